"""A prefill node at TP p feeding a decode node at TP d, in-process (rank 0 of each here, their
other ranks as processes): each decode rank receives exactly its heads from the prefill ranks
that hold them, and the answer equals the engine's at TP 1, token for token; blocks return to
where they started after success and after an abort midway."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from pdserve.common.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.common.node.config import NodeConfig
from pdserve.common.wire.messages import Abort, RenewTransfer, Reserved, ReserveKV
from pdserve.decode_node.node import DecodeNode
from pdserve.prefill_node.node import PrefillNode
from tests.prefill_node.test_prefill_node import FakeRouter, finish_on_decode, start

BLOCK = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(3, 60)), [7, 8, 9, 10, 11, 12, 13]]


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    """Rank 0 of a group sets this process's torch threads to its share: give them back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[int | str, str]:
    from pdserve.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("tp-nodes")
    models = {kv: str(make_tiny_model("llama", root / f"kv{kv}", kv_heads=kv)) for kv in (4, 2)}
    return {**models, "qwen3": str(make_tiny_model("qwen3", root / "qwen3", kv_heads=4))}


@functools.cache
def answers(model: str) -> list[list[int]]:
    """The engine's greedy tokens at TP 1 for PROMPTS (once per model)."""
    outs = LLM(model, block_size=BLOCK, skip_tokenizer_init=True, dtype="float32").generate(
        PROMPTS, GREEDY
    )
    return [o.token_ids for o in outs]


def build(model: str, p: int, d: int, connector: str, dtype: str = "float32"):
    router = FakeRouter()
    cache = CacheConfig(block_size=BLOCK, num_blocks=48)
    sched = SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=8)

    def node(tp: int) -> NodeConfig:
        return NodeConfig(
            (router.addr,), kv_connector=connector, tensor_parallel_size=tp, threads_per_rank=1
        )

    prefill = PrefillNode(ModelConfig(model, dtype=dtype), cache, sched, node(p))
    try:
        decode_ = DecodeNode(ModelConfig(model, dtype=dtype), cache, sched, node(d))
    except BaseException:
        prefill.close()
        raise
    return router, prefill, decode_


@contextlib.contextmanager
def pair(model: str, p: int, d: int, connector: str, **kwargs) -> Iterator[tuple]:
    """`build`'s (router, prefill node, decode node), closed after; when the body passed, both
    engines' block books are checked consistent first."""
    router, prefill, decode_ = build(model, p, d, connector, **kwargs)
    try:
        yield router, prefill, decode_
        prefill.engine.check_integrity()
        decode_.engine.check_integrity()
    finally:
        prefill.close()
        decode_.close()
        router.sock.close()


def serve(
    router, prefill, decode_, rid: str, prompt: list[int], p: int, params=GREEDY
) -> list[int]:
    start(router, prefill, decode_, rid, prompt, params, p)
    while rid in prefill.dests:
        prefill.step()
    return finish_on_decode(router, decode_, rid)


def free(node) -> int:
    return node.engine.kv.num_free_blocks


def settle(prefill, decode_, before: tuple[int, int], timeout: float = 30.0) -> None:
    """Let both nodes take their KV messages until their free blocks are back at `before` or
    `timeout` passes (nixl: the decode node holds an aborted transfer's blocks until every
    sender that could write them settled)."""
    deadline = time.monotonic() + timeout
    while (free(prefill), free(decode_)) != before and time.monotonic() < deadline:
        prefill.poll_io()
        decode_.poll_io()
        time.sleep(0.005)


@pytest.mark.parametrize(
    ("kv", "p", "d", "connector"),
    [
        (4, 1, 2, "zmq"),
        (4, 2, 1, "zmq"),
        (4, 2, 2, "zmq"),
        (4, 1, 4, "zmq"),
        (4, 4, 1, "zmq"),
        (2, 4, 2, "zmq"),  # 2 KV heads on 4 prefill ranks: each held twice
        (4, 2, 1, "nccl"),
        ("qwen3", 1, 2, "zmq"),  # q/k norms per head: each rank normalizes its own heads
        (4, 1, 2, "shm"),
        # nixl: per-token descriptors of each decode rank's heads (1 -> 2), and several
        # senders writing their own heads into one rank's blocks (2 -> 1; 4 -> 1 took the same
        # path at 2.6x its CPU seconds: four ranks and agents).
        (4, 1, 2, "nixl"),
        (4, 2, 1, "nixl"),
    ],
)
def test_tp_p_to_tp_d_equals_the_engine_at_tp1(models, kv, p, d, connector) -> None:
    model = models[kv]
    expected = answers(model)
    with pair(model, p, d, connector) as (router, prefill, decode_):
        before = (free(prefill), free(decode_))
        for i, prompt in enumerate(PROMPTS):
            got = serve(router, prefill, decode_, f"r{i}", prompt, p)
            assert got == expected[i], (i, got)
        # An abort before the KV is all there: the reservation and the transfer go, on every rank.
        start(router, prefill, decode_, "gone", PROMPTS[0], GREEDY, p)
        prefill.step()
        decode_.handle(Abort("gone", "client went away"))
        prefill.handle(Abort("gone", "client went away"))
        settle(prefill, decode_, before)
        assert (free(prefill), free(decode_)) == before
        assert not decode_.pending and not decode_.xfer_to_rid


