"""The zmq side channel every connector shares: handshake, page headers, done messages; the
sender's half (the receiver's is `channel_receiver`).

The receiver binds a ROUTER, each sender connects a DEALER. Page bytes travel however the
connector moves them (a second zmq frame, a gloo/NCCL recv, a shared staging buffer); the
connector subclasses only implement that part, through the hooks at the bottom of each class.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import zmq

from pdserve.common.process import host_id
from pdserve.common.wire.messages import MAX_MESSAGE_BYTES, Message, ProtocolError, encode
from pdserve.common.wire.payloads import FirstToken, KVLayout
from pdserve.common.wire.security import CurveKeys
from pdserve.kv_transfer.base import (
    KVSender,
    LayoutMismatchError,
    TransferError,
    TransferTimeout,
)
from pdserve.kv_transfer.wire import (
    CHECKSUM_SCHEME,
    KV_PLANE,
    KVDone,
    KVHello,
    KVPage,
    KVRefused,
    KVWelcome,
    SendFaults,
    blocks_per_frame,
    check_cache,
    combine,
    corrupt_first_byte,
    frame_digest,
    gather_heads,
    heads_in,
    page_checksum,
    page_shape,
    resolve,
    to_ms,
    wait_event,
)


@dataclass
class _Outbound:
    pages_per_layer: list[int]
    # checksums may be device tensors resolved only at send_done, to keep send_layer async
    frames: list[tuple[int, tuple[int, ...], int | torch.Tensor]] = field(default_factory=list)


class SendBook:
    """What a sender has sent, per open transfer (pure Python): `close` makes the done message
    carrying its totals, and the receiver's `ReceiveBook` passes a transfer only if its own
    totals equal them."""

    def __init__(self, num_layers: int) -> None:
        self._num_layers = num_layers
        self._open: dict[str, _Outbound] = {}

    def record(self, page: KVPage, checksum: int | torch.Tensor) -> None:
        out = self._open.setdefault(page.xfer_id, _Outbound([0] * self._num_layers))
        out.pages_per_layer[page.layer] += len(page.dst_block_ids)
        out.frames.append((page.layer, page.dst_block_ids, checksum))

    def close(self, xfer_id: str, first: FirstToken) -> KVDone:
        """The done message for `xfer_id`; a transfer with no frames is legal (all cached)."""
        out = self._open.pop(xfer_id, None) or _Outbound([0] * self._num_layers)
        digest = combine(frame_digest(lay, ids, resolve(ck)) for lay, ids, ck in out.frames)
        return KVDone(xfer_id, first, digest, tuple(out.pages_per_layer), CHECKSUM_SCHEME)


class ChannelSender(KVSender):
    """Sender half: handshake, argument checks, gathering, checksums and ordered hand-off.

    CUDA copies finish asynchronously; work that must wait for one (sending a header after a
    device-to-host copy) goes into a FIFO of (event, action) run in order as events complete, so
    headers never overtake each other and `send_layer` never stalls on the device. With
    `curve` (the cluster's keys) the side channel authenticates and encrypts.
    """

    CONNECTOR: ClassVar[str] = ""

    def __init__(
        self, layout: KVLayout, send_timeout: float = 30.0, curve: CurveKeys | None = None
    ) -> None:
        super().__init__(layout)
        self.sender_id = uuid.uuid4().hex
        self._curve = curve  # the cluster's keys: the side channel is a cluster link too
        self._send_timeout = send_timeout
        self._sock: zmq.Socket | None = None
        self._endpoint = ""
        self._seq = 0
        self._book = SendBook(layout.num_layers)
        self._deferred: deque[tuple[Any, Callable[[], None]]] = deque()
        self.faults: SendFaults | None = None  # tests only: see wire.SendFaults

    # -- public API

    def connect(self, endpoint: str, timeout: float = 10.0) -> None:
        assert self._sock is None, "connect() may be called once per sender"
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, self.sender_id.encode())
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.SNDTIMEO, to_ms(self._send_timeout))
        if self._curve is not None:
            self._curve.connect(sock)
        sock.connect(endpoint)
        self._sock, self._endpoint = sock, endpoint
        try:
            layout = self.layout
            hello = KVHello(self.sender_id, self.CONNECTOR, layout.digest(), layout, host_id())
            self._send(hello)
            reply = self._wait_for((KVWelcome, KVRefused), time.monotonic() + timeout, "handshake")
            if isinstance(reply, KVRefused):
                error = LayoutMismatchError if reply.code == "layout" else TransferError
                raise error(f"{endpoint} refused the connection: {reply.reason}")
            if reply.digest != layout.digest():
                raise TransferError(f"{endpoint} welcomed another layout digest")
            self._on_welcome(reply.extra, timeout)
        except BaseException:
            self.close()
            raise

    def send_layer(
        self,
        xfer_id: str,
        layer: int,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        layer_cache: torch.Tensor,
        heads: range | None = None,
    ) -> None:
        self._check_send_args(layer, src_block_ids, dst_block_ids, layer_cache)
        heads = heads_in(layer_cache, heads)
        self._pump(block=False)
        step = self._max_blocks_per_frame()
        for start in range(0, len(src_block_ids), step):
            src = torch.tensor(src_block_ids[start : start + step], device=layer_cache.device)
            dst = tuple(int(b) for b in dst_block_ids[start : start + step])
            out = self._frame_buffer(page_shape(self.layout, len(dst), len(heads)), layer_cache)
            pages = gather_heads(layer_cache, src, heads, out)
            page = KVPage(xfer_id, layer, dst, self.layout.dtype, tuple(pages.shape), self._seq)
            self._seq += 1
            if self.faults is not None and self.faults.drop(xfer_id):
                self._book.record(page, 0)  # booked, never sent: the receiver's count fails
                continue
            self._ship(page, pages)

    def send_done(self, xfer_id: str, first: FirstToken) -> None:
        self._require_connected()
        # Every frame of the transfer must be on the wire (and booked) before its done.
        self._pump(block=True, deadline=time.monotonic() + self._send_timeout)
        self._send(self._book.close(xfer_id, first))

    def flush(self, timeout: float = 10.0) -> None:
        self._require_connected()
        deadline = time.monotonic() + timeout
        self._pump(block=True, deadline=deadline)
        self._flush(deadline)

    def close(self) -> None:
        self._deferred.clear()
        self._close_transport()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    # -- helpers for subclasses

    def _seal(self, page: KVPage, wire: torch.Tensor) -> None:
        """Book the checksum of the bytes exactly as they will cross the transport; then, only
        under a test's faults, damage them."""
        self._book.record(page, page_checksum(wire))
        self.bytes_sent += wire.numel() * wire.element_size()
        if self.faults is not None and self.faults.corrupt(page.xfer_id):
            corrupt_first_byte(wire)

    def _send(self, msg: Message, *frames: Any) -> zmq.MessageTracker | None:
        """Send a header (plus raw frames, zero copy); TransferTimeout if the queue stays full."""
        assert self._sock is not None
        try:
            if not frames:
                self._sock.send(encode(msg))
                return None
            return self._sock.send_multipart([encode(msg), *frames], copy=False, track=True)
        except zmq.Again:
            raise TransferTimeout(f"send queue to {self._endpoint} full") from None

    def _defer(self, event: Any, action: Callable[[], None]) -> None:
        """Run `action` once the CUDA `event` completed (at once if None and nothing queued)."""
        if event is None and not self._deferred:
            action()
        else:
            self._deferred.append((event, action))

    def _pump(self, block: bool, deadline: float = 0.0) -> None:
        while self._deferred:
            event, action = self._deferred[0]
            if event is not None and not event.query():
                if not block:
                    return
                wait_event(event, deadline, f"send to {self._endpoint}")
            self._deferred.popleft()
            action()

    def _wait_for(self, kinds: tuple[type, ...], deadline: float, what: str) -> Message:
        """Next message of one of `kinds` from the receiver; others go to `_on_message`."""
        assert self._sock is not None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(to_ms(remaining)):
                raise TransferTimeout(f"{what}: no answer from {self._endpoint} in time")
            try:
                msg = KV_PLANE.decode(self._sock.recv())
            except ProtocolError:
                continue  # a broken reply is as good as none; the deadline still holds
            if isinstance(msg, kinds):
                return msg
            self._on_message(msg)

    def _require_connected(self) -> None:
        assert self._sock is not None, "connect() first"

    def _check_send_args(
        self, layer: int, src: list[int], dst: list[int], layer_cache: torch.Tensor
    ) -> None:
        self._require_connected()
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.layout.num_layers})")
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
        if len(set(dst)) != len(dst):
            raise ValueError("destination block ids repeat")
        check_cache(self.layout, layer_cache, f"layer {layer} cache")

    # -- hooks

    def _on_welcome(self, extra: dict[str, Any], timeout: float) -> None:
        """Set up the data path from the receiver's welcome."""

    def _on_message(self, msg: Message) -> None:
        """A receiver message nobody waited for (credits)."""

    def _max_blocks_per_frame(self) -> int:
        return blocks_per_frame(self.layout.page_bytes)

    def _frame_buffer(
        self, shape: tuple[int, ...], layer_cache: torch.Tensor
    ) -> torch.Tensor | None:
        """A tensor of `shape` the connector owns (a staging slot) to gather the next frame
        into, or None for a fresh one."""
        return None

    def _ship(self, page: KVPage, pages: torch.Tensor) -> None:
        """Move one frame of gathered pages (our own copy) and its header; call `_seal` on the
        bytes that cross."""
        raise NotImplementedError

    def _flush(self, deadline: float) -> None:
        """Wait for the transport to have taken everything."""

    def _close_transport(self) -> None:
        """Release what `_on_welcome` set up."""
