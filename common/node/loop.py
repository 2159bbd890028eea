"""The loop every node process runs, and the colocated ("both") role.

A node's loop reads like an engine step with I/O around it:

    handle control messages -> role I/O (KV arrivals) -> engine step -> heartbeat

Role differences live in small subclasses (prefill_node, decode_node, ColocatedNode here):
each adds its entries to the handler table (message type -> bound method) and overrides a few
hooks; there is no `if role == ...` in the loop.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import zmq

from pdserve.common.engine.block_pool import PrefixEvents
from pdserve.common.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.scheduler import RequestUpdate
from pdserve.common.node.config import NodeConfig
from pdserve.common.wire.codecs import (
    logprobs_to_wire,
    ranked_logprobs_to_wire,
    sampling_from_wire,
)
from pdserve.common.wire.control import ControlClient
from pdserve.common.wire.messages import (
    ALIVE_SUFFIX,
    Abort,
    Alive,
    CheckIntegrity,
    Error,
    Failure,
    Heartbeat,
    IntegrityReport,
    Lease,
    Message,
    Prefill,
    RegisterNode,
    Reregister,
    ReserveKV,
    SyncPrefixes,
    Tokens,
    encode,
)
from pdserve.common.wire.security import load_keys

if TYPE_CHECKING:  # a role that moves KV sets one; this module never needs kv_transfer
    from pdserve.kv_transfer.port import KVPort

log = logging.getLogger(__name__)

# A handler takes the message type it is filed under in the table.
Handler = Callable[[Any], None]


class EngineNode:
    """Base of every role: control link, engine, leases, the loop, and the handlers every role
    shares. A role sets `role`, adds its handlers in `handlers()`, and overrides hooks."""

    role: ClassVar[str] = ""
    reports_prefixes: ClassVar[bool] = False  # heartbeats carry prefix-cache changes
    kv_port: KVPort | None = None  # the node's KV connector, for roles that move KV

    def __init__(
        self, model: ModelConfig, cache: CacheConfig, scheduler: SchedulerConfig, node: NodeConfig
    ) -> None:
        assert self.role, "EngineNode is a base: build one of its roles"
        self.config = node
        self.engine = LLMEngine(model, cache, scheduler)
        self.model_config = model
        self.block_size = cache.block_size
        self.node_id = node.node_id or f"{self.role}-{uuid.uuid4().hex[:8]}"
        self.incarnation = uuid.uuid4().hex
        self.curve = load_keys(node.curve_dir)
        self.ctx = zmq.Context()
        self.control = ControlClient(self.ctx, node.router_addr, self.node_id, self.curve)
        self._next_heartbeat = 0.0
        self._prefix_seq = 0
        # Every request this node holds has a lease the router renews (Lease messages); one
        # left unrenewed for lease_timeout is freed and failed.
        self.leases: dict[str, float] = {}  # request id -> expiry (monotonic)
        self._next_lease_check = 0.0
        self.drain_deadline: float | None = None  # set once draining (SIGTERM)
        self._last_progress = time.monotonic()
        self._liveness = threading.Thread(target=self._prove_alive, daemon=True)
        if self.reports_prefixes:  # nodes a prefix-aware router picks by cache
            self.engine.kv.pool.prefix_events = PrefixEvents()
        self.stop_event = threading.Event()
        self._handlers = self.handlers()

    # -- the role's contract -----------------------------------------------------------------

    def handlers(self) -> dict[type[Message], Handler]:
        """What this node does with each control message; a role adds its own entries (the
        message that brings it new requests through `admitting`). Any other type is refused."""
        return {
            Abort: self.on_abort,
            Lease: self.renew_leases,
            Reregister: self.reregister,
            CheckIntegrity: self.report_integrity,
            SyncPrefixes: self.resync_prefixes,
        }

    def poll_io(self) -> None:
        """Role I/O between steps (e.g. KV arrivals on a decode node)."""

    def step(self) -> None:
        for update in self.engine.step():
            self.send_update(update)

    def refuse(self, request_id: str, kind: Failure, why: str) -> None:
        """Turn a new request away (draining, full): the router's failover reads `kind`."""
        self.control.send(Error(request_id, why, kind))

    # -- handlers every role shares ------------------------------------------------------------

    def admitting(self, take: Handler) -> Handler:
        """The handler of a message that brings a new request: `take` it, unless the node must
        refuse new requests now."""

        def admit(msg: Prefill | ReserveKV) -> None:
            why = self.refusal()
            if why is None:
                take(msg)
            else:
                self.refuse(msg.request_id, *why)

        return admit

    def refusal(self) -> tuple[Failure, str] | None:
        """Why a new request must be refused now (None when it can be taken)."""
        if self.drain_deadline is not None:
            return Failure.DRAINING, "node is shutting down"
        limit = self.config.max_queued_requests
        if len(self.engine.scheduler.requests) >= limit:
            return Failure.BUSY, f"node holds its maximum of {limit} requests"
        return None

    def add_request(self, msg: Prefill) -> None:
        """Queue a Prefill's request (resumed ones carry the tokens already streamed)."""
        self.engine.add_request(
            msg.request_id,
            list(msg.prompt_token_ids),
            sampling_from_wire(msg.sampling),
            output_token_ids=msg.output_token_ids,
        )
        self.take_lease(msg.request_id)

    def on_abort(self, msg: Abort) -> None:
        self.abort(msg.request_id)

    def renew_leases(self, msg: Lease) -> None:
        expiry = time.monotonic() + self.config.lease_timeout
        for rid in msg.request_ids:
            if rid in self.leases:
                self.leases[rid] = expiry

    def reregister(self, _: Reregister) -> None:
        """The router restarted: announce ourselves again."""
        self.register()
        self.heartbeat_now()

    def report_integrity(self, msg: CheckIntegrity) -> None:
        self.control.send(self.integrity_report(msg.nonce))

    def resync_prefixes(self, _: SyncPrefixes) -> None:
        if self.engine.kv.pool.prefix_events is not None:
            self.engine.kv.pool.prefix_events.resync()
            self._next_heartbeat = 0.0  # send the snapshot now

    # -- shared ----------------------------------------------------------------------------

    def send_update(self, update: RequestUpdate) -> None:
        reason = update.finish_reason.value if update.finish_reason else ""
        self.control.send(
            Tokens(
                request_id=update.request_id,
                token_ids=update.new_token_ids,
                logprobs=logprobs_to_wire(update.new_logprobs),
                finish_reason=reason,
                cached_tokens=update.cached_tokens,
                prompt_logprobs=ranked_logprobs_to_wire(update.prompt_logprobs),
            )
        )

    def take_lease(self, request_id: str) -> None:
        self.leases[request_id] = time.monotonic() + self.config.lease_timeout

    def register(self) -> None:
        port = self.kv_port
        self.control.send(
            RegisterNode(
                node_id=self.node_id,
                role=self.role,
                kv_endpoint=port.endpoint if port else "",
                kv_connector=port.connector if port else "",
                layout_digest=port.digest if port else "",
                num_blocks=self.engine.runner.num_blocks,
                block_size=self.block_size,
                max_model_len=self.engine.max_model_len,
                incarnation=self.incarnation,
            )
        )

    def heartbeat(self) -> None:
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.config.heartbeat_interval
        sched = self.engine.scheduler
        queued = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
        prefixes = {}
        pool = self.engine.kv.pool
        if pool.prefix_events is not None:
            reset, stored, removed = pool.prefix_events.drain(pool.cached)
            self._prefix_seq += 1
            prefixes = dict(
                prefix_seq=self._prefix_seq,
                prefix_reset=reset,
                prefix_stored=stored,
                prefix_removed=removed,
            )
        self.control.send(
            Heartbeat(
                node_id=self.node_id,
                free_blocks=self.engine.kv.num_free_blocks,
                num_running=len(sched.running),
                num_waiting=len(sched.waiting),
                queued_tokens=queued,
                draining=self.drain_deadline is not None,
                **prefixes,
            )
        )

    def handle(self, msg: Message) -> None:
        """Run this role's handler for `msg`; bad input fails only its request."""
        rid = getattr(msg, "request_id", "")
        try:
            handler = self._handlers.get(type(msg))
            if handler is None:
                raise ValueError(f"{self.role} node does not take {msg.TYPE}")
            handler(msg)
        except ValueError as exc:  # bad input for one request: fail it, keep serving
            log.warning("request %s refused: %s", rid, exc)
            if rid:
                self.control.send(Error(rid, str(exc), Failure.BAD_REQUEST))

    def abort(self, request_id: str) -> None:
        """Free everything the request holds here; idempotent."""
        self.engine.abort(request_id)
        self.leases.pop(request_id, None)

    def expire_leases(self) -> None:
        """Fail and free requests whose lease ran out; forget leases of ended requests."""
        now = time.monotonic()
        if now < self._next_lease_check:
            return
        self._next_lease_check = now + min(0.5, self.config.lease_timeout / 4)
        live = self.engine.scheduler.requests
        if any(expiry < now for expiry in self.leases.values()):
            # Renewals may be waiting in the socket after a long step: take them first.
            for msg in self.control.recv(0):
                self.handle(msg)
        for rid, expiry in list(self.leases.items()):
            if rid not in live:
                del self.leases[rid]
            elif expiry < now:
                log.warning("lease of request %s expired: freeing it", rid)
                self.abort(rid)
                self.control.send(
                    Error(rid, "lease expired: the router stopped renewing", Failure.LEASE_EXPIRED)
                )

    def drain(self) -> None:
        """Stop taking requests; finish (or, past drain_timeout, fail) what is held; exit.
        A second call stops at once."""
        if self.drain_deadline is not None:
            self.stop_event.set()
            return
        self.drain_deadline = time.monotonic() + self.config.drain_timeout
        self._next_heartbeat = 0.0  # tell the router now

    def _drained(self) -> bool:
        if not self.engine.scheduler.requests:
            return True
        if time.monotonic() < self.drain_deadline:
            return False
        for rid in list(self.engine.scheduler.requests):
            self.abort(rid)
            self.control.send(
                Error(rid, "node shut down before the request finished", Failure.DRAINING)
            )
        return True

    def integrity_report(self, nonce: int) -> IntegrityReport:
        kv = self.engine.kv
        try:
            self.engine.check_integrity()
            ok, detail = True, ""
        except AssertionError as exc:
            ok, detail = False, str(exc)
        return IntegrityReport(
            nonce=nonce,
            ok=ok,
            detail=detail,
            num_blocks=kv.pool.num_blocks - 1,
            free_blocks=kv.num_free_blocks,
            cached_blocks=len(kv.pool.cached),
            live_requests=tuple(self.engine.scheduler.requests),
        )

    def _prove_alive(self) -> None:
        """Liveness thread: tell the router this node lives every heartbeat interval, as long
        as the loop moved within stall_timeout (a wedged loop goes silent, and fails over)."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, (self.node_id + ALIVE_SUFFIX).encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        if self.curve is not None:
            self.curve.connect(sock)
        sock.connect(f"tcp://{self.control.router_addr}")
        frame = encode(Alive(self.node_id))
        try:
            while not self.stop_event.wait(self.config.heartbeat_interval):
                if time.monotonic() - self._last_progress < self.config.stall_timeout:
                    with contextlib.suppress(zmq.Again):
                        sock.send(frame, flags=zmq.NOBLOCK)
        finally:
            sock.close(linger=0)

    def run(self) -> None:
        """Serve until stop_event is set, or until drained after drain()."""
        self.register()
        self._liveness.start()
        while not self.stop_event.is_set():
            self._last_progress = time.monotonic()
            busy = self.engine.has_unfinished
            for msg in self.control.recv(0 if busy else 5):
                self.handle(msg)
            self.poll_io()
            if self.engine.has_unfinished:
                self.step()
            self.expire_leases()
            self.heartbeat()
            if self.drain_deadline is not None and self._drained():
                self.heartbeat_now()
                break
        self.stop_event.set()
        self._liveness.join(timeout=5.0)
        self.close()

    def heartbeat_now(self) -> None:
        self._next_heartbeat = 0.0
        self.heartbeat()

    def close(self) -> None:
        self.control.close()
        self.ctx.term()


class ColocatedNode(EngineNode):
    """Role "both": prefill and decode in one engine (vLLM-style mixed batches). A Prefill
    brings a whole request: the node runs it to its end itself."""

    role = "both"
    reports_prefixes = True

    def handlers(self) -> dict[type[Message], Handler]:
        return {**super().handlers(), Prefill: self.admitting(self.add_request)}
