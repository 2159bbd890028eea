"""Which prefill node may send KV to which decode node (connector, layout, shm's host), the
reasons the router gives when none may, and the registration check of a KV endpoint."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import replace

import pytest

from pdserve.common.wire.messages import RegisterNode
from pdserve.common.wire.payloads import KVLayout
from pdserve.router.cluster.registration import probe_endpoint
from pdserve.router.cluster.registry import NodeRegistry, kv_mismatch

LAYOUT = KVLayout("m", "float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=16)


def add(reg: NodeRegistry, node_id: str, role: str, **fields) -> None:
    msg = RegisterNode(
        node_id=node_id,
        role=role,
        kv_endpoints=("tcp://127.0.0.1:1",) if role == "decode" else (),
        kv_connector=fields.pop("connector", "zmq"),
        layout_digest=fields.pop("digest", "d"),
        num_blocks=8,
        block_size=16,
        max_model_len=128,
        host_id=fields.pop("host", "h1"),
        kv_layout=fields.pop("layout", LAYOUT),
    )
    reg.add(node_id, msg, time.monotonic())


def test_matching_nodes_pair_and_the_router_is_ready():
    reg = NodeRegistry(5.0, 128)
    add(reg, "p", "prefill")
    add(reg, "d", "decode", host="h2")  # another host is fine for zmq
    assert kv_mismatch(reg.get("p"), reg.get("d")) is None
    assert reg.ready() and reg.unpairable("p") is None


@pytest.mark.parametrize(
    "decode, why",
    [
        ({"connector": "nccl"}, "connectors differ (zmq -> nccl)"),
        (
            {"digest": "e", "layout": replace(LAYOUT, block_size=32)},
            "KV layout mismatch: block_size: prefill 16 != decode 32",
        ),
        (  # a layout that differs in several fields: each is named
            {"digest": "e", "layout": replace(LAYOUT, dtype="bfloat16", num_layers=4)},
            "KV layout mismatch: dtype: prefill 'float32' != decode 'bfloat16'; num_layers: "
            "prefill 2 != decode 4",
        ),
        ({"digest": "e", "layout": None}, "KV layout mismatch: the digests differ"),
    ],
)
def test_nodes_that_cannot_exchange_kv_make_no_route_and_the_reason_names_why(decode, why):
    reg = NodeRegistry(5.0, 128)
    add(reg, "p", "prefill")
    add(reg, "d", "decode", **decode)
    assert kv_mismatch(reg.get("p"), reg.get("d")).startswith(why)
    assert not reg.ready()
    assert why in reg.no_route_reason() and "p -> d" in reg.no_route_reason()
    assert why in reg.unpairable("d")


def test_shm_pairs_only_nodes_of_one_host():
    reg = NodeRegistry(5.0, 128)
    add(reg, "p", "prefill", connector="shm", host="h1")
    add(reg, "far", "decode", connector="shm", host="h2")
    assert "shm needs both on one host" in reg.no_route_reason()
    add(reg, "near", "decode", connector="shm", host="h1")
    assert reg.ready()
    assert kv_mismatch(reg.get("p"), reg.get("near")) is None
    assert reg.unpairable("far")  # still says why far gets nothing


def test_no_nodes_at_all_is_said_plainly():
    assert NodeRegistry(5.0, 128).no_route_reason() == "no prefill/decode route is available"


def test_the_registration_probe_of_a_kv_endpoint():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        assert asyncio.run(probe_endpoint(f"tcp://127.0.0.1:{port}", 2.0)) is None
    closed = asyncio.run(probe_endpoint(f"tcp://127.0.0.1:{port}", 2.0))
    assert f"tcp://127.0.0.1:{port} is not reachable" in closed and "--advertise-host" in closed
    wildcard = asyncio.run(probe_endpoint("tcp://0.0.0.0:5", 2.0))
    assert "names no address peers can dial" in wildcard
    assert asyncio.run(probe_endpoint("ipc:///tmp/x", 2.0)) is None  # one host: nothing to dial
