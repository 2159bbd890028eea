"""The decode side of the nixl connector: announces reservations, fences cancelled ones, and
admits a transfer when its pages' checksum matches the sender's (see `nixl_connector`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
import torch
import zmq

from pdserve.common.wire.messages import Message, ProtocolError
from pdserve.common.wire.payloads import KVLayout
from pdserve.kv_transfer import nixl_wire as nx
from pdserve.kv_transfer.base import TransferResult
from pdserve.kv_transfer.channel_receiver import ChannelReceiver, Peer
from pdserve.kv_transfer.nixl_agent import Agent, describe_caches
from pdserve.kv_transfer.wire import KV_PLANE, KVDone, KVHello, KVRefused, welcome_extra

log = logging.getLogger(__name__)

_NOTIF_GRACE_S = 1.0  # how long a finished transfer waits for its last WRITEs' notifications
_ENDED_KEPT = 4096  # finished or cancelled transfers remembered (late notifications name them)


# -- receiver -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Reservation:
    """A live transfer: the blocks reserved for it, in order, and the heads of each it fills."""

    blocks: tuple[int, ...]
    heads: range

    def announce(self, xfer_id: str) -> nx.KVExpect:
        return nx.KVExpect(xfer_id, self.blocks, self.heads.start, len(self.heads))


@dataclass
class _Fence:
    """A cancelled transfer's blocks: writes may still land until every sender settled."""

    waiting: set[bytes]  # peers that have not answered
    deadline: float


