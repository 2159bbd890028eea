"""BlockPool through every state of the block lifecycle:
free -> allocated -> cached -> shared -> evictable -> (revived | evicted)."""

from __future__ import annotations

import pytest

from pdserve.common.engine.kv_cache_manager import (
    BlockPool,
    FreeBlockQueue,
    KVCacheBlock,
    PrefixEvents,
    hash_token_blocks,
)


@pytest.fixture
def pool():
    p = BlockPool(num_blocks=9, enable_caching=True)
    yield p
    p.check_integrity()


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def test_fresh_pool_is_all_free_except_null(pool):
    assert pool.num_free_blocks == 8
    assert free_ids(pool) == list(range(1, 9))
    assert pool.null_block.is_null and pool.null_block.ref_cnt == 0
    assert pool.usage == 0.0


def test_allocate_takes_from_head_and_sets_ref(pool):
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 5
    assert pool.usage == pytest.approx(3 / 8)


def test_over_allocation_raises_and_changes_nothing(pool):
    with pytest.raises(ValueError):
        pool.get_new_blocks(9)
    assert pool.num_free_blocks == 8


def test_free_appends_to_tail_in_given_order(pool):
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 5, 6, 7, 8, 3, 2, 1]


def test_double_free_is_caught(pool):
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([block])


def test_cached_shared_evictable_revived(pool):
    (block,) = pool.get_new_blocks(1)
    h = hash_token_blocks(list(range(4)), 4)[0]
    pool.cache_block(block, h)  # allocated + cached
    assert pool.get_cached_block(h) is block
    pool.touch([block])  # shared by a second owner
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    pool.free_blocks([block])  # evictable: free but still indexed
    assert block.ref_cnt == 0 and block.block_id in free_ids(pool)
    assert pool.get_cached_block(h) is block
    pool.touch([block])  # cache hit revives it out of the free queue
    assert block.ref_cnt == 1 and block.block_id not in free_ids(pool)
    pool.free_blocks([block])


def test_eviction_drops_hash_when_block_is_reused(pool):
    blocks = pool.get_new_blocks(8)
    hashes = hash_token_blocks(list(range(32)), 4)
    for b, h in zip(blocks, hashes):
        pool.cache_block(b, h)
    pool.free_blocks(reversed(blocks))  # all evictable, tail of the request first in line
    (reused,) = pool.get_new_blocks(1)
    assert reused is blocks[-1]
    assert reused.block_hash is None
    assert pool.get_cached_block(hashes[-1]) is None  # evicted
    assert pool.get_cached_block(hashes[0]) is blocks[0]  # the shareable head survives
    pool.free_blocks([reused])


def test_first_writer_wins_for_identical_blocks(pool):
    a, b = pool.get_new_blocks(2)
    h = hash_token_blocks([7, 7, 7, 7], 4)[0]
    pool.cache_block(a, h)
    pool.cache_block(b, h)
    assert pool.get_cached_block(h) is a and b.block_hash is None
    pool.free_blocks([a, b])


def test_caching_disabled_never_indexes():
    pool = BlockPool(4, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, b"x" * 16)
    assert pool.get_cached_block(b"x" * 16) is None
    pool.free_blocks([block])
    pool.check_integrity()


def test_reset_prefix_cache_only_when_idle(pool):
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, b"h" * 16)
    assert not pool.reset_prefix_cache()
    pool.free_blocks([block])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"h" * 16) is None and block.block_hash is None


def test_integrity_check_detects_corruption(pool):
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt = 0  # pretend someone forgot to put it back
    with pytest.raises(AssertionError):
        pool.check_integrity()
    block.ref_cnt = 1
    pool.free_blocks([block])


def test_free_queue_remove_from_middle_is_linked_correctly():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and q.num_free == 4
    q.append(blocks[2])
    assert q.popleft() is blocks[0]
    assert [b.block_id for b in q] == [1, 3, 4, 2]


def test_block_hash_is_chained_and_stable():
    a = hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_token_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[1] != b[1]  # same block tokens, different parent
    assert hash_token_blocks([1, 2, 3, 4, 5], 4) == a[:1]  # partial block is not hashed
    # Stable across processes and Python versions (sha256), pinned here.
    assert a[0].hex() == hash_token_blocks([1, 2, 3, 4], 4)[0].hex()
    assert len(a[0]) == 16


def test_prefix_events_report_a_snapshot_then_changes_and_resync_when_full():
    pool = BlockPool(8)
    events = pool.prefix_events = PrefixEvents(limit=3)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, b"ha")
    assert events.drain(pool.cached) == (True, (b"ha",), ())  # the first report: a snapshot
    pool.cache_block(b, b"hb")
    pool.free_blocks([b])
    pool.get_new_blocks(5)  # takes every free block: b is evicted
    pool.cache_block(c, b"hc")
    assert events.drain(pool.cached) == (False, (b"hc",), (b"hb",))
    assert events.drain(pool.cached) == (False, (), ())
    for i in range(4):  # more changes than the limit: the next report is a snapshot again
        events.record(b"h%d" % i, True)
    assert events.drain(pool.cached) == (True, (b"ha", b"hc"), ())
    events.record(b"hd", True)
    events.record(b"hd", False)  # the last change of a hash wins
    assert events.drain(pool.cached) == (False, (), (b"hd",))
