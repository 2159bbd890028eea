"""The KV cache's blocks, in pure Python (no torch): the pool of physical blocks (reference
counts, an O(1) LRU free queue, the prefix-cache index of chained block hashes) and, on top of
it, the manager's per-request block tables and prefix-cache lookups. They decide which blocks a
request owns; the model runner owns the tensors and turns block ids into slots. `None` from
allocate_slots means "not now" (pool too full); an exception means misuse.

Block lifecycle:
  free       ref_cnt 0, no hash, in the free queue
  allocated  ref_cnt >= 1, not in the free queue
  cached     has a block_hash and sits in the hash index (allocated or evictable)
  shared     ref_cnt >= 2 (prefix-cache hit by a second request)
  evictable  ref_cnt 0 but still cached: in the free queue, reusable by a cache hit (touch)
  evicted    popped from the free queue for new use: its hash is dropped from the index
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.common.engine.request import Request

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: collision resistant and stable across processes.

    sha256 (not Python's hash) so that a crafted prompt cannot alias another user's prefix and
    so that routers and nodes on other hosts compute the same value.
    """
    h = hashlib.sha256(parent or b"\0")
    h.update(array("q", token_ids).tobytes())
    return h.digest()[:16]


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, num_tokens: int
) -> list[BlockHash]:
    """hashes, the chain of token_ids' first full blocks, extended in place to every full
    block among the first num_tokens tokens: the one chaining of engine and router alike."""
    for start in range(len(hashes) * block_size, num_tokens - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size]))
    return hashes


