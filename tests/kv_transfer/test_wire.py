"""Checksums, message strictness, fault hook parsing and the receiver's bookkeeping."""

from __future__ import annotations

from dataclasses import replace

import msgpack
import pytest
import torch

from pdserve.common.wire.messages import Abort, ProtocolError, decode, encode
from pdserve.common.wire.payloads import FirstToken, TokenLogprobs
from pdserve.kv_transfer.channel import SendBook
from pdserve.kv_transfer.channel_receiver import ReceiveBook
from pdserve.kv_transfer.wire import (
    CHECKSUM_ROW_WORDS,
    CHECKSUM_SCHEME,
    FRAME_BYTES,
    KV_PLANE,
    FramePool,
    KVDone,
    KVPage,
    as_bytes,
    blocks_per_frame,
    page_checksum,
    resolve,
)


def reference_checksum(data: bytes) -> tuple[int, int, int]:
    """page_checksum's documented arithmetic, word by word in plain Python."""
    width = CHECKSUM_ROW_WORDS
    data += bytes(-len(data) % (8 * width))
    words = [int.from_bytes(data[i : i + 8], "little", signed=True) for i in range(0, len(data), 8)]
    rows = [sum(words[i : i + width]) for i in range(0, len(words), width)]
    cols = [sum(words[c::width]) for c in range(width)]
    mask = (1 << 64) - 1
    return (
        sum(rows) & mask,
        sum(r * w for w, r in enumerate(rows, 1)) & mask,
        sum(c * w for w, c in enumerate(cols, 1)) & mask,
    )


@pytest.mark.parametrize("rows, extra", [(0, 0), (0, 5), (1, 0), (3, 1000)])
def test_checksum_is_the_documented_sums(rows: int, extra: int) -> None:
    nbytes = rows * 8 * CHECKSUM_ROW_WORDS + extra
    gen = torch.Generator().manual_seed(nbytes)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    got = page_checksum(data)
    assert got.dtype == torch.int64 and got.shape == (3,)
    unsigned = tuple(v & ((1 << 64) - 1) for v in got.tolist())
    assert unsigned == reference_checksum(data.numpy().tobytes())


def test_checksum_catches_every_flipped_byte() -> None:
    # More than a row, with a padded tail: every byte, low bit and high bit (d * 2**63 too).
    pages = torch.randn(2, 3, 7, 2, 48).to(torch.bfloat16)
    raw = as_bytes(pages)
    assert raw.numel() % (8 * CHECKSUM_ROW_WORDS) != 0 and raw.numel() > 8 * CHECKSUM_ROW_WORDS
    base = resolve(page_checksum(pages))
    assert base == resolve(page_checksum(pages.clone()))
    for index in range(raw.numel()):
        for bit in (0x01, 0x80):
            flipped = pages.clone()
            as_bytes(flipped)[index] ^= bit
            assert resolve(page_checksum(flipped)) != base, (index, bit)


def test_checksum_catches_reordering() -> None:
    pages = torch.randn(2, 6, 16, 2, 64)  # 8 KiB pages: two checksum rows each
    base = resolve(page_checksum(pages))

    def swapped(i: int, j: int, words: bool = False) -> int:
        t = pages.clone()
        if words:
            w = as_bytes(t).view(torch.int64)
            w[[i, j]] = w[[j, i]]
        else:
            t[:, [i, j]] = t[:, [j, i]]
        return resolve(page_checksum(t))

    assert swapped(0, 1) != base and swapped(2, 5) != base  # whole pages
    assert swapped(3, 4, words=True) != base  # neighbours in one row
    assert swapped(7, 7 + CHECKSUM_ROW_WORDS, words=True) != base  # same column, next row
    assert swapped(0, 3 * CHECKSUM_ROW_WORDS + 9, words=True) != base
    assert resolve(page_checksum(pages.flip(0).contiguous())) != base  # K and V halves swapped


