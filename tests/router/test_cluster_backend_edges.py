"""Cluster backend edges that mutation testing showed no test pinned (scripts/mutation.sh):
what the backend does with each kind of node message (liveness, heartbeats with a gap,
unknown senders, replies, hand-offs), its readiness and stats, integrity reports, the
token timeout, a client's abort and the conversation a finished request leaves cached. Over
the fake nodes and fake clock of test_failover (no subprocess, no socket)."""

from __future__ import annotations

import asyncio
import logging
import math

import pytest
import zmq
import zmq.asyncio

from pdserve.common.wire.messages import (
    Abort,
    Admitted,
    Alive,
    CheckIntegrity,
    Error,
    Failure,
    Heartbeat,
    IntegrityReport,
    Lease,
    Prefill,
    Registered,
    Reregister,
    SyncPrefixes,
    Tokens,
    decode,
    encode,
)
from pdserve.common.wire.payloads import SamplingParams
from pdserve.local_cluster import free_port
from pdserve.router.backend import GenerateRequest
from pdserve.router.cluster.backend import ClusterBackend
from pdserve.router.cluster.routing import POLICIES, PlacementConfig
from pdserve.router.cluster.streams import BlockHashes
from tests.router.test_failover import (
    BS,
    PROMPT,
    SCORED,
    Client,
    FakeClock,
    FakeNodes,
    backend_config,
    scenario,
    until,
)


async def turns(n: int = 20) -> None:
    """Let spawned sends run."""
    for _ in range(n):
        await asyncio.sleep(0)


def heartbeat(node_id: str, seq: int = 0, free: int = 7) -> Heartbeat:
    return Heartbeat(node_id, free, 1, 2, 3, prefix_seq=seq)


def test_an_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        backend_config(policy="nope")


def test_the_backend_takes_every_setting_from_its_router_config() -> None:
    config = backend_config(
        PlacementConfig("auto", threshold=3),
        policy="round_robin",
        heartbeat_timeout=4.0,
        lease_interval=0.5,
        reply_timeout=3.0,
        token_timeout=7.0,
        reserve_wait=2.0,
        probe_timeout=0.5,
        max_failovers=1,
    )
    backend = ClusterBackend(config, max_model_len=100, clock=FakeClock())
    routing = backend.routing
    assert (backend.token_timeout, backend.lease_interval) == (7.0, 0.5)
    assert (backend.registry.heartbeat_timeout, backend.max_model_len) == (4.0, 100)
    assert (backend.control.reply_timeout, backend.registrar.probe_timeout) == (3.0, 0.5)
    assert (routing.reserve_wait, routing.max_failovers) == (2.0, 1)
    assert routing.placement == PlacementConfig("auto", threshold=3)
    assert type(routing.policy) is type(POLICIES["round_robin"]())


@scenario("p0", "d0")
async def test_liveness_comes_only_from_a_nodes_alive_socket(
    backend: ClusterBackend, nodes: FakeNodes, clock: FakeClock
) -> None:
    clock.advance(50)
    nodes.tell("d0", Alive("d0"))  # the right message from the wrong socket
    assert backend.nodes["d0"].last_seen == 1000.0
    nodes.tell("d9#alive", Alive("d9"))  # a node nobody knows: nothing happens
    nodes.tell("d0#alive", Alive("d0"))
    assert backend.nodes["d0"].last_seen == 1050.0
    assert backend.nodes["p0"].last_seen == 1000.0
    assert nodes.sent == []


@scenario("p0", "d0")
async def test_any_message_from_a_known_node_proves_it_lives(
    backend: ClusterBackend, nodes: FakeNodes, clock: FakeClock
) -> None:
    clock.advance(50)
    nodes.tell("p0", Tokens("nobody", (1,)))  # about no request: dropped, but p0 lives
    assert backend.nodes["p0"].last_seen == 1050.0
    nodes.tell("d0", heartbeat("d0"))
    assert backend.nodes["d0"].last_seen == 1050.0
    assert (backend.nodes["d0"].free_blocks, backend.nodes["d0"].num_waiting) == (7, 2)


