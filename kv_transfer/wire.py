"""Data-plane messages, page checksums and byte views shared by every connector.

Headers are messages of their own plane, `KV_PLANE` (msgpack maps with `type` and `version`,
strictly decoded as control messages are, no pickle): a control message on a KV socket, or a KV
message on a control socket, is an unknown type there. Page bytes never go through msgpack:
they travel as raw frames, NCCL/gloo tensors or shared memory, and the header says what they
are.
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import msgpack
import torch
import torch.nn.functional as F

from pdserve.common.wire.messages import Message, Plane
from pdserve.common.wire.payloads import FirstToken, KVLayout
from pdserve.kernels import ops
from pdserve.kv_transfer.base import TransferError, TransferTimeout

_MASK64 = (1 << 64) - 1

KV_PLANE = Plane("KV data")  # the messages of every connector's sockets
kv_message = KV_PLANE.register


@kv_message
@dataclass(frozen=True, slots=True)
class KVHello(Message):
    """Sender -> receiver, first message on a connection."""

    TYPE: ClassVar[str] = "kvx.hello"
    sender_id: str
    connector: str
    digest: str
    layout: KVLayout
    host_id: str = ""  # the sender's host (`pdserve.common.process.host_id`)


@kv_message
@dataclass(frozen=True, slots=True)
class KVWelcome(Message):
    """Receiver -> sender: handshake accepted; `extra` is what the connector needs (a store
    address, a staging buffer)."""

    TYPE: ClassVar[str] = "kvx.welcome"
    digest: str
    extra: dict[str, Any] = field(default_factory=dict)


@kv_message
@dataclass(frozen=True, slots=True)
class KVRefused(Message):
    """Receiver -> sender: handshake refused. `code` is `layout`, `connector`, `host`
    (shm: the sender runs on another host) or `malformed`."""

    TYPE: ClassVar[str] = "kvx.refused"
    code: str
    reason: str


@kv_message
@dataclass(frozen=True, slots=True)
class KVPage(Message):
    """Header of one frame of pages: `shape` = [planes, len(dst_block_ids), block_size, heads,
    dim] (planes 2: K and V; 1: a latent, see `KVLayout`).

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


@kv_message
@dataclass(frozen=True, slots=True)
class KVDone(Message):
    """Sender -> receiver: end of a transfer, with what the receiver must have seen, and the
    request's first token, which the decode node goes on from.

    `checksum_scheme` names the page checksum `checksum` was built from (another scheme than
    the receiver's fails the transfer). A nixl sender also says what it saw itself, since the
    pages never pass the receiver's code: `sender_error` (WRITEs that failed), `written_blocks`
    (the destination blocks its WRITEs covered) and `writes` (how many WRITEs should land;
    -1 from connectors that send frames).
    """

    TYPE: ClassVar[str] = "kvx.done"
    xfer_id: str
    first: FirstToken
    checksum: int
    pages_per_layer: tuple[int, ...]
    checksum_scheme: str
    sender_error: str = ""
    written_blocks: tuple[int, ...] = ()
    writes: int = -1


@kv_message
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
    """ValueError unless `cache` is one contiguous layer cache of `layout`, holding all its KV
    heads or a tensor-parallel rank's share of them (a number that divides them)."""
    if cache.dim() != 5 or cache.shape[0] != layout.planes:
        raise ValueError(
            f"{what}: a layer cache is [{layout.planes}, num_blocks, bs, H, D], got {cache.shape}"
        )
    heads = cache.shape[3]
    geometry = (layout.block_size, heads, layout.head_dim)
    if tuple(cache.shape[2:]) != geometry or layout.num_kv_heads % heads:
        said = (layout.block_size, layout.num_kv_heads, layout.head_dim)
        raise ValueError(f"{what}: blocks are {tuple(cache.shape[2:])}, layout says {said}")
    if dtype_name(cache.dtype) != layout.dtype:
        raise ValueError(f"{what}: dtype {dtype_name(cache.dtype)}, layout says {layout.dtype}")
    if not cache.is_contiguous():
        raise ValueError(f"{what}: must be contiguous")


# Largest frame a sender makes: large enough that per-frame overheads vanish, small enough
# that buffers stay below glibc's mmap threshold (fresh mappings fault in every page) and
# several frames pipeline through the transport.
FRAME_BYTES = 8 << 20


