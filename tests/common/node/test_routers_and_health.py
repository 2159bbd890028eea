"""A node with several routers (each request answered on its own router's link, leases per
router, a refused registration stops the node), the advertised address, and the node's
health endpoint."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import zmq

from pdserve.common.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.common.node import loop, membership
from pdserve.common.node.config import NodeConfig
from pdserve.common.node.health import LIVE_PATH, METRICS_PATH, NODE_METRICS, READY_PATH
from pdserve.common.node.loop import EngineNode, advertise_host
from pdserve.common.wire.messages import (
    Heartbeat,
    Lease,
    Message,
    Registered,
    RegisterNode,
    Reserved,
    ReserveKV,
    decode,
    encode,
)
from pdserve.common.wire.payloads import SamplingParams
from pdserve.decode_node.node import DecodeNode
from pdserve.local_cluster import free_port

SAMPLING = SamplingParams(max_tokens=2)
WAIT_S = 30.0  # how long a test waits for the node to handle what was sent (real seconds)


class FakeClock:
    """Stands in for the time module in the node's loop: monotonic() is a time the test moves
    (advance()), so leases and stalls time out only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)  # anything else is the real time module's


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The node's clock (its loop's and its membership's), faked for the test (ask for it
    before the node)."""
    fake = FakeClock()
    monkeypatch.setattr(loop, "time", fake)
    monkeypatch.setattr(membership, "time", fake)
    return fake


class Router:
    """A router's ROUTER socket: records what the node sends, sends it messages."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.addr = f"127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.got: list[Message] = []
        self.peer = b""

    def pump(self) -> None:
        while self.sock.poll(0):
            identity, frame = self.sock.recv_multipart()
            if not identity.endswith(b"#alive"):
                self.peer = identity
            self.got.append(decode(frame))

    def send(self, msg: Message) -> None:
        self.sock.send_multipart([self.peer, encode(msg)])

    def of(self, kind: type) -> list[Message]:
        self.pump()
        return [m for m in self.got if isinstance(m, kind)]


@pytest.fixture()
def routers() -> Iterator[list[Router]]:
    rs = [Router(), Router()]
    yield rs
    for r in rs:
        r.sock.close()


@pytest.fixture()
def decode_node(tiny_model_dir, routers) -> Iterator[DecodeNode]:
    model = ModelConfig(str(tiny_model_dir("llama")))
    config = NodeConfig(tuple(r.addr for r in routers), node_id="d0", lease_timeout=0.5)
    node = DecodeNode(model, CacheConfig(num_blocks=16), SchedulerConfig(), config)
    yield node
    node.close()


def turn(node: EngineNode, routers: list[Router], until, timeout: float = WAIT_S) -> None:
    """Run the node's message handling (and lease expiry) until `until()` holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        node.handle_all(20)
        node.expire_leases()
        for r in routers:
            r.pump()
        if until():
            return
    raise AssertionError("condition not reached")


def test_a_node_registers_with_every_router_and_answers_each_on_its_own_link(decode_node, routers):
    a, b = routers
    decode_node.membership.register()
    decode_node.heartbeat(now=True)
    turn(decode_node, routers, lambda: a.of(Heartbeat) and b.of(Heartbeat))
    assert len(a.of(RegisterNode)) == len(b.of(RegisterNode)) == 1
    b.send(ReserveKV("from-b", (1, 2, 3), SAMPLING))
    a.send(ReserveKV("from-a", (4, 5), SAMPLING))
    turn(decode_node, routers, lambda: a.of(Reserved) and b.of(Reserved))
    assert [m.request_id for m in a.of(Reserved)] == ["from-a"]
    assert [m.request_id for m in b.of(Reserved)] == ["from-b"]
    assert decode_node.membership.owner == {"from-a": 0, "from-b": 1}


def test_leases_are_per_router(clock, decode_node, routers):
    """Router A renewing B's request does not keep it: when B stops renewing (it died), its
    request is freed while A's lives on."""
    a, b = routers
    decode_node.membership.register()
    turn(decode_node, routers, lambda: a.of(RegisterNode) and b.of(RegisterNode))
    a.send(ReserveKV("ra", (1, 2, 3), SAMPLING))
    b.send(ReserveKV("rb", (4, 5, 6), SAMPLING))
    turn(decode_node, routers, lambda: a.of(Reserved) and b.of(Reserved))
    lease_timeout = decode_node.config.lease_timeout

    def renewed_now() -> bool:
        return decode_node.membership.leases.get("ra") == clock.monotonic() + lease_timeout

    for _ in range(4):  # past three lease timeouts, A renewing within each
        clock.advance(0.8 * lease_timeout)
        a.send(Lease(("ra", "rb")))  # A names B's request too: it must not count
        turn(decode_node, routers, renewed_now)  # until the node has taken A's renewal
    live = decode_node.engine.scheduler.requests
    assert "ra" in live and "rb" not in live
    decode_node.engine.abort("ra")
    decode_node.engine.check_integrity()


def test_a_refused_registration_stops_the_node_naming_the_router(decode_node, routers):
    a, b = routers
    decode_node.membership.register()
    turn(decode_node, routers, lambda: a.of(RegisterNode) and b.of(RegisterNode))
    a.send(Registered())
    turn(decode_node, routers, lambda: decode_node.membership.accepted == {0})
    assert decode_node.ready()
    b.send(Registered(accepted=False, reason="its KV endpoint tcp://10.9.9.9:1 is unreachable"))
    turn(decode_node, routers, decode_node.stop_event.is_set)
    assert b.addr in decode_node.fatal and "tcp://10.9.9.9:1" in decode_node.fatal


def test_the_advertised_address() -> None:
    def config(**kw) -> NodeConfig:
        return NodeConfig(("127.0.0.1:8100",), **kw)

    assert advertise_host(config(advertise_host="10.1.2.3", host="0.0.0.0")) == "10.1.2.3"
    assert advertise_host(config(host="127.0.0.1")) == "127.0.0.1"
    # A wildcard bind: the local end of the route to the first router (here loopback).
    assert advertise_host(config(host="0.0.0.0")) == "127.0.0.1"


def test_the_health_endpoint(clock, tiny_model_dir, routers):
    model = ModelConfig(str(tiny_model_dir("llama")))
    port = free_port()
    config = NodeConfig((routers[0].addr,), node_id="d1", health_port=port, stall_timeout=0.5)
    node = DecodeNode(model, CacheConfig(num_blocks=16), SchedulerConfig(), config)
    assert node.health is not None and node.health.port == port
    node.health.start()  # as run() does
    url = f"http://127.0.0.1:{node.health.port}"
    try:
        node.heartbeat(now=True)
        assert httpx.get(url + LIVE_PATH).status_code == 200
        assert httpx.get(url + READY_PATH).status_code == 503  # no router accepted it yet
        node.membership.accepted.add(0)
        assert httpx.get(url + READY_PATH).status_code == 200
        metrics = httpx.get(url + METRICS_PATH).text
        for name in NODE_METRICS:
            assert f'{name}{{node_id="d1",role="decode"}}' in metrics, name
        assert 'pdserve_node_free_kv_blocks{node_id="d1",role="decode"} 15.0' in metrics
        node.drain()
        assert httpx.get(url + READY_PATH).status_code == 503  # draining: out of rotation
        clock.advance(0.6)  # the loop made no progress for stall_timeout
        assert httpx.get(url + LIVE_PATH).status_code == 503
        assert httpx.get(url + "/nope").status_code == 404
    finally:
        node.close()
