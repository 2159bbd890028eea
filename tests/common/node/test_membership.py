"""A node's membership (issue 37): `Membership` holds no reference to its node, and after a
router restarts each node registers with it once. The restarted router asks every node it does
not know to register again, once per heartbeat it gets from it, and heartbeats queue in a
node's link while the router is down: answering each ask registered a node about 5 times."""

from __future__ import annotations

import ast
import asyncio
import inspect
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from pdserve.common.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.common.node import membership
from pdserve.common.node.config import NodeConfig
from pdserve.common.node.loop import EngineNode
from pdserve.common.wire.messages import Message, Reregister
from pdserve.decode_node.node import DecodeNode
from pdserve.local_cluster import free_port
from pdserve.prefill_node.node import PrefillNode
from pdserve.router.cluster.backend import ClusterBackend
from pdserve.router.config import RouterConfig

HEARTBEAT_S = 0.05
WAIT_S = 60.0  # how long a step of the test may take (real seconds, two busy cores)


# What an engine node has and a membership must not read (it would be holding the node).
NODE_ATTRIBUTES = {"node", "engine", "scheduler", "kv", "health", "drain_deadline", "stop_event"}
NODE_CLASSES = {"EngineNode", "ColocatedNode", "PrefillNode", "DecodeNode"}


def test_membership_holds_no_reference_to_its_node() -> None:
    """Its constructor takes no node (by name or type), and the module imports no role and
    reads no node's or engine's attributes: what it needs is handed to it."""
    tree = ast.parse(inspect.getsource(membership))
    modules = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in modules if m.endswith((".loop", ".colocated", "_node.node"))], modules
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Membership"]
    (init,) = [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
    for arg in init.args.args[1:] + init.args.kwonlyargs:
        annotation = arg.annotation or ast.Constant(None)
        named = {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}
        assert arg.arg not in NODE_ATTRIBUTES and not named & NODE_CLASSES, arg.arg
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not names & NODE_CLASSES and not attributes & NODE_ATTRIBUTES, attributes


def spy_asks(backend: ClusterBackend) -> Counter[str]:
    """How many Reregister messages the router sends each node."""
    asks: Counter[str] = Counter()
    send = backend.control.send

    async def counting(node_id: str, msg: Message) -> None:
        asks[node_id] += isinstance(msg, Reregister)
        await send(node_id, msg)

    backend.control.send = counting  # type: ignore[method-assign]
    return asks


def spy_heartbeats(node: EngineNode) -> Callable[[], int]:
    """The number of heartbeats `node` has sent so far."""
    sent = [0]
    heartbeat = node.membership.heartbeat

    def counting(status: membership.NodeStatus) -> None:
        sent[0] += 1
        heartbeat(status)

    node.membership.heartbeat = counting  # type: ignore[method-assign]
    return lambda: sent[0]


async def wait_for(what: str, ok: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@pytest.fixture()
def nodes(tiny_model_dir) -> Iterator[list[EngineNode]]:
    """A prefill and a decode node, each running its loop in a thread, with one router
    address (the router is the test's)."""
    model = ModelConfig(str(tiny_model_dir("llama")))
    config = NodeConfig((f"127.0.0.1:{free_port()}",), heartbeat_interval=HEARTBEAT_S)
    made = [
        role(model, CacheConfig(num_blocks=16), SchedulerConfig(), replace(config, node_id=name))
        for role, name in ((PrefillNode, "p0"), (DecodeNode, "d0"))
    ]
    threads = [threading.Thread(target=node.run, daemon=True) for node in made]
    for thread in threads:
        thread.start()
    yield made
    for node in made:
        node.stop_event.set()
    for thread in threads:
        thread.join(timeout=WAIT_S)


async def restart_router(nodes: list[EngineNode]) -> tuple[Counter[str], Counter[str]]:
    """Start a router, take it down once both nodes registered, let heartbeats queue, start
    another on the same port; the second router's asks and registrations, once every node
    is registered with it and its answer is in."""
    port = int(nodes[0].config.router_addrs[0].rpartition(":")[2])
    config = RouterConfig(model="m", control_port=port, heartbeat_timeout=5.0)
    sent = {node.node_id: spy_heartbeats(node) for node in nodes}
    first = ClusterBackend(config)
    await first.start()
    await wait_for("both nodes to register", lambda: len(first.registrar.registrations) == 2)
    await wait_for("both nodes to be accepted", lambda: all(n.ready() for n in nodes))
    await first.close()
    queued = {name: count() + 5 for name, count in sent.items()}
    await wait_for("heartbeats to queue", lambda: all(sent[n]() >= queued[n] for n in sent))
    second = ClusterBackend(config)
    asks = spy_asks(second)
    await second.start()
    try:
        for node in nodes:
            await settled(second, node)
    finally:
        await second.close()
    return asks, second.registrar.registrations


async def settled(router: ClusterBackend, node: EngineNode) -> None:
    """Until the router's answer to the node's registration is in (so were the asks before
    it), and then a heartbeat the node sent later (so was every registration before it)."""

    def answered() -> bool:
        return node.node_id in router.nodes and not node.membership.awaiting and node.ready()

    await wait_for(f"{node.node_id} to be registered", answered)
    seq = node.membership.prefix_seq
    await wait_for("a later heartbeat", lambda: router.nodes[node.node_id].prefix_seq > seq)


def test_each_node_registers_once_with_a_restarted_router(nodes: list[EngineNode]) -> None:
    asks, registrations = asyncio.run(restart_router(nodes))
    assert all(asks[node.node_id] >= 2 for node in nodes), asks  # asked again and again
    assert registrations == {"p0": 1, "d0": 1}
