"""Data-plane messages, page checksums and byte views shared by every connector.

Headers are messages of `common.protocol` (msgpack maps with `type` and `version`, strictly
decoded, no pickle); their types start with `kvx.` so they never collide with control-plane
messages. Page bytes never go through msgpack: they travel as raw frames, NCCL/gloo tensors or
shared memory, and the header says what they are.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import torch

from common.protocol import Message, message
from kv_transfer.base import TransferTimeout
from kv_transfer.layout import KVLayout

_MASK64 = (1 << 64) - 1
FAULT_ENV = "PDSERVE_FAULT_CORRUPT_KV"


@message
@dataclass(frozen=True, slots=True)
class KVHello(Message):
    """Sender -> receiver, first message on a connection."""

    TYPE: ClassVar[str] = "kvx.hello"
    sender_id: str
    connector: str
    digest: str
    layout: dict[str, Any]


@message
@dataclass(frozen=True, slots=True)
class KVWelcome(Message):
    """Receiver -> sender: handshake accepted; `extra` is what the connector needs (a store
    address, a staging buffer)."""

    TYPE: ClassVar[str] = "kvx.welcome"
    digest: str
    extra: dict[str, Any] = field(default_factory=dict)


@message
@dataclass(frozen=True, slots=True)
class KVRefused(Message):
    """Receiver -> sender: handshake refused. `code` is `layout`, `connector` or `malformed`."""

    TYPE: ClassVar[str] = "kvx.refused"
    code: str
    reason: str


@message
@dataclass(frozen=True, slots=True)
class KVPage(Message):
    """Header of one frame of pages: `shape` = [2, len(dst_block_ids), block_size, heads, dim].

    `offset` is the frame's absolute position in the shm staging ring (-1 elsewhere).
    """

    TYPE: ClassVar[str] = "kvx.page"
    xfer_id: str
    layer: int
    dst_block_ids: tuple[int, ...]
    dtype: str
    shape: tuple[int, ...]
    seq: int
    offset: int = -1


@message
@dataclass(frozen=True, slots=True)
class KVDone(Message):
    """Sender -> receiver: end of a transfer, with what the receiver must have seen."""

    TYPE: ClassVar[str] = "kvx.done"
    xfer_id: str
    meta: dict[str, Any]
    checksum: int
    pages_per_layer: tuple[int, ...]


@message
@dataclass(frozen=True, slots=True)
class KVCredit(Message):
    """Receiver -> shm sender: staging bytes up to `consumed` (absolute) may be reused."""

    TYPE: ClassVar[str] = "kvx.credit"
    consumed: int


# -- layout and byte views ----------------------------------------------------------------------


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    assert isinstance(dtype, torch.dtype), f"{name!r} is not a torch dtype"
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_cache(layout: KVLayout, cache: torch.Tensor, what: str) -> None:
    """ValueError unless `cache` is one contiguous layer cache of `layout`."""
    if cache.dim() != 5 or cache.shape[0] != 2:
        raise ValueError(f"{what}: a layer cache is [2, num_blocks, bs, H, D], got {cache.shape}")
    geometry = (layout.block_size, layout.num_kv_heads, layout.head_dim)
    if tuple(cache.shape[2:]) != geometry:
        raise ValueError(f"{what}: blocks are {tuple(cache.shape[2:])}, layout says {geometry}")
    if dtype_name(cache.dtype) != layout.dtype:
        raise ValueError(f"{what}: dtype {dtype_name(cache.dtype)}, layout says {layout.dtype}")
    if not cache.is_contiguous():
        raise ValueError(f"{what}: must be contiguous")


def frame_nbytes(page: KVPage, layout: KVLayout) -> int:
    return math.prod(page.shape) * layout.itemsize


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 view (how bfloat16 crosses numpy/zmq)."""
    return t.reshape(-1).view(torch.uint8)


def from_bytes(buf: torch.Tensor, dtype: str, shape: Iterable[int]) -> torch.Tensor:
    """Flat uint8 bytes -> a typed view of `shape` (no copy)."""
    return buf.view(torch_dtype(dtype)).view(tuple(shape))


