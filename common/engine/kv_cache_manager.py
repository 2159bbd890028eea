"""Per-request block tables on top of the BlockPool, with prefix-cache lookups.

Pure Python: it decides which physical blocks a request owns; the model runner turns block
ids into slots. `None` from allocate_slots means "not now" (pool too full); an exception
means misuse.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.engine.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block_tokens
from pdserve.common.engine.request import Request


@dataclass(frozen=True, slots=True)
class KVCacheBlocks:
    """Blocks handed across the manager's boundary; callers read ids, never mutate blocks."""

    blocks: tuple[KVCacheBlock, ...] = ()

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks)


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Owns every request's block table; the only caller of BlockPool."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.req_num_cached: dict[str, int] = {}  # leading blocks already indexed
        # Blocks a finished request left that remote writes may still reach (a cancelled
        # nixl transfer): owned by the key until `release_held`.
        self.held: dict[str, list[KVCacheBlock]] = {}
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def capacity_tokens(self) -> int:
        """The most tokens one request can ever hold (every usable block)."""
        return (self.pool.num_blocks - 1) * self.block_size

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def _hashes(self, request: Request) -> list[BlockHash]:
        """Chained hashes of the request's full blocks, extended incrementally."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        bs = self.block_size
        while (len(hashes) + 1) * bs <= len(tokens):
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[start : start + bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of the request, in whole blocks.

        Never covers the last token: its logits are needed, so at least one token is
        always computed.
        """
        if not self.enable_caching:
            return KVCacheBlocks(), 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in self._hashes(request)[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        n_tokens = len(hits) * self.block_size
        self.stats.queries += request.num_tokens
        self.stats.hits += n_tokens
        return KVCacheBlocks(tuple(hits)), n_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed: KVCacheBlocks = KVCacheBlocks(),
        cache: bool = True,
    ) -> KVCacheBlocks | None:
        """Make room for num_new_tokens after the request's computed (and newly hit) tokens.

        Returns the newly allocated blocks, or None when the pool cannot supply them now.
        cache=False leaves the blocks out of the prefix index (their KV arrives from another
        node later; call cache_blocks once it has).
        """
        assert num_new_tokens >= 1, "allocate at least one token"
        owned = self.req_blocks.setdefault(request.request_id, [])
        n_hit_tokens = len(new_computed) * self.block_size
        total = request.num_computed_tokens + n_hit_tokens + num_new_tokens
        n_needed = -(-total // self.block_size) - len(owned) - len(new_computed)
        # Hits sitting in the free queue stop being free once touched.
        n_revived = sum(1 for b in new_computed.blocks if b.ref_cnt == 0)
        if n_needed > self.pool.num_free_blocks - n_revived:
            return None
        self.pool.touch(new_computed.blocks)
        owned.extend(new_computed.blocks)
        new_blocks = self.pool.get_new_blocks(max(n_needed, 0))
        owned.extend(new_blocks)
        if cache:
            self.cache_blocks(request, min(total, request.num_tokens))
        return KVCacheBlocks(tuple(new_blocks))

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Index every full block up to num_tokens. Safe before the forward runs: within a
        layer every token's KV is stored before any attention reads the cache."""
        if not self.enable_caching:
            return
        rid = request.request_id
        owned = self.req_blocks[rid]
        hashes = self._hashes(request)
        n_full = num_tokens // self.block_size
        for i in range(self.req_num_cached.get(rid, 0), n_full):
            self.pool.cache_block(owned[i], hashes[i])
        self.req_num_cached[rid] = max(n_full, self.req_num_cached.get(rid, 0))

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so shareable heads are evicted last."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_hashes.pop(request.request_id, None)
        self.req_num_cached.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def hold(self, request_id: str, key: str) -> None:
        """Keep the request's blocks out of the free pool under `key` when it is freed."""
        blocks = self.req_blocks.pop(request_id, None)
        if blocks:
            self.held[key] = blocks

    def release_held(self, key: str) -> None:
        """Free blocks kept by `hold`; idempotent."""
        self.pool.free_blocks(reversed(self.held.pop(key, [])))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants, plus: reference counts equal the number of owning requests (and
        holds)."""
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for blocks in [*self.req_blocks.values(), *self.held.values()]:
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks[1:]:
            got = refs.get(block.block_id, 0)
            assert block.ref_cnt == got, f"{block} ref_cnt != {got} owners"
