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
        self._draining = False  # prefill grew, and its queue has not been drained since
        # When last smoothed, and the arrivals (requests, prompt, answer tokens per second)
        # averaged over the burst time and over the trend's.
        self._rates: tuple[float, Rates, Rates] | None = None

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
        if p > pools.prefill and p_need.flow is not None:
            p = self._cold(snap, pools, p, p_need.flow)
        self._idle = self._idle + 1 if snap.idle() else 0
        p, d = self._paced(current, *self._stabilized(now, current, p, d))
        p, d = self._bounded(p, d)
        self._draining = p > current[0] or (self._draining and not self._drained(snap, pools))
        reasons = (f"prefill: {p_need.why}", f"decode: {d_need.why}")
        return Decision(now, p, d, reasons, current, pools.stop, snap)

    def _cold(self, snap: Snapshot, pools: Pools, p: int, flow: int) -> int:
        """Prefill growth while nodes it asked for are cold. While prefill nodes are starting,
        the queue and the TTFT they are on their way to relieve ask for no more: the pool grows
        only for the arrivals. Once they serve, until the queue they grew for is drained within
        its budget, the queue asks only for the nodes to drain, within that budget, what the
        pool (at least the arrivals' nodes) would leave of it `lead` s on, when a node asked
        for now would serve (llm-d's rule otherwise): on Mooncake from 1P1D
        the nodes started for the first minute's queue came up to it whole and asked for 4
        more, which came up when the first 4 had drained it."""
        if pools.starting_prefill:
            return max(pools.prefill, flow)
        if not self._draining:
            return p
        rate, c, pool = snap.prefill_rate or 0.0, self.config, max(pools.prefill, flow)
        arrivals = snap.arrival_rate * snap.mean_prompt_tokens
        left = snap.queued_prompt_tokens + (arrivals - pool * rate) * c.lead
        return max(pool, _nodes_for(left / (c.ttft_slo * c.queue_share), rate, 1.0))

    def _drained(self, snap: Snapshot, pools: Pools) -> bool:
        budget = self.config.ttft_slo * self.config.queue_share
        serving = pools.prefill - pools.starting_prefill
        return snap.queued_prompt_tokens <= serving * (snap.prefill_rate or 0.0) * budget

    def _smoothed(self, snap: Snapshot) -> Snapshot:
        """The arrivals as a moving average over the burst time (`smoothing`, at least
        `burst_slos` TTFT SLOs), plus their rise per second, read off a slower average over
        `trend` s, times `lead` s. A burst shorter than a few TTFT SLOs is the queue's to
        absorb: it counts at once there (Mooncake's 10 s samples swing 2x around the mean, and
        a pool sized by them ran 4-5 prefill nodes where 3 met a 10 s SLO); a rise is planned
        for by a node's start time, as a node asked for now serves only then (the sinusoid's
        climb from 1x to 8x at a 2 s SLO lost 13% of its requests at 95% utilisation without
        it). An idle snapshot starts the averages over."""
        raw: Rates = (snap.arrival_rate, snap.arrival_rate * snap.mean_prompt_tokens,
                      snap.arrival_rate * snap.mean_output_tokens)  # fmt: skip
        if self._rates is None or snap.idle() or snap.at <= self._rates[0]:
            self._rates = (snap.at, raw, raw)
            return snap
        c, (at, burst, slow) = self.config, self._rates
        seconds = snap.at - at
        burst = _averaged(burst, raw, seconds, max(c.smoothing, c.burst_slos * c.ttft_slo))
        slower = _averaged(slow, raw, seconds, c.trend)
        self._rates = (snap.at, burst, slower)
        n, prompt, answer = (x + max(0.0, y - y0) / seconds * c.lead
                             for x, y, y0 in zip(burst, slower, slow))  # fmt: skip
        return replace(snap, arrival_rate=n, mean_prompt_tokens=prompt / n if n else 0.0,
                       mean_output_tokens=answer / n if n else 0.0)  # fmt: skip

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


Rates = tuple[float, float, float]


def _averaged(before: Rates, now: Rates, seconds: float, over: float) -> Rates:
    """An exponential moving average over about `over` s, `seconds` after `before`."""
    share = 1 - math.exp(-seconds / over)
    return tuple(b + share * (x - b) for b, x in zip(before, now))  # type: ignore[return-value]


def _target(current: int, need: Need) -> int:
    return need.grow if need.grow > current else min(current, need.keep)


def _hold(current: int, target: int, top: int) -> int:
    return target if target >= current else min(current, max(target, top))
