"""Registration edges that mutation testing showed no test pinned (scripts/mutation.sh): a
decode node taken in only after its KV endpoint is probed, a refused one told why, a node
registering again (same process: kept as it is), a registration while the probe runs, and
the probe's reading of endpoints. Over test_failover's fake nodes and fake clock."""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import replace

import pytest

from pdserve.common.wire.messages import Registered
from pdserve.router.cluster.backend import ClusterBackend
from pdserve.router.cluster.registration import probe_endpoint
from tests.router.test_failover import (
    FakeClock,
    FakeNodes,
    backend_config,
    cluster,
    scenario,
    until,
)


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
    wildcard = replace(nodes.registration("d0", "decode"), kv_endpoints=("tcp://0.0.0.0:5",))
    nodes.tell("d0", wildcard)
    await until(lambda: nodes.to("d0", Registered), "the answer")
    (answer,) = nodes.to("d0", Registered)
    assert answer.accepted is False
    assert answer.reason == (
        "its KV endpoint tcp://0.0.0.0:5 names no address peers can dial: start the node "
        "with --advertise-host set to an address other hosts reach"
    )
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


def test_the_probe_dials_the_advertised_host_and_port() -> None:
    with socket.create_server(("::1", 0), family=socket.AF_INET6) as listener:
        port = listener.getsockname()[1]
        assert asyncio.run(probe_endpoint(f"tcp://[::1]:{port}", 2.0)) is None
    with socket.create_server(("127.0.0.2", 0)) as listener:  # not the default host
        port = listener.getsockname()[1]
        assert asyncio.run(probe_endpoint(f"tcp://127.0.0.2:{port}", 2.0)) is None


def test_a_probe_out_of_time_names_the_timeout() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        # No time at all: the connection cannot have opened yet, however fast it is.
        why = asyncio.run(probe_endpoint(f"tcp://127.0.0.1:{port}", 0.0))
    assert why is not None and f"tcp://127.0.0.1:{port} is not reachable" in why
    assert "(TimeoutError)" in why


def test_the_registrar_probes_within_the_backends_probe_timeout() -> None:
    async def main() -> None:
        backend = ClusterBackend(backend_config(probe_timeout=0.0), clock=FakeClock())
        nodes = FakeNodes(backend)
        with socket.create_server(("127.0.0.1", 0)) as listener:
            port = listener.getsockname()[1]
            msg = replace(
                nodes.registration("d0", "decode"), kv_endpoints=(f"tcp://127.0.0.1:{port}",)
            )
            nodes.tell("d0", msg)
            await until(lambda: nodes.to("d0", Registered), "the answer")
        (answer,) = nodes.to("d0", Registered)
        assert answer.accepted is False and "(TimeoutError)" in answer.reason
        await backend.close()

    asyncio.run(main())


def test_registrations_are_logged_with_the_reason_of_a_refusal_or_a_missing_pair(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        async with cluster("p0") as (backend, nodes, _):
            nodes.tell("d0", nodes.registration("d0", "decode"))
            await until(lambda: "d0" in backend.nodes, "d0 taken in")
            nodes.tell("b0", replace(nodes.registration("b0", "both"), kv_connector=""))
            odd = replace(nodes.registration("d1", "decode"), kv_connector="nccl")
            nodes.tell("d1", odd)
            await until(lambda: "d1" in backend.nodes, "d1 taken in")
            nodes.tell("d0", nodes.registration("d0", "decode", incarnation="2"))
            await until(lambda: backend.nodes["d0"].incarnation == "2", "d0 taken again")
            wildcard = replace(
                nodes.registration("d9", "decode"), kv_endpoints=("tcp://0.0.0.0:5",)
            )
            nodes.tell("d9", wildcard)
            await until(lambda: nodes.to("d9", Registered), "d9 refused")

    with caplog.at_level(logging.INFO, logger="pdserve.router.cluster.registration"):
        asyncio.run(main())
    logged = [
        (r.levelname, r.getMessage())
        for r in caplog.records
        if r.name == "pdserve.router.cluster.registration"
    ]
    assert logged == [
        ("INFO", "node d0 registered (decode, zmq KV)"),
        ("INFO", "node b0 registered (both, no KV)"),
        ("INFO", "node d1 registered (decode, nccl KV)"),
        (
            "WARNING",
            "node d1 can exchange KV with no node of the other role: "
            "connectors differ (zmq -> nccl)",
        ),
        ("WARNING", "node d0 restarted: failing over what it held"),
        ("INFO", "node d0 registered (decode, zmq KV)"),
        (
            "ERROR",
            "node d9 refused: its KV endpoint tcp://0.0.0.0:5 names no address peers can "
            "dial: start the node with --advertise-host set to an address other hosts reach",
        ),
    ]
