"""Reshape-and-cache: write each new token's K and V rows into its paged cache slot.

Reference: `kernels.cpu.store_kv`.
"""

from __future__ import annotations

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


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: its [num_kv_heads, head_dim] rows are one small 2-D tile.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        # Padding tokens (e.g. CUDA-graph filler) carry slot -1 and must not touch the cache.
        return
    block = slot // block_size
    offset = slot % block_size

    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    # int64 token index: T * stride overflows int32 for long prefills with many heads.
    token64 = token.to(tl.int64)
    k = tl.load(key_ptr + token64 * stride_key_t + heads * stride_key_h + dims, mask=mask)
    v = tl.load(value_ptr + token64 * stride_value_t + heads * stride_value_h + dims, mask=mask)

    cache_offs = block * stride_cache_block + offset * stride_cache_offset
    cache_offs += heads * stride_cache_head + dims
    tl.store(k_cache_ptr + cache_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_inputs(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"key and value must both be [T, num_kv_heads, head_dim]; "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    check_kv_halves(k_cache, v_cache)
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key rows {tuple(key.shape[1:])} do not match cache rows {tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(
            f"slot_mapping must be [T={key.shape[0]}]; got {tuple(slot_mapping.shape)}"
        )
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_rows(name, t)
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} differ in dtype")
    check_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    check_one_device(key, value, k_cache, v_cache, slot_mapping)


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write K/V rows [T, Hkv, D] into their slots (block_id * block_size + offset) in place.

    Negative slots are skipped; rows are cast to the cache dtype. Slots must be in range:
    checking that would need a device-to-host sync, so it is the caller's invariant.
    """
    _check_inputs(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
