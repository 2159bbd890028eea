"""Merge the key splits of `paged_decode`: each split's softmax-normalised partial output
weighted by its share of the softmax, in one launch (a CUDA-graph node per layer instead of
the ten a torch expression takes). Reference: `kernels.reference.combine_splits_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _split_combine_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_o_t,
    stride_o_h,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # One program per (token, head): its NUM_SPLITS partial rows [BLOCK_D] and log-sum-exps.
    token = tl.program_id(0)
    head = tl.program_id(1)
    row = token.to(tl.int64) * num_heads + head
    splits = tl.arange(0, BLOCK_S)
    split_valid = splits < NUM_SPLITS
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + splits, mask=split_valid, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row with no key at all: weights 0
    weight = tl.exp2(lse - top)
    weight = weight / tl.maximum(tl.sum(weight, axis=0), 1e-30)
    dims = tl.arange(0, BLOCK_D)
    offs = (row * NUM_SPLITS + splits)[:, None] * BLOCK_D + dims[None, :]
    parts = tl.load(part_out_ptr + offs, mask=split_valid[:, None], other=0.0)
    merged = tl.sum(parts * weight[:, None], axis=0)
    o_offs = token.to(tl.int64) * stride_o_t + head * stride_o_h + dims
    tl.store(out_ptr + o_offs, merged.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def combine_splits_triton(
    part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor
) -> None:
    """As `combine_splits_ref`; part_out and part_lse float32 and contiguous."""
    num_tokens, num_heads, num_splits, block_d = part_out.shape
    if part_lse.shape != (num_tokens, num_heads, num_splits):
        raise ValueError(f"part_lse {tuple(part_lse.shape)} does not match {tuple(part_out.shape)}")
    if out.shape[:2] != (num_tokens, num_heads) or out.shape[2] > block_d or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} does not match {tuple(part_out.shape)}")
    for name, t in (("part_out", part_out), ("part_lse", part_lse)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32; got {t.dtype} {t.stride()}")
    if num_tokens == 0:
        return
    _split_combine_kernel[(num_tokens, num_heads)](
        part_out,
        part_lse,
        out,
        out.stride(0),
        out.stride(1),
        num_heads,
        HEAD_DIM=out.shape[2],
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
    )
