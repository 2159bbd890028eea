"""Routing: puts a request on nodes: a colocated one; or a decode node that prefills it
itself; or a decode node's reservation then a prefill node that fills it; and again,
without the nodes it lost, after a failover. Nodes are picked by the routing policy (decode
nodes that hold the conversation first); local or remote prefill by the placement
(router/cluster/placement.py); what it picks is recorded in the RequestTable."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from pdserve.common.wire.messages import (
    Abort,
    Error,
    Failure,
    Message,
    Prefill,
    RenewTransfer,
    Reserved,
    ReserveKV,
)
from pdserve.common.wire.payloads import SamplingParams
from pdserve.router.cluster.control import ControlServer
from pdserve.router.cluster.policies import (
    Estimate,
    PlacementConfig,
    Policy,
    estimate,
    missing_tokens,
)
from pdserve.router.cluster.registry import NodeInfo, NodeRegistry, kv_mismatch
from pdserve.router.cluster.streams import Failover, RequestTable, Stream

log = logging.getLogger(__name__)


class Routing:
    """Sends a request on its way: the nodes it picks go into the RequestTable, the tokens
    sent into each node's expected work and cache (routed)."""

    def __init__(
        self,
        table: RequestTable,
        control: ControlServer,
        policy: Policy,
        reserve_wait: float,
        placement: PlacementConfig | None = None,
        max_failovers: int = 3,
    ) -> None:
        self.table = table
        self.registry: NodeRegistry = table.registry
        self.control = control
        self.policy = policy
        self.reserve_wait = reserve_wait
        self.placement = placement or PlacementConfig()
        self.max_failovers = max_failovers
        self.num_failovers = 0
        self.failover_causes: Counter[str] = Counter()  # the same failovers, by Failover.cause
        self.num_local = 0  # prefills placed on the decode node
        self.num_remote = 0  # prefills placed on a prefill node
        self.kv_tokens_reused = 0  # remote prefills' tokens the decode node had cached
        self.kv_tokens_sent = 0  # and those whose KV the prefill node was asked to send

    def _pairable_decodes(self, exclude: set[str]) -> list[NodeInfo]:
        """Decode nodes that some routable prefill node can send KV to."""
        prefills = self.registry.routable(("prefill",), exclude)
        return [
            d
            for d in self.registry.routable(("decode",), exclude)
            if any(kv_mismatch(p, d) is None for p in prefills)
        ]

    async def renew_transfer(self, stream: Stream, src_tp: int) -> Reserved | None:
        """The decode node keeps its reservation for another prefill node (its old one died,
        or one of another TP size sends): the reservation under a new transfer id, or None
        when it cannot."""
        rid = stream.wire_id
        reply = await self.control.ask(stream.decode_node, rid, RenewTransfer(rid, src_tp))
        return reply if isinstance(reply, Reserved) else None

    def _likely_src_tp(self, stream: Stream, decode: NodeInfo) -> int:
        """The TP size of the prefill node a reservation on `decode` will most likely get:
        the most common among those that can fill it (not the policy's pick: asking it moves
        a round robin's turn). A different pick renews the reservation (send_prefill)."""
        sizes = Counter(p.tp_size for p in self._prefills_for(stream, decode))
        return min(sizes, key=lambda tp: (-sizes[tp], tp)) if sizes else 1

    def _wire(self, stream: Stream) -> tuple[SamplingParams, tuple[int, ...]]:
        """The request's sampling and already streamed tokens, as nodes take them."""
        return stream.request.sampling, stream.generated

    def _routed(self, node: NodeInfo, stream: Stream) -> None:
        """The request's tokens go to node to compute: its queued work and cache expect them."""
        now, tokens = self.registry.clock(), stream.hashes
        node.routed(len(tokens), tokens.of(node.block_size), now)

    async def route(self, stream: Stream) -> Error | None:
        """Send the request on its way (resuming after stream.generated); an error message
        if nothing can take it."""
        request = stream.request
        exclude = stream.lost
        if request.sampling.scores_prompt_only:
            return await self._score(stream)
        colocated = self.policy(self.registry.routable(("both",), exclude), stream.hashes)
        decodes = self._decode_order(stream)
        if colocated and not decodes:
            if stream.trace.on:
                self._trace_route(stream, colocated, [], None, self.registry.clock())
            await self._run_on(stream, colocated[0])
            return None
        if not decodes:
            why = self.registry.no_route_reason(exclude)
            return Error(stream.wire_id, why, Failure.UNAVAILABLE)
        prefills = self._prefills_for(stream, decodes[0])
        now = self.registry.clock()
        choice = estimate(self.placement, decodes[0], prefills, stream.hashes, now)
        if stream.trace.on:
            self._trace_route(stream, decodes, prefills, choice, now)
        if choice.local:
            self.num_local += 1
            await self._run_on(stream, decodes[0])
            return None
        self.num_remote += 1
        reserved = await self._reserve(stream, decodes)
        if isinstance(reserved, Error):  # the request itself is bad: no other node takes it
            return reserved
        if reserved is None:
            why = "no decode node has room for this request"
            return Error(stream.wire_id, why, Failure.UNAVAILABLE)
        return await self.send_prefill(stream, reserved)

    def _decode_order(self, stream: Stream) -> list[NodeInfo]:
        """Decode nodes for the request, best first: the policy's order, except that a node
        holding at least half of the request's tokens (it answered the conversation's earlier
        turns) comes first. Only nodes a prefill node can fill, unless placement is forced
        local (then decode nodes serve alone)."""
        if self.placement.mode == "local":
            nodes = self.registry.routable(("decode",), stream.lost)
        else:
            nodes = self._pairable_decodes(stream.lost)
        nodes = self.policy(nodes, stream.hashes)
        tokens, now = stream.hashes, self.registry.clock()

        def held(node: NodeInfo) -> int:
            cached = len(tokens) - missing_tokens(node, tokens, now)
            return cached if 2 * cached >= len(tokens) else 0

        return sorted(nodes, key=lambda n: -held(n))  # stable: the policy breaks ties

    def _prefills_for(self, stream: Stream, decode: NodeInfo | None) -> list[NodeInfo]:
        """Prefill nodes that can fill `decode`, unordered (asking the policy moves a
        round robin's turn: it is asked once per request, in send_prefill)."""
        return [
            p
            for p in self.registry.routable(("prefill",), stream.lost)
            if decode is None or kv_mismatch(p, decode) is None
        ]

    async def _run_on(self, stream: Stream, node: NodeInfo) -> None:
        """The whole request on one node, prefill and decode: a colocated node, or a decode
        node prefilling locally."""
        # On a decode node: counted apart from its decoding requests until it is one.
        self.table.place_prefill(stream, node.node_id, local=node.role == "decode")
        self._routed(node, stream)
        sampling, outputs = self._wire(stream)
        prompt = stream.request.prompt_token_ids
        traceparent = stream.trace.traceparent
        msg = Prefill(
            stream.wire_id, prompt, sampling, output_token_ids=outputs, traceparent=traceparent
        )
        stream.request.timing.dispatch()  # before the send: its await may run other tasks
        await self.control.send(node.node_id, msg)

    async def _score(self, stream: Stream) -> Error | None:
        """A request that only scores its prompt (max_tokens 0) needs a prefill and nothing
        else: a prefill or colocated node computes it and answers; no KV moves."""
        request = stream.request
        nodes = self.policy(self.registry.routable(("prefill", "both"), stream.lost), stream.hashes)
        if not nodes:
            return Error(stream.wire_id, "no prefill node available", Failure.UNAVAILABLE)
        node = nodes[0]
        self.table.place_prefill(stream, node.node_id)
        self._routed(node, stream)
        sampling, _ = self._wire(stream)
        traceparent = stream.trace.traceparent
        msg = Prefill(stream.wire_id, request.prompt_token_ids, sampling, traceparent=traceparent)
        stream.request.timing.dispatch()
        await self.control.send(node.node_id, msg)
        return None

    async def send_prefill(self, stream: Stream, reserved: Reserved) -> Error | None:
        request = stream.request
        sampling, outputs = self._wire(stream)
        # Picked after the reservation's round trip, so the choice sees requests routed
        # meanwhile (the policy's load and prefix view include them).
        prefills = self.policy(
            self._prefills_for(stream, self.registry.get(stream.decode_node)), stream.hashes
        )
        if not prefills:
            return Error(stream.wire_id, "no prefill node available", Failure.UNAVAILABLE)
        prefill = prefills[0]
        now = time.monotonic()
        if reserved.src_tp != prefill.tp_size:  # the decode ranks expect other slices
            renewed = await self.renew_transfer(stream, prefill.tp_size)
            if renewed is None:
                return Error(stream.wire_id, "the reservation was lost", Failure.UNAVAILABLE)
            reserved = renewed
        self.table.place_prefill(stream, prefill.node_id)
        self._routed(prefill, stream)
        self.kv_tokens_reused += reserved.cached_tokens
        self.kv_tokens_sent += len(stream.tokens) - reserved.cached_tokens
        stream.request.timing.dispatch()
        await self.control.send(
            prefill.node_id,
            Prefill(
                stream.wire_id,
                request.prompt_token_ids,
                sampling,
                xfer_id=reserved.xfer_id,
                dest_block_ids=reserved.block_ids,
                dest_kv_endpoints=reserved.kv_endpoints,
                dest_kv_instance=reserved.kv_instance,
                dest_cached_tokens=reserved.cached_tokens,
                output_token_ids=outputs,
                traceparent=stream.trace.traceparent,
            ),
        )
        stream.trace.child("router.dispatch", now, {"pdserve.prefill_node": prefill.node_id})
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
                src_tp = self._likely_src_tp(stream, node)
                msg = ReserveKV(
                    stream.wire_id,
                    request.prompt_token_ids,
                    sampling,
                    outputs,
                    src_tp,
                    traceparent=stream.trace.traceparent,
                )
                reply = await self._ask_reserve(stream, node, msg)
                if isinstance(reply, Reserved):
                    self.table.place_decode(stream, node.node_id)
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
            decodes = self.policy(self._pairable_decodes(stream.lost), stream.hashes)

    async def _ask_reserve(self, stream: Stream, node: NodeInfo, msg: ReserveKV) -> Message | None:
        """One reservation's round trip, timed (a TTFT stage) and traced."""
        start = time.monotonic()
        reply = await self.control.ask(node.node_id, stream.wire_id, msg)
        stream.request.timing.reserved(time.monotonic() - start)
        outcome = type(reply).__name__.lower() if reply is not None else "timeout"
        attrs = {"pdserve.decode_node": node.node_id, "pdserve.outcome": outcome}
        stream.trace.child("router.reserve", start, attrs)
        return reply

    def _trace_route(
        self,
        stream: Stream,
        candidates: list[NodeInfo],
        prefills: list[NodeInfo],
        choice: Estimate | None,
        now: float,
    ) -> None:
        """The routing decision as a span: the candidates in the policy's order, the blocks
        each holds of the request, the choice and why (no token of the prompt)."""
        tokens = stream.hashes
        cached = [
            f"{n.node_id}:{(len(tokens) - missing_tokens(n, tokens, now)) // n.block_size}"
            for n in [*candidates, *prefills]
        ]
        attrs = {
            "pdserve.candidates": [n.node_id for n in candidates],
            "pdserve.prefill_candidates": [n.node_id for n in prefills],
            "pdserve.cached_blocks": cached,
            "pdserve.chosen": candidates[0].node_id,
            "pdserve.policy": type(self.policy).__name__,
            "pdserve.prefill": "local" if choice is None or choice.local else "remote",
            "pdserve.why": choice.why if choice is not None else "colocated node",
        }
        stream.trace.child("router.route", time.monotonic(), attrs)

    async def recover(self, stream: Stream, failover: Failover) -> Error | None:
        """Carry the request on without the nodes it lost (the table detached it from them
        already); an error message when it cannot, or has failed over too often."""
        start = time.monotonic()
        failure = await self._recover(stream, failover)
        # cause: the bounded word the failover counter is labelled with; why: its sentence
        attrs = {"pdserve.failover.kind": failover.kind, "pdserve.failover.cause": failover.cause}
        attrs["pdserve.failover.why"] = failover.why
        attrs |= {"pdserve.failover.lost": list(failover.lost), "pdserve.attempt": stream.attempt}
        attrs["pdserve.outcome"] = "failed" if failure is not None else "rerouted"
        stream.trace.child("router.failover", start, attrs)
        return failure

    async def _recover(self, stream: Stream, failover: Failover) -> Error | None:
        rid = stream.wire_id
        log.warning("request %s: %s; failing over (%s)", rid, failover.why, failover.kind)
        for node_id in failover.detached:  # a lost one may only be stalled: it frees later
            await self.control.send(node_id, Abort(rid, failover.why))
        stream.failovers += 1
        self.num_failovers += 1
        self.failover_causes[failover.cause] += 1
        if stream.failovers > self.max_failovers:
            why = f"gave up after {self.max_failovers} failovers: {failover.why}"
            return Error(rid, why, Failure.UNAVAILABLE)
        if failover.kind == "prefill" and stream.decode_node:
            decode = self.registry.get(stream.decode_node)
            src_tp = self._likely_src_tp(stream, decode) if decode is not None else 1
            reserved = await self.renew_transfer(stream, src_tp)
            if reserved is not None:
                return await self.send_prefill(stream, reserved)
        for node_id in stream.nodes():  # resume from scratch: drop the survivor's state too
            await self.control.send(node_id, Abort(rid, "resuming"))
        self.table.restart(stream)
        return await self.route(stream)
