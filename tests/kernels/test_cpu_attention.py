"""The in-place decode kernel (kernels/cpu_attention) against the reference and dense attention,
on test_reference's NaN-poisoned paged batches (a read of any slot a row does not own poisons
its output), on both paths: AVX512 and the plain loop. Its route through paged_attention_cpu
over many steps is test_cpu_mixed_steps'."""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import pytest
import torch

from pdserve.kernels import cpu_attention
from pdserve.kernels.cpu import IN_PLACE_KEYS, ROW_QUERIES, paged_attention_cpu, step_plan
from tests.kernels.test_reference import dense_attention, make_paged_batch, run_attention, run_ref

# Ragged decode rows: part-full and just-opened blocks, one of a single token, one long.
DECODE_ROWS = [(100, 1), (37, 1), (60, 1), (0, 1), (15, 1), (300, 1), (31, 1)]
PATHS = [
    pytest.param(True, id="avx512", marks=pytest.mark.skipif(
        not cpu_attention.cpu_has_avx512(), reason="no AVX512 on this CPU")),
    pytest.param(False, id="plain"),
]  # fmt: skip


# Verify rows: each sequence's queries one kernel row, ragged (1 to ROW_QUERIES of them), a
# row's queries across a block boundary (31 + 2: keys 32 and 33), one opening a block (16 + 4),
# one whose every key is a query of it (0 + 3), one long.
VERIFY_ROWS = [(100, 3), (37, 1), (5, 8), (0, 3), (31, 2), (300, ROW_QUERIES), (16, 4)]


def decode(batch, scale: float, window: int | None, avx512: bool, rows=False) -> torch.Tensor:
    """The kernel on a batch: one query a row, or (`rows`) each sequence's queries a row."""
    starts = batch.query_start_loc
    queries = (starts[1:] - starts[:-1]).int() if rows else None
    return cpu_attention.paged_decode(
        batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
        scale, window, avx512, queries,
    )  # fmt: skip


@pytest.mark.parametrize("avx512", PATHS)
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window", [None, 1, 7, 40])
def test_matches_reference_and_dense_in_float32(avx512, group, window):
    assert_float32_exact(DECODE_ROWS, group, window, avx512, rows=False)


