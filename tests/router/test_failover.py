"""Failover in process: the router's backend over fake nodes behind its control server (no
subprocess, no socket, a fake clock). For each way a node fails a request (BUSY, DRAINING,
KV_FAILED from either end, heartbeats lost, a lease expired, a restart), which node the
request leaves and never goes back to, how often it is retried, and what the client sees:
the tokens going on without a duplicate, or one clean error."""

from __future__ import annotations

import ast
import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.common.wire.messages import (
    Abort,
    Admitted,
    Alive,
    Error,
    Failure,
    Lease,
    Message,
    Prefill,
    RegisterNode,
    RenewTransfer,
    Reserved,
    ReserveKV,
    Tokens,
)
from pdserve.common.wire.payloads import SamplingParams
from pdserve.router.backend import GenerateRequest
from pdserve.router.cluster.backend import ClusterBackend
from pdserve.router.cluster.routing import PlacementConfig
from pdserve.router.config import RouterConfig
from pdserve.router.generation import Choice, ChoiceDelta, StopStringMatcher
from tests.router.test_registry import FakeClock

BS = 4
PROMPT = tuple(range(1, 10))
SCORED = GenerateRequest("s", PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=1))  # no answer
TIMEOUT = 5.0  # the heartbeat timeout, in the fake clock's seconds
STEPS = 10_000  # how many turns of the event loop a test waits for something at most


def backend_config(placement: PlacementConfig | None = None, **options: Any) -> RouterConfig:
    """A test backend's RouterConfig: control on a free port; the placement as the
    PlacementConfig the flags make (None: the flags' default)."""
    placement = placement or PlacementConfig()
    where = {"prefill_placement": placement.mode, "local_prefill_threshold": placement.threshold}
    return RouterConfig("m", **{"control_port": 0, **where, **options})


async def until(condition: Callable[[], bool], what: str) -> None:
    """Let the event loop run until condition() holds (failing after STEPS turns)."""
    for _ in range(STEPS):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


class FakeNodes:
    """The nodes behind the backend's control server: whatever the router sends is recorded
    (nothing leaves the process); a decode node answers ReserveKV and RenewTransfer with a
    reservation at once, and every other message waits for the test to answer as a node would
    (`tell`)."""

    def __init__(self, backend: ClusterBackend) -> None:
        self.backend = backend
        self.sent: list[tuple[str, Message]] = []
        self.silent: set[str] = set()  # nodes that answer nothing (killed)
        backend.control.send = self.send  # type: ignore[method-assign]

    async def send(self, node_id: str, msg: Message) -> None:
        self.sent.append((node_id, msg))
        if isinstance(msg, ReserveKV | RenewTransfer) and node_id not in self.silent:
            xfer = f"x{len(self.sent)}"
            endpoints = (f"ipc:///kv/{node_id}",)
            reply = Reserved(msg.request_id, xfer, (1, 2, 3), endpoints, "i", src_tp=msg.src_tp)
            asyncio.get_running_loop().call_soon(self.tell, node_id, reply)

    def tell(self, node_id: str, msg: Message) -> None:
        self.backend.on_message(node_id, msg)

    @staticmethod
    def registration(node_id: str, role: str, incarnation: str = "1") -> RegisterNode:
        return RegisterNode(
            node_id=node_id,
            role=role,
            kv_endpoints=(f"ipc:///kv/{node_id}",) if role == "decode" else (),
            kv_connector="zmq",
            layout_digest="same",
            num_blocks=64,
            block_size=BS,
            max_model_len=4096,
            incarnation=incarnation,
        )

    def register(self, node_id: str, role: str) -> None:
        msg = self.registration(node_id, role)
        self.backend.registry.add(node_id, msg, self.backend.registry.clock())

    def to(self, node_id: str, kind: type[Message]) -> list[Message]:
        """What the router sent node_id, of one message type, in order."""
        return [m for n, m in self.sent if n == node_id and isinstance(m, kind)]

    def where(self, kind: type[Message], request_id: str) -> list[str]:
        """The nodes sent a message of this type about request_id, in order."""
        return [n for n, m in self.sent if isinstance(m, kind) and m.request_id == request_id]

    async def start(self) -> Client:
        """A client's request, once the router sent its prefill."""
        client = Client(self.backend)
        await self.prefilling("r")
        return client

    async def reserving(self, *silent: str) -> tuple[Client, str]:
        """A client's request, once the router asked a decode node for the reservation, which
        the `silent` nodes leave for the test to answer: the client, and the node asked."""
        self.silent = set(silent)
        client = Client(self.backend)
        await until(lambda: self.where(ReserveKV, "r"), "the reservation asked")
        (asked,) = self.where(ReserveKV, "r")
        return client, asked

    async def prefilling(self, request_id: str) -> None:
        """Wait until the router sent the prefill of this attempt of the request."""
        await until(lambda: self.where(Prefill, request_id), f"the prefill of {request_id}")

    def streamed(self) -> None:
        """Request r streamed <10> from p0 and <11> from d0, which has the whole KV."""
        self.tell("p0", Tokens("r", (10,)))
        self.tell("d0", Admitted("r"))
        self.tell("d0", Tokens("r", (11,)))

    def answer(self, request_id: str, prefill: str, decode: str, first: int, *rest: int) -> None:
        """The prefill node's first token, then the decode node's last ones."""
        self.tell(prefill, Tokens(request_id, (first,)))
        self.tell(decode, Tokens(request_id, rest, finish_reason="length"))


