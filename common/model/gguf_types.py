"""GGUF's quantized blocks, the formats as llama.cpp's ggml-common.h lays them out: decoded a
chunk of rows at a time, to int4 exactly where a type is 4-bit affine per 32 values (Q4_0,
Q4_1, Q4_K), else to float32 (quant.py requantizes those to int8). Q8_0, Q5_K and Q6_K are
decoded here; the other types users download (Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS) by the
`gguf` library's own dequantizer, a chunk of rows at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class RawTensor:
    """A GGUF tensor as the file stores it: `blocks` is uint8 [rows, bytes per row] (a vector
    is one row), `shape` the HF orientation ([out, in] for a matrix) of the values those bytes
    encode."""

    name: str  # the HF parameter name (or the GGUF name when it maps to none)
    qtype_name: str  # gguf's GGMLQuantizationType name: "Q4_K", "F32", ...
    blocks: np.ndarray
    shape: tuple[int, ...]


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The f16 field at byte `offset` of every block, as float32 [..., blocks]."""
    return np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 2, n]: low nibbles then high nibbles of n bytes (GGUF's 4-bit order)."""
    return np.stack([qs & 15, qs >> 4], axis=-2)


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0 (d f16, 16 bytes of nibbles): w = d * (q - 8), the int4 form exactly."""
    d = _f16(b, 0).astype(np.float32)
    return _nibbles(b[..., 2:18]), d, np.zeros_like(d)


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 (d, m f16, 16 bytes): w = d * q + m = d * (q - 8) + (m + 8d)."""
    d, m = _f16(b, 0).astype(np.float32), _f16(b, 2).astype(np.float32)
    return _nibbles(b[..., 4:20]), d, m + 8 * d


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4 qh bytes as 32 bits, bit i of them column i's, shifted to 16."""
    bits = (qh[..., None] >> np.arange(8, dtype=np.uint8)) & 1
    return bits.reshape(*qh.shape[:-1], 32) << 4


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_0 (d f16, 4 bytes of fifth bits, 16 bytes of nibbles): w = d * (q - 16)."""
    d = _f16(b, 0).astype(np.float32)
    q = _nibbles(b[..., 6:22]).reshape(*b.shape[:-1], 32) | _fifth_bits(b[..., 2:6])
    return q, d, np.zeros_like(d)


def _q5_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_1 (d, m f16, 4 bytes of fifth bits, 16 bytes): w = d * q + m = d * (q - 16) +
    (m + 16d)."""
    d, m = _f16(b, 0).astype(np.float32), _f16(b, 2).astype(np.float32)
    q = _nibbles(b[..., 8:24]).reshape(*b.shape[:-1], 32) | _fifth_bits(b[..., 4:8])
    return q, d, m + 16 * d


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes as 8 six-bit scales and mins: sub-blocks 0-3 in the low six bits
    of bytes 0-3 (scales) and 4-7 (mins); 4-7 in bytes 8-11's nibbles, topped by the spare
    two bits of bytes 0-3 and 4-7."""
    low, mid, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = np.concatenate([low & 63, (top & 15) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([mid & 63, (top >> 4) | ((mid >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K (256: d, dmin, 12 scale bytes, 128 bytes of nibbles): sub-block j of 32 is
    d*sc_j*q - dmin*m_j; each 32 bytes hold two sub-blocks, low nibbles first."""
    d, dmin = _f16(b, 0).astype(np.float32), _f16(b, 2).astype(np.float32)
    sc, m = _k_scales(b[..., 4:16])
    q = _nibbles(b[..., 16:144].reshape(*b.shape[:-1], 4, 32))
    scale = d[..., None] * sc
    return q, scale, 8 * scale - dmin[..., None] * m


def _q8_0_float(b: np.ndarray) -> np.ndarray:
    """Q8_0 (d f16, 32 int8): w = d * q."""
    return _f16(b, 0).astype(np.float32)[..., None] * b[..., 2:34].view(np.int8)


def _q5_k_float(b: np.ndarray) -> np.ndarray:
    """Q5_K (256: d, dmin, 12 scale bytes, 32 bytes of fifth bits, 128 bytes of nibbles): as
    Q4_K, with bit j of each qh byte on top of sub-block j's nibble."""
    d, dmin = _f16(b, 0).astype(np.float32), _f16(b, 2).astype(np.float32)
    sc, m = _k_scales(b[..., 4:16])
    low = _nibbles(b[..., 48:176].reshape(*b.shape[:-1], 4, 32)).reshape(*b.shape[:-1], 8, 32)
    high = (b[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    q = (low | (high << 4)).astype(np.float32)
    return d[..., None, None] * sc[..., None] * q - dmin[..., None, None] * m[..., None]


def _q6_k_float(b: np.ndarray) -> np.ndarray:
    """Q6_K (256: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d f16):
    per half of 128, positions 32i + l take nibble (i // 2) of ql byte 32(i % 2) + l and bit
    pair i of qh byte l; w = d * scale[pos // 16] * (q - 32)."""
    lead = b.shape[:-1]
    # [half, byte group, nibble, 32] -> [half, nibble, byte group, 32]: i = 2 * nibble + group
    low = _nibbles(b[..., 0:128].reshape(*lead, 2, 2, 32)).swapaxes(-3, -2)
    low = low.reshape(*lead, 2, 4, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    high = (b[..., 128:192].reshape(*lead, 2, 1, 32) >> shifts) & 3
    q = (low | (high << 4)).astype(np.float32).reshape(*lead, 16, 16) - 32
    scales = b[..., 192:208].view(np.int8).astype(np.float32)
    return (_f16(b, 208).astype(np.float32)[..., None, None] * scales[..., None] * q).reshape(
        *lead, 256
    )


def _by_library(name: str) -> Callable[[np.ndarray], np.ndarray]:
    """A decoder through the gguf library's dequantizer (its numpy port of ggml's), for the
    types with none of ours: blocks [rows, blocks per row, bytes] -> float32 [rows, in]."""

    def decode(b: np.ndarray) -> np.ndarray:
        from gguf import GGMLQuantizationType, quants

        out = quants.dequantize(b.reshape(len(b), -1), GGMLQuantizationType[name])
        return out.astype(np.float32, copy=False)

    return decode


# type name -> (bytes per block, values per block, decoder). Q4_0, Q4_1 and Q4_K decode to
# int4 group 32 exactly: (q 0..15, scale, zero) with w = scale * (q - 8) + zero.
_INT4_DECODERS = {"Q4_0": (18, 32, _q4_0), "Q4_1": (20, 32, _q4_1), "Q4_K": (144, 256, _q4_k)}
_FLOAT_DECODERS = {
    "Q8_0": (34, 32, _q8_0_float),
    "Q5_K": (176, 256, _q5_k_float),
    "Q6_K": (210, 256, _q6_k_float),
    # llama.cpp's fallbacks where rows are not whole 256-value super-blocks (Q5_0, Q5_1),
    # its smallest K-quants and the non-linear 4-bit codebooks.
    **{
        name: (block_bytes, per_block, _by_library(name))
        for name, block_bytes, per_block in (
            ("Q5_0", 22, 32),
            ("Q5_1", 24, 32),
            ("Q2_K", 84, 256),
            ("Q3_K", 110, 256),
            ("IQ4_NL", 18, 32),
            ("IQ4_XS", 136, 256),
        )
    },
}
# Q5_0 and Q5_1 decode to 5 bits exactly: (q 0..31, scale, zero), w = scale * (q - 16) + zero.
_INT5_DECODERS = {"Q5_0": (22, 32, _q5_0), "Q5_1": (24, 32, _q5_1)}
INT4_EXACT_TYPES = tuple(_INT4_DECODERS)
INT5_EXACT_TYPES = tuple(_INT5_DECODERS)
QUANTIZED_TYPES = INT4_EXACT_TYPES + tuple(_FLOAT_DECODERS)


def check_blocks(raw: RawTensor) -> str:
    """The tensor's type name; ValueError when it is not a 2-D tensor of a type decoded here
    or its bytes are not that type's blocks."""
    name = raw.qtype_name
    if name not in QUANTIZED_TYPES:
        raise ValueError(
            f"tensor {raw.name}: GGUF type {name} has no quantized form here; "
            f"supported: {', '.join(QUANTIZED_TYPES)}"
        )
    if len(raw.shape) != 2:
        raise ValueError(f"tensor {raw.name}: a linear weight is 2-D, not {raw.shape}")
    block_bytes, per_block, _ = _decoder(name)
    row_bytes = raw.shape[1] // per_block * block_bytes
    if raw.shape[1] % per_block or raw.blocks.shape != (raw.shape[0], row_bytes):
        raise ValueError(
            f"tensor {raw.name}: {raw.blocks.shape} bytes are not {name} blocks of {raw.shape}"
        )
    return name


def _decoder(name: str) -> tuple[int, int, Callable]:
    return _INT4_DECODERS.get(name) or _FLOAT_DECODERS[name]


def _row_chunks(raw: RawTensor, rows: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, blocks [rows, blocks per row, bytes per block]) `rows` rows at a time."""
    block_bytes = _decoder(check_blocks(raw))[0]
    for start in range(0, raw.shape[0], rows):
        chunk = raw.blocks[start : start + rows]
        yield start, chunk.reshape(len(chunk), -1, block_bytes)


def int4_rows(
    raw: RawTensor, rows: int
) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """(first row, q uint8 [rows, in], scale, zero float32 [rows, in / 32]) of a Q4_0, Q4_1 or
    Q4_K tensor (w = scale * (q - 8) + zero), or of a Q5_0 or Q5_1 one (q 0..31, w = scale *
    (q - 16) + zero), `rows` rows at a time."""
    name = check_blocks(raw)
    decode = (_INT4_DECODERS.get(name) or _INT5_DECODERS[name])[2]
    for start, blocks in _row_chunks(raw, rows):
        q, scale, zero = decode(blocks)
        n = len(blocks)
        yield start, q.reshape(n, -1), scale.reshape(n, -1), zero.reshape(n, -1)


def float_rows(raw: RawTensor, rows: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, float32 [rows, in]) of a tensor of any type in QUANTIZED_TYPES."""
    name = check_blocks(raw)
    if name in _INT4_DECODERS:
        for start, q, scale, zero in int4_rows(raw, rows):
            groups = (*scale.shape, 32)
            w = (q.reshape(groups).astype(np.float32) - 8) * scale[..., None] + zero[..., None]
            yield start, w.reshape(len(q), -1)
        return
    for start, blocks in _row_chunks(raw, rows):
        yield start, _FLOAT_DECODERS[name][2](blocks).reshape(len(blocks), -1)
