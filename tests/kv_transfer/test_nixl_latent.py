"""nixl moves MLA's latent cache (one plane per block, see `KVLayout.planes`) as it moves K/V
pages: whole blocks written into the reserved ones bit for bit (float32 and bfloat16, whole
pages and a slice of heads' rows), and a damaged latent page fails the transfer's checksum.
The latent layout and helpers are test_latent_transfer's (zmq, shm, nccl); the sender runs
in this process (NIXL's agent is its own loopback target)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve.common.wire.payloads import FirstToken
from pdserve.kv_transfer import KVLayout, create_receiver
from pdserve.kv_transfer import nixl_wire as nx
from pdserve.kv_transfer.base import KVSender, TransferResult
from pdserve.testbed.kvfaults import FaultPlan, PlannedFaults
from tests.kv_transfer.helpers import Pump, needs_nixl
from tests.kv_transfer.test_latent_transfer import (
    DST,
    DST_BLOCKS,
    LATENT,
    SRC,
    SRC_BLOCKS,
    as_sent,
    caches,
    connect,
    same_bits,
    send,
)


def transfer(
    layout: KVLayout, dst_heads: range | None = None, src_heads: range | None = None, bad=False
) -> tuple[TransferResult, list, list, list, KVSender]:
    """One nixl transfer of SRC's pages into DST's (of those heads; `bad`: a damaged page):
    its result, the sent caches, the receiver's before and after, and the closed sender."""
    sent, got = caches(layout, SRC_BLOCKS, 1), caches(layout, DST_BLOCKS, 2)
    before = [c.clone() for c in got]
    receiver = create_receiver("nixl", layout, got)
    pump = Pump(receiver)
    sender = connect(pump, "nixl", layout, receiver.endpoint)
    try:
        if bad:
            sender.faults = PlannedFaults(FaultPlan(targets=frozenset({"x"})))
        receiver.expect("x", DST, dst_heads)
        send(pump, sender, "x", sent, src_heads)
        (result,) = pump.wait_results("x")
        assert bad or not receiver.counters
        return result, sent, before, got, sender
    finally:
        sender.close()
        receiver.close()


@needs_nixl
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_latent_pages_land_bit_exact_on_nixl(dtype: str) -> None:
    layout = replace(LATENT, dtype=dtype)
    result, sent, before, got, sender = transfer(layout)
    assert result.ok and result.first == FirstToken(7), result.error
    assert all(same_bits(g, as_sent(b, s)) for g, b, s in zip(got, before, sent))
    pages = len(SRC) * layout.num_layers
    assert sender.bytes_sent == pages * layout.page_bytes  # one latent per token, layer


@needs_nixl
def test_a_latent_slice_of_rows_lands_on_nixl() -> None:
    """A slice of heads (written row by row, the tensor-parallel path) of a one-plane cache of
    two heads: only those heads of the reserved blocks change."""
    result, sent, before, got, _ = transfer(
        replace(LATENT, num_kv_heads=2, head_dim=20), range(1, 2), range(0, 1)
    )
    assert result.ok, result.error
    for g, b, s in zip(got, before, sent):
        expected = b.clone()
        expected[:, DST, :, 1:2] = s[:, SRC, :, 0:1]
        assert same_bits(g, expected)


@needs_nixl
def test_a_damaged_latent_page_fails_its_checksum_on_nixl() -> None:
    result, *_ = transfer(LATENT, bad=True)
    assert not result.ok and "checksum" in result.error


def test_latent_page_sums_are_one_per_block() -> None:
    """A one-plane cache sums to one word sum per block, and a change in the plane changes
    the transfer's digest."""
    (cache,) = caches(replace(LATENT, num_layers=1), 6, 5)
    sums = nx.page_sums(cache, [4, 1])
    assert sums.shape == (2, 1)
    words = cache.reshape(1, 6, -1).view(torch.int64)
    assert sums[:, 0].tolist() == [int(words[0, 4].sum()), int(words[0, 1].sum())]
    digest = nx.pages_digest(nx.collect_sums([(0, [4, 1], sums)]))
    cache[0, 4, 0, 0, 0] += 1
    changed = nx.pages_digest(nx.collect_sums([(0, [4, 1], nx.page_sums(cache, [4, 1]))]))
    assert changed != digest
