"""The host tier: blocks in this process's memory under a byte budget, least recently used
out first. It keeps payloads as they are (no header, no checksum): its bytes never leave the
process, and every block it holds was verified on its way in (from the pool or a store)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from pdserve.kv_store.tier import KVTier


class HostTier(KVTier):
    """At most `budget_bytes` of payloads; a put evicts the least recently read first."""

    encoded = False

    def __init__(self, budget_bytes: int, timeout_s: float = 1.0) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"a host tier needs a positive byte budget, got {budget_bytes}")
        super().__init__("host", timeout_s, backoff_s=0.0)
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._blocks: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()  # `watch` hears every join and leave, under it

    def _load(self, name: str) -> bytes | None:
        with self._lock:
            blob = self._blocks.get(name)
            if blob is not None:
                self._blocks.move_to_end(name)
            return blob

    def _store(self, name: str, blob: bytes) -> bool:
        if len(blob) > self.budget_bytes:
            return False
        with self._lock:
            old = self._blocks.pop(name, None)
            self.used_bytes -= len(old) if old is not None else 0
            while self.used_bytes + len(blob) > self.budget_bytes:
                gone, evicted = self._blocks.popitem(last=False)
                self.used_bytes -= len(evicted)
                self.watch(gone, False)
            self._blocks[name] = blob
            self.used_bytes += len(blob)
            self.watch(name, True)
            return True

    def _exists(self, name: str) -> bool:
        with self._lock:
            return name in self._blocks

    def _discard(self, name: str) -> None:
        with self._lock:
            blob = self._blocks.pop(name, None)
            self.used_bytes -= len(blob) if blob is not None else 0
            if blob is not None:
                self.watch(name, False)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)
