"""Registration edges that mutation testing showed no test pinned (scripts/mutation.sh): a
decode node taken in only after its KV endpoint is probed, a refused one told why, a node
registering again (same process: kept as it is), a registration while the probe runs, and
the probe's reading of endpoints. Over test_failover's fake nodes and fake clock."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import replace

from pdserve.common.wire.messages import Registered
from pdserve.router.cluster.backend import ClusterBackend
from pdserve.router.cluster.registration import probe_endpoint
from tests.router.test_failover import FakeClock, FakeNodes, scenario, until


@scenario("p0")
async def test_a_decode_node_is_taken_in_once_its_endpoint_answers(
    backend: ClusterBackend, nodes: FakeNodes, clock: FakeClock
) -> None:
    clock.advance(3)
    nodes.tell("d0", nodes.registration("d0", "decode"))
    assert "d0" not in backend.nodes and backend.registrar.probing("d0")
    assert not backend.registrar.probing("p0")
    await until(lambda: "d0" in backend.nodes, "d0 taken in")
    assert not backend.registrar.probing("d0")
    assert backend.nodes["d0"].last_seen == 1003.0
    await until(lambda: nodes.to("d0", Registered), "the answer")
    assert nodes.to("d0", Registered) == [Registered()]


@scenario("p0")
async def test_a_registration_while_the_probe_runs_is_ignored(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    nodes.tell("d0", nodes.registration("d0", "decode"))
    nodes.tell("d0", nodes.registration("d0", "decode", incarnation="2"))
    await until(lambda: "d0" in backend.nodes, "d0 taken in")
    for _ in range(20):
        await asyncio.sleep(0)
    assert nodes.to("d0", Registered) == [Registered()]
    assert backend.nodes["d0"].incarnation == "1"


@scenario("p0")
async def test_a_node_whose_endpoint_no_peer_can_dial_is_refused_and_told_why(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    wildcard = replace(nodes.registration("d0", "decode"), kv_endpoint="tcp://0.0.0.0:5")
    nodes.tell("d0", wildcard)
    await until(lambda: nodes.to("d0", Registered), "the answer")
    (answer,) = nodes.to("d0", Registered)
    assert not answer.accepted and "names no address peers can dial" in answer.reason
    assert "d0" not in backend.nodes and not backend.registrar.probing("d0")


@scenario("p0", "d0")
async def test_the_same_process_registering_again_is_kept_as_it_is(
    backend: ClusterBackend, nodes: FakeNodes, clock: FakeClock
) -> None:
    node = backend.nodes["d0"]
    node.inflight = 3  # what the node holds stays counted
    clock.advance(4)
    nodes.tell("d0", nodes.registration("d0", "decode"))  # same incarnation: no probe
    assert not backend.registrar.probing("d0")
    assert backend.nodes["d0"] is node and node.inflight == 3 and node.last_seen == 1004.0
    await until(lambda: nodes.to("d0", Registered), "the answer")
    node.inflight = 0


@scenario()
async def test_a_prefill_node_is_taken_in_at_once(
    backend: ClusterBackend, nodes: FakeNodes, clock: FakeClock
) -> None:
    clock.advance(2)
    nodes.tell("p0", nodes.registration("p0", "prefill"))
    assert backend.nodes["p0"].last_seen == 1002.0 and backend.nodes["p0"].role == "prefill"
    await until(lambda: nodes.to("p0", Registered), "the answer")


def test_the_probe_reads_bracketed_hosts_and_bad_ports() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        assert asyncio.run(probe_endpoint(f"tcp://[127.0.0.1]:{port}", 2.0)) is None
    bad = asyncio.run(probe_endpoint("tcp://127.0.0.1:nope", 2.0))
    assert bad is not None and "tcp://127.0.0.1:nope is not reachable" in bad
    assert "invalid literal" in bad
