"""Where a request goes. Placement: whether its prompt is prefilled on a prefill node that
ships the KV (remote) or on the decode node itself (local, "conditional disaggregation").
Policies: orderings of candidate nodes for one request, best first, chosen by name from
POLICIES (every backend gets a fresh policy object, and its own state).

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
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.router.cluster.registry import NodeInfo
from pdserve.router.cluster.streams import BlockHashes

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