# -- checksums ----------------------------------------------------------------------------------

_CHUNK = 1 << 22  # elements per reduction step, so the int64 temporaries stay small
_MIX = 0x3E3779B97F4A7C15  # odd, fits int64: mixes the position-weighted sum into the plain one


def page_checksum(t: torch.Tensor) -> int | torch.Tensor:
    """Checksum of a contiguous tensor's bytes.

    CPU: crc32 (several GB/s, no temporaries). CUDA: a plain plus a position-weighted sum of
    32-bit words computed on the device, returned as a 0-dim tensor so the caller does not
    stall the stream; `int()` it late. Both ends of a connector always checksum bytes on the
    same device type (the bytes as they cross the transport), so the two schemes never meet.
    """
    if t.device.type == "cpu":
        return zlib.crc32(as_bytes(t).numpy())
    return device_checksum(t)


def device_checksum(t: torch.Tensor) -> torch.Tensor:
    """Position-weighted sum of the words of `t`, modulo 2**64, on t's device.

    Any single changed word changes the plain sum; swapped words change the weighted one.
    Integer reductions are exact, so the value does not depend on reduction order.
    """
    raw = as_bytes(t)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    plain = torch.zeros((), dtype=torch.int64, device=t.device)
    weighted = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK].to(torch.int64)
        pos = torch.arange(start + 1, start + 1 + chunk.numel(), device=t.device)
        plain += chunk.sum()
        weighted += (chunk * pos).sum()
    return plain + weighted * _MIX


def resolve(checksum: int | torch.Tensor) -> int:
    return int(checksum) & _MASK64


def frame_digest(layer: int, dst_block_ids: Iterable[int], checksum: int) -> int:
    """Where a frame went plus what it held, as 64 bits; transfer digests add these up mod 2**64
    so the receiver's order of arrival does not matter."""
    key = msgpack.packb([layer, list(dst_block_ids), checksum])
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def combine(digests: Iterable[int]) -> int:
    return sum(digests) & _MASK64


# -- waits and faults ---------------------------------------------------------------------------


def wait_event(event: Any, deadline: float, what: str) -> None:
    """Spin on a CUDA event with a deadline; `event.synchronize()` could wait forever."""
    while not event.query():
        if time.monotonic() >= deadline:
            raise TransferTimeout(f"{what}: device work not finished in time")
        time.sleep(0.0002)


def fault_targets() -> frozenset[str] | None:
    """Test-only fault hook: xfer ids whose pages a sender corrupts after checksumming them.

    `PDSERVE_FAULT_CORRUPT_KV=1` corrupts every transfer, `=a,b` only xfer ids a and b. Read
    once when a sender is built; None (the normal case) when unset.
    """
    value = os.environ.get(FAULT_ENV, "")
    if not value:
        return None
    return frozenset({"*"} if value == "1" else value.split(","))


FAULT_PLAN_ENV = "PDSERVE_FAULT_KV"


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """Test-only fault hook for fault-injection runs: each frame a sender ships is dropped,
    corrupted or delayed with the given probabilities, from a seeded stream.

    `PDSERVE_FAULT_KV="drop=0.02,corrupt=0.02,delay=0.1,delay_s=0.05,seed=1"`. A dropped frame
    is booked (counted in the done message) but never sent; a corrupted one is damaged after
    its checksum was taken; a delayed one waits `delay_s` first. None when unset.
    """

    drop: float = 0.0
    corrupt: float = 0.0
    delay: float = 0.0
    delay_s: float = 0.05
    seed: int = 0

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        value = os.environ.get(FAULT_PLAN_ENV, "")
        if not value:
            return None
        fields = dict(item.split("=", 1) for item in value.split(","))
        return cls(**{k: (int if k == "seed" else float)(v) for k, v in fields.items()})


def corrupt_first_byte(t: torch.Tensor) -> None:
    as_bytes(t)[:1].bitwise_xor_(0x5A)
