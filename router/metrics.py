"""The router's Prometheus metrics, the backend's gauges among them."""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.common.wire.messages import Failure
from pdserve.router.backend import Backend
from pdserve.router.cluster.timing import RequestTiming

logger = logging.getLogger(__name__)


_SLOW = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_FAST = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# attribute, name, buckets, help
_LATENCIES = (
    ("ttft", "pdserve:time_to_first_token_seconds",
     (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
     "Request arrival to its first generated token"),
    ("itl", "pdserve:inter_token_latency_seconds", _FAST,
     "Time between two token messages of one request (several tokens with speculation)"),
    ("tpot", "pdserve:request_time_per_output_token_seconds", _FAST,
     "A finished request's first to last token over its tokens after the first"),
    ("decode_time", "pdserve:request_decode_time_seconds", _SLOW,
     "A finished request's first token to its last"),
    ("e2e", "pdserve:e2e_request_latency_seconds", _SLOW, "Request arrival to its last token"),
)  # fmt: skip


class RouterMetrics:
    """Prometheus metrics of one app, in the app's own registry (tests build many apps)."""

    ttft: Histogram
    itl: Histogram
    tpot: Histogram
    decode_time: Histogram
    e2e: Histogram

    def __init__(self, backend: Backend) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            "pdserve_router_requests", "HTTP requests", ["route", "status"], registry=reg
        )
        self.prompt_tokens = Counter(
            "pdserve_router_prompt_tokens", "Prompt tokens submitted", registry=reg
        )
        self.generation_tokens = Counter(
            "pdserve_router_generation_tokens", "Tokens generated", registry=reg
        )
        self._latency_histograms(reg)
        stages = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.ttft_stages = Histogram(
            "pdserve:ttft_stage_seconds",
            "Time to first token by stage (router/cluster/timing.py), each on one process's clock",
            ["stage"],
            buckets=stages,
            registry=reg,
        )
        self.handoff_stages = Histogram(
            "pdserve:handoff_stage_seconds",
            "A remote prefill's hand-off to its decode node by stage (after the first token)",
            ["stage"],
            buckets=stages,
            registry=reg,
        )
        self.in_flight = Gauge(
            "pdserve_router_requests_in_flight", "Generation requests being served", registry=reg
        )
        reg.register(_BackendStatsCollector(backend))

    def _latency_histograms(self, reg: CollectorRegistry) -> None:
        """vLLM's per-request latencies (`pdserve:` for `vllm:`), one observation per choice
        (a request of n choices is n requests to vLLM too), as the client sees them."""
        for attr, name, buckets, text in _LATENCIES:
            setattr(self, attr, Histogram(name, text, buckets=buckets, registry=reg))

    def on_tokens(self, clock: TokenClock, count: int) -> None:
        """A choice's token message of `count` tokens reached the router."""
        self.generation_tokens.inc(count)
        if not count:
            return
        now = time.monotonic()
        if clock.first:
            self.itl.observe(now - clock.last)
        else:
            clock.first = now
            self.ttft.observe(now - clock.started)
        clock.last = now
        clock.tokens += count

    def finished(self, clock: TokenClock) -> None:
        """A choice ended well (not with an error): its latencies."""
        if not clock.first:
            return  # no token (a prompt only scored): no latency of a token to report
        self.e2e.observe(time.monotonic() - clock.started)
        decoding = clock.last - clock.first
        self.decode_time.observe(decoding)
        if clock.tokens > 1:
            self.tpot.observe(decoding / (clock.tokens - 1))

    def observe_stages(self, timing: RequestTiming) -> None:
        """A finished request's stages, those it reached."""
        for histogram, stages in (
            (self.ttft_stages, timing.ttft_stages()),
            (self.handoff_stages, timing.handoff_stages()),
        ):
            for stage, seconds in (stages or {}).items():
                histogram.labels(stage).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(slots=True)
class TokenClock:
    """One choice's token times at the router (monotonic s; 0: not yet) and its tokens."""

    started: float  # the HTTP request's arrival
    first: float = 0.0
    last: float = 0.0
    tokens: int = 0


class _BackendStatsCollector:
    """Exports Backend.stats() as gauges, read at scrape time."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def describe(self) -> list[Metric]:
        # Names are only known at scrape time; an empty description keeps the registry from
        # calling collect() (and so the backend) when the collector is registered.
        return []

    def collect(self) -> list[Metric]:
        try:
            stats, by_cause = self._backend.stats(), self._backend.failovers()
        except Exception:  # a broken gauge must not take the other metrics down with it
            logger.exception("backend.stats() or failovers() failed")
            return []
        metrics: list[Metric] = []
        for key, value in sorted(stats.items()):
            name = "pdserve_backend_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            metrics.append(GaugeMetricFamily(name, f"backend gauge {key}", value=float(value)))
        failovers = CounterMetricFamily(
            "pdserve:failovers", "Requests failed over to other nodes, by cause", labels=["cause"]
        )
        for cause, count in sorted(by_cause.items()):
            failovers.add_metric([cause], float(count))
        fenced = CounterMetricFamily(
            "pdserve:tp_fenced_requests",
            "Requests a node fenced when a rank of its tensor-parallel group was lost (moved on "
            'as failovers{cause="tp_broken"})',
            value=float(by_cause.get(Failure.TP_BROKEN.value, 0)),
        )
        return [*metrics, failovers, fenced]
