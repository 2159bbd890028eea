"""Each role's contract: which control messages it takes, and how it turns new requests away;
the loop admits and leases new requests around the role's answer."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from pdserve.common.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.common.node.colocated import ColocatedNode
from pdserve.common.node.config import NodeConfig
from pdserve.common.node.loop import EngineNode
from pdserve.common.wire.messages import (
    Abort,
    Busy,
    CheckIntegrity,
    Error,
    Failure,
    Lease,
    Message,
    Prefill,
    Registered,
    RenewTransfer,
    Reregister,
    Reserved,
    ReserveKV,
    SyncPrefixes,
    decode,
)
from pdserve.common.wire.payloads import SamplingParams
from pdserve.decode_node.node import DecodeNode
from pdserve.prefill_node.node import PrefillNode

SHARED = {Abort, Lease, Reregister, Registered, CheckIntegrity, SyncPrefixes}
SAMPLING = SamplingParams(max_tokens=2)


class Router:
    """The router's ROUTER socket; hands back what nodes send."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.addr = f"127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"

    def recv(self, kind: type, timeout: float = 5.0) -> Message:
        deadline = time.monotonic() + timeout
        while self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            msg = decode(self.sock.recv_multipart()[1])
            if isinstance(msg, kind):
                return msg
        raise AssertionError(f"no {kind.__name__} from the node")


@pytest.fixture()
def router() -> Iterator[Router]:
    router = Router()
    yield router
    router.sock.close()


@pytest.fixture()
def build(tiny_model_dir, router) -> Iterator:
    built: list[EngineNode] = []

    def make(cls: type[EngineNode], **settings) -> EngineNode:
        model = ModelConfig(str(tiny_model_dir("llama")))
        node = NodeConfig(router.addr, **settings)
        built.append(cls(model, CacheConfig(num_blocks=16), SchedulerConfig(), node))
        return built[-1]

    yield make
    for node in built:
        node.close()


@pytest.mark.parametrize(
    "cls, own",
    [
        (ColocatedNode, {Prefill}),
        (PrefillNode, {Prefill}),
        (DecodeNode, {ReserveKV, RenewTransfer, Prefill}),
    ],
)
def test_each_role_takes_the_shared_messages_and_its_own(build, cls, own) -> None:
    assert set(build(cls)._handlers) == SHARED | own


def test_a_message_of_another_role_fails_only_its_request(build, router) -> None:
    node = build(PrefillNode)
    node.handle(ReserveKV("r", (1, 2, 3), SAMPLING))
    error = router.recv(Error)
    assert (error.request_id, error.kind) == ("r", Failure.BAD_REQUEST)
    assert "prefill node does not take reserve_kv" in error.message


def test_a_decode_node_prefills_only_for_itself(build, router) -> None:
    node = build(DecodeNode)
    node.handle(Prefill("r", (1, 2, 3), SAMPLING, xfer_id="x", dest_block_ids=(1,)))
    error = router.recv(Error)
    assert (error.request_id, error.kind) == ("r", Failure.BAD_REQUEST)
    assert "prefills only for itself" in error.message
    node.handle(Prefill("local", (1, 2, 3), SAMPLING))  # placed here by the router: runs here
    assert list(node.engine.scheduler.requests) == ["local"]


def test_a_full_colocated_node_refuses_with_an_error_kind(build, router) -> None:
    node = build(ColocatedNode, max_queued_requests=1)
    node.handle(Prefill("a", (1, 2, 3), SAMPLING))
    node.handle(Prefill("b", (1, 2, 3), SAMPLING))
    error = router.recv(Error)
    assert (error.request_id, error.kind) == ("b", Failure.BUSY)
    assert list(node.engine.scheduler.requests) == ["a"]


def test_a_draining_decode_node_answers_busy(build, router) -> None:
    node = build(DecodeNode)
    node.drain()
    node.handle(ReserveKV("r", (1, 2, 3), SAMPLING))
    assert router.recv(Busy).request_id == "r"
    node.handle(Prefill("p", (1, 2, 3), SAMPLING))  # a stream waits on it: an error kind
    error = router.recv(Error)
    assert (error.request_id, error.kind) == ("p", Failure.DRAINING)
    assert not node.engine.scheduler.requests


def test_the_loop_leases_what_the_engine_holds_after_the_roles_answer(build, router) -> None:
    node = build(DecodeNode)
    node.handle(ReserveKV("held", (1, 2, 3), SAMPLING))
    assert router.recv(Reserved).request_id == "held"
    assert set(node.membership.leases) == {"held"} and node.membership.owner == {"held": 0}
    node.handle(ReserveKV("huge", tuple(range(1, 226)), SAMPLING))  # 15 blocks: 14 free
    assert router.recv(Busy).request_id == "huge"
    node.handle(ReserveKV("bad", (1, 10**6), SAMPLING))  # not a token of the vocabulary
    error = router.recv(Error)
    assert (error.request_id, error.kind) == ("bad", Failure.BAD_REQUEST)
    assert set(node.engine.scheduler.requests) == {"held"}
    assert set(node.membership.leases) == {"held"}


def test_an_unreachable_decode_node_fails_the_prefill_without_holding_it(build, router) -> None:
    node = build(PrefillNode, connect_timeout=0.2)
    dest = Prefill(
        "r",
        (1, 2, 3),
        SAMPLING,
        xfer_id="x",
        dest_block_ids=(1,),
        dest_kv_endpoints=("tcp://127.0.0.1:1",),
    )
    node.handle(dest)
    error = router.recv(Error)
    assert (error.request_id, error.kind) == ("r", Failure.KV_FAILED)
    assert not node.engine.scheduler.requests and not node.membership.leases
    assert not node.dests
