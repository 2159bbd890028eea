"""Scheduler core driven by a fake model whose next token is a function of the history."""

from __future__ import annotations

import pytest

from pdserve.common.engine.config import SchedulerConfig
from pdserve.common.engine.kv_cache_manager import KVCacheManager
from pdserve.common.engine.request import FinishReason, Request, RequestStatus
from pdserve.common.engine.scheduler import SampledToken, Scheduler, SchedulerOutput
from pdserve.common.wire.payloads import SamplingParams

EOS = 3


def fake_next(history: list[int], banned: tuple[int, ...]) -> int:
    token = (sum(history) * 31 + len(history)) % 97 + 10  # never EOS by itself
    while token in banned:
        token += 1
    return token


class Harness:
    def __init__(self, num_blocks=64, block_size=4, max_model_len=512, **cfg):
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=True)
        self.s = Scheduler(SchedulerConfig(**cfg), self.kv, max_model_len)
        self.forced: dict[str, list[int]] = {}  # tokens the fake model must emit
        self.outputs: list[SchedulerOutput] = []

    def add(self, rid, prompt, priority=0, arrival=0.0, **sp) -> Request:
        r = Request(rid, list(prompt), SamplingParams(**sp), (EOS,), arrival, priority)
        self.s.add_request(r)
        return r

    def step(self):
        out = self.s.schedule()
        self.outputs.append(out)
        sampled = {}
        for seq in out.seqs:
            r = self.s.requests[seq.request_id]
            assert seq.start_pos == r.num_computed_tokens
            assert (
                list(seq.token_ids)
                == r.all_token_ids[seq.start_pos : seq.start_pos + len(seq.token_ids)]
            )
            if seq.sample:
                forced = self.forced.get(seq.request_id)
                tok = forced.pop(0) if forced else fake_next(r.all_token_ids, seq.banned_token_ids)
                sampled[seq.request_id] = SampledToken(seq.request_id, tok)
        self.s.update(out, sampled)
        self.kv.check_integrity()
        return out

    def run(self, max_steps=10_000):
        for _ in range(max_steps):
            if not self.s.has_unfinished:
                return
            self.step()
        raise AssertionError("did not finish")

    def done(self):
        self.s.schedule()  # flush finished ids
        assert self.kv.num_free_blocks == self.kv.pool.num_blocks - 1, "leaked blocks"
        self.kv.check_integrity()


def test_chunked_prefill_samples_only_on_last_chunk():
    h = Harness(max_num_batched_tokens=8)
    r = h.add("a", range(20), max_tokens=2)
    sizes, samples = [], []
    h.run()
    for out in h.outputs:
        sizes += [len(s.token_ids) for s in out.seqs]
        samples += [s.sample for s in out.seqs]
    assert sizes == [8, 8, 4, 1]
    assert samples == [False, False, True, True]
    assert r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 2
    h.done()


def test_long_prefill_threshold_caps_chunk_and_budget_is_shared():
    h = Harness(max_num_batched_tokens=10, long_prefill_token_threshold=6)
    h.add("a", range(12), max_tokens=1)
    h.add("b", range(100, 103), max_tokens=1)
    out = h.step()
    assert [(s.request_id, len(s.token_ids)) for s in out.seqs] == [("a", 6), ("b", 3)]
    assert out.num_batched_tokens == 9
    h.run()
    h.done()


def test_no_chunking_waits_for_budget():
    h = Harness(max_num_batched_tokens=8, enable_chunked_prefill=False, max_model_len=8)
    h.add("a", range(5), max_tokens=2)
    h.add("b", range(10, 15), max_tokens=2)
    out = h.step()
    assert [s.request_id for s in out.seqs] == ["a"]  # b's 5 tokens do not fit in 3
    h.run()
    h.done()


def test_max_num_seqs_limits_running():
    h = Harness(max_num_seqs=2)
    for i in range(4):
        h.add(f"r{i}", range(i, i + 3), max_tokens=3)
    h.step()
    assert len(h.s.running) == 2 and len(h.s.waiting) == 2
    h.run()
    h.done()


