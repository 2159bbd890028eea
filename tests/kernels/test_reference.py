"""The reference attention against naive dense (non-paged) computations.

The paged batches built here are also the inputs of the Triton tests: every cache entry no
sequence owns (tails of partial blocks, spare blocks, the block that block-table padding
points to) is NaN, so a kernel that reads anything it should not poisons its output.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from pdserve.kernels.reference import paged_attention_ref

# (context_len, q_len) per sequence: a decode in a partial block, a fresh prefill over three
# blocks, a prefill chunk after a cached prefix, a decode that opens a new block, and a
# sequence with no new tokens this step.
MIXED_BATCH = [(37, 1), (0, 19), (21, 9), (32, 1), (5, 0)]
DECODE_BATCH = [(0, 1), (40, 1), (15, 1)]


@dataclass(frozen=True)
class PagedBatch:
    """One attention call's inputs plus each sequence's K/V laid out densely."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    dense_k: list[torch.Tensor]
    dense_v: list[torch.Tensor]


def make_paged_batch(
    spec: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    """Random K/V for each (context_len, q_len) sequence, stored in shuffled physical blocks."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [ctx + q for ctx, q in spec]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 1  # one padding column more than any sequence needs
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay NaN too
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    poison = physical.pop()  # block-table padding points here
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.full((len(spec), max_blocks), poison, dtype=torch.int32)
    dense_k, dense_v = [], []
    for b, seq_len in enumerate(seq_lens):
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        for j in range(blocks_per_seq[b]):
            block = physical.pop()
            block_tables[b, j] = block
            rows = slice(j * block_size, min((j + 1) * block_size, seq_len))
            k_cache[block, : rows.stop - rows.start] = k[rows]
            v_cache[block, : rows.stop - rows.start] = v[rows]
        dense_k.append(k)
        dense_v.append(v)
    q_lens = torch.tensor([q for _, q in spec])
    query_start_loc = torch.zeros(len(spec) + 1, dtype=torch.int32)
    query_start_loc[1:] = q_lens.cumsum(0)
    query = torch.randn(int(q_lens.sum()), num_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        torch.tensor(seq_lens, dtype=torch.int32),
        dense_k,
        dense_v,
    )


def dense_attention(batch: PagedBatch, scale: float, window: int | None) -> torch.Tensor:
    """Token by token in float64: each query softmaxes over exactly the keys it may see."""
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    group = batch.query.shape[1] // batch.k_cache.shape[2]
    starts = batch.query_start_loc.tolist()
    for b, (k, v) in enumerate(zip(batch.dense_k, batch.dense_v, strict=True)):
        k = k.double()[:, torch.arange(batch.query.shape[1]) // group]  # kv head of each q head
        v = v.double()[:, torch.arange(batch.query.shape[1]) // group]
        q_len = starts[b + 1] - starts[b]
        for i in range(q_len):
            pos = k.shape[0] - q_len + i
            first = 0 if window is None else max(0, pos - window + 1)
            q = batch.query[starts[b] + i].double()
            scores = torch.einsum("hd,khd->hk", q, k[first : pos + 1]) * scale
            out[starts[b] + i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[first : pos + 1])
    return out


def run_attention(fn, batch: PagedBatch, scale: float, window: int | None) -> torch.Tensor:
    """Call a paged-attention implementation (reference or Triton) on a batch."""
    return fn(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.query_start_loc,
        batch.seq_lens,
        scale,
        window,
    )


def run_ref(batch: PagedBatch, scale: float, window: int | None) -> torch.Tensor:
    return run_attention(paged_attention_ref, batch, scale, window)


@pytest.mark.parametrize("spec", [MIXED_BATCH, DECODE_BATCH], ids=["mixed", "decode"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 1, 7])
def test_paged_attention_ref_matches_dense(spec, group, head_dim, window):
    batch = make_paged_batch(spec, 2 * group, 2, head_dim, block_size=16)
    scale = head_dim**-0.5
    out = run_ref(batch, scale, window)
    torch.testing.assert_close(
        out.double(), dense_attention(batch, scale, window), atol=1e-5, rtol=1e-5
    )


def test_attention_plan_is_shared_while_metadata_holds_and_remade_when_it_changes():
    # The reference derives groups, gather indices and masks once per step and reuses them
    # for every layer: the same metadata tensors with other cache contents (another layer),
    # and the same tensors changed in place, must both give the right answer.
    batch = make_paged_batch(MIXED_BATCH, 8, 2, 64, block_size=16)
    scale = 0.125
    torch.testing.assert_close(
        run_ref(batch, scale, None).double(),
        dense_attention(batch, scale, None),
        atol=1e-5,
        rtol=1e-5,
    )

    other_layer = replace(
        batch,
        k_cache=batch.k_cache * -2,
        v_cache=batch.v_cache + 1,
        dense_k=[k * -2 for k in batch.dense_k],
        dense_v=[v + 1 for v in batch.dense_v],
    )
    torch.testing.assert_close(
        run_ref(other_layer, scale, None).double(),
        dense_attention(other_layer, scale, None),
        atol=1e-5,
        rtol=1e-5,
    )

    move_first_block(batch)
    torch.testing.assert_close(
        run_ref(batch, scale, None).double(),
        dense_attention(batch, scale, None),
        atol=1e-5,
        rtol=1e-5,
    )


def move_first_block(batch: PagedBatch) -> None:
    """Move sequence 0's first block to a spare one, poisoning the old place, in place."""
    used = set(batch.block_tables.flatten().tolist())
    spare = next(b for b in range(batch.k_cache.shape[0]) if b not in used)
    old = int(batch.block_tables[0, 0])
    for cache in (batch.k_cache, batch.v_cache):
        cache[spare] = cache[old]
        cache[old] = float("nan")
    batch.block_tables[0, 0] = spare


def test_window_one_returns_own_value():
    # With w = 1 each query sees only its own key, so the output is its V row exactly.
    batch = make_paged_batch([(10, 3)], 4, 4, 64, block_size=16)
    out = run_ref(batch, 0.125, 1)
    torch.testing.assert_close(out, batch.dense_v[0][-3:], atol=1e-6, rtol=0)


def random_slots(num_tokens: int, num_blocks: int, block_size: int, seed: int) -> torch.Tensor:
    """Distinct random slots over the whole cache, with the second token marked skip (-1)."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[1] = -1
    return slots
