"""Every Triton launcher against its torch reference: on CPU by the Triton interpreter, on a
GPU (PDSERVE_TEST_DEVICE=cuda) compiled for real, bf16 included.

The interpreter is chosen when a kernel is decorated, so TRITON_INTERPRET must be set before
any kernels.* Triton module is imported.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from tests.devices import ON_CUDA, TEST_DEVICE, require_device

if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed; the torch references still run")

from pdserve.kernels.cpu import gather_pages, scatter_pages, store_kv  # noqa: E402
from pdserve.kernels.page_copy import gather_pages_triton, scatter_pages_triton  # noqa: E402
from pdserve.kernels.paged_attention import paged_attention_triton  # noqa: E402
from pdserve.kernels.paged_decode import paged_decode_triton  # noqa: E402
from pdserve.kernels.reference import combine_splits_ref  # noqa: E402
from pdserve.kernels.split_combine import combine_splits_triton  # noqa: E402
from pdserve.kernels.store_kv import store_kv_triton  # noqa: E402
from tests.kernels.test_reference import (  # noqa: E402
    DECODE_BATCH,
    MIXED_BATCH,
    PagedBatch,
    make_paged_batch,
    random_slots,
    run_attention,
    run_ref,
)

# fp32 differs from the reference only by summation order. fp16 adds the flash-attention
# rounding of P to fp16 before P @ V and the final fp16 output rounding, each ~2**-11 relative
# on outputs of magnitude ~1, so a few e-3 absolute.
# bf16 has 8 significant bits (2**-8 relative): the same two roundings, 8x coarser.
TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 1e-2),
    torch.bfloat16: (4e-2, 5e-2),
}
# Triton 3.9's interpreter multiplies bf16 dot operands as their raw uint16 bits
# (InterpreterBuilder.create_dot), so bf16 attention is checked on a GPU only.
BF16_DOT_BROKEN = pytest.mark.skipif(
    not ON_CUDA, reason="Triton interpreter tl.dot on bf16 is wrong; runs on CUDA"
)
DEVICE = torch.device(TEST_DEVICE)


@pytest.fixture(autouse=True)
def _device_present() -> None:
    require_device()


def assert_copied(actual: torch.Tensor, expected: torch.Tensor, source_dtype: torch.dtype) -> None:
    """Bit-exact, except fp32 -> bf16 within one bf16 ulp under the interpreter: it truncates
    that cast (cast_impl passes no rounding mode) where GPUs, like torch, round to nearest even."""
    actual, expected = actual.cpu(), expected.cpu()
    if actual.dtype == torch.bfloat16 and source_dtype == torch.float32 and not ON_CUDA:
        torch.testing.assert_close(actual, expected, atol=0, rtol=2**-7)
    else:
        assert torch.equal(actual, expected)


def on_device(batch: PagedBatch) -> PagedBatch:
    """The batch's kernel inputs on the test device (the dense copies stay for the oracle)."""
    moved = {f: getattr(batch, f).to(DEVICE) for f in (
        "query", "k_cache", "v_cache", "block_tables", "query_start_loc", "seq_lens"
    )}  # fmt: skip
    return dataclasses.replace(batch, **moved)


def run_triton(batch: PagedBatch, scale: float, window: int | None, fn=None) -> torch.Tensor:
    return run_attention(fn or paged_attention_triton, on_device(batch), scale, window).cpu()


@pytest.mark.parametrize(
    "group, head_dim, block_size, window",
    [(1, 64, 16, None), (4, 128, 32, 7), (8, 64, 32, None), (8, 128, 16, 20), (4, 96, 16, None)],
)
@pytest.mark.parametrize("spec", [MIXED_BATCH, DECODE_BATCH], ids=["mixed", "decode"])
def test_paged_attention_fp32(group, head_dim, block_size, window, spec):
    batch = make_paged_batch(spec, 2 * group, 2, head_dim, block_size, seed=group + head_dim)
    out = run_triton(batch, head_dim**-0.5, window)
    expected = run_ref(batch, head_dim**-0.5, window)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "dtype", [torch.float16, pytest.param(torch.bfloat16, marks=BF16_DOT_BROKEN)]
)
@pytest.mark.parametrize("group, head_dim, window", [(1, 128, None), (8, 64, 9)])
def test_paged_attention_half(dtype, group, head_dim, window):
    batch = make_paged_batch(MIXED_BATCH, 2 * group, 2, head_dim, 16, dtype, seed=3)
    out = run_triton(batch, head_dim**-0.5, window)
    assert out.dtype == dtype
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out, run_ref(batch, head_dim**-0.5, window), atol=atol, rtol=rtol)


