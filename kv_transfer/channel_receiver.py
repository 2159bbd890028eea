"""The receiver's half of the zmq side channel every connector shares (`channel` has the
sender's): it binds the ROUTER, handshakes each sender, validates page headers, books pages and
writes them. A connector subclass only obtains each frame's bytes (the hooks at the bottom).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import zmq

from pdserve.common.wire.messages import MAX_MESSAGE_BYTES, Message, ProtocolError, encode
from pdserve.common.wire.payloads import KVLayout
from pdserve.common.wire.security import CurveKeys, admit_cluster_keys
from pdserve.kernels import ops
from pdserve.kv_transfer.base import KVReceiver, TransferResult
from pdserve.kv_transfer.wire import (
    CHECKSUM_SCHEME,
    KV_PLANE,
    KVDone,
    KVHello,
    KVPage,
    KVRefused,
    KVWelcome,
    check_cache,
    combine,
    frame_digest,
    heads_in,
    page_checksum,
    page_shape,
    resolve,
    to_ms,
)

# How long poll sleeps between progress checks while data is in flight outside the socket.
_PROGRESS_INTERVAL_S = 0.001


@dataclass
class Peer:
    """A sender that passed the handshake; `state` is the connector's per-pair data."""

    identity: bytes
    sender_id: str
    state: Any = None


