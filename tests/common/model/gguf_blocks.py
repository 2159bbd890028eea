"""GGUF blocks for tests: every type users download, from float weights where the `gguf`
library or a format's own packing here can quantize them (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 by the
library; Q4_K, Q5_K, Q6_K here), and as random blocks at a weight's scale for the rest (Q2_K,
Q3_K, IQ4_NL, IQ4_XS): what a test checks of those is the reading, against the library's own
dequantizer, not the encoding."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q

# Where each randomly built type keeps its f16 super-block scales (ggml-common.h): bytes at
# random there would be NaN, infinite or 65504 now and then.
_F16_FIELDS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)}
RANDOM_BLOCKS = tuple(_F16_FIELDS)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(*v.shape[:-1], -1)


def _k_scale_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins as Q4_K/Q5_K's 12 bytes (the format's own packing)."""
    lo = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    mid = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    top = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return np.concatenate([lo, mid, top], axis=-1).astype(np.uint8)


def encode_k(w: np.ndarray, qtype: Q) -> np.ndarray:
    """Q4_K, Q5_K or Q6_K blocks [rows, bytes] for w [rows, cols] (gguf cannot quantize them):
    per sub-block min..max (Q6_K: symmetric) on the type's levels, its scale on 6 bits (Q6_K:
    int8) under the super-block's f16 scale."""
    if qtype == Q.Q6_K:
        return _encode_q6_k(w)
    levels = 15 if qtype == Q.Q4_K else 31
    x = w.reshape(w.shape[0], -1, 8, 32).astype(np.float32)
    low = np.minimum(x.min(axis=-1), 0)
    scale, mins = (x.max(axis=-1) - low) / levels, -low
    d = (scale.max(axis=-1) / 63).astype(np.float16)
    dmin = (mins.max(axis=-1) / 63).astype(np.float16)
    # Rounded up, so that a sub-block's levels still span it.
    sc = np.clip(np.ceil(scale / np.maximum(d[..., None], 1e-8)), 0, 63).astype(np.uint8)
    m = np.clip(np.ceil(mins / np.maximum(dmin[..., None], 1e-8)), 0, 63).astype(np.uint8)
    step = np.maximum(d.astype(np.float32)[..., None] * sc, 1e-8)
    offset = dmin.astype(np.float32)[..., None] * m
    q = np.clip(np.round((x + offset[..., None]) / step[..., None]), 0, levels).astype(np.uint8)
    nib = (q & 15).reshape(*q.shape[:2], 4, 2, 32)
    parts = [_f16_bytes(d[..., None]), _f16_bytes(dmin[..., None]), _k_scale_bytes(sc, m)]
    if qtype == Q.Q5_K:
        bits = (q >> 4) << np.arange(8, dtype=np.uint8)[:, None]
        parts.append(bits.sum(axis=-2, dtype=np.uint8))
    parts.append((nib[..., 0, :] | (nib[..., 1, :] << 4)).reshape(*q.shape[:2], 128))
    return np.concatenate(parts, axis=-1).reshape(w.shape[0], -1)


def _encode_q6_k(w: np.ndarray) -> np.ndarray:
    x = w.reshape(w.shape[0], -1, 16, 16).astype(np.float32)
    scale = np.abs(x).max(axis=-1) / 31
    d = (scale.max(axis=-1) / 127).astype(np.float16)
    sc = np.clip(np.ceil(scale / np.maximum(d[..., None], 1e-8)), 0, 127).astype(np.int8)
    step = np.maximum(d.astype(np.float32)[..., None] * sc, 1e-8)
    q = (np.clip(np.round(x / step[..., None]), -32, 31) + 32).astype(np.uint8)
    # position 32i + l of each half of 128: nibble i // 2 of ql byte 32(i % 2) + l, bits 2i of
    # qh byte l
    q = q.reshape(*q.shape[:2], 2, 4, 32)
    low = q & 15
    ql = low[..., 0:2, :] | (low[..., 2:4, :] << 4)
    qh = ((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=-2, dtype=np.uint8)
    lead = q.shape[:2]
    parts = [ql.reshape(*lead, 128), qh.reshape(*lead, 64), sc.view(np.uint8), _f16_bytes(d)]
    return np.concatenate([p.reshape(*lead, -1) for p in parts], axis=-1).reshape(len(w), -1)


def encode(w: np.ndarray, qtype: Q) -> np.ndarray:
    """w [rows, cols] as `qtype`'s blocks [rows, bytes]."""
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return encode_k(w, qtype)
    if qtype in RANDOM_BLOCKS:
        return random_blocks(w, qtype)
    return quants.quantize(w, qtype)


def random_blocks(w: np.ndarray, qtype: Q, seed: int = 0) -> np.ndarray:
    """Blocks [rows, bytes] of `qtype` for w's shape, random bits under f16 scales chosen so
    that the values they decode to have w's standard deviation."""
    per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    shape = (w.shape[0], w.shape[1] // per_block, block_bytes)
    blocks = rng.integers(0, 256, shape, dtype=np.uint8)
    d = rng.uniform(0.5, 1.0, (*shape[:2], len(_F16_FIELDS[qtype])))
    _set_f16(blocks, qtype, d)
    # The values are linear in the scales (d and dmin together): one rescale gives w's spread.
    _set_f16(blocks, qtype, d * float(w.std()) / _decoded_std(blocks, qtype))
    return blocks.reshape(w.shape[0], -1)


def _set_f16(blocks: np.ndarray, qtype: Q, values: np.ndarray) -> None:
    for i, offset in enumerate(_F16_FIELDS[qtype]):
        blocks[..., offset : offset + 2] = _f16_bytes(values[..., i : i + 1])


def _decoded_std(blocks: np.ndarray, qtype: Q) -> float:
    return float(quants.dequantize(blocks.reshape(len(blocks), -1), qtype).std())
