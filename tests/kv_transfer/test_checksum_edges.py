"""The KV page checksum and transfer digests as pinned values (scripts/mutation.sh showed them
unpinned): both ends of a transfer, possibly on other hosts and releases, must compute the same
numbers for the scheme they name, so a change here must come with a new scheme name."""

from __future__ import annotations

import torch

from pdserve.kv_transfer.wire import (
    CHECKSUM_SCHEME,
    combine,
    frame_digest,
    page_checksum,
    resolve,
)


def test_the_scheme_name_goes_with_these_values() -> None:
    assert CHECKSUM_SCHEME == "pdserve-rowcol64/1"


def test_a_page_of_a_few_bytes_is_padded_to_a_word() -> None:
    sums = page_checksum(torch.arange(9, dtype=torch.uint8))
    assert sums.tolist() == [506097522914230536, 506097522914230536, 506097522914230544]
    assert resolve(sums) == 7608956572638830306


def test_a_page_that_starts_between_words_is_read_from_a_copy() -> None:
    page = torch.arange(40, dtype=torch.float16)[9:17]  # 16 bytes at byte offset 18
    sums = page_checksum(page)
    assert sums.tolist() == [-7637941138304756992, -7637941138304756992, -2161480977036026496]
    assert resolve(sums) == 2466260630555449509


def test_a_page_with_a_short_last_row() -> None:
    words = (torch.arange(4321, dtype=torch.int64) * 2654435761) % (1 << 40)
    sums = page_checksum(words)
    assert sums.tolist() == [2319478580217712, 6281410381715576, 1093256993861043200]
    assert resolve(sums) == 16160264306928772229


def test_frame_digests_and_their_sum_are_pinned() -> None:
    assert frame_digest(3, [5, 9], 12345) == 17738157327048848149
    assert frame_digest(3, [9, 5], 12345) != frame_digest(3, [5, 9], 12345)
    assert combine([(1 << 64) - 1, 2]) == 1  # mod 2**64
    assert resolve(-1) == (1 << 64) - 1 and resolve(7) == 7
