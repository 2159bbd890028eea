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
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from pdserve.common.engine.block_pool import hash_token_blocks
from pdserve.common.wire.codecs import logprobs_from_wire, sampling_to_wire
from pdserve.common.wire.messages import (
    ALIVE_SUFFIX,
    Abort,
    Admitted,
    Alive,
    Busy,
    CheckIntegrity,
    Error,
    Failure,
    Heartbeat,
    IntegrityReport,
    Lease,
    Message,
    Prefill,
    ProtocolError,
    RegisterNode,
    RenewTransfer,
    Reregister,
    Reserved,
    ReserveKV,
    SyncPrefixes,
    Tokens,
    decode,
    encode,
)
from pdserve.common.wire.security import admit_cluster_keys, load_keys, stop_admitting
from pdserve.router.backend import Backend, GenerateRequest, TokenEvent

log = logging.getLogger(__name__)

NODE_ROLES = ("prefill", "decode", "both")


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
    draining: bool = False  # shutting down: takes no new requests
    incarnation: str = ""  # the node process's random start id (a restart changes it)

    def load(self) -> tuple[int, int]:
        return (self.inflight + self.num_waiting, -self.free_blocks)

    def apply_heartbeat(self, msg: Heartbeat, now: float) -> bool:
        """Take a heartbeat's load and prefix-cache changes; False when the prefix changes
        have a gap (the view is then empty until the node sends a snapshot)."""
        self.free_blocks, self.num_running = msg.free_blocks, msg.num_running
        self.num_waiting, self.queued_tokens = msg.num_waiting, msg.queued_tokens
        self.recent_tokens = 0  # now counted in queued_tokens
        self.draining = msg.draining
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

    def routed(
        self, request: GenerateRequest, now: float, ttl: float = 5.0, prefixes: bool = True
    ) -> None:
        """A prompt was sent here: count its tokens and (when the policy reads them) expect
        its blocks to be cached soon."""
        prompt = request.prompt_token_ids
        if not prefixes:
            self.recent_tokens += len(prompt)
            return
        hashes = hash_token_blocks(prompt, self.block_size)
        # Queued work is what it must compute: the prompt less the leading blocks it holds.
        self.recent_tokens += len(prompt) - self.cached_blocks(hashes, now) * self.block_size
        for h in hashes:
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


@dataclass(frozen=True, slots=True)
class _Failover:
    """Queued into a stream when a node it depends on died, stalled or refused it.

    kind "prefill": only the prefill node is lost and no token reached the client yet, so the
    decode node keeps its reservation and another prefill node fills it. kind "resume": run the
    rest elsewhere from the prompt plus the tokens already streamed.
    """

    kind: str
    lost: tuple[str, ...]  # node ids not to route this request to again
    detached: tuple[str, ...]  # node ids the request left (each gets an Abort)
    why: str


@dataclass(slots=True)
class _Stream:
    """Router-side state of one request in flight."""

    request: GenerateRequest
    queue: asyncio.Queue[TokenEvent | _Failover] = field(default_factory=asyncio.Queue)
    prefill_node: str = ""
    decode_node: str = ""
    got_first: bool = False
    admitted: bool = False  # the decode node has the whole KV: the prefill node is done
    failed: bool = False  # ended by an error or abort: the other node may still hold blocks
    early: list[TokenEvent] = field(default_factory=list)  # decode tokens that beat the first
    generated: list[int] = field(default_factory=list)  # tokens handed to the client
    failovers: int = 0
    attempt: int = 0  # bumped when the request starts over on other nodes
    lost: set[str] = field(default_factory=set)  # nodes this request left behind

    @property
    def wire_id(self) -> str:
        """The id nodes know this attempt by: late messages of an earlier attempt (even from
        the same node) can never be taken for this one's."""
        rid = self.request.request_id
        return rid if self.attempt == 0 else f"{rid}~{self.attempt}"

    def nodes(self) -> set[str]:
        return {self.prefill_node, self.decode_node} - {""}