def test_paged_attention_single_sequence_and_padded_tokens():
    # One sequence (B == 1 exercises the tile search's edge) followed by 5 padding tokens
    # that belong to no sequence and must be left alone.
    batch = make_paged_batch([(30, 3)], 8, 2, 64, 16)
    padded = on_device(dataclasses.replace(
        batch, query=torch.cat([batch.query, torch.randn(5, 8, 64)])
    ))  # fmt: skip
    out = run_attention(paged_attention_triton, padded, 0.125, None).cpu()
    torch.testing.assert_close(out[:3], run_ref(batch, 0.125, None), atol=1e-4, rtol=1e-4)


# Decode steps: context lengths from one key to several tiles of BLOCK_N, one sequence per row.
LONG_DECODE = [(0, 1), (40, 1), (15, 1), (200, 1), (63, 1), (64, 1)]


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize(
    "group, head_dim, block_size, window", [(1, 64, 16, None), (4, 128, 32, 70), (8, 96, 16, None)]
)
def test_paged_decode_matches_ref(splits, group, head_dim, block_size, window):
    batch = make_paged_batch(LONG_DECODE, 2 * group, 2, head_dim, block_size, seed=splits)
    decode = functools.partial(paged_decode_triton, splits=splits, block_n=16)
    out = run_triton(batch, head_dim**-0.5, window, fn=decode)
    torch.testing.assert_close(out, run_ref(batch, head_dim**-0.5, window), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "dtype", [torch.float16, pytest.param(torch.bfloat16, marks=BF16_DOT_BROKEN)]
)
def test_paged_decode_half_with_splits(dtype):
    batch = make_paged_batch(LONG_DECODE, 8, 2, 128, 16, dtype, seed=5)
    decode = functools.partial(paged_decode_triton, splits=4, block_n=32)
    out = run_triton(batch, 128**-0.5, None, fn=decode)
    assert out.dtype == dtype
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out, run_ref(batch, 128**-0.5, None), atol=atol, rtol=rtol)


def test_paged_decode_skips_padding_sequences_of_a_captured_batch():
    # A CUDA-graph batch padded from 3 real sequences to 5: the padding ones have no query
    # token (query_start_loc repeats its last value) and a length of 0.
    batch = make_paged_batch(DECODE_BATCH, 8, 2, 64, 16, seed=2)
    pad = dataclasses.replace(
        batch,
        query=torch.cat([batch.query, torch.randn(2, 8, 64)]),
        block_tables=torch.cat([batch.block_tables, batch.block_tables[:2]]),
        query_start_loc=torch.cat([batch.query_start_loc, batch.query_start_loc[-1:].repeat(2)]),
        seq_lens=torch.cat([batch.seq_lens, torch.zeros(2, dtype=torch.int32)]),
    )
    decode = functools.partial(paged_decode_triton, splits=2, block_n=16)
    out = run_triton(pad, 0.125, None, fn=decode)
    torch.testing.assert_close(out[:3], run_ref(batch, 0.125, None), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("splits", [2, 5])
def test_split_combine_matches_ref(splits):
    gen = torch.Generator().manual_seed(splits)
    parts = torch.randn(3, 4, splits, 128, generator=gen)
    lse = torch.randn(3, 4, splits, generator=gen) * 4
    lse[0, 1, 1:] = float("-inf")  # splits past a short sequence's end: no keys, weight 0
    lse[2, 3] = float("-inf")  # a row that saw no key at all stays finite
    expected = torch.full((3, 4, 96), float("nan"))
    combine_splits_ref(parts, lse, expected)
    out = torch.full((3, 4, 96), float("nan"), device=DEVICE)
    combine_splits_triton(parts.to(DEVICE), lse.to(DEVICE), out)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[0, 1].cpu(), parts[0, 1, 0, :96])
    assert torch.isfinite(out).all()


def test_paged_decode_refuses_a_prefill_batch():
    batch = on_device(make_paged_batch([(3, 2), (4, 1)], 4, 2, 64, 16))
    batch = dataclasses.replace(batch, seq_lens=batch.seq_lens[:1],
                                query_start_loc=batch.query_start_loc[:2],
                                block_tables=batch.block_tables[:1])  # fmt: skip
    with pytest.raises(ValueError, match="one token per sequence"):
        run_attention(paged_decode_triton, batch, 0.125, None)


