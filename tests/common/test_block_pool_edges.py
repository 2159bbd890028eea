"""Block pool edges that mutation testing showed no test pinned (scripts/mutation.sh): the hash
value itself, partial blocks, the event limit, the smallest pool, and what each misuse says."""

from __future__ import annotations

import pytest

from pdserve.common.engine.kv_cache_manager import (
    BlockPool,
    FreeBlockQueue,
    KVCacheBlock,
    PrefixEvents,
    hash_block_tokens,
    hash_token_blocks,
)


def test_block_hashes_are_pinned_values() -> None:
    """Routers and nodes on other hosts, and other releases, must compute the same hashes."""
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first.hex() == "5e957b4b790f828aca0343b142059503"
    assert hash_block_tokens(first, [5, 6, 7, 8]).hex() == "b823493295d9628e8ac3ad5d5dde0b7e"


@pytest.mark.parametrize("length", [0, 3, 4, 7, 8, 11])
def test_only_full_blocks_are_hashed(length: int) -> None:
    tokens = list(range(length))
    hashes = hash_token_blocks(tokens, 4)
    assert len(hashes) == length // 4
    assert hashes == hash_token_blocks(tokens[: length // 4 * 4], 4)


def test_prefix_events_keep_exactly_limit_changes() -> None:
    events = PrefixEvents(limit=2)
    events.drain(())  # the first report is a snapshot
    events.record(b"a", True)
    events.record(b"b", True)
    assert events.drain(()) == (False, (b"a", b"b"), ())
    for h in (b"a", b"b", b"c"):
        events.record(h, False)
    assert events.drain([b"z"]) == (True, (b"z",), ())


def test_prefix_events_default_limit_is_4096() -> None:
    events = PrefixEvents()
    events.drain(())
    for i in range(4096):
        events.record(i.to_bytes(4, "big"), True)
    snapshot, stored, _ = events.drain(())
    assert not snapshot and len(stored) == 4096
    for i in range(4097):
        events.record(i.to_bytes(4, "big"), True)
    assert events.drain(())[0]


def test_a_fresh_block_is_shown_uncached() -> None:
    pool = BlockPool(3)
    assert repr(pool.blocks[1]) == "KVCacheBlock(id=1, ref=0, cached=False)"
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, b"h" * 16)
    assert repr(block) == f"KVCacheBlock(id={block.block_id}, ref=1, cached=True)"


def test_an_empty_free_queue_says_so() -> None:
    queue = FreeBlockQueue([])
    with pytest.raises(ValueError, match="^no free blocks$"):
        queue.popleft()
    queue.append(KVCacheBlock(7))
    assert queue.popleft().block_id == 7
    with pytest.raises(ValueError, match="^no free blocks$"):
        queue.popleft()


def test_the_smallest_pool_has_one_usable_block() -> None:
    pool = BlockPool(2)
    assert [b.block_id for b in pool.get_new_blocks(1)] == [1]
    with pytest.raises(AssertionError, match="^need the null block and at least one real block$"):
        BlockPool(1)


def test_over_allocation_names_the_counts() -> None:
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="^asked for 4 blocks, 3 free$"):
        pool.get_new_blocks(4)


def test_touching_the_null_block_is_refused() -> None:
    pool = BlockPool(3)
    with pytest.raises(AssertionError, match="^the null block is never shared$"):
        pool.touch([pool.null_block])


def test_integrity_names_a_wrong_free_count() -> None:
    pool = BlockPool(4)
    pool.free_queue.num_free += 1
    with pytest.raises(AssertionError, match="^free queue count out of sync$"):
        pool.check_integrity()


def test_integrity_names_a_null_block_in_the_free_queue() -> None:
    pool = BlockPool(4)
    pool.free_queue.append(pool.null_block)
    with pytest.raises(AssertionError, match="^null block misused$"):
        pool.check_integrity()


def test_integrity_names_a_referenced_null_block() -> None:
    pool = BlockPool(4)
    pool.null_block.ref_cnt = 1
    with pytest.raises(AssertionError, match="^null block misused$"):
        pool.check_integrity()
