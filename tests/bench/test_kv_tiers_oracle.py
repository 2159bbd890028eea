"""The Belady oracle of `pdserve bench kv-tiers`: prefix hits as the engine counts them, the
farthest next use evicted, and no eviction order doing better on small sequences."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from pdserve.bench.kv_tiers_oracle import (
    BlockRequest,
    belady_hit_rate,
    belady_hits,
    next_uses,
)


def req(*blocks: str, lookups: int | None = None) -> BlockRequest:
    hashes = tuple(b.encode() for b in blocks)
    return BlockRequest(hashes, len(hashes) if lookups is None else lookups)


def test_next_uses_name_the_next_request_holding_each_block() -> None:
    uses = next_uses([req("a", "b"), req("b"), req("a")])
    assert uses == [{b"a": 2, b"b": 1}, {b"b": math.inf}, {b"a": math.inf}]


def test_unbounded_hits_are_the_leading_blocks_seen_before_up_to_the_lookups() -> None:
    requests = [req("a", "b", "c"), req("a", "b", "x"), req("a", "x", lookups=1), req("y", "b")]
    assert belady_hits(requests, None) == [0, 2, 1, 0]  # "b" after a miss is no hit


def test_the_farthest_next_use_leaves_where_lru_would_miss_everything() -> None:
    # Capacity 2, blocks a b c a b: LRU evicts a for c, then b for a, ... and hits nothing;
    # Belady drops c (never used again) and hits a and b.
    requests = [req(x) for x in "abcab"]
    assert belady_hits(requests, 2) == [0, 0, 0, 1, 1]
    assert belady_hits(requests, 0) == [0] * 5


def test_among_blocks_next_used_together_the_deepest_leaves_first() -> None:
    # a and b are both next used by the third request; with room for one, keeping the child
    # b would hit nothing (a lookup stops at the missing parent a).
    requests = [req("a", "b"), req("c"), req("a", "b")]
    assert belady_hits(requests, 1) == [0, 0, 1]


def test_prompts_are_hashed_as_the_engine_chains_their_blocks() -> None:
    doc = list(range(100, 132))  # two blocks of 16
    prompts = [doc + [7], doc + [8], [1] + doc]  # the third shares no leading block
    assert BlockRequest.of_prompt(doc, 16).lookups == 1  # never the last token
    # the second prompt's two blocks are the first's: 32 hit tokens of 99
    assert belady_hit_rate(prompts, 16, None) == pytest.approx(32 / 99)
    assert belady_hit_rate([], 16, None) == 0.0
    with pytest.raises(ValueError, match="-1 blocks"):
        belady_hits([], -1)


def best_by_search(requests: list[BlockRequest], capacity: int) -> int:
    """The most hits any choice of victims after each request gets (exhaustive)."""
    frontier = {frozenset(): 0}
    for r in requests:
        grown: dict[frozenset, int] = {}
        for cache, hits in frontier.items():
            n = next((i for i in range(r.lookups) if r.blocks[i] not in cache), r.lookups)
            full = cache | set(r.blocks)
            keep = min(capacity, len(full))
            for kept in itertools.combinations(sorted(full), keep):
                key = frozenset(kept)
                grown[key] = max(grown.get(key, -1), hits + n)
        frontier = grown
    return max(frontier.values())


@pytest.mark.parametrize("seed", range(30))
def test_no_eviction_order_beats_belady_on_single_block_requests(seed: int) -> None:
    rng = random.Random(seed)
    requests = [req(rng.choice("abcde")) for _ in range(9)]
    capacity = rng.randrange(1, 4)
    assert sum(belady_hits(requests, capacity)) == best_by_search(requests, capacity)
