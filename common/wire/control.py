"""A node's control links to its routers: one ZMQ DEALER socket per router, carrying protocol
messages. Routers share no state: a node registers with each, reports its load to each, and
answers a request on the link it came in on."""

from __future__ import annotations

import logging

import zmq

from pdserve.common.wire.messages import (
    Error,
    Failure,
    Message,
    ProtocolError,
    decode,
    encode,
)
from pdserve.common.wire.security import CurveKeys

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
