"""The planner's measurements in `pdserve serve` and on Kubernetes: each interval `RouterSource`
reads every router's /metrics and /internal/load (`Reading`), and `Measurer` turns the change
since the previous reading into a `Snapshot` (the simulator builds its own).

What is measured where: arrivals are the generation requests that finished plus the change of
those in flight; prompt and answer tokens per arrival are the router's token counters over the
arrivals; the queue is the prompt tokens waiting on the nodes; KV usage the mean of the decode
nodes' (heartbeats); TTFT and ITL p90 from the change of the router's histograms, and the
TTFT's shares spent waiting for a prefill or a decode node from the change of its per-stage sums.
A decode node's rate within the ITL SLO is its answer tokens per busy second (the decode nodes'
`busy_seconds`, seconds in steps that ran work, from their heartbeats), times the ITL SLO over
the p90 ITL (the headroom left; 1 where no answer had a second token). Tokens per wall second
understate a node that idles between requests: at half load it looked half as fast. Where a
node reports no busy time (an older node) or is new since the last reading, the tokens per
wall second per decode node stand in.

The prefill rate is the best that any node measured computing prompts inside the deployment
(the nodes' heartbeats) over the last `horizon` seconds, counting only rates that moved since
the previous reading. Not the mean of the prefill nodes': a node's rate falls while it shares
its cores with other nodes and while it warms up, and a rate stays where it was while the node
computes nothing (the router prefills on the decode node at low load): a pool sized by the
mean of those keeps nodes it does not need (3 -> 2 instead of 3 -> 1 in the planner's real
run on two shared cores). The best recent rate is what one node does unhindered, which is what
the survivors of a shrink will do. A decode node's rate counts: the same engine computes the
prompts it prefills itself.
"""

from __future__ import annotations

import json
import logging
import math
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from pdserve.planner.snapshot import DECODE, NodeView, Snapshot, TtftShares

log = logging.getLogger(__name__)

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
TTFT, ITL = "pdserve:time_to_first_token_seconds", "pdserve:inter_token_latency_seconds"
STAGES = "pdserve:ttft_stage_seconds"
# The TTFT stages (router/cluster/timing.py) spent waiting for a node of each role.
PREFILL_WAIT = ("router_queue", "node_inbox", "prefill_queue")
DECODE_WAIT = ("decode_reservation",)
Buckets = tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """One node as its last heartbeat to a router told it."""

    node_id: str
    role: str
    draining: bool
    kv_usage: float
    queued_tokens: int
    prefill_rate: float  # 0: none measured yet
    busy_seconds: float = 0.0  # in its steps that ran work since it started (0: not reported)


@dataclass(frozen=True, slots=True)
class Reading:
    """Every router's counters, summed, at `at` (the planner's clock), and every node's load
    (from the first router that answered: every node registers with each router)."""

    at: float
    finished: float  # generation requests answered
    in_flight: float
    prompt_tokens: float
    answer_tokens: float
    ttft: Buckets
    itl: Buckets
    nodes: tuple[NodeLoad, ...]
    stages: tuple[tuple[str, float], ...] = ()  # (TTFT stage, its seconds' sum), every stage


def node_load(node_id: str, fields: dict) -> NodeLoad:
    """A node of the router's /internal/load answer."""
    usable = max(1, fields["num_blocks"] - 1)  # the null block is never free
    usage = max(0.0, 1.0 - fields["free_blocks"] / usable)
    return NodeLoad(node_id, fields["role"], fields["draining"], usage, fields["queued_tokens"],
                    fields["prefill_rate"], fields.get("busy_seconds", 0.0))  # fmt: skip


