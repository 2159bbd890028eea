"""redis:// against a real redis-server: round trips, damaged values, a server that is down,
and a server killed and restarted under a loop of gets and puts."""

from __future__ import annotations

import time

import pytest

from pdserve.kv_store import codec, open_store
from pdserve.kv_store.redis_tier import PREFIX, RedisTier
from pdserve.local_cluster import free_port
from tests.kv_store.helpers import RedisServer, key, payload


def test_round_trip(redis_server: RedisServer) -> None:
    tier = open_store(redis_server.url)
    assert tier.get(key(1)) is None and not tier.contains(key(1))
    assert tier.put(key(1), payload(1)) and tier.put(key(1), payload(1))
    assert tier.contains(key(1)) and tier.get(key(1)) == payload(1)
    s = tier.stats()
    assert (s.hits, s.misses, s.puts, s.errors) == (1, 1, 2, 0)


@pytest.mark.parametrize("damage", ["truncate", "corrupt", "wrong-layout"])
def test_a_damaged_value_is_a_miss(damage: str, redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url)
    blob = bytearray(codec.encode(key(1), payload(1)))
    if damage == "truncate":
        blob = blob[: len(blob) // 2]
    elif damage == "corrupt":
        blob[-100] ^= 0x80  # in the payload: only the checksum can tell
    else:
        blob = bytearray(codec.encode(key(2), payload(1)))
    tier._client.set(PREFIX + key(1).name, bytes(blob))
    assert tier.get(key(1)) is None
    assert tier.stats().bad_objects == 1 and not tier.contains(key(1)), "dropped"


def test_a_server_that_is_down_costs_misses_not_errors() -> None:
    tier = RedisTier(f"redis://127.0.0.1:{free_port()}", timeout_s=0.2, backoff_s=60)
    for i in range(10):
        assert tier.get(key(i)) is None and not tier.put(key(i), payload(i))
    s = tier.stats()
    assert s.errors == 1 and s.skipped == 19, "asked once, then skipped while backing off"


def test_kill_and_restart_under_load(redis_server: RedisServer) -> None:
    """No exception escapes while the server is gone; misses are counted; the tier serves
    again once the server is back (empty: it kept nothing on disk)."""
    tier = RedisTier(redis_server.url, timeout_s=0.2, backoff_s=0.05)

    def loop(rounds: int) -> tuple[int, int]:
        hits = stored = 0
        for i in range(rounds):
            stored += tier.put(key(i % 16), payload(i % 16))
            got = tier.get(key(i % 16))
            assert got is None or got == payload(i % 16)
            hits += got is not None
        return hits, stored

    assert loop(40) == (40, 40)
    redis_server.kill()
    assert loop(40) == (0, 0)
    down = tier.stats()
    assert down.errors >= 1 and down.misses >= 40
    redis_server.start()
    deadline = time.monotonic() + 30
    while loop(16) != (16, 16):
        assert time.monotonic() < deadline, "the tier did not recover in 30 s"
        time.sleep(0.05)
    assert tier.stats().bad_objects == 0