def blocks_per_frame(page_bytes: int, limit: int = FRAME_BYTES) -> int:
    """How many whole pages of `page_bytes` one frame carries: at most `limit` bytes, at
    least one page."""
    return max(1, limit // page_bytes)


def page_shape(layout: KVLayout, n_blocks: int, heads: int) -> tuple[int, int, int, int, int]:
    """Shape of `n_blocks` gathered pages of one layer carrying `heads` KV heads."""
    return (layout.planes, n_blocks, layout.block_size, heads, layout.head_dim)


def gather_heads(
    layer_cache: torch.Tensor, block_ids: torch.Tensor, heads: range, out: torch.Tensor | None
) -> torch.Tensor:
    """Pages of `block_ids` holding only the cache's KV heads `heads` (a tensor-parallel
    slice), contiguous, into `out` when given."""
    if len(heads) == layer_cache.shape[3]:
        return ops.gather_pages(layer_cache, block_ids, out=out)
    pages = layer_cache[:, block_ids, :, heads.start : heads.stop]
    return pages.contiguous() if out is None else out.copy_(pages)


def heads_in(layer_cache: torch.Tensor, heads: range | None) -> range:
    """`heads` (all of the cache's KV heads when None); ValueError outside the cache."""
    held = range(layer_cache.shape[3])
    if heads is None:
        return held
    if heads.step != 1 or not heads or heads.start < 0 or heads.stop > held.stop:
        raise ValueError(f"KV heads {heads} are not a range within the cache's {held}")
    return heads


def frame_nbytes(page: KVPage, layout: KVLayout) -> int:
    return math.prod(page.shape) * layout.itemsize


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 view (how bfloat16 crosses numpy/zmq)."""
    return t.reshape(-1).view(torch.uint8)


def from_bytes(buf: torch.Tensor, dtype: str, shape: Iterable[int]) -> torch.Tensor:
    """Flat uint8 bytes -> a typed view of `shape` (no copy)."""
    return buf.view(torch_dtype(dtype)).view(tuple(shape))


class FramePool:
    """A few reusable host buffers for frames in flight, so that a sender's gathers (and a
    receiver's recvs) do not fault in fresh memory for every frame.

    `take` lends one as a tensor of the frame's shape, or None when all are lent (the caller
    then allocates, as without a pool); `give_back` returns a lent tensor's buffer once the
    transport let go of it, and ignores tensors that are not the pool's. A buffer never given
    back (its frame was dropped unsent, or its recv failed and may still land) stays lent.
    """

    def __init__(self, count: int, nbytes: int) -> None:
        self._count, self._nbytes = count, nbytes
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # storage address -> buffer

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        nbytes = math.prod(shape) * dtype.itemsize
        if len(self._lent) >= self._count or nbytes > self._nbytes:
            return None
        buf = self._free.pop() if self._free else torch.empty(self._nbytes, dtype=torch.uint8)
        self._lent[buf.data_ptr()] = buf
        return from_bytes(buf[:nbytes], dtype_name(dtype), shape)

    def give_back(self, frame: torch.Tensor) -> None:
        buf = self._lent.pop(frame.untyped_storage().data_ptr(), None)
        if buf is not None:
            self._free.append(buf)


# -- checksums ----------------------------------------------------------------------------------

# Named in every welcome's `extra` and every done message: both ends must compute the same
# function, so a change to `page_checksum` must change this name.
CHECKSUM_SCHEME = "pdserve-rowcol64/1"
# int64 words per checksum row. Not a power of two: summing columns of rows 2**k words apart
# ran at half speed (cache set conflicts); with 1000 both sums take about as long as a copy.
CHECKSUM_ROW_WORDS = 1000


def page_checksum(t: torch.Tensor) -> torch.Tensor:
    """Checksum of a contiguous tensor's bytes, computed on t's device without a sync.

    The bytes are read as little-endian int64 words in rows of CHECKSUM_ROW_WORDS (the last row
    zero-padded; a frame's length is fixed by its header) and the result is three sums mod
    2**64: of all words, of each row's sum times its row number, and of each column's sum times
    its column number (numbers from 1). A changed byte changes its word by d * 256**k with
    0 < |d| < 256 and k < 8, never a multiple of 2**64, so the plain sum changes; a word moved
    to another row or column changes a weighted sum unless the two words agree in nearly all
    their bits. Integer sums are exact, so every device and reduction order gives the same
    value: ends on different devices agree. Two passes of integer sums run at memory speed
    (crc32 ran at about 3.5 GB/s on one core).

    Returns a 3-element int64 tensor; `resolve` it late so CUDA callers do not stall.
    """
    raw = as_bytes(t)
    if raw.storage_offset() % 8 or raw.numel() % 8:  # int64 views need aligned whole words
        raw = torch.cat([raw, raw.new_zeros(-raw.numel() % 8)])  # a copy, even of 0 bytes
    words = raw.view(torch.int64)
    if words.numel() < 4 * CHECKSUM_ROW_WORDS:  # padding a small one costs less than more ops
        words = F.pad(words, (0, -words.numel() % CHECKSUM_ROW_WORDS))
    full = words.numel() // CHECKSUM_ROW_WORDS * CHECKSUM_ROW_WORDS
    body = words[:full].view(-1, CHECKSUM_ROW_WORDS)
    rows, cols = body.sum(1), body.sum(0)
    if full < words.numel():  # the last, short row
        rest = words[full:]
        rows = torch.cat([rows, rest.sum().view(1)])
        cols[: rest.numel()] += rest
    sums = torch.cat([rows, cols]).unsqueeze(1) * _weights(rows.numel(), raw.device)
    return sums.sum(0)


@functools.lru_cache(maxsize=64)
def _weights(n_rows: int, device: torch.device) -> torch.Tensor:
    """[n_rows + CHECKSUM_ROW_WORDS, 3] weights of (row sums, column sums) for the three checksum
    sums: plain (rows 1, columns 0), by row (rows 1..n_rows), by column (columns 1..)."""
    weights = torch.zeros(n_rows + CHECKSUM_ROW_WORDS, 3, dtype=torch.int64, device=device)
    weights[:n_rows, 0] = 1
    weights[:n_rows, 1] = torch.arange(1, n_rows + 1, device=device)
    weights[n_rows:, 2] = torch.arange(1, CHECKSUM_ROW_WORDS + 1, device=device)
    return weights


def resolve(checksum: int | torch.Tensor) -> int:
    """A checksum as one 64-bit int: ints pass through, `page_checksum` tensors are hashed."""
    if isinstance(checksum, int):
        return checksum & _MASK64
    words = [v & _MASK64 for v in checksum.tolist()]
    digest = hashlib.blake2b(msgpack.packb(words), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def welcome_extra(**extra: Any) -> dict[str, Any]:
    """A receiver's welcome `extra`: the connector's fields plus the checksum scheme."""
    return {"checksum": CHECKSUM_SCHEME, **extra}


def check_welcome(extra: dict[str, Any], endpoint: str) -> None:
    """TransferError unless the receiver checksums pages the way this sender does."""
    theirs = extra.get("checksum", "crc32 (a receiver older than the scheme field)")
    if theirs != CHECKSUM_SCHEME:
        raise TransferError(
            f"{endpoint} checksums pages with {theirs!r}, this sender with "
            f"{CHECKSUM_SCHEME!r}; run the same pdserve version on both ends"
        )


def frame_digest(layer: int, dst_block_ids: Iterable[int], checksum: int) -> int:
    """Where a frame went plus what it held, as 64 bits; transfer digests add these up mod 2**64
    so the receiver's order of arrival does not matter."""
    key = msgpack.packb([layer, list(dst_block_ids), checksum])
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def combine(digests: Iterable[int]) -> int:
    return sum(digests) & _MASK64


# -- waits and faults ---------------------------------------------------------------------------


def to_ms(seconds: float) -> int:
    """A zmq timeout (ms, never negative) of `seconds`."""
    return max(0, int(seconds * 1000))


def wait_event(event: Any, deadline: float, what: str) -> None:
    """Spin on a CUDA event with a deadline; `event.synchronize()` could wait forever."""
    while not event.query():
        if time.monotonic() >= deadline:
            raise TransferTimeout(f"{what}: device work not finished in time")
        time.sleep(0.0002)


class SendFaults(Protocol):
    """Faults a test installs on a sender (`sender.faults`; `pdserve.testbed.kvfaults` for
    node processes). Production senders have none and read nothing from the environment."""

    def drop(self, xfer_id: str) -> bool:
        """Whether to book this frame (a nixl layer WRITE) and never send it; may delay first."""
        ...

    def corrupt(self, xfer_id: str) -> bool:
        """Whether to damage this frame after its checksum was taken."""
        ...


def corrupt_first_byte(t: torch.Tensor) -> None:
    as_bytes(t)[:1].bitwise_xor_(0x5A)