def reading_of(at: float, expositions: Iterable[str], nodes: tuple[NodeLoad, ...]) -> Reading:
    """A Reading of the routers' /metrics texts (Prometheus exposition format), summed."""
    sums: dict[tuple[str, str, str], float] = {}
    for text in expositions:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "pdserve_router_requests_total":
                    if s.labels.get("route") not in GENERATION_ROUTES:
                        continue
                key = (s.name, s.labels.get("le", ""), s.labels.get("stage", ""))
                sums[key] = sums.get(key, 0.0) + s.value
    total = lambda name: sums.get((name, "", ""), 0.0)  # noqa: E731
    stages = tuple((st, v) for (n, _, st), v in sorted(sums.items()) if n == STAGES + "_sum")
    return Reading(
        at,
        total("pdserve_router_requests_total"),
        total("pdserve_router_requests_in_flight"),
        total("pdserve_router_prompt_tokens_total"),
        total("pdserve_router_generation_tokens_total"),
        _buckets(sums, TTFT),
        _buckets(sums, ITL),
        nodes,
        stages,
    )


def _buckets(sums: dict[tuple[str, str, str], float], family: str) -> Buckets:
    name = family + "_bucket"
    found = [(float(le), v) for (n, le, _), v in sums.items() if n == name]
    return tuple(sorted(found))


def shares_of(
    now: tuple[tuple[str, float], ...], before: tuple[tuple[str, float], ...]
) -> TtftShares | None:
    """The TTFT's shares spent waiting for each role between two readings of the stage sums
    (None: no request's stages came in)."""
    old = dict(before)
    grown = {stage: _grown(v, old.get(stage, 0.0)) for stage, v in now}
    total = sum(grown.values())
    if total <= 0:
        return None
    share = lambda names: sum(grown.get(n, 0.0) for n in names) / total  # noqa: E731
    return TtftShares(share(PREFILL_WAIT), share(DECODE_WAIT))


def p90_of(now: Buckets, before: Buckets) -> float | None:
    """The p90 of the observations between two readings of one histogram (linear within its
    bucket, as Prometheus' histogram_quantile); None when there was none."""
    if not now:
        return None
    counts = dict(before)
    grown = [(le, c - counts.get(le, 0.0)) for le, c in now]
    if grown[-1][1] < 0:  # the router restarted: its histogram started over
        grown = list(now)
    total = grown[-1][1]
    if total <= 0:
        return None
    rank, low, below = 0.9 * total, 0.0, 0.0
    for le, count in grown:
        if count >= rank:
            if math.isinf(le):
                return low  # past the last finite bound: the bound is what is known
            return low + (le - low) * (rank - below) / max(count - below, 1e-9)
        low, below = le, count
    return None


def _grown(now: float, before: float) -> float:
    """A counter's growth; a counter below its last value started over (a router restart)."""
    return now - before if now >= before else now


