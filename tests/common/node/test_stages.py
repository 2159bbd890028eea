"""StageClock: each request's stages on one node, as durations of that node's clock, handed to
the router with the first token computed here; spans only for a traced request on a node that
traces, each under the router's request span (a decode node's never under a prefill's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.common.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.common.node.stages import StageClock
from pdserve.common.wire.messages import Tokens
from pdserve.common.wire.payloads import SamplingParams

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@dataclass
class FakeSpan:
    name: str
    parent: Any
    start: float
    end: float
    attributes: dict = field(default_factory=dict)


class FakeTracer:
    """Records the spans a StageClock makes as they end (a span it opens, `start`, when it
    is ended), as an exporter gets them."""

    def __init__(self) -> None:
        self.spans: list[FakeSpan] = []
        self.opened: list[FakeSpan] = []

    def span(self, name: str, parent: Any, start: float, end: float, attributes) -> FakeSpan:
        span = FakeSpan(name, parent, start, end, dict(attributes))
        self.spans.append(span)
        return span

    def start(self, name: str, parent: Any, start: float, attributes) -> FakeSpan:
        span = FakeSpan(name, parent, start, 0.0, dict(attributes))
        self.opened.append(span)
        return span

    def end(self, span: FakeSpan, end: float, attributes=None) -> None:
        assert not span.end, f"{span.name} ended twice"
        span.end = end
        span.attributes |= attributes or {}
        self.spans.append(span)

    def traceparent(self, span: FakeSpan) -> str:
        return f"00-{'1' * 32}-{self.opened.index(span) + 1:016x}-01"

    def named(self, name: str) -> list[FakeSpan]:
        return [s for s in self.spans if s.name == name]


def step(clock: StageClock, *rids: str, tokens: int = 4) -> tuple[str, ...]:
    """One step of `rids`: the node spans the other ranks' spans of it would go under."""
    seqs = tuple(ScheduledSeq(rid, (1,) * tokens, 0, (0,), True, SamplingParams()) for rid in rids)
    parents = clock.step_started(SchedulerOutput(seqs, tokens * len(rids)))
    clock.step_done()
    return parents


def test_a_prompt_computed_here_reports_its_queue_and_prefill_with_the_first_token() -> None:
    tracer = FakeTracer()
    clock = StageClock(tracer, "p0")  # type: ignore[arg-type]
    clock.taken("r", PARENT, handoff=True)
    step(clock, "r")
    step(clock, "r")
    msg = clock.first_token(Tokens("r", (7,)))
    assert msg.stages is not None and msg.stages.queue >= 0 and msg.stages.prefill > 0
    assert msg.stages.kv_transfer == msg.stages.admission == msg.stages.first_step == 0
    later = Tokens("r", (8,))
    assert clock.first_token(later) is later, "only the first token carries the stages"
    (prefill,) = tracer.named("prefill")
    assert prefill.parent == PARENT
    assert [s.parent for s in tracer.named("prefill.chunk")] == [prefill, prefill]
    assert tracer.named("prefill.queue")[0].parent is prefill
    assert len(clock) == 1, "kept until its KV is sent"
    clock.kv_sent("r", pages=3, ok=True)
    (sent,) = tracer.named("prefill.kv_send")
    assert sent.parent == PARENT and sent.attributes["pdserve.kv.pages"] == 3
    assert len(clock) == 0


def test_a_decode_nodes_stages_hang_under_the_request_span_not_the_prefill() -> None:
    tracer = FakeTracer()
    clock = StageClock(tracer, "d0")  # type: ignore[arg-type]
    clock.taken("r", PARENT, remote=True)
    clock.reserved("r", blocks=4, cached_tokens=16)
    clock.kv_whole("r", ok=True, pages=3)
    step(clock, "r", tokens=1)
    msg = clock.first_token(Tokens("r", (7,)))
    stages = msg.stages
    assert stages is not None and stages.queue == stages.prefill == 0
    assert stages.kv_transfer > 0 and stages.admission >= 0 and stages.first_step > 0
    names = ["decode.reserve", "decode.kv_transfer", "decode.admission", "decode.first_step"]
    assert [s.name for s in tracer.spans] == names
    assert {s.parent for s in tracer.spans} == {PARENT}
    assert tracer.named("decode.kv_transfer")[0].attributes["pdserve.kv.checksum_ok"] is True
    assert len(clock) == 0


