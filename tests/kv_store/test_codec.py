"""The codec hands back a payload only for the exact, whole, intact object of the key asked."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.kv_store import KeySpace, codec
from tests.kv_store.helpers import LAYOUT, SPACE, key, payload


def test_round_trip() -> None:
    blob = codec.encode(key(1), payload(1))
    assert codec.decode(blob, key(1)) == payload(1)


def test_every_truncation_is_refused() -> None:
    blob = codec.encode(key(1), payload(1, 64))
    for n in range(len(blob)):
        assert codec.decode(blob[:n], key(1)) is None, n
    assert codec.decode(blob + b"\0", key(1)) is None


def test_every_flipped_byte_is_refused() -> None:
    blob = bytearray(codec.encode(key(1), payload(1, 64)))
    for i in range(len(blob)):
        blob[i] ^= 0x10
        assert codec.decode(blob, key(1)) is None, i
        blob[i] ^= 0x10
    assert codec.decode(blob, key(1)) == payload(1, 64)


def test_another_block_layout_or_slice_is_refused() -> None:
    blob = codec.encode(key(1), payload(1))
    assert codec.decode_or_reason(blob, key(2)).startswith("name")
    other_dtype = KeySpace.of(dataclasses.replace(LAYOUT, dtype="bfloat16"))
    assert codec.decode_or_reason(blob, key(1, other_dtype)).startswith("another KV layout")
    rank1 = KeySpace(SPACE.layout_digest, tp_rank=1, tp_size=2)
    assert codec.decode(blob, key(1, rank1)) is None


def test_a_forged_header_with_the_right_name_still_needs_the_checksum() -> None:
    """A payload swapped under a copied header is refused by the checksum, not the header."""
    blob = codec.encode(key(1), payload(1, 64))
    forged = blob[: len(blob) - 64] + payload(2, 64)
    assert codec.decode_or_reason(forged, key(1)) == "checksum mismatch"


@pytest.mark.parametrize("blob", [b"", b"PDKV", b"PDKV\x01\xff\xff\xff\xff", b"x" * 100])
def test_garbage_is_refused(blob: bytes) -> None:
    assert codec.decode(blob, key(1)) is None


def test_an_empty_payload_is_misuse() -> None:
    with pytest.raises(ValueError, match="empty payload"):
        codec.encode(key(1), b"")


def test_a_key_space_names_the_tp_slice() -> None:
    assert KeySpace(SPACE.layout_digest, 0, 2).namespace != SPACE.namespace
    with pytest.raises(ValueError, match="tp_rank"):
        KeySpace(SPACE.layout_digest, 2, 2)
