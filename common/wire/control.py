"""A node's control link to the router: one ZMQ DEALER socket carrying protocol messages."""

from __future__ import annotations

import logging

import zmq

from pdserve.common.wire.messages import Message, ProtocolError, decode, encode
from pdserve.common.wire.security import CurveKeys

log = logging.getLogger(__name__)


class ControlClient:
    """Connects to the router's ROUTER socket with the node id as its identity.

    Malformed frames are counted and dropped, never raised into the node loop.
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

    def close(self) -> None:
        self.sock.close(linger=0)
