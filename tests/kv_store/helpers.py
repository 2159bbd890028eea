"""Blocks, keys and a real redis-server for the KV tier tests."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pdserve.common.engine.kv_cache_manager import hash_token_blocks
from pdserve.common.wire.payloads import KVLayout
from pdserve.kv_store import BlockKey, KeySpace
from pdserve.kv_store.local_redis import LocalRedis
from tests.conftest import module_command

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
    return module_command("tests.kv_store.store_proc", *args)


RedisServer = LocalRedis  # a real redis-server on a loopback port, restartable on it


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server on a loopback port for one test (tests/kv_store's and the engine's)."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()
