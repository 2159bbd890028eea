"""Quantized weights in their plain form, before a layer packs them for its kernel:
`QuantizedWeight` (integers, scales, zeros, one row per output feature), what float weights
(`quantize_int8`, `quantize_int4`) and GGUF blocks (`from_gguf_blocks`) convert to and what a
tensor-parallel rank slices. Conversions work a chunk of rows at a time, so that a load's
transients stay one chunk's size. The layers that hold these weights (and the AVX2 kernel's
packs) are in quant.py; the per-type choices and their measurements in docs/quantization.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Literal

import numpy as np
import torch

from pdserve.common.model.gguf_types import (
    INT4_EXACT_TYPES,
    INT5_EXACT_TYPES,
    QUANTIZED_TYPES,
    RawTensor,
    check_blocks,
    float_rows,
    int4_rows,
)
from pdserve.kernels import cpu_quant

# The int4 kernel's group size: GGUF's 32-element blocks and Q4_K's sub-blocks map onto it.
INT4_GROUP = 32
# Rows packed or converted at once, so a tensor's int32 (or float32) temporary stays small.
CONVERT_CHUNK = 64  # 256 rows of a 2304-wide float32 chunk came to a tenth of a small model

Bits = Literal[4, 5, 8]
# What a 4- or 5-bit value is offset by: w = scale * (v - offset) + zero.
_OFFSET = {4: 8, 5: 16}


@dataclasses.dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A weight [out, in] as integers: w[n, k] = scales[n, g] * values[n, k] for 8 bits
    (symmetric, g = 0: one scale per output row), and scales[n, g] * (values[n, k] - 8) +
    zeros[n, g] for 4 bits (values 0..15, g = k // group_size); 5 bits (GGUF's Q5_0/Q5_1,
    group 32) the same with values 0..31 and 16. float32 scales keep a GGUF block's f16 scale
    exactly; the layer stores them in its own dtype."""

    bits: Bits
    values: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # float32 [out, groups]
    zeros: torch.Tensor | None  # float32 [out, groups]; None for 8 bits
    group_size: int | None  # None: one group per row

    def __post_init__(self) -> None:
        assert self.values.dtype == torch.int8 and self.values.dim() == 2, self.values.dtype
        assert (self.bits == 8) == (self.zeros is None) == (self.group_size is None), self.bits
        groups = 1 if self.group_size is None else self.values.shape[1] // self.group_size
        assert self.scales.shape == (self.values.shape[0], groups), self.scales.shape

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    @property
    def in_features(self) -> int:
        return self.values.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these integers stand for."""
        if self.zeros is None:
            return self.values.float() * self.scales
        g = self.group_size
        w = self.values.float().view(self.out_features, -1, g) - _OFFSET[self.bits]
        return (w * self.scales[..., None] + self.zeros[..., None]).view(self.values.shape)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """Rows (dim 0) or columns (dim 1) [start, start + length); columns must fall on
        group boundaries (ValueError otherwise)."""
        size = self.values.shape[dim] if dim in (0, 1) else 0
        if dim not in (0, 1) or start < 0 or length <= 0 or start + length > size:
            raise ValueError(f"no [{start}, {start + length}) along dim {dim} of {size}")
        if dim == 0:
            zeros = None if self.zeros is None else self.zeros[start : start + length]
            return dataclasses.replace(
                self,
                values=self.values[start : start + length].clone(),
                scales=self.scales[start : start + length].clone(),
                zeros=None if zeros is None else zeros.clone(),
            )
        values = self.values[:, start : start + length].clone()
        if self.group_size is None:  # one scale per row: any columns keep it
            return dataclasses.replace(self, values=values)
        g = self.group_size
        if start % g or length % g:
            raise ValueError(
                f"columns [{start}, {start + length}) are not aligned to the group size {g}"
            )
        groups = slice(start // g, (start + length) // g)
        return dataclasses.replace(
            self,
            values=values,
            scales=self.scales[:, groups].clone(),
            zeros=self.zeros[:, groups].clone(),
        )

    def shard(self, dim: int, index: int, count: int) -> QuantizedWeight:
        """Tensor-parallel rank `index` of `count`'s even slice: output rows (dim 0, a
        column-parallel linear) or input columns (dim 1, a row-parallel linear)."""
        size = self.values.shape[dim] if dim in (0, 1) else 0
        if not 0 <= index < count or size % count:
            raise ValueError(f"cannot split {size} along dim {dim} into {count} (rank {index})")
        return self.narrow(dim, index * (size // count), size // count)


def stack_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight whose rows are the given ones' (fused q/k/v or gate/up projections); each
    row keeps its own scales, so this is exact."""
    first = weights[0]
    if any(
        (w.bits, w.group_size, w.in_features) != (first.bits, first.group_size, first.in_features)
        for w in weights
    ):
        raise ValueError("stacked weights need one width, group size and in_features")
    return dataclasses.replace(
        first,
        values=torch.cat([w.values for w in weights]),
        scales=torch.cat([w.scales for w in weights]),
        zeros=None if first.zeros is None else torch.cat([w.zeros for w in weights]),
    )


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 with one scale per output row (what `_weight_int8pack_mm` takes)."""
    return _by_rows(weight, _int8_rows)


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP) -> QuantizedWeight:
    """Asymmetric int4 per group of `group_size` input columns: each group's min..max onto
    0..15."""
    if weight.shape[1] % group_size:
        raise ValueError(
            f"in_features {weight.shape[1]} is not a multiple of the group size {group_size}"
        )
    return _by_rows(weight, lambda rows: _int4_group_rows(rows, group_size))


def _by_rows(
    weight: torch.Tensor, quantize: Callable[[torch.Tensor], QuantizedWeight]
) -> QuantizedWeight:
    """`quantize` over chunks of rows, so that only one chunk is ever float32."""
    chunks = range(0, weight.shape[0], CONVERT_CHUNK)
    parts = ((s, quantize(weight[s : s + CONVERT_CHUNK].float())) for s in chunks)
    return _gather_rows(parts, weight.shape[0])


def _gather_rows(parts: Iterable[tuple[int, QuantizedWeight]], out: int) -> QuantizedWeight:
    """Chunks of rows (first row, weight) written into one weight of `out` rows, allocated
    once: a list of chunks to concatenate left 3x the result resident (the heap fragments)."""
    result = None
    for start, part in parts:
        result = result or _empty_like_rows(part, out)
        end = start + part.out_features
        result.values[start:end] = part.values
        result.scales[start:end] = part.scales
        if result.zeros is not None:
            result.zeros[start:end] = part.zeros
    assert result is not None, "a weight has rows"
    return result


def _int8_rows(w: torch.Tensor) -> QuantizedWeight:
    scales = w.abs().amax(dim=1, keepdim=True) / 127
    values = (w / scales.clamp(min=1e-30)).round().to(torch.int8)
    return QuantizedWeight(8, values, scales, None, None)


def _int4_group_rows(w: torch.Tensor, group_size: int = INT4_GROUP) -> QuantizedWeight:
    groups = w.reshape(w.shape[0], -1, group_size)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scales = (high - low) / 15
    step = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = ((groups - low[..., None]) / step[..., None]).round().clamp(0, 15).to(torch.int8)
    return QuantizedWeight(4, values.view(w.shape), scales, low + 8 * scales, group_size)


# --- GGUF blocks ---------------------------------------------------------------------------


def gguf_bits(qtype_name: str) -> Bits | None:
    """The width a GGUF type is held at unless asked otherwise (None: a type with no quantized
    form here, such as F16 or F32, which stays float): int4 where it holds the type exactly,
    int5 for Q5_0/Q5_1 exactly where the AVX2 kernel runs (int8 would hold their 5.5-6 bits in
    8), int8 per row for every other (docs/quantization.md: int4 group 32 would double Q5_K's
    error; int8 per row adds a fifth of it)."""
    if qtype_name in INT4_EXACT_TYPES:
        return 4
    if qtype_name in INT5_EXACT_TYPES and cpu_quant.available():
        return 5
    return 8 if qtype_name in QUANTIZED_TYPES else None


def from_gguf_blocks(raw: RawTensor, bits: Bits | None = None) -> QuantizedWeight:
    """A GGUF tensor's quantized form: int4 group 32 exactly for Q4_0, Q4_1 and Q4_K, int5 for
    Q5_0 and Q5_1 (`gguf_bits`), int8 per row (requantized) for every other type, unless
    `bits` asks for int8 or int4 (int5 is only a Q5 type's own). Works a chunk of rows at a
    time: the peak beyond the result is one chunk's decode."""
    name = check_blocks(raw)
    own = gguf_bits(name)
    if bits == 5 and name not in INT5_EXACT_TYPES:
        raise ValueError(f"tensor {raw.name}: only Q5_0/Q5_1 are held as int5, not {name}")
    if own in (4, 5) and bits in (None, own):
        return _int_exact(raw, own)
    quantize = _int8_rows if (bits or gguf_bits(name)) == 8 else _int4_group_rows
    parts = ((s, quantize(torch.from_numpy(w))) for s, w in float_rows(raw, CONVERT_CHUNK))
    return _gather_rows(parts, raw.shape[0])


def _empty_like_rows(part: QuantizedWeight, out: int) -> QuantizedWeight:
    zeros = None if part.zeros is None else part.zeros.new_empty(out, part.zeros.shape[1])
    return dataclasses.replace(
        part,
        values=part.values.new_empty(out, part.values.shape[1]),
        scales=part.scales.new_empty(out, part.scales.shape[1]),
        zeros=zeros,
    )


def _int_exact(raw: RawTensor, bits: Bits) -> QuantizedWeight:
    return _gather_rows(exact_rows(raw, bits), raw.shape[0])


def exact_rows(raw: RawTensor, bits: Bits) -> Iterator[tuple[int, QuantizedWeight]]:
    """(first row, weight) of a Q4_x (bits 4) or Q5_x (bits 5) tensor, a chunk at a time."""
    for start, q, scale, zero in int4_rows(raw, CONVERT_CHUNK):
        values = torch.from_numpy(q.view(np.int8))
        yield start, QuantizedWeight(bits, values, *map(torch.from_numpy, (scale, zero)), 32)
