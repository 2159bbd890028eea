"""The planner's measurements in `pdserve serve` and on Kubernetes: each interval `RouterSource`
reads every router's /metrics and /internal/load (`Reading`), and `Measurer` turns the change
since the previous reading into a `Snapshot` (the simulator builds its own).

What is measured where: arrivals are the generation requests that finished plus the change of
those in flight; prompt and answer tokens per arrival are the router's token counters over the
arrivals; the queue is the prompt tokens waiting on the nodes; KV usage the mean of the decode
nodes' (heartbeats); the prefill rate the mean of what the prefill nodes measured computing
prompts inside the P/D deployment; TTFT and ITL p90 from the change of the router's histograms.
A decode node's rate within the ITL SLO is not measured directly: it is the answer tokens per
second per decode node now, times the ITL SLO over the p90 ITL (the headroom left; 1 where no
answer had a second token).
"""

from __future__ import annotations

import json
import logging
import math
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from pdserve.planner.snapshot import DECODE, PREFILL, NodeView, Snapshot

log = logging.getLogger(__name__)

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
TTFT, ITL = "pdserve:time_to_first_token_seconds", "pdserve:inter_token_latency_seconds"
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


def node_load(node_id: str, fields: dict) -> NodeLoad:
    """A node of the router's /internal/load answer."""
    usable = max(1, fields["num_blocks"] - 1)  # the null block is never free
    usage = max(0.0, 1.0 - fields["free_blocks"] / usable)
    return NodeLoad(node_id, fields["role"], fields["draining"], usage,
                    fields["queued_tokens"], fields["prefill_rate"])  # fmt: skip


def reading_of(at: float, expositions: Iterable[str], nodes: tuple[NodeLoad, ...]) -> Reading:
    """A Reading of the routers' /metrics texts (Prometheus exposition format), summed."""
    sums: dict[tuple[str, str], float] = {}
    for text in expositions:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "pdserve_router_requests_total":
                    if s.labels.get("route") not in GENERATION_ROUTES:
                        continue
                key = (s.name, s.labels.get("le", ""))
                sums[key] = sums.get(key, 0.0) + s.value
    total = lambda name: sums.get((name, ""), 0.0)  # noqa: E731
    return Reading(
        at,
        total("pdserve_router_requests_total"),
        total("pdserve_router_requests_in_flight"),
        total("pdserve_router_prompt_tokens_total"),
        total("pdserve_router_generation_tokens_total"),
        _buckets(sums, TTFT),
        _buckets(sums, ITL),
        nodes,
    )


def _buckets(sums: dict[tuple[str, str], float], family: str) -> Buckets:
    name = family + "_bucket"
    found = [(float(le), v) for (n, le), v in sums.items() if n == name]
    return tuple(sorted(found))


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
    measured where an interval measured none (prefill and decode rates)."""

    def __init__(self, itl_slo: float) -> None:
        self.itl_slo = itl_slo
        self._last: Reading | None = None
        self._prefill_rate: float | None = None
        self._decode_rate: float | None = None

    def snapshot(
        self, reading: Reading | None, now: float, nodes: tuple[NodeView, ...]
    ) -> Snapshot:
        """The figures since the previous reading; NaN where there is no reading or no
        previous one (the policy then makes no decision)."""
        before, self._last = self._last, reading
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
            self._measure_prefill(reading.nodes),
            self._measure_decode(reading.nodes, answers / seconds, itl),
            p90_of(reading.ttft, before.ttft),
            itl,
            nodes,
        )

    def _measure_prefill(self, nodes: tuple[NodeLoad, ...]) -> float | None:
        rates = [n.prefill_rate for n in nodes if n.role == PREFILL and n.prefill_rate > 0]
        if rates:
            self._prefill_rate = _mean(rates)
        return self._prefill_rate

    def _measure_decode(
        self, nodes: tuple[NodeLoad, ...], answers_per_s: float, itl: float | None
    ) -> float | None:
        decoding = sum(n.role == DECODE and not n.draining for n in nodes)
        if answers_per_s > 0 and decoding:
            headroom = self.itl_slo / itl if itl else 1.0  # no ITL: one-token answers only
            self._decode_rate = answers_per_s / decoding * headroom
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
