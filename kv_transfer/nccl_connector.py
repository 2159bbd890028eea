"""KV pages over torch.distributed point-to-point, one two-rank group per sender-receiver pair.

`init_process_group` can run once per process and would tie every node into one world, so
each pair gets its own backend object built directly (`ProcessGroupNCCL` for CUDA caches,
`ProcessGroupGloo` for CPU caches, which is what CI runs) on a `PrefixStore` of one
`TCPStore` the receiver hosts. The sender is rank 0, the receiver rank 1.

Page headers travel first on the zmq side channel: the receiver must know a frame's shape and
blocks before it can post the matching `recv`. Each frame's tag is its sequence number (gloo
matches on it; NCCL matches in order, which the side channel preserves). The receiver never
blocks on a recv for long: `poll` posts it when the header arrives; NCCL recvs are then
checked with `is_completed()` on later polls. Gloo work reports completion only from `wait()`,
so gloo recvs are waited for at once; that wait is short because the sender posts its send
right after the header.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from pdserve.common.rendezvous import listening_store
from pdserve.common.wire.payloads import KVLayout
from pdserve.common.wire.security import CurveKeys
from pdserve.kv_transfer.base import TransferError, TransferTimeout
from pdserve.kv_transfer.channel import ChannelSender
from pdserve.kv_transfer.channel_receiver import ChannelReceiver, Peer
from pdserve.kv_transfer.wire import (
    FramePool,
    KVPage,
    blocks_per_frame,
    check_welcome,
    torch_dtype,
    welcome_extra,
)

_TAG_MASK = (1 << 30) - 1
_MAX_INFLIGHT = 64  # CUDA frames whose gathered copies a sender holds before it waits
# gloo (CPU): gather buffers a sender reuses, so at most this many sends are in flight (plenty
# to keep the pair's socket busy with frames of up to FRAME_BYTES); recv buffers a receiver
# reuses
_POOL_FRAMES = 4


def _tag(seq: int) -> int:
    return seq & _TAG_MASK


def pair_group(
    store: dist.Store,
    pair: str,
    rank: int,
    backend: str,
    host: str,
    timeout: timedelta,
) -> Any:
    """A two-rank backend for one pair; blocks until both ranks built it (at most `timeout`)."""
    prefixed = dist.PrefixStore(f"pdserve-kv/{pair}/", store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        # An explicit device keeps gloo off hostname resolution and on the address we chose.
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(prefixed, rank, 2, opts)
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if backend != "nccl" or nccl is None:
        raise TransferError(f"backend {backend!r} is not available in this torch build")
    opts = nccl.Options()
    opts._timeout = timeout
    return nccl(prefixed, rank, 2, opts)


@dataclass
class _Pair:
    name: str
    group: Any = None


@dataclass
class _Recv:
    peer: Peer
    page: KVPage
    buf: torch.Tensor
    work: Any
    admitted: bool


class NcclReceiver(ChannelReceiver):
    """Decode side of the nccl connector. Options: `store_port` (0 = free port),
    `pair_timeout` (s) bounds pair setup, `recv_timeout` (s) each gloo recv."""

    CONNECTOR: ClassVar[str] = "nccl"

    def __init__(
        self,
        layout: KVLayout,
        kv_caches: list[torch.Tensor],
        host: str = "127.0.0.1",
        port: int = 0,
        store_port: int = 0,
        pair_timeout: float = 30.0,
        recv_timeout: float = 10.0,
        curve: CurveKeys | None = None,
    ) -> None:
        super().__init__(layout, kv_caches, host, port, curve=curve)
        self._recv_timeout = timedelta(seconds=recv_timeout)
        self._device = kv_caches[0].device
        self._backend = "nccl" if self._device.type == "cuda" else "gloo"
        self._timeout = timedelta(seconds=pair_timeout)
        self._store = listening_store(host, store_port, None, self._timeout)
        self._pending: list[_Recv] = []
        frame_bytes = blocks_per_frame(layout.page_bytes) * layout.page_bytes
        self._pool = FramePool(_POOL_FRAMES, frame_bytes)

    def _accept_peer(self, peer: Peer) -> dict[str, Any]:
        peer.state = _Pair(uuid.uuid4().hex)
        return welcome_extra(
            store_host=self.advertise_host,
            store_port=self._store.port,
            pair=peer.state.name,
            backend=self._backend,
            timeout_s=self._timeout.total_seconds(),
        )

    def _after_welcome(self, peer: Peer) -> None:
        state = peer.state
        state.group = pair_group(
            self._store, state.name, 1, self._backend, self.advertise_host, self._timeout
        )

    def _on_page_data(self, peer: Peer, page: KVPage, frames: list[Any], admitted: bool) -> None:
        if frames:
            if admitted:
                self._book.fail(page, "nccl page header came with a data frame")
            return
        # Refused frames are received too (into a scratch buffer): the pair's stream of sends
        # must stay matched with our recvs.
        dtype = torch_dtype(page.dtype)
        buf = None if self._device.type == "cuda" else self._pool.take(page.shape, dtype)
        if buf is None:
            buf = torch.empty(page.shape, dtype=dtype, device=self._device)
        work = peer.state.group.recv([buf], 0, _tag(page.seq))
        self._pending.append(_Recv(peer, page, buf, work, admitted))

    def _progress(self) -> None:
        still: list[_Recv] = []
        for recv in self._pending:
            if self._backend == "nccl" and not recv.work.is_completed():
                still.append(recv)
                continue
            try:
                # Raises the transport's error; on CUDA also orders our stream after the recv.
                recv.work.wait(self._recv_timeout)
            except Exception as exc:  # its buffer stays lent: the recv may still land
                if recv.admitted:
                    self._book.fail(recv.page, f"recv failed: {exc}")
                continue
            if recv.admitted:
                self._land(recv.page, recv.buf)
            self._pool.give_back(recv.buf)
        self._pending = still

    def _busy(self) -> bool:
        return bool(self._pending)

    def _drop_peer(self, peer: Peer) -> None:
        # Pending recvs keep the group alive until they finish or time out; they land nowhere.
        for recv in self._pending:
            if recv.peer is peer and recv.admitted:
                recv.admitted = False
                self._book.fail(recv.page, "sender dropped")

    def close(self) -> None:
        super().close()
        self._pending.clear()
        self._store = None  # its listening socket closes with it


class NcclSender(ChannelSender):
    """Prefill side of the nccl connector. Options: `send_timeout` (s), `bind_host` (the
    address gloo listens on; set it to a routable one across hosts)."""

    CONNECTOR: ClassVar[str] = "nccl"

    def __init__(
        self,
        layout: KVLayout,
        send_timeout: float = 30.0,
        bind_host: str = "127.0.0.1",
        curve: CurveKeys | None = None,
    ) -> None:
        super().__init__(layout, send_timeout, curve)
        self._bind_host = bind_host
        self._group: Any = None
        self._store: dist.Store | None = None
        self._device_type = ""
        self._works: list[tuple[Any, torch.Tensor]] = []  # (work, the pages it sends)
        frame_bytes = blocks_per_frame(layout.page_bytes) * layout.page_bytes
        self._pool = FramePool(_POOL_FRAMES, frame_bytes)

    def _on_welcome(self, extra: dict[str, Any], timeout: float) -> None:
        check_welcome(extra, self._endpoint)
        try:
            host, port = str(extra["store_host"]), int(extra["store_port"])
            pair, backend = str(extra["pair"]), str(extra["backend"])
            pair_timeout = timedelta(seconds=float(extra["timeout_s"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"bad nccl welcome: {exc!r}") from None
        wait = timedelta(seconds=timeout)
        self._store = dist.TCPStore(host, port, None, False, wait, wait_for_workers=False)
        self._group = pair_group(self._store, pair, 0, backend, self._bind_host, pair_timeout)
        self._device_type = "cuda" if backend == "nccl" else "cpu"

    def _frame_buffer(
        self, shape: tuple[int, ...], layer_cache: torch.Tensor
    ) -> torch.Tensor | None:
        if self._device_type != "cpu" or layer_cache.is_cuda:
            return None
        self._reap(deadline=None, keep=_POOL_FRAMES - 1)  # a buffer comes free
        return self._pool.take(shape, layer_cache.dtype)

    def _ship(self, page: KVPage, pages: torch.Tensor) -> None:
        if pages.device.type != self._device_type:
            raise ValueError(f"receiver expects {self._device_type} pages, got {pages.device}")
        self._seal(page, pages)
        # The gathered copy must outlive the send (gloo reads it from a worker thread), so it
        # is held with its work until the work completes.
        # Header first: NCCL builds the pair's communicator inside the first send and recv, and
        # the receiver posts its recv only once it has the header.
        self._send(page)
        self._works.append((self._group.send([pages], 1, _tag(page.seq)), pages))
        self._reap(deadline=None)

    def _flush(self, deadline: float) -> None:
        self._reap(deadline)

    def _reap(self, deadline: float | None, keep: int = _MAX_INFLIGHT) -> None:
        """Retire finished sends, raising the first failure; with a deadline, wait for all.

        Without one, only sends known to be done are retired, plus the oldest ones beyond
        `keep` (which bounds the gathered copies we hold): gloo work reports completion only
        from `wait()`. Retired pooled buffers go back to the pool.
        """
        while self._works:
            work, pages = self._works[0]
            if deadline is None:
                done = self._device_type == "cuda" and work.is_completed()
                if not done and len(self._works) <= keep:
                    return
            until = deadline if deadline is not None else time.monotonic() + self._send_timeout
            remaining = until - time.monotonic()
            if remaining <= 0:
                raise TransferTimeout(f"flush to {self._endpoint}: sends not taken in time")
            try:
                work.wait(timedelta(seconds=remaining))
            except Exception as exc:
                raise TransferError(
                    f"send to {self._endpoint} failed or timed out: {exc}"
                ) from None
            self._works.pop(0)
            self._pool.give_back(pages)

    def _close_transport(self) -> None:
        self._works.clear()
        self._group = None
        self._store = None
