"""`redis://HOST:PORT[/DB]`: blocks as values in Redis or Valkey (through redis-py, the
`redis` extra).

Put-complete: an object is one SET of the whole encoded block, which Redis applies atomically,
so a reader gets all of it or nothing; two writers of one key each set an equal whole object.
Eviction is the server's: run it with `--maxmemory` and `--maxmemory-policy allkeys-lru`
(docs/kv_tiers.md); a GET returns a whole value or nothing, so eviction during a read is a
miss at worst. A run of blocks is read with one MGET (one round trip). Every call is bounded
by `timeout_s` (connect and socket timeouts, no retries); a server that is down costs one
refused or timed-out call per `backoff_s`.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

from pdserve.kv_store.tier import KVTier

PREFIX = "pdserve:kv:"


class RedisTier(KVTier):
    """Blocks under `PREFIX<namespace>/<hash>` in one Redis database; `ttl_s` expires them."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 0.5,
        backoff_s: float = 1.0,
        ttl_s: float | None = None,
    ) -> None:
        super().__init__(url, timeout_s, backoff_s)
        parts = urlsplit(url)
        if parts.scheme != "redis" or not parts.hostname:
            raise ValueError(f"a Redis store URL is redis://HOST:PORT[/DB], got {url!r}")
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:
            raise ValueError(f"{url} needs redis-py: pip install 'pdserve[redis]'") from e
        self.ttl_ms = int(ttl_s * 1000) if ttl_s else None
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # a retry would double the bounded wait
            retry_on_timeout=False,
            health_check_interval=0,
        )

    def close(self) -> None:
        super().close()
        self._client.close()

    def _load(self, name: str) -> bytes | None:
        return self._client.get(PREFIX + name)

    def _load_many(self, names: Sequence[str]) -> list[bytes | None]:
        return self._client.mget([PREFIX + name for name in names])  # one round trip

    def _store(self, name: str, blob: bytes) -> bool:
        return bool(self._client.set(PREFIX + name, blob, px=self.ttl_ms))

    def _exists(self, name: str) -> bool:
        return bool(self._client.exists(PREFIX + name))

    def _refresh(self, name: str) -> bool:
        return bool(self._client.touch(PREFIX + name))  # exists, and recently used for the LRU

    def _discard(self, name: str) -> None:
        self._client.delete(PREFIX + name)
