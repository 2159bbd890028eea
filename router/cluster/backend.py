"""ClusterBackend: the HTTP layer's `Backend` over the cluster's nodes. It wires the control
socket's messages to the node registry (node facts) and the request table (where each request
runs), asks Routing to place and re-place requests, and streams each request's tokens out.
Leases on the nodes are renewed while a request lives; a node that dies, stalls or refuses
hands its requests to others (failover).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from pdserve.common.tracing import tracer_of
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
    RegisterNode,
    Reregister,
    Reserved,
    SyncPrefixes,
    Tokens,
)
from pdserve.common.wire.security import load_keys
from pdserve.router.backend import Backend, GenerateRequest
from pdserve.router.cluster.registration import Registrar
from pdserve.router.cluster.registry import NODE_ROLES, NodeInfo, NodeRegistry
from pdserve.router.cluster.routing import POLICIES, Routing
from pdserve.router.cluster.streams import (
    ControlServer,
    Failover,
    RequestTable,
    Stream,
    get_within,
    left_behind,
)
from pdserve.router.cluster.timing import RequestTrace
from pdserve.router.request_log import RequestLog, logged

if TYPE_CHECKING:  # router.config reads the policies' names from this package: no cycle
    from pdserve.router.config import RouterConfig

log = logging.getLogger(__name__)


class ClusterBackend(Backend):
    """Backend over the node registry; one asyncio task receives every node message, another
    renews leases and watches for dead nodes. Times are read from `clock` (the registry's;
    a test passes a fake one)."""

    def __init__(
        self,
        config: RouterConfig,
        max_model_len: int = 2048,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """max_model_len: the model's limit, --max-model-len applied (`router.__main__`); a
        node that registers with a lower one lowers it."""
        self.token_timeout = config.token_timeout
        self.lease_interval = config.lease_interval
        self.registry = NodeRegistry(
            config.heartbeat_timeout, max_model_len, clock, config.tier_credit
        )
        self.table = RequestTable(self.registry)
        self.control = ControlServer(
            config.control_address,
            load_keys(config.curve_dir),
            config.reply_timeout,
            self.on_message,
            self._unreachable,
        )
        self.routing = Routing(
            self.table,
            self.control,
            POLICIES[config.policy](),
            reserve_wait=config.reserve_wait,
            placement=config.placement,
            max_failovers=config.max_failovers,
        )
        self.registrar = Registrar(self.table, self.control, config.probe_timeout)
        self.tracer = tracer_of("router", config.tracing)  # None: tracing off
        self.request_log = RequestLog(config.request_log) if config.request_log else None
        self.model_name = config.served_name
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
        if self.tracer is not None:
            self.tracer.close()
        if self.request_log is not None:
            self.request_log.close()

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
        """Every live node's block-pool integrity report (for operators and tests), and the
        requests this router has routed to it that have not ended (`in_flight`, as the router
        counts them when the reports are in) and the registrations it got from the node. The
        nodes are asked at once: one that went away
        unnoticed costs one reply timeout, not one each."""
        nodes = self.registry.alive(NODE_ROLES)
        reports = await asyncio.gather(*(self.check_integrity(n.node_id) for n in nodes))
        out = {}
        for node, report in zip(nodes, reports, strict=True):
            # Its KV layout names the dtype it computes in and how it holds its weights (a
            # model_id ending ":int8" or ":int4": quantized linears, quant.weight_format).
            layout = dataclasses.asdict(node.kv_layout) if node.kv_layout else None
            out[node.node_id] = {"role": node.role, "kv_layout": layout, "report": None}
            out[node.node_id]["in_flight"] = node.inflight
            # The router's view of its prefix cache, as placement reads it (hex block hashes).
            out[node.node_id]["prefix_view"] = sorted(h.hex() for h in node.prefixes)
            out[node.node_id]["host_view"] = sorted(h.hex() for h in node.host_prefixes)
            out[node.node_id]["registrations"] = self.registrar.registrations[node.node_id]
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

    def failovers(self) -> dict[str, int]:
        return dict(self.routing.failover_causes)

    def stats(self) -> dict[str, float]:
        return {
            **self.registry.stats(),
            "requests_in_flight": len(self.table),
            "malformed_messages": self.control.num_malformed,
            "failovers": self.routing.num_failovers,
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

    def on_message(self, sender: str, msg: Message) -> None:
        """One message from a node, as the control socket decoded it."""
        now = self.registry.clock()
        if isinstance(msg, Alive):  # from a node's liveness socket: proof of life only
            node = self.registry.get(sender.removesuffix(ALIVE_SUFFIX))
            if node is not None and sender.endswith(ALIVE_SUFFIX):
                node.last_seen = now
            return
        if isinstance(msg, RegisterNode):
            self.registrar.register(sender, msg, now)
            return
        node = self.registry.get(sender)
        if node is None:  # a node this router does not know (it restarted): ask it in
            if isinstance(msg, Heartbeat) and not self.registrar.probing(sender):
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
            self.table.deliver(sender, msg, now)
        elif isinstance(msg, Admitted):
            handoff = self.table.admitted(sender, msg.request_id, now)
            if handoff is not None:  # the hand-off's time, for the placement's cost model
                node.observe_handoff(handoff)
        elif isinstance(msg, Error):
            self._on_error(sender, msg)

    def _on_error(self, sender: str, msg: Error) -> None:
        """A node's error ends the request or fails it over, by its kind (left_behind)."""
        if self.control.resolve(f"{sender}/{msg.request_id}", msg):
            return
        stream = self.table.held_by(sender, msg.request_id)
        if stream is None:
            return  # about a request that moved on or ended: stale
        lost = left_behind(stream, sender, msg.kind)
        if lost is None:
            stream.queue.put_nowait(msg)
        else:
            self.table.fail_over(stream, lost, f"{sender}: {msg.message}", cause=msg.kind.value)

    async def check_integrity(self, node_id: str) -> IntegrityReport | None:
        nonce = next(self._nonce)
        reply = await self.control.ask(node_id, f"integrity-{nonce}", CheckIntegrity(nonce))
        return reply if isinstance(reply, IntegrityReport) else None

    # -- leases and failure detection -------------------------------------------------------

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_interval)
            try:
                await self.watch()
            except Exception:  # never let one bad round stop leases and failure detection
                log.exception("lease/health round failed")

    async def watch(self) -> None:
        """One round: fail over what depends on nodes missing their heartbeats, then renew
        the leases of what every live node holds."""
        alive = [n.node_id for n in self.registry.alive(NODE_ROLES)]
        self.table.fail_dead(set(alive))
        self.control.abandon(set(self.registry.nodes) - set(alive))
        for node_id, wire_ids in self.table.leases(alive).items():
            await self.control.send(node_id, Lease(wire_ids))

    # -- requests --------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Tokens | Error]:
        stream = self.table.open(request)
        stream.trace = RequestTrace(self.tracer, request, self.model_name)
        stream.trace.child("router.queue", request.timing.arrival, {})
        finished = False
        try:
            failure = await self.routing.route(stream)
            if failure is not None:
                stream.failed = True
                yield failure
                return
            while not finished:
                item = await self._next(stream)
                if isinstance(item, Error):
                    finished = stream.failed = True
                else:
                    request.timing.note(item)
                    stream.tokens.extend(item.token_ids)
                    finished = bool(item.finish_reason)
                    stream.failed = item.finish_reason in ("error", "abort")
                yield item
        finally:
            if not finished or stream.failed:  # free whatever the nodes still hold
                await self._abort_nodes(stream, "stream ended")
            else:
                self._expect_conversation(stream)
            outcome = "failed" if stream.failed else "finished" if finished else "abandoned"
            if self.request_log is not None:  # before close, which detaches its nodes
                self._log(stream, outcome)
            self.table.close(request.request_id)
            stream.trace.finish(len(stream.generated), outcome)

    async def _next(self, stream: Stream) -> Tokens | Error:
        """The request's next message for its client, failing it over on the way as often as
        its nodes fail it; an error when no token comes within the token timeout."""
        while True:
            try:
                item = await get_within(stream.queue, self.token_timeout)
            except asyncio.TimeoutError:
                await self.abort(stream.request.request_id)
                return Error(stream.wire_id, "timed out waiting for tokens", Failure.TIMEOUT)
            if not isinstance(item, Failover):
                return item
            failure = await self.routing.recover(stream, item)
            if failure is not None:
                return failure

    def _log(self, stream: Stream, outcome: str) -> None:
        """The request's line in --request-log, its prompt hashed at its computing node's
        block size (the prefix caches' granularity; 16 if it reached none)."""
        node = self.registry.get(stream.prefill_node or stream.decode_node)
        assert self.request_log is not None
        self.request_log.write(logged(stream, outcome, node.block_size if node else 16))

    def _expect_conversation(self, stream: Stream) -> None:
        """The node that decoded a finished request holds its prompt and answer: the next
        turn of the conversation finds them there before its heartbeat tells."""
        holder = self.registry.get(stream.decode_node or stream.prefill_node)
        if holder is None or holder.role not in ("decode", "both"):
            return
        hashes = stream.hashes.of(holder.block_size, len(stream.tokens) - 1)  # last: no KV
        holder.expect_cached(hashes, self.registry.clock())

    async def abort(self, request_id: str) -> None:
        stream = self.table.get(request_id)
        if stream is None:
            return
        await self._abort_nodes(stream, "client")
        stream.queue.put_nowait(Tokens(stream.wire_id, (), finish_reason="abort"))

    async def _abort_nodes(self, stream: Stream, why: str) -> None:
        for node_id in stream.nodes():
            await self.control.send(node_id, Abort(stream.wire_id, why))
