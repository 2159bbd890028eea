"""One interface for every place a KV block can live beyond the pool, and the rule every one
of them keeps: fail closed, never block.

A tier's `get`, `put` and `contains` never raise and never wait past the tier's timeout. A
backend error, a timeout, a short read, another layout or a bad checksum is a miss (a failed
put is a False): counted, logged once per kind, and after a backend error the tier is skipped
for `backoff_s` so a store that is down costs one bounded timeout per backoff, not one per
block. Callers recompute what a miss did not give them.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TypeVar

from pdserve.kv_store import codec
from pdserve.kv_store.key import BlockKey

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot of one tier's counters since it was made."""

    tier: str
    hits: int = 0
    misses: int = 0  # every get without a payload, errors and bad objects included
    puts: int = 0  # objects stored
    put_failures: int = 0
    errors: int = 0  # backend errors and timeouts (each also a miss or a failed put)
    bad_objects: int = 0  # read whole but refused by the codec (each also a miss)
    skipped: int = 0  # calls answered at once while backing off after an error
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0  # spent in this tier's calls
    load_seconds: float = 0.0  # of which in gets, checking the object included


class _Counters:
    """TierStats' mutable twin, updated under a lock (tiers are called from several threads)."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self.values: dict[str, float] = {f.name: 0 for f in fields(TierStats)[1:]}
        self.lock = threading.Lock()

    def add(self, **deltas: float) -> None:
        with self.lock:
            for name, delta in deltas.items():
                self.values[name] += delta

    def snapshot(self) -> TierStats:
        with self.lock:
            return TierStats(self.tier, **self.values)  # type: ignore[arg-type]


class KVTier(ABC):
    """A place that keeps whole, verified KV blocks by `BlockKey`.

    Subclasses implement the raw `_load`, `_store`, `_exists` (and `_discard`) on object names
    and may raise anything; this class turns every failure into a counted miss. Objects are
    `codec`-encoded unless `encoded` is False (a tier in the reader's own memory).
    """

    encoded = True

    def __init__(self, name: str, timeout_s: float, backoff_s: float) -> None:
        if timeout_s <= 0 or backoff_s < 0:
            raise ValueError(f"tier {name}: timeout_s must be > 0 and backoff_s >= 0")
        self.name = name
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self._counters = _Counters(name)
        self._logged: set[str] = set()
        self._down_until = 0.0
        # Told each name this process saw join (True) or leave (False) the tier: the host tier
        # tells every change, a store the objects this process evicted (a node reports them
        # for tier-aware routing: `PoolTiers`).
        self.watch: Callable[[str, bool], None] = lambda _name, _held: None

    # -- the interface ------------------------------------------------------------------------

    def get(self, key: BlockKey) -> memoryview | None:
        """The block's payload, or None (a miss, whatever the cause)."""
        start = time.monotonic()
        blob = self._guard("get", lambda: self._load(key.name), None)
        payload = None if blob is None else self._verify(key, blob)
        self._counters.add(
            hits=payload is not None,
            misses=payload is None,
            bytes_read=0 if payload is None else payload.nbytes,
            load_seconds=time.monotonic() - start,
        )
        return payload

    def get_run(self, keys: Sequence[BlockKey]) -> list[memoryview]:
        """The verified payloads of the leading `keys` the tier holds intact, read in one round
        trip where the backend can (`_load_many`). Fails closed per block: the first miss or
        refused object ends the run (counted as one miss); the blocks after it are neither
        verified nor counted, and the caller recomputes them."""
        if not keys:
            return []
        start = time.monotonic()
        names = [k.name for k in keys]
        blobs = self._guard("get", lambda: self._load_many(names), None) or ()
        out: list[memoryview] = []
        for key, blob in zip(keys, blobs):
            payload = None if blob is None else self._verify(key, blob)
            if payload is None:
                break
            out.append(payload)
        self._counters.add(
            hits=len(out),
            misses=len(out) < len(keys),
            bytes_read=sum(p.nbytes for p in out),
            load_seconds=time.monotonic() - start,
        )
        return out

    def refresh(self, key: BlockKey) -> bool:
        """Whether an object is stored under the key, marking it recently used if so (a put
        of a block already there is then skipped: `WriteBehind`); not verified."""
        return bool(self._guard("refresh", lambda: self._refresh(key.name), False))

    def put(self, key: BlockKey, payload: bytes | bytearray | memoryview) -> bool:
        """Store the block whole (readers never see part of it); False if it was not stored."""
        blob = codec.encode(key, payload) if self.encoded else bytes(payload)
        ok = bool(self._guard("put", lambda: self._store(key.name, blob), False))
        self._counters.add(puts=ok, put_failures=not ok, bytes_written=len(blob) if ok else 0)
        return ok

    def contains(self, key: BlockKey) -> bool:
        """Whether an object is stored under the key (not verified: only `get` verifies)."""
        return bool(self._guard("contains", lambda: self._exists(key.name), False))

    def stats(self) -> TierStats:
        return self._counters.snapshot()

    def close(self) -> None:
        """Release the backend's resources; the tier answers misses afterwards."""
        self._down_until = float("inf")

    # -- the backend --------------------------------------------------------------------------

    @abstractmethod
    def _load(self, name: str) -> bytes | bytearray | memoryview | None:
        """The whole object stored as `name`, or None if there is none."""

    @abstractmethod
    def _store(self, name: str, blob: bytes) -> bool:
        """Store `blob` as `name` atomically: a reader sees all of it or nothing."""

    def _load_many(self, names: Sequence[str]) -> Sequence[bytes | bytearray | memoryview | None]:
        """The objects stored as `names`, in order, up to the first missing one (None) at
        least; a backend with a batched read overrides this one read per name."""
        return load_until_missing(names, self._load)

    @abstractmethod
    def _exists(self, name: str) -> bool: ...

    def _refresh(self, name: str) -> bool:
        return self._exists(name)

    @abstractmethod
    def _discard(self, name: str) -> None:
        """Remove a bad object so that the next put replaces it (best effort)."""

    # -- failing closed -----------------------------------------------------------------------

    def _verify(self, key: BlockKey, blob: bytes | bytearray | memoryview) -> memoryview | None:
        if not self.encoded:
            return memoryview(blob)
        out = codec.decode_or_reason(blob, key)
        if isinstance(out, memoryview):
            return out
        self._counters.add(bad_objects=1)
        self._log_once(f"bad:{out.split(' ')[0]}", f"refused {key.name}: {out}")
        self._guard("discard", lambda: self._discard(key.name), None)
        return None

    def _guard(self, op: str, call: Callable[[], T], failed: T) -> T:
        """call(), or `failed` if it raises or the tier is backing off; timed and counted."""
        start = time.monotonic()
        if start < self._down_until:
            self._counters.add(skipped=1)
            return failed
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - every backend failure is a miss, by design
            self._counters.add(errors=1)
            self._down_until = time.monotonic() + self.backoff_s
            self._log_once(f"{op}:{type(e).__name__}", f"{op} failed ({e!r})")
            return failed
        finally:
            self._counters.add(seconds=time.monotonic() - start)

    def _log_once(self, kind: str, message: str) -> None:
        if kind in self._logged:
            return
        self._logged.add(kind)
        logger.warning(
            "kv tier %s: %s; counted as a miss, later ones of this kind only counted",
            self.name,
            message,
        )


def load_until_missing(names: Sequence[str], load: Callable[[str], T | None]) -> list[T | None]:
    """`load` of each name in turn, up to and with the first None (a run ends at its first
    missing block: the rest are not read)."""
    out: list[T | None] = []
    for name in names:
        out.append(load(name))
        if out[-1] is None:
            break
    return out
