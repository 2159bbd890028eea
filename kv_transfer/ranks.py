"""A node's end of the KV data plane at each of its tensor-parallel ranks. `RankKV` is a rank's:
on a decode node the rank's receiver, on a prefill node its senders, each moving only the KV
heads the rank holds, through the `KVPort` it holds (one process's connector, layout and keys);
`KVGroup` is the node's (rank 0), with one method per thing the node asks.

A request's transfer between a prefill group at TP p and a decode group at TP d is one slice
per (prefill rank, decode rank) pair of `payloads.transfer_plan`: slice `f"{xfer_id}.{i}"` goes
from prefill rank i to the decode rank that expects it, into that rank's share of the reserved
blocks. `KVGroup` sends each command (`commands`, typed messages of the KV ranks plane) to its
own `RankKV` and, through the engine's `RankDriver`, to every worker's, so a node's KV code
reads the same at any TP, and a decode node admits a request only when every slice on every
rank finished verified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
import zmq

from pdserve.common.engine.model_runner import LayerCall
from pdserve.common.process import host_id
from pdserve.common.wire.messages import Message
from pdserve.common.wire.payloads import FirstToken, HeadSlice, KVLayout, transfer_plan
from pdserve.common.wire.ranks import Count, Done, Handlers, RankCommand
from pdserve.common.wire.security import CurveKeys, load_keys
from pdserve.kv_transfer import commands
from pdserve.kv_transfer.base import (
    KVReceiver,
    KVSender,
    TransferResult,
    check_available,
    create_receiver,
    create_sender,
)

# What a broken or refused KV connection raises (TransferError/TransferTimeout included; a
# worker rank's failure comes back from RankDriver.call as a RankCommandError, a RuntimeError).
SEND_ERRORS = (RuntimeError, OSError, zmq.ZMQError)


def slice_id(xfer_id: str, src_rank: int) -> str:
    """The transfer id of prefill rank `src_rank`'s slice of transfer `xfer_id`."""
    return f"{xfer_id}.{src_rank}"


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


