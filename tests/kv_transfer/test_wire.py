"""Checksums, message strictness, fault hook parsing and the receiver's bookkeeping."""

from __future__ import annotations

import pytest
import torch

from common.protocol import ProtocolError, decode, encode
from kv_transfer.bookkeeping import ReceiveBook, SendBook
from kv_transfer.wire import (
    FAULT_ENV,
    KVPage,
    as_bytes,
    device_checksum,
    fault_targets,
    page_checksum,
    resolve,
)


def test_device_checksum_catches_flips_and_swaps() -> None:
    # device_checksum is the CUDA path; it is plain torch, so its logic is checked on CPU.
    pages = torch.randn(2, 4, 4, 2, 8)
    base = resolve(device_checksum(pages))
    assert base == resolve(device_checksum(pages.clone()))
    for index in (0, 1, 777, as_bytes(pages).numel() - 1):
        flipped = pages.clone()
        as_bytes(flipped)[index] ^= 1
        assert resolve(device_checksum(flipped)) != base, index
    swapped = pages.clone()
    swapped[:, [0, 1]] = pages[:, [1, 0]]
    assert resolve(device_checksum(swapped)) != base
    odd = torch.arange(7, dtype=torch.uint8)  # not a whole number of 32-bit words
    assert resolve(device_checksum(odd)) != resolve(device_checksum(odd.flip(0)))


def test_cpu_checksum_is_crc_of_bytes_for_any_dtype() -> None:
    pages = torch.randn(2, 3, 4, 2, 8).to(torch.bfloat16)
    assert page_checksum(pages) == page_checksum(pages.clone())
    flipped = pages.clone()
    as_bytes(flipped)[5] ^= 0x10
    assert page_checksum(flipped) != page_checksum(pages)


def test_page_header_decoding_is_strict() -> None:
    page = KVPage("x", 1, (3, 5), "float32", (2, 2, 4, 2, 8), seq=9)
    assert decode(encode(page)) == page
    body = encode(page).replace(b"dtype", b"dtypf")
    with pytest.raises(ProtocolError):
        decode(body)


def test_fault_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULT_ENV, raising=False)
    assert fault_targets() is None
    monkeypatch.setenv(FAULT_ENV, "1")
    assert fault_targets() == {"*"}
    monkeypatch.setenv(FAULT_ENV, "a,b")
    assert fault_targets() == {"a", "b"}


def _page(xfer: str, layer: int, blocks: tuple[int, ...]) -> KVPage:
    return KVPage(xfer, layer, blocks, "float32", (2, len(blocks), 1, 1, 1), seq=0)


def test_books_agree_regardless_of_arrival_order() -> None:
    sent, got = SendBook(2), ReceiveBook(2)
    frames = [(_page("t", 0, (1, 2)), 11), (_page("t", 1, (1,)), 22), (_page("t", 1, (2,)), 33)]
    for page, checksum in frames:
        sent.record(page, checksum)
    got.expect("t", [1, 2])
    for page, checksum in reversed(frames):
        assert got.admit(page) and got.land(page, checksum)
    got.on_done(sent.close("t", {"first_token": 3}))
    (result,) = got.finished()
    assert result.ok and result.meta == {"first_token": 3}


def test_missing_and_damaged_pages_fail_the_transfer() -> None:
    sent, got = SendBook(1), ReceiveBook(1)
    for blocks in ((1,), (2,)):
        sent.record(_page("t", 0, blocks), 5)
    got.expect("t", [1, 2])
    assert got.admit(_page("t", 0, (1,))) and got.land(_page("t", 0, (1,)), 6)
    got.on_done(sent.close("t", {}))
    (result,) = got.finished()
    assert not result.ok and "received 1 pages, sender sent 2" in result.error


def test_done_waits_for_frames_in_flight_and_cancel_makes_them_late() -> None:
    got = ReceiveBook(1)
    got.expect("t", [4])
    page = _page("t", 0, (4,))
    assert got.admit(page)
    got.on_done(SendBook(1).close("t", {}))
    assert got.finished() == []  # the admitted frame has not landed yet
    got.cancel("t")
    assert not got.land(page, 1)
    assert got.counters == {"late_frame": 1}
    assert not got.admit(page) and got.counters["frame_cancelled_xfer"] == 1
