"""CurveZMQ: with the cluster's keys a peer gets through; without them nothing it sends lands."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from pdserve.common.node.membership import ControlClient
from pdserve.common.wire.messages import RegisterNode, encode
from pdserve.common.wire.payloads import FirstToken
from pdserve.common.wire.security import CurveKeys, keygen
from pdserve.kv_transfer import KVLayout, TransferTimeout, create_receiver, create_sender
from pdserve.local_cluster import LocalCluster, free_port
from pdserve.router.cluster.backend import ClusterBackend
from pdserve.router.config import RouterConfig
from tests.kv_transfer.helpers import Pump, make_caches
from tests.kv_transfer.test_guards import connect_while_polling

LAYOUT = KVLayout("tiny", "float32", num_layers=2, num_kv_heads=1, head_dim=4, block_size=2)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> CurveKeys:
    directory = str(tmp_path_factory.mktemp("curve"))
    keygen(directory)
    return CurveKeys.load(directory)


def register(node_id: str) -> bytes:
    return encode(RegisterNode(node_id, "both", (), "", "", 8, 16, 64))


def test_router_refuses_a_node_without_the_keys(keys):
    async def scenario() -> tuple[set[str], set[str]]:
        port = free_port()
        config = RouterConfig("m", control_port=port, curve_dir=keys.directory)
        backend = ClusterBackend(config)
        await backend.start()
        try:
            intruder = zmq.Context.instance().socket(zmq.DEALER)
            intruder.setsockopt(zmq.LINGER, 0)
            intruder.connect(f"tcp://127.0.0.1:{port}")
            intruder.send(register("intruder"), flags=zmq.NOBLOCK)
            wrong = zmq.Context.instance().socket(zmq.DEALER)  # a key pair of its own
            wrong.setsockopt(zmq.LINGER, 0)
            public, secret = zmq.curve_keypair()
            wrong.curve_publickey, wrong.curve_secretkey = public, secret
            wrong.curve_serverkey = keys.public
            wrong.connect(f"tcp://127.0.0.1:{port}")
            wrong.send(register("stranger"), flags=zmq.NOBLOCK)
            await asyncio.sleep(1.0)
            before = set(backend.nodes)
            member = ControlClient(zmq.Context.instance(), f"127.0.0.1:{port}", "member", keys)
            member.send(RegisterNode("member", "both", (), "", "", 8, 16, 64))
            deadline = time.monotonic() + 5
            while "member" not in backend.nodes and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            after = set(backend.nodes)
            for sock in (intruder, wrong, member.sock):
                sock.close(linger=0)
            return before, after
        finally:
            await backend.close()

    before, after = asyncio.run(scenario())
    assert before == set()  # neither the keyless nor the foreign-key peer was heard
    assert after == {"member"}


def test_kv_receiver_refuses_a_sender_without_the_keys(keys):
    receiver = create_receiver("zmq", LAYOUT, make_caches(LAYOUT, 8, seed=0), curve=keys)
    try:
        outsider = create_sender("zmq", LAYOUT)
        with pytest.raises(TransferTimeout):
            connect_while_polling(outsider, receiver, timeout=1.0)
        member = create_sender("zmq", LAYOUT, curve=keys)
        connect_while_polling(member, receiver)
        receiver.expect("x", [1, 2])
        cache = make_caches(LAYOUT, 8, seed=1)
        for layer in range(LAYOUT.num_layers):
            member.send_layer("x", layer, [3, 4], [1, 2], cache[layer])
        member.send_done("x", FirstToken(0))
        (result,) = Pump(receiver).wait_results("x")
        assert result.ok, result.error
        member.close()
    finally:
        receiver.close()


def test_a_cluster_with_curve_serves(keys, tiny_model_dir):
    import httpx

    curve = ["--curve-dir", keys.directory]
    with LocalCluster(
        str(tiny_model_dir("llama")), 1, 1, engine_args=curve, router_args=curve
    ) as c:
        body = {"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True}
        resp = httpx.post(c.url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 3
