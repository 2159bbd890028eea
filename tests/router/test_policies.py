"""Routing policies: rotation state per policy object, load ordering."""

from __future__ import annotations

import time

from pdserve.router.cluster.registry import NodeInfo
from pdserve.router.cluster.routing import POLICIES
from pdserve.router.cluster.streams import BlockHashes

REQ = BlockHashes([1, 2])


def node(name: str, inflight: int = 0, free: int = 10, role: str = "decode") -> NodeInfo:
    return NodeInfo(name, role, "", "zmq", "", 10, 100, 0.0, free_blocks=free, inflight=inflight)


def test_round_robin_rotates_and_each_backend_has_its_own_turn():
    nodes = [node("b"), node("a"), node("c")]
    rr = POLICIES["round_robin"]()
    firsts = [rr(nodes, REQ)[0].node_id for _ in range(4)]
    assert firsts == ["a", "b", "c", "a"]
    assert POLICIES["round_robin"]()(nodes, REQ)[0].node_id == "a"  # fresh state


def test_round_robin_keeps_one_turn_per_role():
    """A request asks for decode nodes, then prefill nodes: each role rotates on its own."""
    prefills = [node("p0", role="prefill"), node("p1", role="prefill")]
    decodes = [node("d0", role="decode")]
    rr = POLICIES["round_robin"]()
    firsts = []
    for _ in range(4):
        rr(decodes, REQ)
        firsts.append(rr(prefills, REQ)[0].node_id)
    assert firsts == ["p0", "p1", "p0", "p1"]


def test_least_loaded_prefers_fewer_requests_then_more_free_blocks():
    nodes = [node("busy", inflight=3), node("full", free=1), node("roomy", free=9)]
    assert [n.node_id for n in POLICIES["least_loaded"]()(nodes, REQ)] == ["roomy", "full", "busy"]


# -- prefix-aware routing -------------------------------------------------------------------

from pdserve.common.engine.kv_cache_manager import hash_token_blocks  # noqa: E402
from pdserve.common.wire.messages import Heartbeat  # noqa: E402

BS = 4
PROMPT = tuple(range(100, 141))  # 41 tokens: 10 full blocks of 4


def prefill(name: str, queued: int = 0) -> NodeInfo:
    info = NodeInfo(name, "prefill", "", "zmq", "", 64, 100, 0.0, free_blocks=64, block_size=BS)
    info.queued_tokens = queued
    return info


def beat(seq: int, stored=(), removed=(), reset=False, queued: int = 0) -> Heartbeat:
    return Heartbeat("n", 64, 0, 0, queued, seq, reset, tuple(stored), tuple(removed))


def test_heartbeats_keep_the_prefix_view_and_a_gap_clears_it():
    info = prefill("p")
    blocks = hash_token_blocks(PROMPT, BS)
    assert info.apply_heartbeat(beat(1, blocks[:3], reset=True), 0.0)
    assert info.cached_blocks(blocks, 0.0) == 3
    assert info.apply_heartbeat(beat(2, blocks[3:6], [blocks[1]]), 0.0)
    assert info.cached_blocks(blocks, 0.0) == 1  # a chain breaks at the first missing block
    assert not info.apply_heartbeat(beat(4, blocks[1:2]), 0.0)  # seq 3 went missing
    assert info.prefixes == set() and info.cached_blocks(blocks, 0.0) == 0
    assert info.apply_heartbeat(beat(5, blocks, reset=True), 0.0)  # the snapshot it asked for
    assert info.cached_blocks(blocks, 0.0) == len(blocks)


def test_prefix_aware_picks_the_node_holding_the_prefix_unless_its_queue_outweighs_it():
    policy = POLICIES["prefix_aware"]()
    req = BlockHashes(list(PROMPT))
    holder, other = prefill("holder"), prefill("other")
    holder.prefixes = set(hash_token_blocks(PROMPT[:32], BS))  # 8 blocks = 32 tokens
    assert [n.node_id for n in policy([other, holder], req)] == ["holder", "other"]
    holder.queued_tokens = 31  # 31 + 41 - 32 < 41: still cheaper
    assert policy([other, holder], req)[0].node_id == "holder"
    holder.queued_tokens = 33  # the saving no longer pays for the queue
    assert policy([other, holder], req)[0].node_id == "other"


def test_prefix_aware_expects_what_it_just_routed_and_spreads_fresh_prompts():
    policy = POLICIES["prefix_aware"]()
    a, b = prefill("a"), prefill("b")
    first = BlockHashes(list(PROMPT))
    chosen = policy([a, b], first)[0]
    chosen.routed(len(first), first.of(BS), time.monotonic())
    fresh = BlockHashes(list(range(500, 541)))
    assert policy([a, b], fresh)[0] is not chosen  # the other one has less queued work
    chosen.apply_heartbeat(beat(1), time.monotonic())  # prompt computed, blocks not yet reported
    follow_up = BlockHashes([*PROMPT[:36], 7, 7, 7])
    assert policy([a, b], follow_up)[0] is chosen  # it expects the blocks it just routed
    chosen.apply_heartbeat(beat(2), time.monotonic() + 60)  # they never came: expectation ends
    assert chosen.cached_blocks(hash_token_blocks(PROMPT, BS), time.monotonic()) == 0


def test_prefix_aware_orders_decode_nodes_by_load():
    nodes = [node("busy", inflight=3), node("full", free=1), node("roomy", free=9)]
    assert [n.node_id for n in POLICIES["prefix_aware"]()(nodes, REQ)] == ["roomy", "full", "busy"]
