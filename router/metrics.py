"""The router's Prometheus metrics, the backend's gauges among them."""

from __future__ import annotations

import logging
import re

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from pdserve.router.backend import Backend
from pdserve.router.timing import RequestTiming

logger = logging.getLogger(__name__)


class RouterMetrics:
    """Prometheus metrics of one app, in the app's own registry (tests build many apps)."""

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
        self.ttft = Histogram(
            "pdserve_router_time_to_first_token_seconds",
            "Request arrival to first generated token",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=reg,
        )
        self.e2e = Histogram(
            "pdserve_router_e2e_request_latency_seconds",
            "Request arrival to last token",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=reg,
        )
        stages = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.ttft_stages = Histogram(
            "pdserve:ttft_stage_seconds",
            "Time to first token by stage (router/timing.py), each on one process's clock",
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
            stats = self._backend.stats()
        except Exception:  # a broken gauge must not take the other metrics down with it
            logger.exception("backend.stats() failed")
            return []
        metrics: list[Metric] = []
        for key, value in sorted(stats.items()):
            name = "pdserve_backend_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            metrics.append(GaugeMetricFamily(name, f"backend gauge {key}", value=float(value)))
        return metrics
