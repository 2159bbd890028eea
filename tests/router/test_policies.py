"""Routing policies: rotation state per policy object, load ordering."""

from __future__ import annotations

from common.sampling_params import SamplingParams
from router.backend import GenerateRequest
from router.cluster import POLICIES, NodeInfo

REQ = GenerateRequest("r", (1, 2), SamplingParams())


def node(name: str, inflight: int = 0, free: int = 10) -> NodeInfo:
    return NodeInfo(
        name, "decode", "", "zmq", "", 10, 100, 0.0, free_blocks=free, inflight=inflight
    )


def test_round_robin_rotates_and_each_backend_has_its_own_turn():
    nodes = [node("b"), node("a"), node("c")]
    rr = POLICIES["round_robin"]()
    firsts = [rr(nodes, REQ)[0].node_id for _ in range(4)]
    assert firsts == ["a", "b", "c", "a"]
    assert POLICIES["round_robin"]()(nodes, REQ)[0].node_id == "a"  # fresh state


def test_least_loaded_prefers_fewer_requests_then_more_free_blocks():
    nodes = [node("busy", inflight=3), node("full", free=1), node("roomy", free=9)]
    assert [n.node_id for n in POLICIES["least_loaded"]()(nodes, REQ)] == ["roomy", "full", "busy"]
