"""Weight-only quantized linear layers: weights stay int8 or int4 in memory and the matmul runs
through torch's own packed CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`),
or, on AVX2 CPUs, through kernels/cpu_quant.py's GEMV (6-40x faster than torch's there on
float32 rows; integer dot products on AVX512-VNNI, a GEMM from 4 rows), which holds int4 in a
layout of its own instead of torch's.

A weight goes through two forms. `QuantizedWeight` is the plain one (integers, scales, zeros,
one row per output feature) that GGUF blocks and float weights convert to and that a
tensor-parallel rank slices (quant_weight.py, its names re-exported here); `QuantizedLinear`
packs it for the kernel. The per-type choices
and the measurements behind them are in docs/quantization.md.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from pdserve.common.model.gguf_types import RawTensor, check_blocks
from pdserve.common.model.quant_weight import CONVERT_CHUNK as _CONVERT_CHUNK
from pdserve.common.model.quant_weight import INT4_GROUP, exact_rows
from pdserve.common.model.quant_weight import Bits as Bits
from pdserve.common.model.quant_weight import QuantizedWeight as QuantizedWeight
from pdserve.common.model.quant_weight import from_gguf_blocks as from_gguf_blocks
from pdserve.common.model.quant_weight import gguf_bits as gguf_bits
from pdserve.common.model.quant_weight import quantize_int4 as quantize_int4
from pdserve.common.model.quant_weight import quantize_int8 as quantize_int8
from pdserve.common.model.quant_weight import stack_rows as stack_rows
from pdserve.kernels import cpu_quant

# At this many rows and more, a bf16 (or fp16) input runs dequantize-then-matmul instead of the
# weight-only kernel, per width (docs/quantization.md: the weight-only kernels' time grows with
# each row; dequantizing costs a fixed amount per call, int4's several times int8's).
DENSE_ROWS: dict[int, int] = {8: 16, 4: 128, 5: 128}
# A float32 input's thresholds: on float32 rows the kernels are many times slower (a 1536x576
# int4 layer at one thread: 1.5 ms a row, where the dense path takes 1.0 ms for one row and
# 1.8 ms for 37; int8 0.75 ms a row against 0.2 ms for one).
DENSE_ROWS_FLOAT32: dict[int, int] = {8: 1, 4: 2, 5: 2}
# Rows an int4/int5 layer in the AVX2 kernel's layout serves through it (on the AVX2 path),
# before dequantize-then-matmul: on the AMX machine (1 thread, SmolLM2's 1536x576 and
# 576x1536, bf16 rows) 16 rows took 0.69 ms through it against 1.9 dense, 32 rows 1.33 against
# 1.99, 64 rows 2.69 against 2.01 (float32 rows alike); a batch-16 decode step had dequantized
# every layer's whole weight in every step.
GEMV_ROWS = 32
# The int8 kernel works 4 rows at a time: on SmolLM2's 49152-row tied head 5 rows cost what 8
# do (11.2 ms), the dense path 9.8 ms, bf16's matmul 8.4 ms; 4 rows 6.1 ms against 8.4.
_HEAD_DENSE_ROWS = 5
# Output rows dequantized at once on the dense path: a bf16 chunk of 256 x 4096 stays in L2.
_DENSE_CHUNK = 256
_DENSE_CHUNK_INT8 = 1024  # int8's: 1.6x faster than 256 rows at a time on SmolLM2's head
# The CPU int4 packing groups output rows in blocks of this many (AVX512 builds).
_INT4_BLOCK = 64

Pack = cpu_quant.Int4Pack | cpu_quant.Int5Pack  # a weight already in the AVX2 kernel's layout


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
    `scale_dtype` and cast per call for another input dtype. An input of `dense_rows` rows
    or more (default: DENSE_ROWS for the width; a float32 input's DENSE_ROWS_FLOAT32 when
    fewer) is multiplied by the dequantized weight instead, a chunk of rows at a time (on
    float32 activations the packed kernels are slow: 50 s for a 512-token prompt of SmolLM2
    at int4 against 1.9 s dequantized); `dense=False` always takes the weight-only kernel.
    CPU only: CUDA's `_weight_int4pack_mm` packs differently and is not written yet."""

    def __init__(
        self,
        weight: QuantizedWeight | Pack,
        bias: torch.Tensor | None = None,
        scale_dtype: torch.dtype = torch.bfloat16,
        dense_rows: int | None = None,
        dense: bool = True,
    ) -> None:
        super().__init__()
        self.bits, self.out_features, self.in_features, self.group_size = _form(weight)
        self.dense_rows = (dense_rows or DENSE_ROWS[self.bits]) if dense else None
        # From this many rows an int8 layer's bf16 input keeps its precision (dequantize-then-
        # matmul) instead of the VNNI GEMM's int8 activations (`quantized_head` clears it).
        self.exact_rows = self.dense_rows if self.bits == 8 else None
        # The AVX2 kernel (kernels/cpu_quant.py) serves float32 rows, and int4/int5 rows of
        # any dtype once the weight is held in its layout (torch's int4 packing is not kept).
        self.gemv = cpu_quant.available()
        # VNNI's int8 activations for a bf16/fp16 engine's layers (scales in bf16), AVX2's
        # exact sums for a float32 one's; a plain bool: a traced graph reads it.
        self.vnni = self.gemv and cpu_quant.uses_vnni(scale_dtype)
        self.register_buffer("mins", None)  # int4/int5 in the AVX2 kernel's layout only
        self.tiled = False  # int4 (`_hold`) or int8 in the VNNI GEMM's tile order
        self.register_buffer("qhigh", None)  # int5's fifth bits
        if self.bits == 5 or (self.bits == 4 and self.gemv):
            self._hold(weight if isinstance(weight, Pack) else self.pack_for_gemv(weight))
        elif isinstance(weight, Pack):
            raise ValueError("a weight in the AVX2 kernel's layout needs that kernel")
        elif self.bits == 8:
            # On the VNNI path in its GEMM's tile order (unsigned), so that no call transposes
            # it; K off 32 runs AVX2's (docs/quantization.md, "bf16 rows in and out, and int8
            # weights in tile order").
            self.tiled = self.vnni and self.in_features % cpu_quant.BLOCK == 0
            values = cpu_quant.tile_int8(weight.values) if self.tiled else weight.values
            self.register_buffer("qweight", values)
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
    def pack_for_gemv(weight: QuantizedWeight) -> Pack:
        """An int4 or int5 weight in the AVX2 kernel's layout."""
        if weight.bits == 5:
            return cpu_quant.pack_int5(weight.values, weight.scales, weight.zeros)
        QuantizedLinear._check_int4(weight)
        return cpu_quant.pack_int4(weight.values, weight.scales, weight.zeros, weight.group_size)

    def _hold(self, pack: Pack) -> None:
        """The AVX2 kernel's layout as the layer's buffers: int4's float32 scales and minimums
        (the kernel reads them so), int5's f16 ones (the file's own) and its bit plane."""
        if not self.gemv:
            raise ValueError(f"int{self.bits} in this layout needs the AVX2 kernel (cpu_quant)")
        if self.bits == 4 and self.out_features % 16:
            raise ValueError(f"int4 needs out_features a multiple of 16: {self.out_features}")
        # int4 on the VNNI path is held in its GEMM's tile order (the same bytes permuted):
        # no call transposes it (docs/quantization.md, "Int4 weights in tile order").
        self.tiled = self.bits == 4 and self.vnni
        if self.tiled:
            pack = cpu_quant.tile_int4(pack)
        self.register_buffer("qweight", pack.nibbles)
        self.register_buffer("scales", pack.scales)
        self.register_buffer("mins", pack.mins)
        if isinstance(pack, cpu_quant.Int5Pack):
            self.register_buffer("qhigh", pack.high)

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

    @classmethod
    def stacked(cls, layers: Sequence[QuantizedLinear]) -> QuantizedLinear | None:
        """One layer whose output is the given ones' side by side (fused q/k/v, gate/up), or
        None when they cannot join: the packed rows and scales are concatenated as they are,
        which holds for int4 when each part is whole blocks of 64 rows (the packing's unit),
        so every output row is computed as before, in one kernel call instead of several."""
        first = layers[0]
        same = (first.bits, first.group_size, first.in_features, first.scales.dtype)
        if any((m.bits, m.group_size, m.in_features, m.scales.dtype) != same for m in layers):
            return None
        if any((m.mins is None) != (first.mins is None) for m in layers):
            return None
        if any(m.tiled != first.tiled for m in layers):  # whole tiles (16 rows) concatenate
            return None
        if first.tiled and any(m.out_features % cpu_quant.TILE for m in layers):
            return None  # a short last tile's padding would sit inside the joined weight
        torch_int4 = first.bits == 4 and first.mins is None
        if torch_int4 and any(m.out_features % _INT4_BLOCK for m in layers):
            return None
        if any((m.bias is None) != (first.bias is None) for m in layers):
            return None
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.in_features, fused.bits, fused.group_size = (
            first.in_features,
            first.bits,
            first.group_size,
        )
        fused.out_features = sum(m.out_features for m in layers)
        dense = [m.dense_rows for m in layers]
        fused.dense_rows = None if None in dense else max(dense)
        fused.gemv, fused.vnni, fused.tiled = first.gemv, first.vnni, first.tiled
        exact = [m.exact_rows for m in layers]
        fused.exact_rows = None if None in exact else max(exact)
        rows = 1 if torch_int4 else 0  # torch's int4 scales are [groups, out, 2]
        fused.register_buffer("qweight", torch.cat([m.qweight for m in layers]))
        fused.register_buffer("scales", torch.cat([m.scales for m in layers], dim=rows))
        mins = None if first.mins is None else torch.cat([m.mins for m in layers])
        fused.register_buffer("mins", mins)
        high = None if first.qhigh is None else torch.cat([m.qhigh for m in layers])
        fused.register_buffer("qhigh", high)
        bias = None if first.bias is None else torch.cat([m.bias for m in layers])
        fused.register_buffer("bias", bias)
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise NotImplementedError("quantized linears run on CPU only (CUDA not written)")
        flat = x.reshape(-1, self.in_features).contiguous()  # the kernels need it
        if self._takes_dense(flat):
            out = self._dense(flat)
        else:
            out = self._weight_only(flat)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        # A batch-1 decode step makes 120 of these calls: each dispatch skipped is ~1.5 us.
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def _takes_gemv(self, x: torch.Tensor) -> bool:
        # A bf16 engine's int8 layers too, below their dense rows (the tied head above all):
        # the same sums as `_weight_int8pack_mm`'s in 0.37-0.5x of its time at 1-8 rows of
        # SmolLM2's 49152 x 576 head on AVX512 (docs/quantization.md).
        return self.gemv and (self.mins is not None or self.bits == 8 or x.dtype == torch.float32)

    def _takes_gemm(self, x: torch.Tensor) -> bool:
        """Whether the VNNI path takes every row count (its GEMM from 4 rows, one op in a traced
        graph too): 2.5-3x the GEMV's rate at 16 rows and about 2x dequantize-then-matmul's at
        128-512 (docs/quantization.md, "The VNNI GEMM"); a K off a multiple of 32 is AVX2's.
        Not from `exact_rows` on: a prefill chunk through int8 weights requantized per row
        (`--quantization int8`) with its activations rounded to int8 per 32 columns flipped the
        demo's near-tie first token (SmolLM2, "What is the capital of France?", 37 rows: a
        French reply without Paris); its bf16 rows answer Paris."""
        if self.exact_rows is not None and x.shape[0] >= self.exact_rows:
            return False
        return self.vnni and self._takes_gemv(x) and self.in_features % cpu_quant.BLOCK == 0

    def _takes_dense(self, x: torch.Tensor) -> bool:
        """Whether `x`'s rows go dequantize-then-matmul: past the AVX2 kernel's rows where it
        serves them, else from the width's (and dtype's) threshold on."""
        dense = self.dense_rows
        if dense is None or self._takes_gemm(x):
            return False
        if self._takes_gemv(x) and (self.mins is not None or x.dtype == torch.float32):
            return x.shape[0] > (GEMV_ROWS if self.mins is not None else cpu_quant.MAX_ROWS)
        if x.dtype == torch.float32:
            dense = min(dense, DENSE_ROWS_FLOAT32[self.bits])
        return x.shape[0] >= dense

    def _weight_only(self, x: torch.Tensor) -> torch.Tensor:
        if self._takes_gemv(x):
            return self._gemv(x)
        scales = self.scales if self.scales.dtype == x.dtype else self.scales.to(x.dtype)
        if self.bits == 8:
            return torch.ops.aten._weight_int8pack_mm(x, self.qweight, scales)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, self.group_size, scales)

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel on x's rows in one call (it tiles the rows itself): a VNNI layer's bf16
        rows go in and come out bf16 (the kernel converts as it reads and stores: the float32
        copies around every call were 2.8% of a 16-request run), other rows as float32."""
        if self.vnni and x.dtype == torch.bfloat16 and self.in_features % cpu_quant.BLOCK == 0:
            return self._gemv_rows(x)
        return self._gemv_rows(x.float()).to(x.dtype)

    def _gemv_rows(self, x: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            values = self.qweight
            if self.tiled:
                values = cpu_quant.Int8Tiles(self.qweight, self.out_features)
            return cpu_quant.int8_mm(x, values, self.scales.float(), self.vnni)
        if self.bits == 5:
            return cpu_quant.int5_mm(x, self._pack(), self.vnni)
        return cpu_quant.int4_mm(x, self._pack(), self.vnni)

    def _pack(self) -> cpu_quant.AnyPack:
        """The weight as the kernel's int4 (rows or tiles) or int5 layout (held so, `mins` set)."""
        if self.bits == 5:
            return cpu_quant.Int5Pack(self.qweight, self.qhigh, self.scales, self.mins)
        if self.tiled:
            return cpu_quant.Int4Tiles(self.qweight, self.scales, self.mins, self.out_features)
        return cpu_quant.Int4Pack(self.qweight, self.scales, self.mins)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The weight's rows `index` names, dequantized to `dtype` [len(index), in]: an
        embedding's lookup. int8 or the AVX2 kernel's layouts (torch's int4 packing interleaves
        64 rows and is not read back per row: ValueError)."""
        if self.bits == 8:
            if self.tiled:
                values = cpu_quant.int8_tile_rows(self.qweight, index).to(dtype)
            else:
                values = self.qweight[index].to(dtype)
            return values * self.scales[index, None].to(dtype)
        if self.mins is None:
            raise ValueError("an int4 weight in torch's packing gives no rows back")
        return cpu_quant.unpack_rows(self._pack(), index).to(dtype)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """x @ dequantized weight.T, a chunk of output rows at a time (no whole bf16 copy)."""
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        if self.bits == 8:
            return self._dense_int8(x, out)
        if self.mins is not None:
            pack = self._pack()
            if isinstance(pack, cpu_quant.Int4Tiles):  # not reached: the GEMM takes every row
                pack = cpu_quant.untile_int4(pack)
            for start in range(0, self.out_features, _DENSE_CHUNK):
                w = cpu_quant.unpack_int4(pack, start, start + _DENSE_CHUNK).to(x.dtype)
                out[:, start : start + len(w)] = x @ w.T
            return out
        for start in range(0, self.out_features, _DENSE_CHUNK):
            end = min(start + _DENSE_CHUNK, self.out_features)
            out[:, start:end] = self._dense_int4(x, start, end)
        return out

    def _dense_int8(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The integers converted as they are and multiplied, each output column then scaled:
        no elementwise pass of mixed dtypes over the weight (that made SmolLM2's 49152-row head
        19.6 ms at 8 rows; this 9.3, bf16's own matmul 8.9)."""
        scales = self.scales if self.scales.dtype == x.dtype else self.scales.to(x.dtype)
        for start in range(0, self.out_features, _DENSE_CHUNK_INT8):
            end = min(start + _DENSE_CHUNK_INT8, self.out_features)
            if self.tiled:
                values = cpu_quant.untile_int8(self.qweight, start, end)
            else:
                values = self.qweight[start:end]
            part = torch.nn.functional.linear(x, values.to(x.dtype))
            torch.mul(part, scales[start:end], out=out[:, start:end])
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


