"""KV pages over zmq (TCP or ipc://): a msgpack header frame plus one raw frame of page bytes.

Sender: gathered pages (already our own contiguous copy) go out zero copy through
`copy=False`; pyzmq holds the buffer until the io thread is done with it, and `flush` waits on
the trackers. CPU pages are gathered into a few reused buffers, each lent until its tracker is
done (a fresh one when all are out: a slow receiver never blocks the gather). CUDA pages are
first copied to pinned host memory asynchronously; the frame is sent once that copy's event
completes (checked on every later call, awaited by done/flush).
Receiver: the frame's bytes are checked against dtype x shape, viewed in place (bfloat16 via a
uint8 view, as numpy has no bfloat16) and scattered into the reserved blocks.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, ClassVar

import torch
import zmq

from pdserve.common.wire.payloads import KVLayout
from pdserve.common.wire.security import CurveKeys
from pdserve.kv_transfer.base import TransferTimeout
from pdserve.kv_transfer.channel import ChannelSender
from pdserve.kv_transfer.channel_receiver import ChannelReceiver, Peer
from pdserve.kv_transfer.wire import (
    FramePool,
    KVPage,
    as_bytes,
    blocks_per_frame,
    check_welcome,
    frame_nbytes,
    from_bytes,
    welcome_extra,
)

# Reused gather buffers per sender (frames of up to FRAME_BYTES each).
_POOL_FRAMES = 4


class ZmqSender(ChannelSender):
    """Prefill side of the zmq connector. Options: `send_timeout` (s) bounds a full queue."""

    CONNECTOR: ClassVar[str] = "zmq"

    def __init__(
        self, layout: KVLayout, send_timeout: float = 30.0, curve: CurveKeys | None = None
    ) -> None:
        super().__init__(layout, send_timeout, curve)
        # (tracker, host pages) of frames zmq may still read from, oldest first
        self._trackers: deque[tuple[zmq.MessageTracker, torch.Tensor]] = deque()
        frame_bytes = blocks_per_frame(layout.page_bytes) * layout.page_bytes
        self._pool = FramePool(_POOL_FRAMES, frame_bytes)

    def _on_welcome(self, extra: dict[str, Any], timeout: float) -> None:
        check_welcome(extra, self._endpoint)

    def _frame_buffer(
        self, shape: tuple[int, ...], layer_cache: torch.Tensor
    ) -> torch.Tensor | None:
        if layer_cache.is_cuda:
            return None
        self._retire()
        return self._pool.take(shape, layer_cache.dtype)

    def _ship(self, page: KVPage, pages: torch.Tensor) -> None:
        if not pages.is_cuda:
            self._send_frame(page, pages)
            return
        host = torch.empty(pages.shape, dtype=pages.dtype, pin_memory=True)
        host.copy_(pages, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._defer(copied, lambda: self._send_frame(page, host))

    def _send_frame(self, page: KVPage, host_pages: torch.Tensor) -> None:
        wire = as_bytes(host_pages)
        self._seal(page, wire)
        # numpy() shares memory and keeps the tensor alive as long as zmq holds the frame
        tracker = self._send(page, wire.numpy())
        if tracker is not None:
            self._trackers.append((tracker, host_pages))
        self._retire()

    def _retire(self) -> None:
        """Forget frames zmq is done with, returning pooled buffers."""
        while self._trackers and self._trackers[0][0].done:
            self._pool.give_back(self._trackers.popleft()[1])

    def _flush(self, deadline: float) -> None:
        while self._trackers:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferTimeout(f"flush to {self._endpoint}: frames still queued")
            try:
                self._trackers[0][0].wait(min(remaining, 0.05))
            except zmq.NotDone:
                continue
            self._retire()


class ZmqReceiver(ChannelReceiver):
    """Decode side of the zmq connector. Option `ipc_path` binds ipc:// instead of TCP."""

    CONNECTOR: ClassVar[str] = "zmq"

    def __init__(
        self,
        layout: KVLayout,
        kv_caches: list[torch.Tensor],
        host: str = "127.0.0.1",
        port: int = 0,
        ipc_path: str | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        # No frame can legitimately carry more than one whole layer cache.
        layer_bytes = kv_caches[0].numel() * kv_caches[0].element_size() if kv_caches else 0
        bind = f"ipc://{ipc_path}" if ipc_path is not None else None
        super().__init__(
            layout, kv_caches, host, port, max_frame_bytes=layer_bytes, bind=bind, curve=curve
        )

    def _accept_peer(self, peer: Peer) -> dict[str, Any]:
        return welcome_extra()

    def _on_page_data(self, peer: Peer, page: KVPage, frames: list[Any], admitted: bool) -> None:
        if not admitted:
            return
        expected = frame_nbytes(page, self.layout)
        if len(frames) != 1 or len(frames[0].buffer) != expected:
            got = [len(f.buffer) for f in frames]
            self._book.fail(page, f"page frame of {got} bytes, expected one of {expected}")
            return
        raw = torch.frombuffer(frames[0].buffer, dtype=torch.uint8)
        self._land(page, from_bytes(raw, page.dtype, page.shape))
