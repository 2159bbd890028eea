"""An MLA latent layout (one plane, one "head" of the latent's width) on every connector that
moves frames: the pages land bit for bit, a damaged one fails its checksum, and the bytes each
end counts (`bytes_sent`, `bytes_received`) are exactly the latent's, one page per block and
layer. Under tensor parallelism the latent is replicated: each decode rank gets it once, from
one prefill rank, and no other prefill rank sends anything.

The senders run in this process, each call on a thread while the receivers are polled here
(a handshake, a gloo rendezvous and the shm credits all need the receiver's `poll`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from pdserve.common.wire.payloads import FirstToken, transfer_plan
from pdserve.kv_transfer import KVLayout, create_receiver, create_sender
from pdserve.kv_transfer.base import KVSender, LayoutMismatchError
from pdserve.testbed.kvfaults import FaultPlan, PlannedFaults
from tests.kv_transfer.helpers import Pump

LATENT = KVLayout(
    "tiny-mla", "float32", num_layers=3, num_kv_heads=1, head_dim=40, block_size=4, planes=1
)
SRC_BLOCKS, DST_BLOCKS = 14, 18
SRC, DST = [3, 7, 1, 12, 5], [10, 2, 17, 4, 8]


@pytest.fixture(params=["zmq", "shm", "nccl"])
def connector(request: pytest.FixtureRequest) -> str:
    return request.param


def caches(layout: KVLayout, num_blocks: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = layout.page_shape(num_blocks)
    return [
        torch.randn(shape, generator=gen).to(getattr(torch, layout.dtype))
        for _ in range(layout.num_layers)
    ]


def on_thread(pump: Pump, fn: Callable[[], Any], timeout: float = 20.0) -> None:
    """Run `fn` on a thread while polling `pump`'s receivers; re-raise what it raised."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the test's thread
            failure.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    pump.until(lambda: not worker.is_alive(), timeout, "the sender's call")
    if failure:
        raise failure[0]


def connect(pump: Pump, connector: str, layout: KVLayout, endpoint: str) -> KVSender:
    sender = create_sender(connector, layout, send_timeout=10.0)
    try:
        on_thread(pump, lambda: sender.connect(endpoint, 10.0))
    except BaseException:
        sender.close()
        raise
    return sender


def send(
    pump: Pump, sender: KVSender, xfer: str, cache: list[torch.Tensor], heads: range | None = None
) -> None:
    def run() -> None:
        for layer, layer_cache in enumerate(cache):
            sender.send_layer(xfer, layer, SRC, DST, layer_cache, heads)
        sender.send_done(xfer, FirstToken(7))
        sender.flush(10.0)

    on_thread(pump, run)


