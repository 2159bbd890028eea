"""The tiers under one engine's block pool (`KVCacheManager`'s `BlockTiers`): a block the pool
evicts is copied out of every layer's cache into the chain (host, then the shared store, whose
write is queued off the scheduler's path: `kv_store.write_behind`), and a prefix block the pool
lacks is copied back in from the first tier that holds an intact one.

A block's payload is its pages in every layer cache, in cache order, as raw bytes: the key's
layout digest names that order, the dtype and the shapes, so a payload of another length is
refused (a miss) before anything is written into the pool.

A walk's blocks are read from the shared store a run at a time (`RUN_BLOCKS` in one round
trip: a Redis MGET, one back-to-back pass over the files), not one round trip per block, and
still fail closed per block: the first miss or refused object ends the run, and the blocks
from it on are recomputed.

Which tiers a load asks is the cost model's call (`kv_store.cost.LoadCost`, --kv-load-policy):
a tier measured slower than recomputing is skipped, and its blocks are recomputed.

For tier-aware routing a node reports which blocks its host tier holds (as its pool's, by
change since the last report, or whole) and which it wrote to the shared store: every node of
that store (`store_id`) can load those, and which it found missing there or evicted from it
(docs/kv_tiers.md, "Tier-aware routing").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from pdserve.common.engine.kv_cache_manager import BlockHash, PrefixEvents, TierLoads
from pdserve.kv_store import open_store
from pdserve.kv_store.chain import TierChain
from pdserve.kv_store.cost import LoadCost
from pdserve.kv_store.host import HostTier
from pdserve.kv_store.key import BlockKey, KeySpace
from pdserve.kv_store.tier import KVTier, TierStats

# Evictions queued for the shared store at most (`kv_store.write_behind`): 64 MiB is about 180
# SmolLM2 blocks of 16 tokens in bf16; past it an eviction is not stored.
WRITE_BEHIND_BYTES = 64 << 20
# A walk's blocks read from the store in one round trip at most (`KVTier.get_run`): 32 SmolLM2
# blocks of 8 tokens in bf16 are 5.9 MB.
RUN_BLOCKS = 32


class PoolTiers:
    """Copies blocks of `block_size` tokens between the layer caches `caches` ([planes,
    blocks, ...] each) and `chain`, under the keys of `space`; `cost` decides which tiers a
    load asks (`kv_store.cost`) and learns each tier's rate from the loads. Counts offloads;
    the chain's tiers count the rest."""

    def __init__(
        self,
        chain: TierChain,
        space: KeySpace,
        caches: Sequence[torch.Tensor],
        block_size: int,
        cost: LoadCost,
    ) -> None:
        if not caches:
            raise ValueError("a pool's tiers need its layer caches")
        self.chain = chain
        self.space = space
        self.caches = tuple(caches)
        self.block_size = block_size
        self.cost = cost
        self.block_bytes = sum(c[:, 0].numel() * c.element_size() for c in self.caches)
        self.offloaded = 0  # blocks written to at least one tier
        self.host = next((t for t in chain.tiers if isinstance(t, HostTier)), None)
        self.store = next((t for t in chain.tiers if not isinstance(t, HostTier)), None)
        self.host_events = PrefixEvents()  # the host tier's changes since the last report
        if self.host is not None:
            self.host.watch = self._host_changed
        # The store's blocks as this node saw them change since the last report: put there
        # (True), or missed there or evicted by this node (False), the last change winning.
        # Bounded, the oldest dropped: a routing hint, where a change left out only costs a
        # credit. A sweep reports from its own thread.
        self._shared: dict[BlockHash, bool] = {}
        self._shared_lock = threading.Lock()
        self.shared_limit = 4096
        self._store_asked = False  # by the load under way
        self._at = 0  # the block of the walk under way that the load under way is for
        self._walk_first, self._walk_end = 0, 1
        self._walk_hashes: list[BlockHash] = []
        self._decided: dict[str, bool] = {}  # each tier's answer for the walk under way
        self.walk = TierLoads()  # what the walk under way loaded, for the request's trace
        # The store's run read ahead of the walk: each block's verified payload, or None for
        # the miss that ended the run (counted once, not asked again).
        self._ahead: dict[str, memoryview | None] = {}
        # Each tier's loads in the walk under way, [bytes, seconds]: the cost model learns a
        # run's load as one (its round trip once, its blocks' copies each).
        self._spent: dict[str, list[float]] = {}
        # Blocks evicted since the last fence, block id -> hash: their pages are copied out
        # at the next `fence`, all at once, not one gather per block inside the scheduler's
        # call (0.2-0.3 CPU ms a block, issue 40's trace).
        self._evicted: dict[int, BlockHash] = {}
        if self.store is not None:
            self.store.watch = self._store_changed

    @property
    def store_id(self) -> str:
        """The shared store as every node of it names it: its URL and this key space ("":
        none). Nodes of one model and layout on one store give the same id."""
        return f"{self.store.name}#{self.space.namespace}" if self.store is not None else ""

    def offload(self, block_hash: BlockHash, block_id: int, wait: bool = False) -> None:
        """Mark the block's pages for copying out at the next `fence` (the block is being
        reused: nothing may write it before then); `wait` copies and stores them now."""
        if block_id in self._evicted:  # reused again unwritten (cannot happen: `unschedule`)
            self.fence()
        self._evicted[block_id] = block_hash
        if wait:
            self.fence(wait=True)

    def fence(self, wait: bool = False) -> None:
        """Copy every block marked since the last fence out of the layer caches, one gather
        per cache for all of them, and put each through the chain (a store's write queued,
        unless `wait`). The engine calls it before a forward, a load or a transfer writes
        into any block (`BlockTiers.fence`)."""
        if not self._evicted:
            return
        hashes, ids = list(self._evicted.values()), list(self._evicted)
        self._evicted.clear()
        index = torch.tensor(ids, device=self.caches[0].device)
        rows = torch.cat([_rows(c, index) for c in self.caches], dim=1).cpu().numpy()
        for block_hash, row in zip(hashes, rows):
            stored = self.chain.put(self.space.key(block_hash), memoryview(row), wait)
            self.offloaded += bool(stored)
            if self.store is not None and self.store in stored:
                self._shared_changed(block_hash, True)

    @contextmanager
    def forward(self) -> Iterator[None]:
        """Around a forward that may write any block: the marked blocks are copied out first
        (`fence`), and the store's writer starts no put until it ends (`WriteBehind.hold`)."""
        self.fence()
        for behind in self.chain.behind.values():
            behind.hold(True)
        try:
            yield
        finally:
            for behind in self.chain.behind.values():
                behind.hold(False)

    def begin_walk(self, first: int, end: int, hashes: Sequence[BlockHash] = ()) -> None:
        """A walk will ask `load` for the request's blocks `first`..`end - 1` (`hashes`, if
        given: the store is then read a run at a time), in order, up to its first miss: each
        tier is asked once whether to serve the run from the block it is first asked for to
        `end` (`kv_store.cost`)."""
        self._observe_walk()  # a walk the manager ended before its last block
        self._walk_first, self._walk_end = first, end
        self._walk_hashes = list(hashes)
        self._decided.clear()
        self._ahead.clear()
        self.walk = TierLoads()

    def load(self, block_hash: BlockHash, block_id: int, at: int) -> bool:
        """Write the verified pages of `block_hash`, the walk's block `at`, into `block_id`;
        False on a miss, or when every tier holding it was chosen against (recomputed)."""
        self.fence()  # `block_id` was likely evicted just now; a walk's later block may be too
        start = time.perf_counter()
        self._store_asked, self._at = False, at
        found = self.chain.find(self.space.key(block_hash), self._worth_asking, self._read)
        if found.tier is None and self._store_asked:  # not there (any more), or unreadable
            self._shared_changed(block_hash, False)
        if found.payload is None or found.tier is None or found.payload.nbytes != self.block_bytes:
            self._observe_walk()
            return False
        data = torch.frombuffer(bytearray(found.payload), dtype=torch.uint8)
        offset = 0
        for cache in self.caches:
            page = cache[:, block_id]
            n = page.numel() * page.element_size()
            page.copy_(data[offset : offset + n].view(cache.dtype).view(page.shape))
            offset += n
        if not found.queued:  # a payload still in this process's write queue: not the tier's
            spent = self._spent.setdefault(found.tier.name, [0, 0.0])
            spent[0] += self.block_bytes
            spent[1] += time.perf_counter() - start
        self.walk.blocks[found.tier.name] = self.walk.blocks.get(found.tier.name, 0) + 1
        self.walk.bytes += self.block_bytes
        if at + 1 >= self._walk_end:
            self._observe_walk()
        return True

    def _observe_walk(self) -> None:
        """Each tier's loads of the walk under way, as one observation of the cost model."""
        for name, (nbytes, seconds) in self._spent.items():
            self.cost.observe(name, int(nbytes), seconds)
        self._spent.clear()

    def _read(self, tier: KVTier, key: BlockKey) -> memoryview | None:
        """A store's block from the run read ahead, or the walk's run from it read in one
        round trip; a block at a time from the other tiers (memory) or without the walk's
        hashes."""
        if tier is not self.store:
            return tier.get(key)
        if key.name in self._ahead:
            return self._ahead.pop(key.name)
        keys = self._run(key)
        payloads = tier.get_run(keys)
        self._ahead = {k.name: p for k, p in zip(keys[1:], payloads[1:])}
        if 0 < len(payloads) < len(keys):
            self._ahead[keys[len(payloads)].name] = None
        return payloads[0] if payloads else None

    def _run(self, first: BlockKey) -> list[BlockKey]:
        """`first` (the walk's block `_at`) and the walk's blocks after it, `RUN_BLOCKS` at
        most, up to one that the host tier or the store's write queue holds (read there)."""
        i = self._at - self._walk_first
        if not 0 <= i < len(self._walk_hashes) or self.space.key(self._walk_hashes[i]) != first:
            return [first]
        assert self.store is not None
        behind = self.chain.behind.get(self.store.name)
        keys = [first]
        for block_hash in self._walk_hashes[i + 1 : i + RUN_BLOCKS]:
            key = self.space.key(block_hash)
            if self.host is not None and self.host.contains(key) or behind and behind.has(key):
                break
            keys.append(key)
        return keys

    def _worth_asking(self, tier: KVTier) -> bool:
        ask = self._decided.get(tier.name)
        if ask is None:
            blocks = max(1, self._walk_end - self._at)
            first, end = self._at * self.block_size, (self._at + blocks) * self.block_size
            ask = self.cost.worth_loading(tier.name, first, end, blocks * self.block_bytes, blocks)
            self._decided[tier.name] = ask
            self.walk.recompute_chosen += 0 if ask else blocks  # as the cost model counts them
        self._store_asked |= ask and tier is self.store
        return ask

    def stats(self) -> tuple[TierStats, ...]:
        return self.chain.stats()

    # -- what a node reports for routing -----------------------------------------------------

    def _host_changed(self, name: str, held: bool) -> None:
        namespace, _, hex_hash = name.partition("/")
        if namespace == self.space.namespace:
            self.host_events.record(bytes.fromhex(hex_hash), held)

    def host_hashes(self) -> list[BlockHash]:
        """Every block of this key space the host tier holds now."""
        names = self.host.names() if self.host is not None else []
        prefix = self.space.namespace + "/"
        return [bytes.fromhex(n[len(prefix) :]) for n in names if n.startswith(prefix)]

    def host_changes(
        self, snapshot: bool
    ) -> tuple[bool, tuple[BlockHash, ...], tuple[BlockHash, ...]]:
        """(is_snapshot, joined, left) of the host tier since the last call; the whole host
        tier as joined when `snapshot` is asked or the change log overflowed."""
        if snapshot:
            self.host_events.resync()
        return self.host_events.drain(self.host_hashes())

    def _store_changed(self, name: str, held: bool) -> None:
        namespace, _, hex_hash = name.partition("/")
        if namespace == self.space.namespace:
            self._shared_changed(bytes.fromhex(hex_hash), held)

    def _shared_changed(self, block_hash: BlockHash, held: bool) -> None:
        with self._shared_lock:
            self._shared.pop(block_hash, None)  # re-inserted: the newest change
            self._shared[block_hash] = held
            if len(self._shared) > self.shared_limit:
                del self._shared[next(iter(self._shared))]

    def take_shared_changes(self) -> tuple[tuple[BlockHash, ...], tuple[BlockHash, ...]]:
        """(stored, removed): the blocks this node put into the shared store since the last
        call, and those it found missing there or evicted from it (the router's view of the
        store learns both)."""
        with self._shared_lock:
            changes, self._shared = self._shared, {}
        return (
            tuple(h for h, held in changes.items() if held),
            tuple(h for h, held in changes.items() if not held),
        )

    def close(self) -> None:
        self.fence()  # nothing writes the pool any more: the marked blocks are intact
        self.chain.close()


def _rows(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The pages of blocks `index` in `cache` ([planes, blocks, ...]), one row of bytes per
    block in the order `offload` always stored them: its planes, each whole."""
    pages = cache.index_select(1, index).transpose(0, 1)
    return pages.reshape(len(index), -1).view(torch.uint8)


def open_pool_tiers(
    offload_bytes: int,
    store_url: str | None,
    space: KeySpace,
    caches: Sequence[torch.Tensor],
    block_size: int,
    cost: LoadCost,
) -> PoolTiers | None:
    """The tiers `--kv-offload-bytes` and `--kv-store` ask for, or None for neither."""
    tiers: list[KVTier] = []
    if offload_bytes:
        tiers.append(HostTier(offload_bytes))
    if store_url:
        tiers.append(open_store(store_url))
    chain = TierChain(tiers, behind_bytes=WRITE_BEHIND_BYTES)
    return PoolTiers(chain, space, caches, block_size, cost) if tiers else None
