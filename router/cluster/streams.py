"""What the router has in flight with its nodes: the control socket with the asks waiting on it,
and the requests' streams it feeds.

`ControlServer` is the router's end of the control plane: one ROUTER socket that every node's
DEALER connects to (only nodes holding the cluster's keys, with CurveZMQ). It sends, receives
(each well-formed message is handed on; malformed ones are counted and dropped), and matches
replies to the asks waiting for them. A request in flight is one `Stream` (its state, its
prompt's block hashes, the failover note that re-routes it), and `RequestTable` is the one
owner of where every request runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from pdserve.common.engine.kv_cache_manager import BlockHash, extend_block_hashes
from pdserve.common.wire.messages import (
    Error,
    Failure,
    Message,
    ProtocolError,
    Tokens,
    decode,
    encode,
)
from pdserve.common.wire.security import CurveKeys, admit_cluster_keys, stop_admitting
from pdserve.router.backend import GenerateRequest
from pdserve.router.cluster.registry import NodeRegistry
from pdserve.router.cluster.timing import RequestTrace

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


class BlockHashes:
    """The chained block hashes of one request's tokens (its prompt, then the tokens streamed to
    its client), each block hashed once per request and block size: routing, placement, the
    policies and the conversation's expected cache all read them from here. The nodes hash for
    their own prefix index: a router's hashes are never trusted there."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens  # the stream's own list, which only grows
        self._chains: dict[int, list[BlockHash]] = {}  # block size -> hashes so far

    def __len__(self) -> int:
        return len(self.tokens)

    def of(self, block_size: int, num_tokens: int | None = None) -> list[BlockHash]:
        """Hashes of the full blocks among the first num_tokens tokens (default: all)."""
        n = len(self.tokens) if num_tokens is None else num_tokens
        chain = self._chains.setdefault(block_size, [])
        return extend_block_hashes(chain, self.tokens, block_size, n)[: n // block_size]


async def get_within(queue: asyncio.Queue, timeout: float) -> Any:
    """`queue.get()` bounded by `timeout` (asyncio.TimeoutError past it). An item already
    waiting is taken at once: no timer and no task per item, which a streamed token would
    otherwise cost twice on its way through the router."""
    try:
        return queue.get_nowait()
    except asyncio.QueueEmpty:
        return await asyncio.wait_for(queue.get(), timeout)


@dataclass(frozen=True, slots=True)
class Failover:
    """Queued into a stream when a node it depends on died, stalled or refused it.

    kind "prefill": only the prefill node is lost and no token reached the client yet, so the
    decode node keeps its reservation and another prefill node fills it. kind "resume": run the
    rest elsewhere from the prompt plus the tokens already streamed.
    """

    kind: str
    lost: tuple[str, ...]  # node ids not to route this request to again
    detached: tuple[str, ...]  # node ids the request left (each gets an Abort)
    why: str
    # A few words for the failover counter's label (`why` names nodes: unbounded): "node_gone",
    # "node_restarted", or the Failure kind of the node's error ("busy", "kv_failed", ...).
    cause: str = "node_error"


@dataclass(slots=True)
class Stream:
    """Router-side state of one request in flight. Its queue holds the nodes' messages as
    decoded (the HTTP layer consumes them as they are), and failover notes.

    Where it runs (prefill_node, decode_node, admitted, local_prefill), the nodes it must not
    go back to (lost) and its attempt are changed by the RequestTable only."""

    request: GenerateRequest
    queue: asyncio.Queue[Tokens | Error | Failover] = field(default_factory=asyncio.Queue)
    tokens: list[int] = field(init=False)  # the prompt, then every token handed to the client
    hashes: BlockHashes = field(init=False)  # of tokens
    prefill_node: str = ""
    decode_node: str = ""
    admitted: bool = False  # the decode node has the whole KV: the prefill node is done
    local_prefill: bool = False  # prefilled on its decode node, first token not yet seen
    lost: set[str] = field(default_factory=set)  # nodes this request left behind
    attempt: int = 0  # bumped when the request starts over on other nodes
    got_first: bool = False
    early: list[Tokens] = field(default_factory=list)  # decode tokens that beat the first
    failed: bool = False  # ended by an error or abort: the other node may still hold blocks
    failovers: int = 0
    first_at: float = 0.0  # when the prefill node's first token came (0: not yet)
    trace: RequestTrace = field(init=False)  # its spans (none unless the backend traces)

    def __post_init__(self) -> None:
        self.tokens = list(self.request.prompt_token_ids)
        self.hashes = BlockHashes(self.tokens)
        self.trace = RequestTrace(None, self.request, "")

    @property
    def wire_id(self) -> str:
        """The id nodes know this attempt by: late messages of an earlier attempt (even from
        the same node) can never be taken for this one's."""
        rid = self.request.request_id
        return rid if self.attempt == 0 else f"{rid}~{self.attempt}"

    @property
    def generated(self) -> tuple[int, ...]:
        """The tokens handed to the client so far."""
        return tuple(self.tokens[len(self.request.prompt_token_ids) :])

    def nodes(self) -> set[str]:
        return {self.prefill_node, self.decode_node} - {""}


def left_behind(stream: Stream, sender: str, kind: Failure) -> set[str] | None:
    """The nodes a node's error makes the request leave for good (an empty set: retry anywhere),
    or None when the error ends the request."""
    if kind.elsewhere:  # full or shutting down: others carry the request on
        return {sender}
    if kind is Failure.KV_FAILED and sender == stream.decode_node:
        # The KV arrived damaged or incomplete: nothing was decoded from it; retry anywhere.
        return set()
    if kind is Failure.KV_FAILED and sender == stream.prefill_node:
        # The prefill node could not reach the decode node (nixl and nccl see a dead peer at
        # once): retry without that decode node, before the heartbeats tell.
        return {stream.decode_node} - {""}
    return None


class RequestTable:
    """Every request in flight on this router and where it runs: the one owner of placement,
    failover exclusions and attempts. What nodes count in flight (NodeInfo.inflight and
    local_prefills, written here only) and the leases to renew are derived from it; the
    registry stays the owner of what the nodes report."""

    def __init__(self, registry: NodeRegistry) -> None:
        self.registry = registry
        self._streams: dict[str, Stream] = {}  # by the client-facing request id
        self._by_wire: dict[str, Stream] = {}  # by the id of the current attempt
        self._held: dict[str, dict[str, Stream]] = {}  # node id -> its requests by client id
        self._local: dict[str, set[str]] = {}  # decode node id -> its local prefills' ids

    # -- lookups ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._streams)

    def get(self, request_id: str) -> Stream | None:
        return self._streams.get(request_id)

    def held_by(self, node_id: str, wire_id: str) -> Stream | None:
        """The request a node's message names, while that node holds it (None: it ended, or
        moved on without that node, or it is an earlier attempt: the message is stale)."""
        stream = self._by_wire.get(wire_id)
        return stream if stream is not None and node_id in stream.nodes() else None

    def on_node(self, node_id: str) -> list[Stream]:
        return list(self._held.get(node_id, {}).values())

    def leases(self, node_ids: Iterable[str]) -> dict[str, tuple[str, ...]]:
        """For each node, the ids (of the current attempts) of the requests it holds for this
        router: what its lease renewal lists."""
        return {n: tuple(s.wire_id for s in self.on_node(n)) for n in node_ids}

    # -- a request's life ------------------------------------------------------------------

    def open(self, request: GenerateRequest) -> Stream:
        rid = request.request_id
        assert rid not in self._streams, f"request {rid} is in flight already"
        stream = self._streams[rid] = self._by_wire[rid] = Stream(request)
        return stream

    def close(self, request_id: str) -> None:
        """Forget a request that ended: the nodes it was on count it no more."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._by_wire.pop(stream.wire_id, None)
            self._detach(stream, stream.nodes())

    def place_prefill(self, stream: Stream, node_id: str, local: bool = False) -> None:
        """The request's prefill (the whole request on a colocated node) runs on node_id;
        `local`: a decode node's own prefill, counted apart from its decoding requests until
        the first token."""
        assert not stream.prefill_node, f"{stream.wire_id} is on {stream.prefill_node} already"
        stream.prefill_node = node_id
        stream.local_prefill = local
        if local:
            self._local.setdefault(node_id, set()).add(stream.request.request_id)
        self._hold(stream, node_id)

    def place_decode(self, stream: Stream, node_id: str) -> None:
        assert not stream.decode_node, f"{stream.wire_id} is on {stream.decode_node} already"
        stream.decode_node = node_id
        self._hold(stream, node_id)

    def prefilled(self, stream: Stream) -> None:
        """A request prefilled on its decode node is past its prefill (its first token came,
        or it left the node): it counts as one of the node's decoding requests from now."""
        if stream.local_prefill:
            stream.local_prefill = False
            self._local.get(stream.prefill_node, set()).discard(stream.request.request_id)
            self._count(stream.prefill_node)

    def deliver(self, sender: str, msg: Tokens, now: float) -> None:
        """Tokens from a node, to the client in order: a decode node's tokens wait for the
        prefill node's first one. Tokens from a node the request left are dropped."""
        stream = self.held_by(sender, msg.request_id)
        if stream is None:
            return
        if stream.decode_node == sender and not stream.got_first:
            stream.early.append(msg)  # the decode node outran the prefill node's message
            return
        if not stream.got_first and sender == stream.prefill_node and stream.decode_node:
            stream.first_at = now
        self.prefilled(stream)
        stream.got_first = True
        stream.queue.put_nowait(msg)
        for early in stream.early:
            stream.queue.put_nowait(early)
        stream.early.clear()

    def admitted(self, sender: str, wire_id: str, now: float) -> float | None:
        """The decode node holds the whole KV (the prefill node is done): seconds since the
        prefill node's first token (the hand-off's time), or None."""
        stream = self._by_wire.get(wire_id)
        if stream is None or stream.decode_node != sender:
            return None
        stream.admitted = True
        return now - stream.first_at if stream.first_at else None

    # -- failover --------------------------------------------------------------------------

    def fail_over(
        self,
        stream: Stream,
        lost: set[str],
        why: str,
        exclude: bool = True,
        cause: str = "node_error",
    ) -> None:
        """Detach the request from lost nodes at once (later messages from them are ignored),
        never route it to them again (unless not `exclude`), and let its generator re-route
        it: a lost prefill node alone before the first token keeps the decode node's
        reservation; anything else starts over (a decode node that holds the whole KV is
        decoding already: its reservation cannot take another prefill)."""
        only_prefill = (
            lost == {stream.prefill_node}
            and not stream.got_first
            and not stream.admitted
            and bool(stream.decode_node)
        )
        detached = lost if only_prefill else stream.nodes()
        self._detach(stream, detached)
        excluded = lost if exclude else set()
        stream.lost |= excluded
        kind = "prefill" if only_prefill else "resume"
        stream.queue.put_nowait(Failover(kind, tuple(excluded), tuple(detached), why, cause))

    def fail_dead(self, alive: set[str]) -> None:
        """Fail over every request that depends on a node missing its heartbeats: its decode
        node, or its prefill node until the decode node holds the whole KV and the prefill
        node's first token came (the decode node's tokens wait for that one: a prefill node
        dead between the two would leave the request waiting for a token that never comes)."""
        dead = [n for n, held in self._held.items() if held and n not in alive]
        streams = {s.request.request_id: s for n in dead for s in self.on_node(n)}
        for stream in streams.values():
            done = stream.admitted and stream.got_first  # the prefill node's part is over
            lost = {
                n
                for n in stream.nodes()
                if n not in alive and (n == stream.decode_node or not done)
            }
            if lost:
                self.fail_over(stream, lost, f"{', '.join(sorted(lost))} gone", cause="node_gone")

    def node_restarted(self, node_id: str) -> None:
        """A new process under a known node id holds nothing the old one held: what it held
        fails over now (the new process may take the retry)."""
        for stream in self.on_node(node_id):
            why = f"{node_id} restarted"
            self.fail_over(stream, {node_id}, why, exclude=False, cause="node_restarted")

    def restart(self, stream: Stream) -> None:
        """Start the request over under a new attempt id (late messages of the old attempt
        are ignored): detached from every node, waiting for a first token again."""
        self._detach(stream, stream.nodes())
        stream.got_first = False
        stream.early.clear()
        self._by_wire.pop(stream.wire_id, None)
        stream.attempt += 1
        self._by_wire[stream.wire_id] = stream

    # -- counts ----------------------------------------------------------------------------

    def _hold(self, stream: Stream, node_id: str) -> None:
        self._held.setdefault(node_id, {})[stream.request.request_id] = stream
        self._count(node_id)

    def _detach(self, stream: Stream, node_ids: set[str]) -> None:
        if stream.prefill_node in node_ids:
            self.prefilled(stream)
            stream.prefill_node = ""
        if stream.decode_node in node_ids:
            stream.decode_node = ""
            stream.admitted = False
        for node_id in node_ids:
            self._held.get(node_id, {}).pop(stream.request.request_id, None)
            self._count(node_id)

    def _count(self, node_id: str) -> None:
        """The node's in-flight counts, as this table has them."""
        node = self.registry.get(node_id)
        if node is not None:
            node.inflight = len(self._held.get(node_id, ()))
            node.local_prefills = len(self._local.get(node_id, ()))