class NixlReceiver(ChannelReceiver):
    """Decode side: registers the cache with this process's agent, announces reservations,
    fences cancelled ones, and checks each finished transfer's pages before admitting it.
    Option `fence_timeout` (s): how long a cancelled transfer's blocks wait for senders that
    do not answer."""

    CONNECTOR: ClassVar[str] = "nixl"
    fences: ClassVar[bool] = True

    def __init__(
        self, layout: KVLayout, caches: list[torch.Tensor], fence_timeout: float = 30.0, **opts: Any
    ) -> None:
        super().__init__(layout, caches, **opts)  # host, port, curve
        self._agent = Agent.get()
        self._agent.register(caches)
        self._fence_timeout = fence_timeout
        self._reserved: dict[str, _Reservation] = {}  # live transfers
        self._fences: dict[str, _Fence] = {}
        self._fenced_blocks: dict[str, frozenset[int]] = {}
        self._waiting_done: dict[str, tuple[KVDone, float]] = {}  # done, with its deadline
        self._released: list[str] = []
        # Per live transfer: page sums of each WRITE whose data is in (its notification came),
        # in arrival order, read while later layers still travel.
        self._landed: dict[str, list[tuple[int, list[int], torch.Tensor]]] = {}
        self._ended: dict[str, None] = {}  # insertion-ordered, bounded
        self._inbox = self._agent.notifications.subscribe()

    # -- public API

    def expect(self, xfer_id: str, block_ids: list[int], heads: range | None = None) -> None:
        super().expect(xfer_id, block_ids, heads)
        whole = range(self.kv_caches[0].shape[3])
        reservation = _Reservation(tuple(block_ids), whole if heads is None else heads)
        self._reserved[xfer_id] = reservation
        self._inbox.busy = True
        self._broadcast(reservation.announce(xfer_id))

    def cancel(self, xfer_id: str) -> None:
        """Fence a live transfer's blocks until every sender settled; one not live (finished,
        or never expected) is released at once: nothing of it can be in flight."""
        reservation = self._end(xfer_id)
        self._book.cancel(xfer_id)
        self._waiting_done.pop(xfer_id, None)
        self._landed.pop(xfer_id, None)
        peers = set(self._peers)
        if reservation is None or not peers:
            self._released.append(xfer_id)
            return
        self._fences[xfer_id] = _Fence(peers, time.monotonic() + self._fence_timeout)
        self._fenced_blocks[xfer_id] = frozenset(reservation.blocks)
        self._broadcast(nx.KVCancel(xfer_id))

    def released(self) -> list[str]:
        """Cancelled transfers whose blocks no write can reach any more, since the last call:
        the decode node may free them now."""
        out, self._released = self._released, []
        return out

    # -- handshake

    def _accept_peer(self, peer: Peer) -> dict[str, Any]:
        return welcome_extra(**describe_caches(self.kv_caches), pages=nx.NIXL_CHECKSUM)

    def _after_welcome(self, peer: Peer) -> None:
        for xfer_id, reservation in self._reserved.items():  # made before it came
            self._reply(peer.identity, reservation.announce(xfer_id))

    # -- messages

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        msg = None
        if len(frames) == 2 and identity in self._peers:
            try:
                msg = KV_PLANE.decode(frames[1].bytes)
            except ProtocolError:
                msg = None
        elif len(frames) == 2:
            try:
                if isinstance(KV_PLANE.decode(frames[1].bytes), KVHello):
                    super()._handle(frames)
                    return
            except ProtocolError:
                pass
        if isinstance(msg, nx.KVSettled):
            self._settled(msg.xfer_id, identity)
        elif isinstance(msg, KVDone):
            self._settled(msg.xfer_id, identity, done=True)
            self._on_done(msg)
        else:
            if len(frames) == 2 and identity not in self._peers:
                # A sender dropped after a fence timeout (or never welcomed): tell it to
                # handshake again rather than let it wait for announcements.
                self._reply(identity, KVRefused("handshake", "not connected: handshake again"))
            super()._handle(frames)

    def _settled(self, xfer_id: str, identity: bytes, done: bool = False) -> None:
        fence = self._fences.get(xfer_id)
        if fence is None:
            return
        fence.waiting.discard(identity)
        if done or not fence.waiting:  # the writer finished, or every sender answered
            self._lift(xfer_id)

    def _lift(self, xfer_id: str) -> None:
        del self._fences[xfer_id]
        del self._fenced_blocks[xfer_id]
        self._released.append(xfer_id)

    def _on_done(self, done: KVDone) -> None:
        if done.xfer_id not in self._reserved:
            self._book.on_done(done)  # not live: counted as late or unknown, nothing else
            return
        # Notifications of the last WRITEs may still be on their way (the bytes are in: the
        # sender saw every WRITE done); wait for them briefly, else sum the pages here.
        self._waiting_done[done.xfer_id] = (done, time.monotonic() + _NOTIF_GRACE_S)
        self._progress()

    def _progress(self) -> None:
        now = time.monotonic()
        for xfer_id, fence in list(self._fences.items()):
            if now >= fence.deadline:  # senders silent that long must handshake again
                for identity in fence.waiting:
                    peer = self._peers.pop(identity, None)
                    if peer is not None:
                        self._drop_peer(peer)
                self._book.counters["fence_timeout"] += 1
                log.warning("nixl: senders did not settle transfer %s in time", xfer_id)
                self._lift(xfer_id)
        self._take_notifications()
        fenced = frozenset().union(*self._fenced_blocks.values()) if self._fences else frozenset()
        for xfer_id, (done, deadline) in list(self._waiting_done.items()):
            if fenced and fenced & set(self._reserved[xfer_id].blocks):
                continue  # an older transfer into these blocks may still write: wait
            landed = self._landed.get(xfer_id, [])
            writes = done.writes
            if len(landed) < writes and now < deadline:
                continue
            del self._waiting_done[xfer_id]
            reservation = self._end(xfer_id)
            assert reservation is not None, f"{xfer_id} waits for its pages but is not live"
            self._landed.pop(xfer_id, None)
            if len(landed) != writes:
                landed = []  # not every WRITE was seen landing: sum every page here
            self._book.cancel(xfer_id)  # finished: later messages for it are refused
            self._completed.append(self._check(done, reservation, landed))
        self._inbox.busy = self._busy()

    def _end(self, xfer_id: str) -> _Reservation | None:
        """Take a transfer off the live ones (finished or cancelled), remembered so that its
        late notifications count as late, not as another receiver's of this process."""
        reservation = self._reserved.pop(xfer_id, None)
        if reservation is not None:
            self._ended[xfer_id] = None
            while len(self._ended) > _ENDED_KEPT:
                del self._ended[next(iter(self._ended))]
        return reservation

    def _take_notifications(self) -> None:
        """Sum the pages of every WRITE whose data arrived (NIXL notifies after the data)."""
        for raw in self._inbox.take():
            try:
                xfer_id, layer, dsts = msgpack.unpackb(raw)
            except (ValueError, TypeError, msgpack.ExtraData):
                self._book.counters["bad_notification"] += 1
                continue
            if not isinstance(xfer_id, str):
                self._book.counters["bad_notification"] += 1
                continue
            reservation = self._reserved.get(xfer_id)
            if reservation is None:
                if xfer_id in self._ended:  # else another receiver's of this process
                    self._book.counters["late_notification"] += 1
                continue
            valid = (
                isinstance(layer, int)
                and 0 <= layer < self.layout.num_layers
                and isinstance(dsts, list)
                and set(dsts) <= set(reservation.blocks)
            )
            if not valid:
                self._book.counters["bad_notification"] += 1
                continue
            sums = nx.page_sums(self.kv_caches[layer], dsts, reservation.heads)
            self._landed.setdefault(xfer_id, []).append((layer, dsts, sums))
            self._book.pages_received += len(dsts)

    def _busy(self) -> bool:
        return bool(self._fences or self._waiting_done or self._reserved)

    def _check(
        self,
        done: KVDone,
        reservation: _Reservation,
        landed: Sequence[tuple[int, Sequence[int], torch.Tensor]],
    ) -> TransferResult:
        """The transfer's result: ok only if the sender wrote each of its pages into the
        reservation and the pages here sum as the sender's did."""
        error, blocks = done.sender_error, done.written_blocks
        if not error and done.checksum_scheme != nx.NIXL_CHECKSUM:
            error = f"pages checked with {done.checksum_scheme!r}, not {nx.NIXL_CHECKSUM!r}"
        if not error and not set(blocks) <= set(reservation.blocks):
            error = "the sender wrote blocks outside the reservation"
        if not error:
            for layer, n in enumerate(done.pages_per_layer):
                if n != len(blocks):
                    error = f"layer {layer}: {n} pages written of {len(blocks)}"
                    break
        if not error and self._digest(blocks, reservation.heads, landed) != done.checksum:
            error = "checksum of the written pages does not match the sender's"
        return TransferResult(done.xfer_id, done.first, not error, error)

    def _digest(
        self,
        blocks: Sequence[int],
        heads: range,
        landed: Sequence[tuple[int, Sequence[int], torch.Tensor]],
    ) -> int:
        """The checksum of `blocks` of every layer (their `heads`): pages summed on arrival,
        the others summed now."""
        sums = nx.collect_sums(landed)
        for layer in range(self.layout.num_layers):
            pages = sums.setdefault(layer, {})
            missing = [b for b in blocks if b not in pages]
            if missing:
                late = nx.page_sums(self.kv_caches[layer], missing, heads)
                pages.update(nx.collect_sums([(layer, missing, late)])[layer])
            for extra in set(pages) - set(blocks):
                del pages[extra]
        return nx.pages_digest(sums)

    def _broadcast(self, msg: Message) -> None:
        for identity in self._peers:
            self._reply(identity, msg)

    def _on_page_data(self, peer: Peer, page: Any, frames: list[Any], admitted: bool) -> None:
        # Pages never come through the side channel here.
        self._book.counters["unexpected_message"] += 1

    def close(self) -> None:
        self._agent.notifications.unsubscribe(self._inbox)
        self._released.extend(self._fences)
        self._fences.clear()
        self._fenced_blocks.clear()
        super().close()
        if self.kv_caches:
            self._agent.deregister(self.kv_caches)
            self.kv_caches = []
