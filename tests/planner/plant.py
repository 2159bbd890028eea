"""A steady deployment for the policy's tests: snapshots whose figures follow the node counts
the planner asked for (KV usage spread over the decode nodes, a queue that grows when prefill
falls short), and naive policies that repeat the peers' mistakes (issue 41), each of which a
test must catch."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pdserve.planner.config import PlannerConfig
from pdserve.planner.policy import Decision, Need, Policy, Pools
from pdserve.planner.snapshot import DECODE, PREFILL, NodeView, Snapshot

PREFILL_RATE = 8000.0  # prompt tokens per second one prefill node computes
DECODE_RATE = 600.0  # answer tokens per second one decode node sustains within the ITL SLO
KV_TOKENS = 500_000  # one decode node's KV
CONFIG = PlannerConfig()


@dataclass(frozen=True, slots=True)
class Load:
    """A constant load: requests per second, prompt and answer tokens, and the queue now."""

    arrival: float
    prompt: float
    output: float = 256.0
    queued: float = 0.0


def nodes(prefill: int, decode: int, ready: bool = True, at: float = 0.0) -> tuple[NodeView, ...]:
    pool = [NodeView(f"p{i}", PREFILL, ready, at) for i in range(prefill)]
    return tuple(pool + [NodeView(f"d{i}", DECODE, ready, at) for i in range(decode)])


def snapshot(load: Load, view: tuple[NodeView, ...], when: float, **given: object) -> Snapshot:
    """The load's figures as the router would measure them on these nodes."""
    ready_decode = sum(n.role == DECODE and n.ready for n in view)
    running = load.arrival * load.output * CONFIG.itl_slo  # sequences decoding at once
    kv = running * (load.prompt + load.output / 2) / (KV_TOKENS * max(ready_decode, 1))
    snap = Snapshot(
        when, load.arrival, load.prompt, load.output, load.queued, min(kv, 1.0),
        PREFILL_RATE, DECODE_RATE, 0.5, 0.03, view,
    )  # fmt: skip
    return replace(snap, **given)  # type: ignore[arg-type]


def counts(view: tuple[NodeView, ...]) -> tuple[int, int]:
    return sum(n.role == PREFILL for n in view), sum(n.role == DECODE for n in view)


def run(policy: Policy, loads: list[Load], start: tuple[int, int]) -> list[tuple[int, int]]:
    """One decision per interval on a steady load each; a decision's counts take effect at
    once (all nodes ready). The prefill queue grows by what the pool could not compute."""
    view, out, queued = nodes(*start), [], 0.0
    for i, load in enumerate(loads):
        now = i * CONFIG.interval
        p, _ = counts(view)
        demand = load.arrival * load.prompt * CONFIG.interval + queued
        queued = max(0.0, demand - p * PREFILL_RATE * CONFIG.interval) + load.queued
        decision = policy.decide(snapshot(replace(load, queued=queued), view, now), now)
        if decision.decided:
            view = nodes(decision.prefill, decision.decode)  # type: ignore[arg-type]
        out.append(counts(view))
    return out


class QueueBlind(Policy):
    """Sizes prefill by the arrivals' tokens alone (Dynamo #10528: blind to queue wait)."""

    def prefill_need(self, snap: Snapshot) -> Need | str:
        return super().prefill_need(replace(snap, queued_prompt_tokens=0.0, ttft_p90=None))


class NoHysteresis(Policy):
    """Shrinks as soon as the survivors fit at the growth threshold, on one interval's
    figures (Dynamo #9294)."""

    def _utils(self) -> tuple[float, float]:
        return self.config.util_high, self.config.util_high

    def _smoothed(self, snap: Snapshot) -> Snapshot:
        return snap

    def _stabilized(self, now: float, current: tuple[int, int], p: int, d: int) -> tuple[int, int]:
        return p, d


class NeedsSamples(Policy):
    """Makes no decision without a measured rate, idle or not (Dynamo #11624, #6985)."""

    def _unusable(self, snap: Snapshot, now: float) -> str | None:
        if snap.prefill_rate is None or snap.decode_rate is None:
            return "no samples"
        return super()._unusable(snap, now)


class NaNBlind(Policy):
    """Reads whatever it is given, NaN included."""

    def _unusable(self, snap: Snapshot, now: float) -> str | None:
        return None


class WaitsForReady(Policy):
    """Decides only when every node it asked for is ready (a stalled planner)."""

    def decide(self, snap: Snapshot, now: float) -> Decision:
        if not all(n.ready for n in snap.nodes):
            pools = Pools(0, 0, 0, ())
            return Decision(now, None, None, ("waiting for readiness",), (0, 0), pools.stop)
        return super().decide(snap, now)


class RequestRate(Policy):
    """Sizes prefill by requests per second at a per-node request rate learned once (llm-d's
    wrong constant): the ratio stays what the first prompts made it."""

    learned: float | None = None

    def prefill_need(self, snap: Snapshot) -> Need | str:
        self.learned = self.learned or PREFILL_RATE / snap.mean_prompt_tokens
        grow = math.ceil(snap.arrival_rate / (self.learned * self.config.util_high))
        return Need(grow, math.ceil(snap.arrival_rate / (self.learned * self.config.util_low)), "")


class StageBlind(Policy):
    """Grows prefill on any TTFT breach with prompts waiting, whatever the TTFT was spent
    waiting for (Dynamo's planner before per-stage times: 99% of TTFT opaque)."""

    def _guard_ttft(
        self, snap: Snapshot, current: tuple[int, int], p: int, d: int
    ) -> tuple[int, int]:
        return super()._guard_ttft(replace(snap, ttft_shares=None), current, p, d)


class ColdStartBlind(Policy):
    """Grows prefill on the queue and the TTFT while the nodes it started are still cold: the
    queue they are on their way to drain asks for more (Dynamo #12430's over-scaling)."""

    def prefill_need(self, snap: Snapshot) -> Need | str:
        need = super().prefill_need(snap)
        return need if isinstance(need, str) else replace(need, flow=None)


class QueueTwice(Policy):
    """Sizes prefill for a queue by llm-d's rule alone once the nodes started for it serve:
    the queue they came up to asks for more nodes again, which come up after it drained."""

    def _cold(self, snap: Snapshot, pools: Pools, p: int, flow: int) -> int:
        return max(pools.prefill, flow) if pools.starting_prefill else p
