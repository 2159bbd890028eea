"""Puts into a shared store off the caller's path.

The pool writes a block down when it evicts it, inside the scheduler's call that needed the
block: a `file://` put there costs two fsyncs (about 10 ms a block on this machine's disk
against 0.5 ms for a read), and a prompt that evicts thirty blocks waited for all of them
(issue 40's trace: file store requests 0.73x no tier's speed). `WriteBehind` takes the payload
(the caller's copy of the pages, so the block can be reused at once) and puts it through the
tier on a thread of its own. The tier's rules still hold: its guard bounds every call, a
reader sees a whole object or none, and a block still queued is a miss for everyone (no
reader is handed bytes that are not in the store yet), except this process's own reads: `queued`
hands them the payload still waiting, the bytes that are about to be stored.

The writer spends its CPU (encode, checksum, write: ~2 ms a block here) beside the engine's
threads on the same cores, so it runs at a lower CPU priority (Linux threads have their own
nice value; `WRITER_NICE` above the process's) and skips a block the store already holds
(`KVTier.refresh`: a stat or a Redis TOUCH) before encoding it.

Bounded: past `max_bytes` queued a put is dropped (counted in `dropped`), never waited for;
the store is a cache. `flush` waits for the queue to drain, `close` flushes then stops.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

from pdserve.kv_store.key import BlockKey
from pdserve.kv_store.tier import KVTier

WRITER_NICE = 10  # the writer thread's niceness above the process's (Linux; a no-op elsewhere)


def _lower_priority(increment: int) -> None:
    """Lower the calling thread's CPU priority (Linux: per thread); best effort."""
    try:
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment)
        )
    except (AttributeError, OSError):
        pass


class WriteBehind:
    """`tier`'s puts, queued (at most `max_bytes` of payloads) and run on one thread."""

    def __init__(self, tier: KVTier, max_bytes: int = 64 << 20) -> None:
        if max_bytes <= 0:
            raise ValueError(f"a write-behind queue needs a positive byte bound, got {max_bytes}")
        self.tier = tier
        self.max_bytes = max_bytes
        self.dropped = 0  # puts refused because the queue was full (or closed)
        self.served = 0  # reads answered from the queue (`queued`)
        self.present = 0  # puts skipped: the store already held the block
        self._queue: deque[tuple[BlockKey, bytes]] = deque()
        # Each queued name's newest payload and how many puts of it are queued: a name leaves
        # only once its last put ran, so until then a read finds it here, after in the tier.
        self._waiting: dict[str, tuple[bytes, int]] = {}
        self._bytes = 0
        self._closed = False
        # While the engine runs a forward (`hold`), the writer starts no put unless the queue
        # is half full: its CPU (encode, checksum, write) would slow the forward's threads on
        # the same cores. It writes between steps, and always once the queue fills.
        self.yields = True
        self._held = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name=f"kv-write-behind {tier.name}", daemon=True
        )
        self._thread.start()

    def put(self, key: BlockKey, payload: bytes | bytearray | memoryview) -> bool:
        """Queue the block for the tier; False (dropped) if the queue is full or closed."""
        data = bytes(payload)
        with self._cond:
            if self._closed or self._bytes + len(data) > self.max_bytes:
                self.dropped += 1
                return False
            self._queue.append((key, data))
            self._bytes += len(data)
            self._waiting[key.name] = (data, self._waiting.get(key.name, (b"", 0))[1] + 1)
            self._cond.notify_all()
        return True

    def _run(self) -> None:
        _lower_priority(WRITER_NICE)
        while True:
            with self._cond:
                while not self._closed and (not self._queue or self._yielding()):
                    self._cond.wait()
                if not self._queue:
                    return
                key, data = self._queue[0]
            if self.tier.refresh(key):  # never raise: the tier's guard counts a failure
                self.present += 1
            else:
                self.tier.put(key, data)
            with self._cond:
                self._queue.popleft()
                self._bytes -= len(data)
                newest, count = self._waiting.pop(key.name)
                if count > 1:
                    self._waiting[key.name] = (newest, count - 1)
                self._cond.notify_all()

    def hold(self, held: bool) -> None:
        """A forward starts (True) or ends (False): see `yields`."""
        with self._cond:
            self._held = held
            if not held:
                self._cond.notify_all()

    def _yielding(self) -> bool:
        return self._held and self.yields and self._bytes < self.max_bytes // 2

    def queued(self, key: BlockKey) -> memoryview | None:
        """The payload of `key` still waiting to be put (it was read whole from the pool when
        queued), or None: never put here, or already in the tier (or failed there)."""
        with self._cond:
            waiting = self._waiting.get(key.name)
            self.served += waiting is not None
        return None if waiting is None else memoryview(waiting[0])

    def has(self, key: BlockKey) -> bool:
        """Whether `key` is still queued (served from the queue if read; not counted)."""
        with self._cond:
            return key.name in self._waiting

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued put ran (True), or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._held = False  # a flush is waited for: the writer goes on at once
            self._cond.notify_all()
            while self._queue:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float) -> None:
        """Flush (bounded by `timeout_s`), then stop the thread; later puts are dropped."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
