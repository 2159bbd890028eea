"""Node liveness in the router's registry: a node is dead when its heartbeats stop, not when
the router's own event loop stood still and left them unread."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable

from pdserve.common.process import freeze_startup_heap
from pdserve.common.wire.messages import RegisterNode
from pdserve.router.cluster.registry import LoopLag, NodeRegistry

TIMEOUT = 1.0
WAIT_S = 30.0  # how long a test waits for its event loop to do something (real seconds)


class FakeClock:
    """The registry's clock, moved by the test: its time passes only in advance()."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def until(condition: Callable[[], bool], what: str) -> None:
    """Let the event loop run until condition() holds (failing after WAIT_S real seconds)."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def register(reg: NodeRegistry, node_id: str, seen: float) -> None:
    msg = RegisterNode(
        node_id=node_id,
        role="decode",
        kv_endpoints=("tcp://127.0.0.1:1",),
        kv_connector="zmq",
        layout_digest="",
        num_blocks=8,
        block_size=16,
        max_model_len=128,
    )
    reg.add(node_id, msg, seen)


def test_a_node_silent_past_the_timeout_is_dead_without_a_ticker():
    clock = FakeClock()
    reg = NodeRegistry(TIMEOUT, 128, clock=clock)
    register(reg, "fresh", clock())
    register(reg, "silent", clock() - TIMEOUT - 0.5)
    assert [n.node_id for n in reg.alive(("decode",))] == ["fresh"]


def test_a_stall_of_the_loop_is_not_held_against_the_nodes():
    lag = LoopLag(window=TIMEOUT, tick=0.05)
    t0 = 100.0
    lag._last = t0  # the ticker ran at t0, then the loop stood still for 2 s
    assert lag.recent(t0 + 2.0) == 2.0 - 0.05  # seen while going on, before the ticker runs
    lag.ticked(t0 + 2.0)
    assert lag.recent(t0 + 2.5) == 2.0 - 0.05  # remembered within the window
    for i in range(1, 40):  # the ticker keeps time again
        lag.ticked(t0 + 2.0 + i * 0.05)
    assert lag.recent(t0 + 2.0 + 39 * 0.05) < 0.05  # forgotten after the window


def test_registry_after_a_stall_of_its_loop():
    """A heartbeat read just before a 1.5 s stall of the router's loop (its clock moves on
    while no task runs, as in a long garbage collection): right after the stall, and once the
    ticker has run again, the node is still alive (its later heartbeats are waiting to be
    read); a node silent for longer than the stall plus the timeout is dead."""

    async def scenario() -> tuple[list[str], list[str]]:
        clock = FakeClock()
        reg = NodeRegistry(TIMEOUT, 128, clock=clock)
        ticker = asyncio.create_task(reg.lag.run())
        try:
            await until(lambda: reg.lag._last is not None, "the ticker to start")
            register(reg, "live", clock())
            register(reg, "dead", clock() - TIMEOUT - 2.0)
            clock.advance(1.5)  # the event loop stands still: no await until it is over
            during = [n.node_id for n in reg.alive(("decode",))]
            woke = clock()
            await until(lambda: reg.lag._last == woke, "the ticker to run after the stall")
            after = [n.node_id for n in reg.alive(("decode",))]  # the stall is remembered
        finally:
            ticker.cancel()
        return during, after

    during, after = asyncio.run(scenario())
    assert during == ["live"]
    assert after == ["live"]


def test_freeze_startup_heap_leaves_nothing_for_a_full_collection():
    before = gc.get_freeze_count()
    junk = [[i] for i in range(10_000)]
    freeze_startup_heap()
    try:
        assert gc.get_freeze_count() >= before + len(junk)
    finally:
        gc.unfreeze()
