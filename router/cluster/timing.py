"""What the router measures of one backend request: its time to its first token taken apart
into stages (RequestTiming), and the same stages as spans of its trace (RequestTrace).

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

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.common import tracing as names
from pdserve.common.tracing import Attributes, Tracer
from pdserve.common.wire.messages import Tokens
from pdserve.common.wire.payloads import SamplingParams, StageTimes

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
        self.tracer.end(self.span, now, attrs)
        self.span = None
