"""The router's view of the cluster: node registry, routing policies, and the ZMQ backend.

Nodes connect DEALER sockets to the router's ROUTER socket and register; heartbeats carry
their load. A request on the P/D path goes: ReserveKV to a decode node (it allocates the
prompt's blocks or answers Busy), Prefill to a prefill node with the reserved blocks as the
destination; the prefill node streams the first token here and hands the KV to the decode
node, which streams the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from common.block_pool import hash_token_blocks
from common.node import logprobs_from_wire, sampling_to_wire
from common.protocol import (
    Abort,
    Busy,
    CheckIntegrity,
    Error,
    Heartbeat,
    IntegrityReport,
    Message,
    Prefill,
    ProtocolError,
    RegisterNode,
    Reserved,
    ReserveKV,
    SyncPrefixes,
    Tokens,
    decode,
    encode,
)
from router.backend import Backend, GenerateRequest, TokenEvent

log = logging.getLogger(__name__)


@dataclass(slots=True)
class NodeInfo:
    """What the router knows of one node, refreshed by its heartbeats."""

    node_id: str
    role: str
    kv_endpoint: str
    kv_connector: str
    layout_digest: str
    num_blocks: int
    max_model_len: int
    last_seen: float
    free_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    queued_tokens: int = 0
    inflight: int = 0  # requests the router has routed there and not seen finish
    block_size: int = 16
    # Prefix cache as the node reports it (block hash set) plus what the router has sent
    # there since (hash -> expiry time), and prompt tokens sent since its last heartbeat.
    prefixes: set[bytes] = field(default_factory=set)
    prefix_seq: int = 0
    recent_prefixes: dict[bytes, float] = field(default_factory=dict)
    recent_tokens: int = 0

    def load(self) -> tuple[int, int]:
        return (self.inflight + self.num_waiting, -self.free_blocks)

    def apply_heartbeat(self, msg: Heartbeat, now: float) -> bool:
        """Take a heartbeat's load and prefix-cache changes; False when the prefix changes
        have a gap (the view is then empty until the node sends a snapshot)."""
        self.free_blocks, self.num_running = msg.free_blocks, msg.num_running
        self.num_waiting, self.queued_tokens = msg.num_waiting, msg.queued_tokens
        self.recent_tokens = 0  # now counted in queued_tokens
        self.recent_prefixes = {h: t for h, t in self.recent_prefixes.items() if t > now}
        if not msg.prefix_seq:
            return True  # this node does not report its prefix cache
        in_order = msg.prefix_seq == self.prefix_seq + 1
        self.prefix_seq = msg.prefix_seq
        if msg.prefix_reset:
            self.prefixes = set(msg.prefix_stored)
            return True
        if not in_order:
            self.prefixes.clear()
            return False
        self.prefixes.difference_update(msg.prefix_removed)
        self.prefixes.update(msg.prefix_stored)
        return True

    def cached_blocks(self, hashes: list[bytes], now: float) -> int:
        """How many leading blocks of a prompt (its chained block hashes) this node holds or
        is about to hold."""
        n = 0
        for h in hashes:
            if h not in self.prefixes and self.recent_prefixes.get(h, 0.0) <= now:
                break
            n += 1
        return n

    def routed(self, request: GenerateRequest, now: float, ttl: float = 5.0) -> None:
        """A prompt was sent here: count its tokens and expect its blocks to be cached soon."""
        self.recent_tokens += len(request.prompt_token_ids)
        for h in hash_token_blocks(request.prompt_token_ids, self.block_size):
            self.recent_prefixes[h] = now + ttl


Policy = Callable[[list[NodeInfo], GenerateRequest], list[NodeInfo]]


class RoundRobin:
    """Candidates in turn; the rotation is this policy object's own state."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def __call__(self, nodes: list[NodeInfo], _req: GenerateRequest) -> list[NodeInfo]:
        if not nodes:
            return nodes
        start = next(self._turn) % len(nodes)
        ordered = sorted(nodes, key=lambda n: n.node_id)
        return ordered[start:] + ordered[:start]


