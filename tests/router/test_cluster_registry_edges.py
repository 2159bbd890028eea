"""Registry edges that mutation testing showed no test pinned (scripts/mutation.sh): what a
heartbeat replaces, prefixes expected until exactly when, a node's load and routed work, a
node seen exactly at the heartbeat timeout, exclusions in the no-route reason, readiness and
stats with colocated nodes, and which way round an unpairable prefill node's reason reads."""

from __future__ import annotations

from dataclasses import replace

from pdserve.common.wire.messages import Heartbeat
from pdserve.router.cluster.registry import NodeInfo, NodeRegistry, kv_mismatch
from tests.router.test_failover import FakeNodes
from tests.router.test_registry import FakeClock


def registry(*ids: str, clock: FakeClock | None = None) -> NodeRegistry:
    reg = NodeRegistry(5.0, 4096, clock or FakeClock())
    for node_id in ids:
        role = {"p": "prefill", "d": "decode", "b": "both"}[node_id[0]]
        reg.add(node_id, FakeNodes.registration(node_id, role), 1000.0)
    return reg


def beat(**fields: object) -> Heartbeat:
    return Heartbeat("p0", 7, 1, 2, 3, **fields)  # type: ignore[arg-type]


def test_a_heartbeat_replaces_the_nodes_load_and_keeps_prefixes_expected_later() -> None:
    node = registry("p0").nodes["p0"]
    node.recent_tokens = 40
    node.recent_prefixes = {b"gone": 1000.0, b"kept": 1000.5}
    assert node.apply_heartbeat(beat(draining=True, prefill_rate=0.5), 1000.0) is True
    assert (node.free_blocks, node.num_running, node.num_waiting, node.queued_tokens) == (
        7,
        1,
        2,
        3,
    )
    assert node.recent_tokens == 0 and node.draining is True and node.prefill_rate == 0.5
    assert node.recent_prefixes == {b"kept": 1000.5}


def test_a_reset_heartbeat_replaces_the_prefix_view() -> None:
    node = registry("p0").nodes["p0"]
    node.prefixes = {b"old"}
    assert node.apply_heartbeat(beat(prefix_seq=7, prefix_reset=True, prefix_stored=(b"a",)), 1.0)
    assert node.prefixes == {b"a"} and node.prefix_seq == 7


def test_prefixes_expected_until_now_are_no_longer_counted() -> None:
    node = registry("p0").nodes["p0"]
    node.recent_prefixes = {b"a": 1000.0, b"b": 1001.0}
    assert node.cached_blocks([b"b"], 1000.0) == 1
    assert node.cached_blocks([b"a", b"b"], 1000.0) == 0
    assert node.cached_blocks([b"x"], 0.5) == 0  # unknown even early on


def test_load_counts_requests_held_and_waiting_then_free_blocks() -> None:
    node = registry("d0").nodes["d0"]
    node.inflight, node.num_waiting, node.free_blocks = 2, 1, 9
    assert node.load() == (3, -9)


def test_routed_work_adds_up_less_the_blocks_held() -> None:
    node = registry("p0").nodes["p0"]  # block size 4
    node.prefixes = {b"a"}
    node.routed(9, [b"a", b"b"], 1000.0)
    node.routed(9, [b"a", b"b"], 1000.0)  # b is now expected too
    assert node.recent_tokens == (9 - 4) + (9 - 8)
    assert node.recent_prefixes == {b"a": 1005.0, b"b": 1005.0}


def test_a_registration_keeps_the_nodes_endpoint_and_size() -> None:
    node = registry("d0").nodes["d0"]
    assert (node.kv_endpoints, node.num_blocks) == (("ipc:///kv/d0",), 64)


def test_a_node_heard_from_exactly_a_timeout_ago_is_alive() -> None:
    clock = FakeClock()
    reg = registry("p0", clock=clock)
    clock.advance(5.0)
    assert [n.node_id for n in reg.alive(("prefill",))] == ["p0"]


def test_an_excluded_node_makes_no_route() -> None:
    reg = registry("p0", "d0")
    assert reg.no_route_reason().startswith("no prefill node can send KV")  # a route exists
    assert reg.no_route_reason({"p0"}) == "no prefill/decode route is available"
    assert reg.no_route_reason({"d0"}) == "no prefill/decode route is available"


def test_a_colocated_node_alone_makes_the_router_ready_and_is_counted() -> None:
    reg = registry("b0")
    assert reg.ready()
    reg.nodes["b0"].prefixes = {b"x"}
    assert reg.stats() == {
        "nodes_prefill": 0,
        "nodes_decode": 0,
        "nodes_colocated": 1,
        "prefix_blocks_prefill": 0,
    }
    reg = registry("p0", "d0")
    reg.nodes["p0"].prefixes = {b"x", b"y"}
    assert reg.stats()["prefix_blocks_prefill"] == 2


def test_an_unpairable_prefill_nodes_reason_reads_from_it_to_the_decode_node() -> None:
    reg = registry("d0")
    odd = replace(FakeNodes.registration("p0", "prefill"), kv_connector="nccl")
    reg.add("p0", odd, 1000.0)
    assert reg.unpairable("p0") == "connectors differ (nccl -> zmq)"
    assert registry("b0").unpairable("b0") is None


def test_shm_across_hosts_is_refused_in_so_many_words() -> None:
    reg = registry()
    for node_id, role, host in (("p0", "prefill", "h1"), ("d0", "decode", "h2")):
        msg = replace(FakeNodes.registration(node_id, role), kv_connector="shm", host_id=host)
        reg.add(node_id, msg, 1000.0)
    p0, d0 = reg.nodes["p0"], reg.nodes["d0"]
    assert isinstance(p0, NodeInfo)
    assert kv_mismatch(p0, d0) == "shm needs both on one host, and they run on different hosts"


def test_a_prefill_node_that_pairs_with_any_decode_node_is_pairable() -> None:
    reg = registry("p0")
    odd = replace(FakeNodes.registration("d1", "decode"), kv_connector="nccl")
    reg.add("d1", odd, 1000.0)  # the first decode node cannot take p0's KV
    reg.add("d0", FakeNodes.registration("d0", "decode"), 1000.0)
    assert reg.unpairable("p0") is None
