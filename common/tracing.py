"""OpenTelemetry tracing of requests across the router and the nodes, off by default.

`--otlp-traces-endpoint URL` turns it on for one process: its spans go to that OTLP/HTTP
collector (`.../v1/traces`), sampled at `--trace-sample-ratio` where a trace starts (the router;
a node follows its parent's decision). The router decides before it makes anything
(`Tracer.sampled`): a request left out of the sample costs one random number, no span object
and no attribute. The SDK is the `tracing` extra and is imported only
then: with the flag absent a process imports nothing of it and makes no span object, and every
caller holds `None` in place of a `Tracer`.

A request's context travels as its W3C `traceparent` string in the control messages (Prefill,
ReserveKV). Stage spans are written when a stage ends, from the times the process took on its
own monotonic clock (`Tracer.span`): a stage is never timed across two processes' clocks.
Attribute names are vLLM's (`vllm/tracing.py`: `gen_ai.*`) where it has one, `pdserve.*`
otherwise; no attribute carries prompt or output text.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.common.options import option

TRACING = "tracing"
EXTRA = "tracing"  # pip install 'pdserve[tracing]'

# vLLM's span attribute names (its SpanAttributes), for the values pdserve has too.
REQUEST_ID = "gen_ai.request.id"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
RESPONSE_MODEL = "gen_ai.response.model"
TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
E2E = "gen_ai.latency.e2e"
TIME_IN_PREFILL = "gen_ai.latency.time_in_model_prefill"

Attributes = Mapping[str, str | bool | int | float | list[str] | list[int]]


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """Where one process sends its spans, and how many traces it starts are kept."""

    otlp_traces_endpoint: str | None = option(
        None,
        TRACING,
        "send OpenTelemetry spans of every request to this OTLP/HTTP endpoint, e.g. "
        "http://127.0.0.1:4318/v1/traces (needs the `tracing` extra; default: off)",
        type=str,
        metavar="URL",
    )
    trace_sample_ratio: float = option(
        1.0,
        TRACING,
        "fraction of the traces this process starts that are recorded (a trace continued "
        "from a parent follows the parent's choice)",
        metavar="R",
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise ValueError(f"trace sample ratio must be in [0, 1], got {self.trace_sample_ratio}")
        url = self.otlp_traces_endpoint
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"the OTLP traces endpoint must be an http(s) URL, got {url!r}")


def tracer_of(service: str, config: TracingConfig) -> Tracer | None:
    """This process's tracer, or None when tracing is off (nothing of the SDK imported)."""
    if config.otlp_traces_endpoint is None:
        return None
    return Tracer(service, config.otlp_traces_endpoint, config.trace_sample_ratio)


class Tracer:
    """One process's spans, exported in batches to the OTLP endpoint. `span` writes a finished
    stage; `start` opens a span that ends later (the router's request span)."""

    def __init__(self, service: str, endpoint: str, ratio: float) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise RuntimeError(
                f"--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporter: "
                f"pip install 'pdserve[{EXTRA}]' ({exc})"
            ) from None
        from opentelemetry import trace

        # The ratio is applied by `sampled`, before any span exists; the SDK records what it is
        # handed unless the parent's flags say the trace is left out.
        sampler = ParentBased(ALWAYS_ON)
        self._ratio = ratio
        self._random = random.Random()
        resource = Resource.create({"service.name": f"pdserve-{service}"})
        self._provider = TracerProvider(sampler=sampler, resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("pdserve")
        self._propagator = TraceContextTextMapPropagator()
        self._trace = trace
        # Spans carry epoch times; stages are taken on the monotonic clock (one process's
        # offset between the two, read once: a stage never spans two processes).
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    def sampled(self, parent: str | None) -> bool:
        """Whether a trace that continues `parent` (a valid traceparent) or starts here (None)
        is recorded: the parent's sampled flag, else a draw at the sample ratio."""
        if parent is not None:
            return bool(int(parent[-2:], 16) & 1)
        return self._random.random() < self._ratio

    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._offset_ns

    def _context(self, parent: Any) -> Any:
        """A context from a traceparent string, a span of this tracer, or None (a root)."""
        if parent is None:
            return None
        if isinstance(parent, str):
            return self._propagator.extract({"traceparent": parent})
        return self._trace.set_span_in_context(parent)

    def start(self, name: str, parent: Any, start: float, attributes: Attributes) -> Any:
        """A span open from `start` (monotonic s) under `parent`; end it with `end`."""
        kind = self._trace.SpanKind.SERVER
        return self._tracer.start_span(
            name, self._context(parent), kind, attributes, start_time=self._ns(start)
        )

    def end(self, span: Any, end: float, attributes: Attributes | None = None) -> None:
        if attributes:
            span.set_attributes(attributes)
        span.end(end_time=self._ns(end))

    def span(self, name: str, parent: Any, start: float, end: float, attributes: Attributes) -> Any:
        """A finished span from `start` to `end` (monotonic s) under `parent` (a traceparent
        or a span): the span, to parent others under it."""
        span = self._tracer.start_span(
            name, self._context(parent), attributes=attributes, start_time=self._ns(start)
        )
        span.end(end_time=self._ns(end))
        return span

    def traceparent(self, span: Any) -> str | None:
        """The W3C traceparent that continues under `span`, or None when the span is not
        sampled (its children would not be recorded either: nodes are told nothing)."""
        if not span.get_span_context().trace_flags.sampled:
            return None
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, self._trace.set_span_in_context(span))
        return carrier.get("traceparent")

    def close(self) -> None:
        """Export what is still batched (a process that stops loses no span)."""
        self._provider.shutdown()
