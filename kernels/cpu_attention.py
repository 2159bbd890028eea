"""Decode attention on the CPU that reads the paged cache where it lies: one call a layer for
all of a step's decode rows, a verify step's drafted rows among them (kernels/cpu_attention.cpp).

`paged_attention_cpu` (cpu.py) gathers each group's blocks into a buffer and calls flash
attention per chunk and group, merging partial results by their log-sum-exps: at decode sizes
that is hundreds of calls, gathers and views a step, per-call overhead rather than bandwidth
(docs/quantization.md's profile). Here one C++ call takes q for every decode row, the layer's
K/V cache, the rows' block tables and lengths, and for each (row, KV head), split across
torch's threads, walks the row's blocks from its first seen key (a sliding window's) with an
online softmax: a block's scores for the G query heads that share the KV head, their
exponentials against the running maximum, the running output rescaled once a block. K and V
are read in place, once for the G heads, and never gathered. Scores and sums are float32.
A row may hold a few consecutive queries of one sequence (a verify step's 1 + k), each causal
among them: their G heads each are the KV head's query heads, and a block's keys past a query
(or before its window) are masked out of its scores, so the row's blocks are read once.

Two paths, chosen per call: AVX512 (16 lanes, bf16 widened in registers, a polynomial exp)
where /proc/cpuinfo shows AVX512F/BW/VL/DQ and the head dim is a multiple of 16, a plain loop
otherwise. float32 and bfloat16, the query's dtype the cache's. Built like cpu_quant's kernel
(`cpu_quant.load_extension`: cached by source hash and torch, under a build lock); where it
does not build, `available()` is False (logged once) and cpu.py keeps its flash path.
$PDSERVE_CPU_ATTENTION: "auto" (default), "plain" (the plain loop), "off" (flash for all).
"""

from __future__ import annotations

import logging
from functools import cache

import torch

from pdserve.kernels import cpu_quant

log = logging.getLogger(__name__)

ATTENTION_KERNEL_ENV = "PDSERVE_CPU_ATTENTION"
_MODES = ("auto", "plain", "off")
DTYPES = (torch.float32, torch.bfloat16)
_SOURCE = cpu_quant.kernel_source("cpu_attention.cpp")


@cache
def _module():  # noqa: ANN202 (a compiled extension module)
    return cpu_quant.load_extension("cpu_attention", _SOURCE, ["paged_decode", "store_kv"], [])


def _mode() -> str:
    return cpu_quant.env_mode(ATTENTION_KERNEL_ENV, _MODES)


def cpu_has_avx512() -> bool:
    """Whether this CPU has what the AVX512 path's instructions need."""
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_quant.cpu_flags()


@cache
def available() -> bool:
    """Whether decode rows take this kernel: $PDSERVE_CPU_ATTENTION is not off and the source
    compiled (once per process). Logs why not, once."""
    if _mode() == "off":
        log.info("cpu attention kernel: off (%s=off): flash attention", ATTENTION_KERNEL_ENV)
        return False
    return cpu_quant.builds(_module, "cpu attention kernel", "flash attention")


def serves(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether this kernel takes these tensors' decode rows (dtypes it has, one among them)."""
    dtypes = {query.dtype, k_cache.dtype, v_cache.dtype}
    return len(dtypes) == 1 and query.dtype in DTYPES and available()


def stores(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `store_kv` takes these: one dtype, rows contiguous in D (kernels/cpu.py's
    index_copy_ path takes the rest)."""
    same = key.dtype == value.dtype == k_cache.dtype
    rows = key.dim() == 3 and key.stride(-1) == 1 and value.stride(-1) == 1
    return same and rows and available()


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:  # fmt: skip
    """Each token's K and V rows [T, Hkv, D] into its slot of k_cache and v_cache [N,
    block_size, Hkv, D]; a negative slot is not stored, a slot past the cache raises. One call
    (kernels/cpu.py's store_kv is the reference, and serves what `stores` refuses)."""
    _module().store_kv(key, value, k_cache, v_cache, slot_mapping)


def uses_avx512(head_dim: int) -> bool:
    return _mode() == "auto" and head_dim % 16 == 0 and cpu_has_avx512()


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    avx512: bool | None = None,
    queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of queries over their blocks block_tables [R, W] of k_cache and v_cache [N,
    block_size, Hkv, D]: row r holds queries[r] consecutive rows of query [T, H, D] (int32
    [R]; None: one each), its last at position seq_lens[r] - 1, each query causal (it sees the
    keys up to its own position) -> [T, H, D], the query's dtype. A verify step's drafted rows
    are one row, so their blocks are read once. `avx512` picks the path (default
    `uses_avx512`)."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, not {sliding_window}")
    args = (query.contiguous(), k_cache, v_cache, block_tables, seq_lens, scale)
    path = uses_avx512(query.shape[-1]) if avx512 is None else avx512
    if torch.compiler.is_compiling():
        return torch.ops.pdserve.cpu_paged_decode(*args, sliding_window or 0, path, queries)
    return _module().paged_decode(*args, sliding_window or 0, path, queries)


# As an op a traced graph holds (torch.compile, AOTInductor's proxy executor), defined as
# cpu_quant's are, with a fake giving the output's shape. Eager calls skip the dispatcher.
_LIB = torch.library.Library("pdserve", "FRAGMENT")
_LIB.define(
    "cpu_paged_decode(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
    "Tensor seq_lens, float scale, int window, bool avx512, Tensor? queries=None) -> Tensor"
)


def _paged_decode_op(*args: object, queries: torch.Tensor | None = None) -> torch.Tensor:
    """The op's body: the dispatcher passes `queries` by position where a caller did, else
    not at all (its default), and the extension takes it by position."""
    return _module().paged_decode(*args, *(() if len(args) == 9 else (queries,)))


_LIB.impl("cpu_paged_decode", _paged_decode_op, "CompositeExplicitAutograd")


@torch.library.register_fake("pdserve::cpu_paged_decode")
def _paged_decode_fake(query: torch.Tensor, *_: object) -> torch.Tensor:
    """[R, H, D] in the query's dtype, contiguous."""
    return torch.empty_like(query, memory_format=torch.contiguous_format)