class ClusterBackend(Backend):
    """Backend over the node registry; one asyncio task receives every node message, another
    renews leases and watches for dead nodes."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        control_port: int = 8100,
        policy: str = "least_loaded",
        max_model_len: int = 2048,
        heartbeat_timeout: float = 5.0,
        reply_timeout: float = 10.0,
        token_timeout: float = 120.0,
        lease_interval: float = 1.0,
        max_failovers: int = 3,
        reserve_wait: float = 10.0,
        curve_dir: str | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {sorted(POLICIES)}")
        self.policy = POLICIES[policy]()
        self.hash_prompts = policy == "prefix_aware"  # only it reads recent_prefixes
        self.default_max_model_len = max_model_len
        self.heartbeat_timeout = heartbeat_timeout
        self.reply_timeout = reply_timeout
        self.token_timeout = token_timeout
        self.lease_interval = lease_interval
        self.max_failovers = max_failovers
        self.reserve_wait = reserve_wait
        self.curve = load_keys(curve_dir)
        self.nodes: dict[str, NodeInfo] = {}
        self.streams: dict[str, _Stream] = {}  # by the client-facing request id
        self.by_wire: dict[str, _Stream] = {}  # by the id of the current attempt
        self.replies: dict[str, asyncio.Future[Message]] = {}
        self.num_malformed = 0
        self.num_failovers = 0
        self._addr = f"tcp://{host}:{control_port}"
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._nonce = itertools.count(1)
        self._background: set[asyncio.Task] = set()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 64 * 1024 * 1024)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self.curve is not None:  # only nodes holding the cluster's keys get through
            admit_cluster_keys(self._ctx, self.curve)
            self.curve.serve(self._sock)
        self._sock.bind(self._addr)
        self._tasks = [
            asyncio.create_task(self._receive_loop()),
            asyncio.create_task(self._watch_loop()),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._sock is not None:
            self._sock.close(linger=0)
        stop_admitting(self._ctx)
        self._ctx.term()

    # -- registry --------------------------------------------------------------------------

    def alive(self, roles: tuple[str, ...]) -> list[NodeInfo]:
        """Nodes of these roles heard from within the heartbeat timeout."""
        cutoff = time.monotonic() - self.heartbeat_timeout
        return [n for n in self.nodes.values() if n.role in roles and n.last_seen >= cutoff]

    def routable(self, roles: tuple[str, ...], exclude: set[str] = frozenset()) -> list[NodeInfo]:
        """Live nodes that take new requests (not draining, not excluded)."""
        return [n for n in self.alive(roles) if not n.draining and n.node_id not in exclude]

    @property
    def max_model_len(self) -> int:  # type: ignore[override]
        """The tightest limit among live nodes (every node must be able to hold a request)."""
        lens = [n.max_model_len for n in self.alive(NODE_ROLES)]
        return min([self.default_max_model_len, *lens])

    async def integrity(self) -> dict[str, dict]:
        """Every live node's block-pool integrity report (for operators and tests)."""
        out = {}
        for node in self.alive(NODE_ROLES):
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
        if self.routable(("both",)):
            return True
        return bool(self.routable(("prefill",)) and self.routable(("decode",)))

    def stats(self) -> dict[str, float]:
        return {
            "nodes_prefill": len(self.alive(("prefill",))),
            "nodes_decode": len(self.alive(("decode",))),
            "nodes_colocated": len(self.alive(("both",))),
            "requests_in_flight": len(self.streams),
            "malformed_messages": self.num_malformed,
            "failovers": self.num_failovers,
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
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY): treat it as dead now
            log.warning("send to %s failed: %s", node_id, exc)
            node = self.nodes.get(node_id)
            if node is not None:
                node.last_seen = -math.inf

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
        if isinstance(msg, Alive):  # from a node's liveness socket: proof of life only
            node = self.nodes.get(sender.removesuffix(ALIVE_SUFFIX))
            if node is not None and sender.endswith(ALIVE_SUFFIX):
                node.last_seen = now
            return
        if isinstance(msg, RegisterNode):
            self._register(sender, msg, now)
            return
        node = self.nodes.get(sender)
        if node is None:  # a node this router does not know (it restarted): ask it in
            if isinstance(msg, Heartbeat):
                self._spawn(self._send(sender, Reregister()))
            return
        node.last_seen = now  # any message proves it is alive (a stalled node comes back)
        if isinstance(msg, Heartbeat):
            if not node.apply_heartbeat(msg, now):
                self._spawn(self._send(sender, SyncPrefixes()))
        elif isinstance(msg, Reserved | Busy):
            self._resolve(f"{sender}/{msg.request_id}", msg)
        elif isinstance(msg, IntegrityReport):
            self._resolve(f"{sender}/integrity-{msg.nonce}", msg)
        elif isinstance(msg, Tokens):
            self._on_tokens(sender, msg)
        elif isinstance(msg, Admitted):
            stream = self.by_wire.get(msg.request_id)
            if stream is not None and stream.decode_node == sender:
                stream.admitted = True
        elif isinstance(msg, Error):
            self._on_error(sender, msg)

    def _register(self, sender: str, msg: RegisterNode, now: float) -> None:
        """Add a node, or take it again; a new incarnation under a known id is a restarted
        process that holds nothing the old one held: fail those requests over now."""
        old = self.nodes.get(sender)
        if old is not None and old.incarnation != msg.incarnation:
            log.warning("node %s restarted: failing over what it held", sender)
            for stream in list(self.streams.values()):
                if sender in stream.nodes():
                    self._fail_over(stream, {sender}, f"{sender} restarted")
                    stream.lost.discard(sender)  # the new process may take the retry
        elif old is not None:
            old.last_seen = now
            return
        log.info("node %s registered (%s, %s KV)", sender, msg.role, msg.kv_connector or "no")
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
            incarnation=msg.incarnation,
        )

    def _on_error(self, sender: str, msg: Error) -> None:
        if self._resolve(f"{sender}/{msg.request_id}", msg):
            return
        stream = self.by_wire.get(msg.request_id)
        if stream is None or sender not in stream.nodes():
            return  # about a request that moved on or ended: stale
        if msg.kind.elsewhere:
            # The node is full or shutting down: others carry the request on (a prefill
            # node's share alone when no token went out yet).
            self._fail_over(stream, {sender}, f"{sender} refused: {msg.message}")
            return
        if msg.kind is Failure.KV_FAILED and sender == stream.decode_node:
            # The KV arrived damaged or incomplete: nothing was decoded from it; retry the
            # request (from the tokens already streamed) while failovers remain.
            self._fail_over(stream, set(), f"{sender}: {msg.message}")
            return
        stream.queue.put_nowait(TokenEvent.failed(msg.kind, msg.message))

    def _resolve(self, key: str, msg: Message) -> bool:
        fut = self.replies.pop(key, None)
        if fut is None or fut.done():
            return False
        fut.set_result(msg)
        return True

    def _on_tokens(self, sender: str, msg: Tokens) -> None:
        stream = self.by_wire.get(msg.request_id)
        if stream is None or sender not in stream.nodes():
            return  # finished, aborted, or moved to other nodes: the sender is stale
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

    async def _ask(self, node_id: str, key: str, msg: Message) -> Message | None:
        """Send msg and wait for the reply that node sends under key (None on timeout)."""
        key = f"{node_id}/{key}"
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

    # -- leases and failure detection -------------------------------------------------------

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_interval)
            try:
                self._check_nodes()
                await self._renew_leases()
            except Exception:  # never let one bad round stop leases and failure detection
                log.exception("lease/health round failed")

    def _check_nodes(self) -> None:
        """Fail over every request that depends on a node missing its heartbeats."""
        alive = {n.node_id for n in self.alive(NODE_ROLES)}
        for stream in list(self.streams.values()):
            p_lost = stream.prefill_node and stream.prefill_node not in alive
            d_lost = stream.decode_node and stream.decode_node not in alive
            if p_lost and not stream.admitted:
                self._fail_over(stream, {stream.prefill_node}, f"{stream.prefill_node} is gone")
            elif d_lost:
                self._fail_over(stream, {stream.decode_node}, f"{stream.decode_node} is gone")

    async def _renew_leases(self) -> None:
        held: dict[str, list[str]] = {n.node_id: [] for n in self.alive(NODE_ROLES)}
        for wire_id, stream in self.by_wire.items():
            for node_id in stream.nodes():
                if node_id in held:
                    held[node_id].append(wire_id)
        for node_id, rids in held.items():
            await self._send(node_id, Lease(tuple(rids)))

    def _fail_over(self, stream: _Stream, lost: set[str], why: str) -> None:
        """Detach the request from lost nodes at once (later messages from them are ignored)
        and let its generator re-route it."""
        only_prefill = (
            lost == {stream.prefill_node} and not stream.got_first and bool(stream.decode_node)
        )
        kind = "prefill" if only_prefill else "resume"
        detached = lost if only_prefill else stream.nodes()
        self._detach(stream, detached)
        stream.lost |= lost
        stream.queue.put_nowait(_Failover(kind, tuple(lost), tuple(detached), why))

    def _detach(self, stream: _Stream, node_ids: set[str]) -> None:
        for node_id in node_ids:
            node = self.nodes.get(node_id)
            if node is not None:
                node.inflight = max(0, node.inflight - 1)
        if stream.prefill_node in node_ids:
            stream.prefill_node = ""
        if stream.decode_node in node_ids:
            stream.decode_node = ""
            stream.admitted = False

    # -- requests --------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        rid = request.request_id
        stream = self.streams[rid] = self.by_wire[rid] = _Stream(request)
        finished = False
        try:
            failure = await self._route(stream)
            if failure is not None:
                yield failure
                return
            while True:
                try:
                    item = await asyncio.wait_for(stream.queue.get(), self.token_timeout)
                except asyncio.TimeoutError:
                    yield TokenEvent.failed(Failure.TIMEOUT, "timed out waiting for tokens")
                    await self.abort(rid)
                    return
                if isinstance(item, _Failover):
                    failure = await self._recover(stream, item)
                    if failure is None:
                        continue
                    item = failure
                if item.finish_reason is not None:
                    finished = True
                    stream.failed = item.finish_reason in ("error", "abort")
                stream.generated.extend(item.token_ids)
                yield item
                if finished:
                    return
        finally:
            if not finished or stream.failed:  # free whatever the nodes still hold
                await self._abort_nodes(stream, "stream ended")
            self._release(rid)

    async def _recover(self, stream: _Stream, failover: _Failover) -> TokenEvent | None:
        """Carry the request on without the lost nodes; an error message when it cannot."""
        rid = stream.wire_id
        log.warning("request %s: %s; failing over (%s)", rid, failover.why, failover.kind)
        for node_id in failover.detached:  # a lost one may only be stalled: it frees later
            await self._send(node_id, Abort(rid, failover.why))
        stream.failovers += 1
        self.num_failovers += 1
        if stream.failovers > self.max_failovers:
            why = f"gave up after {self.max_failovers} failovers: {failover.why}"
            return TokenEvent.failed(Failure.UNAVAILABLE, why)
        if failover.kind == "prefill":
            reserved = await self._renew_transfer(stream)
            if reserved is not None:
                return await self._send_prefill(stream, reserved)
        for node_id in stream.nodes():  # resume from scratch: drop the survivor's state too
            await self._send(node_id, Abort(rid, "resuming"))
        self._detach(stream, stream.nodes())
        stream.got_first = False
        stream.early.clear()
        del self.by_wire[rid]
        stream.attempt += 1
        self.by_wire[stream.wire_id] = stream
        return await self._route(stream)

    async def _renew_transfer(self, stream: _Stream) -> Reserved | None:
        rid = stream.wire_id
        reply = await self._ask(stream.decode_node, rid, RenewTransfer(rid))
        return reply if isinstance(reply, Reserved) else None

    def _wire(self, stream: _Stream) -> tuple[dict, tuple[int, ...]]:
        """The request's sampling and already streamed tokens, as nodes take them."""
        return sampling_to_wire(stream.request.sampling), tuple(stream.generated)

    async def _route(self, stream: _Stream) -> TokenEvent | None:
        """Send the request on its way (resuming after stream.generated); an error message
        if nothing can take it."""
        request = stream.request
        sampling, outputs = self._wire(stream)
        exclude = stream.lost
        colocated = self.policy(self.routable(("both",), exclude), request)
        decodes = self.policy(self.routable(("decode",), exclude), request)
        if colocated and not (decodes and self.routable(("prefill",), exclude)):
            node = colocated[0]
            stream.prefill_node = node.node_id
            node.inflight += 1
            node.routed(request, time.monotonic(), prefixes=self.hash_prompts)
            await self._send(
                node.node_id,
                Prefill(
                    stream.wire_id, request.prompt_token_ids, sampling, output_token_ids=outputs
                ),
            )
            return None
        if not (decodes and self.routable(("prefill",), exclude)):
            return TokenEvent.failed(Failure.UNAVAILABLE, "no prefill/decode node available")
        reserved = await self._reserve(stream, decodes)
        if reserved is None:
            return TokenEvent.failed(
                Failure.UNAVAILABLE, "no decode node has room for this request"
            )
        return await self._send_prefill(stream, reserved)

    async def _send_prefill(self, stream: _Stream, reserved: Reserved) -> TokenEvent | None:
        request = stream.request
        sampling, outputs = self._wire(stream)
        # Picked after the reservation's round trip, so the choice sees requests routed
        # meanwhile (the policy's load and prefix view include them).
        prefills = self.policy(self.routable(("prefill",), stream.lost), request)
        if not prefills:
            return TokenEvent.failed(Failure.UNAVAILABLE, "no prefill node available")
        prefill = prefills[0]
        stream.prefill_node = prefill.node_id
        prefill.inflight += 1
        prefill.routed(request, time.monotonic(), prefixes=self.hash_prompts)
        await self._send(
            prefill.node_id,
            Prefill(
                stream.wire_id,
                request.prompt_token_ids,
                sampling,
                xfer_id=reserved.xfer_id,
                dest_block_ids=reserved.block_ids,
                dest_kv_endpoint=reserved.kv_endpoint,
                output_token_ids=outputs,
            ),
        )
        return None

    async def _reserve(self, stream: _Stream, decodes: list[NodeInfo]) -> Reserved | None:
        """Blocks on a decode node; when every one is full, ask again (they free blocks as
        requests finish) for up to reserve_wait seconds."""
        request = stream.request
        sampling, outputs = self._wire(stream)
        deadline = time.monotonic() + self.reserve_wait
        while True:
            for node in decodes:
                msg = ReserveKV(stream.wire_id, request.prompt_token_ids, sampling, outputs)
                reply = await self._ask(node.node_id, stream.wire_id, msg)
                if isinstance(reply, Reserved):
                    stream.decode_node = node.node_id
                    node.inflight += 1
                    return reply
                if reply is None:  # no answer in time: make sure it holds nothing for us
                    await self._send(node.node_id, Abort(stream.wire_id, "reserve timed out"))
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.2)
            decodes = self.policy(self.routable(("decode",), stream.lost), request)

    def _release(self, request_id: str) -> None:
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            self.by_wire.pop(stream.wire_id, None)
            self._detach(stream, stream.nodes())

    async def abort(self, request_id: str) -> None:
        stream = self.streams.get(request_id)
        if stream is None:
            return
        await self._abort_nodes(stream, "client")
        stream.queue.put_nowait(TokenEvent((), finish_reason="abort"))

    async def _abort_nodes(self, stream: _Stream, why: str) -> None:
        for node_id in stream.nodes():
            await self._send(node_id, Abort(stream.wire_id, why))


def new_request_id() -> str:
    return uuid.uuid4().hex