def quantized_head(weight: QuantizedWeight | Pack, dtype: torch.dtype) -> QuantizedLinear:
    """An LM head held quantized (a GGUF's output.weight, or a tied embedding's rows), scales
    in the engine's dtype: int8 goes dense from 5 rows (its kernel works 4 rows at a time),
    int4 by the width's own rule."""
    dense = _HEAD_DENSE_ROWS if _form(weight)[0] == 8 else None
    head = QuantizedLinear(weight, None, scale_dtype=dtype, dense_rows=dense)
    # The GEMM at every row count: a head multiplies few rows at prefill (the last of each
    # chunk), a decode batch's at batch size (16 rows: 6.9 CPU ms against 11.7 dense).
    head.exact_rows = None
    return head


def _form(weight: QuantizedWeight | Pack) -> tuple[Bits, int, int, int | None]:
    """(bits, out_features, in_features, group_size) of a weight in either form."""
    if isinstance(weight, QuantizedWeight):
        return weight.bits, weight.out_features, weight.in_features, weight.group_size
    out, half = weight.nibbles.shape
    return (5 if isinstance(weight, cpu_quant.Int5Pack) else 4), out, 2 * half, INT4_GROUP


class QuantizedEmbedding(nn.Module):
    """A token embedding held quantized: a GGUF's quantized token_embd under `auto`, int8 with
    one scale per row, or int5 at its bits where the file stores Q5_0/Q5_1 (a Q4_K_M file of a
    896-wide model) and the AVX2 kernel runs, instead of a float copy. A lookup dequantizes
    the tokens' rows into `dtype`. Tied, `head` is the LM head too, through the quantized
    kernel, so the pair is stored once: at batch 1 the tied bf16 head read 56 MiB a decode
    step and took a quarter of it (docs/quantization.md's profile)."""

    def __init__(self, weight: QuantizedWeight | Pack, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        if _form(weight)[0] == 4:
            raise ValueError("a quantized embedding is int8 or int5, not int4")
        self.head = quantized_head(weight, dtype)
        self.dtype = dtype
        self.out_features, self.in_features = self.head.out_features, self.head.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.head.rows(input_ids.reshape(-1), self.dtype)
        return rows.view(*input_ids.shape, self.in_features)


# --- GGUF blocks ---------------------------------------------------------------------------


def gguf_weight(raw: RawTensor, bits: Bits | None = None) -> QuantizedWeight | Pack:
    """`from_gguf_blocks`'s weight for one rank (a layer takes either form): a type held
    exactly in the AVX2 kernel's layout (Q4_x as int4, Q5_x as int5) is packed a chunk of rows
    at a time straight from its blocks, without the whole int8 copy QuantizedWeight holds,
    which was the largest transient of issue 36's load (docs/quantization.md)."""
    own = gguf_bits(check_blocks(raw))
    if own not in (4, 5) or bits not in (None, own) or not cpu_quant.available():
        return from_gguf_blocks(raw, bits)
    pack = None
    for start, part in exact_rows(raw, own):
        packed = QuantizedLinear.pack_for_gemv(part)
        pack = pack or _empty_pack(packed, raw.shape[0])
        for field in dataclasses.fields(packed):
            rows = getattr(packed, field.name)
            getattr(pack, field.name)[start : start + len(rows)] = rows
    assert pack is not None, "a weight has rows"
    return pack


def _empty_pack(part: Pack, out: int) -> Pack:
    fields = {f.name: getattr(part, f.name) for f in dataclasses.fields(part)}
    return type(part)(**{n: t.new_empty(out, t.shape[1]) for n, t in fields.items()})


def release_freed_heap() -> None:
    """Give freed temporaries back to the OS once weights are converted or fused: glibc keeps
    freed heap for reuse, 45 MiB beside SmolLM2's 122 MiB of int4 tensors and KV pool
    (docs/quantization.md). Nothing to do without glibc's malloc_trim."""
    gc.collect()  # a GGUF reader's reference cycles first
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def weight_format(model: nn.Module) -> str:
    """How a model holds its linear weights, as far as its outputs depend on it: "" when all
    are float, else the quantized widths ("int4", "int4+int8"). Two nodes whose KV must be
    interchangeable hold their weights alike."""
    widths = sorted({m.bits for m in model.modules() if isinstance(m, QuantizedLinear)})
    return "+".join(f"int{bits}" for bits in widths)


def gemv_paths(model: nn.Module) -> str:
    """The GEMV paths a model's quantized layers take ("avx2", "vnni", both joined by "+"), ""
    when none runs on the GEMV: what a compiled step bakes in beside the weight form."""
    paths = {"vnni" if m.vnni else "avx2" for m in model.modules() if _on_gemv(m)}
    return "+".join(sorted(paths))


def _on_gemv(module: nn.Module) -> bool:
    return isinstance(module, QuantizedLinear) and module.gemv
