"""A child process that writes to or evicts from a file:// tier, for the multi-process tests.

put DIR FIRST COUNT NBYTES     put blocks FIRST..FIRST+COUNT-1, then print "done"
hang DIR I NBYTES WHERE        start putting block I; print "writing" once half its bytes
                               are written (WHERE=write) or all but before fsync and rename
                               (WHERE=fsync), then wait to be killed
evict DIR HIGH_BYTES SECONDS   sweep the folder down to HIGH_BYTES (low 0.01) in a loop
"""

from __future__ import annotations

import os
import sys
import time

from pdserve.kv_store import FileTier
from tests.kv_store.helpers import key, payload


def _hang(*_: object) -> int:
    print("writing", flush=True)
    time.sleep(600)
    return 0


def _write_half_then_hang(fd: int, data: memoryview) -> int:
    os.write = _hang  # the next write hangs
    return _real_write(fd, data[: len(data) // 2])


_real_write = os.write


def main(mode: str, directory: str, *args: str) -> None:
    if mode == "put":
        first, count, nbytes = map(int, args[:3])
        tier = FileTier(directory, timeout_s=30)
        print("ready", flush=True)
        deadline = time.monotonic() + 120
        while not os.path.exists(args[3]):  # every writer starts at once: they race per key
            assert time.monotonic() < deadline, "no start signal in 120 s"
            time.sleep(0.001)
        for i in range(first, first + count):
            assert tier.put(key(i), payload(i, nbytes)), tier.stats()
        print("done", flush=True)
    elif mode == "hang":
        i, nbytes, where = int(args[0]), int(args[1]), args[2]
        if where == "fsync":  # the writer dies between its last write and the rename
            os.fsync = _hang
        else:
            os.write = _write_half_then_hang
        FileTier(directory, timeout_s=600).put(key(i), payload(i, nbytes))
    elif mode == "evict":
        high, seconds = int(args[0]), float(args[1])
        tier = FileTier(directory, high_bytes=high, low_fraction=0.01)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            tier.sweep()
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(*sys.argv[1:])
