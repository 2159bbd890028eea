"""The tiers under one engine's block pool (`KVCacheManager`'s `BlockTiers`): a block the pool
evicts is copied out of every layer's cache into the chain (host, then the shared store), and a
prefix block the pool lacks is copied back in from the first tier that holds an intact one.

A block's payload is its pages in every layer cache, in cache order, as raw bytes: the key's
layout digest names that order, the dtype and the shapes, so a payload of another length is
refused (a miss) before anything is written into the pool.

Which tiers a load asks is the cost model's call (`kv_store.cost.LoadCost`, --kv-load-policy):
a tier measured slower than recomputing is skipped, and its blocks are recomputed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from pdserve.common.engine.kv_cache_manager import BlockHash
from pdserve.kv_store import open_store
from pdserve.kv_store.chain import TierChain
from pdserve.kv_store.cost import LoadCost
from pdserve.kv_store.host import HostTier
from pdserve.kv_store.key import KeySpace
from pdserve.kv_store.tier import KVTier, TierStats


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

    def offload(self, block_hash: BlockHash, block_id: int) -> None:
        pages = torch.cat([c[:, block_id].reshape(-1).view(torch.uint8) for c in self.caches])
        payload = memoryview(pages.cpu().numpy()).cast("B")
        self.offloaded += self.chain.put(self.space.key(block_hash), payload) > 0

    def load(self, block_hash: BlockHash, block_id: int) -> bool:
        start = time.perf_counter()
        payload, tier = self.chain.find(self.space.key(block_hash), self._worth_asking)
        if payload is None or tier is None or payload.nbytes != self.block_bytes:
            return False
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for cache in self.caches:
            page = cache[:, block_id]
            n = page.numel() * page.element_size()
            page.copy_(data[offset : offset + n].view(cache.dtype).view(page.shape))
            offset += n
        self.cost.observe(tier.name, self.block_bytes, time.perf_counter() - start)
        return True

    def _worth_asking(self, tier: KVTier) -> bool:
        return self.cost.worth_loading(tier.name, self.block_size, self.block_bytes)

    def stats(self) -> tuple[TierStats, ...]:
        return self.chain.stats()

    def close(self) -> None:
        self.chain.close()


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
    return PoolTiers(TierChain(tiers), space, caches, block_size, cost) if tiers else None