class ChannelReceiver(KVReceiver):
    """Receiver half: binds the ROUTER, handshakes, validates headers, books and writes pages.

    Subclasses get `_on_page_data(peer, page, frames, admitted)` for every page header that
    passed validation and call `_land(page, pages)` when the bytes are available; `_land`
    checksums and writes only if the transfer is still live. With `curve` (the cluster's keys)
    only senders holding them get through a TCP bind.
    """

    CONNECTOR: ClassVar[str] = ""

    def __init__(
        self,
        layout: KVLayout,
        kv_caches: list[torch.Tensor],
        host: str = "127.0.0.1",
        port: int = 0,
        max_frame_bytes: int = MAX_MESSAGE_BYTES,
        bind: str | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        super().__init__(layout, kv_caches)
        if len(kv_caches) != layout.num_layers:
            raise ValueError(f"{len(kv_caches)} layer caches for {layout.num_layers} layers")
        for i, cache in enumerate(kv_caches):
            check_cache(layout, cache, f"receiver layer {i} cache")
        self.host = host
        self.advertise_host = host  # how peers reach this host (`advertise`)
        self.num_blocks = kv_caches[0].shape[1]
        self._book = ReceiveBook(layout.num_layers)
        self._peers: dict[bytes, Peer] = {}
        self._completed: list[TransferResult] = []
        self._bytes_received = 0
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # zmq drops (and disconnects) a peer whose message exceeds this, before we see it.
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + MAX_MESSAGE_BYTES)
        if curve is not None and not (bind or "").startswith("ipc://"):
            admit_cluster_keys(zmq.Context.instance(), curve)
            curve.serve(self._sock)
        self._sock.bind(bind or f"tcp://{host}:{port or '*'}")
        self._endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    # -- public API

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def advertise(self, host: str) -> None:
        """Peers reach this receiver at `host` (it may be bound to a wildcard address)."""
        if self._endpoint.startswith("tcp://"):
            port = self._endpoint.rpartition(":")[2]
            self._endpoint = f"tcp://{f'[{host}]' if ':' in host else host}:{port}"
        self.advertise_host = host

    @property
    def counters(self) -> Mapping[str, int]:
        return dict(self._book.counters)

    @property
    def pages_received(self) -> int:
        return self._book.pages_received

    @property
    def bytes_received(self) -> int:
        """Page bytes written into the cache so far, as they came off the transport."""
        return self._bytes_received

    def expect(self, xfer_id: str, block_ids: list[int], heads: range | None = None) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad or len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block ids must be unique and in [0, {self.num_blocks}): {bad}")
        self._book.expect(xfer_id, block_ids, heads_in(self.kv_caches[0], heads))

    def cancel(self, xfer_id: str) -> None:
        self._book.cancel(xfer_id)

    def poll(self, timeout: float = 0.0) -> list[TransferResult]:
        deadline = time.monotonic() + timeout
        while True:
            for frames in self._ready_messages():
                self._handle(frames)
            self._progress()
            self._completed.extend(self._book.finished())
            remaining = deadline - time.monotonic()
            if self._completed or remaining <= 0:
                break
            wait = min(remaining, _PROGRESS_INTERVAL_S) if self._busy() else remaining
            self._sock.poll(to_ms(wait) or 1)
        results, self._completed = self._completed, []
        return results

    def close(self) -> None:
        for peer in self._peers.values():
            self._drop_peer(peer)
        self._peers.clear()
        if not self._sock.closed:
            self._sock.close(linger=0)

    # -- message handling

    def _ready_messages(self) -> Iterator[list[zmq.Frame]]:
        # Bounded per call so a flood from one peer cannot starve the decode loop forever.
        for _ in range(4096):
            try:
                yield self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        try:
            msg = KV_PLANE.decode(frames[1].bytes) if len(frames) >= 2 else None
        except ProtocolError:
            msg = None
        if msg is None:
            self._book.counters["malformed"] += 1
        elif isinstance(msg, KVHello):
            self._on_hello(identity, msg)
        elif identity not in self._peers:
            self._book.counters["no_handshake"] += 1
        elif isinstance(msg, KVPage):
            self._on_page(self._peers[identity], msg, frames[2:])
        elif isinstance(msg, KVDone) and len(frames) == 2:
            self._book.on_done(msg)
        else:
            self._book.counters["unexpected_message"] += 1

    def _on_hello(self, identity: bytes, hello: KVHello) -> None:
        if identity in self._peers:  # a reconnecting sender starts over
            self._drop_peer(self._peers.pop(identity))
        refusal = self._check_hello(hello)
        if refusal is not None:
            self._book.counters[f"refused_{refusal.code}"] += 1
            self._reply(identity, refusal)
            return
        peer = Peer(identity, hello.sender_id)
        extra = self._accept_peer(peer)
        self._peers[identity] = peer
        self._reply(identity, KVWelcome(self.layout.digest(), extra))
        try:
            self._after_welcome(peer)
        except Exception:  # the sender sees its own failure (timeout); we only forget it
            self._book.counters["pair_setup_failed"] += 1
            self._drop_peer(self._peers.pop(identity))

    def _check_hello(self, hello: KVHello) -> KVRefused | None:
        if hello.connector != self.CONNECTOR:
            return KVRefused(
                "connector", f"receiver is {self.CONNECTOR!r}, not {hello.connector!r}"
            )
        theirs = hello.layout  # typed and validated by the decoder
        if theirs.digest() != hello.digest:
            return KVRefused("malformed", "layout digest does not match the layout sent")
        if hello.digest != self.layout.digest():
            return KVRefused(
                "layout", theirs.describe_mismatch(self.layout, ("sender", "receiver"))
            )
        return self._refuse_peer(hello)

    def _refuse_peer(self, hello: KVHello) -> KVRefused | None:
        """A connector's own reason to refuse a sender (None: take it)."""
        return None

    def _on_page(self, peer: Peer, page: KVPage, frames: list[zmq.Frame]) -> None:
        problem = self._check_page(page)
        if problem is not None:
            # The bytes of a frame we cannot size may still be on their way (NCCL), so the
            # pair is no longer trustworthy: forget the sender; it must reconnect.
            self._book.counters["bad_header"] += 1
            self._drop_peer(self._peers.pop(peer.identity))
            return
        self._on_page_data(peer, page, frames, self._book.admit(page))

    def _check_page(self, page: KVPage) -> str | None:
        n = len(page.dst_block_ids)
        if not 0 <= page.layer < self.layout.num_layers:
            return "layer out of range"
        if page.dtype != self.layout.dtype or tuple(page.shape) != page_shape(
            self.layout, n, self._frame_heads(page)
        ):
            return "dtype or shape differs from the layout"
        if n == 0 or len(set(page.dst_block_ids)) != n:
            return "empty or repeated block ids"
        if not all(0 <= b < self.num_blocks for b in page.dst_block_ids):
            return "block id out of range"
        return None

    def _frame_heads(self, page: KVPage) -> int:
        """How many KV heads a well-formed frame of this page carries: the heads its transfer
        expects; for a transfer no longer live (a frame racing its cancel), the count its own
        header gives, within the cache's (its bytes are sized by it, then refused as late)."""
        total = self.kv_caches[0].shape[3]
        heads = self._book.heads(page.xfer_id)
        if heads is not None:
            return len(heads)
        if self._book.is_live(page.xfer_id) or len(page.shape) != 5:
            return total
        return page.shape[3] if 1 <= page.shape[3] <= total else total

    def _land(self, page: KVPage, pages: torch.Tensor) -> None:
        """Checksum and write an admitted frame if its transfer is still live."""
        if not self._book.land(page, resolve(page_checksum(pages))):
            return
        self._bytes_received += pages.numel() * pages.element_size()
        cache = self.kv_caches[page.layer]
        ids = torch.tensor(page.dst_block_ids, device=cache.device)
        heads = self._book.heads(page.xfer_id)
        if heads is None or len(heads) == cache.shape[3]:
            ops.scatter_pages(cache, ids, pages.to(cache.device))
        else:  # a tensor-parallel slice: these heads of the blocks, the others untouched
            cache[:, ids, :, heads.start : heads.stop] = pages.to(cache.device)

    def _reply(self, identity: bytes, msg: Message) -> None:
        try:
            self._sock.send_multipart([identity, encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            self._book.counters["reply_dropped"] += 1

    # -- hooks

    def _accept_peer(self, peer: Peer) -> dict[str, Any]:
        """Prepare the data path for a new sender; returns the welcome's `extra`."""
        return {}

    def _after_welcome(self, peer: Peer) -> None:
        """Finish setup that needs the sender to have the welcome (a rendezvous)."""

    def _on_page_data(
        self, peer: Peer, page: KVPage, frames: list[zmq.Frame], admitted: bool
    ) -> None:
        """Obtain the bytes of a validated frame; `_land` them if admitted, drop otherwise."""
        raise NotImplementedError

    def _progress(self) -> None:
        """Advance transfers in flight outside the socket."""

    def _busy(self) -> bool:
        """True while `_progress` has work, so `poll` checks back soon."""
        return False

    def _drop_peer(self, peer: Peer) -> None:
        """Release a sender's per-pair resources."""


# How many finished or cancelled xfer ids to remember, to tell "late" from "never heard of".
_RECENT = 4096


@dataclass
class _Inbound:
    block_ids: frozenset[int]
    pages_per_layer: list[int]
    heads: range | None = None  # the cache's KV heads its pages fill (None: all of them)
    digests: list[int] = field(default_factory=list)
    inflight: int = 0
    problems: list[str] = field(default_factory=list)
    done: KVDone | None = None


class ReceiveBook:
    """Expected transfers on a receiver, the frames written into them, and refusal counters
    (pure Python). A transfer is ok only if its totals equal those the sender's `SendBook`
    put in the done message.

    Frame life: `admit` (header arrived; refused frames are counted and must not be written)
    -> `land` (bytes arrived; True means write them now) or `fail`. A transfer finishes once
    its done message is in and no admitted frame is still in flight.
    """

    def __init__(self, num_layers: int) -> None:
        self._num_layers = num_layers
        self._live: dict[str, _Inbound] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()  # xfer id -> "cancelled" | "finished"
        self.counters: Counter[str] = Counter()
        self.pages_received = 0  # pages (one block of one layer) written, for metrics

    def expect(self, xfer_id: str, block_ids: list[int], heads: range | None = None) -> None:
        if xfer_id in self._live:
            raise ValueError(f"transfer {xfer_id!r} is already expected")
        self._gone.pop(xfer_id, None)
        self._live[xfer_id] = _Inbound(frozenset(block_ids), [0] * self._num_layers, heads)

    def heads(self, xfer_id: str) -> range | None:
        """The KV heads a live transfer fills (None: all, or not live)."""
        inbound = self._live.get(xfer_id)
        return None if inbound is None else inbound.heads

    def cancel(self, xfer_id: str) -> None:
        if self._live.pop(xfer_id, None) is not None:
            self._forget(xfer_id, "cancelled")

    def is_live(self, xfer_id: str) -> bool:
        return xfer_id in self._live

    def admit(self, page: KVPage) -> bool:
        inbound = self._lookup(page.xfer_id, "frame")
        if inbound is None:
            return False
        if inbound.done is not None:
            self.counters["frame_after_done"] += 1
            return False
        outside = [b for b in page.dst_block_ids if b not in inbound.block_ids]
        if outside:
            self.counters["block_outside_reservation"] += 1
            inbound.problems.append(f"layer {page.layer}: refused blocks {outside[:8]}")
            return False
        inbound.inflight += 1
        return True

    def land(self, page: KVPage, checksum: int) -> bool:
        """Book an admitted frame's bytes; False (counted) if the transfer went away meanwhile."""
        inbound = self._live.get(page.xfer_id)
        if inbound is None:
            self.counters["late_frame"] += 1
            return False
        inbound.inflight -= 1
        inbound.pages_per_layer[page.layer] += len(page.dst_block_ids)
        self.pages_received += len(page.dst_block_ids)
        inbound.digests.append(frame_digest(page.layer, page.dst_block_ids, checksum))
        return True

    def fail(self, page: KVPage, reason: str) -> None:
        """An admitted frame whose bytes never arrived or were unusable."""
        self.counters["bad_frame"] += 1
        inbound = self._live.get(page.xfer_id)
        if inbound is not None:
            inbound.inflight -= 1
            inbound.problems.append(f"layer {page.layer}: {reason}")

    def on_done(self, done: KVDone) -> None:
        inbound = self._lookup(done.xfer_id, "done")
        if inbound is None:
            return
        if inbound.done is not None or len(done.pages_per_layer) != self._num_layers:
            self.counters["bad_done"] += 1
            return
        inbound.done = done

    def finished(self) -> list[TransferResult]:
        """Results of transfers whose done is in and whose frames have all landed."""
        ready = [x for x, i in self._live.items() if i.done is not None and i.inflight == 0]
        results = [self._result(x, self._live.pop(x)) for x in ready]
        for xfer_id in ready:
            self._forget(xfer_id, "finished")
        return results

    def _result(self, xfer_id: str, inbound: _Inbound) -> TransferResult:
        done = inbound.done
        assert done is not None
        problems = list(inbound.problems)
        if done.checksum_scheme != CHECKSUM_SCHEME:
            problems.append(
                f"sender checksums pages with {done.checksum_scheme!r}, this receiver with "
                f"{CHECKSUM_SCHEME!r}; run the same pdserve version on both ends"
            )
        for layer, (got, sent) in enumerate(zip(inbound.pages_per_layer, done.pages_per_layer)):
            if got != sent:
                problems.append(f"layer {layer}: received {got} pages, sender sent {sent}")
        if not problems and combine(inbound.digests) != done.checksum:
            problems.append("checksum of received pages does not match the sender's")
        return TransferResult(xfer_id, done.first, not problems, "; ".join(problems))

    def _lookup(self, xfer_id: str, what: str) -> _Inbound | None:
        inbound = self._live.get(xfer_id)
        if inbound is None:
            gone = self._gone.get(xfer_id)
            self.counters[f"{what}_{gone}_xfer" if gone else f"{what}_unknown_xfer"] += 1
        return inbound

    def _forget(self, xfer_id: str, how: str) -> None:
        self._gone[xfer_id] = how
        while len(self._gone) > _RECENT:
            self._gone.popitem(last=False)