@pytest.mark.parametrize(
    "key_dtype, cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32),
    ],
)
@pytest.mark.parametrize("num_kv_heads, head_dim, block_size", [(1, 64, 16), (3, 128, 32)])
def test_store_kv_matches_ref(key_dtype, cache_dtype, num_kv_heads, head_dim, block_size):
    num_tokens, num_blocks = 11, 4
    # K and V as column slices of one fused qkv projection: token stride != heads * head_dim.
    qkv = torch.randn(num_tokens, 4 * num_kv_heads, head_dim).to(key_dtype)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 3 * num_kv_heads :]
    # Block 0 guards each half: a skipped slot (-1) written anyway would land in it.
    buffer = torch.randn(2, 1 + num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype)
    expected = buffer.clone()
    slots = random_slots(num_tokens, num_blocks, block_size, seed=num_kv_heads)
    store_kv(key, value, expected[0, 1:], expected[1, 1:], slots)
    buffer, key, value = buffer.to(DEVICE), key.to(DEVICE), value.to(DEVICE)
    store_kv_triton(key, value, buffer[0, 1:], buffer[1, 1:], slots.to(DEVICE, torch.int32))
    assert_copied(buffer, expected, key_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "planes, heads, block_size, head_dim",
    [(2, 2, 16, 64), (2, 2, 32, 128), (1, 1, 16, 40), (1, 1, 32, 576)],  # K/V; MLA latents
)
def test_gather_and_scatter_pages_match_ref(dtype, planes, heads, block_size, head_dim):
    # A layer of a [planes, layers, N, ...] cache: its K and V halves are far apart in memory.
    kv = torch.randn(planes, 3, 9, block_size, heads, head_dim).to(dtype).to(DEVICE)
    layer = kv[:, 1]
    ids = torch.tensor([7, 2, 8, 0], device=DEVICE)
    pages = gather_pages_triton(layer, ids)
    assert torch.equal(pages.cpu(), gather_pages(layer.cpu(), ids.cpu()))
    out = torch.full_like(pages, float("nan"))
    assert gather_pages_triton(layer, ids, out) is out and torch.equal(out, pages)

    new_pages = torch.randn(planes, 3, block_size, heads, head_dim)  # fp32: scatter casts
    ids = torch.tensor([4, 1, 6], dtype=torch.int32)
    expected = layer.cpu().clone()
    scatter_pages(expected, ids, new_pages)
    scatter_pages_triton(layer, ids.to(DEVICE), new_pages.to(DEVICE))
    assert_copied(layer, expected, new_pages.dtype)


def test_store_kv_rejects_bad_inputs():
    key = torch.randn(4, 2, 64)
    cache = torch.zeros(3, 16, 2, 64)
    slots = torch.arange(4)
    with pytest.raises(ValueError, match="cache rows"):
        store_kv_triton(key[:, :, :32], key[:, :, :32], cache, cache, slots)
    with pytest.raises(ValueError, match="dtype"):
        store_kv_triton(key, key, cache.int(), cache.int(), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv_triton(key, key, cache, cache, slots.float())
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.randn(4, 2, 128)[:, :, ::2]
        store_kv_triton(strided, strided, cache, cache, slots)


def test_paged_attention_rejects_bad_inputs():
    batch = make_paged_batch([(3, 2)], 4, 2, 64, 16)
    good = dict(
        query=batch.query,
        k_cache=batch.k_cache,
        v_cache=batch.v_cache,
        block_tables=batch.block_tables,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        scale=0.125,
    )
    bad_cases = [
        (dict(query=torch.randn(2, 3, 64)), "multiple"),
        (dict(query=batch.query.half()), "dtype"),
        (dict(seq_lens=torch.tensor([5, 5], dtype=torch.int32)), "seq_lens"),
        (dict(block_tables=batch.block_tables.float()), "dtype"),
        (dict(sliding_window=0), "sliding_window"),
    ]
    for change, message in bad_cases:
        with pytest.raises(ValueError, match=message):
            paged_attention_triton(**{**good, **change})


def test_page_copy_rejects_bad_inputs():
    layer = torch.zeros(2, 5, 16, 2, 64)
    ids = torch.tensor([1, 3])
    with pytest.raises(ValueError, match=r"\[planes \(1 or 2\), n"):
        gather_pages_triton(layer[0], ids)
    with pytest.raises(ValueError, match=r"\[planes"):
        gather_pages_triton(torch.zeros(3, 5, 16, 2, 64), ids)
    with pytest.raises(ValueError, match="do not match"):  # K/V pages into a latent cache
        scatter_pages_triton(layer[:1], ids, torch.zeros(2, 2, 16, 2, 64))
    with pytest.raises(ValueError, match="out"):
        gather_pages_triton(layer[:1], ids, torch.zeros(2, 2, 16, 2, 64))
    with pytest.raises(ValueError, match="block_ids"):
        gather_pages_triton(layer, ids.float())
    with pytest.raises(ValueError, match="do not match"):
        scatter_pages_triton(layer, ids, torch.zeros(2, 3, 16, 2, 64))
    with pytest.raises(ValueError, match="compact"):
        gather_pages_triton(layer.transpose(2, 3), ids)
    with pytest.raises(ValueError, match="out"):
        gather_pages_triton(layer, ids, torch.zeros(2, 3, 16, 2, 64))
    with pytest.raises(ValueError, match="out"):
        gather_pages_triton(layer, ids, torch.zeros(2, 2, 16, 2, 64, dtype=torch.float16))
