"""KV pages over zmq (TCP or ipc://): a msgpack header frame plus one raw frame of page bytes.

Sender: gathered pages (already our own contiguous copy) go out zero copy through
`copy=False`; pyzmq holds the buffer until the io thread is done with it, and `flush` waits on
the trackers. CUDA pages are first copied to pinned host memory asynchronously; the frame is
sent once that copy's event completes (checked on every later call, awaited by done/flush).
Receiver: the frame's bytes are checked against dtype x shape, viewed in place (bfloat16 via a
uint8 view, as numpy has no bfloat16) and scattered into the reserved blocks.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, ClassVar

import torch
import zmq

from kv_transfer.base import TransferTimeout
from kv_transfer.channel import ChannelReceiver, ChannelSender, Peer
from kv_transfer.layout import KVLayout
from kv_transfer.wire import KVPage, as_bytes, frame_nbytes, from_bytes


class ZmqSender(ChannelSender):
    """Prefill side of the zmq connector. Options: `send_timeout` (s) bounds a full queue."""

    CONNECTOR: ClassVar[str] = "zmq"

    def __init__(self, layout: KVLayout, send_timeout: float = 30.0) -> None:
        super().__init__(layout, send_timeout)
        self._trackers: deque[zmq.MessageTracker] = deque()

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
        if tracker is not None and not tracker.done:
            self._trackers.append(tracker)
        while self._trackers and self._trackers[0].done:
            self._trackers.popleft()

    def _flush(self, deadline: float) -> None:
        while self._trackers:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferTimeout(f"flush to {self._endpoint}: frames still queued")
            try:
                self._trackers[0].wait(min(remaining, 0.05))
            except zmq.NotDone:
                continue
            self._trackers.popleft()


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
    ) -> None:
        # No frame can legitimately carry more than one whole layer cache.
        layer_bytes = kv_caches[0].numel() * kv_caches[0].element_size() if kv_caches else 0
        bind = f"ipc://{ipc_path}" if ipc_path is not None else None
        super().__init__(layout, kv_caches, host, port, max_frame_bytes=layer_bytes, bind=bind)

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
