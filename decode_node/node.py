"""The decode node: reserves blocks for prompts, receives their KV, decodes them in batches."""

from __future__ import annotations

import logging
import uuid

from pdserve.common.engine.scheduler import SampledToken
from pdserve.common.node.loop import EngineNode
from pdserve.common.wire.codecs import sampling_from_wire
from pdserve.common.wire.messages import (
    Admitted,
    Busy,
    Error,
    Failure,
    Message,
    RenewTransfer,
    Reserved,
    ReserveKV,
)
from pdserve.kv_transfer import create_receiver, node_layout
from pdserve.kv_transfer.channel import use_curve

log = logging.getLogger(__name__)


class DecodeNode(EngineNode):
    """Admission by reservation: ReserveKV holds the prompt's blocks now or answers Busy;
    the prefill node writes into them; KVDone (the transfer's end) admits the request."""

    role = "decode"

    def __init__(
        self, *args, kv_connector: str = "zmq", host: str = "127.0.0.1", kv_port: int = 0, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.connector = kv_connector
        self.layout = node_layout(self.engine, self.model_config.model_dir)
        use_curve(self.control.curve)  # the KV side channel is a cluster link too
        self.receiver = create_receiver(
            kv_connector, self.layout, self.engine.runner.kv_caches, host=host, port=kv_port
        )
        self.xfer_to_rid: dict[str, str] = {}
        self.rid_to_xfer: dict[str, str] = {}

    def kv_endpoint(self) -> str:
        return self.receiver.endpoint

    def kv_connector(self) -> str:
        return self.connector

    def layout_digest(self) -> str:
        return self.layout.digest()

    def on_message(self, msg: Message) -> None:
        if isinstance(msg, ReserveKV):
            self.reserve(msg)
        elif isinstance(msg, RenewTransfer):
            self.renew_transfer(msg.request_id)
        else:
            super().on_message(msg)

    def reserve(self, msg: ReserveKV) -> None:
        sampling = sampling_from_wire(msg.sampling)
        request = self.engine.new_request(
            msg.request_id,
            list(msg.prompt_token_ids),
            sampling,
            output_token_ids=msg.output_token_ids,
        )
        block_ids = self.engine.scheduler.reserve(request)
        if block_ids is None:
            self.control.send(Busy(msg.request_id, "no free blocks"))
            return
        self.take_lease(msg.request_id)
        self.expect(msg.request_id, block_ids)

    def expect(self, request_id: str, block_ids: list[int]) -> None:
        """Open a transfer into the reserved blocks and tell the router where to send."""
        xfer_id = uuid.uuid4().hex  # made here, never taken from a client
        self.receiver.expect(xfer_id, block_ids)
        self.xfer_to_rid[xfer_id] = request_id
        self.rid_to_xfer[request_id] = xfer_id
        self.control.send(Reserved(request_id, xfer_id, tuple(block_ids), self.receiver.endpoint))

    def renew_transfer(self, request_id: str) -> None:
        """The prefill node feeding a reservation died: same blocks, a new transfer id; frames
        of the old one that still arrive are dropped."""
        old = self.rid_to_xfer.pop(request_id, None)
        if old is None:  # not reserved here (any more): nothing to renew
            self.control.send(Error(request_id, "no reservation to renew", Failure.NO_RESERVATION))
            return
        self.xfer_to_rid.pop(old, None)
        self.receiver.cancel(old)
        self.expect(request_id, self.engine.kv.block_ids(request_id))

    def poll_io(self) -> None:
        for result in self.receiver.poll(0):
            rid = self.xfer_to_rid.pop(result.xfer_id, None)
            if rid is None:
                continue
            self.rid_to_xfer.pop(rid, None)
            if not result.ok:  # fail closed: never decode from corrupt or partial KV
                self.engine.abort(rid)
                self.control.send(
                    Error(rid, f"KV transfer failed: {result.error}", Failure.KV_FAILED)
                )
                continue
            first = SampledToken(rid, int(result.meta["first_token"]))
            # The prefill node already streamed the first token (and any finish) to the router.
            self.engine.scheduler.admit_remote(rid, first)
            self.control.send(Admitted(rid))

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        xfer_id = self.rid_to_xfer.pop(request_id, None)
        if xfer_id is not None:
            self.xfer_to_rid.pop(xfer_id, None)
            self.receiver.cancel(xfer_id)

    def close(self) -> None:
        self.receiver.close()
        super().close()