class RankKV:
    """This rank's KV connector end (see the module docstring), the rank agent of a node that
    moves KV. Built on every rank of a node from the same options: `connector`, the
    checkpoint's `model_id` (the layout is the runner's: the model's whole KV heads), the
    directory of the cluster's CurveZMQ keys, and for a decode node the bind `host`/`port`
    (each rank binds `port` + rank, or any free port when 0)."""

    PLANE = commands.KV_RANKS

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

    def handlers(self) -> Handlers:
        """Each command of the KV ranks plane -> the method that answers it."""
        return {
            commands.Endpoint: self.endpoint,
            commands.Expect: self.expect,
            commands.Cancel: self.cancel,
            commands.TakeFinished: self.finished,
            commands.TakeReleased: self.released,
            commands.BytesReceived: self.bytes_received,
            commands.BytesSent: self.bytes_sent,
            commands.Connect: self.connect,
            commands.TakeFailures: self.take_failures,
            commands.SendDone: self.done,
            commands.Abandon: self.abandon,
            commands.Drop: self.drop,
            commands.PollSenders: self.poll_senders,
        }

    def _plan(self, send_tp: int, recv_tp: int) -> tuple[HeadSlice, ...]:
        key = (send_tp, recv_tp)
        if key not in self._plans:
            self._plans[key] = transfer_plan(self.layout.num_kv_heads, send_tp, recv_tp)
        return self._plans[key]

    # -- decode side ----------------------------------------------------------------------------

    def endpoint(self, _: commands.Endpoint) -> commands.EndpointIs:
        return commands.EndpointIs(self.port.endpoint)

    def expect(self, cmd: commands.Expect) -> Count:
        """Expect this rank's slices of the transfer; how many."""
        assert self.receiver is not None, "a decode node's rank binds a receiver"
        ids = []
        for s in self._plan(cmd.src_tp, self.size):
            if s.dst_rank == self.rank:
                heads = range(s.dst_offset, s.dst_offset + s.count)
                sid = slice_id(cmd.xfer_id, s.src_rank)
                self.receiver.expect(sid, list(cmd.block_ids), heads)
                ids.append(sid)
        self.expected[cmd.xfer_id] = ids
        return Count(len(ids))

    def cancel(self, cmd: commands.Cancel) -> Done:
        assert self.receiver is not None
        ids = self.expected.pop(cmd.xfer_id, [])
        for sid in ids:
            self.receiver.cancel(sid)
        if self.receiver.fences:  # released here once each of these slices is
            self.fenced.setdefault(cmd.xfer_id, set()).update(ids)
        return Done()

    def finished(self, _: commands.TakeFinished) -> commands.Finished:
        """Slices finished here since the last call."""
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
            out.append(commands.SliceDone(xfer_id, r.ok, r.error, r.first))
        return commands.Finished(tuple(out))

    def released(self, _: commands.TakeReleased) -> commands.Released:
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
        return commands.Released(tuple(out))

    def _poll(self) -> None:
        """Let the receiver take its messages; keep the transfers it finished for `finished`."""
        assert self.receiver is not None
        self._results += self.receiver.poll(0)

    def bytes_received(self, _: commands.BytesReceived) -> Count:
        """KV bytes written here: pages received, each this rank's share of a page (exact
        when every slice carries all of the rank's heads)."""
        if self.receiver is None:
            return Count(0)
        share = self.caches[0].shape[3] / self.layout.num_kv_heads
        return Count(int(self.receiver.pages_received * self.layout.page_bytes * share))

    # -- prefill side ---------------------------------------------------------------------------

    def bytes_sent(self, _: commands.BytesSent) -> Count:
        """Page bytes this rank's senders handed to their transports, as they count them (a
        rank the plan names for no slice sends none: an MLA latent leaves from one rank)."""
        return Count(sum(s.bytes_sent for s in self.port.senders.values()))

    def _my_slices(self, endpoints: Sequence[str]) -> list[HeadSlice]:
        return [s for s in self._plan(self.size, len(endpoints)) if s.src_rank == self.rank]

    def connect(self, cmd: commands.Connect) -> Done:
        """Handshake with every decode rank this rank sends to (raises what connect raises)."""
        for s in self._my_slices(cmd.endpoints):
            self.port.sender(cmd.endpoints[s.dst_rank], f"{cmd.instance}.{s.dst_rank}")
        return Done()

    def layer_hook(self, ship: commands.ShipKV) -> Callable[[int], None]:
        """What this rank runs after each layer of a step that ships `ship.shipments`."""
        return lambda layer: self.ship_layer(layer, ship.shipments)

    def ship_layer(self, layer: int, shipments: Sequence[commands.Shipment]) -> None:
        """Send this rank's slices of one layer's new pages; a broken connection goes to
        `failed` (the rest of that destination's pages are skipped)."""
        cache = self.caches[layer]
        for ship in shipments:
            if ship.endpoints[0] in self.failed:
                continue
            try:
                for s in self._my_slices(ship.endpoints):
                    heads = range(s.src_offset, s.src_offset + s.count)
                    sender = self.port.senders[ship.endpoints[s.dst_rank]]
                    sid = slice_id(ship.xfer_id, self.rank)
                    sender.send_layer(sid, layer, list(ship.src), list(ship.dst), cache, heads)
            except (*SEND_ERRORS, KeyError) as exc:
                self.failed[ship.endpoints[0]] = str(exc) or type(exc).__name__

    def take_failures(self, _: commands.TakeFailures) -> commands.Failures:
        failed, self.failed = self.failed, {}
        return commands.Failures(failed)

    def done(self, cmd: commands.SendDone) -> Done:
        """End this rank's slices of the transfer, handing over the request's first token."""
        for s in self._my_slices(cmd.endpoints):
            sender = self.port.senders[cmd.endpoints[s.dst_rank]]
            sender.send_done(slice_id(cmd.xfer_id, self.rank), cmd.first)
        return Done()

    def abandon(self, cmd: commands.Abandon) -> Done:
        for s in self._my_slices(cmd.endpoints):
            sender = self.port.senders.get(cmd.endpoints[s.dst_rank])
            if sender is not None:
                sender.abandon(slice_id(cmd.xfer_id, self.rank))
        return Done()

    def drop(self, cmd: commands.Drop) -> Done:
        for endpoint in cmd.endpoints:
            self.port.drop(endpoint)
        return Done()

    def poll_senders(self, _: commands.PollSenders) -> Done:
        self.port.poll()
        return Done()

    def close(self) -> None:
        self.port.close()