def test_decode_one_token_per_step_for_each_running():
    h = Harness()
    h.add("a", range(5), max_tokens=4)
    h.add("b", range(7), max_tokens=4)
    h.step()
    out = h.step()
    assert [len(s.token_ids) for s in out.seqs] == [1, 1] and all(s.sample for s in out.seqs)
    h.run()
    h.done()


def outputs_without_pressure(prompts, max_tokens):
    h = Harness(num_blocks=256)
    reqs = [h.add(f"r{i}", p, max_tokens=max_tokens) for i, p in enumerate(prompts)]
    h.run()
    h.done()
    return [r.output_token_ids for r in reqs]


def test_preemption_fcfs_newest_first_and_recompute_gives_same_tokens():
    prompts = [list(range(i * 7, i * 7 + 9)) for i in range(4)]
    want = outputs_without_pressure(prompts, 12)
    h = Harness(num_blocks=13)  # 12 usable blocks of 4: not enough for 4 x 21 tokens
    reqs = [h.add(f"r{i}", p, arrival=float(i), max_tokens=12) for i, p in enumerate(prompts)]
    h.run()
    assert [r.output_token_ids for r in reqs] == want
    assert sum(r.num_preemptions for r in reqs) > 0
    assert reqs[0].num_preemptions == 0  # the oldest is never the FCFS victim
    h.done()


def test_priority_preemption_picks_lowest_priority():
    h = Harness(num_blocks=9, policy="priority")  # 8 usable blocks
    hi = h.add("hi", range(12), priority=0, arrival=1.0, max_tokens=10)
    lo = h.add("lo", range(50, 62), priority=5, arrival=0.0, max_tokens=10)
    h.run()
    assert hi.num_preemptions == 0 and lo.num_preemptions > 0
    assert hi.num_output_tokens == 10 and lo.num_output_tokens == 10
    h.done()


def test_priority_orders_waiting_queue():
    h = Harness(policy="priority", max_num_seqs=1)
    h.add("late", range(3), priority=1, arrival=0.0, max_tokens=1)
    h.add("urgent", range(3), priority=0, arrival=1.0, max_tokens=1)
    assert h.step().seqs[0].request_id == "urgent"
    h.run()
    h.done()


def test_eos_stops_and_is_kept():
    h = Harness()
    r = h.add("a", range(5), max_tokens=10)
    h.forced["a"] = [20, EOS]
    h.run()
    assert r.output_token_ids == [20, EOS] and r.finish_reason is FinishReason.STOP
    h.done()


def test_ignore_eos_runs_to_length():
    h = Harness()
    r = h.add("a", range(5), max_tokens=3, ignore_eos=True)
    h.forced["a"] = [EOS, EOS, EOS]
    h.run()
    assert r.output_token_ids == [EOS] * 3 and r.finish_reason is FinishReason.LENGTH
    h.done()


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    h = Harness()
    r = h.add("a", range(5), max_tokens=10, min_tokens=3, stop_token_ids=(55,))
    h.step()
    h.step()
    banned = [s.banned_token_ids for out in h.outputs for s in out.seqs]
    assert banned[0] == (EOS, 55)
    h.forced["a"] = [55]  # at 3 outputs the stop id is allowed and stops the request
    h.run()
    assert r.output_token_ids[-1] == 55 and r.stop_reason == 55
    assert r.finish_reason is FinishReason.STOP and r.num_output_tokens == 3
    h.done()


def test_max_model_len_stops_generation():
    h = Harness(max_model_len=8)
    r = h.add("a", range(5), max_tokens=100)
    h.run()
    assert r.num_tokens == 8 and r.finish_reason is FinishReason.LENGTH
    h.done()


def test_too_long_prompt_and_duplicate_id_rejected():
    h = Harness(max_model_len=8)
    with pytest.raises(ValueError, match="at most 8"):
        h.add("a", range(9))
    h.add("b", range(3))
    with pytest.raises(ValueError, match="duplicate"):
        h.add("b", range(3))
    h.run()
    h.done()


