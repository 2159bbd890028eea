"""Routing: where a request goes, and putting it there.

Where: a policy orders the candidate nodes for one request, best first (chosen by name from
POLICIES; every backend gets a fresh policy object, and its own state); decode nodes that hold
the conversation come first. The placement decides whether the prompt is prefilled on a
prefill node that ships the KV (remote) or on the decode node itself (local, "conditional
disaggregation").

Remote prefill keeps long prompts off the decode node, whose running requests would wait for
them; it costs the prefill node's queue, the prompt tokens the prefill node lacks, and the
hand-off (the pages the decode node lacks, mostly sent while later layers compute). Local
prefill costs only the tokens the decode node lacks: a follow-up turn of a conversation the
decode node answered is mostly cached there, the answer included, which no prefill node has.

The cost model compares the two in seconds, from rates the nodes measure (prefill tokens/s,
in heartbeats) and the hand-off time the router observes (first token from the prefill node
to the decode node's Admitted). Local prefill is charged once for the request and once more
for every request decoding on the decode node, since each of their next tokens waits for it:
a busy decode node sends long prompts to prefill nodes, and a follow-up turn, whose tokens
the decode node mostly holds, stays there unless many requests decode there.

Putting it there (`Routing`): a colocated node; or a decode node that prefills it itself; or
a decode node's reservation then a prefill node that fills it; and again, without the nodes
it lost, after a failover. What it picks is recorded in the RequestTable.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

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
from pdserve.router.cluster.registry import NodeInfo, NodeRegistry, kv_mismatch
from pdserve.router.cluster.streams import (
    BlockHashes,
    ControlServer,
    Failover,
    RequestTable,
    Stream,
)

log = logging.getLogger(__name__)

PLACEMENTS = ("auto", "remote", "local")


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """How the router places prefills: `auto` by the cost model, or by `threshold` when it is
    set (local when the decode node lacks at most that many prompt tokens); `remote` and
    `local` force one way."""

    mode: str = "auto"
    threshold: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in PLACEMENTS:
            raise ValueError(f"prefill placement must be one of {PLACEMENTS}, got {self.mode!r}")
        if self.threshold is not None and self.threshold < 0:
            raise ValueError("the local prefill threshold must be >= 0 tokens")


@dataclass(frozen=True, slots=True)
class Estimate:
    """Both ways of prefilling one prompt, in seconds, and the choice."""

    local: bool
    local_s: float
    remote_s: float
    missing_decode: int  # prompt tokens the decode node lacks (computes, or receives)
    missing_prefill: int  # prompt tokens the prefill node lacks (computes)
    why: str


def missing_tokens(node: NodeInfo, tokens: BlockHashes, now: float) -> int:
    """Tokens `node` would have to compute (or receive): those past its cached prefix, a
    block in its host tier or the shared store counting as part computed (`TierCredit`)."""
    return len(tokens) - node.credited_tokens(tokens.of(node.block_size), now)


def _rate(node: NodeInfo | None, fallback: NodeInfo | None) -> float:
    """A node's measured prefill tokens/s; the other node's when it has measured none (same
    model: the best guess), else 1.0 (then both sides compare in tokens)."""
    for n in (node, fallback):
        if n is not None and n.prefill_rate > 0:
            return n.prefill_rate
    return 1.0


def estimate(
    config: PlacementConfig,
    decode: NodeInfo,
    prefills: list[NodeInfo],
    prompt: BlockHashes,
    now: float | None = None,
) -> Estimate:
    """Local or remote prefill of `prompt` (the request's tokens, as their block hashes) for a
    request that decodes on `decode`; remote counts the cheapest of `prefills`, the prefill
    nodes that can fill `decode` (none: local)."""
    now = time.monotonic() if now is None else now
    miss_d = missing_tokens(decode, prompt, now)
    fallback = prefills[0] if prefills else None
    rate_d = _rate(decode, fallback)
    queued_d = decode.queued_tokens + decode.recent_tokens
    # Each request decoding there waits for the prefill (those waiting for their own local
    # prefill are in the queue already).
    decoding = max(0, decode.inflight - decode.local_prefills)
    local_s = queued_d / rate_d + miss_d / rate_d * (1 + decoding)
    remote_s, miss_p = float("inf"), len(prompt)
    for prefill in prefills:
        miss = missing_tokens(prefill, prompt, now)
        queued = prefill.queued_tokens + prefill.recent_tokens
        cost = (queued + miss) / _rate(prefill, decode) + decode.handoff_s
        if cost < remote_s:
            remote_s, miss_p = cost, miss
    local, why = _choose(config, miss_d, local_s, remote_s, bool(prefills))
    return Estimate(local, local_s, remote_s, miss_d, miss_p, why)


def _choose(
    config: PlacementConfig, miss_d: int, local_s: float, remote_s: float, has_prefill: bool
) -> tuple[bool, str]:
    if config.mode != "auto":
        return config.mode == "local", f"forced {config.mode}"
    if not has_prefill:
        return True, "no prefill node can send KV to this decode node"
    if config.threshold is not None:
        local = miss_d <= config.threshold
        sign = "<=" if local else ">"
        return local, f"{miss_d} tokens missing on the decode node {sign} {config.threshold}"
    # A tie goes remote: what the decode node does not compute, its next arrivals never wait on.
    return local_s < remote_s, f"cost local {local_s:.4f}s vs remote {remote_s:.4f}s"


# Orders candidate nodes for a request (given as its tokens' block hashes), best first.
Policy = Callable[[list[NodeInfo], BlockHashes], list[NodeInfo]]


class RoundRobin:
    """Candidates in turn; the rotation is this policy object's own state, one turn per role,
    so that asking for decode nodes does not move the prefill nodes' turn (one request asks
    for both: a shared turn would send every request of a 2P1D cluster to the same P)."""

    def __init__(self) -> None:
        self._turns: dict[str, itertools.count] = {}

    def __call__(self, nodes: list[NodeInfo], _tokens: BlockHashes) -> list[NodeInfo]:
        if not nodes:
            return nodes
        turn = self._turns.setdefault(nodes[0].role, itertools.count())
        start = next(turn) % len(nodes)
        ordered = sorted(nodes, key=lambda n: n.node_id)
        return ordered[start:] + ordered[:start]


def least_loaded(nodes: list[NodeInfo], _tokens: BlockHashes) -> list[NodeInfo]:
    return sorted(nodes, key=NodeInfo.load)


def prefix_aware(nodes: list[NodeInfo], tokens: BlockHashes) -> list[NodeInfo]:
    """Least prefill work first: tokens already queued there plus the request's tokens it
    would have to compute, i.e. not covered by the leading blocks it caches. A node holding the
    prompt's prefix wins unless its queue outweighs the saving; load breaks ties (decode
    nodes report no prefixes, so for them this is least_loaded)."""
    now = time.monotonic()

    def work(node: NodeInfo) -> int:
        return node.queued_tokens + node.recent_tokens + missing_tokens(node, tokens, now)

    return sorted(nodes, key=lambda n: (work(n), n.load()))


# Name -> factory, so every backend gets a fresh policy (and its own state).
POLICIES: dict[str, Callable[[], Policy]] = {
    "round_robin": RoundRobin,
    "least_loaded": lambda: least_loaded,
    "prefix_aware": lambda: prefix_aware,
}


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
        """The whole request on one node: a colocated node, a decode node prefilling locally,
        or the prefill node that scores a prompt."""
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
        nodes = self.policy(self.registry.routable(("prefill", "both"), stream.lost), stream.hashes)
        if not nodes:
            return Error(stream.wire_id, "no prefill node available", Failure.UNAVAILABLE)
        await self._run_on(stream, nodes[0])  # it streams nothing, so sends no outputs
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