class Digits:
    """A detokenizer that writes each token as <id>: a duplicated token shows in the text."""

    def push(self, token_ids: list[int]) -> str:
        return "".join(f"<{t}>" for t in token_ids)

    def flush(self) -> str:
        return ""


class Client:
    """One request read as the HTTP layer reads it: the backend's events through a Choice."""

    def __init__(self, backend: ClusterBackend, rid: str = "r", max_tokens: int = 8) -> None:
        request = GenerateRequest(rid, PROMPT, SamplingParams(max_tokens=max_tokens))
        self.choice = Choice(0, 0, request, Digits(), StopStringMatcher(()))  # type: ignore[arg-type]
        self.deltas: list[ChoiceDelta] = []
        self.task = asyncio.create_task(self._read(backend.generate(request)))

    async def _read(self, events: AsyncIterator[Tokens | Error]) -> None:
        async for event in events:
            self.deltas.append(self.choice.on_event(event))

    async def done(self) -> ChoiceDelta:
        """The last delta, once the backend's stream has ended."""
        await until(self.task.done, "the request to end")
        await self.task
        return self.deltas[-1]

    async def seen(self) -> tuple[str, str | None]:
        """What the client saw once the stream ended: its text and how it finished."""
        last = await self.done()
        return self.text, last.finish_reason

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)


ROLES = {"p": "prefill", "d": "decode", "b": "both"}  # a fake node's role by its name's letter


@contextlib.asynccontextmanager
async def cluster(
    *nodes: str, **options: Any
) -> AsyncIterator[tuple[ClusterBackend, FakeNodes, FakeClock]]:
    """A backend over nodes named p* (prefill), d* (decode) or b* (both), all alive at the
    fake clock's start. `options` go to ClusterBackend; by default prefill runs on prefill
    nodes always (placement None: the backend's own default)."""
    clock = FakeClock()
    options = {"heartbeat_timeout": TIMEOUT, "placement": PlacementConfig("remote"), **options}
    backend = ClusterBackend(backend_config(**options), clock=clock)
    fake = FakeNodes(backend)
    for node_id in nodes:
        fake.register(node_id, ROLES[node_id[0]])
    try:
        yield backend, fake, clock
        assert len(backend.table) == 0, "a request is left in the table"
        counts = {n.node_id: (n.inflight, n.local_prefills) for n in backend.nodes.values()}
        assert set(counts.values()) == {(0, 0)}, f"in-flight counts left: {counts}"
    finally:  # a failed test leaves its client waiting: stop it before the backend
        others = asyncio.all_tasks() - {asyncio.current_task()}
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await backend.close()


Body = Callable[[ClusterBackend, FakeNodes, FakeClock], Awaitable[None]]


def scenario(*nodes: str, **options: Any) -> Callable[[Body], Callable[[], None]]:
    """The decorated coroutine becomes a test run over a fresh cluster of these nodes
    (`options` as `cluster`'s)."""

    def wrap(body: Body) -> Callable[[], None]:
        def test() -> None:
            run(body, *nodes, **options)

        return test

    return wrap


def run(body: Body, *nodes: str, **options: Any) -> None:
    """Run body over a fresh cluster of these nodes (`options` as `cluster`'s)."""

    async def main() -> None:
        async with cluster(*nodes, **options) as parts:
            await body(*parts)

    asyncio.run(main())


# -- a node refuses: BUSY, DRAINING --------------------------------------------------------------


