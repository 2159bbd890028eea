"""The loop every node process runs: the base of every role.

A node's loop reads like an engine step with I/O around it:

    handle control messages -> role I/O (KV arrivals) -> engine step -> leases, heartbeat

Registration, heartbeats and leases are the node's `Membership` (membership.py), handed its data;
what a heartbeat, /metrics and an integrity check report is read off the engine (reports.py).

Role differences live in small subclasses (prefill_node, decode_node, colocated.py):
each adds its entries to the handler table (message type -> bound method) and overrides a few
hooks; there is no `if role == ...` in the loop. Calls go one way, from the loop to the role
and the engine: a role's handlers and hooks return (or yield) the messages to send and the
stages they ended, and the loop sends them, records the stages, admits new requests and leases
them; a role never calls back into the loop, nor the engine into the node (the loop takes the
step's batch from the scheduler and hands the forward its layer call, `EngineNode.step_messages`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

from pdserve.common.engine.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdserve.common.engine.kv_cache_manager import PrefixEvents
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.model_runner import LayerCall
from pdserve.common.engine.request import Request
from pdserve.common.engine.scheduler import RequestUpdate, SchedulerOutput
from pdserve.common.engine.tensor_parallel import GroupBroken
from pdserve.common.node.config import NodeConfig
from pdserve.common.node.health import HealthServer
from pdserve.common.node.membership import Handler, Membership, NodeStatus, advertise_host
from pdserve.common.node.reports import engine_gauges, engine_status, integrity_report
from pdserve.common.node.stages import NodeMetrics, StageClock, Told
from pdserve.common.node.tier_metrics import tier_report
from pdserve.common.tracing import tracer_of
from pdserve.common.wire.messages import (
    Abort,
    CheckIntegrity,
    Error,
    Failure,
    IntegrityReport,
    Message,
    Prefill,
    RegisterNode,
    Reserved,
    ReserveKV,
    SyncPrefixes,
)
from pdserve.common.wire.security import load_keys

log = logging.getLogger(__name__)

# A role's part in taking a new request (Prefill, ReserveKV): the message and its validated
# Request; it queues or reserves the request on the engine, or answers why not.
Take = Callable[[Any, Request], Message | None]


class EngineNode:
    """Base of every role: the engine, the loop, drain and health, and the handlers every role
    shares; its routers (links, registration, heartbeats, leases) are `membership`'s. A role
    sets `role`, adds its handlers in `handlers()`, and overrides hooks."""

    role: ClassVar[str] = ""
    reports_prefixes: ClassVar[bool] = False  # heartbeats carry prefix-cache changes
    hands_off: ClassVar[bool] = False  # a Prefill's KV leaves after its first token (`xfer_id`)
    # A role that moves KV (`kv_transfer.ranks.MovesKV`) names its ranks' agent ("module:Class")
    # and opens its KV group on them (`open_kv`); common/node never imports kv_transfer.
    rank_agent_class: ClassVar[str | None] = None
    kv: Any = None  # that role's `kv_transfer.ranks.KVGroup`

    def __init__(
        self, model: ModelConfig, cache: CacheConfig, scheduler: SchedulerConfig, node: NodeConfig
    ) -> None:
        assert self.role, "EngineNode is a base: build one of its roles"
        self.config = node
        self.curve = load_keys(node.curve_dir)
        self.advertise_host = advertise_host(node)
        agent = self.rank_agent(model, node)
        parallel = ParallelConfig(
            node.tensor_parallel_size,
            node.threads_per_rank,
            rank_agent=self.rank_agent_class if agent is not None else None,
            rank_agent_options=agent,
            otlp_traces_endpoint=node.tracing.otlp_traces_endpoint,
            trace_service=self.role,
            workers=node.tp_workers,
            host=node.host if node.tp_workers == "external" else "127.0.0.1",
            port=node.tp_port,
        )
        self.engine = LLMEngine(model, cache, scheduler, parallel, decodes=not self.hands_off)
        self.model_config = model
        self.block_size = cache.block_size
        self.node_id = node.node_id or f"{self.role}-{uuid.uuid4().hex[:8]}"
        self.incarnation = uuid.uuid4().hex
        self.tracer = tracer_of(self.role, node.tracing)  # None: tracing off
        self.fatal: str | None = None  # why the node stopped on its own (exit non-zero)
        self.drain_deadline: float | None = None  # set once draining (SIGTERM)
        self._last_progress = time.monotonic()
        self.stop_event = threading.Event()
        if agent is not None:  # rank 0's end; the workers built theirs from the same options
            self.kv = self.open_kv(agent)
        labels = {"role": self.role, "node_id": self.node_id}
        self.metrics = self.node_metrics(labels)
        drafter = self.engine.scheduler.drafter
        method = drafter.config.method if drafter is not None and not self.hands_off else ""
        self.stages = StageClock(self.tracer, self.node_id, self.metrics, method)
        self.membership = Membership(node, self.registration(), self.curve, self.live, self.fail)
        if self.reports_prefixes:  # nodes a prefix-aware router picks by cache
            self.engine.kv.pool.prefix_events = PrefixEvents()
        self._handlers = self.handlers()
        self.health: HealthServer | None = None
        if node.health_port:  # bound now: a port in use fails the start, not a probe later
            self.health = HealthServer(
                node.host, node.health_port, self.live, self.ready, labels, self.metrics.registry
            )

    def rank_agent(self, model: ModelConfig, node: NodeConfig) -> dict[str, Any] | None:
        """The options of this role's KV end on every tensor-parallel rank
        (`kv_transfer.ranks.RankKV`), or None for a role that moves no KV (names no agent)."""
        if self.rank_agent_class is None:
            return None
        from pdserve.common.model.weights import model_fingerprint

        model_id = model_fingerprint(model.model_dir)
        return node.kv_options(model_id, self.role, self.advertise_host)

    def node_metrics(self, labels: dict[str, str]) -> NodeMetrics:
        """The node's request metrics; a node that moves KV labels its transfer series with
        its connector."""
        if self.kv is None:
            return NodeMetrics(labels)
        port = self.kv.port
        return NodeMetrics(labels, port.connector, port.layout.block_bytes)

    def open_kv(self, options: dict[str, Any]) -> Any:
        """Rank 0's KV group of a role that moves KV (`rank_agent` gave `options`)."""
        raise NotImplementedError(f"the {self.role} role moves no KV")

    # -- the role's contract -----------------------------------------------------------------

    def handlers(self) -> dict[type[Message], Handler]:
        """What this node does with each control message; a role adds its own entries (the
        message that brings it new requests through `admitting`). Any other type is refused."""
        return {
            Abort: self.on_abort,
            CheckIntegrity: self.report_integrity,
            SyncPrefixes: self.resync_prefixes,
            **self.membership.handlers(),
        }

    def io_messages(self) -> Iterator[Told]:
        """Role I/O between steps (e.g. KV arrivals on a decode node), yielding what to tell
        the requests' routers."""
        return iter(())

    def layer_call(self, output: SchedulerOutput) -> LayerCall | None:
        """What runs inside this step's forward after each layer (a prefill node ships the
        layer's pages), given the step's batch; None: nothing."""
        return None

    def stepped(self, updates: list[RequestUpdate]) -> Iterator[Told]:
        """What to tell the requests' routers of a step's updates (and the stages it ended)."""
        for update in updates:
            yield update.tokens()

    def step_messages(self) -> Iterator[Told]:
        """One engine step, yielding what to tell the requests' routers; each message is sent
        before the step goes on (a role may act on a request after its tokens left). The
        step's spans open before the forward: the other ranks put theirs under them."""
        output = self.engine.scheduler.schedule()
        drafter = self.engine.scheduler.drafter
        drafts = drafter.by_request if drafter is not None else {}
        traces = self.stages.step_started(output, self.engine.kv.req_tier_loads, drafts)
        updates = self.engine.run(output, LayerCall.traced(self.layer_call(output), traces))
        self.stages.step_done()
        yield from self.stepped(updates)

    def refuse(self, msg: Prefill | ReserveKV, kind: Failure, why: str) -> Message:
        """The answer that turns a new request away (draining, full): the router's failover
        reads `kind`."""
        return Error(msg.request_id, why, kind)

    # -- handlers every role shares ------------------------------------------------------------

    def admitting(self, take: Take) -> Handler:
        """The handler of a message that brings a new request: refused while the node takes
        none (`refusal`); else its Request is built and validated (ValueError: bad input) and
        the role's `take` queues or reserves it, or answers why not. A request the engine
        holds afterwards is leased to the router that sent it."""

        def admit(msg: Prefill | ReserveKV) -> Message | None:
            why = self.refusal()
            if why is not None:
                return self.refuse(msg, *why)
            # A reservation's KV comes from a prefill node: its stages are the decode side's.
            remote = isinstance(msg, ReserveKV)
            handoff = isinstance(msg, Prefill) and self.hands_off and bool(msg.xfer_id)
            self.stages.taken(msg.request_id, msg.traceparent, remote, handoff)
            try:  # validation (a grammar's compile) is part of the request's queue
                request = self.engine.new_request(
                    msg.request_id,
                    list(msg.prompt_token_ids),
                    msg.sampling,
                    output_token_ids=msg.output_token_ids,
                )
            except ValueError:
                self.stages.forget(msg.request_id)
                raise
            answer = take(msg, request)
            if isinstance(answer, Reserved):  # a decode node's reservation (its span, if traced)
                self.stages.reserved(msg.request_id, len(answer.block_ids), answer.cached_tokens)
            if msg.request_id in self.engine.scheduler.requests:
                self.membership.take_lease(msg.request_id)
            else:
                self.stages.forget(msg.request_id)
            return answer

        return admit

    def refusal(self) -> tuple[Failure, str] | None:
        """Why a new request must be refused now (None when it can be taken)."""
        if self.drain_deadline is not None:
            return Failure.DRAINING, "node is shutting down"
        limit = self.config.max_queued_requests
        if len(self.engine.scheduler.requests) >= limit:
            return Failure.BUSY, f"node holds its maximum of {limit} requests"
        return None

    def on_abort(self, msg: Abort) -> None:
        self.abort(msg.request_id)

    def report_integrity(self, msg: CheckIntegrity) -> IntegrityReport:
        return integrity_report(self.engine, msg.nonce)

    def resync_prefixes(self, _: SyncPrefixes) -> None:
        """A router lost track of our prefix-cache changes: send it the whole index now."""
        events = self.engine.kv.pool.prefix_events
        if events is not None:
            events.resync()
            self.membership.report_soon()

    # -- shared ----------------------------------------------------------------------------

    def send(self, messages: Iterable[Told]) -> None:
        """Tell each message's request's router, one by one as they come; stage events are
        recorded, not sent."""
        for msg in messages:
            out = self.stages.record(msg)
            if out is not None:
                self.membership.tell(out.request_id, out)

    def poll_io(self) -> None:
        self.send(self.io_messages())

    def step(self) -> None:
        self.send(self.step_messages())

    def registration(self) -> RegisterNode:
        """How this node announces itself to a router (the same for the life of the process)."""
        port = self.kv.port if self.kv is not None else None
        return RegisterNode(
            node_id=self.node_id,
            role=self.role,
            kv_endpoints=self.kv.endpoints if self.kv is not None else (),
            kv_connector=port.connector if port else "",
            layout_digest=port.digest if port else "",
            num_blocks=self.engine.runner.num_blocks,
            block_size=self.block_size,
            max_model_len=self.engine.max_model_len,
            incarnation=self.incarnation,
            host_id=port.host_id if port else "",
            kv_layout=port.layout if port else None,
            tp_size=self.config.tensor_parallel_size,
            kv_store=self.engine.tiers.store_id if self.engine.tiers is not None else "",
        )

    def status(self) -> NodeStatus:
        """This node's load and prefix-cache changes for a heartbeat (`engine_status`); the
        health gauges are refreshed with it."""
        status = engine_status(self.engine, self.drain_deadline is not None)
        if self.health is not None:
            self.publish_gauges(status.queued_tokens)
        return status

    def heartbeat(self, now: bool = False) -> None:
        """Report this node's status to every router once per interval (`now`: at once)."""
        if now:
            self.membership.report_soon()
        if self.membership.heartbeat_due():
            self.membership.heartbeat(self.status())

    def expire_leases(self) -> None:
        """Fail and free the requests whose lease ran out."""
        if not self.membership.lease_check_due():
            return
        if self.membership.lapsed():  # renewals may wait in the links after a long step
            self.handle_all(0)
        for rid in self.membership.expire_leases(self.engine.scheduler.requests):
            log.warning("lease of request %s expired: freeing it", rid)
            self.stages.lease_expired(rid, self.config.lease_timeout)  # counted; a span if traced
            self.abort(rid)
            why = "lease expired: the router stopped renewing"
            self.membership.tell(rid, Error(rid, why, Failure.LEASE_EXPIRED))

    def publish_gauges(self, queued_tokens: int) -> None:
        """Refresh what the health endpoint's /metrics reports (a role may add gauges)."""
        draining = self.drain_deadline is not None
        self.health.gauges = engine_gauges(self.engine, queued_tokens, draining)
        self.metrics.tiers.publish(tier_report(self.engine))

    def handle(self, msg: Message, link: int = 0) -> None:
        """Run this role's handler for `msg`, which came on `link`; bad input fails only its
        request."""
        self.membership.link = link
        rid = getattr(msg, "request_id", "")
        try:
            handler = self._handlers.get(type(msg))
            if handler is None:
                raise ValueError(f"{self.role} node does not take {msg.TYPE}")
            answer = handler(msg)
            if answer is not None:
                self.membership.reply(answer)
        except ValueError as exc:  # bad input for one request: fail it, keep serving
            log.warning("request %s refused: %s", rid, exc)
            if rid:
                self.membership.reply(Error(rid, str(exc), Failure.BAD_REQUEST))

    def handle_all(self, timeout_ms: int) -> None:
        """Handle every message that arrives from any router within timeout_ms."""
        for link, msg in self.membership.control.recv(timeout_ms):
            self.handle(msg, link)

    def abort(self, request_id: str) -> None:
        """Free everything the request holds here; idempotent."""
        self.engine.abort(request_id)
        self.membership.drop_lease(request_id)
        self.stages.forget(request_id)

    def fail(self, why: str) -> None:
        """Stop on our own for a reason the process exits non-zero with."""
        self.fatal = why
        log.error("%s", why)
        self.stop_event.set()

    def group_broken(self, why: str) -> None:
        """A rank is gone: stop, fencing what is held here (routers move it on at once)."""
        self.fail(f"tensor-parallel group broken: {why}")
        for rid in list(self.membership.leases):
            self.membership.tell(rid, Error(rid, self.fatal or why, Failure.TP_BROKEN))

    def drain(self) -> None:
        """Stop taking requests; finish (or, past drain_timeout, fail) what is held; exit.
        A second call stops at once."""
        if self.drain_deadline is not None:
            self.stop_event.set()
            return
        self.drain_deadline = time.monotonic() + self.config.drain_timeout
        self.membership.report_soon()  # tell the routers now

    def _drained(self) -> bool:
        if not self.engine.scheduler.requests:
            return True
        if time.monotonic() < self.drain_deadline:
            return False
        for rid in list(self.engine.scheduler.requests):
            self.abort(rid)
            why = "node shut down before the request finished"
            self.membership.tell(rid, Error(rid, why, Failure.DRAINING))
        return True

    def live(self) -> bool:
        """The loop made progress within stall_timeout."""
        return time.monotonic() - self._last_progress < self.config.stall_timeout

    def ready(self) -> bool:
        """A router accepted this node and it takes new requests."""
        return bool(self.membership.accepted) and self.drain_deadline is None

    def run(self) -> None:
        """Serve until stop_event is set, or until drained after drain(); a lost
        tensor-parallel rank stops the node (`fatal` says which)."""
        self.membership.start()
        if self.health is not None:
            self.heartbeat(now=True)  # gauges before the first probe
            self.health.start()
        while not self.stop_event.is_set():
            self._last_progress = time.monotonic()
            try:
                if not self._turn():
                    break
            except (RuntimeError, GroupBroken):  # a collective of the step saw a rank go
                broken = self._rank_lost()
                if broken is None:
                    raise
                self.group_broken(broken)
                break
        self.stop_event.set()
        self.close()

    def _turn(self) -> bool:
        """One turn of the loop; False when the node stops."""
        broken = self.engine.broken()
        if broken is not None:  # a rank is gone: the whole node goes (and is restarted)
            self.group_broken(broken)
            return False
        self.handle_all(0 if self.engine.has_unfinished else 5)
        self.poll_io()
        if self.engine.has_unfinished:
            self.step()
        self.expire_leases()
        self.heartbeat()
        if self.drain_deadline is not None and self._drained():
            self.heartbeat(now=True)
            return False
        return True

    def _rank_lost(self, wait_s: float = 2.0) -> str | None:
        """After a step failed: the lost rank that broke it, if one did (its exit shows within
        moments of the closed connection the step saw), else None."""
        if self.engine.runner.driver is None:
            return None
        deadline = time.monotonic() + wait_s
        while (broken := self.engine.broken()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return broken

    def close(self) -> None:
        if self.health is not None:
            self.health.close()
        self.membership.close(linger_ms=1000 if self.fatal else 0)  # fences go out
        if self.kv is not None:
            self.kv.close()
        self.engine.close()
        if self.tracer is not None:
            self.tracer.close()
