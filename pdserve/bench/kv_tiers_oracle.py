"""The hit rate a prefix cache could have had: Belady's offline optimum (evict the block whose
next use is farthest away) over a request sequence's block hashes, for `pdserve bench
kv-tiers` to set each system's measured hit rate against a cache of the same size.

Hits count as the engine counts them: a request's leading blocks that the cache holds, up to
the blocks it may look up (never its last token), stopping at the first block it lacks. After
a request runs, every full block of its prompt is in the cache (as the engine indexes them);
then, over capacity, the blocks used farthest ahead (never again first; among equals, the
deepest in its chain, whose parent a lookup needs first) leave. Choosing the victims after the
request, among all blocks, makes the oracle at least as good as any cache that must choose
while the request holds its blocks: an upper bound for the engine's pool and tiers.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.common.engine.kv_cache_manager import BlockHash, hash_token_blocks


@dataclass(frozen=True, slots=True)
class BlockRequest:
    """One prompt as the cache sees it: its full blocks' chained hashes, and how many of the
    leading ones a lookup may hit (the engine never covers a prompt's last token)."""

    blocks: tuple[BlockHash, ...]
    lookups: int

    @classmethod
    def of_prompt(cls, prompt: Sequence[int], block_size: int) -> BlockRequest:
        return cls(tuple(hash_token_blocks(prompt, block_size)), (len(prompt) - 1) // block_size)


def next_uses(requests: Sequence[BlockRequest]) -> list[dict[BlockHash, float]]:
    """Per request, each of its blocks' next request index that uses it (inf: none)."""
    later: dict[BlockHash, float] = {}
    out: list[dict[BlockHash, float]] = [{} for _ in requests]
    for i in range(len(requests) - 1, -1, -1):
        out[i] = {h: later.get(h, math.inf) for h in requests[i].blocks}
        later.update(dict.fromkeys(requests[i].blocks, i))
    return out


def belady_hits(requests: Sequence[BlockRequest], capacity: int | None) -> list[int]:
    """Per request, the leading blocks a Belady cache of `capacity` blocks (None: unbounded)
    serves it."""
    if capacity is not None and capacity < 0:
        raise ValueError(f"a cache of {capacity} blocks")
    cache: dict[BlockHash, float] = {}  # block -> its next use
    heap: list[tuple[float, int, BlockHash]] = []  # (-next use, -depth, block), stale kept
    hits = []
    for req, uses in zip(requests, next_uses(requests)):
        n = 0
        while n < req.lookups and req.blocks[n] in cache:
            n += 1
        hits.append(n)
        for depth, h in enumerate(req.blocks):
            cache[h] = uses[h]
            heapq.heappush(heap, (-uses[h], -depth, h))
        while capacity is not None and len(cache) > capacity:
            negative_next, _, h = heapq.heappop(heap)
            if cache.get(h) == -negative_next:  # not an entry an update superseded
                del cache[h]
    return hits


def belady_hit_rate(prompts: Sequence[Sequence[int]], block_size: int,
                    capacity: int | None) -> float:  # fmt: skip
    """Prompt tokens served from a Belady cache of `capacity` blocks over all prompt tokens
    (the engine's prefix hit rate, `hits / queries`)."""
    requests = [BlockRequest.of_prompt(p, block_size) for p in prompts]
    total = sum(map(len, prompts))
    return block_size * sum(belady_hits(requests, capacity)) / total if total else 0.0