def least_loaded(nodes: list[NodeInfo], _req: GenerateRequest) -> list[NodeInfo]:
    return sorted(nodes, key=NodeInfo.load)


def prefix_aware(nodes: list[NodeInfo], req: GenerateRequest) -> list[NodeInfo]:
    """Least prefill work first: tokens already queued there plus the prompt tokens it would
    have to compute, i.e. not covered by the leading blocks it caches. A node holding the
    prompt's prefix wins unless its queue outweighs the saving; load breaks ties (decode
    nodes report no prefixes, so for them this is least_loaded)."""
    now = time.monotonic()
    prompt = req.prompt_token_ids
    hashes: dict[int, list[bytes]] = {}  # block size -> the prompt's block hashes

    def work(node: NodeInfo) -> int:
        if node.block_size not in hashes:
            hashes[node.block_size] = hash_token_blocks(prompt, node.block_size)
        hit = node.cached_blocks(hashes[node.block_size], now) * node.block_size
        return node.queued_tokens + node.recent_tokens + len(prompt) - hit

    return sorted(nodes, key=lambda n: (work(n), n.load()))


# Name -> factory, so every backend gets a fresh policy (and its own state).
POLICIES: dict[str, Callable[[], Policy]] = {
    "round_robin": RoundRobin,
    "least_loaded": lambda: least_loaded,
    "prefix_aware": lambda: prefix_aware,
}


@dataclass(slots=True)
class _Stream:
    """Router-side state of one request in flight."""

    queue: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)
    prefill_node: str = ""
    decode_node: str = ""
    got_first: bool = False
    failed: bool = False  # ended by an error or abort: the other node may still hold blocks
    early: list[TokenEvent] = field(default_factory=list)  # decode tokens that beat the first


