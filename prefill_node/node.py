"""The prefill node: chunked prefill of queued prompts, KV shipped to decode nodes' blocks."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import zmq

from pdserve.common.engine.scheduler import RequestUpdate, SchedulerOutput
from pdserve.common.node.loop import EngineNode
from pdserve.common.wire.messages import Error, Failure, Prefill
from pdserve.kv_transfer import KVSender, create_sender, node_layout
from pdserve.kv_transfer.channel import use_curve

log = logging.getLogger(__name__)

# What a broken or refused KV connection raises (TransferError/TransferTimeout included).
SEND_ERRORS = (RuntimeError, OSError, zmq.ZMQError)


@dataclass(frozen=True, slots=True)
class Shipment:
    """One request's pages of one step: source blocks here into reserved blocks there."""

    endpoint: str
    xfer_id: str
    src: list[int]
    dst: list[int]


class PrefillNode(EngineNode):
    """Runs prompts to their first token and hands each off: KV pages go to the reserved
    blocks of the decode node, the first token to the router."""

    role = "prefill"

    def __init__(
        self, *args, kv_connector: str = "zmq", connect_timeout: float = 10.0, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.connector = kv_connector
        self.connect_timeout = connect_timeout
        self.layout = node_layout(self.engine, self.model_config.model_dir)
        use_curve(self.control.curve)  # the KV side channel is a cluster link too
        self.senders: dict[str, KVSender] = {}
        self.dests: dict[str, Prefill] = {}  # request id -> where its KV goes
        self.next_block: dict[str, int] = {}  # request id -> first block not yet fully sent

    def kv_connector(self) -> str:
        return self.connector

    def layout_digest(self) -> str:
        return self.layout.digest()

    def _sender(self, endpoint: str) -> KVSender:
        sender = self.senders.get(endpoint)
        if sender is None:  # handshake once per decode node; a layout mismatch raises here
            sender = create_sender(self.connector, self.layout)
            sender.connect(endpoint, self.connect_timeout)
            self.senders[endpoint] = sender
        return sender

    def on_prefill(self, msg: Prefill) -> None:
        if not msg.xfer_id:
            raise ValueError("a prefill node needs a destination (xfer_id and blocks)")
        try:
            self._sender(msg.dest_kv_endpoint)
        except SEND_ERRORS as exc:  # the decode node is unreachable: fail this request only
            self.control.send(
                Error(msg.request_id, f"KV connection failed: {exc}", Failure.KV_FAILED)
            )
            return
        self.add_request(msg)
        self.dests[msg.request_id] = msg
        self.next_block[msg.request_id] = 0

    def step(self) -> None:
        output = self.engine.scheduler.schedule()
        if output.empty:
            self.engine.runner.forget(output.finished_ids)
            return
        shipments = self.plan_kv(output)
        failed: dict[str, str] = {}  # decode node endpoint -> why sending to it failed

        def ship_layer(layer: int) -> None:
            # Runs inside the forward right after layer `layer` wrote its K/V: its pages are
            # gathered and handed to the transport while the later layers compute.
            cache = self.engine.runner.kv_caches[layer]
            for ship in shipments:
                if ship.endpoint in failed:
                    continue
                try:
                    self.senders[ship.endpoint].send_layer(
                        ship.xfer_id, layer, ship.src, ship.dst, cache
                    )
                except SEND_ERRORS as exc:
                    failed[ship.endpoint] = str(exc)

        sampled = self.engine.runner.execute(output, on_layer=ship_layer if shipments else None)
        for update in self.engine.scheduler.update(output, sampled):
            dest = self.dests.get(update.request_id)
            if dest is not None and dest.dest_kv_endpoint in failed:
                continue  # failed below, before any of its tokens reach the client
            self.send_update(update)  # the first token goes to the client at once
            self.hand_off(update, failed)
        for endpoint, error in failed.items():
            self.drop_destination(endpoint, error)

    def plan_kv(self, output: SchedulerOutput) -> list[Shipment]:
        """Which blocks of this step go where: every block not yet sent up to what the step
        writes. The first chunk also sends the prefix-cache hits it did not compute; a partly
        filled last block is sent again once the next chunk completes it."""
        bs = self.block_size
        shipments = []
        for seq in output.seqs:
            dest = self.dests.get(seq.request_id)
            if dest is None:
                continue
            end = seq.start_pos + len(seq.token_ids)
            first, last = self.next_block[seq.request_id], -(-end // bs)
            self.next_block[seq.request_id] = end // bs
            src, dst = list(seq.block_ids[first:last]), list(dest.dest_block_ids[first:last])
            shipments.append(Shipment(dest.dest_kv_endpoint, dest.xfer_id, src, dst))
        return shipments

    def hand_off(self, update: RequestUpdate, failed: dict[str, str]) -> None:
        dest = self.dests.pop(update.request_id, None)
        self.next_block.pop(update.request_id, None)
        if dest is None:
            return
        meta = {"first_token": update.new_token_ids[0], "n_tokens": len(dest.prompt_token_ids)}
        self.engine.scheduler.release(update.request_id)
        try:
            self.senders[dest.dest_kv_endpoint].send_done(dest.xfer_id, meta)
        except SEND_ERRORS as exc:
            failed[dest.dest_kv_endpoint] = str(exc)
            self.control.send(
                Error(update.request_id, f"KV transfer failed: {exc}", Failure.KV_FAILED)
            )

    def drop_destination(self, endpoint: str, error: str) -> None:
        """A connection to a decode node broke: fail every request bound there (the router
        then aborts their reservations) and reconnect on the next request."""
        log.warning("KV connection to %s failed: %s", endpoint, error)
        sender = self.senders.pop(endpoint, None)
        if sender is not None:
            sender.close()
        for rid in [rid for rid, d in self.dests.items() if d.dest_kv_endpoint == endpoint]:
            self.abort(rid)
            self.control.send(
                Error(rid, f"KV transfer to the decode node failed: {error}", Failure.KV_FAILED)
            )

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self.dests.pop(request_id, None)
        self.next_block.pop(request_id, None)

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()
        super().close()