@scenario("p0", "p1", "d0", "d1")
async def test_a_busy_prefill_node_is_left_and_the_decode_reservation_kept(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    client = await nodes.start()
    nodes.tell("p0", Error("r", "queue full", Failure.BUSY))
    await until(lambda: nodes.to("p1", Prefill), "the prefill on p1")
    assert nodes.where(ReserveKV, "r") == ["d0"]  # reserved once: the blocks are kept
    assert nodes.where(RenewTransfer, "r") == ["d0"]
    assert nodes.where(Abort, "r") == ["p0"]
    assert backend.table.get("r").lost == {"p0"}
    (renewed,) = nodes.to("p1", Prefill)
    assert renewed.xfer_id != nodes.to("p0", Prefill)[0].xfer_id
    nodes.tell("p0", Tokens("r", (99,)))  # p0 computed it anyway: too late, dropped
    nodes.tell("d0", Tokens("r", (11,)))  # the decode node outruns p1's first token
    nodes.tell("p1", Tokens("r", (10,)))
    nodes.tell("d0", Tokens("r", (12,), finish_reason="length"))
    assert await client.seen() == ("<10><11><12>", "length")
    assert backend.stats()["failovers"] == 1
    assert backend.failovers() == {"busy": 1}  # by cause: the node's Failure kind


@scenario("p0", "d0", "d1")
async def test_a_draining_decode_node_is_left_mid_stream_and_the_tokens_go_on(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    client = await nodes.start()
    nodes.streamed()
    nodes.tell("d0", Error("r", "shutting down", Failure.DRAINING))
    await until(lambda: nodes.where(ReserveKV, "r~1"), "the retry's reservation")
    assert nodes.where(ReserveKV, "r~1") == ["d1"]  # not the node that just refused
    assert nodes.to("d1", ReserveKV)[0].output_token_ids == (10, 11)  # resumed
    assert sorted(nodes.where(Abort, "r")) == ["d0", "p0"]
    await nodes.prefilling("r~1")
    nodes.tell("d0", Tokens("r", (12,)))  # the old attempt's late token: dropped
    nodes.answer("r~1", "p0", "d1", 12, 13)
    assert await client.seen() == ("<10><11><12><13>", "length")
    assert backend.stats()["failovers"] == 1


# -- the KV transfer fails -----------------------------------------------------------------------


@scenario("p0", "d0", "d1")
async def test_kv_failed_from_the_prefill_node_leaves_a_decode_node_the_router_thinks_alive(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    client = await nodes.start()
    nodes.tell("p0", Error("r", "cannot reach d0", Failure.KV_FAILED))
    await nodes.prefilling("r~1")
    assert [n.node_id for n in backend.registry.alive(("decode",))] == ["d0", "d1"]
    assert nodes.where(ReserveKV, "r~1") == ["d1"]
    assert backend.table.get("r").lost == {"d0"}
    nodes.answer("r~1", "p0", "d1", 10, 11)
    assert await client.seen() == ("<10><11>", "length")


@scenario("p0", "d0")
async def test_kv_failed_from_the_decode_node_retries_anywhere_that_node_included(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    client = await nodes.start()
    nodes.tell("p0", Tokens("r", (10,)))
    nodes.tell("d0", Error("r", "checksum mismatch", Failure.KV_FAILED))
    await nodes.prefilling("r~1")
    assert nodes.where(ReserveKV, "r~1") == ["d0"]  # the only one, and not to blame
    assert nodes.to("d0", ReserveKV)[1].output_token_ids == (10,)
    assert backend.table.get("r").lost == set()
    nodes.answer("r~1", "p0", "d0", 11, 12)
    assert await client.seen() == ("<10><11><12>", "length")


@scenario("p0", "d0", max_failovers=2)
async def test_a_request_failed_over_too_often_ends_with_one_clean_error(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    client = Client(backend)
    for attempt in ("r", "r~1", "r~2"):
        await nodes.prefilling(attempt)
        nodes.tell("d0", Error(attempt, "checksum mismatch", Failure.KV_FAILED))
    last = await client.done()
    assert nodes.where(ReserveKV, "r~3") == []  # two retries, no third
    assert last.finish_reason == "error" and "gave up after 2 failovers" in last.error
    assert [d.finish_reason for d in client.deltas] == ["error"]
    assert backend.stats()["failovers"] == 3
    assert backend.failovers() == {"kv_failed": 3}


# -- a node goes silent, restarts, or lets a lease expire -----------------------------------------


@scenario("p0", "d0", "d1")
async def test_a_decode_node_silent_mid_stream_is_left_and_the_tokens_go_on(
    backend: ClusterBackend, nodes: FakeNodes, clock: FakeClock
) -> None:
    client = await nodes.start()
    nodes.streamed()
    await backend.watch()  # all alive: nothing moves, both nodes' leases renewed
    assert nodes.to("d0", Lease)[-1].request_ids == ("r",) == nodes.to("p0", Lease)[-1].request_ids
    clock.advance(TIMEOUT + 1)
    for node_id in ("p0", "d1"):  # only d0 stopped proving it lives
        nodes.tell(f"{node_id}#alive", Alive(node_id))
    await backend.watch()
    await nodes.prefilling("r~1")
    assert nodes.where(ReserveKV, "r~1") == ["d1"]
    assert nodes.to("d1", ReserveKV)[0].output_token_ids == (10, 11)
    await backend.watch()  # the new attempt's leases; none for the silent node
    assert nodes.to("d1", Lease)[-1].request_ids == ("r~1",)
    assert nodes.to("p0", Lease)[-1].request_ids == ("r~1",)
    assert len(nodes.to("d0", Lease)) == 1
    nodes.answer("r~1", "p0", "d1", 12, 13)
    assert await client.seen() == ("<10><11><12><13>", "length")
    assert backend.failovers() == {"node_gone": 1}


@scenario("p0", "d0", "d1")
async def test_a_reservation_asked_of_a_node_that_died_moves_on_once_the_node_is_taken_for_dead(
    backend: ClusterBackend, nodes: FakeNodes, clock: FakeClock
) -> None:
    client, dead = await nodes.reserving("d0", "d1")
    other = ({"d0", "d1"} - {dead}).pop()
    nodes.silent = {dead}
    clock.advance(TIMEOUT + 1)
    for node_id in ("p0", other):
        nodes.tell(f"{node_id}#alive", Alive(node_id))
    await backend.watch()  # the ask is answered now, not after the 10 s reply timeout
    await nodes.prefilling("r")
    assert nodes.where(ReserveKV, "r") == [dead, other]
    assert nodes.where(Abort, "r") == [dead]
    nodes.answer("r", "p0", other, 10, 11)
    assert await client.seen() == ("<10><11>", "length")


@scenario("p0", "d0")
async def test_a_prefill_node_silent_after_the_hand_off_moves_nothing(
    backend: ClusterBackend, nodes: FakeNodes, clock: FakeClock
) -> None:
    client = await nodes.start()
    nodes.tell("p0", Tokens("r", (10,)))
    nodes.tell("d0", Admitted("r"))  # d0 holds the whole KV: p0 is done with it
    clock.advance(TIMEOUT + 1)
    nodes.tell("d0#alive", Alive("d0"))
    await backend.watch()
    nodes.tell("d0", Tokens("r", (11,), finish_reason="length"))
    assert await client.seen() == ("<10><11>", "length")
    assert nodes.where(ReserveKV, "r~1") == [] and backend.stats()["failovers"] == 0


@scenario("p0", "d0")
async def test_a_restarted_node_fails_its_requests_over_and_may_take_the_retry(
    backend: ClusterBackend, nodes: FakeNodes, _: FakeClock
) -> None:
    client = await nodes.start()
    nodes.tell("p0", Tokens("r", (10,)))
    restarted = nodes.registration("d0", "decode", incarnation="2")
    nodes.tell("d0", restarted)  # its KV endpoint is probed, then it is taken again
    await nodes.prefilling("r~1")
    assert nodes.where(ReserveKV, "r~1") == ["d0"]
    nodes.answer("r~1", "p0", "d0", 11, 12)
    assert await client.seen() == ("<10><11><12>", "length")


@pytest.mark.parametrize(
    ("failure", "why"),
    [
        (Failure.LEASE_EXPIRED, "lease expired: the router stopped renewing"),
        (Failure.INTERNAL, "boom"),
    ],
)
def test_an_expired_lease_or_internal_error_ends_the_request_once_and_frees_the_other_node(
    failure: Failure, why: str
) -> None:
    async def body(backend: ClusterBackend, nodes: FakeNodes, _: FakeClock) -> None:
        client = await nodes.start()
        nodes.tell("p0", Tokens("r", (10,)))
        nodes.tell("d0", Error("r", why, failure))
        last = await client.done()
        assert (client.text, last.finish_reason, last.error) == ("<10>", "error", why)
        assert last.failure is failure
        assert nodes.where(ReserveKV, "r~1") == []  # not retried
        assert sorted(nodes.where(Abort, "r")) == ["d0", "p0"]  # nothing left held
        await backend.watch()
        assert nodes.to("d0", Lease)[-1].request_ids == ()

    run(body, "p0", "d0")


# -- one owner ----------------------------------------------------------------------------------

PLACEMENT = {"prefill_node", "decode_node", "admitted", "local_prefill", "lost", "attempt"}
COUNTS = {"inflight", "local_prefills"}


def test_only_the_request_table_changes_placement_and_counts():
    """No router module but streams.py assigns a stream's placement or a node's counts."""
    root = Path(__file__).resolve().parents[2] / "router"
    writers = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = getattr(node, "targets", [getattr(node, "target", None)])
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in PLACEMENT | COUNTS:
                    writers.add(f"{path.relative_to(root)}:{target.attr}")
    assert writers and {w.split(":")[0] for w in writers} == {"cluster/streams.py"}, writers
