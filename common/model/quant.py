"""Weight-only quantized linear layers: weights stay int8 or int4 in memory and the matmul runs
through torch's own packed CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`).

A weight goes through two forms. `QuantizedWeight` is the plain one (integers, scales, zeros,
one row per output feature) that GGUF blocks and float weights convert to and that a
tensor-parallel rank slices; `QuantizedLinear` packs it for the kernel. The per-type choices
and the measurements behind them are in docs/quantization.md.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
import torch
from torch import nn

from pdserve.common.model.gguf import RawTensor

# The int4 kernel's group size: GGUF's 32-element blocks and Q4_K's sub-blocks map onto it.
INT4_GROUP = 32
# At this many rows and more, a bf16 (or fp16) input runs dequantize-then-matmul instead of the
# weight-only kernel, per width (docs/quantization.md: the weight-only kernels' time grows with
# each row; dequantizing costs a fixed amount per call, int4's twice int8's).
DENSE_ROWS: dict[int, int] = {8: 32, 4: 128}
# Output rows dequantized at once on the dense path: a bf16 chunk of 256 x 4096 stays in L2.
_DENSE_CHUNK = 256
# Rows packed or converted at once, so a tensor's int32 (or float32) temporary stays small.
_CONVERT_CHUNK = 256
# The CPU int4 packing groups output rows in blocks of this many (AVX512 builds).
_INT4_BLOCK = 64

Bits = Literal[4, 8]


@dataclasses.dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A weight [out, in] as integers: w[n, k] = scales[n, g] * values[n, k] for 8 bits
    (symmetric, g = 0: one scale per output row), and scales[n, g] * (values[n, k] - 8) +
    zeros[n, g] for 4 bits (values 0..15, g = k // group_size). float32 scales keep a GGUF
    block's f16 scale exactly; the layer stores them in its own dtype."""

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
        w = self.values.float().view(self.out_features, -1, g) - 8
        return (w * self.scales[..., None] + self.zeros[..., None]).view(self.values.shape)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """Rows (dim 0) or columns (dim 1) [start, start + length); columns must fall on
        group boundaries (ValueError otherwise)."""
        if dim == 0:
            zeros = None if self.zeros is None else self.zeros[start : start + length]
            return dataclasses.replace(
                self,
                values=self.values[start : start + length].clone(),
                scales=self.scales[start : start + length].clone(),
                zeros=None if zeros is None else zeros.clone(),
            )
        if dim != 1:
            raise ValueError(f"a linear weight has dims 0 and 1, not {dim}")
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


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 with one scale per output row (what `_weight_int8pack_mm` takes)."""
    values = torch.empty(weight.shape, dtype=torch.int8)
    scales = torch.empty(weight.shape[0], 1)
    for start in range(0, weight.shape[0], _CONVERT_CHUNK):
        rows = weight[start : start + _CONVERT_CHUNK].float()
        scale = rows.abs().amax(dim=1, keepdim=True) / 127
        scales[start : start + _CONVERT_CHUNK] = scale
        values[start : start + _CONVERT_CHUNK] = (
            (rows / scale.clamp(min=1e-30)).round().to(torch.int8)
        )
    return QuantizedWeight(8, values, scales, None, None)


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP) -> QuantizedWeight:
    """Asymmetric int4 per group of `group_size` input columns: each group's min..max onto
    0..15."""
    out, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"in_features {cols} is not a multiple of the group size {group_size}")
    w = weight.float().view(out, cols // group_size, group_size)
    low, high = w.amin(dim=2), w.amax(dim=2)
    scales = (high - low) / 15
    step = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = ((w - low[..., None]) / step[..., None]).round().clamp(0, 15).to(torch.int8)
    return QuantizedWeight(4, values.view(out, cols), scales, low + 8 * scales, group_size)


def _pack_int4(values: torch.Tensor) -> torch.Tensor:
    """The CPU int4 kernel's packed form, converted a chunk of rows at a time: its packing
    works on whole blocks of rows, so chunks of a multiple of them concatenate (a test checks
    it), and the int32 input it needs never spans the whole tensor. Written into one tensor:
    a list of chunks to concatenate left 3x the result resident (the heap fragments)."""
    out, cols = values.shape
    packed = torch.empty(out, cols // 2, dtype=torch.uint8)
    for start in range(0, out, _CONVERT_CHUNK):
        chunk = values[start : start + _CONVERT_CHUNK].to(torch.int32)
        packed[start : start + len(chunk)] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            chunk, 1
        )
    return packed


def _unpack_int4_blocks(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """Packed rows (a multiple of 64) back to values as [blocks, in, 64]: the transposed weight
    of each block of 64 output rows. AVX512 builds store, per input column, 32 bytes whose low
    nibbles hold rows 0-31 and high nibbles rows 32-63 of the block; layers check this against
    their own values before they rely on it."""
    b = packed.view(-1, in_features, _INT4_BLOCK // 2)
    low, high = b & 15, b >> 4
    return torch.cat([low, high], dim=2)


def _int4_unpacks(packed: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether this torch build's packing is the layout `_unpack_int4_blocks` reads."""
    out, cols = values.shape
    if out % _INT4_BLOCK or packed.shape != (out, cols // 2):
        return False
    blocks = _unpack_int4_blocks(packed[:_INT4_BLOCK], cols)
    return torch.equal(blocks[0].T, values[:_INT4_BLOCK].to(torch.uint8))


class QuantizedLinear(nn.Module):
    """A drop-in for nn.Linear's forward whose weight stays int8 or int4: input [..., in] in
    bf16, fp16 or float32, output in the input's dtype. Scales (and zeros) are stored in
    `scale_dtype` and cast per call for another input dtype. A bf16/fp16 input of
    `dense_rows` rows or more (default: DENSE_ROWS for the width) is multiplied by the
    dequantized weight instead, a chunk of rows at a time; `dense=False` always takes the
    weight-only kernel. CPU only: CUDA's `_weight_int4pack_mm` packs differently and is not
    written yet."""

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None = None,
        scale_dtype: torch.dtype = torch.bfloat16,
        dense_rows: int | None = None,
        dense: bool = True,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bits, self.group_size = weight.bits, weight.group_size
        self.dense_rows = (dense_rows or DENSE_ROWS[weight.bits]) if dense else None
        if weight.bits == 8:
            self.register_buffer("qweight", weight.values)
            self.register_buffer("scales", weight.scales[:, 0].to(scale_dtype))
        else:
            self._check_int4(weight)
            packed = _pack_int4(weight.values)
            # The kernel takes [groups, out, 2]: (scale, zero) of every group of every row.
            sz = torch.stack([weight.scales, weight.zeros], dim=2).transpose(0, 1)
            self.register_buffer("qweight", packed)
            self.register_buffer("scales", sz.to(scale_dtype).contiguous())
            if not _int4_unpacks(packed, weight.values):
                self.dense_rows = None  # this build packs another way: kernel only
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @staticmethod
    def _check_int4(weight: QuantizedWeight) -> None:
        if weight.group_size not in (32, 64, 128, 256):
            raise ValueError(f"int4 group size {weight.group_size}: the kernel takes 32-256")
        if weight.out_features % 16:
            raise ValueError(f"int4 needs out_features a multiple of 16: {weight.out_features}")

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, mode: Literal["int8", "int4"]
    ) -> QuantizedLinear:
        """`--quantization int8|int4` on a float checkpoint's weight [out, in]."""
        if mode == "int8":
            return cls(quantize_int8(weight), bias)
        if mode == "int4":
            return cls(quantize_int4(weight), bias)
        raise ValueError(f"quantization mode must be int8 or int4, not {mode!r}")

    @classmethod
    def from_gguf(cls, raw: RawTensor, bias: torch.Tensor | None = None) -> QuantizedLinear:
        """A GGUF tensor's blocks, converted as `from_gguf_blocks` chooses per type."""
        return cls(from_gguf_blocks(raw), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise NotImplementedError("quantized linears run on CPU only (CUDA not written)")
        flat = x.reshape(-1, self.in_features).contiguous()  # the kernels need it
        dense = self.dense_rows is not None and flat.shape[0] >= self.dense_rows
        if dense and x.dtype in (torch.bfloat16, torch.float16):
            out = self._dense(flat)
        else:
            out = self._weight_only(flat)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def _weight_only(self, x: torch.Tensor) -> torch.Tensor:
        scales = self.scales.to(x.dtype)
        if self.bits == 8:
            return torch.ops.aten._weight_int8pack_mm(x, self.qweight, scales)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, self.group_size, scales)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """x @ dequantized weight.T, a chunk of output rows at a time (no whole bf16 copy)."""
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        for start in range(0, self.out_features, _DENSE_CHUNK):
            end = min(start + _DENSE_CHUNK, self.out_features)
            if self.bits == 8:
                w = self.qweight[start:end] * self.scales[start:end, None].to(x.dtype)
                out[:, start:end] = torch.nn.functional.linear(x, w)
            else:
                out[:, start:end] = self._dense_int4(x, start, end)
        return out

    def _dense_int4(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        blocks, groups = (end - start) // _INT4_BLOCK, self.in_features // self.group_size
        values = _unpack_int4_blocks(self.qweight[start:end], self.in_features)
        # [groups, rows, 2] -> [blocks, groups, 2, 64], contiguous: a strided broadcast
        # operand makes the elementwise ops below ten times slower.
        sz = self.scales[:, start:end].float().reshape(groups, blocks, _INT4_BLOCK, 2)
        sz = sz.permute(1, 0, 3, 2).contiguous()
        w = values.view(blocks, groups, self.group_size, _INT4_BLOCK).float()
        w.sub_(8).mul_(sz[:, :, 0:1]).add_(sz[:, :, 1:2])
        # Each block is [in, 64]: side by side they are the chunk's transposed weight.
        wt = torch.empty(self.in_features, blocks, _INT4_BLOCK, dtype=x.dtype)
        wt.copy_(w.view(blocks, self.in_features, _INT4_BLOCK).transpose(0, 1))
        return x @ wt.view(self.in_features, end - start)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, group_size={self.group_size}, bias={self.bias is not None}"
        )


