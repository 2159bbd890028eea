"""DeepSeek-V3 (MLA) served 1P1D and across tensor-parallel groups, in-process (rank 0 of each
node here, other ranks as processes): the answer equals the offline engine's greedy tokens, the
decode node's latent cache for the request is bit-identical to the prefill node's, the link
carries one latent per token and layer (the connectors' own byte counters), and under TP one
prefill rank sends each latent and every decode rank gets it once."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.common.model.test_mla import LATENT
from tests.common.model.test_mla import model_dir as model_dir  # the tiny DeepSeek-V3
from tests.common.node.test_tp_nodes import BLOCK, GREEDY, PROMPTS, answers, free, pair
from tests.kv_transfer.helpers import needs_nixl
from tests.prefill_node.test_prefill_node import finish_on_decode, start


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Both nodes' rank 0 run here: one torch thread each step (as a group's ranks get), not
    several spinning against each other; the process's own count comes back after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def serve(
    router: Any, prefill: Any, decode_: Any, rid: str, prompt: list[int], p: int
) -> list[int]:
    """One request through both nodes; the decode node takes its I/O on a thread while the
    prefill node steps, as its own process would (nccl's sender waits for the receiver's
    recvs once a few frames are in flight)."""
    start(router, prefill, decode_, rid, prompt, GREEDY, p)
    stop = threading.Event()
    pump = threading.Thread(target=lambda: [decode_.poll_io() for _ in iter(stop.is_set, True)])
    pump.start()
    try:
        while rid in prefill.dests:
            prefill.step()
    finally:
        stop.set()
        pump.join()
    return finish_on_decode(router, decode_, rid)


class Shipped:
    """What the prefill node's plan shipped for one request: each of its blocks' destination
    (in block order; a partly filled block is sent again when a later chunk completes it),
    and how many pages (blocks of one layer each) left per layer."""

    def __init__(self, prefill: Any) -> None:
        self.blocks: dict[int, int] = {}  # source block -> destination block
        self.pages = 0
        plan = prefill.plan_kv

        def planning(output: Any) -> list[Any]:
            shipments = plan(output)
            for ship in shipments:
                self.blocks.update(zip(ship.src, ship.dst))
                self.pages += len(ship.src)
            return shipments

        prefill.plan_kv = planning  # rank 0 plans for every rank


def assert_same_latents(prefill: Any, decode_: Any, shipped: Shipped, n_tokens: int) -> None:
    """Every prompt token's latent, layer by layer, is the same bits on both nodes (rank 0's
    caches; a decode rank's later tokens are its own)."""
    assert len(shipped.blocks) == math.ceil(n_tokens / BLOCK)
    sent, got = prefill.engine.runner.kv_caches, decode_.engine.runner.kv_caches
    for i, (src, dst) in enumerate(shipped.blocks.items()):
        held = min(BLOCK, n_tokens - i * BLOCK)
        for layer, (a, b) in enumerate(zip(sent, got)):
            assert a.shape[0] == 1 and a.shape[-1] == LATENT  # one latent plane per token
            same = torch.equal(
                a[:, src, :held].view(torch.uint8), b[:, dst, :held].view(torch.uint8)
            )
            assert same, (i, layer)


@pytest.mark.parametrize(
    ("p", "d", "connector"),
    [
        (1, 1, "zmq"),
        (1, 1, "nccl"),
        (1, 1, "shm"),
        pytest.param(1, 1, "nixl", marks=needs_nixl),  # WRITEs of the one latent plane
        (2, 1, "zmq"),
        (1, 2, "zmq"),
    ],
)
def test_mla_through_pd_equals_the_engine(model_dir: str, p: int, d: int, connector: str) -> None:
    expected = answers(model_dir)
    with pair(model_dir, p, d, connector) as (router, prefill, decode_):
        layout = decode_.kv.local.layout
        assert (layout.planes, layout.num_kv_heads, layout.head_dim) == (1, 1, LATENT)
        before = (free(prefill), free(decode_))
        pages = 0
        for i, prompt in enumerate(PROMPTS):
            shipped = Shipped(prefill)
            assert serve(router, prefill, decode_, f"r{i}", prompt, p) == expected[i]
            assert_same_latents(prefill, decode_, shipped, len(prompt))
            pages += shipped.pages
        # One latent per token and layer on the link: a page is block_size latents.
        assert layout.page_bytes == BLOCK * LATENT * layout.itemsize
        one_copy = pages * layout.num_layers * layout.page_bytes
        assert decode_.kv.bytes_received() == [one_copy] * d  # each decode rank, once
        sent = prefill.kv.bytes_sent()
        assert sum(sent) == d * one_copy and sent.count(0) == p - min(p, d)  # one sender each
        assert (free(prefill), free(decode_)) == before
