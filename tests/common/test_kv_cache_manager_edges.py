"""KV-cache manager edges that mutation testing showed no test pinned (scripts/mutation.sh):
the hashes it indexes, blocks filled during decode, exact fits, counters, and the state a
freed request leaves behind."""

from __future__ import annotations

import pytest

from pdserve.common.engine.kv_cache_manager import KVCacheManager, hash_token_blocks
from pdserve.common.engine.request import Request
from pdserve.common.wire.payloads import SamplingParams

BS = 4


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def prefill(kv: KVCacheManager, r: Request) -> None:
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hits) is not None
    r.num_computed_tokens = r.num_tokens


def decode(kv: KVCacheManager, r: Request, token: int) -> None:
    r.append_output(token)
    assert kv.allocate_slots(r, 1) is not None
    r.num_computed_tokens += 1


def test_caching_is_on_by_default() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    prefill(kv, req("a", list(range(9))))
    assert kv.get_computed_blocks(req("b", list(range(9))))[1] == 8


def test_capacity_counts_every_usable_block() -> None:
    assert KVCacheManager(num_blocks=11, block_size=BS).capacity_tokens() == 40


def test_an_unknown_request_owns_no_blocks_and_holds_nothing() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    assert kv.block_ids("nobody") == []
    kv.hold("nobody", "xfer")
    assert kv.held == {}


def test_indexed_hashes_are_the_chained_hashes_routers_compute() -> None:
    """Prefix-aware routing compares these hashes with its own hash_token_blocks."""
    kv = KVCacheManager(num_blocks=11, block_size=BS)
    tokens = [7, 7, 7, 7, 1, 2, 3, 4, 1, 2, 3, 4, 9]
    prefill(kv, req("a", tokens))
    assert set(kv.pool.cached) == set(hash_token_blocks(tokens, BS))


def test_blocks_filled_during_decode_are_indexed_with_their_full_tokens() -> None:
    kv = KVCacheManager(num_blocks=11, block_size=BS)
    a = req("a", [1, 2, 3])  # shorter than a block: nothing to index after prefill
    prefill(kv, a)
    assert kv.pool.cached == {}
    for token in (4, 5, 6, 7, 8, 9):
        decode(kv, a, token)
    assert set(kv.pool.cached) == set(hash_token_blocks(a.all_token_ids, BS))
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(b)[1] == 8


def test_a_hit_may_cover_every_token_but_the_last() -> None:
    kv = KVCacheManager(num_blocks=11, block_size=BS)
    prefill(kv, req("a", list(range(12))))
    assert kv.get_computed_blocks(req("b", list(range(9))))[1] == 8


def test_hit_statistics_add_up_over_lookups() -> None:
    kv = KVCacheManager(num_blocks=11, block_size=BS)
    prefill(kv, req("a", list(range(9))))
    kv.get_computed_blocks(req("b", list(range(9))))
    kv.get_computed_blocks(req("c", list(range(5))))
    assert (kv.stats.queries, kv.stats.hits) == (9 + 9 + 5, 0 + 8 + 4)
    assert kv.stats.hit_rate == pytest.approx(12 / 23)


def test_a_hit_allocates_only_the_blocks_past_it() -> None:
    kv = KVCacheManager(num_blocks=11, block_size=BS)
    prefill(kv, req("a", list(range(12))))
    b = req("b", list(range(12)))
    hits, n = kv.get_computed_blocks(b)
    new = kv.allocate_slots(b, b.num_tokens - n, hits)
    assert n == 8 and new is not None and len(new) == 1
    assert len(kv.block_ids("b")) == 3
    kv.check_integrity()  # two owners of each shared block


def test_revived_hits_fit_exactly_into_the_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable blocks
    a = req("a", list(range(12)))
    prefill(kv, a)
    kv.free(a)  # 3 evictable cached blocks
    b = req("b", list(range(12)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8  # 2 revived hits + 1 new block = the 3 free ones
    assert kv.allocate_slots(b, b.num_tokens - n, hits) is not None
    assert kv.num_free_blocks == 0


def test_allocating_nothing_is_misuse() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    with pytest.raises(AssertionError, match="^allocate at least one token$"):
        kv.allocate_slots(req("a", [1]), 0)


def test_a_freed_request_leaves_no_state_behind() -> None:
    kv = KVCacheManager(num_blocks=11, block_size=BS)
    a = req("a", list(range(9)))
    prefill(kv, a)
    kv.free(a)
    assert (kv.req_blocks, kv.req_hashes, kv.req_num_cached) == ({}, {}, {})


def test_integrity_checks_the_first_usable_block_too() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    prefill(kv, req("a", [1, 2]))
    assert kv.block_ids("a") == [1]
    kv.req_blocks["a"].append(kv.pool.blocks[1])  # owned twice, referenced once
    with pytest.raises(AssertionError, match="ref_cnt != 2 owners"):
        kv.check_integrity()


def test_each_block_is_offered_to_the_index_once_when_it_fills() -> None:
    """A private copy (its twin was indexed first) stays private: a later step of its request
    does not offer it again, even once the twin has been evicted."""
    kv = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable blocks
    a = req("a", [1, 2, 3, 4])
    prefill(kv, a)
    (h0,) = hash_token_blocks([1, 2, 3, 4], BS)
    b = req("b", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(b, 5) is not None  # no hits passed: b's first block is a copy
    b.num_computed_tokens = 5
    kv.free(a)
    prefill(kv, req("c", [7, 7, 7, 7]))  # takes a's block: the twin is evicted
    assert kv.pool.get_cached_block(h0) is None
    decode(kv, b, 6)
    assert kv.pool.get_cached_block(h0) is None


def test_a_lookup_stops_at_the_first_block_missing_from_the_cache() -> None:
    """The prompt's first block was evicted while its second and third stay indexed: the hit
    is empty, never the later blocks standing in for the earlier ones."""
    kv = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable blocks
    tokens = list(range(3 * BS + 1))
    hashes = hash_token_blocks(tokens, BS)
    blocks = kv.pool.get_new_blocks(3)
    for block, block_hash in zip(blocks, hashes, strict=True):
        kv.pool.cache_block(block, block_hash)
    kv.pool.free_blocks(blocks)  # head first: the prompt's first block is evicted first
    assert kv.pool.get_new_blocks(1) == [blocks[0]]
    assert set(kv.pool.cached) == set(hashes[1:])
    hits, n = kv.get_computed_blocks(req("a", tokens))
    assert (hits.block_ids, n) == ([], 0)