def as_sent(before: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
    expected = before.clone()
    expected[:, DST] = sent[:, SRC]
    return expected


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_latent_pages_land_bit_exact_and_the_link_carries_only_the_latent(
    connector: str, dtype: str
) -> None:
    layout = replace(LATENT, dtype=dtype)
    sent, got = caches(layout, SRC_BLOCKS, 1), caches(layout, DST_BLOCKS, 2)
    before = [c.clone() for c in got]
    # A small shm ring (2 pages): frames split, the ring wraps, credits flow.
    opts = {"staging_bytes": 2 * layout.page_bytes} if connector == "shm" else {}
    receiver = create_receiver(connector, layout, got, **opts)
    pump = Pump(receiver)
    sender = connect(pump, connector, layout, receiver.endpoint)
    try:
        receiver.expect("x", DST)
        send(pump, sender, "x", sent)
        (result,) = pump.wait_results("x")
        assert result.ok and result.first == FirstToken(7), result.error
        assert all(same_bits(g, as_sent(b, s)) for g, b, s in zip(got, before, sent))
        assert not receiver.counters
        pages = len(SRC) * layout.num_layers
        assert receiver.pages_received == pages
        # Bytes on the link per page are the page's bytes: per token, one latent per layer.
        assert sender.bytes_sent == receiver.bytes_received == pages * layout.page_bytes
        per_token = receiver.bytes_received // (pages * layout.block_size)
        assert per_token == layout.head_dim * layout.itemsize
    finally:
        sender.close()
        receiver.close()


def test_a_damaged_latent_page_fails_its_checksum(connector: str) -> None:
    sent, got = caches(LATENT, SRC_BLOCKS, 1), caches(LATENT, DST_BLOCKS, 2)
    receiver = create_receiver(connector, LATENT, got)
    pump = Pump(receiver)
    sender = connect(pump, connector, LATENT, receiver.endpoint)
    try:
        sender.faults = PlannedFaults(FaultPlan(targets=frozenset({"bad"})))
        receiver.expect("bad", DST)
        send(pump, sender, "bad", sent)
        (result,) = pump.wait_results("bad")
        assert not result.ok and "checksum" in result.error
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize(("p", "d"), [(1, 2), (2, 1), (2, 2)])
def test_under_tp_each_decode_rank_gets_the_latent_once_from_one_prefill_rank(
    p: int, d: int
) -> None:
    """Every rank of a group holds the whole latent (the same on each); the plan names one
    sender per decode rank, and the prefill ranks send, together, one latent per decode rank."""
    plan = transfer_plan(LATENT.num_kv_heads, p, d)
    assert sorted(s.dst_rank for s in plan) == list(range(d))  # one slice per decode rank
    prefill = caches(LATENT, SRC_BLOCKS, 1)  # replicated: every prefill rank's is this one
    decode = [caches(LATENT, DST_BLOCKS, 2 + j) for j in range(d)]
    before = [[c.clone() for c in rank] for rank in decode]
    receivers = [create_receiver("zmq", LATENT, decode[j]) for j in range(d)]
    pumps = [Pump(r) for r in receivers]  # each decode rank names its slices alike
    senders: dict[tuple[int, int], KVSender] = {}
    try:
        for s in plan:
            endpoint = receivers[s.dst_rank].endpoint
            senders[s.src_rank, s.dst_rank] = connect(pumps[s.dst_rank], "zmq", LATENT, endpoint)
        for s in plan:
            heads = range(s.dst_offset, s.dst_offset + s.count)
            receivers[s.dst_rank].expect(f"x.{s.src_rank}", DST, heads)
        for s in plan:
            heads = range(s.src_offset, s.src_offset + s.count)
            sender = senders[s.src_rank, s.dst_rank]
            send(pumps[s.dst_rank], sender, f"x.{s.src_rank}", prefill, heads)
            (result,) = pumps[s.dst_rank].wait_results(f"x.{s.src_rank}")
            assert result.ok, result.error
        for j in range(d):
            landed = zip(decode[j], before[j], prefill)
            assert all(same_bits(g, as_sent(b, s)) for g, b, s in landed)
            assert not receivers[j].counters
        one_latent = len(SRC) * LATENT.num_layers * LATENT.page_bytes
        assert sum(s.bytes_sent for s in senders.values()) == d * one_latent
        assert [r.bytes_received for r in receivers] == [one_latent] * d
    finally:
        for sender in senders.values():
            sender.close()
        for receiver in receivers:
            receiver.close()


def test_latent_and_kv_layouts_do_not_mix() -> None:
    """A K/V cache is not a latent layout's cache, and a latent sender is refused by a K/V
    receiver at the handshake, naming `planes`."""
    kv = replace(LATENT, planes=2)
    with pytest.raises(ValueError, match=r"\[1, num_blocks"):
        create_receiver("zmq", LATENT, caches(kv, DST_BLOCKS, 2))
    receiver = create_receiver("zmq", kv, caches(kv, DST_BLOCKS, 2))
    try:
        with pytest.raises(LayoutMismatchError, match="planes"):
            connect(Pump(receiver), "zmq", LATENT, receiver.endpoint)
    finally:
        receiver.close()
