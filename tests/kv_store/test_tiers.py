"""Each tier's round trip and its fail-closed rules, in one process."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from pdserve.kv_store import FileTier, HostTier, KVTier, TierChain, codec, open_store
from tests.kv_store.helpers import key, payload, wait_until


class Broken(KVTier):
    """A backend whose every call raises, as a store that is down."""

    def __init__(self, backoff_s: float = 0.0) -> None:
        super().__init__("broken", timeout_s=1.0, backoff_s=backoff_s)
        self.calls = 0

    def _fail(self, *_: object) -> bool:
        self.calls += 1
        raise ConnectionError("store is down")

    _load = _store = _exists = _discard = _fail


def test_host_round_trip_and_lru_budget() -> None:
    host = HostTier(budget_bytes=3 * 100)
    for i in range(3):
        assert host.put(key(i), payload(i, 100))
    assert host.get(key(0)) == payload(0, 100)  # 0 is now the most recent
    assert host.put(key(3), payload(3, 100))  # evicts 1, the least recently used
    assert host.get(key(1)) is None and host.get(key(0)) is not None
    assert host.used_bytes == 300 and len(host) == 3
    assert not host.put(key(9), payload(9, 301)), "larger than the whole budget"
    s = host.stats()
    assert (s.hits, s.misses, s.puts, s.put_failures) == (2, 1, 4, 1)


@pytest.mark.parametrize("backend", ["host", "file"])
def test_round_trip(backend: str, tmp_path: Path) -> None:
    tier = HostTier(1 << 20) if backend == "host" else open_store(f"file://{tmp_path}")
    assert tier.get(key(1)) is None and not tier.contains(key(1))
    assert tier.put(key(1), payload(1))
    assert tier.contains(key(1)) and tier.get(key(1)) == payload(1)
    assert tier.put(key(1), payload(1)), "a second put of one key is harmless"
    s = tier.stats()
    assert (s.hits, s.misses, s.errors, s.bytes_read) == (1, 1, 0, len(payload(1)))


def test_errors_are_misses_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    tier = Broken()
    with caplog.at_level(logging.WARNING, "pdserve.kv_store"):
        for i in range(5):
            assert tier.get(key(i)) is None
            assert tier.put(key(i), payload(i)) is False
            assert tier.contains(key(i)) is False
    s = tier.stats()
    assert (s.misses, s.put_failures, s.errors) == (5, 5, 15)
    assert len(caplog.records) == 3, "one line per kind of failure (get, put, contains)"


def test_after_an_error_the_tier_backs_off() -> None:
    tier = Broken(backoff_s=60.0)
    for i in range(5):
        assert tier.get(key(i)) is None
    assert tier.calls == 1, "a store that is down is asked once per backoff"
    assert tier.stats().skipped == 4 and tier.stats().misses == 5


def _object(tier: FileTier, i: int) -> Path:
    return tier.path(key(i).name)


@pytest.mark.parametrize("damage", ["truncate", "corrupt", "wrong-layout", "empty"])
def test_a_damaged_file_is_a_miss_then_replaced(damage: str, tmp_path: Path) -> None:
    tier = FileTier(tmp_path)
    assert tier.put(key(1), payload(1))
    path = _object(tier, 1)
    blob = bytearray(path.read_bytes())
    if damage == "truncate":
        blob = blob[:-1]
    elif damage == "corrupt":
        blob[-7] ^= 1
    elif damage == "wrong-layout":  # another block's whole, valid object under this name
        blob = bytearray(codec.encode(key(2), payload(1)))
    else:
        blob = bytearray()
    path.write_bytes(blob)
    assert tier.get(key(1)) is None
    assert tier.stats().bad_objects == 1 and tier.stats().errors == 0
    assert not path.exists(), "a bad object is removed so the next put replaces it"
    assert tier.put(key(1), payload(1)) and tier.get(key(1)) == payload(1)


def test_a_hung_filesystem_costs_a_timeout(tmp_path: Path) -> None:
    release = threading.Event()
    tier = FileTier(tmp_path, timeout_s=0.2, backoff_s=0.0, max_pending=2)
    tier._read = lambda path: release.wait(30)  # type: ignore[method-assign]
    assert tier.get(key(1)) is None
    assert tier.get(key(2)) is None
    assert tier.get(key(3)) is None, "refused at once: two calls are still stuck"
    s = tier.stats()
    assert (s.misses, s.errors) == (3, 3)
    release.set()
    tier.close()


def test_eviction_by_watermark_keeps_the_recently_used(tmp_path: Path) -> None:
    blob_bytes = len(codec.encode(key(0), payload(0)))
    tier = FileTier(tmp_path, high_bytes=10 * blob_bytes, low_fraction=0.5)
    for i in range(10):
        assert tier.put(key(i), payload(i))
    for i in range(10):
        _object(tier, i).touch()  # put order, by mtime
    assert tier.get(key(0)) is not None  # 0 becomes the most recent
    assert tier.put(key(10), payload(10))  # past the high watermark: a background sweep
    wait_until(lambda: len(list(tmp_path.glob("*/*/*.kv"))) <= 5, "the sweep to the low mark")
    assert tier.contains(key(0)) and tier.contains(key(10))
    assert not tier.contains(key(1)), "the least recently used go first"


def test_the_sweep_removes_stale_temporary_files(tmp_path: Path) -> None:
    tier = FileTier(tmp_path, tmp_max_age_s=0.0)
    (tier.tmp / "dead-writer.123.tmp").write_bytes(b"partial")
    tier.sweep()
    assert not any(tier.tmp.iterdir())


def test_chain_reads_down_and_writes_through(tmp_path: Path) -> None:
    host, store = HostTier(1 << 20), FileTier(tmp_path)
    chain = TierChain([host, store])
    assert chain.put(key(1), payload(1)) == [host, store]
    host._discard(key(1).name)  # the host tier dropped it; the store still has it
    assert chain.get(key(1)) == payload(1)
    assert host.contains(key(1)), "a store hit is copied into the host tier"
    assert chain.get(key(1)) == payload(1)
    assert chain.get(key(2)) is None
    h, s = chain.stats()
    assert (h.hits, h.misses, s.hits, s.misses) == (1, 2, 1, 1)


def test_chain_survives_a_broken_store() -> None:
    host = HostTier(1 << 20)
    chain = TierChain([host, Broken()])
    assert chain.put(key(1), payload(1)) == [host], "stored in the host tier only"
    assert chain.get(key(1)) == payload(1) and chain.get(key(2)) is None


@pytest.mark.parametrize("url", ["s3://bucket", "file://", "redis://"])
def test_bad_store_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError):
        open_store(url)