# --- GGUF blocks -----------------------------------------------------------------------------


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


# type name -> (bytes per block, elements per block, decoder). "int4" decoders give the int4
# form exactly; "float" ones give float32, requantized to the type's target.
_INT4_EXACT = {"Q4_0": (18, 32, _q4_0), "Q4_1": (20, 32, _q4_1), "Q4_K": (144, 256, _q4_k)}
_FLOAT = {
    "Q8_0": (34, 32, _q8_0_float),
    "Q5_K": (176, 256, _q5_k_float),
    "Q6_K": (210, 256, _q6_k_float),
}
# Where a float type goes (measured in docs/quantization.md): all to int8 per row.
_FLOAT_TARGET: dict[str, Bits] = {"Q8_0": 8, "Q5_K": 8, "Q6_K": 8}
GGUF_TYPES = tuple(_INT4_EXACT) + tuple(_FLOAT)


def _row_blocks(raw: RawTensor, block_bytes: int, start: int) -> np.ndarray:
    rows = raw.blocks[start : start + _CONVERT_CHUNK]
    return rows.reshape(rows.shape[0], -1, block_bytes)


def _check(raw: RawTensor) -> str:
    name = raw.qtype_name
    if name not in GGUF_TYPES:
        raise ValueError(
            f"tensor {raw.name}: GGUF type {name} has no quantized form here; "
            f"supported: {', '.join(GGUF_TYPES)}"
        )
    if len(raw.shape) != 2:
        raise ValueError(f"tensor {raw.name}: a linear weight is 2-D, not {raw.shape}")
    block_bytes, per_block, _ = _FLOAT.get(name) or _INT4_EXACT[name]
    if raw.shape[1] % per_block or raw.blocks.shape != (
        raw.shape[0],
        raw.shape[1] // per_block * block_bytes,
    ):
        raise ValueError(
            f"tensor {raw.name}: {raw.blocks.shape} bytes are not {name} blocks of {raw.shape}"
        )
    return name


