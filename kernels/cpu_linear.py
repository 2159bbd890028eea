"""The LM head's float32 matmul on the CPU, where MKL's small-M SGEMM (F.linear) is slow.

Measured at one thread on the AVX2 EPYC, a 49152 x 576 float32 head (113 MB, read from memory
every step; docs/quantization.md, "CPU linear"): F.linear takes 19-23 ms at 1 row and 45-86 ms
at 2 to 16. The weight reordered once into oneDNN's blocked layout (`PackedLinear`) takes the
same at 1 row and half that from 2 rows on. A tied head must stay plain, because the embedding
looks its rows up; there the plain weight multiplied HEAD_CHUNK vocabulary rows at a time
(`chunked_linear`) is 1.3-1.7x faster than F.linear from 2 rows on, and slower at 1 row, where
F.linear stays. The decoder's own linears stay F.linear: at the decode batches a step runs
most, the packed layouts stream their weights 1.3-1.9x slower than F.linear at one row.

The model runner applies these after loading. An engine that compiles decode steps keeps each
packed layer's plain weight too (`keep_plain`): its AOTInductor packages are traced over the
plain model and read those weights by name (a packed tensor is opaque to torch.export), while
its eager steps (prefill, mixed steps, and every decode bucket until its package is adopted)
run the packed ones. PDSERVE_CPU_LINEAR=off keeps F.linear everywhere.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

CPU_LINEAR_ENV = "PDSERVE_CPU_LINEAR"  # "auto" (default) or "off"
# Vocabulary rows per matmul of a chunked head: 512 measured best of 256-2048 at 2-64 rows.
HEAD_CHUNK = 512
# From this many rows a plain head is chunked (F.linear is faster at one row).
CHUNKED_FROM_ROWS = 2
# The batch size oneDNN's reorder is told to expect; 16 and 128 measured alike at 1-64 rows.
_PACK_ROWS = 16


def cpu_linear_enabled() -> bool:
    """Whether $PDSERVE_CPU_LINEAR lets the head use these kernels (ValueError if it is
    neither auto nor off)."""
    mode = os.environ.get(CPU_LINEAR_ENV, "auto")
    if mode not in ("auto", "off"):
        raise ValueError(f"{CPU_LINEAR_ENV} must be auto or off, not {mode!r}")
    return mode == "auto"


def packs(weight: torch.Tensor, native_bf16: bool = False) -> bool:
    """Whether `weight` can be held in oneDNN's layout: float32 on a CPU with oneDNN, or bf16
    where the caller found native bf16 (AMX or AVX512-BF16: oneDNN's bf16 kernels; emulated
    on AVX2, where they were not measured faster)."""
    dtypes = (torch.float32, torch.bfloat16) if native_bf16 else (torch.float32,)
    return (
        weight.device.type == "cpu"
        and weight.dtype in dtypes
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
    )


class PackedLinear(nn.Module):
    """nn.Linear's forward over a float32 or bf16 weight held in oneDNN's blocked layout; the
    input comes in the weight's dtype. The packed tensor is an attribute, not a buffer:
    state_dict, `.to()` and parameter walks cannot read an opaque oneDNN tensor.

    With `keep_plain` the plain weight stays, a parameter under nn.Linear's name, and a traced
    forward (torch.export, torch.compile) is nn.Linear's over it: a compiled step reads the
    plain weight, the eager ones the packed copy. Without it the caller drops the plain weight
    and the layer runs eager only."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_plain: bool = False
    ) -> None:
        super().__init__()
        if not packs(weight, native_bf16=True):
            raise ValueError(f"a packed linear takes a float32 or bf16 CPU weight: {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        if keep_plain and not isinstance(weight, nn.Parameter):
            weight = nn.Parameter(weight.detach(), requires_grad=False)
        # the caller's own parameter (a tied embedding's is listed once, under its first name)
        self.register_parameter("weight", weight if keep_plain else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            assert self.weight is not None, "a packed linear without its plain weight is eager only"
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != self.dtype:
            raise ValueError(f"a packed linear takes {self.dtype} input, not {flat.dtype}")
        if flat.shape[0] == 0:  # oneDNN refuses an empty batch
            out = flat.new_zeros(0, self.out_features)
        else:
            op = torch.ops.mkldnn._linear_pointwise
            out = op(flat.contiguous(), self.packed, self.bias, "none", [], "")
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


def packed_numel(model: nn.Module) -> int:
    """Weight elements `model` holds in packed linears, which its parameters() do not list (a
    packed layer that keeps its plain weight holds both)."""
    return sum(
        m.in_features * m.out_features for m in model.modules() if isinstance(m, PackedLinear)
    )


def chunked_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x [M, K], weight [N, K]) without a bias, HEAD_CHUNK output columns at a time
    from CHUNKED_FROM_ROWS rows on (each chunk's [M, 512] output stays in cache while its
    weight rows stream once)."""
    rows, vocab = x.shape[0], weight.shape[0]
    if rows < CHUNKED_FROM_ROWS or vocab <= HEAD_CHUNK:
        return F.linear(x, weight)
    out = x.new_empty(rows, vocab)
    for start in range(0, vocab, HEAD_CHUNK):
        part = weight[start : start + HEAD_CHUNK]
        torch.mm(x, part.t(), out=out[:, start : start + part.shape[0]])
    return out
