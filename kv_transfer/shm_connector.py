"""KV pages through shared memory between processes on one host.

Each sender gets its own staging ring from the receiver: a file in /dev/shm both processes map
(CPU caches) or a CUDA allocation on the receiver's GPU opened by the sender through a CUDA IPC
handle (CUDA caches). The sender copies a frame of gathered pages into the ring and sends its
header (with the ring offset) over the zmq side channel; the receiver validates the header,
scatters the pages from the ring into the reserved blocks and returns credits, so the sender
knows which ring bytes it may reuse.

Why a staging ring and not the receiver's cache tensors themselves: a sender writing straight
into the cache could not be stopped from writing into blocks that were never reserved for it,
or that the decode node reused after `cancel`. With staging, the receiver stays the only writer
of its cache, at the price of one device-local copy.

The CUDA IPC path cannot run in CI (no GPU); the handle fields cross as msgpack, never pickle.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pdserve.common.process import host_id
from pdserve.common.wire.messages import Message
from pdserve.common.wire.payloads import KVLayout
from pdserve.common.wire.security import CurveKeys
from pdserve.kv_transfer.base import TransferError
from pdserve.kv_transfer.channel import ChannelSender
from pdserve.kv_transfer.channel_receiver import ChannelReceiver, Peer
from pdserve.kv_transfer.wire import (
    FRAME_BYTES,
    KVCredit,
    KVHello,
    KVPage,
    KVRefused,
    blocks_per_frame,
    check_welcome,
    dtype_name,
    frame_nbytes,
    from_bytes,
    wait_event,
    welcome_extra,
)

ALIGN = 256  # ring offsets stay aligned for every dtype and for fast device copies
_DEFAULT_STAGING = 32 << 20


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _default_shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _share_cuda(staging: torch.Tensor) -> dict[str, Any]:
    """The CUDA IPC handle of a fresh allocation as plain msgpack-able fields."""
    (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
        staging.untyped_storage()._share_cuda_()
    )
    return {
        "kind": "cuda_ipc",
        "device": int(device),
        "handle": bytes(handle),
        "storage_bytes": int(size),
        "storage_offset": int(offset),
        "ref_handle": bytes(ref_handle),
        "ref_offset": int(ref_offset),
        "event_handle": bytes(event_handle) if event_handle is not None else None,
        "event_sync": bool(event_sync),
    }


def _open_cuda(extra: dict[str, Any], nbytes: int) -> torch.Tensor:
    """Map a receiver's staging allocation from `_share_cuda` fields (mirrors
    torch.multiprocessing.reductions.rebuild_cuda_tensor, without pickle)."""
    device = int(extra["device"])
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        device,
        extra["handle"],
        extra["storage_bytes"],
        extra["storage_offset"],
        extra["ref_handle"],
        extra["ref_offset"],
        extra["event_handle"],
        extra["event_sync"],
    )
    staging = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
    return staging.set_(storage, 0, (nbytes,), (1,))


@dataclass(frozen=True, slots=True)
class _Slot:
    """A ring slot a sender reserved for the frame it is gathering."""

    written_before: int  # the sender's `_written` before the reservation, to undo it
    offset: int  # absolute ring offset
    view: torch.Tensor


@dataclass
class _Ring:
    staging: torch.Tensor
    path: str  # "" for CUDA staging
    consumed: int = 0  # absolute, aligned end of the last frame we took


class ShmReceiver(ChannelReceiver):
    """Decode side of the shm connector. Options: `staging_bytes` per sender (default 32 MiB,
    at least one page), `shm_dir` for the CPU staging files."""

    CONNECTOR: ClassVar[str] = "shm"

    def __init__(
        self,
        layout: KVLayout,
        kv_caches: list[torch.Tensor],
        host: str = "127.0.0.1",
        port: int = 0,
        staging_bytes: int = _DEFAULT_STAGING,
        shm_dir: str | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        super().__init__(layout, kv_caches, host, port, curve=curve)
        self._capacity = staging_bytes // ALIGN * ALIGN
        if self._capacity < layout.page_bytes:
            raise ValueError(f"staging_bytes {staging_bytes} below one page ({layout.page_bytes})")
        self._device = kv_caches[0].device
        self._shm_dir = shm_dir or _default_shm_dir()

    def _refuse_peer(self, hello: KVHello) -> KVRefused | None:
        if hello.host_id != host_id():
            return KVRefused(
                "host",
                "shm moves KV through shared memory on one host, and this prefill node runs on "
                "another (its host id differs): use --kv-connector zmq, nccl or nixl across hosts",
            )
        return None

    def _accept_peer(self, peer: Peer) -> dict[str, Any]:
        if self._device.type == "cuda":
            staging = torch.empty(self._capacity, dtype=torch.uint8, device=self._device)
            peer.state = _Ring(staging, "")
            return welcome_extra(**_share_cuda(staging), nbytes=self._capacity)
        path = os.path.join(self._shm_dir, f"pdserve-kv-{os.getpid()}-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self._capacity)
        finally:
            os.close(fd)
        staging = torch.from_file(path, shared=True, size=self._capacity, dtype=torch.uint8)
        peer.state = _Ring(staging, path)
        return welcome_extra(kind="file", path=path, nbytes=self._capacity)

    def _on_page_data(self, peer: Peer, page: KVPage, frames: list[Any], admitted: bool) -> None:
        ring: _Ring = peer.state
        nbytes = frame_nbytes(page, self.layout)
        start = page.offset % self._capacity
        if (
            frames
            or page.offset < ring.consumed
            or page.offset % ALIGN
            or start + nbytes > (self._capacity)
        ):
            # The ring is out of step with this sender; nothing it sends can be trusted now.
            if admitted:
                self._book.fail(page, f"bad staging offset {page.offset}")
            self._book.counters["bad_offset"] += 1
            self._drop_peer(self._peers.pop(peer.identity))
            return
        if admitted:
            self._land(
                page, from_bytes(ring.staging[start : start + nbytes], page.dtype, page.shape)
            )
            if ring.staging.is_cuda:  # the scatter must have read the ring before we free it
                done = torch.cuda.Event()
                done.record()
                wait_event(done, time.monotonic() + 30.0, "shm scatter")
        ring.consumed = _align(page.offset + nbytes)
        self._reply(peer.identity, KVCredit(ring.consumed))

    def _drop_peer(self, peer: Peer) -> None:
        ring: _Ring | None = peer.state
        if ring is not None and ring.path:
            try:  # normally the sender unlinked it right after mapping it
                os.unlink(ring.path)
            except FileNotFoundError:
                pass
        peer.state = None


class ShmSender(ChannelSender):
    """Prefill side of the shm connector. Option `send_timeout` (s) bounds the wait for ring
    space (the receiver frees it from its `poll`)."""

    CONNECTOR: ClassVar[str] = "shm"

    def __init__(
        self, layout: KVLayout, send_timeout: float = 30.0, curve: CurveKeys | None = None
    ) -> None:
        super().__init__(layout, send_timeout, curve)
        self._staging: torch.Tensor | None = None
        self._capacity = 0
        self._written = 0  # absolute, aligned end of the last frame we placed
        self._consumed = 0  # absolute, as credited by the receiver
        self._slot: _Slot | None = None  # reserved by _frame_buffer, not yet shipped

    def _on_welcome(self, extra: dict[str, Any], timeout: float) -> None:
        check_welcome(extra, self._endpoint)
        try:
            kind, nbytes = extra["kind"], int(extra["nbytes"])
            if kind == "file":
                self._staging = self._open_file(str(extra["path"]), nbytes)
            elif kind == "cuda_ipc":
                self._staging = _open_cuda(extra, nbytes)
            else:
                raise TransferError(f"unknown staging kind {kind!r}")
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"bad shm welcome: {exc!r}") from None
        self._capacity = nbytes
        if nbytes < self.layout.page_bytes or nbytes % ALIGN:
            raise TransferError(f"staging of {nbytes} bytes cannot hold aligned pages")

    @staticmethod
    def _open_file(path: str, nbytes: int) -> torch.Tensor:
        if not os.path.exists(path):
            raise TransferError(f"staging file {path} not found: shm needs one host")
        staging = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        os.unlink(path)  # both sides have it mapped; nothing is left behind if either dies
        return staging

    def _on_message(self, msg: Message) -> None:
        if isinstance(msg, KVCredit):
            self._consumed = max(self._consumed, msg.consumed)

    def _max_blocks_per_frame(self) -> int:
        return blocks_per_frame(self.layout.page_bytes, min(FRAME_BYTES, self._capacity))

    def _frame_buffer(
        self, shape: tuple[int, ...], layer_cache: torch.Tensor
    ) -> torch.Tensor | None:
        """The next ring slot, so that pages are gathered straight into it: one pass fewer
        than gathering and copying. Not across devices (a CUDA ring on another GPU)."""
        assert self._staging is not None
        if layer_cache.device != self._staging.device:
            return None
        if self._slot is not None:  # its frame was never shipped (a fault plan drop): reuse it
            self._written = self._slot.written_before
        written_before = self._written
        nbytes = math.prod(shape) * layer_cache.element_size()
        offset = self._reserve(nbytes, time.monotonic() + self._send_timeout)
        view = self._ring_view(offset, shape, layer_cache.dtype)
        self._slot = _Slot(written_before, offset, view)
        return view

    def _ring_view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        assert self._staging is not None
        start = offset % self._capacity
        nbytes = math.prod(shape) * dtype.itemsize
        return from_bytes(self._staging[start : start + nbytes], dtype_name(dtype), shape)

    def _ship(self, page: KVPage, pages: torch.Tensor) -> None:
        assert self._staging is not None
        if pages.device.type != self._staging.device.type:
            raise ValueError(
                f"receiver stages on {self._staging.device}, pages are on {pages.device}"
            )
        slot, self._slot = self._slot, None
        if slot is not None and pages is slot.view:
            offset, staged = slot.offset, pages
        else:
            nbytes = pages.numel() * pages.element_size()
            offset = self._reserve(nbytes, time.monotonic() + self._send_timeout)
            staged = self._ring_view(offset, tuple(pages.shape), pages.dtype)
            staged.copy_(pages)
        page = dataclasses.replace(page, offset=offset)
        self._seal(page, staged)
        copied = None
        if staged.is_cuda:  # the receiver may read only after our copy is done
            copied = torch.cuda.Event()
            copied.record()
        self._defer(copied, lambda: self._send(page))

    def _reserve(self, nbytes: int, deadline: float) -> int:
        """Absolute ring offset for `nbytes`, waiting for credits while the ring is full."""
        while True:
            start = self._written % self._capacity
            pad = self._capacity - start if start + nbytes > self._capacity else 0
            offset = self._written + pad
            # Free if the frame's bytes, one lap back, end before the oldest unconsumed byte.
            if (
                self._consumed >= self._written
                or offset + nbytes <= self._consumed + self._capacity
            ):
                self._written = _align(offset + nbytes)
                return offset
            if self._deferred:  # headers not sent yet cannot be consumed: send them first
                self._pump(block=True, deadline=deadline)
                continue
            self._on_message(self._wait_for((KVCredit,), deadline, "staging space"))

    def _close_transport(self) -> None:
        self._staging = None