def gguf_dequantize(raw: RawTensor) -> torch.Tensor:
    """The tensor as float32 [out, in], decoded by this module (a test holds it to gguf's
    own dequantization)."""
    return _convert(raw, None).dequantize() if raw.qtype_name in _INT4_EXACT else _floats(raw)


def _floats(raw: RawTensor) -> torch.Tensor:
    block_bytes, _, decode = _FLOAT[_check(raw)]
    parts = [
        decode(_row_blocks(raw, block_bytes, start)).reshape(-1, raw.shape[1])
        for start in range(0, raw.shape[0], _CONVERT_CHUNK)
    ]
    return torch.from_numpy(np.concatenate(parts))


def from_gguf_blocks(raw: RawTensor, bits: Bits | None = None) -> QuantizedWeight:
    """A GGUF tensor's quantized form, `bits` (default: its type's choice, see _FLOAT_TARGET)
    or int4 for the types that map onto int4 exactly. Works a chunk of rows at a time: the
    peak beyond the result is one chunk's float32 (or int8) decode."""
    return _convert(raw, bits)


def _convert(raw: RawTensor, bits: Bits | None) -> QuantizedWeight:
    name = _check(raw)
    if name in _INT4_EXACT and bits in (None, 4):
        return _int4_exact(raw)
    target = bits or _FLOAT_TARGET[name]
    block_bytes, _, decode = _FLOAT.get(name) or _INT4_EXACT[name]
    quantize = quantize_int8 if target == 8 else quantize_int4
    out, cols = raw.shape
    result = None
    for start in range(0, out, _CONVERT_CHUNK):
        rows = _row_blocks(raw, block_bytes, start)
        floats = _int4_floats(*decode(rows)) if name in _INT4_EXACT else decode(rows)
        part = quantize(torch.from_numpy(floats.reshape(len(rows), cols)))
        result = result or _empty_like_rows(part, out)
        _write_rows(result, part, start)
    return result


