"""A node's KV ends at every tensor-parallel rank (`RankKV`, `KVGroup`), driven the way the
nodes drive them: typed commands, encoded and decoded on the KV ranks plane for every worker
rank, and the step's layer hook (`KVGroup.ship`) on every prefill rank. All ranks of both
groups live in this process on the zmq connector; the decode group's caches, joined across
its ranks, must equal the prefill group's pages bit for bit, each rank holding only its heads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pdserve.common.wire.messages import Message, encode
from pdserve.common.wire.payloads import FirstToken, KVLayout, rank_kv_heads
from pdserve.common.wire.ranks import RankCommand, RankPlane, answer
from pdserve.kv_transfer.commands import KV_RANKS, Shipment
from pdserve.kv_transfer.ranks import KVGroup, RankKV
from tests.kv_transfer.helpers import make_caches

LAYOUT = KVLayout("tiny", "float32", num_layers=2, num_kv_heads=4, head_dim=8, block_size=4)
SRC_BLOCKS, DST_BLOCKS = 10, 12


class Runner:
    """The part of a model runner a RankKV reads: its caches and the layout they make."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self.kv_caches = caches

    def kv_layout(self, model_id: str) -> KVLayout:
        return LAYOUT


class Workers:
    """Stands in for the engine's RankDriver: every command goes to each worker rank as the
    worker process takes it (encoded, decoded by the plane, answered, decoded again)."""

    def __init__(self, agents: list[RankKV]) -> None:
        self.agents = agents

    def call(
        self, plane: RankPlane, command: RankCommand, local: Callable[[], Message]
    ) -> list[Message]:
        frames = [answer(plane, a.handlers(), encode(command)) for a in self.agents]
        return [local(), *(plane.reply(command, f, r) for r, f in enumerate(frames, 1))]


def group(role: str, size: int, caches: Callable[[int], list[torch.Tensor]]) -> KVGroup:
    """A node's KV group at TP `size`: rank 0's RankKV and its workers'."""
    ranks = [
        RankKV(Runner(caches(r)), SimpleNamespace(rank=r, size=size), "zmq", "tiny", role)
        for r in range(size)
    ]
    return KVGroup(ranks[0], Workers(ranks[1:]) if size > 1 else None)


def every_rank(kv: KVGroup) -> list[RankKV]:
    return [kv.local, *(kv.driver.agents if kv.driver is not None else [])]


@contextmanager
def answering(decode: KVGroup) -> Iterator[None]:
    """Poll the decode ranks' receivers while the prefill ranks handshake (a sender's connect
    waits for the receiver's welcome)."""
    stop = threading.Event()

    def pump() -> None:
        while not stop.is_set():
            for rank in every_rank(decode):
                assert rank.receiver is not None
                rank.receiver.poll(0.005)  # its results come back in TakeFinished's poll

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def transfer(prefill: KVGroup, decode: KVGroup, src: list[int], dst: list[int]) -> None:
    """One request's transfer the nodes' way: reserve on decode, connect, ship each layer of
    the step on every prefill rank, end with the first token; every slice must come out ok."""
    p = prefill.size
    slices = decode.expect("x1", dst, p)
    with answering(decode):
        prefill.connect(decode.endpoints, "decode-1")
    call = prefill.ship([Shipment(decode.endpoints, "x1", tuple(src), tuple(dst))])
    workers = every_rank(prefill)[1:]
    for layer in range(LAYOUT.num_layers):
        call.run(layer)  # rank 0; a worker builds its hook from the step's encoded message
        for rank in workers:
            rank.layer_hook(KV_RANKS.decode(encode(call.args)))(layer)
    assert prefill.take_failures() == {}
    prefill.done(decode.endpoints, "x1", FirstToken(7))
    done = []
    for _ in range(2000):  # a loopback transfer of a few pages lands in milliseconds
        done += decode.finished()
        if len(done) == slices:
            break
        threading.Event().wait(0.005)
    assert [(d.ok, d.error, d.first) for d in done] == [(True, "", FirstToken(7))] * slices


@pytest.mark.parametrize(("p", "d"), [(1, 2), (2, 1), (2, 4)])
def test_each_decode_rank_holds_exactly_its_heads_of_the_prefill_pages(p: int, d: int) -> None:
    full = make_caches(LAYOUT, SRC_BLOCKS, seed=5)
    heads = LAYOUT.num_kv_heads

    def held(caches: list[torch.Tensor], size: int, rank: int) -> list[torch.Tensor]:
        part = rank_kv_heads(heads, size, rank)
        return [c[:, :, :, part.start : part.stop].contiguous() for c in caches]

    zeros = [torch.zeros(2, DST_BLOCKS, 4, heads, 8) for _ in range(LAYOUT.num_layers)]
    prefill = group("prefill", p, lambda r: held(full, p, r))
    decode = group("decode", d, lambda r: held(zeros, d, r))
    try:
        src, dst = [3, 0, 7, 5], [11, 2, 6, 9]
        transfer(prefill, decode, src, dst)
        for r, rank in enumerate(every_rank(decode)):
            want = held(full, d, r)
            for layer, cache in enumerate(rank.caches):
                assert torch.equal(cache[:, dst], want[layer][:, src]), (r, layer)
                others = [b for b in range(DST_BLOCKS) if b not in dst]
                assert not cache[:, others].any(), f"rank {r} wrote outside its blocks"
    finally:
        for kv in (prefill, decode):
            for rank in every_rank(kv):
                rank.close()


def test_every_kv_transfer_module_reads_at_a_glance() -> None:
    """Files under ~450 lines (STYLE.md): kv_transfer's largest once was channel.py at 517."""
    root = Path(__file__).resolve().parents[2] / "kv_transfer"
    sizes = {p.name: len(p.read_text().splitlines()) for p in root.glob("*.py")}
    assert len(sizes) > 10 and max(sizes.values()) <= 450, sorted(sizes.items(), key=lambda x: x[1])
