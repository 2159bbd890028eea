"""The prefill node: chunked prefill of queued prompts, KV shipped to decode nodes' blocks."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace

from pdserve.common.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.common.engine.model_runner import LayerCall
from pdserve.common.engine.request import Request
from pdserve.common.engine.scheduler import RequestUpdate, SchedulerOutput
from pdserve.common.node.config import NodeConfig
from pdserve.common.node.loop import EngineNode, Handler
from pdserve.common.node.stages import KVSent, Told
from pdserve.common.wire.messages import Error, Failure, Message, Prefill
from pdserve.common.wire.payloads import FirstToken
from pdserve.kv_transfer.commands import Shipment
from pdserve.kv_transfer.ranks import SEND_ERRORS, KVGroup, MovesKV

log = logging.getLogger(__name__)


class PrefillNode(MovesKV, EngineNode):
    """Runs prompts to their first token and hands each off: KV pages go to the reserved
    blocks of the decode node, the first token to the router."""

    role = "prefill"
    reports_prefixes = True
    hands_off = True
    kv: KVGroup

    def __init__(
        self, model: ModelConfig, cache: CacheConfig, scheduler: SchedulerConfig, node: NodeConfig
    ) -> None:
        if model.enforce_eager is None and model.compile_mode is None:  # prompts only: no decode
            model = replace(model, enforce_eager=True)
        super().__init__(model, cache, scheduler, node)
        self.dests: dict[str, Prefill] = {}  # request id -> where its KV goes
        self.next_block: dict[str, int] = {}  # request id -> first block not yet fully sent
        self.shipping = False  # this step's forward ships KV (its failures are read after it)

    def handlers(self) -> dict[type[Message], Handler]:
        return {**super().handlers(), Prefill: self.admitting(self.on_prefill)}

    def on_prefill(self, msg: Prefill, request: Request) -> Error | None:
        if not msg.xfer_id:
            if msg.sampling.scores_prompt_only:  # no KV goes anywhere
                self.engine.scheduler.add_request(request)
                return None
            raise ValueError("a prefill node needs a destination (xfer_id and blocks)")
        try:  # every rank handshakes once per decode rank; a layout mismatch raises here
            self.kv.connect(msg.dest_kv_endpoints, msg.dest_kv_instance)
        except SEND_ERRORS as exc:  # the decode node is unreachable: fail this request only
            return Error(msg.request_id, f"KV connection failed: {exc}", Failure.KV_FAILED)
        self.engine.scheduler.add_request(request)
        self.dests[msg.request_id] = msg
        # The decode node holds the leading blocks already (its prefix cache): skip them.
        self.next_block[msg.request_id] = msg.dest_cached_tokens // self.block_size
        return None

    def stepped(self, updates: list[RequestUpdate]) -> Iterator[Told]:
        failed: dict[str, str] = {}  # decode node (its rank 0 endpoint) -> why sending failed
        if self.shipping:  # what broke on any rank while the layers went out
            failed.update(self.kv.take_failures())
            self.shipping = False
        for update in updates:
            dest = self.dests.get(update.request_id)
            if dest is not None and dest.dest_kv_endpoints[0] in failed:
                continue  # failed below, before any of its tokens reach the client
            yield update.tokens()  # sent now: the first token reaches the client first
            yield from self.hand_off(update, failed)
        for endpoint, error in failed.items():
            yield from self.drop_destination(endpoint, error)

    def layer_call(self, output: SchedulerOutput) -> LayerCall | None:
        """The layer call of this step's forward, on every rank: each layer's new pages (each
        rank its slices) leave as soon as the layer wrote them, while the later layers
        compute."""
        shipments = self.plan_kv(output)
        if not shipments:
            return None
        self.shipping = True
        return self.kv.ship(shipments)

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
            src, dst = seq.block_ids[first:last], dest.dest_block_ids[first:last]
            shipments.append(Shipment(dest.dest_kv_endpoints, dest.xfer_id, src, dst))
        return shipments

    def hand_off(self, update: RequestUpdate, failed: dict[str, str]) -> Iterator[Told]:
        """The request's KV is all sent: send the transfer's done message with the first
        token, and release the request here (the decode node goes on from that token)."""
        dest = self.dests.pop(update.request_id, None)
        self.next_block.pop(update.request_id, None)
        if dest is None:
            return
        lps = update.new_logprobs
        first = FirstToken(update.new_token_ids[0], lps[0] if lps else None)
        self.engine.scheduler.release(update.request_id)
        endpoints = list(dest.dest_kv_endpoints)
        pages = len(dest.dest_block_ids) - dest.dest_cached_tokens // self.block_size
        try:
            self.kv.done(endpoints, dest.xfer_id, first)
        except SEND_ERRORS as exc:
            failed[endpoints[0]] = str(exc)
            why = f"KV transfer failed: {exc}"
            yield Error(update.request_id, why, Failure.KV_FAILED)
        yield KVSent(update.request_id, pages, endpoints[0] not in failed)

    def drop_destination(self, endpoint: str, error: str) -> Iterator[Told]:
        """A connection to a decode node (named by its rank 0 endpoint) broke: fail every
        request bound there (the router then aborts their reservations) and reconnect on the
        next request."""
        log.warning("KV connection to %s failed: %s", endpoint, error)
        bound = [(rid, d) for rid, d in self.dests.items() if d.dest_kv_endpoints[0] == endpoint]
        for rid, _ in bound:
            self.abort(rid)
            yield KVSent(rid, 0, ok=False)  # counted as a failed transfer
            why = f"KV transfer to the decode node failed: {error}"
            yield Error(rid, why, Failure.KV_FAILED)
        if bound:
            self.kv.drop(bound[0][1].dest_kv_endpoints)

    def io_messages(self) -> Iterator[Told]:
        if self.kv.port.connector == "nixl":  # decode nodes' notices (cancels to answer)
            self.kv.poll_senders()
        return iter(())

    def abort(self, request_id: str) -> None:
        dest = self.dests.pop(request_id, None)
        if dest is not None:
            try:  # a transport still reading our blocks (nixl) finishes before they are freed
                self.kv.abandon(dest.dest_kv_endpoints, dest.xfer_id)
            except SEND_ERRORS as exc:
                log.warning("abandoning KV transfer %s failed: %s", dest.xfer_id, exc)
        super().abort(request_id)
        self.next_block.pop(request_id, None)
