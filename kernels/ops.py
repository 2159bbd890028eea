"""The one dispatch point between the model and the kernels: which kernel runs each op.

Paged KV (store, attention, page gather and scatter) and MoE: Triton kernels for CUDA tensors,
else the plain-torch kernels of `cpu.py` (paged attention on a device that is neither CUDA nor
CPU: `reference.py`'s). The model and the connectors take these from here.

The CPU's linears, chosen by measurement where MKL's small-M SGEMM (F.linear) is slow. At one
thread on the AVX2 EPYC, a 49152 x 576 float32 head (113 MB, read from memory every step;
docs/quantization.md, "CPU linear"): F.linear takes 19-23 ms at 1 row and 45-86 ms at 2 to 16.
The weight reordered once into oneDNN's blocked layout (`PackedLinear`) takes the same at 1 row
and half that from 2 rows on. A tied head must stay plain, because the embedding looks its rows
up; there the plain weight multiplied HEAD_CHUNK vocabulary rows at a time (`chunked_linear`) is
1.3-1.7x faster than F.linear from 2 rows on, and slower at 1 row, where F.linear stays. A
float32 decoder's own linears stay F.linear: at the decode batches a step runs most, the packed
layouts stream their weights 1.3-1.9x slower than F.linear at one row (a bf16 one's are packed
where the CPU has native bf16: docs/quantization.md).

The model applies these after loading (`use_cpu_head` in common/model/llama.py). An engine
that compiles decode steps keeps each packed layer's plain weight too (`keep_plain`): its
AOTInductor packages are traced over the plain model and read those weights by name (a packed
tensor is opaque to torch.export), while its eager steps (prefill, mixed steps, and every
decode bucket until its package is adopted) run the packed ones. PDSERVE_CPU_LINEAR=off keeps
F.linear everywhere. The quantized linears' kernels are `cpu_quant.py`'s, which
common/model/quant.py's layers call.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import cpu, reference


@functools.cache
def triton_available() -> bool:
    """True when triton imports; checked once, lazily, so CPU-only installs never pay for it."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Write K/V rows [T, Hkv, D] into cache slots; slot = block_id * block_size + offset."""
    if _use_triton(key):
        from pdserve.kernels.store_kv import store_kv_triton

        return store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    return cpu.store_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window=None
) -> torch.Tensor:
    """Causal varlen attention over paged K/V (prefill chunks and decode in one call).
    v_cache may be k_cache itself (an MLA latent as keys and values: on the CPU one read
    serves both; the caller keeps the value dims of the output)."""
    if _use_triton(query) and query.shape[0] == seq_lens.shape[0]:
        # One token per sequence (a decode step): the kernel that splits keys across programs.
        # A step the scheduler made never has a sequence without tokens, so T == B means that.
        from pdserve.kernels.paged_decode import paged_decode_triton

        return paged_decode_triton(
            query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window
        )
    if _use_triton(query):
        from pdserve.kernels.paged_attention import paged_attention_triton

        return paged_attention_triton(
            query,
            k_cache,
            v_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            scale,
            sliding_window,
        )
    args = (query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)
    if query.device.type == "cpu":
        # The chunked reader of cpu.py; reference.paged_attention_ref is its oracle (and
        # serves any other device without Triton).
        return cpu.paged_attention_cpu(*args, sliding_window)
    return reference.paged_attention_ref(*args, sliding_window)


def gather_pages(
    layer_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Blocks of one layer cache [P, N, bs, H, D] (P planes: 2 for K and V, 1 for a latent) ->
    contiguous pages [P, n, bs, H, D], new or written into `out` (contiguous, same dtype and
    device; returned)."""
    if _use_triton(layer_cache):
        from pdserve.kernels.page_copy import gather_pages_triton

        return gather_pages_triton(layer_cache, block_ids, out)
    return cpu.gather_pages(layer_cache, block_ids, out)


def scatter_pages(layer_cache: torch.Tensor, block_ids: torch.Tensor, pages: torch.Tensor) -> None:
    """Contiguous pages [P, n, bs, H, D] -> the given blocks of one layer cache [P, N, bs, H, D]."""
    if _use_triton(layer_cache):
        from pdserve.kernels.page_copy import scatter_pages_triton

        return scatter_pages_triton(layer_cache, block_ids, pages)
    return cpu.scatter_pages(layer_cache, block_ids, pages)


def fused_moe(x, gate_up, down, weights, ids) -> torch.Tensor:
    """Mixture-of-experts SwiGLU: x [T, H], gate_up [E, 2I, H], down [E, H, I], routing weights
    and expert ids [T, k] -> each token's chosen experts' outputs summed by weight, [T, H].
    An id equal to E is an expert another rank holds (expert parallelism): it adds nothing."""
    if _use_triton(x):
        from pdserve.kernels.fused_moe import fused_moe_triton

        return fused_moe_triton(x, gate_up, down, weights, ids)
    return reference.fused_moe_ref(x, gate_up, down, weights, ids)


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
