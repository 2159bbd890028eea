"""The one dispatch point: Triton kernels for CUDA tensors, else the plain-torch kernels of
`cpu.py` (paged attention on a device that is neither CUDA nor CPU: `reference.py`'s).

Callers (the model runner, the connectors) only ever import from here.
"""

from __future__ import annotations

import functools

import torch

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