def assert_float32_exact(layout, group: int, window: int | None, avx512: bool, rows: bool):
    batch = make_paged_batch(layout, 2 * group, 2, 64, block_size=16)
    out = decode(batch, 0.125, window, avx512, rows=rows)
    torch.testing.assert_close(out, run_ref(batch, 0.125, window), atol=1e-5, rtol=1e-5)
    dense = dense_attention(batch, 0.125, window)
    torch.testing.assert_close(out.double(), dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("avx512", PATHS)
@pytest.mark.parametrize("window", [None, 7])
def test_bf16_within_tolerance_of_the_float32_reference(avx512, window):
    assert_bf16_close(DECODE_ROWS, window, avx512, rows=False)


def assert_bf16_close(layout, window: int | None, avx512: bool, rows: bool):
    batch = make_paged_batch(layout, 9, 3, 64, block_size=16, dtype=torch.bfloat16)
    out = decode(batch, 0.125, window, avx512, rows=rows)
    assert out.dtype == torch.bfloat16
    ref = run_ref(replace(batch, query=batch.query.float(), k_cache=batch.k_cache.float(),
                          v_cache=batch.v_cache.float()), 0.125, window)  # fmt: skip
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("avx512", PATHS)
def test_latent_as_keys_and_values(avx512):
    # MLA's absorbed attention: one KV head, keys the whole latent, values the same rows.
    batch = make_paged_batch(DECODE_ROWS, 8, 1, 576, block_size=16)
    latent = replace(batch, v_cache=batch.k_cache, dense_v=[k.clone() for k in batch.dense_k])
    out = decode(latent, 0.1, None, avx512)
    torch.testing.assert_close(out, run_ref(latent, 0.1, None), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("avx512", PATHS)
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [None, 1, 2, 5, 40])
def test_rows_of_several_queries_are_causal_among_them_in_float32(avx512, group, window):
    # A window under a row's queries (1, 2, 5) makes its later queries skip its first keys.
    assert_float32_exact(VERIFY_ROWS, group, window, avx512, rows=True)


# Prefill chunks as kernel rows: a chunk's earlier queries see none of its later blocks (the
# kernel skips them), a window's later queries none of its first; one chunk opens the sequence,
# one follows a cached prefix mid-block, one ends mid-block.
CHUNK_ROWS = [(0, 40), (20, 30), (7, 50), (33, 1)]


@pytest.mark.parametrize("avx512", PATHS)
@pytest.mark.parametrize("window", [None, 1, 5, 17, 40])
def test_prefill_chunks_as_rows_skip_the_blocks_a_query_does_not_see(avx512, window):
    assert_float32_exact(CHUNK_ROWS, 3, window, avx512, rows=True)


@pytest.mark.parametrize("avx512", PATHS)
@pytest.mark.parametrize("window", [None, 3])
def test_rows_of_several_queries_in_bf16_within_tolerance(avx512, window):
    assert_bf16_close(VERIFY_ROWS, window, avx512, rows=True)


def test_a_verify_step_past_in_place_keys_is_one_kernel_row_a_sequence():
    # Verify rows (up to ROW_QUERIES queries) over long contexts, a decode row, and a prefill
    # chunk of ROW_QUERIES + 1 queries past IN_PLACE_KEYS that flash keeps.
    long = IN_PLACE_KEYS + 50
    spec = [(long, 4), (long + 90, 1), (long, ROW_QUERIES), (long, ROW_QUERIES + 1)]
    batch = make_paged_batch(spec, 9, 3, 64, block_size=16)
    meta = (batch.block_tables, batch.query_start_loc, batch.seq_lens)
    plan = step_plan(*meta, 16, None, 384, True)
    assert plan.decode.queries.tolist() == [4, 1, ROW_QUERIES]
    assert plan.decode.seq_lens.tolist() == [long + 4, long + 91, long + ROW_QUERIES]
    assert plan.decode.tokens.tolist() == list(range(5 + ROW_QUERIES))
    assert [g.q_len for g in plan.groups] == [ROW_QUERIES + 1]
    for window in (None, 6):
        out = run_attention(paged_attention_cpu, batch, 0.125, window)
        torch.testing.assert_close(out, run_ref(batch, 0.125, window), atol=1e-5, rtol=1e-5)


def test_a_head_dim_off_16_takes_the_plain_loop_only():
    batch = make_paged_batch(DECODE_ROWS, 4, 2, 40, block_size=16)
    assert not cpu_attention.uses_avx512(40)
    out = decode(batch, 0.2, None, False)
    torch.testing.assert_close(out, run_ref(batch, 0.2, None), atol=1e-5, rtol=1e-5)
    if cpu_attention.cpu_has_avx512():
        with pytest.raises(RuntimeError, match="multiple of 16"):
            decode(batch, 0.2, None, True)


def test_a_mixed_step_sends_decode_rows_and_short_prefills_to_the_kernel():
    # decode, a short prompt, a chunk over a prefix past IN_PLACE_KEYS, a long prompt, decode
    spec = [(37, 1), (0, 19), (190, 9), (0, 200), (32, 1)]
    batch = make_paged_batch(spec, 8, 2, 64, block_size=16)
    meta = (batch.block_tables, batch.query_start_loc, batch.seq_lens)
    plan = step_plan(*meta, 16, None, 512, True)
    assert plan.decode.tokens.tolist() == [0, *range(1, 20), 229]
    assert plan.decode.seq_lens.tolist() == [38, *range(1, 20), 33]  # each row its position + 1
    assert sorted(g.q_len for g in plan.groups) == [9, 200]  # only the long ones left for flash
    out = run_attention(paged_attention_cpu, batch, 0.125, None)
    torch.testing.assert_close(out, run_ref(batch, 0.125, None), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("avx512", PATHS)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("prefix", [0, 40])
def test_short_prefill_chunks_in_place_match_the_reference(avx512, window, prefix):
    # Chunks up to IN_PLACE_KEYS keys (one at exactly that many) go to the kernel, row by row.
    spec = [(prefix, 23), (0, IN_PLACE_KEYS), (prefix + 3, 1), (IN_PLACE_KEYS - 40, 40)]
    batch = make_paged_batch(spec, 8, 2, 64, block_size=16)
    meta = (batch.block_tables, batch.query_start_loc, batch.seq_lens)
    plan = step_plan(*meta, 16, window, 512, True)
    assert plan.groups == () and plan.decode.tokens is None  # every row in place
    with mock.patch.object(cpu_attention, "uses_avx512", lambda _: avx512):
        out = run_attention(paged_attention_cpu, batch, 0.125, window)
    torch.testing.assert_close(out, run_ref(batch, 0.125, window), atol=1e-5, rtol=1e-5)


def test_bad_input_is_refused_with_a_reason():
    batch = make_paged_batch(DECODE_ROWS, 4, 2, 64, block_size=16)
    with pytest.raises(ValueError, match="sliding_window"):
        decode(batch, 0.125, 0, False)
    with pytest.raises(RuntimeError, match="block table names block"):
        decode(replace(batch, block_tables=batch.block_tables + 1000), 0.125, None, False)
    with pytest.raises(RuntimeError, match="outside its block table"):
        decode(replace(batch, seq_lens=batch.seq_lens + 100), 0.125, None, False)
    with pytest.raises(RuntimeError, match="one dtype"):
        decode(replace(batch, query=batch.query.bfloat16()), 0.125, None, False)
    rows = make_paged_batch([(0, 3), (5, 2)], 4, 2, 64, block_size=16)
    with pytest.raises(RuntimeError, match="the rows hold 5 queries, q 4"):
        decode(replace(rows, query=rows.query[:4]), 0.125, None, False, rows=True)
    with pytest.raises(RuntimeError, match="under its 3 queries"):
        decode(replace(rows, seq_lens=rows.seq_lens - 1), 0.125, None, False, rows=True)


def test_the_op_has_a_fake_for_traced_graphs():
    batch = make_paged_batch(DECODE_ROWS, 4, 2, 64, block_size=16)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    out = torch.ops.pdserve.cpu_paged_decode(*args, 0.125, 0, False)
    torch.testing.assert_close(out, run_ref(batch, 0.125, None), atol=1e-5, rtol=1e-5)
    torch.library.opcheck(
        torch.ops.pdserve.cpu_paged_decode.default, (*args, 0.125, 0, False),
        test_utils=("test_schema", "test_faketensor"),
    )  # fmt: skip
    rows = make_paged_batch(VERIFY_ROWS, 4, 2, 64, block_size=16)
    queries = (rows.query_start_loc[1:] - rows.query_start_loc[:-1]).int()
    args = (rows.query, rows.k_cache, rows.v_cache, rows.block_tables, rows.seq_lens, 0.125, 0)
    out = torch.ops.pdserve.cpu_paged_decode(*args, False, queries)
    torch.testing.assert_close(out, run_ref(rows, 0.125, None), atol=1e-5, rtol=1e-5)
    torch.library.opcheck(
        torch.ops.pdserve.cpu_paged_decode.default, (*args, False, queries),
        test_utils=("test_schema", "test_faketensor"),
    )  # fmt: skip


@pytest.mark.parametrize("avx512", PATHS)
@pytest.mark.parametrize("rows", [1, 3])
def test_rows_fewer_than_threads_split_by_kv_head(avx512, rows):
    # Fewer rows than threads: a task is one KV head of a row, not the row's every head.
    batch = make_paged_batch(DECODE_ROWS[:rows], 12, 4, 64, block_size=16)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        out = decode(batch, 0.125, 7, avx512)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out, run_ref(batch, 0.125, 7), atol=1e-5, rtol=1e-5)
