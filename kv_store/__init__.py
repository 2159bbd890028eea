"""KV tiers below a node's block pool (docs/kv_tiers.md): a block key naming everything that
makes a block's bytes valid, a codec that refuses any other bytes, and tiers that fail closed:
`HostTier` (this process's memory), `FileTier` (`file://DIR`), `RedisTier` (`redis://`), and
`TierChain` to stack them."""

from __future__ import annotations

from urllib.parse import urlsplit

from pdserve.kv_store.chain import TierChain
from pdserve.kv_store.file_tier import FileTier
from pdserve.kv_store.host import HostTier
from pdserve.kv_store.key import BlockKey, KeySpace
from pdserve.kv_store.tier import KVTier, TierStats

__all__ = [
    "BlockKey",
    "FileTier",
    "HostTier",
    "KVTier",
    "KeySpace",
    "TierChain",
    "TierStats",
    "open_store",
]


def open_store(url: str, timeout_s: float | None = None) -> KVTier:
    """The shared tier `url` names: file://DIR or redis://HOST:PORT[/DB]; ValueError otherwise."""
    scheme = urlsplit(url).scheme
    kwargs = {} if timeout_s is None else {"timeout_s": timeout_s}
    if scheme == "file":
        path = url.removeprefix("file://")
        if not path:
            raise ValueError(f"a file store URL is file:///absolute/dir, got {url!r}")
        return FileTier(path, **kwargs)
    if scheme == "redis":
        from pdserve.kv_store.redis_tier import RedisTier

        return RedisTier(url, **kwargs)
    raise ValueError(f"--kv-store {url!r}: use file://DIR or redis://HOST:PORT")