@scenario("p0", "d0")
async def test_a_heartbeat_with_a_gap_in_its_prefix_changes_asks_for_a_snapshot(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    nodes.tell("p0", heartbeat("p0", seq=1))
    nodes.tell("p0", heartbeat("p0", seq=2))
    await turns()
    assert nodes.to("p0", SyncPrefixes) == []
    nodes.tell("p0", heartbeat("p0", seq=5))
    await until(lambda: nodes.to("p0", SyncPrefixes), "the snapshot asked for")
    assert len(nodes.to("p0", SyncPrefixes)) == 1


@scenario("p0", "d0")
async def test_an_unknown_node_heartbeating_is_asked_to_register_again(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    nodes.tell("d9", heartbeat("d9"))
    await until(lambda: nodes.to("d9", Reregister), "the reregister")
    nodes.tell("d9", Tokens("r", (1,)))  # not a heartbeat: nothing asked
    await turns()
    assert len(nodes.sent) == 1 and "d9" not in backend.nodes


@scenario("p0")
async def test_a_node_being_probed_is_not_asked_to_register_again(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    backend.registrar._probing.add("d9")
    nodes.tell("d9", heartbeat("d9"))
    await turns()
    assert nodes.sent == []


@scenario("p0", "d0")
async def test_an_unreachable_node_is_taken_for_dead_at_once(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    backend._unreachable("d0")
    backend._unreachable("d9")  # unknown: nothing to do
    assert backend.nodes["d0"].last_seen == -math.inf
    assert [n.node_id for n in backend.registry.alive(("prefill", "decode"))] == ["p0"]
    assert not backend.ready()


@scenario("p0", "d0")
async def test_integrity_reports_of_every_live_node(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    backend.nodes["d0"].last_seen = -math.inf  # dead: not asked
    nodes.register("d1", "decode")
    task = asyncio.create_task(backend.integrity())
    await until(lambda: len(nodes.to("p0", CheckIntegrity)) == 1, "p0 asked")
    await until(lambda: len(nodes.to("d1", CheckIntegrity)) == 1, "d1 asked")
    assert nodes.to("d0", CheckIntegrity) == []
    (ask_p,) = nodes.to("p0", CheckIntegrity)
    (ask_d,) = nodes.to("d1", CheckIntegrity)
    assert ask_p.nonce != ask_d.nonce and {ask_p.nonce, ask_d.nonce} == {1, 2}
    report = IntegrityReport(ask_p.nonce, False, "leak", 64, 60, 3, ("a", "b"))
    nodes.tell("p0", report)
    nodes.tell("d1", Error(f"integrity-{ask_d.nonce}", "no", Failure.INTERNAL))  # not a report
    await until(task.done, "the reports")
    assert task.result() == {
        "p0": {
            "role": "prefill",
            "kv_layout": None,  # the fake nodes register none
            "in_flight": 0,  # requests this router routed there and waits on
            "registrations": 0,  # RegisterNode messages it got (fakes skip them)
            "prefix_view": [],  # block hashes the router credits it with (none announced)
            "host_view": [],  # those in its host tier (none announced)
            "report": {
                "ok": False,
                "detail": "leak",
                "num_blocks": 64,
                "free_blocks": 60,
                "cached_blocks": 3,
                "live_requests": ["a", "b"],
            },
        },
        "d1": {
            "role": "decode",
            "kv_layout": None,
            "report": None,
            "in_flight": 0,
            "registrations": 0,
            "prefix_view": [],
            "host_view": [],
        },
    }


@scenario("p0", "d0")
async def test_stats_count_nodes_requests_and_routing(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    client = await nodes.start()
    stats = backend.stats()
    assert stats["nodes_prefill"] == 1 and stats["nodes_decode"] == 1
    assert stats["requests_in_flight"] == 1 and stats["malformed_messages"] == 0
    assert (stats["prefills_remote"], stats["prefills_local"], stats["failovers"]) == (1, 0, 0)
    assert stats["kv_tokens_sent"] == len(PROMPT) and stats["kv_tokens_reused_on_decode"] == 0
    nodes.answer("r", "p0", "d0", 10, 11)
    assert await client.seen() == ("<10><11>", "length")
    assert backend.stats()["requests_in_flight"] == 0


def test_readiness_with_local_placement_needs_only_a_decode_node() -> None:
    clock = FakeClock()
    local = ClusterBackend(backend_config(PlacementConfig("local")), clock=clock)
    fake = FakeNodes(local)
    assert not local.ready()
    assert local.unready_reason() == "no decode node is available (prefill placement is local)"
    fake.register("d0", "decode")
    assert local.ready()
    remote = ClusterBackend(backend_config(PlacementConfig("remote")), clock=clock)
    FakeNodes(remote).register("d0", "decode")
    assert not remote.ready()
    assert remote.unready_reason() == "no prefill/decode route is available"


@scenario("p0", "d0")
async def test_a_hand_off_time_is_observed_from_the_first_token_to_admitted(
    backend: ClusterBackend, nodes: FakeNodes, clock: FakeClock
) -> None:
    client = await nodes.start()
    nodes.tell("d0", Admitted("r"))  # before any first token: no time to observe
    assert backend.nodes["d0"].handoff_s == 0.0
    nodes.tell("p0", Tokens("r", (10,)))
    clock.advance(0.5)
    nodes.tell("p0", Admitted("r"))  # not the decode node: ignored
    assert backend.nodes["d0"].handoff_s == 0.0 and backend.nodes["p0"].handoff_s == 0.0
    nodes.tell("d0", Admitted("r"))
    assert backend.nodes["d0"].handoff_s == 0.5
    nodes.tell("d0", Tokens("r", (11,), finish_reason="length"))
    assert await client.seen() == ("<10><11>", "length")


@scenario("p0", "d0")
async def test_an_error_of_a_node_the_request_left_is_stale(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    client = await nodes.start()
    nodes.tell("p0", Tokens("r", (10,)))
    nodes.tell("p0", Error("other", "who?", Failure.INTERNAL))  # no such request
    nodes.tell("d0", Error("r~1", "late", Failure.INTERNAL))  # no such attempt
    nodes.tell("d0", Tokens("r", (11,), finish_reason="length"))
    assert await client.seen() == ("<10><11>", "length")


@scenario("p0", "d0")
async def test_a_finished_request_leaves_nothing_to_abort_and_its_conversation_expected(
    backend: ClusterBackend, nodes: FakeNodes, clock: FakeClock
) -> None:
    client = await nodes.start()
    before = dict(backend.nodes["d0"].recent_prefixes)
    clock.advance(1)
    nodes.answer("r", "p0", "d0", 10, 11, 12, 13)
    assert await client.seen() == ("<10><11><12><13>", "length")
    assert nodes.where(Abort, "r") == []
    tokens = [*PROMPT, 10, 11, 12, 13]  # 13 tokens: the last has no KV, so 3 full blocks
    expected = BlockHashes(tokens).of(BS, len(tokens) - 1)
    assert len(expected) == 3
    after = backend.nodes["d0"].recent_prefixes
    assert {h: after[h] for h in expected} == dict.fromkeys(expected, clock() + 5.0)
    assert set(after) - set(before) == set(expected) - set(before)
    assert backend.registry.get("p0").recent_prefixes.keys() <= set(expected)


@scenario("p0", "d0")
async def test_a_stream_ended_with_an_abort_frees_its_nodes(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    client = await nodes.start()
    nodes.tell("p0", Tokens("r", (10,)))
    await backend.abort("r")
    await backend.abort("nobody")  # unknown: nothing sent
    assert sorted(nodes.where(Abort, "r")) == ["d0", "p0"]
    last = await client.done()
    assert last.finish_reason == "abort"
    # The stream's own end frees them once more: an abort is idempotent on a node.
    assert sorted(nodes.where(Abort, "r")) == ["d0", "d0", "p0", "p0"]
    assert [m.reason for m in nodes.to("d0", Abort)] == ["client", "stream ended"]


# Nothing will ever come: the wait's end is the test, not its length.
@scenario("p0", "d0", token_timeout=0.01, placement=None)
async def test_no_token_within_the_token_timeout_ends_the_request(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    request = GenerateRequest("r", PROMPT, SamplingParams(max_tokens=8))
    events = [e async for e in backend.generate(request)]
    assert events == [Error("r", "timed out waiting for tokens", Failure.TIMEOUT)]
    assert sorted(nodes.where(Abort, "r")) == ["d0", "d0", "p0", "p0"]


@scenario("p0", "d0")
async def test_leases_go_to_every_live_node_and_none_to_a_dead_one(
    backend: ClusterBackend, nodes: FakeNodes, clock: FakeClock
) -> None:
    await backend.watch()
    assert nodes.to("p0", Lease) == [Lease(())] and nodes.to("d0", Lease) == [Lease(())]
    clock.advance(10)
    nodes.tell("p0#alive", Alive("p0"))
    await backend.watch()
    assert len(nodes.to("p0", Lease)) == 2 and len(nodes.to("d0", Lease)) == 1


@scenario("p0", "d0")
async def test_a_prompt_only_request_is_prefilled_and_answered_there(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    request = SCORED
    events = backend.generate(request)
    first = asyncio.create_task(events.__anext__())
    await until(lambda: nodes.to("p0", Prefill), "the prefill")
    (prefill,) = nodes.to("p0", Prefill)
    assert prefill.xfer_id == "" and nodes.to("d0", Prefill) == []
    nodes.tell("p0", Tokens("s", (), finish_reason="length"))
    await until(first.done, "the answer")
    assert first.result().finish_reason == "length"
    await events.aclose()


def test_the_limits_a_router_runs_with_by_default() -> None:
    backend = ClusterBackend(backend_config(), max_model_len=100, clock=FakeClock())
    FakeNodes(backend).register("p0", "prefill")  # its 4096 is above the router's own
    assert backend.max_model_len == 100
    assert (backend.token_timeout, backend.control.reply_timeout) == (120.0, 10.0)
    assert (backend.routing.reserve_wait, backend.routing.max_failovers) == (10.0, 3)
    assert (backend.registrar.probe_timeout, backend.lease_interval) == (3.0, 1.0)


@scenario("p0", "d0")
async def test_a_heartbeat_drops_the_expected_prefixes_that_expired(
    backend: ClusterBackend, nodes: FakeNodes, clock: FakeClock
) -> None:
    node = backend.nodes["p0"]
    node.expect_cached([b"old"], clock(), ttl=1.0)
    node.expect_cached([b"new"], clock(), ttl=10.0)
    clock.advance(2)
    nodes.tell("p0", heartbeat("p0"))
    assert node.recent_prefixes == {b"new": 1010.0}


@scenario("p0", "d0", max_failovers=0)
async def test_a_failover_note_names_the_node_and_its_message(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    client = await nodes.start()
    nodes.tell("p0", Error("r", "queue full", Failure.BUSY))
    last = await client.done()
    assert last.error == "gave up after 0 failovers: p0: queue full"


@scenario("p0", "d0")
async def test_the_events_of_a_request_carry_its_id(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    events = backend.generate(GenerateRequest("r", PROMPT, SamplingParams(max_tokens=8)))
    first = asyncio.create_task(events.__anext__())
    await nodes.prefilling("r")
    nodes.tell("p0", Tokens("r", (10,)))
    await until(first.done, "the first token")
    assert first.result() == Tokens("r", (10,))
    await backend.abort("r")
    assert await events.__anext__() == Tokens("r", (), finish_reason="abort")
    await events.aclose()


@scenario("p0", "d0")
async def test_a_node_ending_a_request_with_an_error_finish_is_freed(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    client = await nodes.start()
    nodes.tell("p0", Tokens("r", (10,)))
    nodes.tell("d0", Tokens("r", (), finish_reason="error"))
    await client.done()
    assert sorted(nodes.where(Abort, "r")) == ["d0", "p0"]
    assert [m.reason for m in nodes.to("d0", Abort)] == ["stream ended"]


@scenario("p0", "d0")
async def test_a_prompt_scored_on_a_prefill_node_leaves_no_conversation_expected(
    backend: ClusterBackend, nodes: FakeNodes, clock: FakeClock
) -> None:
    request = SCORED
    events = backend.generate(request)
    first = asyncio.create_task(events.__anext__())
    await until(lambda: nodes.to("p0", Prefill), "the prefill")
    routed = dict(backend.nodes["p0"].recent_prefixes)
    clock.advance(1)
    nodes.tell("p0", Tokens("s", (), finish_reason="length"))
    await until(first.done, "the answer")
    await events.aclose()
    assert backend.nodes["p0"].recent_prefixes == routed


@scenario("p0", "d0")
async def test_the_last_token_of_a_finished_request_is_not_expected_cached(
    backend: ClusterBackend, nodes: FakeNodes, clock: FakeClock
) -> None:
    client = await nodes.start()
    clock.advance(1)
    nodes.answer("r", "p0", "d0", 10, 11, 12)  # 12 tokens: the last block is not complete
    assert await client.seen() == ("<10><11><12>", "length")
    tokens = [*PROMPT, 10, 11, 12]
    expected = BlockHashes(tokens).of(BS, len(tokens) - 1)
    assert len(expected) == 2
    third = BlockHashes(tokens).of(BS)[2]
    assert third not in backend.nodes["d0"].recent_prefixes
    assert all(backend.nodes["d0"].recent_prefixes[h] == clock() + 5.0 for h in expected)


@scenario("p0")
async def test_a_colocated_node_expects_the_conversation_it_answered(
    backend: ClusterBackend, nodes: FakeNodes, clock: FakeClock
) -> None:
    backend.registry.add("b0", nodes.registration("b0", "both"), clock())
    client = Client(backend)
    await until(lambda: nodes.to("b0", Prefill), "the prefill")
    clock.advance(1)
    nodes.tell("b0", Tokens("r", (10, 11, 12, 13), finish_reason="length"))
    assert await client.seen() == ("<10><11><12><13>", "length")
    tokens = [*PROMPT, 10, 11, 12, 13]
    expected = BlockHashes(tokens).of(BS, len(tokens) - 1)
    assert all(backend.nodes["b0"].recent_prefixes[h] == clock() + 5.0 for h in expected)


def test_a_started_backend_serves_its_control_socket_and_renews_leases(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        port = free_port()
        config = backend_config(control_port=port, lease_interval=0.01)
        backend = ClusterBackend(config, clock=FakeClock())
        await backend.start()
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, b"p0")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        try:
            await sock.send(encode(FakeNodes.registration("p0", "prefill")))
            got: list[object] = []  # the answer, and leases (the watch loop runs), in any order
            while Registered() not in got or not any(isinstance(m, Lease) for m in got):
                got.append(decode(await asyncio.wait_for(sock.recv(), 10.0)))
            backend.registry.add("x9", FakeNodes.registration("x9", "prefill"), 1000.0)
            await backend.control.send("x9", Lease(()))  # no such peer: taken for dead
            assert backend.nodes["x9"].last_seen == -math.inf
            failed = asyncio.Event()

            async def broken() -> None:
                failed.set()
                raise RuntimeError("a bad round")

            backend.watch = broken  # type: ignore[method-assign]
            await asyncio.wait_for(failed.wait(), 10.0)
            await asyncio.wait_for(failed.wait(), 10.0)
            failed.clear()
            await asyncio.wait_for(failed.wait(), 10.0)  # the loop goes on after a bad round
        finally:
            sock.close()
            ctx.term()
            await backend.close()

    with caplog.at_level(logging.ERROR, logger="pdserve.router.cluster.backend"):
        asyncio.run(main())
    assert "lease/health round failed" in [r.getMessage() for r in caplog.records]
