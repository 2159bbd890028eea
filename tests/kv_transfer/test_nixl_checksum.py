"""The nixl connector's page checksum: each end sums its own blocks in place (runs of
contiguous blocks; scattered ones through bounded gathers), and the two must agree exactly
when the pages are equal, wherever each end keeps them; a changed byte, a page in the wrong
block or a missing page changes it. Pure torch: runs without NIXL installed."""

from __future__ import annotations

import random

import torch

from pdserve.kv_transfer import KVLayout
from pdserve.kv_transfer import nixl_wire as nx
from tests.kv_transfer.helpers import make_caches

LAYOUT = KVLayout("tiny-llama", "float32", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)


def _digest(caches: list[torch.Tensor], blocks: list[int], dsts: list[int]) -> int:
    """The checksum of pages `blocks` of `caches`, as written to destination blocks `dsts`."""
    parts = [(layer, dsts, nx.page_sums(c, blocks)) for layer, c in enumerate(caches)]
    return nx.pages_digest(nx.collect_sums(parts))


def _placed(n: int, num_blocks: int, seed: int) -> tuple[list[torch.Tensor], list[int]]:
    """Caches holding the same n pages (per layer) at random blocks of their own."""
    source = make_caches(LAYOUT, n, seed=7)
    caches = make_caches(LAYOUT, num_blocks, seed=seed)  # other blocks: unrelated bytes
    blocks = random.Random(seed).sample(range(num_blocks), n)
    for layer, cache in enumerate(caches):
        cache[:, blocks] = source[layer]
    return caches, blocks


def test_equal_pages_checksum_equal_wherever_they_sit() -> None:
    dsts = random.Random(0).sample(range(100), 40)
    a, blocks_a = _placed(40, 60, seed=1)  # scattered: summed through gathers
    b, blocks_b = _placed(40, 90, seed=2)
    contiguous = make_caches(LAYOUT, 50, seed=3)  # one run: summed in place
    for layer, cache in enumerate(contiguous):
        cache[:, 5:45] = a[layer][:, blocks_a]
    want = _digest(a, blocks_a, dsts)
    assert _digest(b, blocks_b, dsts) == want
    assert _digest(contiguous, list(range(5, 45)), dsts) == want
    sums = nx.page_sums(contiguous[0], list(range(5, 45)))
    assert torch.equal(sums, nx.page_sums(a[0], blocks_a))  # in place == gathered
    assert sums.shape == (40, 2) and sums.dtype == torch.int64


def test_a_changed_byte_a_misplaced_or_missing_page_change_it() -> None:
    caches, blocks = _placed(6, 10, seed=4)
    dsts = [3, 9, 4, 1, 7, 2]
    want = _digest(caches, blocks, dsts)
    swapped = [dsts[0], dsts[2], dsts[1], *dsts[3:]]
    assert _digest(caches, blocks, swapped) != want
    assert _digest(caches, blocks[:5], dsts[:5]) != want
    raw = caches[2][1, blocks[5]].view(-1).view(torch.uint8)
    raw[7] ^= 1
    assert _digest(caches, blocks, dsts) != want
    raw[7] ^= 1
    assert _digest(caches, blocks, dsts) == want


def test_the_last_write_of_a_page_counts() -> None:
    caches, blocks = _placed(4, 8, seed=5)
    stale = torch.full((4, 2), 12345, dtype=torch.int64)
    parts = [(0, [1, 2, 3, 4], stale), (0, [1, 2, 3, 4], nx.page_sums(caches[0], blocks))]
    assert nx.collect_sums(parts) == nx.collect_sums(parts[1:])


def test_runs_of_consecutive_ids() -> None:
    assert nx._runs([2, 3, 4, 7, 9, 10]) == [(2, 3), (7, 1), (9, 2)]
    assert nx._runs([]) == []


def test_nixl_without_the_extra_names_the_install(monkeypatch) -> None:
    """Choosing nixl where NIXL is not installed fails when the node starts (its KV port is
    made), with the command that installs it."""
    import pytest

    from pdserve.kv_transfer import TransferError, nixl_agent
    from pdserve.kv_transfer.ranks import KVPort

    monkeypatch.setattr(nixl_agent, "_NIXL_MODULES", ("no_such_nixl_module._api",))
    with pytest.raises(TransferError, match=r"pip install 'pdserve\[nixl\]'"):
        KVPort("nixl", LAYOUT)
    KVPort("zmq", LAYOUT)  # the others need nothing more
