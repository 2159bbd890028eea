"""Argument checks shared by the Triton launchers: clear ValueErrors instead of bad memory."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name} dtype {t.dtype} is not one of {allowed}")


def check_rows(name: str, t: torch.Tensor) -> None:
    """A float tensor whose last (head_dim) axis is contiguous."""
    check_dtype(name, t, FLOAT_DTYPES)
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in head_dim; strides {t.stride()}")


def check_kv_halves(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """K and V halves of one layer cache: the same 4-D shape and the same strides."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share strides (halves of one layer cache)")


def check_one_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {devices}")
