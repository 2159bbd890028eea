"""KV pages written by NIXL straight from the prefill node's cache blocks into the decode
node's reserved blocks: no gather, no staging, no scatter.

Each process has one NIXL agent (`Agent`) that registers its KV cache tensors once. The
handshake runs over the zmq side channel every connector shares: the receiver's welcome
carries its agent metadata and where each layer's cache lives (base address, block count,
memory type), so the sender can describe any of the receiver's pages. Per layer, as soon as
the layer's K/V are written, the sender posts one WRITE pairing its source pages with the
reserved destination pages (one descriptor per plane of a block: its K and its V half, or
MLA's one latent plane; NIXL merges runs of contiguous blocks into one descriptor). A
tensor-parallel slice (some of a block's KV heads, on either end) is not one region of a
block in the [planes, blocks, block_size, heads, head_dim] layout, only of each token's row:
its WRITE has one descriptor per (plane, block, token). A
WRITE is DONE only after its endpoint flush, so the data is in the receiver's memory when the
sender says so.

Ownership rules (the receiver cannot refuse a remote write, so the sender must never issue
one that could land where it should not):

- A sender writes only blocks and heads the receiver itself announced for the transfer
  (`KVExpect`, sent to every connected sender when the decode node reserves, and to a sender
  that connects later): not what the router relayed. Pages outside the announcement, or a
  slice of another number of heads, are never written; the transfer then fails at
  `send_done`.
- When the decode node cancels a transfer (abort, failure, renewal), the receiver fences
  its blocks and sends `KVCancel` to every sender. A sender that gets it stops writing that
  transfer for good, waits for its WRITEs in flight, and answers `KVSettled`; a done message
  settles too. The fence lifts once every sender connected at the cancel has settled, or
  after `fence_timeout` (a sender silent that long is dropped: it must handshake again).
  The decode node keeps the blocks of a fenced transfer out of its free pool until then
  (`released`), and a renewed transfer into the same blocks is not admitted before.
- The sender's own pages: `send_done` returns only after every WRITE of the transfer is
  DONE, and `abandon` (the prefill node dropped the request) waits the same way, so a
  source block is never reused while a WRITE still reads it. A block sent again (a partly
  filled last block that the next chunk completed) waits for its earlier WRITE first, so
  two WRITEs of one page never race.
- Fail closed: the sender sums each layer's pages after posting its WRITE; each WRITE carries
  a NIXL notification, delivered after its data, on which the receiver sums the same pages
  as they land. The done message carries the pages written and the sender's checksum; the
  receiver admits the request only if its checksum of exactly those pages is the same.

Without the `nixl` extra installed, choosing this connector raises an error naming
`pip install 'pdserve[nixl]'`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import torch
from torch import Tensor

from pdserve.common.wire.messages import Message, ProtocolError
from pdserve.common.wire.payloads import FirstToken, KVLayout
from pdserve.common.wire.security import CurveKeys
from pdserve.kv_transfer import nixl_agent as na
from pdserve.kv_transfer import nixl_wire as nx
from pdserve.kv_transfer.base import TransferError
from pdserve.kv_transfer.channel import ChannelSender
from pdserve.kv_transfer.wire import KV_PLANE, KVDone, KVRefused, check_welcome, corrupt_first_byte

log = logging.getLogger(__name__)

Blocks = list[int]  # block ids, in the order their pages pair up
Heads = range | None  # KV heads of a cache (None: all of them)

_ANNOUNCED_KEPT = 16384  # reservations a sender remembers (see NixlSender._on_message)


# -- sender ---------------------------------------------------------------------------------------


@dataclass
class _Outbound:
    """One transfer on the sender: WRITEs in flight, pages written, what went wrong."""

    handles: list[tuple[int, Any]] = field(default_factory=list)  # (layer, xfer handle)
    # (layer, destination blocks, page_sums of their source pages), in the order written
    sums: list[tuple[int, list[int], torch.Tensor]] = field(default_factory=list)
    writes: int = 0  # WRITEs posted (each notifies the receiver when its data is in)
    problems: list[str] = field(default_factory=list)
    unannounced: bool = False  # waited for the receiver's announcement in vain


class NixlSender(ChannelSender):
    """Prefill side: WRITEs from this process's cache into the receiver's reserved blocks.
    Option `send_timeout` (s) bounds every wait: for a WRITE to finish, for the receiver's
    announcement of a transfer."""

    CONNECTOR: ClassVar[str] = "nixl"

    @classmethod
    def check_installed(cls) -> None:
        na.load_nixl()

    def __init__(
        self,
        layout: KVLayout,
        send_timeout: float = 30.0,
        curve: CurveKeys | None = None,
        announce_timeout: float = 5.0,
    ) -> None:
        super().__init__(layout, send_timeout, curve)
        self._announce_timeout = announce_timeout
        self._agent = na.Agent.get()
        self._remote = ""
        self._remote_pages: dict[int, Any] = {}  # layer -> prepped list of the receiver's
        self._remote_blocks = 0
        self._remote_rows: list[na.Rows] = []  # per layer, the receiver's cache as token rows
        self._caches: dict[int, torch.Tensor] = {}  # layer -> our cache, as sent from
        # announced by the receiver: the blocks and heads of its cache a transfer may write
        self._expected: dict[str, tuple[frozenset[int], range]] = {}
        self._cancelled: dict[str, None] = {}  # insertion-ordered, bounded
        self._out: dict[str, _Outbound] = {}
        self._refused = ""  # the receiver dropped us: the next send fails, we reconnect

    # -- handshake

    def _on_welcome(self, extra: dict[str, Any], timeout: float) -> None:
        check_welcome(extra, self._endpoint)
        if extra.get("pages") != nx.NIXL_CHECKSUM:
            raise TransferError(f"{self._endpoint} checks pages with {extra.get('pages')!r}")
        try:
            layers = list(extra["layers"])
            if len(layers) != self.layout.num_layers:
                raise ValueError(f"{len(layers)} layers offered")
            self._remote_blocks = int(extra["num_blocks"])
            heads = self._receiver_heads(int(extra["half_bytes"]))
            self._remote, pages = na.remote_pages(extra)
            self._remote_pages = dict(enumerate(pages))
            size, head_bytes = self.layout.block_size, self._head_bytes()
            self._remote_rows = na.remote_rows(extra, heads, size, head_bytes)
        except (KeyError, TypeError, ValueError, RuntimeError, *self._agent.errors) as exc:
            raise TransferError(f"bad nixl welcome from {self._endpoint}: {exc!r}") from None

    def _written_bytes(self, cache: torch.Tensor, blocks: int, heads: int) -> int:
        """Bytes a WRITE of `heads` KV heads of `blocks` blocks of a layer cache moves: every
        plane (K and V; or the latent) of them."""
        return cache.shape[0] * blocks * self.layout.block_size * heads * self._head_bytes()

    def _head_bytes(self) -> int:
        """One KV head of one token: head_dim elements."""
        return self.layout.head_dim * self.layout.itemsize

    def _receiver_heads(self, half_bytes: int) -> int:
        """The KV heads a receiver's blocks hold, from the bytes of one block's plane: all of
        the model's, or a tensor-parallel rank's share (a divisor of them)."""
        heads, rest = divmod(half_bytes, self.layout.block_size * self._head_bytes())
        if rest or not heads or self.layout.num_kv_heads % heads:
            raise ValueError(f"blocks of {half_bytes} bytes per plane")
        return heads

    # -- messages from the receiver

    def _on_message(self, msg: Message) -> None:
        if isinstance(msg, nx.KVExpect):
            if msg.xfer_id not in self._cancelled:
                self._expected[msg.xfer_id] = (frozenset(msg.block_ids), msg.heads)
                # Every reservation is announced to every sender, most of them for other
                # prefill nodes: keep the newest (a request waits here far less than this).
                while len(self._expected) > _ANNOUNCED_KEPT:
                    del self._expected[next(iter(self._expected))]
        elif isinstance(msg, nx.KVCancel):
            self._stop(msg.xfer_id)
        elif isinstance(msg, KVRefused):
            self._refused = msg.reason

    def poll(self) -> None:
        """Take the receiver's messages now: announcements, and cancels, answered at once."""
        sock = self._sock
        while sock is not None and sock.poll(0):
            try:
                msg = KV_PLANE.decode(sock.recv())
            except ProtocolError:
                continue
            self._on_message(msg)

    def _stop(self, xfer_id: str) -> None:
        """Never write the transfer again; once its WRITEs are done, say so."""
        self._cancelled[xfer_id] = None
        while len(self._cancelled) > 4096:  # the receiver never reuses an id
            del self._cancelled[next(iter(self._cancelled))]
        self._expected.pop(xfer_id, None)
        out = self._out.pop(xfer_id, None)
        if out is not None:
            self._settle(out)
        self._send(nx.KVSettled(xfer_id))

    # -- sending

    def send_layer(
        self, xfer_id: str, layer: int, src: Blocks, dst: Blocks, cache: Tensor, heads: Heads = None
    ) -> None:
        """KVSender.send_layer: one WRITE of the layer's pages (or of their `heads`)."""
        self._check_send_args(layer, src, dst, cache)
        sent = _sent_heads(cache, heads)
        self._caches[layer] = cache
        self.poll()
        if xfer_id in self._cancelled or not src:
            return  # nothing to write (a cancelled transfer's pages go nowhere, refused or not)
        if self._refused:
            raise TransferError(f"{self._endpoint} dropped this sender: {self._refused}")
        out = self._out.setdefault(xfer_id, _Outbound())
        dst_heads = self._writable(out, xfer_id, layer, dst, sent)
        if dst_heads is None:
            return
        if self.faults is None or not self.faults.drop(xfer_id):  # dropped: booked, not written
            self._write(out, xfer_id, layer, (src, sent), (dst, dst_heads))
        # The pages' sums, read while the WRITE runs (the receiver sums what lands).
        out.sums.append((layer, dst, nx.page_sums(cache, src, sent)))

    def _writable(
        self, out: _Outbound, xfer_id: str, layer: int, dst: list[int], heads: range
    ) -> range | None:
        """The receiver's heads this layer's pages go to, if the receiver announced the
        transfer, every block of `dst` is in it, and it expects as many heads as we send;
        else None, with the problem noted (the transfer then fails at `send_done`)."""
        announced = self._announced(xfer_id)
        if announced is None:  # cancelled meanwhile, or never announced
            if xfer_id not in self._cancelled:
                out.problems.append("the receiver never announced this transfer")
            return None
        allowed, dst_heads = announced
        outside = sorted(set(dst) - allowed)
        if outside:
            out.problems.append(f"layer {layer}: blocks {outside[:8]} are outside the reservation")
            return None
        if len(dst_heads) != len(heads):
            out.problems.append(
                f"{len(heads)} KV heads sent, the receiver expects {len(dst_heads)}"
            )
            return None
        return dst_heads

    def _write(
        self,
        out: _Outbound,
        xfer_id: str,
        layer: int,
        src: tuple[list[int], range],
        dst: tuple[list[int], range],
    ) -> None:
        """Post the WRITE of one layer's pages (blocks, heads) `src` into the receiver's `dst`."""
        # A page sent again (a last block that a later chunk completed) must not race its
        # earlier WRITE: this layer's earlier WRITEs of the transfer finish first.
        self._wait(out, time.monotonic() + self._send_timeout, layer)
        cache = self._caches[layer]
        restore = self._fault_corrupt(xfer_id, cache, src[0][0], src[1])
        notif = msgpack.packb([xfer_id, layer, dst[0]])
        try:
            if len(src[1]) == cache.shape[3] and len(dst[1]) == self._remote_rows[layer].heads:
                # whole blocks on both ends (the same TP): one descriptor per block plane
                pages = self._remote_pages, self._remote_blocks, [layer], src[0], dst[0], notif
                (handle,) = na.write_pages(self._caches, *pages)
            else:
                remote = (self._remote, self._remote_rows[layer])
                handle = na.write_rows(cache, *src, remote, *dst, notif)
        except TransferError as exc:
            if restore is not None:
                restore()
            raise TransferError(f"NIXL WRITE to {self._endpoint}: {exc}") from None
        out.handles.append((layer, handle))
        out.writes += 1
        self.bytes_sent += self._written_bytes(cache, len(src[0]), len(src[1]))
        if restore is not None:  # test hook: the page goes out damaged, stays clean here
            self._wait(out, time.monotonic() + self._send_timeout, layer)
            restore()

    def send_done(self, xfer_id: str, first: FirstToken) -> None:
        self._require_connected()
        self.poll()
        if xfer_id in self._cancelled:
            return  # the receiver cancelled it and was told it settled
        out = self._out.pop(xfer_id, None) or _Outbound()
        self._expected.pop(xfer_id, None)
        self._settle(out)
        sums = nx.collect_sums(out.sums)
        per_layer = tuple(len(sums.get(i, {})) for i in range(self.layout.num_layers))
        done = KVDone(
            xfer_id,
            first,
            nx.pages_digest(sums) if sums else 0,
            per_layer,
            nx.NIXL_CHECKSUM,
            sender_error="; ".join(out.problems),
            written_blocks=tuple(sorted({dst for pages in sums.values() for dst in pages})),
            writes=out.writes,
        )
        self._send(done)

    def abandon(self, xfer_id: str) -> None:
        """The prefill node dropped the transfer: its WRITEs finish, the receiver hears."""
        if self._sock is not None and xfer_id not in self._cancelled:
            self._stop(xfer_id)

    def flush(self, timeout: float = 10.0) -> None:
        self._require_connected()
        deadline = time.monotonic() + timeout
        for out in self._out.values():
            self._wait(out, deadline)

    def close(self) -> None:
        for out in self._out.values():
            try:
                self._settle(out)
            except TransferError:
                pass
        self._out.clear()
        if self._remote:
            self._agent.drop_remote(self._remote)
            self._remote = ""
        super().close()

    # -- helpers

    def _announced(self, xfer_id: str) -> tuple[frozenset[int], range] | None:
        """The receiver's blocks and heads for the transfer, waiting (bounded) for its announcement
        (it normally arrives before the router's request does); None if it never came."""
        out = self._out[xfer_id]
        if out.unannounced:
            return None
        deadline = time.monotonic() + self._announce_timeout
        while xfer_id not in self._expected:
            if xfer_id in self._cancelled:
                return None
            if time.monotonic() >= deadline:
                out.unannounced = True
                return None
            assert self._sock is not None
            if self._sock.poll(10):
                self.poll()
        return self._expected[xfer_id]

    def _wait(self, out: _Outbound, deadline: float, layer: int | None = None) -> None:
        """WRITEs of `out` (of one layer, or all) out of flight; failures become problems."""
        keep = []
        for lay, handle in out.handles:
            if layer is not None and lay != layer:
                keep.append((lay, handle))
                continue
            state = na.finish_handle(handle, deadline, f"NIXL WRITE to {self._endpoint}")
            if state != "DONE":
                out.problems.append(f"layer {lay}: NIXL WRITE failed ({state})")
        out.handles = keep

    def _settle(self, out: _Outbound) -> None:
        """Every WRITE of the transfer finished, or was aborted: its source pages are free."""
        try:
            self._wait(out, time.monotonic() + self._send_timeout)
        finally:
            for _, handle in out.handles:  # timed out: release aborts the rest
                na.release_handle(handle)
            out.handles.clear()

    def _fault_corrupt(self, xfer_id: str, cache: torch.Tensor, block: int, heads: range) -> Any:
        """Under a test's faults only: damage a source page's first sent byte for the WRITE to
        carry; returns how to undo it once the WRITE is done (the checksum reads the clean
        page)."""
        if self.faults is None or not self.faults.corrupt(xfer_id):
            return None
        row = cache[0, block, 0, heads.start]
        corrupt_first_byte(row)
        return lambda: corrupt_first_byte(row)  # xor twice: the original byte


def _sent_heads(cache: torch.Tensor, heads: range | None) -> range:
    """The cache's KV heads a slice carries (all when None); ValueError outside the cache."""
    if heads is None:
        return range(cache.shape[3])
    if not heads or heads.step != 1 or heads.start < 0 or heads.stop > cache.shape[3]:
        raise ValueError(f"KV heads {heads} are not a range within the cache's {cache.shape[3]}")
    return heads
