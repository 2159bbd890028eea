"""The CPU kernels (kernels/cpu.py): store_kv and the page copies against plain indexing; the
paged attention against the reference it replaced on the hot path and against dense attention,
on the NaN-poisoned paged batches of test_reference: a read of anything a sequence does not own
poisons the output."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve.kernels import cpu, cpu_attention
from pdserve.kernels.cpu import (
    gather_pages,
    paged_attention_cpu,
    scatter_pages,
    step_plan,
    store_kv,
)
from tests.kernels.test_reference import (
    DECODE_BATCH,
    MIXED_BATCH,
    dense_attention,
    make_paged_batch,
    move_first_block,
    random_slots,
    run_attention,
    run_ref,
)

# Decode rows of ragged lengths (two length groups), a prefill chunk over a cached prefix of
# several blocks, and a fresh prompt.
RAGGED_BATCH = [(100, 1), (37, 1), (60, 1), (70, 1), (9, 1), (300, 40), (0, 23)]
SPECS = [MIXED_BATCH, DECODE_BATCH, RAGGED_BATCH]


@pytest.fixture(params=[64, 1 << 20], ids=["block-chunks", "default-chunks"])
def chunk_bytes(request, monkeypatch) -> int:
    """64 bytes: every chunk is one block, so every merge path runs; else the default."""
    monkeypatch.setattr(cpu, "CHUNK_BYTES", request.param)
    return request.param


def run_new(batch, scale: float, window: int | None) -> torch.Tensor:
    return run_attention(paged_attention_cpu, batch, scale, window)


@pytest.mark.parametrize("spec", SPECS, ids=["mixed", "decode", "ragged"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [None, 1, 7, 40])
def test_matches_reference_and_dense_in_float32(spec, group, window, chunk_bytes):
    batch = make_paged_batch(spec, 2 * group, 2, 64, block_size=16)
    out = run_new(batch, 0.125, window)
    torch.testing.assert_close(out, run_ref(batch, 0.125, window), atol=1e-5, rtol=1e-5)
    dense = dense_attention(batch, 0.125, window)
    torch.testing.assert_close(out.double(), dense, atol=1e-5, rtol=1e-5)


def test_small_chunks_really_split_and_merge(chunk_bytes):
    batch = make_paged_batch(RAGGED_BATCH, 8, 2, 64, block_size=16)
    plan = step_plan(batch.block_tables, batch.query_start_loc, batch.seq_lens, 16, None, 512)
    most = max(len(g.chunks) for g in plan.groups)
    # The prefill row's 340 keys are 22 blocks of 8 KiB (512 bytes a token): 1 MiB holds all.
    assert most == (22 if chunk_bytes == 64 else 1)
    prefill = next(g for g in plan.groups if g.q_len == 40)
    assert prefill.n == 1 and prefill.tokens.tolist() == list(range(5, 45))


@pytest.mark.parametrize("window", [None, 7])
def test_bf16_within_tolerance_of_the_float32_reference(window, chunk_bytes):
    batch = make_paged_batch(RAGGED_BATCH, 8, 2, 64, block_size=16, dtype=torch.bfloat16)
    out = run_new(batch, 0.125, window)
    assert out.dtype == torch.bfloat16
    ref = run_ref(batch, 0.125, window)  # accumulates in float32, rounds once
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("spec", [[(130, 1), (40, 1), (77, 1)], [(90, 12)]], ids=["dec", "pre"])
def test_latent_as_keys_and_values_reads_once_and_matches(spec, chunk_bytes):
    # MLA's absorbed attention: one-plane cache [blocks, bs, 1, rank + rope], keys the whole
    # latent, values its first `rank` dims; passing the cache twice reads it once.
    rank, rope = 48, 16
    batch = make_paged_batch(spec, 8, 1, rank + rope, block_size=16)
    latent = replace(
        batch, v_cache=batch.k_cache, dense_v=[k.clone() for k in batch.dense_k]
    )  # dense V = dense K: what the kernel computes before the caller slices
    out = run_new(latent, 0.1, None)
    torch.testing.assert_close(out, run_ref(latent, 0.1, None), atol=1e-5, rtol=1e-5)
    dense = dense_attention(latent, 0.1, None)
    torch.testing.assert_close(out[..., :rank].double(), dense[..., :rank], atol=1e-5, rtol=1e-5)


def test_plan_is_made_once_per_metadata_and_remade_when_it_changes():
    batch = make_paged_batch(MIXED_BATCH, 8, 2, 64, block_size=16)
    meta = (batch.block_tables, batch.query_start_loc, batch.seq_lens)
    first = step_plan(*meta, 16, None, 512)
    assert step_plan(*meta, 16, None, 512) is first  # every layer of the step
    windowed = step_plan(*meta, 16, 7, 512)  # a layer with a sliding window: its own plan
    assert windowed is not first and step_plan(*meta, 16, None, 512) is first

    other_layer = replace(batch, k_cache=batch.k_cache * -2, v_cache=batch.v_cache + 1)
    other_layer = replace(
        other_layer,
        dense_k=[k * -2 for k in batch.dense_k],
        dense_v=[v + 1 for v in batch.dense_v],
    )
    dense = dense_attention(other_layer, 0.125, None)
    torch.testing.assert_close(run_new(other_layer, 0.125, None).double(), dense, atol=1e-5, rtol=0)

    move_first_block(batch)
    assert step_plan(*meta, 16, None, 512) is not first
    dense = dense_attention(batch, 0.125, None)
    torch.testing.assert_close(run_new(batch, 0.125, None).double(), dense, atol=1e-5, rtol=0)


def test_inference_mode_metadata_gets_one_plan_per_step():
    # The engine builds metadata under inference mode (no version counters): a new step is new
    # tensors, and each step's plan lives on its own seq_lens.
    batch = make_paged_batch(DECODE_BATCH, 4, 2, 64, block_size=16)
    with torch.inference_mode():
        steps = [tuple(t.clone() for t in (batch.block_tables, batch.query_start_loc,
                                           batch.seq_lens)) for _ in range(2)]  # fmt: skip
        plans = [step_plan(*meta, 16, None, 512) for meta in steps]
        assert plans[0] is not plans[1]
        assert all(step_plan(*m, 16, None, 512) is p for m, p in zip(steps, plans, strict=True))
        out = run_new(replace(batch, seq_lens=steps[0][2]), 0.125, None)
    dense = dense_attention(batch, 0.125, None)
    torch.testing.assert_close(out.double(), dense, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_slots_and_skips_negative(cache_dtype):
    num_blocks, block_size, heads, dim = 6, 16, 2, 64
    key, value = torch.randn(2, 9, heads, dim).unbind(0)
    k_cache = torch.zeros(num_blocks, block_size, heads, dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = random_slots(9, num_blocks, block_size, seed=1)
    store_kv(key, value, k_cache, v_cache, slots)
    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = key[t].to(cache_dtype)
            expected_v[slot // block_size, slot % block_size] = value[t].to(cache_dtype)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_in_one_call_equals_indexing_from_split_rows_into_a_layer_cache(dtype):
    # The C++ store (cpu_attention.store_kv) takes K/V of the cache's dtype as a step makes
    # them: split from one projection (rows strided), into the K and V halves of one layer's
    # cache [2, N, bs, Hkv, D]; negative slots skipped, a slot past the cache refused.
    num_blocks, block_size, heads, dim, tokens = 6, 16, 3, 64, 11
    fused = torch.randn(tokens, (3 + 2) * heads * dim).to(dtype)  # q (3 groups), k, v
    _, key, value = fused.split([3 * heads * dim, heads * dim, heads * dim], -1)
    key, value = key.view(tokens, heads, dim), value.view(tokens, heads, dim)
    layer = torch.zeros(2, num_blocks, block_size, heads, dim, dtype=dtype)
    slots = random_slots(tokens, num_blocks, block_size, seed=3)
    assert cpu_attention.stores(key, value, layer[0])
    cpu_attention.store_kv(key, value, layer[0], layer[1], slots)
    expected = torch.zeros_like(layer)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[0, slot // block_size, slot % block_size] = key[t]
            expected[1, slot // block_size, slot % block_size] = value[t]
    assert (slots < 0).any() and torch.equal(layer, expected)
    past = slots.clone()
    past[2] = num_blocks * block_size
    with pytest.raises(RuntimeError, match="past the cache"):
        cpu_attention.store_kv(key, value, layer[0], layer[1], past)


@pytest.mark.parametrize("shape", [(2, 7, 16, 2, 64), (1, 7, 16, 1, 40)])  # K/V; a latent
def test_gather_then_scatter_moves_exactly_the_named_blocks(shape):
    layer = torch.randn(shape)
    ids = torch.tensor([5, 0, 3], dtype=torch.int32)
    pages = gather_pages(layer, ids)
    for i, block in enumerate(ids.tolist()):
        assert torch.equal(pages[:, i], layer[:, block])
    target = torch.zeros_like(layer)
    scatter_pages(target, torch.tensor([1, 6, 2]), pages)
    assert torch.equal(target[:, [1, 6, 2]], pages)
    assert not target[:, [0, 3, 4, 5]].any()


def test_gather_into_out_writes_the_given_buffer_or_refuses_it():
    layer = torch.randn(2, 7, 16, 2, 64)
    ids = torch.tensor([5, 0, 3])
    staging = torch.zeros(4 * layer[:, :3].numel() * 4, dtype=torch.uint8)  # bytes, like a ring
    out = staging[4096 : 4096 + layer[:, :3].numel() * 4].view(torch.float32).view(2, 3, 16, 2, 64)
    assert gather_pages(layer, ids, out=out) is out
    assert torch.equal(out, gather_pages(layer, ids))
    assert not staging[:4096].any()
    for bad in (out[:, :2], out.to(torch.float16), out.transpose(2, 3)):
        with pytest.raises(ValueError, match="out"):
            gather_pages(layer, ids, out=bad)


def test_a_kernel_source_has_the_shared_vector_code_pasted_in() -> None:
    # The kernels share bf16 widening and exp16 through kernels/cpu_simd.h: each extension is
    # built from one text, so the header is pasted in where the source includes it.
    from pdserve.kernels import cpu_quant

    for name in ("cpu_attention.cpp", "cpu_fused.cpp", "cpu_quant.cpp"):
        source = cpu_quant.kernel_source(name)
        assert '#include "cpu_simd.h"' not in source
        assert source.count("inline __m512 exp16(__m512 x)") == 1
        assert source.count("inline __m512 load16(const c10::BFloat16* p)") == 1
