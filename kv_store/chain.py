"""Tiers in order, nearest first (host, then the deployment's shared store): reads go down the
chain and copy a hit into every tier above it; writes go through to every tier, so a block the
host tier drops is still in the store."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdserve.kv_store.key import BlockKey
from pdserve.kv_store.tier import KVTier, TierStats


class TierChain:
    """The tiers under one KV cache (the pool is above them, and the engine asks it first)."""

    def __init__(self, tiers: Sequence[KVTier]) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"a tier chain holds each tier once, got {names}")
        self.tiers = tuple(tiers)

    def get(self, key: BlockKey) -> memoryview | None:
        """The first tier's verified payload, copied into the tiers above it; None: no tier
        holds an intact one (every miss and failure counted in its tier)."""
        return self.find(key)[0]

    def find(
        self, key: BlockKey, ask: Callable[[KVTier], bool] = lambda _: True
    ) -> tuple[memoryview | None, KVTier | None]:
        """`get`, asking only the tiers `ask` accepts; also says which tier served it."""
        for i, tier in enumerate(self.tiers):
            payload = tier.get(key) if ask(tier) else None
            if payload is not None:
                for upper in self.tiers[:i]:
                    upper.put(key, payload)
                return payload, tier
        return None, None

    def put(self, key: BlockKey, payload: bytes | bytearray | memoryview) -> list[KVTier]:
        """Write through every tier; returns those that stored it."""
        return [tier for tier in self.tiers if tier.put(key, payload)]

    def contains(self, key: BlockKey) -> bool:
        return any(tier.contains(key) for tier in self.tiers)

    def stats(self) -> tuple[TierStats, ...]:
        return tuple(tier.stats() for tier in self.tiers)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
