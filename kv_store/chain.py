"""Tiers in order, nearest first (host, then the deployment's shared store): reads go down the
chain and copy a hit into every tier above it; writes go through to every tier, so a block the
host tier drops is still in the store. With `behind_bytes` a store's writes are queued and run
on a thread of their own (`WriteBehind`), unless the caller asks to wait for them; until it
ran, this process's reads of that block are served from the queue."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.kv_store.key import BlockKey
from pdserve.kv_store.tier import KVTier, TierStats
from pdserve.kv_store.write_behind import WriteBehind


@dataclass(frozen=True, slots=True)
class Found:
    """What a lookup found: the payload (None: a miss in every tier asked), the tier that
    served it, and whether it came from that tier's write queue in this process (the bytes
    about to be stored there) rather than from the tier itself."""

    payload: memoryview | None = None
    tier: KVTier | None = None
    queued: bool = False


class TierChain:
    """The tiers under one KV cache (the pool is above them, and the engine asks it first)."""

    CLOSE_TIMEOUT_S = 10.0  # the most a close waits for queued writes

    def __init__(self, tiers: Sequence[KVTier], behind_bytes: int = 0) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"a tier chain holds each tier once, got {names}")
        self.tiers = tuple(tiers)
        # A store's writes (an encoded tier: outside this process) off the caller's path.
        self.behind = {
            t.name: WriteBehind(t, behind_bytes) for t in tiers if behind_bytes and t.encoded
        }

    def get(self, key: BlockKey) -> memoryview | None:
        """The first tier's verified payload, copied into the tiers above it; None: no tier
        holds an intact one (every miss and failure counted in its tier)."""
        return self.find(key).payload

    def find(
        self,
        key: BlockKey,
        ask: Callable[[KVTier], bool] = lambda _: True,
        read: Callable[[KVTier, BlockKey], memoryview | None] = KVTier.get,
    ) -> Found:
        """`get`, asking only the tiers `ask` accepts, through `read` (a caller reading a run
        ahead serves a block from it); a block still in a tier's write queue is served from
        there, without asking. Also says where it came from."""
        for i, tier in enumerate(self.tiers):
            behind = self.behind.get(tier.name)
            queued = behind.queued(key) if behind is not None else None
            payload = queued if queued is not None else read(tier, key) if ask(tier) else None
            if payload is not None:
                for upper in self.tiers[:i]:
                    upper.put(key, payload)
                return Found(payload, tier, queued is not None)
        return Found()

    def put(
        self, key: BlockKey, payload: bytes | bytearray | memoryview, wait: bool = False
    ) -> list[KVTier]:
        """Write through every tier; returns those that stored it (or queued it: a store
        written behind, unless `wait`)."""
        return [tier for tier in self.tiers if self._put(tier, key, payload, wait)]

    def _put(self, tier: KVTier, key: BlockKey, payload: bytes | bytearray | memoryview,
             wait: bool) -> bool:  # fmt: skip
        behind = self.behind.get(tier.name)
        return tier.put(key, payload) if behind is None or wait else behind.put(key, payload)

    def flush(self, timeout_s: float) -> bool:
        """Wait for the queued writes; False if some were still queued after `timeout_s`."""
        return all(b.flush(timeout_s) for b in self.behind.values())

    def contains(self, key: BlockKey) -> bool:
        return any(tier.contains(key) for tier in self.tiers)

    def stats(self) -> tuple[TierStats, ...]:
        return tuple(tier.stats() for tier in self.tiers)

    def close(self) -> None:
        for behind in self.behind.values():
            behind.close(self.CLOSE_TIMEOUT_S)
        for tier in self.tiers:
            tier.close()
