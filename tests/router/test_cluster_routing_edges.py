"""Routing edges that mutation testing showed no test pinned (scripts/mutation.sh): colocated
and local prefills, no route at all, a decode node refusing the request or having no room,
the conversation's holder picked first, what a remote prefill is told about its reservation,
a prefill node lost between reservation and prefill, and a failover whose reservation cannot
be renewed. Over test_failover's fake nodes and fake clock (no subprocess, no socket)."""

from __future__ import annotations

import asyncio
import math

from pdserve.common.engine.sampling_params import SamplingParams
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
from pdserve.router.backend import GenerateRequest
from pdserve.router.cluster.backend import ClusterBackend
from pdserve.router.cluster.placement import PlacementConfig
from pdserve.router.cluster.registry import NodeInfo
from pdserve.router.cluster.streams import BlockHashes
from tests.router.test_failover import (
    BS,
    PROMPT,
    Client,
    FakeClock,
    FakeNodes,
    scenario,
    until,
)


def add(nodes: FakeNodes, node_id: str, role: str) -> NodeInfo:
    nodes.backend.registry.add(node_id, nodes.registration(node_id, role), 1000.0)
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
    request = GenerateRequest("s", PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=1))
    events = [e async for e in backend.generate(request)]
    assert events == [Error("s", "no prefill node available", Failure.UNAVAILABLE)]


def test_a_local_placement_prefills_on_the_decode_node() -> None:
    async def main() -> None:
        backend = ClusterBackend(
            control_port=0, placement=PlacementConfig("local"), clock=FakeClock()
        )
        nodes = FakeNodes(backend)
        nodes.register("d0", "decode")
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
        await backend.close()

    asyncio.run(main())


@scenario("p0", "d0", "d1")
async def test_a_decode_node_refusing_the_request_as_invalid_ends_it(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    nodes.silent = {"d0", "d1"}
    client = Client(backend)
    await until(lambda: nodes.where(ReserveKV, "r"), "the reservation asked")
    (first,) = nodes.where(ReserveKV, "r")
    nodes.tell(first, Error("r", "the grammar does not compile", Failure.BAD_REQUEST))
    last = await client.done()
    assert (last.error, last.failure) == ("the grammar does not compile", Failure.BAD_REQUEST)
    assert nodes.where(ReserveKV, "r") == [first] and nodes.to("p0", Prefill) == []


@scenario("p0", "d0", "d1")
async def test_a_busy_decode_node_is_passed_for_the_next(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    nodes.silent = {"d0", "d1"}
    client = Client(backend)
    await until(lambda: nodes.where(ReserveKV, "r"), "the reservation asked")
    (first,) = nodes.where(ReserveKV, "r")
    other = ({"d0", "d1"} - {first}).pop()
    nodes.tell(first, Busy("r", "full"))
    await until(lambda: len(nodes.where(ReserveKV, "r")) == 2, "the next node asked")
    assert nodes.where(ReserveKV, "r") == [first, other] and nodes.where(Abort, "r") == []
    reserved = Reserved("r", "x", (5, 6), "tcp://d:1", "inc", cached_tokens=BS)
    nodes.tell(other, reserved)
    await nodes.prefilling("r")
    (prefill,) = nodes.to("p0", Prefill)
    assert (prefill.xfer_id, prefill.dest_block_ids) == ("x", (5, 6))
    assert (prefill.dest_kv_endpoint, prefill.dest_kv_instance) == ("tcp://d:1", "inc")
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
    nodes.silent = {"d0"}
    client = Client(backend)
    await until(lambda: nodes.where(ReserveKV, "r"), "the reservation asked")
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
    nodes.silent = {"d0"}
    client = Client(backend)
    await until(lambda: nodes.where(ReserveKV, "r"), "the reservation asked")
    backend.nodes["p0"].last_seen = -math.inf
    nodes.tell("d0", Reserved("r", "x", (1,), "ipc:///kv/d0"))
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
    assert [m.reason for m in nodes.to("d0", Abort)] == ["resuming"]
    other = ({"p0", "p1"} - {first}).pop()
    nodes.tell("d0", Reserved("r~1", "y", (1,), "ipc:///kv/d0"))
    await nodes.prefilling("r~1")
    assert nodes.where(Prefill, "r~1") == [other]
    nodes.answer("r~1", other, "d0", 10, 11)
    assert await client.seen() == ("<10><11>", "length")
    assert backend.stats()["failovers"] == 1
