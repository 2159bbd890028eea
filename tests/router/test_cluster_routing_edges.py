"""Routing edges that mutation testing showed no test pinned (scripts/mutation.sh): colocated
and local prefills, no route at all, a decode node refusing the request or having no room,
the conversation's holder picked first, what a remote prefill is told about its reservation,
a prefill node lost between reservation and prefill, and a failover whose reservation cannot
be renewed. Over test_failover's fake nodes and fake clock (no subprocess, no socket)."""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import replace

import pytest

from pdserve.common.wire.messages import (
    Abort,
    Busy,
    Error,
    Failure,
    Prefill,
    RenewTransfer,
    Reserved,
    ReserveKV,
    Tokens,
)
from pdserve.common.wire.payloads import SamplingParams
from pdserve.router.backend import GenerateRequest
from pdserve.router.cluster.backend import ClusterBackend
from pdserve.router.cluster.registry import NodeInfo
from pdserve.router.cluster.routing import PlacementConfig
from pdserve.router.cluster.streams import BlockHashes
from tests.router.test_failover import (
    BS,
    PROMPT,
    SCORED,
    Client,
    FakeClock,
    FakeNodes,
    cluster,
    scenario,
    until,
)

LOCAL = PlacementConfig("local")


def add(nodes: FakeNodes, node_id: str, role: str, tp: int = 1) -> NodeInfo:
    """Register a node of this TP size after the cluster started."""
    registration = replace(nodes.registration(node_id, role), tp_size=tp)
    nodes.backend.registry.add(node_id, registration, 1000.0)
    return nodes.backend.nodes[node_id]


