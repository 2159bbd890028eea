"""A node's end of the KV data plane, at each of its tensor-parallel ranks. `KVPort` is one
process's connector end (the layout both ends agree on, the cluster's keys, its senders or its
receiver); `RankKV` is a rank's: on a decode node the rank's receiver, on a prefill node its
senders, each moving only the KV heads the rank holds.

A request's transfer between a prefill group at TP p and a decode group at TP d is one slice
per (prefill rank, decode rank) pair of `payloads.transfer_plan`: slice `f"{xfer_id}.{i}"` goes
from prefill rank i to the decode rank that expects it, into that rank's share of the reserved
blocks. Every rank of a node holds a `RankKV`; the node's `KVGroup` (rank 0) runs each method
on its own and on every worker's (`RankDriver.call`), so a node's KV code reads the same at any
TP, and a decode node admits a request only when every slice on every rank finished verified.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import zmq

from pdserve.common.process import host_id
from pdserve.common.wire.payloads import (
    FirstToken,
    HeadSlice,
    KVLayout,
    TokenLogprobs,
    transfer_plan,
)
from pdserve.common.wire.security import CurveKeys, load_keys
from pdserve.kv_transfer.base import (
    KVReceiver,
    KVSender,
    TransferResult,
    check_available,
    create_receiver,
    create_sender,
)


class KVPort:
    """One node's KV connector: its name, the cache layout both ends must agree on (the digest
    a node registers with), and the cluster's CurveZMQ keys for every socket it opens.

    A prefill node keeps one connected sender per decode node (`sender`, `drop`); a decode node
    binds one receiver (`listen`) and registers its `endpoint`.
    """

    def __init__(
        self,
        connector: str,
        layout: KVLayout,
        curve: CurveKeys | None = None,
        connect_timeout: float = 10.0,
        advertise_host: str = "127.0.0.1",
    ) -> None:
        check_available(connector)
        self.advertise_host = advertise_host  # how other hosts reach this node's sockets
        self.host_id = host_id()
        self.connector = connector
        self.layout = layout
        self.digest = layout.digest()
        self.curve = curve
        self.connect_timeout = connect_timeout
        self.senders: dict[str, KVSender] = {}  # receiver endpoint -> connected sender
        self._instances: dict[str, str] = {}  # receiver endpoint -> the process behind it
        self.receiver: KVReceiver | None = None

    @property
    def endpoint(self) -> str:
        """Where senders connect ("" on a node that binds no receiver)."""
        return self.receiver.endpoint if self.receiver is not None else ""

    def listen(
        self, kv_caches: list[torch.Tensor], host: str, port: int, fence_timeout: float = 30.0
    ) -> KVReceiver:
        """Bind the receiver that writes arriving pages into `kv_caches` (`port=0`: any free);
        `fence_timeout` is nixl's (see nixl_receiver)."""
        assert self.receiver is None, "a KV port binds one receiver"
        opts = {"fence_timeout": fence_timeout} if self.connector == "nixl" else {}
        self.receiver = create_receiver(
            self.connector, self.layout, kv_caches, host=host, port=port, curve=self.curve, **opts
        )
        self.receiver.advertise(self.advertise_host)
        return self.receiver

    def sender(self, endpoint: str, instance: str = "") -> KVSender:
        """The connected sender to the receiver at `endpoint`. The first call handshakes and
        raises what `KVSender.connect` raises (a layout mismatch included). `instance` names
        the receiving process: when another one now listens at the same address (a restart on
        a fixed port), the old connection is dropped and a new one handshakes; the transport
        would otherwise reconnect silently to a receiver that never heard our hello."""
        if instance and self._instances.get(endpoint, instance) != instance:
            self.drop(endpoint)
        if instance:
            self._instances[endpoint] = instance
        sender = self.senders.get(endpoint)
        if sender is None:
            # nccl's gloo pair listens on this node's own address, which the peer dials.
            opts = {"bind_host": self.advertise_host} if self.connector == "nccl" else {}
            sender = create_sender(self.connector, self.layout, curve=self.curve, **opts)
            sender.connect(endpoint, self.connect_timeout)
            self.senders[endpoint] = sender
        return sender

    def poll(self) -> None:
        """Let every sender take its receiver's messages (a prefill node's loop calls it)."""
        for sender in self.senders.values():
            sender.poll()

    def drop(self, endpoint: str) -> None:
        """Close the sender to `endpoint` (its connection broke); the next `sender` reconnects."""
        sender = self.senders.pop(endpoint, None)
        if sender is not None:
            sender.close()

    def close(self) -> None:
        """Close every sender and the receiver; idempotent."""
        for endpoint in list(self.senders):
            self.drop(endpoint)
        if self.receiver is not None:
            self.receiver.close()


# A decode group's receivers, rank 0 first (Reserved.kv_endpoints).
Endpoints = list[str]
# One request's pages of one step: [endpoints, xfer_id, source blocks, destination blocks].
Shipment = list[Any]
# What a broken or refused KV connection raises (TransferError/TransferTimeout included; a
# worker rank's failure comes back from RankDriver.call as a RuntimeError).
SEND_ERRORS = (RuntimeError, OSError, zmq.ZMQError)


