"""Decode attention over paged K/V with the keys split across programs (flash-decoding).

A decode step has one query token per sequence, so `paged_attention`'s one program per
(sequence, kv head) leaves most of a GPU idle at small batches and long contexts. Here each
(sequence, kv head) is also split along its keys into NUM_SPLITS programs; each writes its
softmax-normalised partial output and log-sum-exp, and `split_combine` merges them. The split
length is derived inside the kernel from the sequence's own length, so every split does an equal
share of the real work whatever the block table's width: the launch needs no device-to-host
sync and a CUDA graph captured at one width serves every context length.
Reference: `kernels.reference.paged_attention_ref` (query length 1).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from pdserve.kernels.paged_attention import (
    attend_keys,
    check_attention_inputs,
    launch_strides,
    softmax_start,
)
from pdserve.kernels.split_combine import combine_splits_triton

# Keys per inner-loop step, and warps per program: tuned on an H100 (docs/gpu.md).
BLOCK_N = 32
NUM_WARPS = 4
MAX_SPLITS = 32


@triton.jit
def _paged_decode_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    qk_scale,
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
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == q_start:
        return  # a padding sequence of a captured batch: no token
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_begin = 0
    if SLIDING_WINDOW > 0:
        kv_begin = tl.maximum(seq_len - SLIDING_WINDOW, 0)
    # This split's keys: an equal share of the visible ones, in whole BLOCK_N tiles.
    chunk = tl.cdiv(tl.cdiv(seq_len - kv_begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = kv_begin + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    rows = tl.arange(0, BLOCK_M)
    head = kv_head * QUERIES_PER_KV + rows
    row_valid = rows < QUERIES_PER_KV
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    q_mask = row_valid[:, None] & dim_valid[None, :]
    tok64 = q_start.to(tl.int64)
    q_offs = tok64 * stride_q_t + head[:, None] * stride_q_h + dims[None, :]
    q = tl.load(query_ptr + q_offs, mask=q_mask, other=0.0)

    m_i, l_i, acc = softmax_start(BLOCK_M, BLOCK_D)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # The only query sits at seq_len - 1: every key below seq_len is visible (no causal mask).
    kv_head_offset = kv_head * stride_kv_head
    for tile in range(start, end, BLOCK_N):
        keys = tile + tl.arange(0, BLOCK_N)
        key_valid = keys < end
        m_i, l_i, acc = attend_keys(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table, keys, key_valid,
            key_valid[None, :], block_size, stride_kv_block, stride_kv_offset, kv_head_offset,
            dims, dim_valid, qk_scale,
        )  # fmt: skip

    # A split past the sequence's end saw no key: l = 0, weight 0 in the combine.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if NUM_SPLITS == 1:
        o_offs = tok64 * stride_o_t + head[:, None] * stride_o_h + dims[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # part_out [T, H, NUM_SPLITS, BLOCK_D] and part_lse [T, H, NUM_SPLITS], contiguous.
        part_row = (tok64 * (QUERIES_PER_KV * tl.num_programs(1)) + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part_row[:, None] * BLOCK_D + dims[None, :], out, mask=q_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_i))
        tl.store(part_lse_ptr + part_row, lse, mask=row_valid)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(
    num_seqs: int, num_kv_heads: int, max_keys: int, device: torch.device, block_n: int = BLOCK_N
) -> int:
    """Splits per (sequence, kv head): enough programs for two waves over the multiprocessors,
    no more than the widest context could use. Shapes only: no sync."""
    if device.type != "cuda":
        return 1
    programs = num_seqs * num_kv_heads
    wanted = triton.cdiv(2 * _num_sms(device), programs)
    return max(1, min(wanted, MAX_SPLITS, triton.cdiv(max_keys, block_n)))


def _split_buffers(
    out: torch.Tensor, splits: int, block_d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each split's partial rows [T, H, splits, block_d] and log-sum-exps [T, H, splits],
    float32; with one split the kernel writes `out` directly and these are placeholders."""
    if splits <= 1:
        return out, out
    num_tokens, num_heads = out.shape[:2]
    part_out = torch.empty(num_tokens, num_heads, splits, block_d, device=out.device)
    return part_out, torch.empty(num_tokens, num_heads, splits, device=out.device)


def paged_decode_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    splits: int | None = None,
    block_n: int = BLOCK_N,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """Attention of decode tokens [T, Hq, D] over paged K/V; returns [T, Hq, D].

    Every sequence has at most one query token (T == B for a decode step; a sequence with none
    is padding and its row is left unwritten). Same semantics as `paged_attention_ref` for those
    rows. `splits` overrides the split count (None: `num_splits`); `block_n` and `num_warps`
    are the tuning knobs.
    """
    check_attention_inputs(
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, sliding_window
    )
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, block_size, num_kv_heads = seq_lens.shape[0], k_cache.shape[1], k_cache.shape[2]
    if num_tokens > num_seqs:
        raise ValueError(
            f"a decode step has at most one token per sequence; got {num_tokens} "
            f"tokens for {num_seqs} sequences"
        )
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    max_keys = block_tables.shape[1] * block_size
    if splits is None:
        splits = num_splits(num_seqs, num_kv_heads, max_keys, query.device, block_n)
    block_d = max(16, triton.next_power_of_2(head_dim))
    part_out, part_lse = _split_buffers(out, splits, block_d)
    queries_per_kv = num_heads // num_kv_heads
    _paged_decode_kernel[(num_seqs, num_kv_heads, splits)](
        query,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * math.log2(math.e),  # the kernel uses exp2
        *launch_strides(query, out, k_cache, block_tables),
        block_size,
        QUERIES_PER_KV=queries_per_kv,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=max(16, triton.next_power_of_2(queries_per_kv)),
        BLOCK_N=block_n,
        NUM_SPLITS=splits,
        SLIDING_WINDOW=sliding_window or 0,
        num_warps=num_warps,
    )
    if splits > 1:
        combine_splits_triton(part_out, part_lse, out)
    return out
