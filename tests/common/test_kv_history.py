"""What the KV cache manager hands its tiers (issue 40): only blocks whose KV a forward wrote,
and, on a decode node with a shared store (history pull), a request's answer blocks when it
ends. A block is indexed when its step is scheduled, before the forward runs: a request
preempted within that same schedule must take such a block out of the index unwritten."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from pdserve.common.engine.kv_cache_manager import KVCacheManager, TierLoads, hash_token_blocks
from pdserve.common.engine.request import Request
from pdserve.common.wire.payloads import SamplingParams
from tests.common.test_scheduler import Harness

BS = 4


class Recorder:
    """BlockTiers that keeps what it is given (hash -> block id) and serves nothing."""

    def __init__(self) -> None:
        self.offloaded: dict[bytes, int] = {}
        self.walk = TierLoads()

    def offload(self, block_hash: bytes, block_id: int, wait: bool = False) -> None:
        self.offloaded[block_hash] = block_id

    def begin_walk(self, first: int, end: int, hashes: object = ()) -> None:
        pass

    def fence(self) -> None:
        pass

    def forward(self) -> AbstractContextManager[None]:
        return nullcontext()

    def load(self, block_hash: bytes, block_id: int, at: int) -> bool:
        return False


def test_a_block_indexed_in_a_step_whose_forward_never_ran_is_never_offloaded() -> None:
    """Priority preemption of a request already scheduled in the step: "lo" (index 0 of
    running) fills its second block at step 6 and is indexed; "hi" then needs a block, none is
    free, and "lo" is preempted. Its second block's last position was never computed: the block
    goes back unindexed, so neither the history write on its free nor its eviction when "hi"
    takes it offloads it, and no prefix hit finds it."""
    h = Harness(num_blocks=5, block_size=BS, policy="priority")  # 4 usable blocks
    tiers = Recorder()
    h.kv.pool.tiers = tiers
    h.kv.store_answers = True  # a freed request's blocks go down at once, as on a decode node
    lo = h.add("lo", [11, 12, 13], priority=5, max_tokens=8, ignore_eos=True)
    h.step()
    h.add("hi", [21, 22, 23, 24, 25], priority=0, max_tokens=8, ignore_eos=True)
    for _ in range(4):  # steps 2-5: both decode, every block taken by step 3
        h.step()
    assert lo.num_tokens == 8 and h.kv.num_free_blocks == 0
    stale = hash_token_blocks(lo.all_token_ids, BS)[1]  # position 7 not computed yet
    h.step()
    assert h.s.num_preemptions == 1 and lo not in h.s.running
    assert stale not in tiers.offloaded, "an unwritten block was offloaded"
    assert stale not in h.kv.pool.cached, "an unwritten block stayed in the prefix index"
    h.run()
    assert h.kv.num_free_blocks == 4


def finished_answer(store_answers: bool) -> tuple[Recorder, list[bytes]]:
    """A 9-token prompt answered with 7 tokens as a decode node runs it (one token a step),
    then freed; returns what the tiers got and the request's block hashes."""
    tiers = Recorder()
    kv = KVCacheManager(num_blocks=16, block_size=BS, tiers=tiers)
    kv.store_answers = store_answers
    r = Request("r", list(range(100, 109)), SamplingParams(max_tokens=8))
    assert kv.allocate_slots(r, r.num_tokens) is not None
    for token in range(200, 207):
        r.num_computed_tokens = r.num_tokens  # the step's forward ran
        r.append_output(token)
        assert kv.allocate_slots(r, 1) is not None
    r.num_computed_tokens = r.num_tokens
    kv.free(r)
    kv.check_integrity()
    return tiers, hash_token_blocks(r.all_token_ids, BS)


def test_a_decode_node_writes_its_answer_blocks_when_the_request_ends() -> None:
    """History pull: blocks 2 and 3 (tokens 8-15: the prompt's last token and the answer) go
    to the tiers at once; the prompt's blocks 0 and 1 do not (the prefill node has them)."""
    tiers, hashes = finished_answer(store_answers=True)
    assert len(hashes) == 4 and set(tiers.offloaded) == set(hashes[2:])
    tiers, _ = finished_answer(store_answers=False)
    assert not tiers.offloaded  # nothing evicted yet: the pool still holds every block
