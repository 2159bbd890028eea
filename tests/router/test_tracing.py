"""The router's side of a request's stages and spans: RequestTiming stitches the nodes' stage
times with its own (router/cluster/timing.py); the request span's traceparent goes to every node the
request is sent to (prefill and decode alike: siblings under it), and a failover is a span
with its cause (over fake nodes, tests/router/test_failover.py's harness)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pdserve.common.wire.messages import Error, Failure, Prefill, ReserveKV, Tokens
from pdserve.common.wire.payloads import SamplingParams, StageTimes
from pdserve.router.app import create_app
from pdserve.router.backend import GenerateRequest
from pdserve.router.cluster.backend import ClusterBackend
from pdserve.router.cluster.timing import RequestTiming, RequestTrace
from tests.router.fake_backend import FIRST_ORDINARY_ID, FakeBackend, tiny_tokenizer
from tests.router.test_failover import FakeNodes, run, until


def test_the_ttft_stages_are_the_routers_time_and_the_computing_nodes() -> None:
    t = RequestTiming(arrival=100.0, entered=99.9)  # the middleware's stamp, then the handler's
    assert t.ttft_stages() is None and t.handoff_stages() is None
    t.wrote()  # no first token yet: nothing written of it
    assert t.written == 0
    t.reserved(0.25)
    t.dispatched = 101.0  # one second at the router, a quarter of it reserving
    t.note(Tokens("r", (1,), stages=StageTimes(queue=0.5, prefill=2.0)))
    assert t.first_token > 0
    t.first_token = 104.5  # 3.5 s after the dispatch: 1 s of it unread or on the way
    assert t.ttft == pytest.approx(4.6), "until its write, the TTFT ends at the reading"
    t.wrote()
    assert t.written >= t.first_token
    t.written = 104.55  # the chunk's write returned 50 ms after the reading
    assert t.ttft_stages() == pytest.approx(
        {
            "router_ingress": 0.1,
            "router_queue": 0.75,
            "decode_reservation": 0.25,
            "node_inbox": 1.0,
            "prefill_queue": 0.5,
            "prefill": 2.0,
            "router_egress": 0.05,
        }
    )
    assert t.ttft == pytest.approx(4.65), "the first stamp to the first token's write"
    assert sum(t.ttft_stages().values()) == pytest.approx(t.ttft)  # nothing of the TTFT left out
    t.wrote()
    assert t.written == 104.55, "the first write only"
    t.note(Tokens("r", (2,), stages=StageTimes(kv_transfer=3.0, admission=0.1, first_step=0.2)))
    assert t.handoff_stages() == {
        "kv_transfer": 3.0,
        "decode_admission": 0.1,
        "first_decode_step": 0.2,
    }


def test_an_attempt_after_the_first_token_leaves_the_ttft_stages_alone() -> None:
    t = RequestTiming(arrival=0.0)
    t.dispatch()
    first = StageTimes(queue=0.5, prefill=2.0)
    t.note(Tokens("r", (1,), stages=first))
    dispatched, token = t.dispatched, t.first_token
    t.reserved(9.0)  # a resumed attempt, after the client had its first token
    t.dispatch()
    t.note(Tokens("r~1", (2,), stages=StageTimes(queue=7.0, prefill=7.0)))
    assert (t.dispatched, t.first_token, t.reserving, t.computed) == (dispatched, token, 0, first)


@dataclass
class FakeSpan:
    name: str
    parent: Any
    attributes: dict = field(default_factory=dict)
    ended: bool = False


class FakeTracer:
    """Records spans; every request span is sampled, its traceparent names it."""

    def __init__(self, sample: bool = True) -> None:
        self.spans: list[FakeSpan] = []
        self.sample = sample
        self.asked: list[str | None] = []

    def sampled(self, parent: str | None) -> bool:
        self.asked.append(parent)
        return self.sample

    def start(self, name: str, parent: Any, start: float, attributes) -> FakeSpan:
        self.spans.append(FakeSpan(name, parent, dict(attributes)))
        return self.spans[-1]

    def end(self, span: FakeSpan, end: float, attributes=None) -> None:
        span.attributes |= attributes or {}
        span.ended = True

    def span(self, name: str, parent: Any, start: float, end: float, attributes) -> FakeSpan:
        self.spans.append(FakeSpan(name, parent, dict(attributes), ended=True))
        return self.spans[-1]

    def traceparent(self, span: FakeSpan) -> str:
        return f"00-{'1' * 32}-{self.spans.index(span) + 1:016x}-01"

    def close(self) -> None:
        pass

    def named(self, name: str) -> list[FakeSpan]:
        return [s for s in self.spans if s.name == name]


@pytest.mark.parametrize("traced", [True, False])
def test_every_node_gets_the_request_spans_context_and_a_failover_is_a_span(traced) -> None:
    tracer = FakeTracer()

    async def body(backend: ClusterBackend, nodes: FakeNodes, _: Any) -> None:
        backend.tracer = tracer if traced else None  # type: ignore[assignment]
        client = await nodes.start()
        nodes.tell("p0", Error("r", "queue full", Failure.BUSY))
        await until(lambda: nodes.to("p1", Prefill), "the prefill on p1")
        nodes.answer("r", "p1", "d0", 10, 11)
        await client.done()
        sent = [m for _, m in nodes.sent if isinstance(m, Prefill | ReserveKV)]
        parents = {m.traceparent for m in sent}
        if not traced:
            assert parents == {None} and tracer.spans == []
            return
        (request,) = tracer.named("llm_request")
        assert parents == {tracer.traceparent(request)}, "prefill and decode: one parent"
        (failover,) = tracer.named("router.failover")
        assert failover.parent is request
        assert failover.attributes["pdserve.failover.cause"] == "busy"  # the counter's label
        assert failover.attributes["pdserve.failover.why"] == "p0: queue full"
        assert failover.attributes["pdserve.failover.kind"] == "prefill"
        assert failover.attributes["pdserve.failover.lost"] == ["p0"]
        assert len(tracer.named("router.route")) == 1  # the first placement
        assert request.ended and request.attributes["gen_ai.usage.completion_tokens"] == 2

    run(body, "p0", "p1", "d0")


def test_a_request_left_out_of_the_sample_makes_no_span_and_no_attribute() -> None:
    tracer = FakeTracer(sample=False)
    request = GenerateRequest("r", (1, 2, 3), SamplingParams(max_tokens=4))
    request.timing.traceparent = "00-" + "1" * 32 + "-" + "2" * 16 + "-00"
    trace = RequestTrace(tracer, request, "m")  # type: ignore[arg-type]
    assert tracer.asked == [request.timing.traceparent], "the client's flags decide"
    assert not trace.on and trace.traceparent is None and tracer.spans == []
    trace.child("router.queue", 0.0, {})
    trace.finish(4, "finished")
    assert tracer.spans == [], "no span at all for it"
    kept = RequestTrace(FakeTracer(sample=True), request, "m")  # type: ignore[arg-type]
    assert kept.on and kept.traceparent is not None


def test_the_request_span_holds_the_ttft_taken_apart() -> None:
    """The TTFT's stages, and the hand-off's, are attributes of the request span (issue 39:
    in the trace too), the TTFT's adding up to the span's time to first token."""
    tracer = FakeTracer()
    timing = RequestTiming(arrival=100.0, entered=99.9)
    request = GenerateRequest("r", (1, 2, 3), SamplingParams(max_tokens=4), timing=timing)
    trace = RequestTrace(tracer, request, "m")  # type: ignore[arg-type]
    timing.reserved(0.25)
    timing.dispatched = 101.0
    timing.note(Tokens("r", (1,), stages=StageTimes(queue=0.5, prefill=2.0)))
    timing.first_token, timing.written = 104.5, 104.55
    timing.note(Tokens("r", (2,), stages=StageTimes(kv_transfer=3.0, admission=0.1)))
    trace.finish(2, "finished")
    (span,) = tracer.named("llm_request")

    def prefixed(prefix: str) -> dict[str, float]:
        attrs = span.attributes.items()
        return {k.removeprefix(prefix): v for k, v in attrs if k.startswith(prefix)}

    assert prefixed("pdserve.ttft.") == timing.ttft_stages()
    assert sum(prefixed("pdserve.ttft.").values()) == pytest.approx(4.65)
    assert span.attributes["gen_ai.latency.time_to_first_token"] == pytest.approx(4.65)
    assert prefixed("pdserve.handoff.") == timing.handoff_stages()


class OneMessage(FakeBackend):
    """Answers with one message that carries the only token and the finish, with the computing
    node's stages, as a cluster backend hands them on (dispatched, then noted)."""

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Tokens | Error]:
        request.timing.dispatch()
        stages = StageTimes(queue=0.01, prefill=0.02)
        msg = Tokens(
            request.request_id, (FIRST_ORDINARY_ID,), finish_reason="length", stages=stages
        )
        request.timing.note(msg)
        yield msg


def test_a_stream_that_ends_before_its_first_write_still_measures_its_egress() -> None:
    """The whole answer comes before the router writes its first chunk: the stages are taken
    once that chunk is written, so router_egress is the time to its write, not 0."""
    tokenizer = tiny_tokenizer()
    backend = OneMessage(len(tokenizer), tokenizer.eos_token_id)
    with TestClient(create_app(backend, tokenizer, "tiny")) as client:
        body = {"model": "tiny", "prompt": "Once", "max_tokens": 1, "stream": True}
        assert client.post("/v1/completions", json=body).text.endswith("data: [DONE]\n\n")
        metrics = client.get("/metrics").text.splitlines()
    egress = 'pdserve:ttft_stage_seconds_{}{{stage="router_egress"}} '
    (count,) = [float(m.split()[-1]) for m in metrics if m.startswith(egress.format("count"))]
    (total,) = [float(m.split()[-1]) for m in metrics if m.startswith(egress.format("sum"))]
    assert count == 1 and total > 0, "router_egress observed before the chunk's write"
