"""ClusterBackend: the HTTP layer's `Backend` over the cluster's nodes.

A request on the P/D path goes: ReserveKV to a decode node (it allocates the prompt's blocks
or answers Busy), Prefill to a prefill node with the reserved blocks as the destination; the
prefill node streams the first token here and hands the KV to the decode node, which streams
the rest. Leases on both nodes are renewed while the request lives; a node that dies, stalls
or refuses hands its requests to others (failover).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator

from pdserve.common.engine.block_pool import hash_token_blocks
from pdserve.common.node.config import is_wildcard
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
    Registered,
    RegisterNode,
    Reregister,
    Reserved,
    SyncPrefixes,
    Tokens,
)
from pdserve.common.wire.security import load_keys
from pdserve.router.backend import Backend, GenerateRequest, get_within
from pdserve.router.cluster.control import ControlServer
from pdserve.router.cluster.placement import PlacementConfig
from pdserve.router.cluster.policies import POLICIES
from pdserve.router.cluster.registry import NODE_ROLES, NodeInfo, NodeRegistry
from pdserve.router.cluster.routing import Routing
from pdserve.router.cluster.streams import Failover, Stream

log = logging.getLogger(__name__)


async def probe_endpoint(endpoint: str, timeout: float) -> str | None:
    """Why peers cannot reach a node's KV endpoint from here (None: a TCP connection opens)."""
    scheme, _, address = endpoint.partition("://")
    if scheme != "tcp":
        return None  # ipc:// and the like: one host, nothing to route
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    hint = "start the node with --advertise-host set to an address other hosts reach"
    if is_wildcard(host):
        return f"its KV endpoint {endpoint} names no address peers can dial: {hint}"
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout)
    except (OSError, ValueError, asyncio.TimeoutError) as exc:
        why = str(exc) or type(exc).__name__
        return f"its KV endpoint {endpoint} is not reachable from the router ({why}): {hint}"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


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
        probe_timeout: float = 3.0,
        placement: PlacementConfig | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {sorted(POLICIES)}")
        self.token_timeout = token_timeout
        self.lease_interval = lease_interval
        self.max_failovers = max_failovers
        self.registry = NodeRegistry(heartbeat_timeout, max_model_len)
        self.control = ControlServer(
            f"tcp://{host}:{control_port}",
            load_keys(curve_dir),
            reply_timeout,
            self._on_message,
            self._unreachable,
        )
        self.routing = Routing(
            self.registry,
            self.control,
            POLICIES[policy](),
            hash_prompts=policy == "prefix_aware",
            reserve_wait=reserve_wait,
            placement=placement,
        )
        self.streams: dict[str, Stream] = {}  # by the client-facing request id
        self.by_wire: dict[str, Stream] = {}  # by the id of the current attempt
        self.num_failovers = 0
        self.probe_timeout = probe_timeout
        self._probing: set[str] = set()  # nodes whose KV endpoint is being checked
        self._tasks: list[asyncio.Task] = []
        self._nonce = itertools.count(1)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        await self.control.start()
        self._tasks = [
            asyncio.create_task(self._watch_loop()),
            asyncio.create_task(self.registry.lag.run()),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.control.close()

    # -- registry --------------------------------------------------------------------------

    @property
    def nodes(self) -> dict[str, NodeInfo]:
        """The registered nodes by id (for operators and tests)."""
        return self.registry.nodes

    @property
    def max_model_len(self) -> int:  # type: ignore[override]
        """The tightest limit among live nodes (every node must be able to hold a request)."""
        return self.registry.max_model_len

    async def integrity(self) -> dict[str, dict]:
        """Every live node's block-pool integrity report (for operators and tests). The nodes
        are asked at once: one that went away unnoticed costs one reply timeout, not one each."""
        nodes = self.registry.alive(NODE_ROLES)
        reports = await asyncio.gather(*(self.check_integrity(n.node_id) for n in nodes))
        out = {}
        for node, report in zip(nodes, reports, strict=True):
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
        # Forced local prefill needs no prefill node: a decode node runs requests whole.
        if self.routing.placement.mode == "local" and self.registry.routable(("decode",)):
            return True
        return self.registry.ready()

    def unready_reason(self) -> str:
        if self.routing.placement.mode == "local":
            return "no decode node is available (prefill placement is local)"
        return self.registry.no_route_reason()

    def stats(self) -> dict[str, float]:
        return {
            **self.registry.stats(),
            "requests_in_flight": len(self.streams),
            "malformed_messages": self.control.num_malformed,
            "failovers": self.num_failovers,
            "prefills_local": self.routing.num_local,
            "prefills_remote": self.routing.num_remote,
            "kv_tokens_reused_on_decode": self.routing.kv_tokens_reused,
            "kv_tokens_sent": self.routing.kv_tokens_sent,
        }

    # -- messages --------------------------------------------------------------------------

    def _unreachable(self, node_id: str) -> None:
        """A send found the node's socket gone: take it as dead now."""
        node = self.registry.get(node_id)
        if node is not None:
            node.last_seen = -math.inf

    def _on_message(self, sender: str, msg: Message) -> None:
        now = time.monotonic()
        if isinstance(msg, Alive):  # from a node's liveness socket: proof of life only
            node = self.registry.get(sender.removesuffix(ALIVE_SUFFIX))
            if node is not None and sender.endswith(ALIVE_SUFFIX):
                node.last_seen = now
            return
        if isinstance(msg, RegisterNode):
            self._register(sender, msg, now)
            return
        node = self.registry.get(sender)
        if node is None:  # a node this router does not know (it restarted): ask it in
            if isinstance(msg, Heartbeat) and sender not in self._probing:
                self.control.spawn(self.control.send(sender, Reregister()))
            return
        node.last_seen = now  # any message proves it is alive (a stalled node comes back)
        if isinstance(msg, Heartbeat):
            if not node.apply_heartbeat(msg, now):
                self.control.spawn(self.control.send(sender, SyncPrefixes()))
        elif isinstance(msg, Reserved | Busy):
            self.control.resolve(f"{sender}/{msg.request_id}", msg)
        elif isinstance(msg, IntegrityReport):
            self.control.resolve(f"{sender}/integrity-{msg.nonce}", msg)
        elif isinstance(msg, Tokens):
            self._on_tokens(sender, msg)
        elif isinstance(msg, Admitted):
            stream = self.by_wire.get(msg.request_id)
            if stream is not None and stream.decode_node == sender:
                stream.admitted = True
                if stream.first_at:  # the hand-off's time, for the placement's cost model
                    node.observe_handoff(now - stream.first_at)
        elif isinstance(msg, Error):
            self._on_error(sender, msg)

    def _register(self, sender: str, msg: RegisterNode, now: float) -> None:
        """Check a node's KV endpoint first (a decode node), then take it in and say so."""
        if sender in self._probing:
            return  # its first registration is being checked
        known = self.registry.get(sender)
        if msg.kv_endpoint and (known is None or known.incarnation != msg.incarnation):
            self._probing.add(sender)
            self.control.spawn(self._probe_then_register(sender, msg))
            return
        self._take(sender, msg, now)

    async def _probe_then_register(self, sender: str, msg: RegisterNode) -> None:
        """A decode node is only taken in once its advertised KV endpoint answers here: a
        wrong --advertise-host fails the node at registration, naming the address, instead of
        every prefill later hanging on it."""
        try:
            why = await probe_endpoint(msg.kv_endpoint, self.probe_timeout)
        finally:
            self._probing.discard(sender)
        if why is not None:
            log.error("node %s refused: %s", sender, why)
            await self.control.send(sender, Registered(accepted=False, reason=why))
            return
        self._take(sender, msg, time.monotonic())

    def _take(self, sender: str, msg: RegisterNode, now: float) -> None:
        """Add a node, or take it again; a new incarnation under a known id is a restarted
        process that holds nothing the old one held: fail those requests over now."""
        self.control.spawn(self.control.send(sender, Registered()))
        old = self.registry.get(sender)
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
        self.registry.add(sender, msg, now)
        why = self.registry.unpairable(sender)
        if why:
            log.warning("node %s can exchange KV with no node of the other role: %s", sender, why)

    def _on_error(self, sender: str, msg: Error) -> None:
        if self.control.resolve(f"{sender}/{msg.request_id}", msg):
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
        if msg.kind is Failure.KV_FAILED and sender == stream.prefill_node:
            # The prefill node could not reach the decode node (nixl and nccl see a dead
            # peer at once): retry without that decode node, before the heartbeats tell.
            lost = {stream.decode_node} if stream.decode_node else set()
            self._fail_over(stream, lost, f"{sender}: {msg.message}")
            return
        stream.queue.put_nowait(msg)

    def _on_tokens(self, sender: str, msg: Tokens) -> None:
        stream = self.by_wire.get(msg.request_id)
        if stream is None or sender not in stream.nodes():
            return  # finished, aborted, or moved to other nodes: the sender is stale
        if stream.decode_node == sender and not stream.got_first:
            stream.early.append(msg)  # the decode node outran the prefill node's message
            return
        if not stream.got_first and sender == stream.prefill_node and stream.decode_node:
            stream.first_at = time.monotonic()
        self._prefilled_locally(stream)
        stream.got_first = True
        stream.queue.put_nowait(msg)
        for e in stream.early:
            stream.queue.put_nowait(e)
        stream.early.clear()

    async def check_integrity(self, node_id: str) -> IntegrityReport | None:
        nonce = next(self._nonce)
        reply = await self.control.ask(node_id, f"integrity-{nonce}", CheckIntegrity(nonce))
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
        alive = {n.node_id for n in self.registry.alive(NODE_ROLES)}
        for stream in list(self.streams.values()):
            p_lost = stream.prefill_node and stream.prefill_node not in alive
            d_lost = stream.decode_node and stream.decode_node not in alive
            if p_lost and not stream.admitted:
                self._fail_over(stream, {stream.prefill_node}, f"{stream.prefill_node} is gone")
            elif d_lost:
                self._fail_over(stream, {stream.decode_node}, f"{stream.decode_node} is gone")

    async def _renew_leases(self) -> None:
        held: dict[str, list[str]] = {n.node_id: [] for n in self.registry.alive(NODE_ROLES)}
        for wire_id, stream in self.by_wire.items():
            for node_id in stream.nodes():
                if node_id in held:
                    held[node_id].append(wire_id)
        for node_id, rids in held.items():
            await self.control.send(node_id, Lease(tuple(rids)))

    def _fail_over(self, stream: Stream, lost: set[str], why: str) -> None:
        """Detach the request from lost nodes at once (later messages from them are ignored)
        and let its generator re-route it."""
        only_prefill = (
            lost == {stream.prefill_node} and not stream.got_first and bool(stream.decode_node)
        )
        kind = "prefill" if only_prefill else "resume"
        detached = lost if only_prefill else stream.nodes()
        self._detach(stream, detached)
        stream.lost |= lost
        stream.queue.put_nowait(Failover(kind, tuple(lost), tuple(detached), why))

    def _prefilled_locally(self, stream: Stream) -> None:
        """A request prefilled on its decode node is past its prefill (its first token came,
        or it left the node): it counts as one of the node's decoding requests no more."""
        if stream.local_prefill:
            stream.local_prefill = False
            node = self.registry.get(stream.prefill_node)
            if node is not None:
                node.local_prefills = max(0, node.local_prefills - 1)

    def _detach(self, stream: Stream, node_ids: set[str]) -> None:
        if stream.prefill_node in node_ids:
            self._prefilled_locally(stream)
        for node_id in node_ids:
            node = self.registry.get(node_id)
            if node is not None:
                node.inflight = max(0, node.inflight - 1)
        if stream.prefill_node in node_ids:
            stream.prefill_node = ""
        if stream.decode_node in node_ids:
            stream.decode_node = ""
            stream.admitted = False

    # -- requests --------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Tokens | Error]:
        rid = request.request_id
        stream = self.streams[rid] = self.by_wire[rid] = Stream(request)
        finished = False
        try:
            failure = await self.routing.route(stream)
            if failure is not None:
                yield failure
                return
            while True:
                try:
                    item = await get_within(stream.queue, self.token_timeout)
                except asyncio.TimeoutError:
                    yield Error(rid, "timed out waiting for tokens", Failure.TIMEOUT)
                    await self.abort(rid)
                    return
                if isinstance(item, Failover):
                    failure = await self._recover(stream, item)
                    if failure is None:
                        continue
                    item = failure
                if isinstance(item, Error):
                    finished = stream.failed = True
                else:
                    stream.generated.extend(item.token_ids)
                    finished = bool(item.finish_reason)
                    stream.failed = item.finish_reason in ("error", "abort")
                yield item
                if finished:
                    return
        finally:
            if not finished or stream.failed:  # free whatever the nodes still hold
                await self._abort_nodes(stream, "stream ended")
            else:
                self._expect_conversation(stream)
            self._release(rid)

    def _expect_conversation(self, stream: Stream) -> None:
        """The node that decoded a finished request holds its prompt and answer: the next
        turn of the conversation finds them there before its heartbeat tells."""
        holder = self.registry.get(stream.decode_node or stream.prefill_node)
        if holder is None or holder.role not in ("decode", "both"):
            return
        tokens = [*stream.request.prompt_token_ids, *stream.generated][:-1]  # last: no KV
        holder.expect_cached(hash_token_blocks(tokens, holder.block_size), time.monotonic())

    async def _recover(self, stream: Stream, failover: Failover) -> Error | None:
        """Carry the request on without the lost nodes; an error message when it cannot."""
        rid = stream.wire_id
        log.warning("request %s: %s; failing over (%s)", rid, failover.why, failover.kind)
        for node_id in failover.detached:  # a lost one may only be stalled: it frees later
            await self.control.send(node_id, Abort(rid, failover.why))
        stream.failovers += 1
        self.num_failovers += 1
        if stream.failovers > self.max_failovers:
            why = f"gave up after {self.max_failovers} failovers: {failover.why}"
            return Error(rid, why, Failure.UNAVAILABLE)
        if failover.kind == "prefill":
            reserved = await self.routing.renew_transfer(stream)
            if reserved is not None:
                return await self.routing.send_prefill(stream, reserved)
        for node_id in stream.nodes():  # resume from scratch: drop the survivor's state too
            await self.control.send(node_id, Abort(rid, "resuming"))
        self._detach(stream, stream.nodes())
        stream.got_first = False
        stream.early.clear()
        del self.by_wire[rid]
        stream.attempt += 1
        self.by_wire[stream.wire_id] = stream
        return await self.routing.route(stream)

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
        stream.queue.put_nowait(Tokens(stream.wire_id, (), finish_reason="abort"))

    async def _abort_nodes(self, stream: Stream, why: str) -> None:
        for node_id in stream.nodes():
            await self.control.send(node_id, Abort(stream.wire_id, why))
