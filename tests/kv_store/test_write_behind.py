"""A store's writes off the caller's path (`kv_store.write_behind`, issue 40): a chain with
`behind_bytes` returns from a put before the store has it, the store gets it on the writer's
thread, a block still queued is a miss (never bytes the store does not hold), `wait` writes at
once (the history write), a full queue drops a put, and close writes what was queued."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from pdserve.kv_store import FileTier, HostTier, TierChain
from pdserve.kv_store.write_behind import WriteBehind
from tests.kv_store.helpers import key, payload


class GatedFileTier(FileTier):
    """A file tier whose writes wait until the test opens the gate."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder, timeout_s=30.0)
        self.gate = threading.Event()

    def _store(self, name: str, blob: bytes) -> bool:
        assert self.gate.wait(20.0), "the test never opened the gate"
        return super()._store(name, blob)


def test_a_put_returns_before_the_store_has_it_and_lands_after(tmp_path: Path) -> None:
    store = GatedFileTier(tmp_path)
    chain = TierChain([HostTier(1 << 20), store], behind_bytes=1 << 20)
    try:
        stored = chain.put(key(1), payload(1))
        assert stored == [chain.tiers[0], store], "queued for the store counts as stored"
        assert store.stats().puts == 0 and chain.behind[store.name].pending() == 1
        assert store.get(key(1)) is None, "still queued: a miss, not a partial object"
        store.gate.set()
        assert chain.flush(20.0)
        assert store.stats().puts == 1
        assert bytes(store.get(key(1)) or b"") == payload(1)
    finally:
        store.gate.set()
        chain.close()


def test_wait_writes_before_returning(tmp_path: Path) -> None:
    store = FileTier(tmp_path)
    chain = TierChain([store], behind_bytes=1 << 20)
    try:
        chain.put(key(2), payload(2), wait=True)
        assert chain.behind[store.name].pending() == 0 and store.stats().puts == 1
        assert bytes(store.get(key(2)) or b"") == payload(2)
    finally:
        chain.close()


def test_a_full_queue_drops_the_put(tmp_path: Path) -> None:
    store = GatedFileTier(tmp_path)
    behind = WriteBehind(store, max_bytes=4096)
    try:
        assert behind.put(key(1), payload(1)), "the first fits"
        assert not behind.put(key(2), payload(2)), "past max_bytes: dropped, not waited for"
        assert behind.dropped == 1
        store.gate.set()
        assert behind.flush(20.0) and store.get(key(1)) is not None and store.get(key(2)) is None
    finally:
        store.gate.set()
        behind.close(20.0)
    assert not behind.put(key(3), payload(3)), "closed: dropped"


def test_close_writes_what_was_queued(tmp_path: Path) -> None:
    store = FileTier(tmp_path)
    chain = TierChain([store], behind_bytes=1 << 20)
    for i in range(8):
        chain.put(key(i), payload(i))
    chain.close()
    reader = FileTier(tmp_path)
    assert all(bytes(reader.get(key(i)) or b"") == payload(i) for i in range(8))


def test_a_chain_without_behind_bytes_writes_at_once(tmp_path: Path) -> None:
    store = FileTier(tmp_path)
    chain = TierChain([store])
    chain.put(key(4), payload(4))
    assert chain.behind == {} and store.stats().puts == 1
    with pytest.raises(ValueError, match="positive"):
        WriteBehind(store, max_bytes=0)


def test_a_queued_block_is_read_from_the_queue(tmp_path: Path) -> None:
    store = GatedFileTier(tmp_path)
    chain = TierChain([store], behind_bytes=1 << 20)
    try:
        chain.put(key(5), payload(5))
        found = chain.find(key(5), ask=lambda _: False)  # even a tier chosen against
        assert found.queued and found.tier is store and bytes(found.payload or b"") == payload(5)
        assert store.stats().hits == store.stats().misses == 0, "the store itself not asked"
        assert chain.behind[store.name].served == 1
        store.gate.set()
        assert chain.flush(20.0)
        found = chain.find(key(5))
        assert not found.queued and bytes(found.payload or b"") == payload(5), "now the store's"
    finally:
        store.gate.set()
        chain.close()


def test_a_read_racing_its_own_write_gets_the_bytes(tmp_path: Path) -> None:
    """Reads of each block from the moment it is queued until the store serves it: every one
    the right bytes, none a miss (a name leaves the queue only after the store has it) and
    none another block's."""
    store = FileTier(tmp_path)
    chain = TierChain([store], behind_bytes=1 << 20)
    sources = {"queue": 0, "store": 0}
    try:
        for i in range(30):
            chain.put(key(i), payload(i))
            deadline = time.monotonic() + 20.0
            while True:
                found = chain.find(key(i))
                assert found.payload is not None, f"block {i} missed while being written"
                assert bytes(found.payload) == payload(i), f"block {i}: wrong bytes"
                sources["queue" if found.queued else "store"] += 1
                if not found.queued:
                    break
                assert time.monotonic() < deadline, f"block {i} never reached the store"
    finally:
        chain.close()
    assert sources["queue"] > 0 and sources["store"] == 30, sources


def test_a_block_the_store_holds_is_not_encoded_again(tmp_path: Path) -> None:
    """An evicted block that the store already holds (loaded from it earlier) costs the writer
    a stat, not an encode, checksum and write."""
    store = FileTier(tmp_path)
    chain = TierChain([store], behind_bytes=1 << 20)
    try:
        assert store.put(key(3), payload(3))
        mtime = store.path(key(3).name).stat().st_mtime_ns
        time.sleep(0.01)
        chain.put(key(3), payload(3))
        chain.put(key(4), payload(4))
        assert chain.flush(20.0)
        behind = chain.behind[store.name]
        assert behind.present == 1 and store.stats().puts == 2, "key 3 skipped, key 4 put"
        assert store.path(key(3).name).stat().st_mtime_ns > mtime, "marked recently used"
        assert bytes(store.get(key(4)) or b"") == payload(4)
    finally:
        chain.close()


def wait_for(check, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_the_writer_waits_out_a_forward_unless_its_queue_is_half_full(tmp_path: Path) -> None:
    """Held (a forward runs: `PoolTiers.forward`), the writer starts no put while the queue
    is under half its bound; it writes once released, or while the queue is at half or more."""
    store = FileTier(tmp_path)
    behind = WriteBehind(store, max_bytes=4 * 4096)
    try:
        behind.hold(True)
        behind.put(key(1), payload(1))
        time.sleep(0.3)
        assert store.stats().puts == 0 and behind.pending() == 1, "written during a forward"
        behind.hold(False)
        assert wait_for(lambda: store.stats().puts == 1), "not written after the forward"
        behind.hold(True)
        behind.put(key(2), payload(2))
        behind.put(key(3), payload(3))  # half of the bound: the writer goes on, to under half
        assert wait_for(lambda: store.stats().puts == 2), "a half-full queue waited"
        time.sleep(0.3)
        assert store.stats().puts == 2 and behind.pending() == 1
        behind.put(key(4), payload(4))
        assert behind.flush(20.0) and store.stats().puts == 4, "a flush waits for no forward"
        behind.yields = False
        behind.hold(True)
        behind.put(key(5), payload(5))
        assert wait_for(lambda: store.stats().puts == 5), "yields off: written at once"
    finally:
        behind.close(20.0)
