"""Scheduler edges that mutation testing showed no test pinned (scripts/mutation.sh): what each
update carries, the min_tokens and max_num_seqs boundaries, which request a preemption picks
and what the step does after it, a prefill chunk that gets no room, and what a scheduled
sequence hands the model runner."""

from __future__ import annotations

import pytest

from pdserve.common.engine.config import SchedulerConfig
from pdserve.common.engine.kv_cache_manager import KVCacheManager
from pdserve.common.engine.request import FinishReason, Request, RequestStatus
from pdserve.common.engine.scheduler import (
    RequestUpdate,
    SampledToken,
    Scheduler,
    SchedulerOutput,
)
from pdserve.common.wire.payloads import SamplingParams, TokenLogprobs

EOS = 3
TOKEN = 50  # what the fake model samples: never EOS


class Engine:
    """A scheduler over a small pool, stepped with a fake model that always samples TOKEN."""

    def __init__(
        self, num_blocks: int = 32, max_model_len: int = 256, caching: bool = True, **cfg: object
    ) -> None:
        self.kv = KVCacheManager(num_blocks, 4, caching)
        self.s = Scheduler(SchedulerConfig(**cfg), self.kv, max_model_len)  # type: ignore[arg-type]

    def add(self, rid: str, prompt: list[int], priority: int = 0, **sp: object) -> Request:
        params = SamplingParams(**{"max_tokens": 64, **sp})  # type: ignore[arg-type]
        request = Request(rid, prompt, params, (EOS,), 0.0, priority)
        self.s.add_request(request)
        return request

    def step(
        self, logprobs: TokenLogprobs | None = None, prompt_lps: bool = False
    ) -> tuple[SchedulerOutput, dict[str, RequestUpdate]]:
        out = self.s.schedule()
        sampled = {
            seq.request_id: SampledToken(seq.request_id, TOKEN, logprobs)
            for seq in out.seqs
            if seq.sample
        }
        scored = {seq.request_id: [LP] * len(seq.prompt_targets) for seq in out.seqs}
        updates = self.s.update(out, sampled, scored if prompt_lps else None)
        self.kv.check_integrity()
        return out, {u.request_id: u for u in updates}


LP = TokenLogprobs(7, -0.5, ((7, -0.5),))


def scheduled(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(seq.request_id, len(seq.token_ids)) for seq in out.seqs]


# ---------------------------------------------------------------- what an update carries


def test_each_update_carries_its_token_and_logprobs() -> None:
    e = Engine()
    r = e.add("a", [1, 2, 3])
    _, updates = e.step(logprobs=LP)
    assert updates["a"] == RequestUpdate("a", (TOKEN,), (LP,), None, 0, ())
    _, updates = e.step()
    assert updates["a"] == RequestUpdate("a", (TOKEN,), (), None, 0, ())
    assert r.output_logprobs == [LP] and r.output_token_ids == [TOKEN, TOKEN]


def test_cached_tokens_come_with_the_first_update_only() -> None:
    e = Engine()
    e.add("a", list(range(9)), max_tokens=1)
    e.step()
    e.add("b", list(range(9)))
    _, updates = e.step()
    assert updates["b"].cached_tokens == 8
    _, updates = e.step()
    assert updates["b"].cached_tokens == 0


def test_prompt_logprobs_come_with_the_first_update_only() -> None:
    e = Engine()
    e.add("a", [1, 2, 3, 4], prompt_logprobs=1)
    _, updates = e.step(prompt_lps=True)
    assert updates["a"].prompt_logprobs == (LP, LP, LP)
    _, updates = e.step(prompt_lps=True)
    assert updates["a"].prompt_logprobs == ()


def test_a_scoring_request_ends_with_its_prompt_logprobs_and_no_token() -> None:
    e = Engine()
    e.add("a", list(range(9)), max_tokens=1)
    e.step()
    r = e.add("b", list(range(9)), max_tokens=0, prompt_logprobs=0)
    out, updates = e.step(prompt_lps=True)
    assert out.seqs[0].prompt_logprobs == 0
    # every position is computed for prompt logprobs: no cache hit is used
    assert updates["b"] == RequestUpdate("b", (), (), FinishReason.LENGTH, 0, (LP,) * 8)
    assert r.status is RequestStatus.FINISHED and r.output_token_ids == []