class KVGroup:
    """A node's KV connector across its tensor-parallel ranks (held by rank 0): each method
    sends one command to every rank (rank 0's own `RankKV` included) and combines their
    answers. A worker's refusal raises RankCommandError (a RuntimeError, one of SEND_ERRORS)."""

    def __init__(self, local: RankKV, driver: Any) -> None:
        self.local = local
        self.driver = driver  # the engine's RankDriver (None at TP 1)
        self.port = local.port
        self.size = local.size
        self._handlers = local.handlers()
        self.endpoints: tuple[str, ...] = ()
        self._released_on: dict[str, set[int]] = {}  # cancelled xfer id -> ranks that released
        if local.receiver is not None:
            self.endpoints = tuple(r.endpoint for r in self._all(commands.Endpoint()))

    def _all(self, command: RankCommand) -> list[Message]:
        """Every rank's answer to `command`, rank 0's first."""

        def here() -> Message:
            return self._handlers[type(command)](command)

        if self.driver is None:
            return [here()]
        return self.driver.call(commands.KV_RANKS, command, here)

    # -- decode side ----------------------------------------------------------------------------

    def expect(self, xfer_id: str, block_ids: Sequence[int], src_tp: int) -> int:
        """Open transfer `xfer_id` into `block_ids` from a prefill group at TP `src_tp` on
        every rank; how many slices the node waits for."""
        return sum(c.n for c in self._all(commands.Expect(xfer_id, tuple(block_ids), src_tp)))

    def cancel(self, xfer_id: str) -> None:
        self._all(commands.Cancel(xfer_id))

    def finished(self) -> list[commands.SliceDone]:
        """Slices finished on any rank since the last call."""
        return [s for answer in self._all(commands.TakeFinished()) for s in answer.slices]

    def released(self) -> list[str]:
        """Cancelled transfers whose blocks no sender can write on any rank any more (each
        rank names each cancelled transfer once): the node may free them now."""
        for rank, answer in enumerate(self._all(commands.TakeReleased())):
            for xfer_id in answer.xfer_ids:
                self._released_on.setdefault(xfer_id, set()).add(rank)
        out = [x for x, ranks in self._released_on.items() if len(ranks) == self.size]
        for xfer_id in out:
            del self._released_on[xfer_id]
        return out

    def bytes_received(self) -> list[int]:
        """KV bytes written on each rank, rank 0's first."""
        return [c.n for c in self._all(commands.BytesReceived())]

    # -- prefill side ---------------------------------------------------------------------------

    def bytes_sent(self) -> list[int]:
        """KV page bytes each rank's senders sent, rank 0's first."""
        return [c.n for c in self._all(commands.BytesSent())]

    def connect(self, endpoints: Sequence[str], instance: str) -> None:
        """Every rank handshakes with the decode ranks it sends to (a layout mismatch and an
        unreachable decode node raise one of SEND_ERRORS)."""
        self._all(commands.Connect(tuple(endpoints), instance))

    def ship(self, shipments: Sequence[commands.Shipment]) -> LayerCall:
        """The layer hook of a step that ships `shipments`, here and on every worker."""
        ship = commands.ShipKV(tuple(shipments))
        return LayerCall(self.local.layer_hook(ship), ship)

    def take_failures(self) -> dict[str, str]:
        """Decode groups (by rank 0 endpoint) whose sends broke on any rank, and why."""
        failed: dict[str, str] = {}
        for answer in self._all(commands.TakeFailures()):
            failed.update(answer.why)
        return failed

    def done(self, endpoints: Sequence[str], xfer_id: str, first: FirstToken) -> None:
        self._all(commands.SendDone(tuple(endpoints), xfer_id, first))

    def abandon(self, endpoints: Sequence[str], xfer_id: str) -> None:
        self._all(commands.Abandon(tuple(endpoints), xfer_id))

    def drop(self, endpoints: Sequence[str]) -> None:
        self._all(commands.Drop(tuple(endpoints)))

    def poll_senders(self) -> None:
        self._all(commands.PollSenders())

    def close(self) -> None:
        self.local.close()  # the workers' ends close with their processes


class MovesKV:
    """What a node role that moves KV (prefill, decode) adds to `common.node.loop.EngineNode`:
    every rank builds a `RankKV` beside its model runner, and rank 0 holds the `KVGroup`. Here
    and not in common/node, which never imports kv_transfer."""

    rank_agent_class: ClassVar[str | None] = f"{RankKV.__module__}:{RankKV.__name__}"
    kv: KVGroup

    def open_kv(self, options: dict[str, Any]) -> KVGroup:
        runner = self.engine.runner  # type: ignore[attr-defined]  # the EngineNode's
        return KVGroup(RankKV(runner, runner.tp, **options), runner.driver)
