"""The nixl connector's page checksum: both ends compute it over their own blocks in place
(runs of contiguous blocks, no gather) and must agree exactly when the pages are equal,
wherever each end keeps them; any changed byte or swapped page changes it. Pure torch: runs
without NIXL installed."""

from __future__ import annotations

import random

import torch

from pdserve.kv_transfer import KVLayout
from pdserve.kv_transfer.nixl_connector import _runs, pages_checksum
from tests.kv_transfer.helpers import make_caches

LAYOUT = KVLayout("tiny-llama", "float32", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)


def _placed(n_pages: int, num_blocks: int, seed: int) -> tuple[list[torch.Tensor], list[int]]:
    """Caches holding the same n_pages pages (per layer) at random blocks of their own."""
    source = make_caches(LAYOUT, n_pages, seed=7)
    caches = make_caches(LAYOUT, num_blocks, seed=seed)  # other blocks: unrelated bytes
    blocks = random.Random(seed).sample(range(num_blocks), n_pages)
    for layer, cache in enumerate(caches):
        cache[:, blocks] = source[layer]
    return caches, blocks


def _pages(blocks: list[int]) -> list[tuple[int, int, int]]:
    return [(layer, rank, b) for layer in range(LAYOUT.num_layers) for rank, b in enumerate(blocks)]


def test_equal_pages_checksum_equal_wherever_they_sit() -> None:
    a, blocks_a = _placed(9, 20, seed=1)
    b, blocks_b = _placed(9, 31, seed=2)
    contiguous = make_caches(LAYOUT, 12, seed=3)
    for layer, cache in enumerate(contiguous):
        cache[:, 2:11] = a[layer][:, blocks_a]
    want = pages_checksum(a, _pages(blocks_a))
    assert pages_checksum(b, _pages(blocks_b)) == want
    assert pages_checksum(contiguous, _pages(list(range(2, 11)))) == want
    # a dict of layers (the sender's) is read the same way
    assert pages_checksum(dict(enumerate(b)), _pages(blocks_b)) == want


def test_a_changed_byte_or_swapped_pages_change_it() -> None:
    caches, blocks = _placed(6, 10, seed=4)
    want = pages_checksum(caches, _pages(blocks))
    swapped = blocks[:]
    swapped[1], swapped[2] = swapped[2], swapped[1]
    assert pages_checksum(caches, _pages(swapped)) != want
    raw = caches[2][1, blocks[5]].view(-1).view(torch.uint8)
    raw[7] ^= 1
    assert pages_checksum(caches, _pages(blocks)) != want
    raw[7] ^= 1
    assert pages_checksum(caches, _pages(blocks)) == want


def test_runs_split_where_positions_or_blocks_stop_stepping() -> None:
    entries = [(0, 5), (1, 6), (2, 7), (3, 2), (4, 3), (5, 9)]
    assert _runs(entries) == [(0, 3), (3, 2), (5, 1)]
    assert _runs([]) == []
