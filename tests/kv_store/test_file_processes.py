"""file:// with real processes: writers killed mid-write, writers racing on one key, eviction
racing reads. Every read is the whole, verified object or a miss."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from pdserve.kv_store import FileTier
from tests.kv_store.helpers import key, payload, store_proc

BIG = 1 << 20  # a block of a real model is about this size


@pytest.mark.parametrize("where", ["write", "fsync"])
def test_a_writer_killed_mid_write_leaves_nothing_readable(where: str, tmp_path: Path) -> None:
    writer = subprocess.Popen(store_proc("hang", tmp_path, 1, BIG, where), stdout=subprocess.PIPE)
    try:
        assert writer.stdout is not None and writer.stdout.readline() == b"writing\n"
    finally:
        writer.kill()  # kill -9: no cleanup runs
        writer.wait(timeout=30)
    assert [p.stat().st_size > 0 for p in (tmp_path / "tmp").iterdir()] == [True]
    tier = FileTier(tmp_path)
    assert tier.get(key(1)) is None and not tier.contains(key(1))
    assert tier.stats().bad_objects == 0, "the partial file was never under the block's name"
    assert tier.put(key(1), payload(1, BIG)) and tier.get(key(1)) == payload(1, BIG)


def test_concurrent_writers_of_the_same_keys(tmp_path: Path) -> None:
    """Three processes put the same 20 blocks, started together so that they write each block
    at the same time, while this one reads them."""
    store, gate = tmp_path / "store", tmp_path / "go"
    writers = [
        subprocess.Popen(store_proc("put", store, 0, 20, BIG, gate), stdout=subprocess.PIPE)
        for _ in range(3)
    ]
    for w in writers:
        assert w.stdout is not None and w.stdout.readline() == b"ready\n"
    gate.touch()
    tier = FileTier(store, timeout_s=30)
    while any(w.poll() is None for w in writers):
        for i in range(20):
            got = tier.get(key(i))
            assert got is None or got == payload(i, BIG), i
    assert [w.wait(timeout=60) for w in writers] == [0, 0, 0], "a writer's put failed"
    assert all(tier.get(key(i)) == payload(i, BIG) for i in range(20))
    assert tier.stats().bad_objects == 0
    assert not any((store / "tmp").iterdir()), "every writer's temporary file was renamed"


def test_eviction_during_reads_gives_whole_objects_or_misses(tmp_path: Path) -> None:
    """Another process evicts everything over and over while this one reads and rewrites."""
    tier = FileTier(tmp_path, timeout_s=30)
    evicter = subprocess.Popen(store_proc("evict", tmp_path, 1, 8))
    hits = misses = 0
    try:
        while evicter.poll() is None:
            for i in range(8):
                got = tier.get(key(i))
                assert got is None or got == payload(i, BIG), i
                hits, misses = hits + (got is not None), misses + (got is None)
                if got is None:
                    tier.put(key(i), payload(i, BIG))
    finally:
        evicter.kill()
        evicter.wait(timeout=30)
    assert tier.stats().bad_objects == 0 and tier.stats().errors == 0
    assert misses > 0, "the evicter never removed a block: the test raced nothing"


def test_an_object_evicted_between_open_and_read_is_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tier's read opens the file; another tier evicts everything before it reads."""
    tier, evicter = FileTier(tmp_path), FileTier(tmp_path, high_bytes=1, low_fraction=0.5)
    assert tier.put(key(1), payload(1, BIG))
    real_fstat, path = os.fstat, tier.path(key(1).name)

    def evict_then_fstat(fd: int) -> os.stat_result:
        monkeypatch.setattr(os, "fstat", real_fstat)
        assert evicter.sweep() == 0 and not path.exists()
        return real_fstat(fd)

    monkeypatch.setattr(os, "fstat", evict_then_fstat)
    assert tier.get(key(1)) == payload(1, BIG), "the open descriptor kept the whole object"
    assert os.fstat is real_fstat, "the eviction ran inside the read"
    assert tier.get(key(1)) is None
