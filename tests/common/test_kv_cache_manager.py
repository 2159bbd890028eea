"""KVCacheManager: block tables, prefix-cache hits, sharing, eviction, frees."""

from __future__ import annotations

import pytest

from pdserve.common.engine.kv_cache_manager import KVCacheManager
from pdserve.common.engine.request import Request
from pdserve.common.wire.payloads import SamplingParams

BS = 4


@pytest.fixture
def kv():
    m = KVCacheManager(num_blocks=11, block_size=BS, enable_caching=True)
    yield m
    m.check_integrity()


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def run_prefill(kv: KVCacheManager, r: Request) -> list[int]:
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hits) is not None
    r.num_computed_tokens = r.num_tokens
    return kv.block_ids(r.request_id)


def test_allocation_rounds_up_to_blocks(kv):
    r = req("a", list(range(10)))
    ids = run_prefill(kv, r)
    assert len(ids) == 3 and kv.num_free_blocks == 7
    kv.free(r)
    assert kv.num_free_blocks == 10


def test_decode_growth_allocates_only_at_block_boundary(kv):
    r = req("a", list(range(8)))
    run_prefill(kv, r)
    r.append_output(100)
    new = kv.allocate_slots(r, 1)
    assert new is not None and len(new) == 1  # token 9 starts block 3
    r.num_computed_tokens += 1
    r.append_output(101)
    assert len(kv.allocate_slots(r, 1)) == 0
    kv.free(r)


def test_prefix_hit_shares_blocks_and_never_covers_last_token(kv):
    a = req("a", list(range(12)))
    ids_a = run_prefill(kv, a)
    b = req("b", list(range(12)))  # identical prompt: last token must still be computed
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and hits.block_ids == ids_a[:2]
    kv.allocate_slots(b, 4, hits)
    assert kv.block_ids("b")[:2] == ids_a[:2]
    assert all(kv.pool.blocks[i].ref_cnt == 2 for i in ids_a[:2])  # shared
    assert kv.stats.hits == 8 and kv.stats.queries == 24
    kv.free(a)
    kv.free(b)


def test_hit_on_evictable_blocks_revives_them(kv):
    a = req("a", list(range(9)))
    ids_a = run_prefill(kv, a)
    kv.free(a)  # blocks now evictable, still indexed
    b = req("b", list(range(8)) + [50, 51])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and hits.block_ids == ids_a[:2]
    assert kv.allocate_slots(b, 2, hits) is not None
    assert all(kv.pool.blocks[i].ref_cnt == 1 for i in ids_a[:2])
    kv.free(b)


def test_allocation_counts_revived_hits_against_free_blocks(kv):
    a = req("a", list(range(40)))  # all 10 usable blocks
    ids = run_prefill(kv, a)
    assert len(ids) == 10
    kv.free(a)
    b = req("b", list(range(37)) + [99] * 7)  # 9 hit blocks + needs 2 more = 11 > 10
    hits, n = kv.get_computed_blocks(b)
    assert n == 36
    assert kv.allocate_slots(b, b.num_tokens - n, hits) is None  # not now, nothing changed
    assert kv.num_free_blocks == 10


def test_evicted_block_no_longer_hits(kv):
    a = req("a", list(range(8)) + [1])
    run_prefill(kv, a)
    kv.free(a)
    filler = req("f", list(range(100, 140)))  # takes every block, evicting a's
    run_prefill(kv, filler)
    b = req("b", list(range(8)) + [2])
    assert kv.get_computed_blocks(b)[1] == 0
    kv.free(filler)


def test_none_when_pool_is_full(kv):
    a = req("a", list(range(40)))
    run_prefill(kv, a)
    b = req("b", [1, 2, 3])
    assert kv.allocate_slots(b, 3) is None
    kv.free(a)
    kv.free(b)  # freeing a request that holds nothing is harmless


def test_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=11, block_size=BS, enable_caching=False)
    a = req("a", list(range(12)))
    run_prefill(kv, a)
    b = req("b", list(range(12)))
    assert kv.get_computed_blocks(b) == (kv.get_computed_blocks(b)[0], 0)
    kv.free(a)
    kv.check_integrity()


def test_free_releases_tail_first(kv):
    a = req("a", list(range(12)))
    ids = run_prefill(kv, a)
    kv.free(a)
    order = [b.block_id for b in kv.pool.free_queue]
    assert order[-3:] == ids[::-1]


def test_held_blocks_stay_out_of_the_pool_until_released(kv):
    """A decode node holds a cancelled nixl transfer's blocks (remote writes may still land)
    past the request's end; they count as owned, and free only on release."""
    r = req("a", list(range(10)))
    ids = run_prefill(kv, r)
    kv.hold("a", "xfer-1")
    kv.free(r)  # the request ends: its blocks stay held
    assert kv.num_free_blocks == 7 and [b.block_id for b in kv.held["xfer-1"]] == ids
    kv.check_integrity()
    other = req("b", list(range(100, 128)))  # 7 blocks: exactly what is free
    assert set(run_prefill(kv, other)).isdisjoint(ids)
    kv.free(other)
    kv.release_held("xfer-1")
    kv.release_held("xfer-1")  # idempotent
    assert kv.num_free_blocks == 10 and not kv.held