def test_abort_waiting_and_running_is_idempotent():
    h = Harness(max_num_seqs=1)
    a = h.add("a", range(5), max_tokens=50)
    b = h.add("b", range(5), max_tokens=50)
    h.step()
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    assert h.s.abort("a") is a and h.s.abort("b") is b
    assert h.s.abort("a") is None and h.s.abort("nope") is None
    assert a.finish_reason is FinishReason.ABORT and b.finish_reason is FinishReason.ABORT
    assert set(h.s.schedule().finished_ids) == {"a", "b"}
    h.done()


def test_prefix_cache_hit_is_reported_and_skips_compute():
    h = Harness(max_num_seqs=1)
    h.add("a", range(10), max_tokens=1)
    h.run()
    b = h.add("b", range(10), max_tokens=1)
    out = h.step()
    assert b.num_cached_tokens == 8 and out.seqs[0].start_pos == 8
    assert len(out.seqs[0].token_ids) == 2
    h.run()
    h.done()


def test_request_aborted_mid_step_is_skipped_by_update():
    h = Harness()
    h.add("a", range(5), max_tokens=5)
    out = h.s.schedule()
    h.s.abort("a")
    assert h.s.update(out, {"a": SampledToken("a", 20)}) == []
    h.done()


def test_reserve_then_admit_remote_decodes_from_first_token():
    h = Harness(num_blocks=9)
    r = Request("d", list(range(10)), SamplingParams(max_tokens=3), (EOS,))
    blocks = h.s.reserve(r)
    assert blocks is not None and len(blocks) == 3
    assert h.s.schedule().empty  # nothing runs until the KV is there
    assert h.kv.pool.cached == {}  # reserved blocks hold no valid KV yet: not indexed
    upd = h.s.admit_remote("d", SampledToken("d", 42))
    assert upd.new_token_ids == (42,) and upd.finish_reason is None
    assert len(h.kv.pool.cached) == 2  # now the prompt's full blocks are shareable
    out = h.step()
    assert out.seqs[0].start_pos == 10 and out.seqs[0].token_ids == (42,)
    h.run()
    assert r.num_output_tokens == 3 and r.finish_reason is FinishReason.LENGTH
    h.done()


def test_reserve_refuses_when_full_and_abort_frees_reservation():
    h = Harness(num_blocks=5)  # 4 usable blocks of 4
    a = Request("a", list(range(12)), SamplingParams(max_tokens=3), (EOS,))
    b = Request("b", list(range(20, 32)), SamplingParams(max_tokens=3), (EOS,))
    assert h.s.reserve(a) is not None
    assert h.s.reserve(b) is None  # busy: nothing held for it
    h.kv.check_integrity()
    h.s.abort("a")
    assert h.s.admit_remote("a", SampledToken("a", 1)) is None  # late KVDone is harmless
    h.done()


def test_first_token_can_finish_a_remote_request():
    h = Harness()
    r = Request("d", list(range(6)), SamplingParams(max_tokens=1), (EOS,))
    h.s.reserve(r)
    upd = h.s.admit_remote("d", SampledToken("d", 7))
    assert upd.finish_reason is FinishReason.LENGTH
    h.done()


def test_release_keeps_prefix_cached_for_the_next_request():
    h = Harness()
    h.add("p", range(9), max_tokens=5)
    h.step()
    h.s.release("p")
    h.s.release("p")  # idempotent
    assert h.kv.num_free_blocks == h.kv.pool.num_blocks - 1
    q = h.add("q", range(9), max_tokens=1)
    h.step()
    assert q.num_cached_tokens == 8
    h.run()
    h.done()