class Measurer:
    """Readings in, Snapshots out: the change since the previous reading, and the last rate
    measured where an interval measured none (prefill and decode rates); the prefill rate the
    best of the last `horizon` seconds (the module's docstring says why)."""

    def __init__(self, itl_slo: float, horizon: float) -> None:
        self.itl_slo = itl_slo
        self.horizon = horizon
        self._last: Reading | None = None
        self._prefill_rate: float | None = None
        self._decode_rate: float | None = None
        self._reported: dict[str, float] = {}  # node id -> the prefill rate it last reported
        self._busy: dict[str, float] = {}  # node id -> its busy seconds at the last reading
        self._rates: deque[tuple[float, float]] = deque()  # (at, a rate that moved)

    def snapshot(
        self, reading: Reading | None, now: float, nodes: tuple[NodeView, ...]
    ) -> Snapshot:
        """The figures since the previous reading; NaN where there is no reading or no
        previous one (the policy then makes no decision)."""
        before, self._last = self._last, reading
        busy = None
        if reading is not None:
            self._measure_prefill(reading.at, reading.nodes)
            busy = self._decode_busy(reading.nodes)
        if reading is None or before is None or reading.at <= before.at:
            nan = math.nan
            return Snapshot(now, nan, nan, nan, nan, nan, None, None, None, None, nodes)
        seconds = reading.at - before.at
        arrived = max(0.0, _grown(reading.finished, before.finished) + reading.in_flight
                      - before.in_flight)  # fmt: skip
        answers = _grown(reading.answer_tokens, before.answer_tokens)
        per = lambda tokens: tokens / arrived if arrived else 0.0  # noqa: E731
        itl = p90_of(reading.itl, before.itl)
        return Snapshot(
            reading.at,
            arrived / seconds,
            per(_grown(reading.prompt_tokens, before.prompt_tokens)),
            per(answers),
            float(sum(n.queued_tokens for n in reading.nodes)),
            _mean([n.kv_usage for n in reading.nodes if n.role == DECODE and not n.draining]),
            self._prefill_rate,
            self._measure_decode(reading.nodes, answers / (busy or seconds), busy is None, itl),
            p90_of(reading.ttft, before.ttft),
            itl,
            nodes,
            shares_of(reading.stages, before.stages),
        )

    def _measure_prefill(self, at: float, nodes: tuple[NodeLoad, ...]) -> None:
        for n in nodes:
            if n.prefill_rate > 0 and self._reported.get(n.node_id) != n.prefill_rate:
                self._rates.append((at, n.prefill_rate))
            self._reported[n.node_id] = n.prefill_rate
        while self._rates and self._rates[0][0] < at - self.horizon:
            self._rates.popleft()
        if self._rates:  # else the last best stands: nothing was computed since
            self._prefill_rate = max(rate for _, rate in self._rates)

    def _decode_busy(self, nodes: tuple[NodeLoad, ...]) -> float | None:
        """The decode nodes' busy seconds since the previous reading; None where a node's is
        not known (not reported, or the node is new since)."""
        decoding = [n for n in nodes if n.role == DECODE and not n.draining]
        known = all(n.busy_seconds > 0 and n.node_id in self._busy for n in decoding)
        busy = sum(_grown(n.busy_seconds, self._busy.get(n.node_id, 0.0)) for n in decoding)
        self._busy = {n.node_id: n.busy_seconds for n in nodes}
        return busy if known and busy > 0 else None

    def _measure_decode(
        self, nodes: tuple[NodeLoad, ...], answers_per_s: float, per_wall_s: bool,
        itl: float | None,
    ) -> float | None:  # fmt: skip
        """Answer tokens per busy second of the decode nodes (`per_wall_s`: their busy time
        is not known; per wall second and node), times the ITL headroom."""
        decoding = sum(n.role == DECODE and not n.draining for n in nodes)
        if answers_per_s > 0 and decoding:
            headroom = self.itl_slo / itl if itl else 1.0  # no ITL: one-token answers only
            per_node = answers_per_s / decoding if per_wall_s else answers_per_s
            self._decode_rate = per_node * headroom
        return self._decode_rate


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class RouterSource:
    """Reads the routers over HTTP (their API key, if any, as a bearer token); a router that
    does not answer within `timeout` is left out of the reading, and with none: None."""

    def __init__(
        self,
        urls: list[str],
        api_key: str | None = None,
        timeout: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not urls:
            raise ValueError("the planner needs at least one router URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.clock = clock

    def read(self) -> Reading | None:
        texts, nodes = [], None
        for url in self.urls:
            try:
                texts.append(self._get(url + "/metrics").decode())
                if nodes is None:
                    answer = json.loads(self._get(url + "/internal/load"))
                    nodes = tuple(node_load(i, f) for i, f in sorted(answer.items()))
            except (OSError, ValueError, KeyError) as exc:  # URLError is an OSError
                log.warning("planner: no reading from %s: %s", url, exc)
        return None if nodes is None else reading_of(self.clock(), texts, nodes)

    def _get(self, url: str) -> bytes:
        request = urllib.request.Request(url, headers=self.headers)
        with urllib.request.urlopen(request, timeout=self.timeout) as resp:
            return resp.read()
