"""A node's standing with its routers, beside the engine loop (`loop.EngineNode`): its control
links (one ZMQ DEALER socket per router, carrying protocol messages) and its membership of the
cluster. Routers share no state: a node registers with each, reports its load to each, and
answers a request on the link it came in on."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import zmq

from pdserve.common.node.config import NodeConfig, is_wildcard
from pdserve.common.process import route_source
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
    decode,
    encode,
)
from pdserve.common.wire.payloads import SpecDecodeCounts, TierCounts
from pdserve.common.wire.security import CurveKeys

log = logging.getLogger(__name__)

# A handler takes the message type it is filed under in the node's table; what it returns (if
# not None) answers the router that sent the message.
Handler = Callable[[Any], Message | None]


@dataclass(frozen=True, slots=True)
class PrefixChanges:
    """The node's prefix-cache index since its last report: the hashes that joined and left
    it, or (reset) the whole index as `stored`."""

    reset: bool
    stored: tuple[bytes, ...]
    removed: tuple[bytes, ...]
    # The same of its host KV tier (whole on a reset), and the blocks it wrote to its store
    # and found gone from it (missed there, or evicted by this node).
    host_stored: tuple[bytes, ...] = ()
    host_removed: tuple[bytes, ...] = ()
    shared_stored: tuple[bytes, ...] = ()
    shared_removed: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """What a heartbeat reports, as the node saw itself when the report was due: its load,
    whether it drains, and its prefix-cache changes (None: it reports no prefixes)."""

    free_blocks: int
    num_running: int
    num_waiting: int
    queued_tokens: int
    draining: bool
    prefill_rate: float
    prefixes: PrefixChanges | None = None
    spec_decode: SpecDecodeCounts | None = None  # None: the node does not speculate
    kv_tiers: tuple[TierCounts, ...] = ()  # its KV tiers' counters (none: no tiers)
    kv_tier_loaded_tokens: int = 0  # prompt tokens loaded from a tier, not recomputed
    busy_seconds: float = 0.0  # in steps that ran work (a decode node's; 0: not reported)


def advertise_host(node: NodeConfig) -> str:
    """The address other hosts reach this node's sockets at: --advertise-host; else --host,
    unless it is a wildcard; then the local address of the route to the first router."""
    if node.advertise_host:
        return node.advertise_host
    if not is_wildcard(node.host):
        return node.host
    host, _, port = node.router_addrs[0].rpartition(":")
    try:
        return route_source(host.strip("[]"), int(port))
    except OSError as exc:  # the router's name does not resolve (yet), no route to it
        raise RuntimeError(
            f"cannot tell which address of this host the router at {node.router_addrs[0]} "
            f"reaches ({exc}): give --advertise-host"
        ) from None


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

    def close(self, linger_ms: int = 0) -> None:
        self.sock.close(linger=linger_ms)


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

    def close(self, linger_ms: int = 0) -> None:
        for link in self.links:
            link.close(linger_ms)


class Membership:
    """One node's membership of the cluster: a control link per router, its registration
    with each (again when a router restarts), heartbeats of the status the node hands it, a
    lease per request renewed only by the router that sent it, and the liveness thread's
    proofs.

    It holds no reference to its node: the node hands it what to announce (`registration`)
    and, at each heartbeat, a `NodeStatus`; it calls the node back only through `live` (for
    the liveness proofs) and `fail` (a router refused the node). Expired leases are returned
    to the node, which frees and fails them."""

    def __init__(
        self,
        config: NodeConfig,
        registration: RegisterNode,
        curve: CurveKeys | None,
        live: Callable[[], bool],
        fail: Callable[[str], None],
    ) -> None:
        self.config = config
        self.registration = registration
        self.curve = curve
        self._live, self._fail = live, fail
        self.ctx = zmq.Context()
        # One link per router; a request is answered on the link it came in on (`owner`).
        node_id = registration.node_id
        self.control = RouterLinks(self.ctx, config.router_addrs, node_id, curve)
        self.owner: dict[str, int] = {}  # request id -> link of the router that sent it
        self.link = 0  # link of the message being handled
        self.accepted: set[int] = set()  # links whose router accepted our registration
        # link -> until when the registration sent there awaits its answer (monotonic)
        self.awaiting: dict[int, float] = {}
        # Every request this node holds has a lease the router renews (Lease messages); one
        # left unrenewed for lease_timeout is freed and failed.
        self.leases: dict[str, float] = {}  # request id -> expiry (monotonic)
        self._next_lease_check = 0.0
        self._next_heartbeat = 0.0
        self.prefix_seq = 0  # number of the last heartbeat that carried prefix changes
        self._stopping = threading.Event()
        self._liveness = threading.Thread(target=self._prove_alive, daemon=True)

    def handlers(self) -> dict[type[Message], Handler]:
        """The control messages about membership, for the node's handler table."""
        return {
            Lease: self.renew_leases,
            Reregister: self.reregister,
            Registered: self.on_registered,
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
        """Announce this node to one router (`link`), or to every router; each answer is
        awaited for up to lease_timeout (a router answers a decode node after probing its KV
        endpoints, within seconds)."""
        links = range(len(self.control.links)) if link is None else (link,)
        until = time.monotonic() + self.config.lease_timeout
        for i in links:
            self.control.send(i, self.registration)
            self.awaiting[i] = until

    def reregister(self, _: Reregister) -> None:
        """A router does not know this node (it restarted): announce it again, unless the
        registration sent there still awaits its answer. The restarted router asks once per
        heartbeat of ours it gets before our registration, and heartbeats queue in the link
        while it is down: answering each ask registered a node about 5 times."""
        if time.monotonic() < self.awaiting.get(self.link, -math.inf):
            return
        self.accepted.discard(self.link)
        self.register(self.link)
        self.report_soon()

    def on_registered(self, msg: Registered) -> None:
        """A router's answer to our registration; a refusal (a KV address it cannot reach)
        is a configuration error: stop the node, naming it."""
        self.awaiting.pop(self.link, None)
        addr = self.control.addrs[self.link]
        if msg.accepted:
            self.accepted.add(self.link)
            log.info("registered with the router at %s", addr)
            return
        self._fail(f"the router at {addr} refused this node: {msg.reason}")

    # -- heartbeats --------------------------------------------------------------------------

    def heartbeat_due(self) -> bool:
        return time.monotonic() >= self._next_heartbeat

    def heartbeat(self, status: NodeStatus) -> None:
        """Report the node's status to every router; the next report is due an interval on."""
        self._next_heartbeat = time.monotonic() + self.config.heartbeat_interval
        self.control.broadcast(
            Heartbeat(
                node_id=self.registration.node_id,
                free_blocks=status.free_blocks,
                num_running=status.num_running,
                num_waiting=status.num_waiting,
                queued_tokens=status.queued_tokens,
                draining=status.draining,
                prefill_rate=status.prefill_rate,
                spec_decode=status.spec_decode,
                kv_tiers=status.kv_tiers,
                kv_tier_loaded_tokens=status.kv_tier_loaded_tokens,
                busy_seconds=status.busy_seconds,
                **self._prefix_fields(status.prefixes),
            )
        )

    def _prefix_fields(self, changes: PrefixChanges | None) -> dict[str, Any]:
        """The heartbeat's prefix-cache fields, numbered so a router sees a gap (none when
        the node reports no prefixes)."""
        if changes is None:
            return {}
        self.prefix_seq += 1
        return dict(
            prefix_seq=self.prefix_seq,
            prefix_reset=changes.reset,
            prefix_stored=changes.stored,
            prefix_removed=changes.removed,
            host_stored=changes.host_stored,
            host_removed=changes.host_removed,
            shared_stored=changes.shared_stored,
            shared_removed=changes.shared_removed,
        )

    def report_soon(self) -> None:
        """Send the next heartbeat at the next chance rather than on schedule."""
        self._next_heartbeat = 0.0

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

    def lease_check_due(self) -> bool:
        """Whether leases are due a look (a few times per lease_timeout, at most every 0.5 s)."""
        now = time.monotonic()
        if now < self._next_lease_check:
            return False
        self._next_lease_check = now + min(0.5, self.config.lease_timeout / 4)
        return True

    def lapsed(self) -> bool:
        """Whether some lease ran out (renewals may still wait in the links)."""
        now = time.monotonic()
        return any(expiry < now for expiry in self.leases.values())

    def expire_leases(self, live: Collection[str]) -> list[str]:
        """The requests whose lease ran out, for the node to free and fail; leases and owners
        of requests the node no longer holds (`live`: those it does) are forgotten."""
        now = time.monotonic()
        expired = []
        for rid, expiry in list(self.leases.items()):
            if rid not in live:
                del self.leases[rid]
            elif expiry < now:
                expired.append(rid)
        for rid in [r for r in self.owner if r not in live and r not in self.leases]:
            del self.owner[rid]
        return expired

    # -- liveness ----------------------------------------------------------------------------

    def start(self) -> None:
        """Register with every router and start proving liveness."""
        self.register()
        self._liveness.start()

    def _prove_alive(self) -> None:
        """Liveness thread: tell every router this node lives every heartbeat interval, as long
        as the node says its loop moved within stall_timeout (a wedged loop goes silent, and
        fails over)."""
        node_id = self.registration.node_id
        socks = []
        for addr in self.control.addrs:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, (node_id + ALIVE_SUFFIX).encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 4)
            if self.curve is not None:
                self.curve.connect(sock)
            sock.connect(f"tcp://{addr}")
            socks.append(sock)
        frame = encode(Alive(node_id))
        try:
            while not self._stopping.wait(self.config.heartbeat_interval):
                if self._live():
                    for sock in socks:
                        with contextlib.suppress(zmq.Again):
                            sock.send(frame, flags=zmq.NOBLOCK)
        finally:
            for sock in socks:
                sock.close(linger=0)

    def close(self, linger_ms: int = 0) -> None:
        """End the liveness thread, close every link (`linger_ms`: how long what is still
        queued may take to leave; 0: dropped)."""
        self._stopping.set()
        if self._liveness.is_alive():
            self._liveness.join(timeout=5.0)
        self.control.close(linger_ms)
        self.ctx.term()