def test_reserve_shares_what_an_earlier_turn_left_on_the_decode_node():
    """Turn 2 of a conversation reserves on the node that decoded turn 1: the prompt and the
    answer of turn 1 (whose KV only this node computed) are shared, not received again."""
    h = Harness(num_blocks=16)  # block size 4
    turn1 = Request("t1", list(range(10)), SamplingParams(max_tokens=6), (EOS,))
    h.s.reserve(turn1)
    h.s.admit_remote("t1", SampledToken("t1", 42))
    h.run()  # decodes 5 more tokens here: 16 tokens, 15 with KV (the last was never fed)
    h.done()
    history = turn1.all_token_ids
    turn2 = Request("t2", history + [7, 8, 9], SamplingParams(max_tokens=2), (EOS,))
    blocks = h.s.reserve(turn2)
    assert turn2.num_cached_tokens == 12  # 3 full blocks with KV; the 4th lacks token 15's
    cached = [h.kv.pool.get_cached_block(x).block_id for x in h.kv._hashes(turn2)[:3]]
    assert blocks[:3] == cached and len(blocks) == 5
    assert all(h.kv.pool.blocks[b].ref_cnt == 1 for b in blocks)
    h.kv.check_integrity()
    # A second conversation sharing turn 1 shares the same blocks (ref-counted).
    other = Request("o", history + [1], SamplingParams(max_tokens=1), (EOS,))
    assert h.s.reserve(other)[:3] == cached
    assert all(h.kv.pool.blocks[b].ref_cnt == 2 for b in cached)
    h.kv.check_integrity()
    h.s.abort("o")
    h.s.admit_remote("t2", SampledToken("t2", 50))
    h.run()
    h.done()


def test_reserve_when_full_releases_its_cache_hits():
    h = Harness(num_blocks=8)  # 7 usable blocks of 4
    h.add("a", range(12), max_tokens=1)
    h.run()  # 3 cached blocks, all evictable
    big = Request("b", list(range(12)) + list(range(100, 112)), SamplingParams(), (EOS,))
    h.add("hold", range(200, 208), max_tokens=50)
    h.step()  # holds 2 blocks (evicts 2 of a's) while it runs
    assert h.s.reserve(big) is None  # 3 hits + 3 new needed, 2 others free: nothing held
    h.kv.check_integrity()
    h.s.abort("hold")
    h.done()


def test_a_long_prefill_leaves_running_decodes_their_token_each_step():
    """A prompt admitted before the decodes (a decode node prefilling locally) takes only
    what the budget leaves after one token for every decoding request."""
    h = Harness(max_num_batched_tokens=16)
    h.add("d1", range(3), max_tokens=30)
    h.add("d2", range(20, 23), max_tokens=30)
    h.step()
    long = h.add("long", range(40, 140), max_tokens=1)
    for _ in range(4):
        out = h.step()
        sizes = {s.request_id: len(s.token_ids) for s in out.seqs}
        assert sizes["d1"] == sizes["d2"] == 1, sizes
        assert sizes.get("long", 0) <= 14 and out.num_batched_tokens <= 16
    # Put the long prompt first in the running list: it still leaves the decodes theirs.
    h.s.running.sort(key=lambda r: r.request_id != "long")
    out = h.step()
    sizes = {s.request_id: len(s.token_ids) for s in out.seqs}
    assert sizes["long"] == 14 and sizes["d1"] == sizes["d2"] == 1, sizes
    h.run()
    assert long.num_output_tokens == 1
    h.done()


@pytest.mark.parametrize("left", [1, 0])
def test_waiting_prompt_takes_the_last_token_of_budget(left: int) -> None:
    """With chunked prefill a waiting prompt starts with whatever budget is left, even a
    single token; with none left it waits for the next step."""
    h = Harness(max_num_batched_tokens=8)
    h.add("a", range(8 - left), max_tokens=1)
    b = h.add("b", range(100, 105), max_tokens=1)
    out = h.step()
    sizes = [(s.request_id, len(s.token_ids)) for s in out.seqs]
    assert out.num_batched_tokens == 8
    if left:
        assert sizes == [("a", 7), ("b", 1)] and not out.seqs[1].sample
        assert b.status is RequestStatus.RUNNING and b.num_computed_tokens == 1
    else:
        assert sizes == [("a", 8)]
        assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    h.run()
    assert b.num_output_tokens == 1
    h.done()
