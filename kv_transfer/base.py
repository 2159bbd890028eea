"""What a KV connector is: one sender class (prefill side), one receiver class (decode side).

A transfer is named by an `xfer_id` the decode node hands out with its reservation. The decode
node `expect`s it with the blocks it reserved, the prefill node sends pages layer by layer into
those blocks and ends with `send_done`, and the decode node's `poll` returns one
`TransferResult` per finished transfer. Connectors are picked by name through
`create_sender` / `create_receiver`.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.common.wire.payloads import FirstToken, KVLayout
from pdserve.common.wire.security import CurveKeys


class LayoutMismatchError(ValueError):
    """The receiver's KV layout differs from the sender's; the message names the fields."""


class TransferTimeout(TimeoutError):
    """A bounded wait (handshake, send queue, staging space, flush) ran out."""


class TransferError(RuntimeError):
    """The peer refused the connection for a reason other than the layout, or a transport
    failed."""


@dataclass(frozen=True, slots=True)
class TransferResult:
    """One finished transfer as the decode node sees it.

    `ok` is False when pages are missing, refused or fail the sender's checksum; `error` then
    says why. `first` is the prefill node's first token, from the sender's `send_done`.
    """

    xfer_id: str
    first: FirstToken
    ok: bool
    error: str = ""


class KVSender(abc.ABC):
    """Prefill side of one connection: pushes pages of its cache into one receiver's blocks."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        # Page bytes handed to the transport, counted where they cross it (the frame-moving
        # connectors; a nixl WRITE is not counted here).
        self.bytes_sent = 0

    @classmethod
    def check_installed(cls) -> None:
        """TransferError naming the extra to install when this connector's library is missing
        (`check_available`, at a node's start); most need nothing beyond pdserve's own."""
        return None

    @abc.abstractmethod
    def connect(self, endpoint: str, timeout: float = 10.0) -> None:
        """Connect to a receiver's `endpoint` and handshake.

        The sender sends its layout; the receiver compares digests. Raises
        LayoutMismatchError (naming the differing fields) on a refused layout, TransferError on
        any other refusal, TransferTimeout when no answer comes within `timeout` seconds (the
        receiver answers from its `poll`).
        """

    @abc.abstractmethod
    def send_layer(
        self,
        xfer_id: str,
        layer: int,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        layer_cache: torch.Tensor,
        heads: range | None = None,
    ) -> None:
        """Send the pages of `src_block_ids` of one layer into the receiver's `dst_block_ids`.

        With `heads` (indices into this cache's KV heads), only those heads' part of each
        page: a tensor-parallel rank's slice for a receiving rank (see `common.wire.payloads`).

        The pages are gathered (copied out of `layer_cache`) before this returns, so the caller
        may overwrite those blocks at once; the transport itself may still be in flight
        (`flush` waits). Blocks for at most the sender's send timeout when the transport is
        full (TransferTimeout).
        """

    @abc.abstractmethod
    def send_done(self, xfer_id: str, first: FirstToken) -> None:
        """End a transfer, handing the decode node the request's first token; the
        connector adds a checksum of every page it sent and a page count per layer, so the
        receiver can tell a complete transfer from a damaged one."""

    @abc.abstractmethod
    def flush(self, timeout: float = 10.0) -> None:
        """Wait until everything sent so far has been handed to the transport
        (TransferTimeout after `timeout` seconds)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release sockets and buffers without waiting; call `flush` first to be sure that
        queued pages went out. Idempotent."""

    def abandon(self, xfer_id: str) -> None:
        """The prefill node dropped a transfer midway. Connectors that copy pages out before
        `send_layer` returns have nothing to do; one whose transport reads the source blocks
        later (nixl) waits for that here, so the caller may free the blocks afterwards."""
        return None

    def poll(self) -> None:
        """Take the receiver's messages now (called from the prefill node's loop)."""
        return None