def _empty_like_rows(part: QuantizedWeight, out: int) -> QuantizedWeight:
    """A weight of `out` rows shaped as `part`, filled by _write_rows (no list to concatenate:
    see _pack_int4)."""
    zeros = None if part.zeros is None else part.zeros.new_empty(out, part.zeros.shape[1])
    return dataclasses.replace(
        part,
        values=part.values.new_empty(out, part.values.shape[1]),
        scales=part.scales.new_empty(out, part.scales.shape[1]),
        zeros=zeros,
    )


def _write_rows(into: QuantizedWeight, part: QuantizedWeight, start: int) -> None:
    end = start + part.out_features
    into.values[start:end] = part.values
    into.scales[start:end] = part.scales
    if into.zeros is not None:
        into.zeros[start:end] = part.zeros


def _int4_floats(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    groups = scale.shape[:2] + (-1,)
    q = q.reshape(*groups, 32).astype(np.float32)
    return (q - 8) * scale.reshape(groups)[..., None] + zero.reshape(groups)[..., None]


def _int4_exact(raw: RawTensor) -> QuantizedWeight:
    block_bytes, _, decode = _INT4_EXACT[raw.qtype_name]
    out, cols = raw.shape
    values = torch.empty(out, cols, dtype=torch.int8)
    scales = torch.empty(out, cols // INT4_GROUP)
    zeros = torch.empty(out, cols // INT4_GROUP)
    for start in range(0, out, _CONVERT_CHUNK):
        q, scale, zero = decode(_row_blocks(raw, block_bytes, start))
        end = start + q.shape[0]
        values[start:end] = torch.from_numpy(q.reshape(end - start, cols).view(np.int8))
        scales[start:end] = torch.from_numpy(scale.reshape(end - start, -1))
        zeros[start:end] = torch.from_numpy(zero.reshape(end - start, -1))
    return QuantizedWeight(4, values, scales, zeros, INT4_GROUP)
