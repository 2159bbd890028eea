"""What the router measures of requests: one backend request's time to its first token taken
apart into stages (RequestTiming), the same stages as spans of its trace (RequestTrace), and the
Prometheus metrics they and every request's latencies are observed into (RouterMetrics, with
the backend's gauges read at scrape time).

Each stage is a duration on one process's monotonic clock: the router's own (the HTTP request's
way in, its queue, the decode reservation's round trips, the first token's way out), the
computing node's (its queue, the prefill), the decode node's (the KV transfer, its admission,
its first step); the nodes send theirs with the first token they compute (`Tokens.stages`).
No two instants of different clocks are compared.

The router's TTFT runs from its first stamp of the HTTP request to the write of the chunk that
carries the first token, so the stages add up to what a streaming client measures, less the
bytes' way over the socket and the router process's wait for a CPU before it reads them.
`router_ingress` is the first stamp (the outermost ASGI middleware's first line,
router/middleware.py `Entered`) to the handler's first; it holds uvicorn's task start and
the loop's other work before the handler runs. `router_egress` is the router's reading of the
first token to the return of the server's `send` of its chunk (the chunk's making, the loop's
other work, the stream task's start, the socket write). An answer that is not streamed is
written whole at its end: its `router_egress` is 0, and its TTFT ends at the router's reading.

`node_inbox` is the router's dispatch -> first token less the computing node's taken -> first
token: two durations, each on one clock. It is the prompt's wait unread in the node's control
socket (a node reads its messages between engine steps, so a prompt that comes during a step
waits for its end: 1.4 s at 8 requests at once on the loaded 2-core box, against 1-13 ms for
the messages' way there and back), and the messages' way. With it the TTFT stages add up to
the router's TTFT.

In pdserve the prefill node streams the first token at once; the KV transfer's tail, the decode
node's admission and its first step come after it and delay the second token. They are
reported as the hand-off stages, beside the TTFT stages.

A request's spans at the router: the request span (vLLM's `llm_request`), which continues the
client's traceparent or starts the trace, and under it the router's stages (the request's way
in, its queue, each routing decision, each decode reservation, the first token's way out, each
failover). The nodes' spans hang under the same request span (its traceparent goes in Prefill
and ReserveKV): the decode node's are siblings of the prefill node's, never its children.

With tracing off, or the trace not sampled (decided before any span or attribute is made),
a RequestTrace holds no span and every method returns at once; `on` tells a caller whether an
attribute is worth computing.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.common import tracing as names
from pdserve.common.tracing import Attributes, Tracer
from pdserve.common.wire.messages import Failure, Tokens
from pdserve.common.wire.payloads import SamplingParams, StageTimes

logger = logging.getLogger(__name__)

TTFT_STAGES = (
    "router_ingress",
    "router_queue",
    "decode_reservation",
    "node_inbox",
    "prefill_queue",
    "prefill",
    "router_egress",
)
HANDOFF_STAGES = ("kv_transfer", "decode_admission", "first_decode_step")


@dataclass(slots=True)
class RequestTiming:
    """Router-side stamps of one backend request (monotonic s; 0: not yet) and the nodes' stage
    times. The backend writes it as the request goes; the HTTP layer reads it at the end.
    Stamps after the first token (a failover's new attempt) leave the TTFT stages as they were:
    they are those of the attempt that produced it."""

    arrival: float = field(default_factory=time.monotonic)  # the HTTP handler's first stamp
    entered: float = 0.0  # the router's first stamp of the HTTP request (0: taken as arrival)
    traceparent: str | None = None  # the client's W3C trace context, when it sent one
    reserving: float = 0.0  # seconds spent waiting for decode nodes' reservations
    dispatched: float = 0.0  # the computing node was sent the prompt
    first_token: float = 0.0  # the first token reached the router's request stream
    written: float = 0.0  # its chunk was written to the client (0: not yet, or not streamed)
    computed: StageTimes | None = None  # from the node that computed the prompt
    received: StageTimes | None = None  # from the decode node its KV went to
    cached_tokens: int = 0  # prompt tokens a node had cached (its first message's count)

    def reserved(self, seconds: float) -> None:
        if not self.first_token:
            self.reserving += seconds

    def dispatch(self) -> None:
        if not self.first_token:
            self.dispatched = time.monotonic()

    def wrote(self) -> None:
        """The chunk that carries the first token was written (later calls: nothing)."""
        if self.first_token and not self.written:
            self.written = time.monotonic()

    def note(self, msg: Tokens) -> None:
        """A node's message on its way to the client: its stages, the first token's time."""
        stages = msg.stages
        if stages is not None:
            if stages.kv_transfer or stages.admission or stages.first_step:
                self.received = self.received or stages
            elif not self.first_token:
                self.computed = stages
        if msg.token_ids and not self.first_token:
            self.first_token = time.monotonic()
        self.cached_tokens = max(self.cached_tokens, msg.cached_tokens)

    @property
    def start(self) -> float:
        """Where the TTFT starts: the router's first stamp of the request."""
        return self.entered or self.arrival

    @property
    def ttft(self) -> float:
        """The first stamp to the first token's write (or its reading, until written)."""
        return (self.written or self.first_token) - self.start if self.first_token else 0.0

    def ttft_stages(self) -> dict[str, float] | None:
        """The stages before the first token (None until the computing node's are in)."""
        c = self.computed
        if c is None or not self.dispatched:
            return None
        ingress, router = self.arrival - self.start, self.dispatched - self.arrival
        away = (self.first_token or self.dispatched) - self.dispatched
        inbox = max(0.0, away - c.queue - c.prefill)  # see the module's docstring
        egress = self.written - self.first_token if self.written else 0.0
        queue = router - self.reserving
        values = (ingress, queue, self.reserving, inbox, c.queue, c.prefill, egress)
        return dict(zip(TTFT_STAGES, values, strict=True))

    def handoff_stages(self) -> dict[str, float] | None:
        """The decode node's stages (None: no KV was sent, or not yet)."""
        r = self.received
        if r is None:
            return None
        values = (r.kv_transfer, r.admission, r.first_step)
        return dict(zip(HANDOFF_STAGES, values, strict=True))

    def metrics(self) -> dict[str, object]:
        """What a request that asked for its metrics gets back (`"metrics"`), in seconds."""
        return {
            "time_to_first_token": self.ttft or None,
            "ttft_stages": self.ttft_stages(),
            "handoff_stages": self.handoff_stages(),
        }


def valid_traceparent(header: str | None) -> str | None:
    """An incoming W3C traceparent header as given when well formed, else None (a bad header
    starts a new trace rather than failing the request)."""
    if header is None:
        return None
    parts = header.strip().split("-")
    sizes = (2, 32, 16, 2)
    if len(parts) != 4 or any(len(p) != n for p, n in zip(parts, sizes)):
        return None
    try:
        int("".join(parts), 16)
    except ValueError:
        return None
    if parts[0] == "ff" or set(parts[1]) == {"0"} or set(parts[2]) == {"0"}:
        return None
    return header.strip().lower()


class Traced(Protocol):
    """What a trace reads of a backend request (router/backend.py `GenerateRequest`, which
    holds a RequestTiming: named here by its fields, so this module imports nothing above it)."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt_token_ids(self) -> tuple[int, ...]: ...
    @property
    def sampling(self) -> SamplingParams: ...
    @property
    def timing(self) -> RequestTiming: ...


class RequestTrace:
    """The spans of one backend request (none when `tracer` is None or the trace unsampled)."""

    def __init__(self, tracer: Tracer | None, request: Traced, model: str) -> None:
        self.tracer = tracer
        self.request = request
        self.span: Any = None
        self.traceparent: str | None = None  # what the nodes are sent (None: nothing traced)
        timing, sampling = request.timing, request.sampling
        if tracer is None or not tracer.sampled(timing.traceparent):
            return  # left out: no span object, no attribute built
        attrs = {
            names.REQUEST_ID: request.request_id,
            names.RESPONSE_MODEL: model,
            names.PROMPT_TOKENS: len(request.prompt_token_ids),
            names.MAX_TOKENS: sampling.max_tokens,
            names.TEMPERATURE: sampling.temperature,
            names.TOP_P: sampling.top_p,
        }
        self.span = tracer.start("llm_request", timing.traceparent, timing.start, attrs)
        self.traceparent = tracer.traceparent(self.span)
        self.child("router.ingress", timing.start, {}, timing.arrival)

    @property
    def on(self) -> bool:
        return self.span is not None

    def child(self, name: str, start: float, attributes: Attributes, end: float = 0.0) -> None:
        """A finished span under the request span, from `start` to `end` (default: now)."""
        if self.span is not None:
            assert self.tracer is not None
            end = end or time.monotonic()
            self.tracer.span(name, self.span, start, end, attributes)

    def finish(self, completion_tokens: int, outcome: str) -> None:
        """End the request span with its totals."""
        if self.span is None:
            return
        assert self.tracer is not None
        timing, now = self.request.timing, time.monotonic()
        if timing.written:  # else not streamed, or its stream's write not done by now
            self.child("router.egress", timing.first_token, {}, timing.written)
        attrs: dict[str, Any] = {
            names.COMPLETION_TOKENS: completion_tokens,
            names.E2E: now - timing.start,
            "pdserve.outcome": outcome,
        }
        if timing.ttft:
            attrs[names.TIME_TO_FIRST_TOKEN] = timing.ttft
        for kind, stages in (("ttft", timing.ttft_stages()), ("handoff", timing.handoff_stages())):
            attrs |= {f"pdserve.{kind}.{stage}": v for stage, v in (stages or {}).items()}
        self.tracer.end(self.span, now, attrs)
        self.span = None


class Gauged(Protocol):
    """What the router's metrics read of its backend at scrape time (router/backend.py
    `Backend`: named here by its methods, so this module imports nothing above it)."""

    def stats(self) -> dict[str, float]: ...
    def failovers(self) -> dict[str, int]: ...


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

    def __init__(self, backend: Gauged) -> None:
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
            "Time to first token by stage (TTFT_STAGES), each on one process's clock",
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

    def __init__(self, backend: Gauged) -> None:
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
