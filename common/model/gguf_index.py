"""A GGUF file's tensor table, read from its header alone.

The quantized loader (gguf.read_raw_tensors) needs only where each tensor lies: its name, type,
shape, offset and size. gguf's own reader maps the whole file and parses every metadata field
into numpy arrays (two per string of the tokenizer's vocabulary and merges), and the pages it
touched stay resident until it goes: for SmolLM2's Q4_1 file (94 MiB) that was 168 MiB of peak
RSS above the process's start, the whole of the load's peak (scripts/quant_load.py). Here the
header is read through, the metadata skipped over but for `general.architecture` and
`general.alignment`; the layout is llama.cpp's GGUF v2/v3 (little-endian; lengths and counts
64-bit).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> their struct format (8 string, 9 array: variable length).
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lies in the file: shape in GGUF's order (fastest dimension first),
    offset from the file's start, and its bytes."""

    name: str
    qtype_name: str
    shape: tuple[int, ...]
    offset: int
    n_bytes: int


def tensor_index(path: Path) -> tuple[str | None, list[TensorInfo]]:
    """The file's general.architecture (None if it names none) and its tensors, in file order;
    ValueError for a file that is not GGUF v2/v3 or names an unknown tensor type."""
    with path.open("rb") as f:
        if f.read(4) != _MAGIC:
            raise ValueError(f"{path.name}: not a GGUF file")
        version, n_tensors, n_fields = struct.unpack("<IQQ", _read(f, 20))
        if version not in _VERSIONS:
            raise ValueError(f"{path.name}: GGUF version {version} (reads 2 and 3, little-endian)")
        wanted = {"general.architecture": None, "general.alignment": _DEFAULT_ALIGNMENT}
        for _ in range(n_fields):
            key = _string(f)
            value = _value(f, _u32(f), keep=key in wanted)
            if key in wanted:
                wanted[key] = value
        raw = [_tensor_header(f) for _ in range(n_tensors)]
        align = int(wanted["general.alignment"])
        start = -(-f.tell() // align) * align
    infos = [TensorInfo(n, t, s, start + o, _n_bytes(n, t, s)) for n, t, s, o in raw]
    return wanted["general.architecture"], infos


def _tensor_header(f: BinaryIO) -> tuple[str, str, tuple[int, ...], int]:
    name = _string(f)
    (dims,) = struct.unpack("<I", _read(f, 4))
    shape = struct.unpack(f"<{dims}Q", _read(f, 8 * dims))
    qtype, offset = struct.unpack("<IQ", _read(f, 12))
    return name, _type_name(name, qtype), tuple(int(d) for d in shape), offset


def _type_name(name: str, qtype: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        raise ValueError(f"tensor {name}: unknown GGUF tensor type {qtype}") from None


def _n_bytes(name: str, qtype_name: str, shape: tuple[int, ...]) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype_name]]
    values = 1
    for d in shape:
        values *= d
    if values % block:
        raise ValueError(f"tensor {name}: {values} values are not whole {qtype_name} blocks")
    return values // block * size


def _value(f: BinaryIO, kind: int, keep: bool) -> object:
    """Read (or skip, unless `keep`) one metadata value of type `kind`."""
    if kind in _FIXED:
        fmt = "<" + _FIXED[kind]
        return struct.unpack(fmt, _read(f, struct.calcsize(fmt)))[0]
    if kind == _STRING:
        return _string(f)
    if kind != _ARRAY:
        raise ValueError(f"unknown GGUF metadata type {kind}")
    item, count = struct.unpack("<IQ", _read(f, 12))
    if item in _FIXED:  # skipped whole: no array field is wanted
        f.seek(count * struct.calcsize(_FIXED[item]), 1)
        return None
    for _ in range(count):
        _value(f, item, keep=False)
    return None


def _string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", _read(f, 8))
    return _read(f, n).decode("utf-8", errors="replace")


def _u32(f: BinaryIO) -> int:
    return struct.unpack("<I", _read(f, 4))[0]


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError("GGUF header ends early")
    return data