@scenario("p0")
async def test_a_colocated_node_runs_the_whole_request(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    both = add(nodes, "b0", "both")
    client = Client(backend)
    await until(lambda: nodes.to("b0", Prefill), "the prefill on b0")
    (prefill,) = nodes.to("b0", Prefill)
    assert (prefill.request_id, prefill.prompt_token_ids, prefill.xfer_id) == ("r", PROMPT, "")
    assert prefill.sampling.max_tokens == 8 and prefill.output_token_ids == ()
    assert (both.inflight, both.local_prefills) == (1, 0)
    assert both.recent_tokens == len(PROMPT)
    stats = backend.stats()
    assert (stats["prefills_local"], stats["prefills_remote"]) == (0, 0)
    nodes.tell("b0", Tokens("r", (10, 11), finish_reason="length"))
    assert await client.seen() == ("<10><11>", "length")


@scenario("p0")
async def test_no_decode_node_is_no_route(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    last = await Client(backend).done()
    assert (last.finish_reason, last.failure) == ("error", Failure.UNAVAILABLE)
    assert last.error == "no prefill/decode route is available"
    assert nodes.sent == []


@scenario("d0")
async def test_a_prompt_to_score_needs_a_prefill_node(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    events = [e async for e in backend.generate(SCORED)]
    assert events == [Error("s", "no prefill node available", Failure.UNAVAILABLE)]


@scenario("d0", placement=LOCAL)
async def test_a_local_placement_prefills_on_the_decode_node(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    client = Client(backend)
    await until(lambda: nodes.to("d0", Prefill), "the prefill on d0")
    assert nodes.to("d0", ReserveKV) == [] and nodes.to("d0", Prefill)[0].xfer_id == ""
    d0 = backend.nodes["d0"]
    assert (d0.inflight, d0.local_prefills) == (1, 1)
    assert (backend.stats()["prefills_local"], backend.stats()["prefills_remote"]) == (1, 0)
    nodes.tell("d0", Tokens("r", (10,)))
    assert (d0.inflight, d0.local_prefills) == (1, 0)
    nodes.tell("d0", Tokens("r", (11,), finish_reason="length"))
    assert await client.seen() == ("<10><11>", "length")
    assert (d0.inflight, d0.local_prefills) == (0, 0)


@scenario("p0", "d0", "d1")
async def test_a_decode_node_refusing_the_request_as_invalid_ends_it(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    client, first = await nodes.reserving("d0", "d1")
    nodes.tell(first, Error("r", "the grammar does not compile", Failure.BAD_REQUEST))
    last = await client.done()
    assert (last.error, last.failure) == ("the grammar does not compile", Failure.BAD_REQUEST)
    assert nodes.where(ReserveKV, "r") == [first] and nodes.to("p0", Prefill) == []


@scenario("p0", "d0", "d1")
async def test_a_busy_decode_node_is_passed_for_the_next(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    client, first = await nodes.reserving("d0", "d1")
    other = ({"d0", "d1"} - {first}).pop()
    nodes.tell(first, Busy("r", "full"))
    await until(lambda: len(nodes.where(ReserveKV, "r")) == 2, "the next node asked")
    assert nodes.where(ReserveKV, "r") == [first, other] and nodes.where(Abort, "r") == []
    reserved = Reserved("r", "x", (5, 6), ("tcp://d:1",), "inc", cached_tokens=BS)
    nodes.tell(other, reserved)
    await nodes.prefilling("r")
    (prefill,) = nodes.to("p0", Prefill)
    assert (prefill.xfer_id, prefill.dest_block_ids) == ("x", (5, 6))
    assert (prefill.dest_kv_endpoints, prefill.dest_kv_instance) == (("tcp://d:1",), "inc")
    assert (prefill.dest_cached_tokens, prefill.output_token_ids) == (BS, ())
    stats = backend.stats()
    assert stats["kv_tokens_reused_on_decode"] == BS
    assert stats["kv_tokens_sent"] == len(PROMPT) - BS
    assert backend.nodes["p0"].recent_tokens == len(PROMPT)
    nodes.answer("r", "p0", other, 10, 11)
    assert await client.seen() == ("<10><11>", "length")


@scenario("p0", "d0")
async def test_no_room_on_any_decode_node_within_the_wait_is_unavailable(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    backend.routing.reserve_wait = 0.0
    client, _ = await nodes.reserving("d0")
    nodes.tell("d0", Busy("r", "full"))
    last = await client.done()
    assert (last.error, last.failure) == (
        "no decode node has room for this request",
        Failure.UNAVAILABLE,
    )


@scenario("p0", "d0")
async def test_a_reservation_never_answered_is_aborted_on_its_node(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    backend.routing.reserve_wait = 0.0
    backend.control.reply_timeout = 0.01  # d0 never answers: the wait's end is the test
    nodes.silent = {"d0"}
    last = await Client(backend).done()
    assert last.failure is Failure.UNAVAILABLE
    assert [m.reason for m in nodes.to("d0", Abort)][0] == "reserve timed out"


@scenario("p0", "d0", "d1")
async def test_the_decode_node_holding_most_of_the_conversation_comes_first(
    backend: ClusterBackend, nodes: FakeNodes, clock: FakeClock
) -> None:
    hashes = BlockHashes(list(PROMPT)).of(BS)
    backend.nodes["d0"].inflight = 0
    backend.nodes["d1"].free_blocks = 1  # least_loaded alone picks d0
    backend.nodes["d1"].expect_cached(hashes, clock(), ttl=100)  # 8 of 9 tokens
    client = Client(backend)
    await nodes.prefilling("r")
    assert nodes.where(ReserveKV, "r") == ["d1"]
    nodes.answer("r", "p0", "d1", 10, 11)
    assert await client.seen() == ("<10><11>", "length")


@scenario("p0", "d0", "d1")
async def test_a_decode_node_holding_less_than_half_is_not_preferred(
    backend: ClusterBackend, nodes: FakeNodes, clock: FakeClock
) -> None:
    hashes = BlockHashes(list(PROMPT)).of(BS)
    backend.nodes["d1"].free_blocks = 1  # least_loaded picks d0
    backend.nodes["d1"].expect_cached(hashes[:1], clock(), ttl=100)  # 4 of 9 tokens
    client = Client(backend)
    await nodes.prefilling("r")
    assert nodes.where(ReserveKV, "r") == ["d0"]
    nodes.answer("r", "p0", "d0", 10, 11)
    assert await client.seen() == ("<10><11>", "length")


@scenario("p0", "d0")
async def test_a_prefill_node_gone_during_the_reservation_leaves_no_route(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    client, _ = await nodes.reserving("d0")
    backend.nodes["p0"].last_seen = -math.inf
    nodes.tell("d0", Reserved("r", "x", (1,), ("ipc:///kv/d0",)))
    last = await client.done()
    assert (last.error, last.failure) == ("no prefill node available", Failure.UNAVAILABLE)
    assert nodes.where(Abort, "r") == ["d0"]  # the reservation is freed


@scenario("p0", "p1", "d0")
async def test_a_reservation_that_cannot_be_renewed_starts_over(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    client = await nodes.start()
    (first,) = nodes.where(Prefill, "r")
    nodes.silent = {"d0"}
    nodes.tell(first, Error("r", "queue full", Failure.BUSY))
    await until(lambda: nodes.where(RenewTransfer, "r"), "the renewal asked")
    nodes.tell("d0", Error("r", "not held", Failure.NO_RESERVATION))
    await until(lambda: nodes.where(ReserveKV, "r~1"), "the new reservation")
    assert nodes.to("d0", Abort) == [Abort("r", "resuming")]
    other = ({"p0", "p1"} - {first}).pop()
    nodes.tell("d0", Reserved("r~1", "y", (1,), ("ipc:///kv/d0",)))
    await nodes.prefilling("r~1")
    assert nodes.where(Prefill, "r~1") == [other]
    nodes.answer("r~1", other, "d0", 10, 11)
    assert await client.seen() == ("<10><11>", "length")
    assert backend.stats()["failovers"] == 1


# -- whole events, every field -----------------------------------------------------------------


async def events_of(backend: ClusterBackend, request: GenerateRequest) -> list[object]:
    return [e async for e in backend.generate(request)]


def plain(rid: str = "r", **sampling: object) -> GenerateRequest:
    return GenerateRequest(rid, PROMPT, SamplingParams(max_tokens=8, **sampling))  # type: ignore[arg-type]


@scenario("p0")
async def test_no_route_is_an_error_under_the_requests_id(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    why = "no prefill/decode route is available"
    assert await events_of(backend, plain()) == [Error("r", why, Failure.UNAVAILABLE)]


@scenario("p0", "d0")
async def test_no_room_is_an_error_under_the_requests_id(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    backend.routing.reserve_wait = 0.0
    nodes.silent = {"d0"}
    task = asyncio.create_task(events_of(backend, plain()))
    await until(lambda: nodes.where(ReserveKV, "r"), "the reservation asked")
    (ask,) = nodes.to("d0", ReserveKV)
    assert (ask.prompt_token_ids, ask.sampling, ask.output_token_ids) == (
        PROMPT,
        plain().sampling,
        (),
    )
    nodes.tell("d0", Busy("r", "full"))
    await until(task.done, "the answer")
    why = "no decode node has room for this request"
    assert task.result() == [Error("r", why, Failure.UNAVAILABLE)]


@scenario("p0", "d0")
async def test_no_prefill_node_left_is_an_error_under_the_requests_id(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    nodes.silent = {"d0"}
    task = asyncio.create_task(events_of(backend, plain()))
    await until(lambda: nodes.where(ReserveKV, "r"), "the reservation asked")
    backend.nodes["p0"].last_seen = -math.inf
    nodes.tell("d0", Reserved("r", "x", (1,), ("ipc:///kv/d0",)))
    await until(task.done, "the answer")
    assert task.result() == [Error("r", "no prefill node available", Failure.UNAVAILABLE)]


@scenario("p0", "d0", max_failovers=0)
async def test_giving_up_is_an_error_under_the_attempts_id(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    task = asyncio.create_task(events_of(backend, plain()))
    await nodes.prefilling("r")
    nodes.tell("p0", Error("r", "queue full", Failure.BUSY))
    await until(task.done, "the answer")
    why = "gave up after 0 failovers: p0: queue full"
    assert task.result() == [Error("r", why, Failure.UNAVAILABLE)]
    assert nodes.to("p0", Abort)[0] == Abort("r", "p0: queue full")


@scenario("p0", "p1")
async def test_a_scored_prompt_is_sent_whole_and_retried_elsewhere(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    backend.nodes["p1"].free_blocks = 1  # p0 first
    request = SCORED
    task = asyncio.create_task(events_of(backend, request))
    await until(lambda: nodes.to("p0", Prefill), "the prefill on p0")
    assert nodes.to("p0", Prefill) == [Prefill("s", PROMPT, request.sampling)]
    nodes.tell("p0", Error("s", "queue full", Failure.BUSY))
    await until(lambda: nodes.to("p1", Prefill), "the retry on p1")
    assert nodes.to("p1", Prefill) == [Prefill("s~1", PROMPT, request.sampling)]
    nodes.tell("p1", Tokens("s~1", (), finish_reason="length"))
    await until(task.done, "the answer")
    assert [m.reason for m in nodes.to("p0", Abort)] == ["p0: queue full"]


@scenario("p0", "d0", "d1")
async def test_a_resumed_request_tells_its_new_prefill_node_what_was_streamed(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    client = await nodes.start()
    nodes.streamed()
    nodes.tell("d0", Error("r", "shutting down", Failure.DRAINING))
    await nodes.prefilling("r~1")
    first, again = nodes.to("p0", Prefill)
    assert (again.prompt_token_ids, again.sampling) == (PROMPT, first.sampling)
    assert again.output_token_ids == (10, 11) and first.output_token_ids == ()
    assert first.sampling == SamplingParams(max_tokens=8)
    assert Abort("r", "resuming") not in nodes.to("d0", Abort)  # d0 left with the failover
    nodes.answer("r~1", "p0", "d1", 12, 13)
    assert await client.seen() == ("<10><11><12><13>", "length")


@scenario("p0")
async def test_a_colocated_node_refusing_is_not_asked_again(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    add(nodes, "b0", "both")
    add(nodes, "b1", "both").free_blocks = 1  # b0 first
    client = Client(backend)
    await until(lambda: nodes.to("b0", Prefill), "the prefill on b0")
    nodes.tell("b0", Tokens("r", (10,)))
    nodes.tell("b0", Error("r", "shutting down", Failure.DRAINING))
    await until(lambda: nodes.to("b1", Prefill), "the retry on b1")
    assert nodes.to("b1", Prefill)[0].output_token_ids == (10,)
    nodes.tell("b1", Tokens("r~1", (11,), finish_reason="length"))
    assert await client.seen() == ("<10><11>", "length")


@scenario("d0", "d1", placement=LOCAL)
async def test_a_local_decode_node_refusing_is_not_asked_again(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    backend.nodes["d1"].free_blocks = 1  # d0 first
    client = Client(backend)
    await until(lambda: nodes.to("d0", Prefill), "the prefill on d0")
    nodes.tell("d0", Error("r", "shutting down", Failure.DRAINING))
    await until(lambda: nodes.to("d1", Prefill), "the retry on d1")
    nodes.tell("d1", Tokens("r~1", (10, 11), finish_reason="length"))
    assert await client.seen() == ("<10><11>", "length")


@scenario("p0", "p1", "d0", "d1")
async def test_a_lost_prefill_node_leaves_only_the_decode_nodes_others_can_fill(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    for node_id in ("p1", "d1"):  # another connector: p1 fills d1 only; both last in load
        backend.nodes[node_id].kv_connector = "nccl"
        backend.nodes[node_id].free_blocks = 1
    client = await nodes.start()
    assert nodes.where(Prefill, "r") == ["p0"] and nodes.where(ReserveKV, "r") == ["d0"]
    nodes.tell("p0", Tokens("r", (10,)))
    nodes.tell("p0", Error("r", "queue full", Failure.BUSY))  # after the first: resume
    await nodes.prefilling("r~1")
    assert nodes.where(ReserveKV, "r~1") == ["d1"] and nodes.where(Prefill, "r~1") == ["p1"]
    nodes.answer("r~1", "p1", "d1", 11, 12)
    assert await client.seen() == ("<10><11><12>", "length")


@scenario("p0", "p1", "d0")
async def test_the_prefill_node_picked_can_fill_the_reserved_decode_node(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    backend.nodes["p1"].kv_connector = "nccl"  # cannot fill d0, though the least loaded
    backend.nodes["p0"].free_blocks = 1
    client = await nodes.start()
    assert nodes.where(Prefill, "r") == ["p0"]
    nodes.answer("r", "p0", "d0", 10, 11)
    assert await client.seen() == ("<10><11>", "length")


@scenario("p0", "d0")
async def test_routing_counts_add_up_over_requests(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    for rid in ("a", "b"):
        client = Client(backend, rid)
        await nodes.prefilling(rid)
        nodes.answer(rid, "p0", "d0", 10, 11)
        assert await client.seen() == ("<10><11>", "length")
    stats = backend.stats()
    assert (stats["prefills_remote"], stats["kv_tokens_sent"]) == (2, 2 * len(PROMPT))
    nodes.silent = {"d0"}
    client = Client(backend, "c")
    await until(lambda: nodes.where(ReserveKV, "c"), "the reservation asked")
    nodes.tell("d0", Reserved("c", "x", (1,), ("ipc:///kv/d0",), cached_tokens=BS))
    nodes.tell("d0", Reserved("c", "x", (1,), ("ipc:///kv/d0",), cached_tokens=BS))  # late: none
    await nodes.prefilling("c")
    nodes.answer("c", "p0", "d0", 10, 11)
    await client.seen()
    client = Client(backend, "e")
    await until(lambda: nodes.where(ReserveKV, "e"), "the reservation asked")
    nodes.tell("d0", Reserved("e", "x", (1,), ("ipc:///kv/d0",), cached_tokens=2 * BS))
    await nodes.prefilling("e")
    nodes.answer("e", "p0", "d0", 10, 11)
    await client.seen()
    stats = backend.stats()
    assert (stats["kv_tokens_reused_on_decode"], stats["kv_tokens_sent"]) == (
        3 * BS,
        4 * len(PROMPT) - 3 * BS,
    )


@scenario("d0", placement=LOCAL)
async def test_local_prefills_are_counted_over_requests(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    for rid in ("a", "b"):
        client = Client(backend, rid)
        await until(lambda rid=rid: nodes.where(Prefill, rid), "the prefill")
        nodes.tell("d0", Tokens(rid, (10,), finish_reason="length"))
        await client.seen()
    assert backend.stats()["prefills_local"] == 2


@scenario("p0", "d0", "d1")
async def test_a_decode_node_holding_exactly_half_comes_first(
    backend: ClusterBackend, nodes: FakeNodes, clock: FakeClock
) -> None:
    prompt = tuple(range(1, 9))  # 8 tokens: 2 blocks
    backend.nodes["d1"].free_blocks = 1  # least_loaded alone picks d0
    backend.nodes["d1"].expect_cached(BlockHashes(list(prompt)).of(BS)[:1], clock(), ttl=100)
    task = asyncio.create_task(
        events_of(backend, GenerateRequest("h", prompt, SamplingParams(max_tokens=2)))
    )
    await nodes.prefilling("h")
    assert nodes.where(ReserveKV, "h") == ["d1"]
    nodes.answer("h", "p0", "d1", 10, 11)
    await until(task.done, "the answer")


@scenario("p0", "d0", "b0", policy="prefix_aware", placement=None)
async def test_every_policy_routes_remote_local_colocated_and_scored_requests(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    client = Client(backend, "a")
    await nodes.prefilling("a")
    nodes.answer("a", "p0", "d0", 10, 11)
    assert await client.seen() == ("<10><11>", "length")
    task = asyncio.create_task(events_of(backend, SCORED))
    await until(lambda: nodes.where(Prefill, "s"), "the scoring prefill")
    (node,) = nodes.where(Prefill, "s")
    nodes.tell(node, Tokens("s", (), finish_reason="length"))
    await until(task.done, "the score")


@scenario("p0", "d0", policy="prefix_aware")
async def test_a_second_round_of_reservations_follows_the_policy_again(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    client, _ = await nodes.reserving("d0")
    nodes.tell("d0", Busy("r", "full"))
    # The next round comes after the routing's pause (real time): polled for, generously.
    for _ in range(1000):
        if len(nodes.where(ReserveKV, "r")) == 2:
            break
        await asyncio.sleep(0.01)
    assert nodes.where(ReserveKV, "r") == ["d0", "d0"]
    nodes.tell("d0", Reserved("r", "x", (1,), ("ipc:///kv/d0",)))
    await nodes.prefilling("r")
    nodes.answer("r", "p0", "d0", 10, 11)
    assert await client.seen() == ("<10><11>", "length")


@scenario("p0", "d0", placement=PlacementConfig("auto", threshold=1))
async def test_auto_placement_reads_the_routers_clock(
    backend: ClusterBackend, nodes: FakeNodes, clock: FakeClock
) -> None:
    # d0 is about to hold the prompt's 2 full blocks, by the router's (fake) clock: only 1
    # token is missing there, within the threshold.
    backend.nodes["d0"].expect_cached(BlockHashes(list(PROMPT)).of(BS), clock(), ttl=100)
    client = Client(backend)
    await until(lambda: nodes.where(Prefill, "r"), "the prefill")
    assert nodes.where(Prefill, "r") == ["d0"] and nodes.where(ReserveKV, "r") == []
    nodes.tell("d0", Tokens("r", (10, 11), finish_reason="length"))
    assert await client.seen() == ("<10><11>", "length")


def test_a_failover_is_logged_with_its_reason_and_kind(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with cluster("p0", "p1", "d0") as (backend, nodes, _):
            client = await nodes.start()
            (first,) = nodes.where(Prefill, "r")
            nodes.tell(first, Error("r", "queue full", Failure.BUSY))
            other = ({"p0", "p1"} - {first}).pop()
            await until(lambda: nodes.where(Prefill, "r")[1:], "the retry")
            nodes.answer("r", other, "d0", 10, 11)
            await client.seen()

    with caplog.at_level(logging.WARNING, logger="pdserve.router.cluster.routing"):
        asyncio.run(main())
    logged = [r.getMessage() for r in caplog.records if r.name == "pdserve.router.cluster.routing"]
    assert len(logged) == 1 and logged[0].startswith("request r: p")
    assert logged[0].endswith(": queue full; failing over (prefill)")


@scenario()
async def test_a_scored_prompt_may_run_on_a_colocated_node(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    add(nodes, "b0", "both")
    request = SCORED
    task = asyncio.create_task(events_of(backend, request))
    await until(lambda: nodes.to("b0", Prefill), "the prefill on b0")
    nodes.tell("b0", Tokens("s", (), finish_reason="length"))
    await until(task.done, "the answer")
    assert task.result() == [Tokens("s", (), finish_reason="length")]


# -- tensor parallelism: the sending TP the decode ranks expect ---------------------------------


@scenario("d0")
async def test_the_reservation_expects_the_prefill_nodes_tp(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    add(nodes, "p0", "prefill", 2)
    client = await nodes.start()
    (reserve,) = nodes.to("d0", ReserveKV)
    assert reserve.src_tp == 2
    assert nodes.to("d0", RenewTransfer) == []  # the prefill node it got is the expected one
    nodes.answer("r", "p0", "d0", 10, 11)
    assert await client.seen() == ("<10><11>", "length")


@scenario("d0")
async def test_a_prefill_node_of_another_tp_renews_the_reservation_first(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    add(nodes, "p0", "prefill", 4)
    client, _ = await nodes.reserving("d0")
    nodes.tell("d0", Reserved("r", "x", (1,), ("ipc:///kv/d0",), src_tp=1))  # for TP 1
    await until(lambda: nodes.where(RenewTransfer, "r"), "the renewal asked")
    assert nodes.to("d0", RenewTransfer) == [RenewTransfer("r", src_tp=4)]
    assert nodes.where(Prefill, "r") == []  # not before the decode ranks expect 4 slices
    nodes.tell("d0", Reserved("r", "y", (1,), ("ipc:///kv/d0",), src_tp=4))
    await nodes.prefilling("r")
    (prefill,) = nodes.to("p0", Prefill)
    assert prefill.xfer_id == "y"
    nodes.answer("r", "p0", "d0", 10, 11)
    assert await client.seen() == ("<10><11>", "length")
