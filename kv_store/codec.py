"""A stored block's bytes: a header naming the block, its layout and its checksum, then the
payload. `decode` hands back the payload only when every field matches what the reader asked
for and the checksum holds; anything else (another block, another layout, a truncated or
corrupted object, garbage) is a reason string, never an exception or a partial payload.

    MAGIC (4) | VERSION (1) | header length (4, little endian) | msgpack header | payload

The checksum is the KV transfer's (`pdserve-rowcol64/1`, `kv_transfer/wire.py`): the same
function, so a block verified on the wire and one verified from a store mean the same thing.
"""

from __future__ import annotations

import struct

import msgpack
import torch

from pdserve.kv_store.key import BlockKey
from pdserve.kv_transfer.wire import CHECKSUM_SCHEME, page_checksum, resolve

MAGIC = b"PDKV"
VERSION = 1
_PREFIX = struct.Struct("<4sBI")
_MAX_HEADER = 4096  # a header is ~250 bytes; a larger length field means garbage


def checksum(payload: bytes | bytearray | memoryview) -> int:
    """The transfer checksum of raw bytes, as one 64-bit int."""
    view = memoryview(payload)
    if view.readonly:  # torch.frombuffer warns on (and would alias) read-only memory
        view = memoryview(bytearray(view))
    return resolve(page_checksum(torch.frombuffer(view, dtype=torch.uint8)))


def _header(key: BlockKey, length: int, check: int) -> dict[str, object]:
    return {
        "name": key.name,
        "layout": key.space.layout_digest,
        "tp": [key.space.tp_rank, key.space.tp_size],
        "length": length,
        "checksum": check,
        "scheme": CHECKSUM_SCHEME,
    }


def encode(key: BlockKey, payload: bytes | bytearray | memoryview) -> bytes:
    """The object to store for `key`; ValueError on an empty payload (no block is empty)."""
    view = memoryview(payload).cast("B")
    if not view.nbytes:
        raise ValueError(f"block {key.name}: an empty payload is never a block")
    header = msgpack.packb(_header(key, view.nbytes, checksum(view)))
    return b"".join((_PREFIX.pack(MAGIC, VERSION, len(header)), header, view))


def decode_or_reason(blob: bytes | bytearray | memoryview, key: BlockKey) -> memoryview | str:
    """The payload of `blob` if it is `key`'s whole, intact object; else why not."""
    view = memoryview(blob).cast("B")
    if view.nbytes < _PREFIX.size:
        return "truncated before the header"
    magic, version, n_header = _PREFIX.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        return f"not a version {VERSION} block (magic {bytes(magic)!r}, version {version})"
    if n_header > _MAX_HEADER or view.nbytes < _PREFIX.size + n_header:
        return "truncated or garbled header"
    try:
        header = msgpack.unpackb(view[_PREFIX.size : _PREFIX.size + n_header])
    except (ValueError, msgpack.UnpackException) as e:
        return f"unreadable header ({e})"
    payload = view[_PREFIX.size + n_header :]
    return _check(header, payload, key)


def _check(header: object, payload: memoryview, key: BlockKey) -> memoryview | str:
    if not isinstance(header, dict) or header.get("scheme") != CHECKSUM_SCHEME:
        return "header without this checksum scheme"
    if header.get("layout") != key.space.layout_digest:
        return f"another KV layout ({header.get('layout')!r})"
    expected = _header(key, payload.nbytes, header.get("checksum"))  # type: ignore[arg-type]
    for field in ("name", "tp", "length"):
        if header.get(field) != expected[field]:
            return f"{field} {header.get(field)!r} != {expected[field]!r}"
    if payload.nbytes == 0 or checksum(payload) != header.get("checksum"):
        return "checksum mismatch"
    return payload


def decode(blob: bytes | bytearray | memoryview, key: BlockKey) -> memoryview | None:
    """The payload of `key`'s object, or None on any mismatch, truncation or corruption."""
    out = decode_or_reason(blob, key)
    return out if isinstance(out, memoryview) else None
