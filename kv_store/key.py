"""What names a stored KV block: the pool's chained block hash (parent and tokens) inside a key
space that names everything else that makes the bytes valid.

The layout digest (`KVLayout.digest`) already covers the model fingerprint with its weight form
(`ModelRunner.kv_layout` appends it to `model_id`), the cache dtype, the layer count, KV heads,
head_dim, block size and planes. A tensor-parallel rank holds a slice of every block's heads,
so the rank and the group size enter the space too: rank 1 of 2 never reads rank 0's slice.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from pdserve.common.engine.kv_cache_manager import BlockHash
from pdserve.common.wire.payloads import KVLayout

# Bumped when what a space hashes changes, so old and new names never meet.
_SPACE_SCHEMA = b"pdserve-kv-space/1"


@dataclass(frozen=True, slots=True)
class KeySpace:
    """The blocks of one KV layout at one tensor-parallel slice (rank `tp_rank` of `tp_size`)."""

    layout_digest: str
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.layout_digest, str) or len(self.layout_digest) != 64:
            raise ValueError(f"a layout digest is 64 hex digits, got {self.layout_digest!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is not a rank of a group of {self.tp_size}")

    @classmethod
    def of(cls, layout: KVLayout, tp_rank: int = 0, tp_size: int = 1) -> KeySpace:
        return cls(layout.digest(), tp_rank, tp_size)

    @property
    def namespace(self) -> str:
        """32 hex digits: a folder (file://) or key prefix (redis://) per space."""
        h = hashlib.sha256(_SPACE_SCHEMA)
        h.update(f"{self.layout_digest}:{self.tp_rank}/{self.tp_size}".encode())
        return h.hexdigest()[:32]

    def key(self, block_hash: BlockHash) -> BlockKey:
        return BlockKey(self, block_hash)


@dataclass(frozen=True, slots=True)
class BlockKey:
    """One block of one space: `block_hash` is the pool's chained hash of the block's tokens
    and its parent (`hash_block_tokens`), the one the router also computes."""

    space: KeySpace
    block_hash: BlockHash

    def __post_init__(self) -> None:
        if not isinstance(self.block_hash, bytes) or not self.block_hash:
            raise ValueError(f"a block hash is non-empty bytes, got {self.block_hash!r}")

    @property
    def name(self) -> str:
        """`<namespace>/<block hash hex>`: the object's name in every backend."""
        return f"{self.space.namespace}/{self.block_hash.hex()}"