class FakeGrammar:
    """Accepts the tokens in `ok`; complete once `done_after` tokens were accepted."""

    def __init__(self, ok: set[int], done_after: int) -> None:
        self.ok, self.left = ok, done_after

    def accept(self, token_id: int) -> bool:
        self.left -= 1
        return token_id in self.ok

    @property
    def terminated(self) -> bool:
        return self.left <= 0


@pytest.mark.parametrize(
    ("ok", "done_after", "reasons"),
    [({TOKEN}, 2, [None, FinishReason.STOP]), (set(), 5, [FinishReason.ERROR])],
)
def test_the_grammar_ends_a_request(
    ok: set[int], done_after: int, reasons: list[FinishReason | None]
) -> None:
    """STOP once the grammar is complete (ignore_eos or not), ERROR on a token it refuses."""
    e = Engine()
    r = e.add("a", [1, 2], ignore_eos=True)
    r.grammar = grammar = FakeGrammar(ok, done_after)
    out, updates = e.step()
    assert out.seqs[0].grammar is grammar
    got = [updates["a"].finish_reason]
    while r.finish_reason is None and len(got) < 5:
        got.append(e.step()[1]["a"].finish_reason)
    assert got == reasons and r.finish_reason is reasons[-1]


# ---------------------------------------------------------------- boundaries


def test_eos_and_stop_ids_are_allowed_once_min_tokens_are_out() -> None:
    e = Engine()
    e.add("a", [1, 2], min_tokens=2, stop_token_ids=(9,))
    seqs = [e.step()[0].seqs[0] for _ in range(3)]
    assert [s.banned_token_ids for s in seqs] == [(EOS, 9), (EOS, 9), ()]
    assert [s.num_output_tokens for s in seqs] == [0, 1, 2]


def test_ignore_eos_still_bans_stop_ids_before_min_tokens() -> None:
    e = Engine()
    e.add("a", [1, 2], min_tokens=2, stop_token_ids=(9,), ignore_eos=True)
    assert e.step()[0].seqs[0].banned_token_ids == (9,)


def test_a_plain_request_asks_for_no_prompt_scoring() -> None:
    e = Engine()
    e.add("a", [1, 2])
    (seq,) = e.step()[0].seqs
    assert (seq.prompt_targets, seq.prompt_logprobs, seq.grammar) == ((), 0, None)


def reserve(e: Engine, rid: str, prompt: list[int]) -> list[int] | None:
    return e.s.reserve(Request(rid, prompt, SamplingParams(max_tokens=64), (EOS,)))


def test_running_and_reserved_requests_share_max_num_seqs() -> None:
    e = Engine(max_num_seqs=2)
    e.add("a", [1, 2])
    e.step()
    assert reserve(e, "b", [1, 2]) is not None
    assert reserve(e, "c", [1, 2]) is None
    e2 = Engine(max_num_seqs=2)
    assert reserve(e2, "b", [1, 2]) is not None and reserve(e2, "c", [1, 2]) is not None
    assert reserve(e2, "d", [1, 2]) is None


def test_admitted_remote_requests_run_and_finished_ones_say_so() -> None:
    e = Engine()
    request = Request("r", [1, 2], SamplingParams(max_tokens=2), (EOS,))
    assert e.s.reserve(request) is not None
    e.s.admit_remote("r", SampledToken("r", TOKEN))
    assert request.status is RequestStatus.RUNNING
    e.step()
    assert request.status is RequestStatus.FINISHED


def test_a_prefix_hit_runs_on_the_shared_blocks_without_chunking() -> None:
    e = Engine(max_num_batched_tokens=64, enable_chunked_prefill=False, max_model_len=64)
    e.add("a", list(range(12)), max_tokens=1)
    (first,) = e.step()[0].seqs
    e.add("b", list(range(12)))
    (seq,) = e.step()[0].seqs
    assert (seq.start_pos, len(seq.token_ids)) == (8, 4)
    assert seq.block_ids[:2] == first.block_ids[:2] and len(seq.block_ids) == 3


