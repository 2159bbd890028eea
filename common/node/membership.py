"""A node's standing with its routers, beside the engine loop (`loop.EngineNode`): its control
links (one ZMQ DEALER socket per router, carrying protocol messages) and its membership of the
cluster. Routers share no state: a node registers with each, reports its load to each, and
answers a request on the link it came in on."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import zmq

from pdserve.common.wire.messages import (
    ALIVE_SUFFIX,
    Alive,
    Error,
    Failure,
    Heartbeat,
    Lease,
    Message,
    ProtocolError,
    Registered,
    RegisterNode,
    Reregister,
    SyncPrefixes,
    decode,
    encode,
)
from pdserve.common.wire.security import CurveKeys

if TYPE_CHECKING:
    from pdserve.common.node.loop import EngineNode, Handler

log = logging.getLogger(__name__)


class ControlClient:
    """Connects to the router's ROUTER socket with the node id as its identity.

    Malformed frames are counted and dropped, never raised into the node loop; one that names
    its request (bad sampling parameters) fails that request with a bad-request Error, so the
    router answers its client at once instead of at the token timeout.
    """

    def __init__(
        self, ctx: zmq.Context, router_addr: str, node_id: str, curve: CurveKeys | None = None
    ) -> None:
        self.node_id = node_id
        self.router_addr = router_addr
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, node_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 64 * 1024 * 1024)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.curve = curve
        if curve is not None:
            curve.connect(self.sock)
        self.sock.connect(f"tcp://{router_addr}")
        self.num_malformed = 0

    def send(self, msg: Message) -> None:
        self.sock.send(encode(msg), flags=zmq.NOBLOCK)

    def recv(self, timeout_ms: int) -> list[Message]:
        """Every message that arrives within timeout_ms (at least one wait)."""
        out: list[Message] = []
        if not self.sock.poll(timeout_ms):
            return out
        while True:
            try:
                frame = self.sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(decode(frame))
            except ProtocolError as exc:
                self.num_malformed += 1
                log.warning("dropped malformed control message: %s", exc)
                if exc.request_id:
                    self.send(Error(exc.request_id, str(exc), Failure.BAD_REQUEST))

    def close(self) -> None:
        self.sock.close(linger=0)


class RouterLinks:
    """One ControlClient per router address; links are numbered in the order given."""

    def __init__(
        self,
        ctx: zmq.Context,
        router_addrs: tuple[str, ...],
        node_id: str,
        curve: CurveKeys | None = None,
    ) -> None:
        self.links = [ControlClient(ctx, addr, node_id, curve) for addr in router_addrs]
        self._poller = zmq.Poller()
        for link in self.links:
            self._poller.register(link.sock, zmq.POLLIN)

    @property
    def addrs(self) -> list[str]:
        return [link.router_addr for link in self.links]

    def send(self, link: int, msg: Message) -> None:
        self.links[link].send(msg)

    def broadcast(self, msg: Message) -> None:
        for link in self.links:
            link.send(msg)

    def recv(self, timeout_ms: int) -> list[tuple[int, Message]]:
        """Every message that arrives on any link within timeout_ms, with its link number."""
        if len(self.links) == 1:
            return [(0, msg) for msg in self.links[0].recv(timeout_ms)]
        if not self._poller.poll(timeout_ms):
            return []
        return [(i, msg) for i, link in enumerate(self.links) for msg in link.recv(0)]

    def close(self) -> None:
        for link in self.links:
            link.close()


class Membership:
    """One node's membership of the cluster: a control link per router, its registration
    with each (again when a router restarts), heartbeats with the load report (and the health
    gauges), a lease per request renewed only by the router that sent it, and the liveness
    thread's proofs. The node's engine, drain state and role hooks (`abort`, `publish_gauges`,
    `handle`, `live`) are read through `node`."""

    def __init__(self, node: EngineNode, curve: CurveKeys | None) -> None:
        self.node = node
        self.config = node.config
        self.curve = curve
        self.ctx = zmq.Context()
        # One link per router; a request is answered on the link it came in on (`owner`).
        self.control = RouterLinks(self.ctx, self.config.router_addrs, node.node_id, curve)
        self.owner: dict[str, int] = {}  # request id -> link of the router that sent it
        self.link = 0  # link of the message being handled
        self.accepted: set[int] = set()  # links whose router accepted our registration
        # Every request this node holds has a lease the router renews (Lease messages); one
        # left unrenewed for lease_timeout is freed and failed.
        self.leases: dict[str, float] = {}  # request id -> expiry (monotonic)
        self._next_lease_check = 0.0
        self._next_heartbeat = 0.0
        self._prefix_seq = 0
        self._liveness = threading.Thread(target=self._prove_alive, daemon=True)

    def handlers(self) -> dict[type[Message], Handler]:
        """The control messages about membership, for the node's handler table."""
        return {
            Lease: self.renew_leases,
            Reregister: self.reregister,
            Registered: self.on_registered,
            SyncPrefixes: self.resync_prefixes,
        }

    # -- links -------------------------------------------------------------------------------

    def reply(self, msg: Message) -> None:
        """Answer the router whose message is being handled."""
        self.control.send(self.link, msg)

    def tell(self, request_id: str, msg: Message) -> None:
        """Send a message about a request to the router that sent the request."""
        link = self.owner.get(request_id)
        if link is None:  # not ours (any more): every router ignores an id it does not know
            self.control.broadcast(msg)
        else:
            self.control.send(link, msg)

    # -- registration ------------------------------------------------------------------------

    def register(self, link: int | None = None) -> None:
        """Announce this node to one router (`link`), or to every router."""
        node = self.node
        kv = node.kv
        port = kv.port if kv is not None else None
        msg = RegisterNode(
            node_id=node.node_id,
            role=node.role,
            kv_endpoints=kv.endpoints if kv is not None else (),
            kv_connector=port.connector if port else "",
            layout_digest=port.digest if port else "",
            num_blocks=node.engine.runner.num_blocks,
            block_size=node.block_size,
            max_model_len=node.engine.max_model_len,
            incarnation=node.incarnation,
            host_id=port.host_id if port else "",
            kv_layout=port.layout if port else None,
            tp_size=node.config.tensor_parallel_size,
        )
        if link is None:
            self.control.broadcast(msg)
        else:
            self.control.send(link, msg)

    def reregister(self, _: Reregister) -> None:
        """A router restarted: announce ourselves to it again."""
        self.accepted.discard(self.link)
        self.register(self.link)
        self.heartbeat_now()

    def on_registered(self, msg: Registered) -> None:
        """A router's answer to our registration; a refusal (a KV address it cannot reach)
        is a configuration error: stop the node, naming it."""
        addr = self.control.addrs[self.link]
        if msg.accepted:
            self.accepted.add(self.link)
            log.info("registered with the router at %s", addr)
            return
        self.node.fail(f"the router at {addr} refused this node: {msg.reason}")

    # -- heartbeats --------------------------------------------------------------------------

    def heartbeat(self) -> None:
        """Report load (and prefix-cache changes) to every router, once per interval."""
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.config.heartbeat_interval
        node, engine = self.node, self.node.engine
        sched = engine.scheduler
        queued = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
        if node.health is not None:
            node.publish_gauges(queued)
        self.control.broadcast(
            Heartbeat(
                node_id=node.node_id,
                free_blocks=engine.kv.num_free_blocks,
                num_running=len(sched.running),
                num_waiting=len(sched.waiting),
                queued_tokens=queued,
                draining=node.drain_deadline is not None,
                prefill_rate=engine.prefill_rate.tokens_per_s,
                **self._prefix_changes(),
            )
        )

    def _prefix_changes(self) -> dict[str, Any]:
        """The heartbeat's prefix-cache fields: changes since the last one (none when the
        node reports no prefixes)."""
        pool = self.node.engine.kv.pool
        if pool.prefix_events is None:
            return {}
        reset, stored, removed = pool.prefix_events.drain(pool.cached)
        self._prefix_seq += 1
        return dict(
            prefix_seq=self._prefix_seq,
            prefix_reset=reset,
            prefix_stored=stored,
            prefix_removed=removed,
        )

    def report_soon(self) -> None:
        """Send the next heartbeat at the next chance rather than on schedule."""
        self._next_heartbeat = 0.0

    def heartbeat_now(self) -> None:
        self.report_soon()
        self.heartbeat()

    def resync_prefixes(self, _: SyncPrefixes) -> None:
        pool = self.node.engine.kv.pool
        if pool.prefix_events is not None:
            pool.prefix_events.resync()
            self.report_soon()  # send the snapshot now

    # -- leases ------------------------------------------------------------------------------

    def take_lease(self, request_id: str) -> None:
        """The request is held here for the router that sent it, which renews its lease."""
        self.leases[request_id] = time.monotonic() + self.config.lease_timeout
        self.owner[request_id] = self.link

    def drop_lease(self, request_id: str) -> None:
        self.leases.pop(request_id, None)

    def renew_leases(self, msg: Lease) -> None:
        """A router renews the requests it sent (a router's leases are its own: requests of a
        router that died expire here)."""
        expiry = time.monotonic() + self.config.lease_timeout
        for rid in msg.request_ids:
            if rid in self.leases and self.owner.get(rid) == self.link:
                self.leases[rid] = expiry

    def expire_leases(self) -> None:
        """Fail and free requests whose lease ran out; forget leases of ended requests."""
        now = time.monotonic()
        if now < self._next_lease_check:
            return
        self._next_lease_check = now + min(0.5, self.config.lease_timeout / 4)
        node = self.node
        live = node.engine.scheduler.requests
        if any(expiry < now for expiry in self.leases.values()):
            # Renewals may be waiting in the socket after a long step: take them first.
            for link, msg in self.control.recv(0):
                node.handle(msg, link)
        for rid, expiry in list(self.leases.items()):
            if rid not in live:
                del self.leases[rid]
            elif expiry < now:
                log.warning("lease of request %s expired: freeing it", rid)
                node.abort(rid)
                why = "lease expired: the router stopped renewing"
                self.tell(rid, Error(rid, why, Failure.LEASE_EXPIRED))
        for rid in [r for r in self.owner if r not in live and r not in self.leases]:
            del self.owner[rid]

    # -- liveness ----------------------------------------------------------------------------

    def start(self) -> None:
        """Register with every router and start proving liveness."""
        self.register()
        self._liveness.start()

    def _prove_alive(self) -> None:
        """Liveness thread: tell every router this node lives every heartbeat interval, as long
        as the loop moved within stall_timeout (a wedged loop goes silent, and fails over)."""
        socks = []
        for addr in self.control.addrs:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, (self.node.node_id + ALIVE_SUFFIX).encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 4)
            if self.curve is not None:
                self.curve.connect(sock)
            sock.connect(f"tcp://{addr}")
            socks.append(sock)
        frame = encode(Alive(self.node.node_id))
        try:
            while not self.node.stop_event.wait(self.config.heartbeat_interval):
                if self.node.live():
                    for sock in socks:
                        with contextlib.suppress(zmq.Again):
                            sock.send(frame, flags=zmq.NOBLOCK)
        finally:
            for sock in socks:
                sock.close(linger=0)

    def close(self) -> None:
        """After the node's stop_event is set: end the liveness thread, close every link."""
        if self._liveness.is_alive():
            self._liveness.join(timeout=5.0)
        self.control.close()
        self.ctx.term()
