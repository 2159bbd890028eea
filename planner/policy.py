"""`Policy.decide`: one `Snapshot` in, one `Decision` (prefill and decode node counts, with the
reasons) out. The same object runs in the simulator and in `pdserve serve`.

What it takes from the peers' failures (issue 41): prefill is sized by the prompt tokens to
compute, the queue's included, so queue wait alone grows it (Dynamo sized by request rate and
was blind to the queue); a pool shrinks only to a size whose survivors take the whole load under
`util_low` (Dynamo's 2 <-> 1 oscillation came from N-1 survivors taking N/(N-1) of the load); an
idle deployment needs no measured rate to shrink (Dynamo never scaled down without samples);
missing, stale or NaN demand makes no decision; a node that never becomes ready is stopped after
`start_timeout` and counted no more, and no decision waits for readiness; while prefill nodes
are still starting, the queue and the TTFT they are on their way to relieve ask for no more
(Dynamo over-scaled on cold-start samples, #12430): the pool grows then only for the arrivals.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from pdserve.planner.config import PlannerConfig
from pdserve.planner.snapshot import DECODE, PREFILL, NodeView, Snapshot, measured


@dataclass(frozen=True, slots=True)
class Decision:
    """The node counts the planner asks for (both None: no decision), why, the nodes to stop
    because they never became ready, and the snapshot it was made from (logged with it)."""

    at: float
    prefill: int | None
    decode: int | None
    reasons: tuple[str, ...]
    current: tuple[int, int]
    stop: tuple[str, ...] = ()
    inputs: Snapshot | None = None

    @property
    def decided(self) -> bool:
        return self.prefill is not None and self.decode is not None

    def describe(self) -> str:
        """One log line: the counts (from -> to), the reasons, the nodes to stop."""
        head = f"planner at {self.at:.1f}:"
        stop = f"; stop {', '.join(self.stop)} (never ready)" if self.stop else ""
        if not self.decided:
            return f"{head} no decision: {'; '.join(self.reasons)}{stop}"
        (p, d), why = self.current, "; ".join(self.reasons)
        return f"{head} prefill {p}->{self.prefill}, decode {d}->{self.decode}: {why}{stop}"


@dataclass(frozen=True, slots=True)
class Need:
    """A pool's size for its load: `grow` nodes at `util_high`, `keep` nodes whose survivors
    stay under `util_low` (keep >= grow; between them the pool holds still)."""

    grow: int
    keep: int
    why: str
    flow: int | None = None  # grow for the arrivals alone (None: the same as grow)


@dataclass(frozen=True, slots=True)
class Pools:
    """The nodes a decision counts: ready or still starting within the timeout, not draining."""

    prefill: int
    decode: int
    ready_decode: int
    stop: tuple[str, ...]
    starting_prefill: int = 0


def pools_of(nodes: tuple[NodeView, ...], now: float, start_timeout: float) -> Pools:
    late = tuple(n.node_id for n in nodes if not n.ready and now - n.started_at > start_timeout)
    live = [n for n in nodes if not n.draining and n.node_id not in late]
    count = lambda role: sum(n.role == role for n in live)
    ready_decode = sum(n.role == DECODE and n.ready for n in live)
    starting = sum(n.role == PREFILL and not n.ready for n in live)
    return Pools(count(PREFILL), count(DECODE), ready_decode, late, starting)


def _nodes_for(load: float, per_node: float, share: float) -> int:
    return math.ceil(load / (per_node * share) - 1e-9) if load > 0 else 0


class Policy:
    """Decides every interval; remembers the targets of the last `window` seconds (a pool
    shrinks only to the largest of them) and nothing else."""

    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self._targets: deque[tuple[float, int, int]] = deque()
        self._idle = 0  # decisions in a row made on an idle snapshot
        self._rates: tuple[float, float, float, float] | None = None  # (at, req, prompt, answer)/s

    def decide(self, snap: Snapshot, now: float) -> Decision:
        pools = pools_of(snap.nodes, now, self.config.start_timeout)
        current = (pools.prefill, pools.decode)
        problem = self._unusable(snap, now)
        snap = snap if problem else self._smoothed(snap)
        p_need: Need | str = problem or self.prefill_need(snap)
        d_need: Need | str = problem or self.decode_need(snap, pools)
        if isinstance(p_need, str) or isinstance(d_need, str):
            why = problem or "; ".join(n for n in (p_need, d_need) if isinstance(n, str))
            return Decision(now, None, None, (why,), current, pools.stop, snap)
        p, d = _target(pools.prefill, p_need), _target(pools.decode, d_need)
        p, d = self._guard_ttft(snap, current, p, d)
        d = self._guard_itl(snap, pools.decode, d)
        if pools.starting_prefill and p > pools.prefill and p_need.flow is not None:
            p = max(pools.prefill, p_need.flow)  # the queue and TTFT wait for those starting
        self._idle = self._idle + 1 if snap.idle() else 0
        p, d = self._paced(current, *self._stabilized(now, current, p, d))
        p, d = self._bounded(p, d)
        reasons = (f"prefill: {p_need.why}", f"decode: {d_need.why}")
        return Decision(now, p, d, reasons, current, pools.stop, snap)

    def _smoothed(self, snap: Snapshot) -> Snapshot:
        """The arrivals as a moving average over about `smoothing` seconds: one interval's
        count of long prompts is noise (Mooncake's 10 s samples swing 2x around the mean);
        a burst the average is slow to see fills the queue, which counts at once."""
        rate = snap.arrival_rate
        raw = (rate * snap.mean_prompt_tokens, rate * snap.mean_output_tokens)
        if self._rates is None or snap.idle() or snap.at <= self._rates[0]:
            self._rates = (snap.at, snap.arrival_rate, *raw)
            return snap
        share = 1 - math.exp(-(snap.at - self._rates[0]) / self.config.smoothing)
        before = self._rates[1:]
        now = [b + share * (x - b) for b, x in zip(before, (snap.arrival_rate, *raw))]
        self._rates = (snap.at, *now)  # type: ignore[assignment]
        n = now[0]
        return replace(snap, arrival_rate=n, mean_prompt_tokens=now[1] / n if n else 0.0,
                       mean_output_tokens=now[2] / n if n else 0.0)  # fmt: skip

    def _unusable(self, snap: Snapshot, now: float) -> str | None:
        if now - snap.at > self.config.max_age:
            return f"measurements are {now - snap.at:.0f} s old (max {self.config.max_age:g})"
        if not all(measured(v) for v in snap.demand()):
            return "a demand figure is missing or NaN"
        return None

    def prefill_need(self, snap: Snapshot) -> Need | str:
        """Nodes for the arrivals' prompt tokens at the measured per-node prefill rate, or for
        draining the queue within the queue's share of the TTFT SLO (llm-d's rule), whichever
        is more. The larger, not the sum: a queue of a few prompts is what a pool busy at
        `util_high` holds anyway, and adding it to the arrivals would size by Poisson noise."""
        arrivals = snap.arrival_rate * snap.mean_prompt_tokens
        if arrivals == 0 and snap.queued_prompt_tokens == 0:
            return Need(0, 0, "no prompt tokens to compute")
        rate = snap.prefill_rate
        if not measured(rate) or not rate:
            return "prefill rate not measured"
        budget = self.config.ttft_slo * self.config.queue_share
        queue = _nodes_for(snap.queued_prompt_tokens / budget, rate, 1.0)
        flow = _nodes_for(arrivals, rate, self.config.util_high)
        grow, keep = (max(queue, _nodes_for(arrivals, rate, u)) for u in self._utils())
        why = f"{arrivals:,.0f} tok/s, queue {snap.queued_prompt_tokens:,.0f} tok, {rate:,.0f}/node"
        return Need(grow, keep, why, flow)

    def decode_need(self, snap: Snapshot, pools: Pools) -> Need | str:
        """Answer tokens per second over what one node sustains within the ITL SLO, and the
        KV in use over `kv_high` of a node (the larger of the two)."""
        load = snap.arrival_rate * snap.mean_output_tokens
        kv = snap.kv_usage * pools.ready_decode
        kv_grow = _nodes_for(kv, 1.0, self.config.kv_high)
        kv_keep = _nodes_for(kv, 1.0, self.config.kv_low)
        why = f"KV {kv:.2f} nodes' worth"
        if load == 0:
            return Need(kv_grow, kv_keep, why)
        rate = snap.decode_rate
        if not measured(rate) or not rate:
            return "decode rate not measured"
        grow, keep = (_nodes_for(load, rate, u) for u in self._utils())
        why += f", {load:,.0f} tok/s at {rate:,.0f}/node"
        return Need(max(grow, kv_grow), max(keep, kv_keep), why)

    def _utils(self) -> tuple[float, float]:
        return self.config.util_high, self.config.util_low

    def _guard_ttft(
        self, snap: Snapshot, current: tuple[int, int], p: int, d: int
    ) -> tuple[int, int]:
        """TTFT over its SLO: one more node at least of the pool it waited for. With the
        stages measured, decode grows when waiting for a decode node's reservation took more
        of the TTFT than waiting for a prefill node, else prefill when that wait took
        `queue_share` of it or more (a TTFT that is mostly the prefill itself grows neither:
        the rate-based sizing covers throughput); without them, prefill grows when prompts
        are waiting."""
        if not (measured(snap.ttft_p90) and snap.ttft_p90 > self.config.ttft_slo):  # type: ignore[operator]
            return p, d
        shares = snap.ttft_shares
        if shares is None:
            grow_p, grow_d = snap.queued_prompt_tokens > 0, False
        else:
            grow_d = shares.decode_wait > shares.prefill_wait
            grow_p = not grow_d and shares.prefill_wait >= self.config.queue_share
        more = lambda grow, now, target: max(target, now + 1) if grow else target  # noqa: E731
        return more(grow_p, current[0], p), more(grow_d, current[1], d)

    def _guard_itl(self, snap: Snapshot, current: int, target: int) -> int:
        """ITL over its SLO: one more decode node at least."""
        late = measured(snap.itl_p90) and snap.itl_p90 > self.config.itl_slo  # type: ignore[operator]
        return max(target, current + 1) if late else target

    def _stabilized(self, now: float, current: tuple[int, int], p: int, d: int) -> tuple[int, int]:
        """Growth at once; a shrink only to the largest target of the last `window` s, or at
        once on a second idle snapshot in a row (an idle deployment has no load to protect;
        one idle interval may be chance)."""
        if self._idle >= 2:
            self._targets.clear()
        self._targets.append((now, p, d))
        while self._targets[0][0] < now - self.config.window:
            self._targets.popleft()
        top_p = max(t[1] for t in self._targets)
        top_d = max(t[2] for t in self._targets)
        return _hold(current[0], p, top_p), _hold(current[1], d, top_d)

    @staticmethod
    def _paced(current: tuple[int, int], p: int, d: int) -> tuple[int, int]:
        """A pool at most doubles, or grows by 4, per decision (Kubernetes' HPA default): a
        queue measured at one instant asks for nodes that start too late to drain it."""
        return tuple(min(t, max(2 * c, c + 4)) for c, t in zip(current, (p, d)))  # type: ignore[return-value]

    def _bounded(self, p: int, d: int) -> tuple[int, int]:
        c = self.config
        p = min(max(p, c.min_prefill), c.max_prefill)
        d = min(max(d, c.min_decode), c.max_decode)
        if p + d <= c.max_nodes:
            return p, d
        p = max(c.min_prefill, min(round(c.max_nodes * p / (p + d)), c.max_nodes - c.min_decode))
        return p, c.max_nodes - p


def _target(current: int, need: Need) -> int:
    return need.grow if need.grow > current else min(current, need.keep)


def _hold(current: int, target: int, top: int) -> int:
    return target if target >= current else min(current, max(target, top))
