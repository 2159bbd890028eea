"""Placement edges that mutation testing showed no test pinned (scripts/mutation.sh): the
config's checks and messages, the reason each choice gives, whose prefill rate a cost uses,
queued work on either side, and the first of two equally cheap prefill nodes."""

from __future__ import annotations

import pytest

from pdserve.router.cluster.registry import NodeInfo, NodeRegistry
from pdserve.router.cluster.routing import PlacementConfig, estimate
from pdserve.router.cluster.streams import BlockHashes
from tests.router.test_failover import BS, FakeNodes
from tests.router.test_registry import FakeClock

PROMPT = list(range(1, 10))  # 9 tokens: 2 full blocks of BS


def nodes(*ids: str) -> list[NodeInfo]:
    registry = NodeRegistry(5.0, 4096, FakeClock())
    for node_id in ids:
        role = "prefill" if node_id.startswith("p") else "decode"
        registry.add(node_id, FakeNodes.registration(node_id, role), 1000.0)
    return [registry.nodes[n] for n in ids]


def test_a_bad_placement_is_refused_with_what_is_allowed() -> None:
    with pytest.raises(ValueError) as bad:
        PlacementConfig("nearby")
    assert str(bad.value) == (
        "prefill placement must be one of ('auto', 'remote', 'local'), got 'nearby'"
    )
    with pytest.raises(ValueError) as negative:
        PlacementConfig("auto", threshold=-1)
    assert str(negative.value) == "the local prefill threshold must be >= 0 tokens"
    assert PlacementConfig("auto", threshold=0).threshold == 0


def test_each_choice_says_why() -> None:
    d0, p0 = nodes("d0", "p0")
    hashes = BlockHashes(PROMPT)
    alone = estimate(PlacementConfig(), d0, [], hashes, 1000.0)
    assert (alone.local, alone.why) == (True, "no prefill node can send KV to this decode node")
    assert alone.missing_prefill == len(PROMPT) and alone.remote_s == float("inf")
    d0.expect_cached(hashes.of(BS), 1000.0)
    within = estimate(PlacementConfig("auto", threshold=1), d0, [p0], hashes, 1000.0)
    assert (within.local, within.why) == (True, "1 tokens missing on the decode node <= 1")
    past = estimate(PlacementConfig("auto", threshold=0), d0, [p0], hashes, 1000.0)
    assert (past.local, past.why) == (False, "1 tokens missing on the decode node > 0")
    forced = estimate(PlacementConfig("remote"), d0, [p0], hashes, 1000.0)
    assert (forced.local, forced.why) == (False, "forced remote")


def test_without_a_time_the_estimate_reads_the_clock() -> None:
    d0, p0 = nodes("d0", "p0")
    est = estimate(PlacementConfig(), d0, [p0], BlockHashes(PROMPT))
    assert est.missing_decode == len(PROMPT) == est.missing_prefill


def test_costs_count_queued_work_and_measured_rates() -> None:
    d0, p0 = nodes("d0", "p0")
    d0.prefill_rate = 0.5  # below 1 token/s, still measured
    d0.recent_tokens, d0.queued_tokens = 3, 2
    p0.recent_tokens, p0.queued_tokens = 4, 1
    est = estimate(PlacementConfig(), d0, [p0], BlockHashes(PROMPT), 1000.0)
    assert est.local_s == (5 + 9) / 0.5
    assert est.remote_s == (5 + 9) / 0.5  # p0 measured nothing: the decode node's rate
    p0.prefill_rate = 3.0
    est = estimate(PlacementConfig(), d0, [p0], BlockHashes(PROMPT), 1000.0)
    assert est.remote_s == (5 + 9) / 3.0


def test_the_first_of_two_equally_cheap_prefill_nodes_is_counted() -> None:
    d0, p0, p1 = nodes("d0", "p0", "p1")
    hashes = BlockHashes(PROMPT)
    p1.expect_cached(hashes.of(BS), 1000.0)  # p1 lacks 1 token but has 8 queued: as cheap
    p1.queued_tokens = 8
    est = estimate(PlacementConfig(), d0, [p0, p1], hashes, 1000.0)
    assert (est.remote_s, est.missing_prefill) == (9.0, 9)
    est = estimate(PlacementConfig(), d0, [p1, p0], hashes, 1000.0)
    assert (est.remote_s, est.missing_prefill) == (9.0, 1)