def test_checksum_ignores_alignment_and_dtype_views() -> None:
    data = torch.randint(0, 256, (9003,), dtype=torch.uint8)
    for misaligned in (data[3:], data[3:-2]):  # whole words or not
        assert misaligned.storage_offset() % 8
        assert resolve(page_checksum(misaligned)) == resolve(page_checksum(misaligned.clone()))
    floats = torch.randn(2, 2, 4, 2, 8)
    assert resolve(page_checksum(floats)) == resolve(page_checksum(floats.view(torch.uint8)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_checksum_is_the_same_on_cpu_and_cuda() -> None:
    pages = torch.randn(2, 7, 16, 8, 128).to(torch.bfloat16)
    assert resolve(page_checksum(pages)) == resolve(page_checksum(pages.cuda()))


def test_resolve_passes_ints_through() -> None:
    assert resolve(5) == 5 and resolve(-1) == (1 << 64) - 1


def test_frames_hold_whole_pages_up_to_the_cap() -> None:
    assert blocks_per_frame(128 << 10) == FRAME_BYTES // (128 << 10)
    assert blocks_per_frame(3 << 20) == 2
    assert blocks_per_frame(FRAME_BYTES + 1) == 1  # a page larger than the cap still goes
    assert blocks_per_frame(512, limit=3 * 512) == 3


def test_frame_pool_lends_each_buffer_once_and_takes_back_only_its_own() -> None:
    pool = FramePool(count=2, nbytes=1024)
    a = pool.take((2, 4, 8), torch.float32)
    b = pool.take((16,), torch.bfloat16)
    assert a is not None and b is not None and a.shape == (2, 4, 8) and b.dtype == torch.bfloat16

    def address(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    assert address(a) != address(b)
    assert pool.take((1,), torch.float32) is None  # all lent: the caller allocates
    pool.give_back(torch.zeros(4))  # not the pool's: ignored
    assert pool.take((1,), torch.float32) is None
    pool.give_back(a)
    again = pool.take((256,), torch.float32)
    assert again is not None and address(again) == address(a)
    pool.give_back(b)
    assert pool.take((257,), torch.float32) is None  # larger than a buffer


def test_page_header_decoding_is_strict() -> None:
    page = KVPage("x", 1, (3, 5), "float32", (2, 2, 4, 2, 8), seq=9)
    assert KV_PLANE.decode(encode(page)) == page
    body = encode(page).replace(b"dtype", b"dtypf")
    with pytest.raises(ProtocolError):
        KV_PLANE.decode(body)


def test_control_and_kv_messages_are_refused_on_each_others_sockets() -> None:
    page = KVPage("x", 1, (3,), "float32", (2, 1, 4, 2, 8), seq=0)
    with pytest.raises(ProtocolError, match="unknown message type on the control plane"):
        decode(encode(page))
    with pytest.raises(ProtocolError, match="unknown message type on the KV data plane"):
        KV_PLANE.decode(encode(Abort("r1")))
    assert decode(encode(Abort("r1"))) == Abort("r1")


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
    got.on_done(sent.close("t", FirstToken(3)))
    (result,) = got.finished()
    assert result.ok and result.first == FirstToken(3)


def test_missing_and_damaged_pages_fail_the_transfer() -> None:
    sent, got = SendBook(1), ReceiveBook(1)
    for blocks in ((1,), (2,)):
        sent.record(_page("t", 0, blocks), 5)
    got.expect("t", [1, 2])
    assert got.admit(_page("t", 0, (1,))) and got.land(_page("t", 0, (1,)), 6)
    got.on_done(sent.close("t", FirstToken(0)))
    (result,) = got.finished()
    assert not result.ok and "received 1 pages, sender sent 2" in result.error


def test_done_waits_for_frames_in_flight_and_cancel_makes_them_late() -> None:
    got = ReceiveBook(1)
    got.expect("t", [4])
    page = _page("t", 0, (4,))
    assert got.admit(page)
    got.on_done(SendBook(1).close("t", FirstToken(0)))
    assert got.finished() == []  # the admitted frame has not landed yet
    got.cancel("t")
    assert not got.land(page, 1)
    assert got.counters == {"late_frame": 1}
    assert not got.admit(page) and got.counters["frame_cancelled_xfer"] == 1


def test_done_from_another_checksum_scheme_fails_the_transfer_clearly() -> None:
    sent, got = SendBook(1), ReceiveBook(1)
    sent.record(_page("t", 0, (1,)), 7)
    done = sent.close("t", FirstToken(0))
    assert done.checksum_scheme == CHECKSUM_SCHEME
    got.expect("t", [1])
    assert got.admit(_page("t", 0, (1,))) and got.land(_page("t", 0, (1,)), 7)
    got.on_done(replace(done, checksum_scheme="crc32"))
    (result,) = got.finished()
    assert not result.ok and "'crc32'" in result.error and CHECKSUM_SCHEME in result.error


FIRST = FirstToken(7, TokenLogprobs(7, -0.25, ((7, -0.25), (3, -1.5)), 1))


def test_done_round_trips_its_typed_first_token_and_nixl_fields() -> None:
    done = KVDone("t", FIRST, 5, (2, 2), "s", "write failed", (4, 9), 2)
    assert KV_PLANE.decode(encode(done)) == done
    plain = KVDone("t", FirstToken(7), 5, (1,), CHECKSUM_SCHEME)
    assert KV_PLANE.decode(encode(plain)) == plain and plain.writes == -1


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda b: b.pop("first"), "kvx.done: missing field 'first'"),
        (lambda b: b.pop("checksum_scheme"), "kvx.done: missing field 'checksum_scheme'"),
        (lambda b: b["first"].pop("token_id"), "kvx.done.first: missing field 'token_id'"),
        (lambda b: b["first"].update(token_id="7"), "kvx.done.first.token_id: expected int"),
        (lambda b: b["first"]["logprobs"].update(top=[[7]]), "kvx.done.first.logprobs.top"),
        (lambda b: b["first"].update(meta={}), r"kvx.done.first: unknown fields \['meta'\]"),
    ],
)
def test_done_without_a_whole_first_token_is_refused(change, why) -> None:
    body = msgpack.unpackb(encode(KVDone("t", FIRST, 5, (1,), CHECKSUM_SCHEME)))
    change(body)
    with pytest.raises(ProtocolError, match=why):
        KV_PLANE.decode(msgpack.packb(body))