def test_a_reservation_renewed_for_another_sending_tp(models) -> None:
    """D reserved for a TP 1 sender (one slice); the router picked a TP 2 prefill node, so it
    renews the reservation for TP 2 (two slices, one per prefill rank) before the prefill."""
    model = models[4]
    expected = answers(model)
    router, prefill, decode_ = build(model, 2, 1, "zmq")
    try:
        decode_.handle(ReserveKV("r", tuple(PROMPTS[0]), GREEDY, src_tp=1))
        first = router.recv(Reserved, "r")
        decode_.handle(RenewTransfer("r", src_tp=2))
        renewed = router.recv(Reserved, "r")
        assert renewed.xfer_id != first.xfer_id and renewed.src_tp == 2
        assert decode_.pending == {renewed.xfer_id: 2}  # one slice from each prefill rank
        decode_.handle(Abort("r", "done"))
        got = serve(router, prefill, decode_, "r2", PROMPTS[0], 2)
        assert got == expected[0]
    finally:
        prefill.close()
        decode_.close()
        router.sock.close()


def test_a_dead_rank_stops_its_node(models) -> None:
    """kill -9 of a worker rank of an idle decode node: the node's loop sees it at once and
    stops with the reason (its supervisor restarts the group; the router fails over)."""
    import os
    import signal

    router, prefill, decode_ = build(models[4], 1, 2, "zmq")
    try:
        worker = decode_.engine.runner.driver.procs[0]
        runner = threading.Thread(target=decode_.run, daemon=True)
        runner.start()
        os.kill(worker.pid, signal.SIGKILL)
        runner.join(timeout=30)
        assert not runner.is_alive(), "the node kept running without a rank"
        assert decode_.fatal == "tensor-parallel group broken: rank 1 exited with -9"
    finally:
        prefill.close()
        router.sock.close()


@pytest.mark.parametrize("connector", ["zmq", "nixl"])
def test_a_corrupted_slice_fails_the_request_and_frees_its_blocks(models, connector) -> None:
    """Prefill TP 2 -> decode TP 1: rank 0's slice arrives damaged, rank 1's whole; the
    decode node never admits the request (KV_FAILED to the router) and every block is back."""
    from pdserve.common.wire.messages import Error, Failure
    from pdserve.testbed.kvfaults import FaultPlan, PlannedFaults

    router, prefill, decode_ = build(models[4], 2, 1, connector)
    try:
        before = (free(prefill), free(decode_))
        reserved = start(router, prefill, decode_, "bad", PROMPTS[0], GREEDY, 2)
        (sender,) = prefill.kv.port.senders.values()  # rank 0's, to the decode rank
        sender.faults = PlannedFaults(FaultPlan(targets=frozenset({f"{reserved.xfer_id}.0"})))
        while "bad" in prefill.dests:
            prefill.step()
        deadline = time.monotonic() + 30
        while decode_.pending and time.monotonic() < deadline:
            decode_.poll_io()
        error = router.recv(Error, "bad")
        assert error.kind is Failure.KV_FAILED and "bad" not in decode_.engine.scheduler.requests
        assert "checksum" in error.message, error.message
        assert (free(prefill), free(decode_)) == before
        decode_.engine.check_integrity()
    finally:
        prefill.close()
        decode_.close()
        router.sock.close()


def test_a_worker_started_apart_joins_its_rank_0(models) -> None:
    """`--tp-workers external`: the decode node's rank 0 starts no worker; `pdserve
    tp-worker --leader HOST:PORT --rank 1` (as on another host) joins it, takes its spec from
    the rendezvous, binds its own KV receiver, and the request equals the engine at TP 1."""
    import subprocess
    import sys

    from pdserve.local_cluster import free_port

    model = models[4]
    expected = answers(model)
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "tp-worker", "--leader", f"127.0.0.1:{port}"]
    worker = subprocess.Popen([*cmd, "--rank", "1", "--advertise-host", "127.0.0.1"])
    router = FakeRouter()
    cache = CacheConfig(block_size=BLOCK, num_blocks=48)
    sched = SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=8)
    config = NodeConfig((router.addr,), tensor_parallel_size=2, threads_per_rank=1,
                        tp_workers="external", tp_port=port)  # fmt: skip
    prefill = decode_ = None
    try:
        decode_ = DecodeNode(ModelConfig(model, dtype="float32"), cache, sched, config)
        assert decode_.engine.runner.driver.procs == []  # none of its own
        assert len(set(decode_.kv.endpoints)) == 2
        prefill = PrefillNode(
            ModelConfig(model, dtype="float32"), cache, sched, NodeConfig((router.addr,))
        )
        assert serve(router, prefill, decode_, "r", PROMPTS[0], 1) == expected[0]
    finally:
        for node in (prefill, decode_):
            if node is not None:
                node.close()
        router.sock.close()
        assert worker.wait(timeout=30) == 0  # rank 0's close stops it


def test_a_worker_ignores_sigterm_until_its_rank_0_stops_it(models) -> None:
    """SIGTERM reaches every pod (process) of a group at once; the worker goes on following
    rank 0, which drains and then stops it."""
    import os
    import signal

    router, prefill, decode_ = build(models[4], 1, 2, "zmq")
    try:
        worker = decode_.engine.runner.driver.procs[0]
        os.kill(worker.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert worker.poll() is None and decode_.engine.broken() is None
        got = serve(router, prefill, decode_, "r", PROMPTS[1], 1)
        assert got == answers(models[4])[1]
    finally:
        prefill.close()
        decode_.close()
        router.sock.close()
    assert worker.wait(timeout=30) == 0
