"""The router's end of the control plane: one ROUTER socket that every node's DEALER connects
to (only nodes holding the cluster's keys, with CurveZMQ). It sends, receives (each well-formed
message is handed on; malformed ones are counted and dropped), and matches replies to the asks
waiting for them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import zmq
import zmq.asyncio

from pdserve.common.wire.messages import Message, ProtocolError, decode, encode
from pdserve.common.wire.security import CurveKeys, admit_cluster_keys, stop_admitting

log = logging.getLogger(__name__)


class ControlServer:
    """The ROUTER socket at addr. on_message(sender, msg) gets every decoded message;
    on_unreachable(node_id) is told when a send finds its peer gone."""

    def __init__(
        self,
        addr: str,
        curve: CurveKeys | None,
        reply_timeout: float,
        on_message: Callable[[str, Message], None],
        on_unreachable: Callable[[str], None],
    ) -> None:
        self.reply_timeout = reply_timeout
        self.replies: dict[str, asyncio.Future[Message | None]] = {}
        self.num_malformed = 0
        self._addr = addr
        self._curve = curve
        self._on_message = on_message
        self._on_unreachable = on_unreachable
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 64 * 1024 * 1024)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self._curve is not None:  # only nodes holding the cluster's keys get through
            admit_cluster_keys(self._ctx, self._curve)
            self._curve.serve(self._sock)
        self._sock.bind(self._addr)
        self._receiver = asyncio.create_task(self._receive_loop())

    async def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
        if self._sock is not None:
            self._sock.close(linger=0)
        stop_admitting(self._ctx)
        self._ctx.term()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a send from synchronous message handling; the task is kept until done."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def send(self, node_id: str, msg: Message) -> None:
        assert self._sock is not None, "backend not started"
        try:
            await self._sock.send_multipart([node_id.encode(), encode(msg)])
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY): treat it as dead now
            log.warning("send to %s failed: %s", node_id, exc)
            self._on_unreachable(node_id)

    async def ask(self, node_id: str, key: str, msg: Message) -> Message | None:
        """Send msg and wait for the reply that node sends under key (None on timeout)."""
        key = f"{node_id}/{key}"
        fut: asyncio.Future[Message | None] = asyncio.get_running_loop().create_future()
        self.replies[key] = fut
        await self.send(node_id, msg)
        try:
            return await asyncio.wait_for(fut, self.reply_timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            self.replies.pop(key, None)

    def abandon(self, node_ids: set[str]) -> None:
        """Answer None now to every ask waiting on these nodes (they were taken for dead): a
        request asking a killed node fails over at once, not after the reply timeout."""
        for key, fut in list(self.replies.items()):
            if key.split("/", 1)[0] in node_ids and not fut.done():
                fut.set_result(None)

    def resolve(self, key: str, msg: Message) -> bool:
        """Hand msg to the ask waiting under key; False when none waits (a late reply)."""
        fut = self.replies.pop(key, None)
        if fut is None or fut.done():
            return False
        fut.set_result(msg)
        return True

    async def _receive_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2:
                self.num_malformed += 1
                continue
            try:
                msg = decode(frames[1])
            except ProtocolError as exc:
                self.num_malformed += 1
                log.warning("malformed message from a node: %s", exc)
                continue
            self._on_message(frames[0].decode(errors="replace"), msg)
