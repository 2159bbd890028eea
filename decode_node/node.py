"""The decode node: reserves blocks for prompts, receives their KV, decodes them in batches."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import replace

from pdserve.common.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.common.engine.request import Request
from pdserve.common.engine.scheduler import SampledToken
from pdserve.common.node.config import NodeConfig
from pdserve.common.node.loop import EngineNode, Handler
from pdserve.common.node.membership import NodeStatus
from pdserve.common.node.stages import KVWhole, Told
from pdserve.common.wire.messages import (
    Admitted,
    Busy,
    Error,
    Failure,
    Message,
    Prefill,
    RenewTransfer,
    Reserved,
    ReserveKV,
)
from pdserve.kv_transfer.commands import SliceDone
from pdserve.kv_transfer.ranks import KVGroup, MovesKV

log = logging.getLogger(__name__)


class DecodeNode(MovesKV, EngineNode):
    """Admission by reservation: ReserveKV holds the prompt's blocks now (sharing those its
    prefix cache holds) or answers Busy; the prefill node writes into the rest; KVDone (the
    transfer's end) admits the request. A Prefill without destination runs here whole."""

    role = "decode"
    reports_prefixes = True  # the router sends a conversation's next turn where it is cached
    kv: KVGroup

    def __init__(
        self, model: ModelConfig, cache: CacheConfig, scheduler: SchedulerConfig, node: NodeConfig
    ) -> None:
        super().__init__(model, cache, scheduler, node)
        # History pull: an answer's blocks go to the shared store when it ends, so that the
        # next turn's prefill node loads them instead of prefilling them (docs/kv_tiers.md).
        self.engine.kv.store_answers = cache.kv_store is not None
        self.fences = self.kv.local.receiver.fences
        self.xfer_to_rid: dict[str, str] = {}
        self.rid_to_xfer: dict[str, str] = {}
        # Each open transfer's slices not yet finished (on every rank), and the first failure.
        self.pending: dict[str, int] = {}
        self.problems: dict[str, str] = {}

    def handlers(self) -> dict[type[Message], Handler]:
        return {
            **super().handlers(),
            ReserveKV: self.admitting(self.reserve),
            Prefill: self.admitting(self.prefill_locally),
            RenewTransfer: self.renew_transfer,
        }

    def prefill_locally(self, msg: Prefill, request: Request) -> None:
        """The router placed this prompt's prefill here (it holds most of it, or a prefill
        node would cost more): run the request here from its first token, in chunks that
        leave every running request its token each step."""
        if msg.xfer_id:
            raise ValueError("a decode node prefills only for itself (no KV destination)")
        self.engine.scheduler.add_request(request)

    def refuse(self, msg: Prefill | ReserveKV, kind: Failure, why: str) -> Message:
        if isinstance(msg, ReserveKV):  # the router awaits the answer: it tries another node
            return Busy(msg.request_id, why)
        return Error(msg.request_id, why, kind)  # a stream waits on it: fail it over

    def reserve(self, msg: ReserveKV, request: Request) -> Reserved | Busy:
        if self.engine.scheduler.reserve(request) is None:
            return Busy(msg.request_id, "no free blocks")
        return self.expect(msg.request_id, msg.src_tp)

    def expect(self, request_id: str, src_tp: int) -> Reserved:
        """Open a transfer into the request's reserved blocks (each rank expects its slices
        from a prefill node at TP `src_tp`) and tell the router where to send. Blocks this
        node's prefix cache supplied are shared: the transfer may not write them (the
        receivers refuse frames outside the blocks they expect)."""
        block_ids = self.engine.kv.block_ids(request_id)
        cached = self.engine.scheduler.requests[request_id].num_cached_tokens
        xfer_id = uuid.uuid4().hex  # made here, never taken from a client
        sent = block_ids[cached // self.block_size :]
        self.pending[xfer_id] = self.kv.expect(xfer_id, sent, src_tp)
        self.xfer_to_rid[xfer_id] = request_id
        self.rid_to_xfer[request_id] = xfer_id
        return Reserved(
            request_id,
            xfer_id,
            tuple(block_ids),
            self.kv.endpoints,
            self.incarnation,
            cached_tokens=cached,
            src_tp=src_tp,
        )

    def renew_transfer(self, msg: RenewTransfer) -> Reserved | Error:
        """Another prefill node feeds a reservation (the old one died, or the router picked
        one of another TP size): same blocks, a new transfer id; frames of the old one that
        still arrive are dropped."""
        request_id = msg.request_id
        old = self.rid_to_xfer.pop(request_id, None)
        if old is None:  # not reserved here (any more): nothing to renew
            return Error(request_id, "no reservation to renew", Failure.NO_RESERVATION)
        self._forget(old)
        return self.expect(request_id, msg.src_tp)

    def _forget(self, xfer_id: str) -> None:
        self.xfer_to_rid.pop(xfer_id, None)
        self.pending.pop(xfer_id, None)
        self.problems.pop(xfer_id, None)
        self.kv.cancel(xfer_id)

    def status(self) -> NodeStatus:
        """The heartbeat's load with this node's busy seconds: the planner sizes decode by
        answer tokens per busy second (`planner/source.py`)."""
        return replace(super().status(), busy_seconds=self.stages.busy_seconds)

    def publish_gauges(self, queued_tokens: int) -> None:
        super().publish_gauges(queued_tokens)
        received = sum(self.kv.bytes_received())
        self.health.gauges["pdserve_node_kv_received_bytes"] = received

    def io_messages(self) -> Iterator[Told]:
        if self.fences:
            for xfer_id in self.kv.released():  # no remote write can reach them on any rank
                self.engine.kv.release_held(xfer_id)
        if not self.pending:
            return
        for done in self.kv.finished():
            yield from self._slice_done(done)

    def _slice_done(self, done: SliceDone) -> Iterator[Told]:
        """One rank's slice of a transfer finished: once every slice on every rank did, the
        request is admitted, or failed if any slice was not whole (fail closed: never decode
        from corrupt or partial KV)."""
        xfer_id = done.xfer_id
        rid = self.xfer_to_rid.get(xfer_id)
        if rid is None or xfer_id not in self.pending:
            return
        if not done.ok:
            self.problems.setdefault(xfer_id, done.error)
        self.pending[xfer_id] -= 1
        if self.pending[xfer_id] > 0:
            return
        problem = self.problems.pop(xfer_id, None)
        del self.pending[xfer_id], self.xfer_to_rid[xfer_id]
        self.rid_to_xfer.pop(rid, None)
        yield from self._kv_whole(rid, problem is None)
        if problem is not None:
            self.kv.cancel(xfer_id)  # the other ranks' slices, if any still open
            self.engine.abort(rid)
            yield Error(rid, f"KV transfer failed: {problem}", Failure.KV_FAILED)
            return
        token = done.first
        # The prefill node already streamed the first token (and any finish) to the router.
        self.engine.scheduler.admit_remote(rid, SampledToken(rid, token.token_id, token.logprobs))
        yield Admitted(rid)

    def _kv_whole(self, request_id: str, ok: bool) -> Iterator[KVWhole]:
        """The request's KV transfer ended on every rank: its stage (and span, if traced)."""
        request = self.engine.scheduler.requests.get(request_id)
        if request is None:
            return
        cached = request.num_cached_tokens // self.block_size
        yield KVWhole(request_id, ok, len(self.engine.kv.block_ids(request_id)) - cached)

    def abort(self, request_id: str) -> None:
        xfer_id = self.rid_to_xfer.pop(request_id, None)
        if xfer_id is not None and self.fences:
            # Remote writes of the transfer may still land: its blocks stay held until the
            # receiver says no sender can write them any more (`released`).
            self.engine.kv.hold(request_id, xfer_id)
        super().abort(request_id)
        if xfer_id is not None:
            self._forget(xfer_id)
