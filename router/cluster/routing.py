"""Routing: puts a request on nodes, a colocated one, or a decode node's reservation then a
prefill node that fills it, each picked by the routing policy."""

from __future__ import annotations

import asyncio
import time

from pdserve.common.wire.codecs import sampling_to_wire
from pdserve.common.wire.messages import (
    Abort,
    Error,
    Failure,
    Prefill,
    RenewTransfer,
    Reserved,
    ReserveKV,
)
from pdserve.router.backend import TokenEvent
from pdserve.router.cluster.control import ControlServer
from pdserve.router.cluster.policies import Policy
from pdserve.router.cluster.registry import NodeInfo, NodeRegistry, kv_mismatch
from pdserve.router.cluster.streams import Stream


class Routing:
    """Sends a request on its way; it records the nodes chosen in the request's Stream and
    counts the request against them (inflight, routed prompt tokens)."""

    def __init__(
        self,
        registry: NodeRegistry,
        control: ControlServer,
        policy: Policy,
        hash_prompts: bool,
        reserve_wait: float,
    ) -> None:
        self.registry = registry
        self.control = control
        self.policy = policy
        self.hash_prompts = hash_prompts  # only the prefix_aware policy reads recent_prefixes
        self.reserve_wait = reserve_wait

    def _pairable_decodes(self, exclude: set[str]) -> list[NodeInfo]:
        """Decode nodes that some routable prefill node can send KV to."""
        prefills = self.registry.routable(("prefill",), exclude)
        return [
            d
            for d in self.registry.routable(("decode",), exclude)
            if any(kv_mismatch(p, d) is None for p in prefills)
        ]

    async def renew_transfer(self, stream: Stream) -> Reserved | None:
        """The decode node keeps its reservation for a new prefill node (its old one died):
        the reservation under a new transfer id, or None when it cannot."""
        rid = stream.wire_id
        reply = await self.control.ask(stream.decode_node, rid, RenewTransfer(rid))
        return reply if isinstance(reply, Reserved) else None

    def _wire(self, stream: Stream) -> tuple[dict, tuple[int, ...]]:
        """The request's sampling and already streamed tokens, as nodes take them."""
        return sampling_to_wire(stream.request.sampling), tuple(stream.generated)

    async def route(self, stream: Stream) -> TokenEvent | None:
        """Send the request on its way (resuming after stream.generated); an error message
        if nothing can take it."""
        request = stream.request
        sampling, outputs = self._wire(stream)
        exclude = stream.lost
        if request.sampling.max_tokens == 0:
            return await self._score(stream)
        colocated = self.policy(self.registry.routable(("both",), exclude), request)
        decodes = self.policy(self._pairable_decodes(exclude), request)
        if colocated and not decodes:
            node = colocated[0]
            stream.prefill_node = node.node_id
            node.inflight += 1
            node.routed(request, time.monotonic(), prefixes=self.hash_prompts)
            await self.control.send(
                node.node_id,
                Prefill(
                    stream.wire_id, request.prompt_token_ids, sampling, output_token_ids=outputs
                ),
            )
            return None
        if not decodes:
            return TokenEvent.failed(Failure.UNAVAILABLE, self.registry.no_route_reason(exclude))
        reserved = await self._reserve(stream, decodes)
        if isinstance(reserved, Error):  # the request itself is bad: no other node takes it
            return TokenEvent.failed(reserved.kind, reserved.message)
        if reserved is None:
            return TokenEvent.failed(
                Failure.UNAVAILABLE, "no decode node has room for this request"
            )
        return await self.send_prefill(stream, reserved)

    async def _score(self, stream: Stream) -> TokenEvent | None:
        """A request that only scores its prompt (max_tokens 0) needs a prefill and nothing
        else: a prefill or colocated node computes it and answers; no KV moves."""
        request = stream.request
        nodes = self.policy(self.registry.routable(("prefill", "both"), stream.lost), request)
        if not nodes:
            return TokenEvent.failed(Failure.UNAVAILABLE, "no prefill node available")
        node = nodes[0]
        stream.prefill_node = node.node_id
        node.inflight += 1
        node.routed(request, time.monotonic(), prefixes=self.hash_prompts)
        sampling, _ = self._wire(stream)
        await self.control.send(
            node.node_id, Prefill(stream.wire_id, request.prompt_token_ids, sampling)
        )
        return None

    async def send_prefill(self, stream: Stream, reserved: Reserved) -> TokenEvent | None:
        request = stream.request
        sampling, outputs = self._wire(stream)
        # Picked after the reservation's round trip, so the choice sees requests routed
        # meanwhile (the policy's load and prefix view include them).
        decode = self.registry.get(stream.decode_node)
        prefills = [
            p
            for p in self.registry.routable(("prefill",), stream.lost)
            if decode is None or kv_mismatch(p, decode) is None
        ]
        prefills = self.policy(prefills, request)
        if not prefills:
            return TokenEvent.failed(Failure.UNAVAILABLE, "no prefill node available")
        prefill = prefills[0]
        stream.prefill_node = prefill.node_id
        prefill.inflight += 1
        prefill.routed(request, time.monotonic(), prefixes=self.hash_prompts)
        await self.control.send(
            prefill.node_id,
            Prefill(
                stream.wire_id,
                request.prompt_token_ids,
                sampling,
                xfer_id=reserved.xfer_id,
                dest_block_ids=reserved.block_ids,
                dest_kv_endpoint=reserved.kv_endpoint,
                dest_kv_instance=reserved.kv_instance,
                output_token_ids=outputs,
            ),
        )
        return None

    async def _reserve(self, stream: Stream, decodes: list[NodeInfo]) -> Reserved | Error | None:
        """Blocks on a decode node; when every one is full, ask again (they free blocks as
        requests finish) for up to reserve_wait seconds. A node's refusal of the request as
        invalid (a grammar that does not compile) ends the search: the Error."""
        request = stream.request
        sampling, outputs = self._wire(stream)
        deadline = time.monotonic() + self.reserve_wait
        while True:
            for node in decodes:
                msg = ReserveKV(stream.wire_id, request.prompt_token_ids, sampling, outputs)
                reply = await self.control.ask(node.node_id, stream.wire_id, msg)
                if isinstance(reply, Reserved):
                    stream.decode_node = node.node_id
                    node.inflight += 1
                    return reply
                if isinstance(reply, Error) and reply.kind is Failure.BAD_REQUEST:
                    return reply
                if reply is None:  # no answer in time: make sure it holds nothing for us
                    await self.control.send(
                        node.node_id, Abort(stream.wire_id, "reserve timed out")
                    )
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.2)
            decodes = self.policy(self._pairable_decodes(stream.lost), request)