def test_untraced_requests_and_a_node_without_tracer_make_no_span() -> None:
    tracer = FakeTracer()
    clock = StageClock(tracer, "p0")  # type: ignore[arg-type]
    clock.taken("r", None)
    step(clock, "r")
    assert clock.first_token(Tokens("r", (7,))).stages is not None
    assert tracer.spans == []
    off = StageClock(None, "p0")
    off.taken("r", PARENT)  # the router traces, this node does not
    step(off, "r")
    assert off.first_token(Tokens("r", (7,))).stages is not None


def test_a_request_that_ends_before_its_first_token_leaves_nothing() -> None:
    clock = StageClock(None, "d0")
    clock.taken("a", None, remote=True)
    clock.kv_whole("a", ok=False, pages=1)  # a slice was not whole
    clock.taken("b", None)
    clock.forget("b")  # aborted
    clock.taken("c", None)
    step(clock, "c")
    clock.first_token(Tokens("c", (), finish_reason="length"))  # a prompt only scored
    assert len(clock) == 0


def test_the_other_ranks_get_the_open_node_span_of_each_traced_request_until_its_first_token():
    """A tensor-parallel node's workers put their spans of a step under the node's span of each
    traced request in it: `prefill` on a node that computes the prompt, `decode.first_step` on
    a decode node; an untraced request gives them nothing, nor a step after the first token."""
    tracer = FakeTracer()
    clock = StageClock(tracer, "p0")  # type: ignore[arg-type]
    clock.taken("r", PARENT)
    clock.taken("u", None)
    (prefill,) = tracer.opened
    assert prefill.name == "prefill" and prefill.parent == PARENT and not prefill.end
    assert step(clock, "r", "u") == (tracer.traceparent(prefill),)
    assert step(clock, "u") == ()
    clock.first_token(Tokens("r", (7,)))
    assert prefill.end and tracer.named("prefill") == [prefill]
    assert step(clock, "r") == (), "after its first token"
    decode = StageClock(tracer, "d0")  # type: ignore[arg-type]
    decode.taken("d", PARENT, remote=True)
    decode.kv_whole("d", ok=True, pages=1)
    (parent,) = step(decode, "d", tokens=1)
    first_step = tracer.opened[-1]
    assert first_step.name == "decode.first_step" and parent == tracer.traceparent(first_step)
    decode.first_token(Tokens("d", (8,)))
    assert first_step.end and tracer.named("decode.first_step") == [first_step]


def test_an_open_node_span_ends_when_its_request_ends_before_its_first_token() -> None:
    tracer = FakeTracer()
    clock = StageClock(tracer, "p0")  # type: ignore[arg-type]
    clock.taken("r", PARENT)
    step(clock, "r")
    clock.forget("r")  # aborted
    (prefill,) = tracer.spans
    assert prefill.end and prefill.attributes["pdserve.outcome"] == "ended"


def test_a_lapsed_lease_is_a_span_under_the_request_span_and_ends_an_open_one() -> None:
    tracer = FakeTracer()
    decode = StageClock(tracer, "d0")  # type: ignore[arg-type]
    decode.taken("d", PARENT, remote=True)  # a reservation whose KV never came
    decode.lease_expired("d", 3.0)
    (lapsed,) = tracer.spans
    assert (lapsed.name, lapsed.parent) == ("node.lease_expired", PARENT)
    assert lapsed.end >= lapsed.start > 0
    assert lapsed.attributes["pdserve.lease_timeout"] == 3.0
    assert lapsed.attributes["pdserve.node_id"] == "d0" and len(decode) == 0
    prefill = StageClock(tracer, "p0")  # type: ignore[arg-type]
    prefill.taken("p", PARENT)
    prefill.lease_expired("p", 3.0)
    assert tracer.spans[-1].name == "prefill"  # the open span ends with the lease's outcome
    assert tracer.spans[-1].attributes["pdserve.outcome"] == "lease_expired"
    untraced = StageClock(tracer, "d0")  # type: ignore[arg-type]
    untraced.taken("u", None, remote=True)
    untraced.lease_expired("u", 3.0)
    assert len(tracer.spans) == 3 and len(untraced) == 0
