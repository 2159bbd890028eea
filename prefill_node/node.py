"""The prefill node: chunked prefill of queued prompts, KV shipped to decode nodes' blocks."""

from __future__ import annotations

import logging

from common.node import EngineNode, sampling_from_wire
from common.protocol import Prefill
from common.scheduler import RequestUpdate, SchedulerOutput
from kv_transfer import KVSender, create_sender, node_layout

log = logging.getLogger(__name__)


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
        self._sender(msg.dest_kv_endpoint)
        sampling = sampling_from_wire(msg.sampling)
        self.engine.add_request(msg.request_id, list(msg.prompt_token_ids), sampling)
        self.dests[msg.request_id] = msg
        self.next_block[msg.request_id] = 0

    def step(self) -> None:
        output = self.engine.scheduler.schedule()
        if output.empty:
            self.engine.runner.forget(output.finished_ids)
            return
        sampled = self.engine.runner.execute(output)
        self.ship_kv(output)
        for update in self.engine.scheduler.update(output, sampled):
            self.send_update(update)  # the first token goes to the client at once
            self.hand_off(update)

    def ship_kv(self, output: SchedulerOutput) -> None:
        """Send every block not yet sent up to what this step wrote, layer by layer, to its
        reserved block. The first chunk also sends the prefix-cache hits it did not compute;
        a partly filled last block is sent again once the next chunk completes it."""
        bs = self.block_size
        for seq in output.seqs:
            dest = self.dests.get(seq.request_id)
            if dest is None:
                continue
            end = seq.start_pos + len(seq.token_ids)
            first, last = self.next_block[seq.request_id], -(-end // bs)
            self.next_block[seq.request_id] = end // bs
            src, dst = list(seq.block_ids[first:last]), list(dest.dest_block_ids[first:last])
            sender = self.senders[dest.dest_kv_endpoint]
            for layer, cache in enumerate(self.engine.runner.kv_caches):
                sender.send_layer(dest.xfer_id, layer, src, dst, cache)

    def hand_off(self, update: RequestUpdate) -> None:
        dest = self.dests.pop(update.request_id, None)
        self.next_block.pop(update.request_id, None)
        if dest is None:
            return
        meta = {"first_token": update.new_token_ids[0], "n_tokens": len(dest.prompt_token_ids)}
        self.senders[dest.dest_kv_endpoint].send_done(dest.xfer_id, meta)
        self.engine.scheduler.release(update.request_id)

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self.dests.pop(request_id, None)
        self.next_block.pop(request_id, None)

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()
        super().close()