def slice_id(xfer_id: str, src_rank: int) -> str:
    """The transfer id of prefill rank `src_rank`'s slice of transfer `xfer_id`."""
    return f"{xfer_id}.{src_rank}"


def encode_first(first: FirstToken) -> list[Any]:
    lp = first.logprobs
    lps = None if lp is None else [lp.token_id, lp.logprob, [list(t) for t in lp.top], lp.rank]
    return [first.token_id, lps]


def decode_first(body: list[Any]) -> FirstToken:
    token, lps = body
    if lps is None:
        return FirstToken(token)
    tid, logprob, top, rank = lps
    return FirstToken(token, TokenLogprobs(tid, logprob, tuple(tuple(t) for t in top), rank))


class RankKV:
    """This rank's KV connector end (see the module docstring). Built on every rank of a node
    from the same options: `connector`, the checkpoint's `model_id` (the layout is the
    runner's: the model's whole KV heads), the directory of the cluster's CurveZMQ keys, and
    for a decode node the bind `host`/`port` (each rank binds `port` + rank, or any free port
    when 0)."""

    COMMANDS = frozenset(
        {
            "endpoint",
            "expect",
            "cancel",
            "finished",
            "released",
            "bytes_received",
            "bytes_sent",
            "connect",
            "take_failures",
            "done",
            "abandon",
            "drop",
            "poll_senders",
        }
    )

    def __init__(
        self,
        runner: Any,
        group: Any,
        connector: str,
        model_id: str,
        role: str,
        curve_dir: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str = "127.0.0.1",
        connect_timeout: float = 10.0,
        fence_timeout: float = 30.0,
    ) -> None:
        self.caches: list[torch.Tensor] = runner.kv_caches
        self.rank, self.size = (0, 1) if group is None else (group.rank, group.size)
        self.layout: KVLayout = runner.kv_layout(model_id)
        if connector == "nixl" and self.layout.planes != 2:
            raise ValueError(
                "--kv-connector nixl moves K/V pages only, and this model's cache holds one "
                "latent per token (MLA); choose zmq, shm or nccl"
            )
        keys = load_keys(curve_dir)
        self.port = KVPort(connector, self.layout, keys, connect_timeout, advertise_host)
        self.receiver: KVReceiver | None = None
        if role == "decode":
            bind = port + self.rank if port else 0
            self.receiver = self.port.listen(self.caches, host, bind, fence_timeout)
        self.expected: dict[str, list[str]] = {}  # xfer id -> this rank's slice ids
        self.failed: dict[str, str] = {}  # decode group (its rank 0 endpoint) -> why
        self.fenced: dict[str, set[str]] = {}  # cancelled xfer id -> its slices still fenced
        self._results: list[TransferResult] = []  # finished slices not yet taken
        # (send TP, receive TP) -> the plan: asked for each layer of each shipment, made once
        self._plans: dict[tuple[int, int], tuple[HeadSlice, ...]] = {}

    def _plan(self, send_tp: int, recv_tp: int) -> tuple[HeadSlice, ...]:
        key = (send_tp, recv_tp)
        if key not in self._plans:
            self._plans[key] = transfer_plan(self.layout.num_kv_heads, send_tp, recv_tp)
        return self._plans[key]

    # -- decode side ----------------------------------------------------------------------------

    def endpoint(self) -> str:
        return self.port.endpoint

    def expect(self, xfer_id: str, block_ids: list[int], src_tp: int) -> int:
        """Expect this rank's slices of `xfer_id` from a prefill group at TP `src_tp` into
        `block_ids`; how many."""
        assert self.receiver is not None, "a decode node's rank binds a receiver"
        ids = []
        for s in self._plan(src_tp, self.size):
            if s.dst_rank == self.rank:
                heads = range(s.dst_offset, s.dst_offset + s.count)
                self.receiver.expect(slice_id(xfer_id, s.src_rank), block_ids, heads)
                ids.append(slice_id(xfer_id, s.src_rank))
        self.expected[xfer_id] = ids
        return len(ids)

    def cancel(self, xfer_id: str) -> None:
        assert self.receiver is not None
        ids = self.expected.pop(xfer_id, [])
        for sid in ids:
            self.receiver.cancel(sid)
        if self.receiver.fences:  # released here once each of these slices is
            self.fenced.setdefault(xfer_id, set()).update(ids)

    def finished(self) -> list[list[Any]]:
        """Slices finished here since the last call: [xfer id, ok, error, first token]."""
        assert self.receiver is not None
        out = []
        self._poll()
        results, self._results = self._results, []
        for r in results:
            xfer_id = r.xfer_id.rpartition(".")[0]
            ids = self.expected.get(xfer_id)
            if ids is None or r.xfer_id not in ids:
                continue
            ids.remove(r.xfer_id)
            if not ids:
                del self.expected[xfer_id]
            out.append([xfer_id, r.ok, r.error, encode_first(r.first)])
        return out

    def released(self) -> list[str]:
        """Cancelled transfers whose blocks no sender can write here any more (fencing
        connectors): each cancelled xfer id once, when every one of its slices is."""
        assert self.receiver is not None
        if self.fenced:  # the senders' settles come in through the receiver's poll
            self._poll()
        for sid in self.receiver.released():
            self.fenced.get(sid.rpartition(".")[0], set()).discard(sid)
        out = sorted(x for x, ids in self.fenced.items() if not ids)
        for xfer_id in out:
            del self.fenced[xfer_id]
        return out

    def _poll(self) -> None:
        """Let the receiver take its messages; keep the transfers it finished for `finished`."""
        assert self.receiver is not None
        self._results += self.receiver.poll(0)

    def bytes_received(self) -> int:
        """KV bytes written here: pages received, each this rank's share of a page (exact
        when every slice carries all of the rank's heads)."""
        if self.receiver is None:
            return 0
        share = self.caches[0].shape[3] / self.layout.num_kv_heads
        return int(self.receiver.pages_received * self.layout.page_bytes * share)

    # -- prefill side ---------------------------------------------------------------------------

    def bytes_sent(self) -> int:
        """Page bytes this rank's senders handed to their transports, as they count them (a
        rank the plan names for no slice sends none: an MLA latent leaves from one rank)."""
        return sum(s.bytes_sent for s in self.port.senders.values())

    def _my_slices(self, endpoints: Endpoints) -> list[HeadSlice]:
        return [s for s in self._plan(self.size, len(endpoints)) if s.src_rank == self.rank]

    def connect(self, endpoints: Endpoints, instance: str) -> None:
        """Handshake with every decode rank this rank sends to (raises what connect raises)."""
        for s in self._my_slices(endpoints):
            self.port.sender(endpoints[s.dst_rank], f"{instance}.{s.dst_rank}")

    def layer_hook(self, shipments: list[Shipment]) -> Callable[[int], None]:
        """What this rank runs after each layer of a step that ships `shipments`."""
        return lambda layer: self.ship_layer(layer, shipments)

    def ship_layer(self, layer: int, shipments: list[Shipment]) -> None:
        """Send this rank's slices of one layer's new pages; a broken connection goes to
        `failed` (the rest of that destination's pages are skipped)."""
        cache = self.caches[layer]
        for endpoints, xfer_id, src, dst in shipments:
            if endpoints[0] in self.failed:
                continue
            try:
                for s in self._my_slices(endpoints):
                    heads = range(s.src_offset, s.src_offset + s.count)
                    sender = self.port.senders[endpoints[s.dst_rank]]
                    sender.send_layer(slice_id(xfer_id, self.rank), layer, src, dst, cache, heads)
            except (*SEND_ERRORS, KeyError) as exc:
                self.failed[endpoints[0]] = str(exc) or type(exc).__name__

    def take_failures(self) -> dict[str, str]:
        failed, self.failed = self.failed, {}
        return failed

    def done(self, endpoints: Endpoints, xfer_id: str, first: list[Any]) -> None:
        """End this rank's slices of `xfer_id`, handing over the request's first token."""
        for s in self._my_slices(endpoints):
            sender = self.port.senders[endpoints[s.dst_rank]]
            sender.send_done(slice_id(xfer_id, self.rank), decode_first(first))

    def abandon(self, endpoints: Endpoints, xfer_id: str) -> None:
        for s in self._my_slices(endpoints):
            sender = self.port.senders.get(endpoints[s.dst_rank])
            if sender is not None:
                sender.abandon(slice_id(xfer_id, self.rank))

    def drop(self, endpoints: Endpoints) -> None:
        for endpoint in endpoints:
            self.port.drop(endpoint)

    def poll_senders(self) -> None:
        self.port.poll()

    def close(self) -> None:
        self.port.close()


