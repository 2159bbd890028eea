"""Causal varlen attention over paged K/V: prefill chunks and decodes in one launch.

Each program owns one kv head and one tile of up to BLOCK_Q query tokens of one sequence;
the tile's rows are (token, q head of that kv head's group) pairs, so a decode under GQA
still fills the rows of a tensor-core tile and every K/V tile is loaded once per group.
Reference: `kernels.reference.paged_attention_ref`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pdserve.kernels._checks import (
    INDEX_DTYPES,
    check_dtype,
    check_kv_halves,
    check_one_device,
    check_rows,
)

# Keys per inner-loop step (tiles may straddle pages: each key looks up its own block), the
# fewest rows of a prefill tile, and warps per program; the defaults were tuned on an H100
# (docs/gpu.md) and the launcher takes others for tuning.
BLOCK_N = 32
PREFILL_ROWS = 64
NUM_WARPS = 4
_LONG_PREFILL = 4096  # tokens in a step from which prefill tiles get 128 rows


@triton.jit
def softmax_start(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """An empty running softmax for BLOCK_M query rows: (m_i, l_i, acc) before any key.

    Shared with `paged_decode`'s kernel, whose rows fold keys in with `attend_keys` too."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    return m_i, l_i, acc


@triton.jit
def attend_keys(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    block_table,
    keys,
    key_valid,
    visible,
    block_size,
    stride_kv_block,
    stride_kv_offset,
    kv_head_offset,
    dims,
    dim_valid,
    qk_scale,
):
    """One tile of keys into a tile of query rows' running softmax: (m_i, l_i, acc) updated.

    Each key looks up its own block, so tiles may straddle pages; `visible` [rows, keys] says
    which query row sees which key. Shared with `paged_decode`'s kernel."""
    # Padding entries of the block table are never read: masked keys load block 0.
    block = tl.load(block_table + keys // block_size, mask=key_valid, other=0).to(tl.int64)
    kv_offs = block * stride_kv_block + (keys % block_size) * stride_kv_offset + kv_head_offset
    kv_mask = key_valid[:, None] & dim_valid[None, :]
    k = tl.load(k_cache_ptr + kv_offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    # ieee: fp32 caches must not silently drop to tf32; fp16/bf16 operands ignore it.
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row that has seen no key yet keeps m = -inf; shifting by 0 makes exp2 give 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + kv_offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    qk_scale,
    num_seqs,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_kv_block,
    stride_kv_offset,
    stride_kv_head,
    stride_bt,
    block_size,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Sequence b's tiles start at id qsl[b] // BLOCK_Q + b, which bounds the tiles of all
    # sequences before it: ids never collide and the grid needs only T and B, so the launch
    # needs no device-to-host sync. Binary search for the last sequence starting at or before us.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile_start = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if q_tile_start >= q_len:
        return  # a spare id of the upper-bound grid
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_tile_start + rows // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (q_tok < q_len)
    q_pos = context_len + q_tok
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    tok64 = (q_start + q_tok).to(tl.int64)
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q_offs = tok64[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :]
    q = tl.load(query_ptr + q_offs, mask=q_mask, other=0.0)

    # Only keys some row of this tile can see: up to its last query, from its first's window.
    kv_end = tl.minimum(context_len + q_tile_start + BLOCK_Q, seq_len)
    kv_begin = 0
    if SLIDING_WINDOW > 0:
        kv_begin = tl.maximum(context_len + q_tile_start - SLIDING_WINDOW + 1, 0)

    m_i, l_i, acc = softmax_start(BLOCK_M, BLOCK_D)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_offset = kv_head * stride_kv_head
    for start in range(kv_begin, kv_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_valid = keys < kv_end
        visible = key_valid[None, :] & (keys[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            visible &= keys[None, :] > q_pos[:, None] - SLIDING_WINDOW
        m_i, l_i, acc = attend_keys(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table, keys, key_valid, visible,
            block_size, stride_kv_block, stride_kv_offset, kv_head_offset, dims, dim_valid,
            qk_scale,
        )  # fmt: skip

    # Every valid row sees at least its own key; the guard only keeps padded rows finite.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_offs = tok64[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _check_layout(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [T, num_heads, head_dim]; got {tuple(query.shape)}")
    check_kv_halves(k_cache, v_cache)
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    if query.shape[2] != k_cache.shape[3]:
        raise ValueError(f"query head_dim {query.shape[2]} != cache head_dim {k_cache.shape[3]}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_rows(name, t)
    if not query.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(
            f"query, k_cache, v_cache must share a dtype; "
            f"got {query.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )


def _check_batch(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None,
) -> None:
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if num_seqs < 0 or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"seq_lens must be [B] and query_start_loc [B + 1]; "
            f"got {tuple(seq_lens.shape)} and {tuple(query_start_loc.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [B={num_seqs}, max_blocks]; got {tuple(block_tables.shape)}"
        )
    if block_tables.stride(1) != 1:
        raise ValueError(f"block_tables rows must be contiguous; strides {block_tables.stride()}")
    for name, t in (
        ("block_tables", block_tables),
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
    ):
        check_dtype(name, t, INDEX_DTYPES)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1; got {sliding_window}")


def check_attention_inputs(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None,
) -> None:
    """ValueError naming what is wrong with a paged-attention call's arguments."""
    _check_layout(query, k_cache, v_cache)
    _check_batch(block_tables, query_start_loc, seq_lens, sliding_window)
    check_one_device(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens)


def launch_strides(
    query: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[int, ...]:
    """The strides both attention kernels take, in their parameter order (stride_q_t to
    stride_bt): one list, so the two launchers cannot pass them in different orders."""
    return (
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
    )


def _tile_sizes(
    num_tokens: int, num_seqs: int, queries_per_kv: int, prefill_rows: int | None
) -> tuple[int, int]:
    """(BLOCK_M rows, BLOCK_Q query tokens per program), chosen from shapes alone (no sync)."""
    # tl.dot needs >= 16 rows. A decode-only batch has one token per sequence, so more rows
    # would be masked waste; prefill chunks get taller tiles to reuse each K/V load more.
    if prefill_rows is None:  # long prompts: 128 rows ran 8k tokens 9% faster (docs/gpu.md)
        prefill_rows = 128 if num_tokens >= _LONG_PREFILL else PREFILL_ROWS
    min_rows = 16 if num_tokens == num_seqs else prefill_rows
    block_m = max(min_rows, triton.next_power_of_2(queries_per_kv))
    return block_m, block_m // queries_per_kv


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    block_n: int = BLOCK_N,
    prefill_rows: int | None = None,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """Causal varlen attention of new tokens [T, Hq, D] over paged K/V; returns [T, Hq, D].

    Same semantics as `paged_attention_ref`: query i of a sequence with q_len new tokens sits at
    position seq_len - q_len + i and sees keys up to it (the last `sliding_window` of them when
    given). Softmax in float32; the output has query's dtype. No device-to-host sync.
    `block_n`, `prefill_rows` (None: by the step's size) and `num_warps` are the tuning knobs.
    """
    check_attention_inputs(
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, sliding_window
    )
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    if num_tokens == 0 or num_seqs == 0:
        return out
    queries_per_kv = num_heads // num_kv_heads
    block_m, block_q = _tile_sizes(num_tokens, num_seqs, queries_per_kv, prefill_rows)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * math.log2(math.e),  # the kernel uses exp2
        num_seqs,
        *launch_strides(query, out, k_cache, block_tables),
        k_cache.shape[1],
        QUERIES_PER_KV=queries_per_kv,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        SLIDING_WINDOW=sliding_window or 0,
        num_warps=num_warps,
    )
    return out
