"""The nixl page checksum's edges (scripts/mutation.sh showed them unpinned): page sums against
a plain word sum, in the caller's order, for every block size and path; collected sums per
layer; and the transfer digest as pinned values (both ends must compute the same number)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer import nixl_wire as nx


def reference(cache: torch.Tensor, blocks: list[int]) -> list[list[int]]:
    """Each block's K and V half summed as int64 words (halves of whole words only)."""
    halves = [[cache[0, b], cache[1, b]] for b in blocks]
    return [[int(h.contiguous().view(torch.int64).sum()) for h in pair] for pair in halves]


def cache(num_blocks: int, per_block: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(num_blocks * 31 + per_block)
    return torch.randn(2, num_blocks, per_block, generator=g).to(dtype)


@pytest.mark.parametrize(
    "blocks",
    [[3], [5, 6, 7, 8, 9, 10, 11, 12, 20, 21, 22, 23, 24, 25, 26, 27, 28], [9, 2, 30, 4]],
    ids=["one", "two-runs", "scattered"],
)
def test_page_sums_are_word_sums_in_the_callers_order(blocks: list[int]) -> None:
    c = cache(32, 8)  # 32 bytes per half: whole words, read in place
    assert nx.page_sums(c, blocks).tolist() == reference(c, blocks)


def test_blocks_that_are_not_whole_words_sum_each_byte() -> None:
    """A half of 6 bytes is no whole number of int64 words: each byte counts as one."""
    c = cache(8, 3, torch.float16)
    want = [
        [int(h.contiguous().view(torch.uint8).to(torch.int64).sum()) for h in c[:, b]]
        for b in (1, 4)
    ]
    assert nx.page_sums(c, [1, 4]).tolist() == want


def test_scattered_blocks_sum_through_several_gathers(monkeypatch: pytest.MonkeyPatch) -> None:
    c = cache(40, 8)
    blocks = [37, 3, 15, 22, 8, 30, 1]
    # blocks of 4 words a half: a gather of 2 blocks reads 2 * 4 * 16 bytes (K and V, 8 each)
    monkeypatch.setattr(nx, "_GATHER_BYTES", 2 * 4 * 16)
    assert nx.page_sums(c, blocks).tolist() == reference(c, blocks)


def test_no_blocks_give_an_empty_int64_table() -> None:
    sums = nx.page_sums(cache(4, 8), [])
    assert sums.shape == (0, 2) and sums.dtype == torch.int64


def test_collected_sums_keep_layers_apart_as_unsigned_words() -> None:
    parts = [
        (0, [4, 2], torch.tensor([[1, -1], [2, 3]])),
        (1, [4], torch.tensor([[-2, 5]])),
        (0, [2], torch.tensor([[7, 8]])),  # a later write of block 2 wins
    ]
    assert nx.collect_sums(parts) == {
        0: {4: (1, (1 << 64) - 1), 2: (7, 8)},
        1: {4: ((1 << 64) - 2, 5)},
    }


def test_transfer_digests_are_pinned() -> None:
    sums = {0: {4: (10, 20), 2: (1, 2)}, 3: {7: (5, (1 << 64) - 6)}}
    assert nx.pages_digest(sums) == 10746799297480564377
    assert nx.pages_digest({}) == 6370644464059465465
    swapped = {0: {4: (1, 2), 2: (10, 20)}, 3: sums[3]}  # pages in the wrong blocks
    assert nx.pages_digest(swapped) != nx.pages_digest(sums)