class KVGroup:
    """A node's KV connector across its tensor-parallel ranks (held by rank 0): `call` runs a
    `RankKV` method on every rank and returns each rank's result, rank 0's first."""

    def __init__(self, local: RankKV, driver: Any) -> None:
        self.local = local
        self.driver = driver  # the engine's RankDriver (None at TP 1)
        self.port = local.port
        self.size = local.size
        self.endpoints: tuple[str, ...] = ()
        self._released_on: dict[str, set[int]] = {}  # cancelled xfer id -> ranks that released
        if local.receiver is not None:
            self.endpoints = tuple(self.call("endpoint"))

    def released(self) -> list[str]:
        """Cancelled transfers whose blocks no sender can write on any rank any more (each
        rank names each cancelled transfer once): the node may free them now."""
        for rank, ids in enumerate(self.call("released")):
            for xfer_id in ids:
                self._released_on.setdefault(xfer_id, set()).add(rank)
        out = [x for x, ranks in self._released_on.items() if len(ranks) == self.size]
        for xfer_id in out:
            del self._released_on[xfer_id]
        return out

    def call(self, method: str, *args: Any) -> list[Any]:
        def here() -> Any:
            return getattr(self.local, method)(*args)

        if self.driver is None:
            return [here()]
        return self.driver.call(method, list(args), here)

    def close(self) -> None:
        self.local.close()  # the workers' ends close with their processes
