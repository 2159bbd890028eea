"""Fused mixture-of-experts: the experts' SwiGLU as two grouped GEMMs over (token, expert) pairs.

`align_pairs` sorts a step's pairs by expert and pads each expert's run to a whole number of
BLOCK_M rows, so every M-block of the sorted order belongs to one expert. One kernel, launched
over (M-blocks x N-blocks), multiplies each block's gathered rows by its expert's weight tile;
the layer runs it twice (gate_up, then down with the routing weights) with SiLU(gate) * up
between. Reference: `kernels.reference.fused_moe_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pdserve.kernels._checks import FLOAT_DTYPES, INDEX_DTYPES, check_dtype, check_one_device

# Untuned defaults (nothing has been measured on a GPU yet: docs/models.md); the launcher takes
# others for tuning. BLOCK_M is chosen per call from the pairs per expert (`pick_block_m`).
BLOCK_N = 64
BLOCK_K = 32
NUM_WARPS = 4


@dataclass(frozen=True, slots=True)
class MoeAlignment:
    """A step's (token, slot) pairs in expert order, each expert's run padded to BLOCK_M rows.

    sorted_ids:  [capacity] int32 pair index (token * top_k + slot); padding holds num_pairs
    expert_ids:  [capacity // block_m] int32, the expert of each M-block; -1 past the end
    num_padded:  [1] int32, rows in use (the sum of the padded runs); blocks past it are skipped
    Sized by an upper bound from shapes alone, so aligning needs no device-to-host sync.
    """

    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_padded: torch.Tensor
    num_pairs: int
    block_m: int


def pick_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per M-block: near the mean pairs per expert, 16 to 64 (tl.dot needs 16), so a
    decode step does not pad every expert's few rows to 64."""
    mean = -(-num_pairs // max(num_experts, 1))
    return min(64, max(16, triton.next_power_of_2(mean)))


def _padded_order(
    flat: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, dest, padded_ends): the pairs sorted by expert (stable), the row each sorted
    pair takes once every expert's run starts on a block_m boundary, and where each run ends."""
    # Not bincount: on CUDA it reads the ids' max back to size its output (a host sync).
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = -(-counts // block_m) * block_m
    padded_ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    run_starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(flat.numel(), device=flat.device) - run_starts[expert]
    return order, (padded_ends - padded)[expert] + rank, padded_ends


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Sort the pairs of `ids` [T, k] by expert (stable: pairs of one expert keep token order,
    so the result is deterministic) and pad each expert's run to a multiple of `block_m`.

    An id equal to `num_experts` names an expert another rank holds (expert parallelism):
    those pairs sort last, past `num_padded`, so no block computes them."""
    flat = ids.flatten().long()
    num_pairs = flat.numel()
    busy = min(num_experts + 1, num_pairs)  # only experts with a pair add padding
    capacity = -(-(num_pairs + busy * (block_m - 1)) // block_m) * block_m
    order, dest, padded_ends = _padded_order(flat, num_experts + 1, block_m)
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=ids.device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, capacity, block_m, device=ids.device)
    block_expert = torch.searchsorted(padded_ends, starts, right=True)
    expert_ids = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    num_padded = padded_ends[num_experts - 1 : num_experts].to(torch.int32)
    return MoeAlignment(sorted_ids, expert_ids, num_padded, num_pairs, block_m)


@triton.jit
def _expert_matmul_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    scale_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    n,
    k,
    stride_a_row,
    stride_w_e,
    stride_w_n,
    stride_w_k,
    stride_o_row,
    ROWS_PER_A: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program per (M-block of sorted pairs, N-tile): out[pair] = a[pair // ROWS_PER_A] @
    # W[expert]^T over the tile, times the pair's routing weight when SCALE.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # a spare block of the upper-bound grid
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_valid = pairs < num_pairs
    # int64: rows * stride and expert * stride overflow int32 at large T or E.
    a_rows = (pairs // ROWS_PER_A).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < n
    w_tile = w_ptr + expert * stride_w_e + cols[None, :].to(tl.int64) * stride_w_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, k, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_valid = ks < k
        a_mask = row_valid[:, None] & k_valid[None, :]
        a = tl.load(a_ptr + a_rows[:, None] * stride_a_row + ks[None, :], mask=a_mask, other=0.0)
        w_mask = k_valid[:, None] & col_valid[None, :]
        w = tl.load(w_tile + ks[:, None] * stride_w_k, mask=w_mask, other=0.0)
        # ieee: fp32 inputs must not silently drop to tf32; fp16/bf16 operands ignore it.
        acc += tl.dot(a, w, input_precision="ieee")
    if SCALE:
        acc *= tl.load(scale_ptr + pairs, mask=row_valid, other=0.0).to(tl.float32)[:, None]
    o_offs = pairs.to(tl.int64)[:, None] * stride_o_row + cols[None, :]
    o_mask = row_valid[:, None] & col_valid[None, :]
    tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


def expert_matmul(
    a: torch.Tensor,
    w: torch.Tensor,
    align: MoeAlignment,
    rows_per_a: int,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """out [num_pairs, N] (out_dtype, else a's): pair p's row is a[p // rows_per_a] @ w[its
    expert]^T, times scale[p] (a flat [num_pairs] float tensor) when given; w is [E, N, K]."""
    if min(align.block_m, block_n, block_k) < 16:
        raise ValueError(
            f"tl.dot needs blocks of 16 or more; got {align.block_m}, {block_n}, {block_k}"
        )
    # Weighted rows are summed over a token's slots: another rank's pairs, never computed,
    # must add zeros there.
    new = torch.empty if scale is None else torch.zeros
    out = new((align.num_pairs, w.shape[1]), dtype=out_dtype or a.dtype, device=a.device)
    if align.num_pairs == 0:
        return out
    grid = (align.expert_ids.shape[0], triton.cdiv(w.shape[1], block_n))
    _expert_matmul_kernel[grid](
        a,
        w,
        out,
        scale if scale is not None else out,  # never read without SCALE
        align.sorted_ids,
        align.expert_ids,
        align.num_padded,
        align.num_pairs,
        w.shape[1],
        w.shape[2],
        a.stride(0),
        *w.stride(),
        out.stride(0),
        ROWS_PER_A=rows_per_a,
        SCALE=scale is not None,
        BLOCK_M=align.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    return out


def check_moe_inputs(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> None:
    """ValueError naming what is wrong with a fused-MoE call's arguments (ids must also lie in
    [0, E], E meaning another rank's expert: the router's contract, not checked here since it
    would sync the host)."""
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError("x must be [T, H], gate_up [E, 2I, H] and down [E, H, I]")
    num_experts, hidden, inter = down.shape
    if gate_up.shape != (num_experts, 2 * inter, hidden) or x.shape[1] != hidden:
        raise ValueError(
            f"x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} "
            "do not agree on E, H and I"
        )
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        raise ValueError(
            f"weights and ids must both be [T, k]; got {tuple(weights.shape)}, {tuple(ids.shape)}"
        )
    check_dtype("ids", ids, INDEX_DTYPES)
    check_dtype("weights", weights, FLOAT_DTYPES)
    check_dtype("x", x, FLOAT_DTYPES)
    if not x.dtype == gate_up.dtype == down.dtype:
        raise ValueError(
            f"x, gate_up, down must share a dtype; got {x.dtype}, {gate_up.dtype}, {down.dtype}"
        )
    if x.stride(1) != 1:
        raise ValueError(f"x rows must be contiguous; strides {x.stride()}")
    check_one_device(x, gate_up, down, weights, ids)


def fused_moe_triton(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    block_m: int | None = None,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
) -> torch.Tensor:
    """As `fused_moe_ref`: each token's chosen experts' SwiGLU outputs [T, H] summed by their
    weights. Matmuls accumulate in float32; the intermediate and output have x's dtype. No
    device-to-host sync. `block_m` (None: by pairs per expert), `block_n`, `block_k` tune it."""
    check_moe_inputs(x, gate_up, down, weights, ids)
    num_tokens, top_k = ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    num_experts = down.shape[0]
    block_m = block_m or pick_block_m(ids.numel(), num_experts)
    align = align_pairs(ids, num_experts, block_m)
    tiles = {"block_n": block_n, "block_k": block_k}
    gate, up = expert_matmul(x, gate_up, align, top_k, **tiles).chunk(2, dim=-1)
    act = F.silu(gate) * up
    scale = weights.reshape(-1).contiguous()
    # Weighted rows in float32, so the k slots are summed before the one rounding to x's dtype.
    rows = expert_matmul(act, down, align, 1, scale, torch.float32, **tiles)
    return rows.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)
