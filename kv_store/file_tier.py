"""`file://DIR`: blocks as files on a local disk or a filesystem every node mounts.

    DIR/<namespace>/<first 2 hex of the hash>/<block hash hex>.kv     complete objects
    DIR/tmp/<name>.<pid>.<random>.tmp                                 writes in progress

Put-complete by rename: a writer writes a temporary file, fsyncs it, renames it over the final
name and fsyncs the folder, so a name only ever points at a whole object. A writer killed
mid-write leaves only a temporary file, which no reader opens and the eviction sweep removes
once it is `tmp_max_age_s` old. Two writers of one key each rename a whole object; the last
wins and they are equal.

Eviction never removes an object a reader holds: a reader opens the file, then reads through
its descriptor. Unlinking (eviction, or a rename over it) removes only the name; the open
inode keeps its bytes until the reader closes it (POSIX; NFS keeps it as a `.nfsXXXX` file),
so a read returns the whole object or, if the name was gone before the open, a miss. Objects
go least recently used first (a hit touches the file's mtime; atime is often off) when the
folder passes `high_bytes`, down to `low_fraction` of it.

A run of blocks is read back to back in one worker call (`get_run`). Every call runs on a
small worker pool and is abandoned after `timeout_s` (a hung shared
filesystem costs the caller a miss, not a stall); with `max_pending` calls still stuck, new
ones are refused at once.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from pdserve.kv_store.tier import KVTier, load_until_missing

T = TypeVar("T")
SUFFIX = ".kv"


class FileTier(KVTier):
    """Blocks as files under `directory`; LRU eviction past `high_bytes` (None: never)."""

    def __init__(
        self,
        directory: str | Path,
        high_bytes: int | None = None,
        low_fraction: float = 0.8,
        timeout_s: float = 2.0,
        backoff_s: float = 1.0,
        tmp_max_age_s: float = 600.0,
        max_pending: int = 4,
    ) -> None:
        super().__init__(f"file://{directory}", timeout_s, backoff_s)
        if high_bytes is not None and high_bytes <= 0 or not 0 < low_fraction < 1:
            raise ValueError("high_bytes must be positive (or None) and 0 < low_fraction < 1")
        self.root = Path(directory)
        self.tmp = self.root / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.high_bytes = high_bytes
        self.low_bytes = int(high_bytes * low_fraction) if high_bytes else None
        self.tmp_max_age_s = tmp_max_age_s
        self.max_pending = max_pending
        self._workers = ThreadPoolExecutor(2, thread_name_prefix="kv-file-tier")
        self._pending = 0
        self._lock = threading.Lock()
        self._approx_bytes: int | None = None  # of this folder, known after the first sweep
        self._sweeping = False

    def path(self, name: str) -> Path:
        space, block = name.split("/")
        return self.root / space / block[:2] / f"{block}{SUFFIX}"

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)
        super().close()

    # -- bounded calls ------------------------------------------------------------------------

    def _bounded(self, call: Callable[[], T]) -> T:
        with self._lock:
            if self._pending >= self.max_pending:
                raise TimeoutError(f"{self._pending} calls to {self.root} still pending")
            self._pending += 1
        try:
            future = self._workers.submit(self._done_after, call)
        except RuntimeError:  # shut down
            self._done()
            raise
        return future.result(timeout=self.timeout_s)

    def _done_after(self, call: Callable[[], T]) -> T:
        try:
            return call()
        finally:
            self._done()

    def _done(self) -> None:
        with self._lock:
            self._pending -= 1

    # -- the backend --------------------------------------------------------------------------

    def _load(self, name: str) -> bytearray | None:
        return self._bounded(lambda: self._read(self.path(name)))

    def _load_many(self, names: Sequence[str]) -> list[bytearray | None]:
        read = lambda name: self._read(self.path(name))  # noqa: E731
        return self._bounded(lambda: load_until_missing(names, read))  # one worker call

    def _store(self, name: str, blob: bytes) -> bool:
        return self._bounded(lambda: self._write(name, blob))

    def _exists(self, name: str) -> bool:
        return self._bounded(lambda: self.path(name).is_file())

    def _refresh(self, name: str) -> bool:
        return self._bounded(lambda: _touch(self.path(name)))

    def _discard(self, name: str) -> None:
        self._bounded(lambda: self.path(name).unlink(missing_ok=True))

    def _read(self, path: Path) -> bytearray | None:
        try:
            f = path.open("rb", buffering=0)
        except FileNotFoundError:
            return None
        with f:  # from here on the inode is ours, whatever happens to the name
            size = os.fstat(f.fileno()).st_size
            buf = bytearray(size)
            n = f.readinto(buf)
        _touch(path)
        return buf if n == size else buf[:n]  # a short read fails the codec's length check

    def _write(self, name: str, blob: bytes) -> bool:
        path = self.path(name)
        if path.is_file():  # equal bytes already there: a hit's mtime is enough
            _touch(path)
            return True
        tmp = self.tmp / f"{name.replace('/', '-')}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            _write_synced(tmp, blob)
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(path.parent)
        self._account(len(blob))
        return True

    # -- eviction -----------------------------------------------------------------------------

    def _account(self, nbytes: int) -> None:
        """Count a stored object; past the high watermark (or before the first sweep) start
        a sweep in the background, so that no put waits for one."""
        if self.high_bytes is None:
            return
        with self._lock:
            if self._approx_bytes is not None:
                self._approx_bytes += nbytes
            due = not self._sweeping and (
                self._approx_bytes is None or self._approx_bytes > self.high_bytes
            )
            self._sweeping |= due
        if due:
            self._workers.submit(self._background_sweep)

    def _background_sweep(self) -> None:
        total = None
        try:
            total = self.sweep()
        except Exception as e:  # noqa: BLE001 - a failed sweep is retried at the next put
            self._log_once("sweep", f"eviction sweep failed ({e!r})")
        finally:
            with self._lock:
                self._approx_bytes, self._sweeping = total, False

    def sweep(self) -> int:
        """Evict least recently used objects down to the low watermark once the folder is past
        the high one, and stale temporary files; returns the bytes of objects left."""
        now = time.time()
        for tmp in self.tmp.iterdir():
            _unlink_if(tmp, lambda st: now - st.st_mtime > self.tmp_max_age_s)
        objects = sorted(_objects(self.root))  # (mtime, size, path), oldest first
        total = sum(size for _, size, _ in objects)
        if self.high_bytes is None or total <= self.high_bytes:
            return total
        for _, size, path in objects:
            if total <= (self.low_bytes or 0):
                break
            path.unlink(missing_ok=True)  # a reader that opened it keeps its bytes
            self.watch(f"{path.parent.parent.name}/{path.stem}", False)
            total -= size
        return total


def _objects(root: Path) -> list[tuple[float, int, Path]]:
    out = []
    for path in root.glob(f"*/*/*{SUFFIX}"):
        try:
            st = path.stat()
        except FileNotFoundError:  # evicted by another node meanwhile
            continue
        out.append((st.st_mtime, st.st_size, path))
    return out


def _unlink_if(path: Path, stale: Callable[[os.stat_result], bool]) -> None:
    try:
        if stale(path.stat()):
            path.unlink(missing_ok=True)
    except FileNotFoundError:
        pass


def _touch(path: Path) -> bool:
    """Mark the object recently used; False if it is gone."""
    try:
        os.utime(path)
    except FileNotFoundError:
        return False
    except OSError:  # a read-only mount: recency is a hint only
        pass
    return True


def _write_synced(path: Path, blob: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(blob)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable; some filesystems refuse a folder fsync, which is harmless."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
