"""StageClock's spans of a traced request's tier loads (`node.tier_load`, under the node's span
of its computing, once) and of its drafts on a speculating node (`decode.speculation`, when it
ends: the clock keeps it past its first token, and forgets it however it ends)."""

from __future__ import annotations

from pdserve.common.engine.drafting import SpecDecodeStats
from pdserve.common.engine.kv_cache_manager import TierLoads
from pdserve.common.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.common.node.stages import StageClock
from pdserve.common.wire.messages import Tokens
from pdserve.common.wire.payloads import SamplingParams
from tests.common.node.test_stages import PARENT, FakeTracer, step

LOADS = TierLoads({"host": 2, "file:///tmp/secret-dir": 3}, 4, 5 * 1024, 80, 10.0, 10.5)


def spec_step(clock: StageClock, rid: str, drafts: int, counts: dict[str, SpecDecodeStats]):
    """A verify step of `drafts` drafts for `rid` (its counts as the engine's drafter keeps
    them)."""
    seq = ScheduledSeq(rid, (1,) * (1 + drafts), 0, (0,), True, SamplingParams(), num_drafts=drafts)
    clock.step_started(SchedulerOutput((seq,), 1 + drafts), drafts=counts)
    clock.step_done()


def test_a_tier_load_is_one_span_under_the_prefill_span_with_blocks_by_tier_kind() -> None:
    tracer = FakeTracer()
    clock = StageClock(tracer, "p0")  # type: ignore[arg-type]
    clock.taken("r", PARENT, handoff=True)
    clock.taken("plain", PARENT, handoff=True)
    seqs = tuple(
        ScheduledSeq(rid, (1,) * 4, 0, (0,), True, SamplingParams()) for rid in ("r", "plain")
    )
    clock.step_started(SchedulerOutput(seqs, 8), tier_loads={"r": LOADS})
    clock.step_done()
    clock.step_started(SchedulerOutput(seqs[:1], 4), tier_loads={"r": LOADS})  # not again
    clock.step_done()
    (load,) = tracer.named("node.tier_load")
    (prefill,) = tracer.opened[:1]
    assert load.parent is prefill and (load.start, load.end) == (10.0, 10.5)
    assert load.attributes["pdserve.kv_tier.host.blocks"] == 2
    assert load.attributes["pdserve.kv_tier.file.blocks"] == 3
    assert load.attributes["pdserve.kv_tier.recompute_chosen_blocks"] == 4
    assert load.attributes["pdserve.kv_tier.bytes"] == 5 * 1024
    assert load.attributes["pdserve.kv_tier.tokens"] == 80
    assert load.attributes["gen_ai.request.id"] == "r"
    assert not any("secret" in str(v) for v in load.attributes.values()), "no store URL"


def test_a_decode_nodes_tier_load_goes_under_its_first_step_and_untraced_gets_none() -> None:
    tracer = FakeTracer()
    clock = StageClock(tracer, "d0")  # type: ignore[arg-type]
    clock.taken("r", PARENT, remote=True)
    clock.taken("u", None, remote=True)
    seqs = tuple(ScheduledSeq(rid, (1,), 0, (0,), True, SamplingParams()) for rid in ("r", "u"))
    clock.step_started(SchedulerOutput(seqs, 2), tier_loads={"r": LOADS, "u": LOADS})
    clock.step_done()
    clock.first_token(Tokens("r", (7,)))
    (load,) = tracer.named("node.tier_load")
    assert load.parent is tracer.named("decode.first_step")[0]


def test_a_speculating_node_spans_a_traced_requests_drafts_when_it_finishes() -> None:
    tracer = FakeTracer()
    clock = StageClock(tracer, "d0", spec_method="ngram")  # type: ignore[arg-type]
    clock.taken("r", PARENT, remote=True)
    clock.kv_whole("r", ok=True, pages=2)
    step(clock, "r", tokens=1)
    clock.first_token(Tokens("r", (7,)))
    assert len(clock) == 1, "kept past its first token for its drafts"
    counts = {"r": SpecDecodeStats()}
    spec_step(clock, "r", 3, counts)
    counts["r"].observe(3, 2)
    spec_step(clock, "r", 3, {})  # the clock holds its own reference from the first
    counts["r"].observe(3, 1)
    clock.first_token(Tokens("r", (8, 9, 10)))
    assert not tracer.named("decode.speculation")
    clock.first_token(Tokens("r", (11,), finish_reason="length"))
    (spec,) = tracer.named("decode.speculation")
    assert spec.parent == PARENT, "under the request span, not the first step's"
    assert spec.start == tracer.named("decode.first_step")[0].start and spec.end >= spec.start
    attrs = spec.attributes
    assert attrs["pdserve.spec.method"] == "ngram" and attrs["pdserve.outcome"] == "length"
    assert attrs["pdserve.spec.num_drafts"] == 2
    assert attrs["pdserve.spec.num_draft_tokens"] == 6
    assert attrs["pdserve.spec.num_accepted_tokens"] == 3
    assert len(clock) == 0


def test_an_aborted_or_lapsed_request_on_a_speculating_node_leaves_nothing_behind() -> None:
    tracer = FakeTracer()
    clock = StageClock(tracer, "d0", spec_method="ngram")  # type: ignore[arg-type]
    for rid in ("a", "l", "once", "u"):
        clock.taken(rid, None if rid == "u" else PARENT, remote=True)
    step(clock, "a", "l", "once", "u", tokens=1)
    for rid in ("a", "l", "u"):
        clock.first_token(Tokens(rid, (7,)))
    clock.first_token(Tokens("once", (7,), finish_reason="stop"))  # ended at its first token
    assert len(clock) == 2, "the untraced one and the finished one are gone at once"
    clock.forget("a")  # aborted (the loop's abort)
    clock.lease_expired("l", 5.0)
    assert len(clock) == 0
    outcomes = {s.attributes["gen_ai.request.id"]: s for s in tracer.named("decode.speculation")}
    assert {k: v.attributes["pdserve.outcome"] for k, v in outcomes.items()} == {
        "a": "ended",
        "l": "lease_expired",
        "once": "stop",
    }
    assert all(s.attributes["pdserve.spec.num_drafts"] == 0 for s in outcomes.values())


def test_a_node_without_speculation_or_a_prefill_node_forgets_at_the_first_token() -> None:
    tracer = FakeTracer()
    plain = StageClock(tracer, "d0")  # type: ignore[arg-type]
    plain.taken("r", PARENT, remote=True)
    step(plain, "r", tokens=1)
    plain.first_token(Tokens("r", (7,)))
    assert len(plain) == 0
    prefill = StageClock(tracer, "p0", spec_method="ngram")  # type: ignore[arg-type]
    prefill.taken("r", PARENT, handoff=True)
    step(prefill, "r")
    prefill.first_token(Tokens("r", (7,)))
    prefill.kv_sent("r", pages=1, ok=True)
    assert len(prefill) == 0 and not tracer.named("decode.speculation")
