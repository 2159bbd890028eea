"""The decode node: reserves blocks for prompts, receives their KV, decodes them in batches."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

from pdserve.common.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.common.engine.request import Request
from pdserve.common.engine.scheduler import SampledToken
from pdserve.common.node.config import NodeConfig
from pdserve.common.node.loop import EngineNode, Handler, Told
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
from pdserve.kv_transfer import KVPort

log = logging.getLogger(__name__)


class DecodeNode(EngineNode):
    """Admission by reservation: ReserveKV holds the prompt's blocks now (sharing those its
    prefix cache holds) or answers Busy; the prefill node writes into the rest; KVDone (the
    transfer's end) admits the request. A Prefill without destination runs here whole."""

    role = "decode"
    reports_prefixes = True  # the router sends a conversation's next turn where it is cached
    kv_port: KVPort

    def __init__(
        self, model: ModelConfig, cache: CacheConfig, scheduler: SchedulerConfig, node: NodeConfig
    ) -> None:
        super().__init__(model, cache, scheduler, node)
        self.kv_port = KVPort(
            node.kv_connector,
            self.engine.kv_layout(),
            self.curve,
            advertise_host=self.advertise_host,
        )
        self.receiver = self.kv_port.listen(
            self.engine.runner.kv_caches, node.host, node.kv_port, node.kv_fence_timeout
        )
        self.xfer_to_rid: dict[str, str] = {}
        self.rid_to_xfer: dict[str, str] = {}

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
        return self.expect(msg.request_id)

    def expect(self, request_id: str) -> Reserved:
        """Open a transfer into the request's reserved blocks and tell the router where to
        send. Blocks this node's prefix cache supplied are shared: the transfer may not write
        them (the receiver refuses frames outside the blocks it expects)."""
        block_ids = self.engine.kv.block_ids(request_id)
        cached = self.engine.scheduler.requests[request_id].num_cached_tokens
        xfer_id = uuid.uuid4().hex  # made here, never taken from a client
        self.receiver.expect(xfer_id, block_ids[cached // self.block_size :])
        self.xfer_to_rid[xfer_id] = request_id
        self.rid_to_xfer[request_id] = xfer_id
        return Reserved(
            request_id,
            xfer_id,
            tuple(block_ids),
            self.receiver.endpoint,
            self.incarnation,
            cached_tokens=cached,
        )

    def renew_transfer(self, msg: RenewTransfer) -> Reserved | Error:
        """The prefill node feeding a reservation died: same blocks, a new transfer id; frames
        of the old one that still arrive are dropped."""
        request_id = msg.request_id
        old = self.rid_to_xfer.pop(request_id, None)
        if old is None:  # not reserved here (any more): nothing to renew
            return Error(request_id, "no reservation to renew", Failure.NO_RESERVATION)
        self.xfer_to_rid.pop(old, None)
        self.receiver.cancel(old)
        return self.expect(request_id)

    def publish_gauges(self, queued_tokens: int) -> None:
        super().publish_gauges(queued_tokens)
        received = self.receiver.pages_received * self.kv_port.layout.page_bytes
        self.health.gauges["pdserve_node_kv_received_bytes"] = received

    def io_messages(self) -> Iterator[Told]:
        for xfer_id in self.receiver.released():  # no remote write can reach them now
            self.engine.kv.release_held(xfer_id)
        for result in self.receiver.poll(0):
            rid = self.xfer_to_rid.pop(result.xfer_id, None)
            if rid is None:
                continue
            self.rid_to_xfer.pop(rid, None)
            if not result.ok:  # fail closed: never decode from corrupt or partial KV
                self.engine.abort(rid)
                why = f"KV transfer failed: {result.error}"
                yield Error(rid, why, Failure.KV_FAILED)
                continue
            first = SampledToken(rid, result.first.token_id, result.first.logprobs)
            # The prefill node already streamed the first token (and any finish) to the router.
            self.engine.scheduler.admit_remote(rid, first)
            yield Admitted(rid)

    def abort(self, request_id: str) -> None:
        xfer_id = self.rid_to_xfer.pop(request_id, None)
        if xfer_id is not None and self.receiver.fences:
            # Remote writes of the transfer may still land: its blocks stay held until the
            # receiver says no sender can write them any more (`released`).
            self.engine.kv.hold(request_id, xfer_id)
        super().abort(request_id)
        if xfer_id is not None:
            self.xfer_to_rid.pop(xfer_id, None)
            self.receiver.cancel(xfer_id)

    def close(self) -> None:
        self.kv_port.close()
        super().close()
