"""One request's spans at the router: the request span (vLLM's `llm_request`), which continues
the client's traceparent or starts the trace, and under it the router's stages (the request's
way in, its queue, each routing decision, each decode reservation, the first token's way out,
each failover). The nodes' spans hang under
the same request span (its traceparent goes in Prefill and ReserveKV): the decode node's are
siblings of the prefill node's, never its children.

With tracing off, or the trace not sampled (decided before any span or attribute is made),
a RequestTrace holds no span and every method returns at once; `on` tells a caller whether an
attribute is worth computing.
"""

from __future__ import annotations

import time
from typing import Any

from pdserve.common import tracing as names
from pdserve.common.tracing import Attributes, Tracer
from pdserve.router.backend import GenerateRequest


class RequestTrace:
    """The spans of one backend request (none when `tracer` is None or the trace unsampled)."""

    def __init__(self, tracer: Tracer | None, request: GenerateRequest, model: str) -> None:
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
        self.tracer.end(self.span, now, attrs)
        self.span = None
