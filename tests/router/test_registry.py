"""Node liveness in the router's registry: a node is dead when its heartbeats stop, not when
the router's own event loop stood still and left them unread."""

from __future__ import annotations

import asyncio
import gc
import time

from pdserve.common.process import freeze_startup_heap
from pdserve.common.wire.messages import RegisterNode
from pdserve.router.cluster.registry import LoopLag, NodeRegistry

TIMEOUT = 1.0


def register(reg: NodeRegistry, node_id: str, seen: float) -> None:
    msg = RegisterNode(
        node_id=node_id,
        role="decode",
        kv_endpoint="tcp://127.0.0.1:1",
        kv_connector="zmq",
        layout_digest="",
        num_blocks=8,
        block_size=16,
        max_model_len=128,
    )
    reg.add(node_id, msg, seen)


def test_a_node_silent_past_the_timeout_is_dead_without_a_ticker():
    reg = NodeRegistry(TIMEOUT, 128)
    now = time.monotonic()
    register(reg, "fresh", now)
    register(reg, "silent", now - TIMEOUT - 0.5)
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


def test_registry_after_a_real_stall_of_its_loop():
    """A heartbeat read just before a 1.5 s stall: right after it the node is still alive
    (its later heartbeats are waiting to be read); a node silent for longer than the stall
    plus the timeout is dead."""

    async def scenario() -> tuple[list[str], list[str]]:
        reg = NodeRegistry(TIMEOUT, 128)
        ticker = asyncio.create_task(reg.lag.run())
        await asyncio.sleep(0.2)
        now = time.monotonic()
        register(reg, "live", now)
        register(reg, "dead", now - TIMEOUT - 2.0)
        time.sleep(1.5)  # the event loop stands still (as in a long garbage collection)
        during = [n.node_id for n in reg.alive(("decode",))]
        await asyncio.sleep(0.1)  # the ticker has run again: the stall is remembered
        after = [n.node_id for n in reg.alive(("decode",))]
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