def test_an_unchunked_prompt_is_admitted_when_its_uncached_part_fits() -> None:
    e = Engine(max_num_batched_tokens=5, enable_chunked_prefill=False, max_model_len=5)
    e.add("a", [1, 2, 3, 4, 5], max_tokens=1)
    e.step()
    e.add("b", [1, 2, 3, 4, 5])
    assert scheduled(e.step()[0]) == [("b", 1)]


# ---------------------------------------------------------------- preemption


def fill_until_preempt(e: Engine, limit: int = 50) -> SchedulerOutput:
    for _ in range(limit):
        out, _ = e.step()
        if any(r.num_preemptions for r in e.s.requests.values()):
            return out
    raise AssertionError("no preemption happened")


def test_fcfs_preempts_the_newest_even_when_it_has_the_best_priority() -> None:
    e = Engine(num_blocks=5)  # 4 usable blocks of 4 tokens
    old, mid, new = e.add("old", [1] * 3, 5), e.add("mid", [2] * 3, 5), e.add("new", [3] * 3)
    out = fill_until_preempt(e)
    assert (old.num_preemptions, mid.num_preemptions, new.num_preemptions) == (0, 0, 1)
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert e.s.waiting[0] is new and scheduled(out) == [("old", 1), ("mid", 1)]


def test_priority_preempts_the_worst_even_when_it_already_had_its_token() -> None:
    e = Engine(num_blocks=5, policy="priority")
    worst = e.add("worst", [1], priority=9)
    e.step()  # admitted first: the running list starts with it
    e.add("best", [2] * 3, priority=0)
    e.add("good", [3] * 3, priority=1)
    out = fill_until_preempt(e)
    assert worst.num_preemptions == 1 and worst.status is RequestStatus.PREEMPTED
    # worst was given its token in this step before the shortage: it loses it again
    assert scheduled(out) == [("best", 1), ("good", 1)]
    assert out.num_batched_tokens == 2


def test_a_request_that_preempts_itself_ends_the_step() -> None:
    """b runs short and is the newest: it preempts itself. a, already scheduled, runs once;
    nothing is admitted in a step that preempted, not even b's recompute, which would fit."""
    e = Engine(num_blocks=3, caching=False, max_num_batched_tokens=5)  # 2 usable blocks
    e.add("a", [1] * 2)
    b = e.add("b", [2] * 3)
    out = fill_until_preempt(e)
    assert scheduled(out) == [("a", 1)]
    assert b.num_preemptions == 1 and e.s.waiting[0] is b


# ---------------------------------------------------------------- budget


def test_a_prefill_chunk_with_no_room_left_waits_and_decodes_still_run() -> None:
    """Running: a decode, a long prefill, two decodes, in that order; the decodes take the
    whole budget and the prefill gets nothing this step (no chunk of zero tokens)."""
    e = Engine(max_num_batched_tokens=3)
    e.add("d0", [1])
    e.add("p", list(range(100, 140)))
    e.step()  # d0's prompt and p's first chunk
    for rid in ("d1", "d2"):
        assert reserve(e, rid, [5, 6]) is not None
        e.s.admit_remote(rid, SampledToken(rid, TOKEN))
    assert [r.request_id for r in e.s.running] == ["d0", "p", "d1", "d2"]
    out, _ = e.step()
    assert scheduled(out) == [("d0", 1), ("d1", 1), ("d2", 1)]


def test_a_decode_ahead_of_a_prefill_leaves_it_the_rest_of_the_budget() -> None:
    e = Engine(max_num_batched_tokens=8)
    e.add("d", [1])
    e.add("p", list(range(100, 140)))
    e.step()
    out, _ = e.step()
    assert scheduled(out) == [("d", 1), ("p", 7)]


def test_an_update_after_an_abort_still_reaches_the_other_requests() -> None:
    e = Engine()
    e.add("a", [1, 2])
    e.add("b", [3, 4])
    out = e.s.schedule()
    e.s.abort("a")
    sampled = {rid: SampledToken(rid, TOKEN) for rid in ("a", "b")}
    assert [u.request_id for u in e.s.update(out, sampled)] == ["b"]
