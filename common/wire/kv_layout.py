"""The KV layout descriptor both ends of a transfer must agree on before any page moves.

A page written into a block of a cache with another dtype, head count or block size would be
silently wrong tokens later, so the handshake compares a digest of this descriptor and refuses
a mismatch. It travels in control messages (a node's registration) and data-plane ones (the
KV handshake) as a typed map, and lives here, torch-free, so that the router compares layouts
with this very class.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

# Element sizes of the cache dtypes a connector can carry; names are torch's attribute names.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

# Bumped whenever the canonical encoding below changes, so old and new digests never collide.
_DIGEST_SCHEMA = "pdserve-kv-layout/1"


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a KV page means: model, cache dtype and the geometry of one layer's cache.

    A layer cache is `[2, num_blocks, block_size, num_kv_heads, head_dim]`; `num_blocks` is a
    per-node choice and deliberately not part of the layout.
    """

    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError("KVLayout.model_id must be a non-empty string")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer, K and V together."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    def page_shape(self, n_blocks: int) -> tuple[int, int, int, int, int]:
        """Shape of `n_blocks` gathered pages of one layer."""
        return (2, n_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> KVLayout:
        """Build from a wire map; ValueError on unknown, missing or ill-typed fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(body, dict) or set(body) != names:
            raise ValueError(f"a KV layout needs exactly the fields {sorted(names)}")
        return cls(**body)

    def digest(self) -> str:
        """sha256 hex of a canonical encoding (sorted keys, fixed separators, schema tag)."""
        canonical = json.dumps(
            {"schema": _DIGEST_SCHEMA, **self.to_dict()}, sort_keys=True, separators=(",", ":")
        )
        return hashlib.sha256(canonical.encode()).hexdigest()

    def describe_mismatch(
        self, other: KVLayout, labels: tuple[str, str] = ("this", "other")
    ) -> str:
        """One line naming every field that differs with both values; "" when equal."""
        diffs = [
            f"{f.name}: {labels[0]} {getattr(self, f.name)!r} != {labels[1]} "
            f"{getattr(other, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        return "KV layout mismatch: " + "; ".join(diffs) if diffs else ""