def hash_token_blocks(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Chained hashes of every full block of token_ids."""
    return extend_block_hashes([], token_ids, block_size, len(token_ids))


class PrefixEvents:
    """Which hashes joined or left the prefix-cache index since the last drain.

    A node's heartbeat carries them so a router can send each prompt where its leading blocks
    are cached. Bounded: past `limit` pending changes it forgets them and the next drain is a
    full snapshot of the index instead (as is the first one).
    """

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self.pending: dict[BlockHash, bool] = {}  # hash -> cached now; the last change wins
        self.overflow = True  # start with a snapshot

    def resync(self) -> None:
        """Make the next drain a full snapshot."""
        self.overflow = True
        self.pending.clear()

    def record(self, block_hash: BlockHash, cached: bool) -> None:
        if self.overflow:
            return
        self.pending[block_hash] = cached
        if len(self.pending) > self.limit:
            self.resync()

    def drain(
        self, index: Iterable[BlockHash]
    ) -> tuple[bool, tuple[BlockHash, ...], tuple[BlockHash, ...]]:
        """(is_snapshot, stored, removed) since the last drain; a snapshot lists `index`."""
        if self.overflow:
            self.overflow = False
            return True, tuple(index), ()
        stored = tuple(h for h, cached in self.pending.items() if cached)
        removed = tuple(h for h, cached in self.pending.items() if not cached)
        self.pending.clear()
        return False, stored, removed


@dataclass(slots=True)
class TierLoads:
    """What a request's prefix lookups took from the tiers below the pool: blocks loaded by
    tier name, blocks the cost model chose to recompute rather than load (`LoadCost`), the
    bytes and tokens loaded, and the monotonic times the first lookup began and the last
    one ended."""

    blocks: dict[str, int] = field(default_factory=dict)
    recompute_chosen: int = 0
    bytes: int = 0
    tokens: int = 0  # loaded (what `PrefixCacheStats.tier_hits` counted of them)
    start: float = 0.0
    end: float = 0.0

    def add(self, walk: TierLoads) -> None:
        for name, n in walk.blocks.items():
            self.blocks[name] = self.blocks.get(name, 0) + n
        self.recompute_chosen += walk.recompute_chosen
        self.bytes += walk.bytes
        self.tokens += walk.tokens
        self.start = self.start or walk.start
        self.end = walk.end


class BlockTiers(Protocol):
    """Where full blocks go when the pool evicts them and come back from on a prefix miss
    (host memory, a shared store: `kv_store.PoolTiers`). The manager stays free of tensors:
    the tiers copy a block's pages themselves, by block id."""

    walk: TierLoads  # what the walk under way loaded and chose to recompute (`begin_walk`)

    def offload(self, block_hash: BlockHash, block_id: int, wait: bool = False) -> None:
        """Keep a copy of the block's pages (called as the block is reused): taken at the
        next `fence`, or now with `wait`, which also waits for a shared store's write."""

    def fence(self) -> None:
        """Copy out the pages of every block offloaded since the last fence: called before
        anything writes into a block (a load, a transfer's pages)."""

    def forward(self) -> AbstractContextManager[None]:
        """Around the step's forward: `fence` first; the tiers' background writers wait for
        its end (their CPU would slow the forward's threads)."""

    def begin_walk(self, first: int, end: int, hashes: Sequence[BlockHash] = ()) -> None:
        """`load` will be asked for a request's blocks `first`..`end - 1` (`hashes`: a store
        can read them a run at a time), in order, up to the first miss (the tiers decide per
        contiguous run whether loading beats recomputing)."""

    def load(self, block_hash: BlockHash, block_id: int, at: int) -> bool:
        """Write the verified pages of `block_hash` (the request's block `at`) into the block;
        False on any miss, or when the tiers chose to have it recomputed."""


class KVCacheBlock:
    """One physical block. prev_free/next_free link it into the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "is_null", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.is_null = False
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order (head = evicted first).

    Every operation is O(1), including removing a block from the middle when a cache hit
    revives an evictable block.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels keep the link logic branch-free
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, f"{block} not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} already free"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """All physical blocks of one KV cache, with the prefix-cache index.

    Block 0 is the null block: never handed out, never freed; padding in block tables
    points at it.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks >= 2, "need the null block and at least one real block"
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.prefix_events: PrefixEvents | None = None  # set by nodes that report their cache
        self.tiers: BlockTiers | None = None  # evicted full blocks go there (KVCacheManager)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that get_new_blocks can hand out now (free or evictable)."""
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by some request."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks from the head of the free queue, evicting cached ones."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.tiers is not None:  # its pages are still intact: nothing wrote it since
            self.tiers.offload(block.block_hash, block.block_id)
        self.forget(block)

    def forget(self, block: KVCacheBlock) -> None:
        """Drop the block's hash from the index (its pages are no use to anyone now)."""
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            if self.prefix_events is not None:
                self.prefix_events.record(block.block_hash, False)
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, reviving evictable ones from the free queue."""
        for block in blocks:
            assert not block.is_null, "the null block is never shared"
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the queue's tail
        in the given order (callers pass a request's blocks tail first, so its tail is
        evicted before its shareable head)."""
        for block in ordered:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full block under its chained hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # an identical block is already indexed; this copy stays private
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self.prefix_events is not None:
            self.prefix_events.record(block_hash, True)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is referenced."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.prefix_events is not None:
            self.prefix_events.resync()  # the next report is a (now empty) snapshot
        return True

    def check_integrity(self) -> None:
        """Assert the pool's invariants: every block is exactly one of free or referenced,
        the queue count is right, and the hash index points at blocks that carry the hash."""
        in_queue = set()
        for block in self.free_queue:
            assert block.block_id not in in_queue, f"{block} twice in free queue"
            in_queue.add(block.block_id)
        assert len(in_queue) == self.free_queue.num_free, "free queue count out of sync"
        assert 0 not in in_queue and self.null_block.ref_cnt == 0, "null block misused"
        for block in self.blocks[1:]:
            assert block.ref_cnt >= 0, f"{block} negative ref count"
            is_free = block.block_id in in_queue
            assert is_free == (block.ref_cnt == 0), f"{block} free={is_free} mismatch"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"{block} hash index out of sync"


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
    hits: int = 0  # of which served from the cache (the pool or a tier)
    tier_hits: int = 0  # of which loaded from a tier below the pool

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Owns every request's block table; the only caller of BlockPool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        tiers: BlockTiers | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.pool.tiers = tiers if enable_caching else None
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.req_num_cached: dict[str, int] = {}  # leading blocks already indexed
        # Blocks a finished request left that remote writes may still reach (a cancelled
        # nixl transfer): owned by the key until `release_held`.
        self.held: dict[str, list[KVCacheBlock]] = {}
        # History pull (a decode node with a shared store): a request's answer blocks go to
        # the tiers when it ends, for the next turn's prefill node (`_store_answer`).
        self.store_answers = False
        self.stats = PrefixCacheStats()
        # What each request's lookups took from the tiers (only requests a tier served or the
        # cost model turned to recompute; until `free`): a traced request's span reads it.
        self.req_tier_loads: dict[str, TierLoads] = {}

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
        return extend_block_hashes(hashes, tokens, self.block_size, len(tokens))

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of the request, in whole blocks.

        Never covers the last token: its logits are needed, so at least one token is
        always computed.
        """
        if not self.enable_caching:
            return KVCacheBlocks(), 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._hashes(request)[:max_blocks]
        hits: list[KVCacheBlock] = []
        for block_hash in hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.pool.tiers is not None and len(hits) < len(hashes):
            self.stats.tier_hits += self._load_from_tiers(request, hits, hashes[len(hits) :])
        n_tokens = len(hits) * self.block_size
        self.stats.queries += request.num_tokens
        self.stats.hits += n_tokens
        return KVCacheBlocks(tuple(hits)), n_tokens

    def _load_from_tiers(
        self, request: Request, hits: list[KVCacheBlock], missing: list[BlockHash]
    ) -> int:
        """Extend `hits` with the blocks after them that a tier holds, each loaded into a
        pool block and indexed like a computed one; stops at the first miss (the rest is
        recomputed); returns the tokens loaded. The hits are held while loading so that
        taking a block for a load never evicts one of them; afterwards every one is
        evictable again until allocate_slots touches it, as pool hits are."""
        assert self.pool.tiers is not None
        self.pool.touch(hits)
        held, loaded, start = list(hits), 0, time.monotonic()
        self.pool.tiers.begin_walk(len(hits), len(hits) + len(missing), missing)
        for block_hash in missing:
            block = self.pool.get_cached_block(block_hash)  # a later block may still be here
            if block is not None:
                self.pool.touch([block])
            elif self.pool.num_free_blocks:
                (block,) = self.pool.get_new_blocks(1)
                if not self.pool.tiers.load(block_hash, block.block_id, len(hits)):
                    self.pool.free_blocks([block])
                    break
                self.pool.cache_block(block, block_hash)
                loaded += self.block_size
            else:
                break
            held.append(block)
            hits.append(block)
        self.pool.free_blocks(reversed(held))
        walk = self.pool.tiers.walk
        if walk.blocks or walk.recompute_chosen:
            walk.start, walk.end, walk.tokens = start, time.monotonic(), loaded
            self.req_tier_loads.setdefault(request.request_id, TierLoads()).add(walk)
        return loaded

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
        else:  # another node's pages may arrive in them at any time from now on
            self.fence()
        return KVCacheBlocks(tuple(new_blocks))

    def fence(self) -> None:
        """Before anything writes KV into a block: the blocks evicted since the last fence
        have their pages copied to the tiers (`BlockTiers.fence`)."""
        if self.pool.tiers is not None:
            self.pool.tiers.fence()

    def forward(self) -> AbstractContextManager[None]:
        """Around the step's forward, which may write any block: `BlockTiers.forward`."""
        return nullcontext() if self.pool.tiers is None else self.pool.tiers.forward()

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Index every full block up to num_tokens. Safe before the forward runs: within a
        layer every token's KV is stored before any attention reads the cache (but see
        `unschedule`)."""
        if not self.enable_caching:
            return
        rid = request.request_id
        owned = self.req_blocks[rid]
        hashes = self._hashes(request)
        n_full = num_tokens // self.block_size
        for i in range(self.req_num_cached.get(rid, 0), n_full):
            self.pool.cache_block(owned[i], hashes[i])
        self.req_num_cached[rid] = max(n_full, self.req_num_cached.get(rid, 0))

    def unschedule(self, request: Request) -> None:
        """The request's step will not run after all (preempted within the schedule that gave
        it tokens): the blocks that step's allocation indexed past its computed tokens hold no
        KV yet, so they leave the index, and neither a prefix hit nor a tier (`free` and
        eviction write indexed blocks down) ever takes their pages."""
        rid = request.request_id
        first = request.num_computed_tokens // self.block_size
        for block in self.req_blocks.get(rid, [])[first:]:
            if block.block_hash is not None:
                assert block.ref_cnt == 1, f"{block}: an unwritten block was shared"
                self.pool.forget(block)
        self.req_num_cached[rid] = min(first, self.req_num_cached.get(rid, 0))

    def trim(self, request: Request) -> None:
        """Give back the blocks past the request's known tokens: a verify step allocated them
        for drafts it rejected. None of them is cached: a block joins the index only once
        every token in it is known (`cache_blocks`), and drafts never are."""
        owned = self.req_blocks.get(request.request_id, [])
        keep = -(-request.num_tokens // self.block_size)
        extra = owned[keep:]
        assert all(b.block_hash is None for b in extra), "a drafted block was cached"
        del owned[keep:]
        self.pool.free_blocks(reversed(extra))

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so shareable heads are evicted last."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_hashes.pop(request.request_id, None)
        self.req_num_cached.pop(request.request_id, None)
        self.req_tier_loads.pop(request.request_id, None)
        if self.store_answers and self.pool.tiers is not None:
            self._store_answer(request, blocks)
        self.pool.free_blocks(reversed(blocks))

    def _store_answer(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        """Write the request's indexed blocks from the one its first generated token falls in
        to the tiers now rather than at eviction. Indexed means full of known tokens whose KV
        a forward wrote (see `unschedule`): never a draft's or an unfinished position's."""
        assert self.pool.tiers is not None
        for block in blocks[request.num_prompt_tokens // self.block_size :]:
            if block.block_hash is not None:  # in the store before the next turn asks
                self.pool.tiers.offload(block.block_hash, block.block_id, wait=True)

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