class KVReceiver(abc.ABC):
    """Decode side: owns a listening endpoint and writes arriving pages into reserved blocks.

    Single-threaded by design: the decode node's main loop calls `poll`, which does all the
    work (handshakes, writes, completions) on the calling thread.
    """

    # True when remote writes may still land in a cancelled transfer's blocks until
    # `released` names it (nixl); others drop late pages themselves and never fence.
    fences: bool = False

    def __init__(self, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        self.layout = layout
        self.kv_caches = kv_caches

    def released(self) -> list[str]:
        """Cancelled transfers whose blocks the decode node may free now (fencing
        connectors; the others' blocks are free at `cancel`)."""
        return []

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """Address to give to senders' `connect`."""

    def advertise(self, host: str) -> None:
        """Give senders `host` in `endpoint` (and in the connector's own addresses) instead of
        the bind address, which may be a wildcard such as 0.0.0.0."""
        raise NotImplementedError(f"{type(self).__name__} cannot advertise an address")

    @abc.abstractmethod
    def expect(self, xfer_id: str, block_ids: list[int], heads: range | None = None) -> None:
        """Register a transfer into `block_ids` (the blocks reserved for it); with `heads`
        (indices into this receiver's cache heads) its pages carry and fill only those heads.

        Frames for xfer ids not expected (or cancelled, or finished) and frames for blocks
        outside `block_ids` are refused and counted in `counters`, never written.
        """

    @abc.abstractmethod
    def poll(self, timeout: float = 0.0) -> list[TransferResult]:
        """Process arriving frames for up to `timeout` seconds and return the transfers
        completed since the last call. Returns early once at least one has completed."""

    @abc.abstractmethod
    def cancel(self, xfer_id: str) -> None:
        """Forget a transfer: frames arriving later are dropped and counted; no result is
        returned for it. Idempotent; the caller may reuse the blocks at once."""

    @property
    @abc.abstractmethod
    def counters(self) -> Mapping[str, int]:
        """Refused or dropped frames and messages by reason (e.g. `unknown_xfer`)."""

    @property
    @abc.abstractmethod
    def pages_received(self) -> int:
        """Pages (one block of one layer) written into the cache so far."""

    @abc.abstractmethod
    def close(self) -> None:
        """Unbind and release buffers; idempotent."""


# -- registry -----------------------------------------------------------------------------------

# name -> (sender, receiver) as "module:Class"; modules import lazily so that asking for `zmq`
# never pulls in torch.distributed.
_KV = "pdserve.kv_transfer."
_CONNECTORS: dict[str, tuple[str, str]] = {
    "zmq": (_KV + "zmq_connector:ZmqSender", _KV + "zmq_connector:ZmqReceiver"),
    "nccl": (_KV + "nccl_connector:NcclSender", _KV + "nccl_connector:NcclReceiver"),
    "shm": (_KV + "shm_connector:ShmSender", _KV + "shm_connector:ShmReceiver"),
    "nixl": (_KV + "nixl_connector:NixlSender", _KV + "nixl_receiver:NixlReceiver"),
}


def check_available(name: str) -> None:
    """Fail early (at a node's start) when connector `name` needs a library that is not
    installed: ValueError for an unknown name, TransferError naming the extra to install."""
    _load(name, 0).check_installed()


def connector_names() -> tuple[str, ...]:
    return tuple(sorted(_CONNECTORS))


def _load(name: str, which: int) -> type:
    if name not in _CONNECTORS:
        raise ValueError(f"unknown KV connector {name!r}; choose one of {connector_names()}")
    module, _, cls = _CONNECTORS[name][which].partition(":")
    return getattr(importlib.import_module(module), cls)


def create_sender(
    name: str, layout: KVLayout, curve: CurveKeys | None = None, **opts: Any
) -> KVSender:
    """A not yet connected sender of connector `name` (`zmq`, `nccl`, `shm`, `nixl`); with `curve`
    (the cluster's keys) it authenticates to the receiver and encrypts its side channel."""
    return _load(name, 0)(layout, curve=curve, **opts)


def create_receiver(
    name: str,
    layout: KVLayout,
    kv_caches: list[torch.Tensor],
    host: str = "127.0.0.1",
    port: int = 0,
    curve: CurveKeys | None = None,
    **opts: Any,
) -> KVReceiver:
    """A bound receiver of connector `name` writing into `kv_caches` (one tensor per layer);
    `port=0` picks a free port. With `curve` it admits only senders holding the cluster's
    keys."""
    return _load(name, 1)(layout, kv_caches, host=host, port=port, curve=curve, **opts)
