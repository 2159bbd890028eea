"""Speculative-decoding counters at the router (issue 38): each node's heartbeat carries its
drafter's counters over the wire, and the router's /metrics shows their sum over live nodes,
accepted drafts per position included."""

from __future__ import annotations

from pdserve.common.wire.messages import Heartbeat, decode, encode
from pdserve.common.wire.payloads import SpecDecodeCounts
from pdserve.router.cluster.registry import NodeRegistry
from pdserve.router.cluster.timing import RouterMetrics
from tests.router.test_registry import FakeClock, register

TIMEOUT = 1.0


def beat(node_id: str, counts: SpecDecodeCounts | None) -> Heartbeat:
    msg = Heartbeat(node_id, 8, 0, 0, 0, spec_decode=counts)
    return decode(encode(msg))  # what the router gets: the counters survive the wire


class RegistryBackend:
    """A backend whose stats are the registry's (as ClusterBackend.stats includes them)."""

    def __init__(self, registry: NodeRegistry) -> None:
        self.registry = registry

    def stats(self) -> dict[str, float]:
        return self.registry.stats()

    def failovers(self) -> dict[str, int]:
        return {}


def test_the_router_sums_live_nodes_counters() -> None:
    clock = FakeClock()
    reg = NodeRegistry(TIMEOUT, 128, clock=clock)
    for node in ("d1", "d2", "plain", "gone"):
        register(reg, node, clock())
    reg.get("d1").apply_heartbeat(beat("d1", SpecDecodeCounts(4, 10, 6, (3, 2, 1))), clock())
    reg.get("d2").apply_heartbeat(beat("d2", SpecDecodeCounts(2, 3, 1, (1,))), clock())
    reg.get("plain").apply_heartbeat(beat("plain", None), clock())
    reg.get("gone").apply_heartbeat(beat("gone", SpecDecodeCounts(9, 9, 9, (9,))), clock())
    reg.get("gone").last_seen = clock() - 2 * TIMEOUT
    text = RouterMetrics(RegistryBackend(reg)).exposition().decode()
    want = {
        "spec_decode_num_drafts": 6.0,
        "spec_decode_num_draft_tokens": 13.0,
        "spec_decode_num_accepted_tokens": 7.0,
        "spec_decode_num_accepted_tokens_per_pos_0": 4.0,
        "spec_decode_num_accepted_tokens_per_pos_1": 2.0,
        "spec_decode_num_accepted_tokens_per_pos_2": 1.0,
    }
    for name, value in want.items():
        assert f"pdserve_backend_{name} {value}" in text, name


def test_no_counters_without_speculation() -> None:
    clock = FakeClock()
    reg = NodeRegistry(TIMEOUT, 128, clock=clock)
    register(reg, "plain", clock())
    reg.get("plain").apply_heartbeat(beat("plain", None), clock())
    assert not any(key.startswith("spec_decode") for key in reg.stats())