class ClusterBackend(Backend):
    """Backend over the node registry; one asyncio task receives every node message."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        control_port: int = 8100,
        policy: str = "least_loaded",
        max_model_len: int = 2048,
        heartbeat_timeout: float = 5.0,
        reply_timeout: float = 10.0,
        token_timeout: float = 120.0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {sorted(POLICIES)}")
        self.policy = POLICIES[policy]()
        self.default_max_model_len = max_model_len
        self.heartbeat_timeout = heartbeat_timeout
        self.reply_timeout = reply_timeout
        self.token_timeout = token_timeout
        self.nodes: dict[str, NodeInfo] = {}
        self.streams: dict[str, _Stream] = {}
        self.replies: dict[str, asyncio.Future[Message]] = {}
        self.num_malformed = 0
        self._addr = f"tcp://{host}:{control_port}"
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self._nonce = itertools.count(1)
        self._background: set[asyncio.Task] = set()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 64 * 1024 * 1024)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.bind(self._addr)
        self._task = asyncio.create_task(self._receive_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sock is not None:
            self._sock.close(linger=0)
        self._ctx.term()

    # -- registry --------------------------------------------------------------------------

    def alive(self, roles: tuple[str, ...]) -> list[NodeInfo]:
        cutoff = time.monotonic() - self.heartbeat_timeout
        return [n for n in self.nodes.values() if n.role in roles and n.last_seen >= cutoff]

    @property
    def max_model_len(self) -> int:  # type: ignore[override]
        """The tightest limit among live nodes (every node must be able to hold a request)."""
        lens = [n.max_model_len for n in self.alive(("prefill", "decode", "both"))]
        return min([self.default_max_model_len, *lens])

    async def integrity(self) -> dict[str, dict]:
        """Every live node's block-pool integrity report (for operators and tests)."""
        out = {}
        for node in self.alive(("prefill", "decode", "both")):
            report = await self.check_integrity(node.node_id)
            out[node.node_id] = {"role": node.role, "report": None}
            if report is not None:
                out[node.node_id]["report"] = {
                    "ok": report.ok,
                    "detail": report.detail,
                    "num_blocks": report.num_blocks,
                    "free_blocks": report.free_blocks,
                    "cached_blocks": report.cached_blocks,
                    "live_requests": list(report.live_requests),
                }
        return out

    def ready(self) -> bool:
        if self.alive(("both",)):
            return True
        return bool(self.alive(("prefill",)) and self.alive(("decode",)))

    def stats(self) -> dict[str, float]:
        return {
            "nodes_prefill": len(self.alive(("prefill",))),
            "nodes_decode": len(self.alive(("decode",))),
            "nodes_colocated": len(self.alive(("both",))),
            "requests_in_flight": len(self.streams),
            "malformed_messages": self.num_malformed,
        }

    # -- messages --------------------------------------------------------------------------

    def _spawn(self, coro) -> None:
        """Run a send from synchronous message handling; the task is kept until done."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send(self, node_id: str, msg: Message) -> None:
        assert self._sock is not None, "backend not started"
        try:
            await self._sock.send_multipart([node_id.encode(), encode(msg)])
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY): it will miss heartbeats
            log.warning("send to %s failed: %s", node_id, exc)

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

    def _on_message(self, sender: str, msg: Message) -> None:
        now = time.monotonic()
        if isinstance(msg, RegisterNode):
            self.nodes[sender] = NodeInfo(
                node_id=sender,
                role=msg.role,
                kv_endpoint=msg.kv_endpoint,
                kv_connector=msg.kv_connector,
                layout_digest=msg.layout_digest,
                num_blocks=msg.num_blocks,
                max_model_len=msg.max_model_len,
                last_seen=now,
                free_blocks=msg.num_blocks,
                block_size=msg.block_size,
            )
            return
        node = self.nodes.get(sender)
        if node is not None:
            node.last_seen = now
        if isinstance(msg, Heartbeat) and node is not None:
            if not node.apply_heartbeat(msg, now):
                self._spawn(self._send(sender, SyncPrefixes()))
        elif isinstance(msg, Reserved | Busy):
            self._resolve(msg.request_id, msg)
        elif isinstance(msg, IntegrityReport):
            self._resolve(f"integrity-{msg.nonce}", msg)
        elif isinstance(msg, Tokens):
            self._on_tokens(sender, msg)
        elif isinstance(msg, Error):
            if not self._resolve(msg.request_id, msg):
                self._push(msg.request_id, TokenEvent((), finish_reason="error", error=msg.message))

    def _resolve(self, key: str, msg: Message) -> bool:
        fut = self.replies.pop(key, None)
        if fut is None or fut.done():
            return False
        fut.set_result(msg)
        return True

    def _on_tokens(self, sender: str, msg: Tokens) -> None:
        stream = self.streams.get(msg.request_id)
        if stream is None:
            return  # finished or aborted already
        event = TokenEvent(
            token_ids=msg.token_ids,
            logprobs=logprobs_from_wire(msg.logprobs),
            finish_reason=msg.finish_reason or None,
            cached_tokens=msg.cached_tokens,
        )
        if stream.decode_node == sender and not stream.got_first:
            stream.early.append(event)  # the decode node outran the prefill node's message
            return
        stream.got_first = True
        stream.queue.put_nowait(event)
        for e in stream.early:
            stream.queue.put_nowait(e)
        stream.early.clear()

    def _push(self, request_id: str, event: TokenEvent) -> None:
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(event)

    async def _ask(self, node_id: str, key: str, msg: Message) -> Message | None:
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self.replies[key] = fut
        await self._send(node_id, msg)
        try:
            return await asyncio.wait_for(fut, self.reply_timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            self.replies.pop(key, None)

    async def check_integrity(self, node_id: str) -> IntegrityReport | None:
        nonce = next(self._nonce)
        reply = await self._ask(node_id, f"integrity-{nonce}", CheckIntegrity(nonce))
        return reply if isinstance(reply, IntegrityReport) else None

    # -- requests --------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        rid = request.request_id
        stream = self.streams[rid] = _Stream()
        finished = False
        try:
            error = await self._route(request, stream)
            if error is not None:
                yield TokenEvent((), finish_reason="error", error=error)
                return
            while True:
                try:
                    event = await asyncio.wait_for(stream.queue.get(), self.token_timeout)
                except asyncio.TimeoutError:
                    yield TokenEvent(
                        (), finish_reason="error", error="timed out waiting for tokens"
                    )
                    await self.abort(rid)
                    return
                if event.finish_reason is not None:
                    finished = True
                    stream.failed = event.finish_reason in ("error", "abort")
                yield event
                if finished:
                    return
        finally:
            if not finished or stream.failed:  # free whatever the nodes still hold
                await self._abort_nodes(rid, stream, "stream ended")
            self._release(rid)

    async def _route(self, request: GenerateRequest, stream: _Stream) -> str | None:
        """Send the request on its way; an error message if nothing can take it."""
        sampling = sampling_to_wire(request.sampling)
        colocated = self.policy(self.alive(("both",)), request)
        prefills = self.policy(self.alive(("prefill",)), request)
        decodes = self.policy(self.alive(("decode",)), request)
        if colocated and not (prefills and decodes):
            node = colocated[0]
            stream.prefill_node = node.node_id
            node.inflight += 1
            node.routed(request, time.monotonic())
            await self._send(
                node.node_id, Prefill(request.request_id, request.prompt_token_ids, sampling)
            )
            return None
        if not (prefills and decodes):
            return "no prefill/decode node available"
        reserved = await self._reserve(request, sampling, decodes, stream)
        if reserved is None:
            return "no decode node has room for this request"
        # Picked after the reservation's round trip, so the choice sees requests routed
        # meanwhile (the policy's load and prefix view include them).
        prefills = self.policy(self.alive(("prefill",)), request)
        if not prefills:
            await self._send(stream.decode_node, Abort(request.request_id, "no prefill node"))
            return "no prefill node available"
        prefill = prefills[0]
        stream.prefill_node = prefill.node_id
        prefill.inflight += 1
        prefill.routed(request, time.monotonic())
        await self._send(
            prefill.node_id,
            Prefill(
                request.request_id,
                request.prompt_token_ids,
                sampling,
                xfer_id=reserved.xfer_id,
                dest_block_ids=reserved.block_ids,
                dest_kv_endpoint=reserved.kv_endpoint,
            ),
        )
        return None

    async def _reserve(self, request, sampling, decodes, stream) -> Reserved | None:
        for node in decodes:
            msg = ReserveKV(request.request_id, request.prompt_token_ids, sampling)
            reply = await self._ask(node.node_id, request.request_id, msg)
            if isinstance(reply, Reserved):
                stream.decode_node = node.node_id
                node.inflight += 1
                return reply
            if reply is None:  # no answer in time: make sure it holds nothing for us
                await self._send(node.node_id, Abort(request.request_id, "reserve timed out"))
        return None

    def _release(self, request_id: str) -> None:
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return
        for node_id in (stream.prefill_node, stream.decode_node):
            node = self.nodes.get(node_id)
            if node is not None:
                node.inflight = max(0, node.inflight - 1)

    async def abort(self, request_id: str) -> None:
        stream = self.streams.get(request_id)
        if stream is None:
            return
        await self._abort_nodes(request_id, stream, "client")
        self._push(request_id, TokenEvent((), finish_reason="abort"))

    async def _abort_nodes(self, request_id: str, stream: _Stream, why: str) -> None:
        for node_id in {stream.prefill_node, stream.decode_node} - {""}:
            await self._send(node_id, Abort(request_id, why))


def new_request_id() -> str:
    return uuid.uuid4().hex
