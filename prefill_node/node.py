"""The prefill node: chunked prefill of queued prompts, KV shipped to decode nodes' blocks."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import zmq

from pdserve.common.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.common.engine.request import Request
from pdserve.common.engine.scheduler import RequestUpdate, SchedulerOutput
from pdserve.common.node.config import NodeConfig
from pdserve.common.node.loop import EngineNode, Handler, Told
from pdserve.common.wire.messages import Error, Failure, Message, Prefill
from pdserve.common.wire.payloads import FirstToken
from pdserve.kv_transfer import KVPort

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
    reports_prefixes = True
    kv_port: KVPort

    def __init__(
        self, model: ModelConfig, cache: CacheConfig, scheduler: SchedulerConfig, node: NodeConfig
    ) -> None:
        if model.enforce_eager is None:  # it runs prompts only: compiled decode steps never run
            model = replace(model, enforce_eager=True)
        super().__init__(model, cache, scheduler, node)
        self.kv_port = KVPort(
            node.kv_connector,
            self.engine.kv_layout(),
            self.curve,
            node.connect_timeout,
            self.advertise_host,
        )
        self.dests: dict[str, Prefill] = {}  # request id -> where its KV goes
        self.next_block: dict[str, int] = {}  # request id -> first block not yet fully sent

    def handlers(self) -> dict[type[Message], Handler]:
        return {**super().handlers(), Prefill: self.admitting(self.on_prefill)}

    def on_prefill(self, msg: Prefill, request: Request) -> Error | None:
        if not msg.xfer_id:
            if msg.sampling.max_tokens == 0:  # scoring a prompt: no KV goes anywhere
                self.engine.scheduler.add_request(request)
                return None
            raise ValueError("a prefill node needs a destination (xfer_id and blocks)")
        try:  # handshake once per decode node; a layout mismatch raises here
            self.kv_port.sender(msg.dest_kv_endpoint, msg.dest_kv_instance)
        except SEND_ERRORS as exc:  # the decode node is unreachable: fail this request only
            return Error(msg.request_id, f"KV connection failed: {exc}", Failure.KV_FAILED)
        self.engine.scheduler.add_request(request)
        self.dests[msg.request_id] = msg
        # The decode node holds the leading blocks already (its prefix cache): skip them.
        self.next_block[msg.request_id] = msg.dest_cached_tokens // self.block_size
        return None

    def step_messages(self) -> Iterator[Told]:
        failed: dict[str, str] = {}  # decode node endpoint -> why sending to it failed
        for update in self.engine.step(on_layer=lambda output: self.ship_kv(output, failed)):
            dest = self.dests.get(update.request_id)
            if dest is not None and dest.dest_kv_endpoint in failed:
                continue  # failed below, before any of its tokens reach the client
            yield update.tokens()  # sent now: the first token reaches the client first
            yield from self.hand_off(update, failed)
        for endpoint, error in failed.items():
            yield from self.drop_destination(endpoint, error)

    def ship_kv(
        self, output: SchedulerOutput, failed: dict[str, str]
    ) -> Callable[[int], None] | None:
        """The layer hook of this step's forward: each layer's new pages leave as soon as the
        layer wrote them, while the later layers compute. Broken connections go to `failed`."""
        shipments = self.plan_kv(output)
        if not shipments:
            return None
        senders = self.kv_port.senders

        def ship_layer(layer: int) -> None:
            cache = self.engine.runner.kv_caches[layer]
            for ship in shipments:
                if ship.endpoint in failed:
                    continue
                try:
                    senders[ship.endpoint].send_layer(
                        ship.xfer_id, layer, ship.src, ship.dst, cache
                    )
                except SEND_ERRORS as exc:
                    failed[ship.endpoint] = str(exc)

        return ship_layer

    def plan_kv(self, output: SchedulerOutput) -> list[Shipment]:
        """Which blocks of this step go where: every block not yet sent up to what the step
        writes. The first chunk also sends the prefix-cache hits it did not compute; a partly
        filled last block is sent again once the next chunk completes it. Blocks the decode node
        already holds (Prefill.dest_cached_tokens) are never sent."""
        bs = self.block_size
        shipments = []
        for seq in output.seqs:
            dest = self.dests.get(seq.request_id)
            if dest is None:
                continue
            end = seq.start_pos + len(seq.token_ids)
            first, last = self.next_block[seq.request_id], -(-end // bs)
            if first >= last:
                continue  # this chunk wrote only blocks the decode node has cached
            self.next_block[seq.request_id] = end // bs
            src, dst = list(seq.block_ids[first:last]), list(dest.dest_block_ids[first:last])
            shipments.append(Shipment(dest.dest_kv_endpoint, dest.xfer_id, src, dst))
        return shipments

    def hand_off(self, update: RequestUpdate, failed: dict[str, str]) -> Iterator[Error]:
        """The request's KV is all sent: send the transfer's done message with the first
        token, and release the request here (the decode node goes on from that token)."""
        dest = self.dests.pop(update.request_id, None)
        self.next_block.pop(update.request_id, None)
        if dest is None:
            return
        lps = update.new_logprobs
        first = FirstToken(update.new_token_ids[0], lps[0] if lps else None)
        self.engine.scheduler.release(update.request_id)
        try:
            self.kv_port.senders[dest.dest_kv_endpoint].send_done(dest.xfer_id, first)
        except SEND_ERRORS as exc:
            failed[dest.dest_kv_endpoint] = str(exc)
            why = f"KV transfer failed: {exc}"
            yield Error(update.request_id, why, Failure.KV_FAILED)

    def drop_destination(self, endpoint: str, error: str) -> Iterator[Error]:
        """A connection to a decode node broke: fail every request bound there (the router
        then aborts their reservations) and reconnect on the next request."""
        log.warning("KV connection to %s failed: %s", endpoint, error)
        self.kv_port.drop(endpoint)
        for rid in [rid for rid, d in self.dests.items() if d.dest_kv_endpoint == endpoint]:
            self.abort(rid)
            why = f"KV transfer to the decode node failed: {error}"
            yield Error(rid, why, Failure.KV_FAILED)

    def io_messages(self) -> Iterator[Told]:
        self.kv_port.poll()  # decode nodes' notices (nixl: cancels to answer)
        return iter(())

    def abort(self, request_id: str) -> None:
        dest = self.dests.pop(request_id, None)
        sender = self.kv_port.senders.get(dest.dest_kv_endpoint) if dest is not None else None
        if sender is not None:
            try:  # a transport still reading our blocks (nixl) finishes before they are freed
                sender.abandon(dest.xfer_id)
            except SEND_ERRORS as exc:
                log.warning("abandoning KV transfer %s failed: %s", dest.xfer_id, exc)
        super().abort(request_id)
        self.next_block.pop(request_id, None)

    def close(self) -> None:
        self.kv_port.close()
        super().close()
