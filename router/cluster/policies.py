"""Routing policies: each orders candidate nodes for one request, best first. Chosen by
name from POLICIES; every backend gets a fresh policy object (and its own state)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from pdserve.router.cluster.placement import missing_tokens
from pdserve.router.cluster.registry import NodeInfo
from pdserve.router.cluster.streams import BlockHashes

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
