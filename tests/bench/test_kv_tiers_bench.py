"""`pdserve bench kv-tiers`' pure parts: the workloads' prompts (the trace's sharing kept), the
oracle's cache size per system, the tier-served requests against recomputing, and the goals.
The bench itself runs SmolLM2 (docs/benchmarks.md), not here."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdserve.bench import kv_tiers
from pdserve.bench.kv_tiers_workloads import TRACE, multiturn, prefix, trace
from pdserve.common.engine.config import CacheConfig

# Mooncake's format: 512-token blocks; ids 0 and 1 shared by the first two requests.
LINES = """\
{"timestamp": 0, "input_length": 2048, "output_length": 5, "hash_ids": [0, 1, 2, 3]}
{"timestamp": 10, "input_length": 1536, "output_length": 5, "hash_ids": [0, 1, 4]}
{"timestamp": 20, "input_length": 1024, "output_length": 5, "hash_ids": [5, 1]}
"""


def options(*argv: str) -> argparse.Namespace:
    return kv_tiers.parse_args(["--model", "unused", *argv])


def test_trace_prompts_share_exactly_the_blocks_the_trace_shares(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(LINES)
    args = options("--trace", str(path), "--length-scale", "0.03125")
    a, b, c = trace(args, vocab=1000)
    assert [len(p) for p in (a, b, c)] == [64, 48, 32]  # 1/32 of the lengths: 16-token blocks
    assert a[:32] == b[:32] and a[32:48] != b[32:48]
    assert a[:16] != c[:16] and a[16:32] == c[16:32]  # id 1's block, after another's
    args.trace_requests = 2
    assert len(trace(args, vocab=1000)) == 2
    args.trace = str(tmp_path / "none.jsonl")
    with pytest.raises(ValueError, match="no trace at"):
        trace(args, vocab=1000)


def test_the_shipped_excerpt_is_the_conversation_trace_at_its_start() -> None:
    assert TRACE.is_file()
    args = options("--trace-requests", "3")
    prompts = trace(args, vocab=49152)
    assert [len(p) for p in prompts] == [106, 114, 113]  # 6758, 7322, 7236 at 1/64
    assert prompts[0][:8] == prompts[1][:8] and prompts[0][8:16] != prompts[1][8:16]


def test_multiturn_and_prefix_prompts_grow_and_repeat_as_described() -> None:
    args = options("--conversations", "2", "--turns", "2", "--first-len", "20",
                   "--message-len", "3", "--documents", "2", "--document-len", "40",
                   "--questions", "2")  # fmt: skip
    first_a, first_b, second_a, second_b = multiturn(args, vocab=1000)
    assert second_a[:20] == first_a and len(second_a) == 26 and second_b[:20] == first_b
    docs = prefix(args, vocab=1000)
    assert [len(p) for p in docs] == [72] * 4
    assert docs[0][:40] == docs[2][:40] and docs[0][40:] != docs[2][40:]


def test_the_oracle_is_as_big_as_the_pool_and_the_host_budget_and_unbounded_on_a_store() -> None:
    args = options("--num-blocks", "10", "--kv-offload-bytes", "1000")
    tiers = SimpleNamespace(block_bytes=300)
    assert kv_tiers.oracle_capacity(args, "none", None) == 9
    assert kv_tiers.oracle_capacity(args, "host", tiers) == 12
    assert kv_tiers.oracle_capacity(args, "file", tiers) is None
    assert kv_tiers.oracle_capacity(args, "redis", tiers) is None


def record(ttfts: list[float], loaded: list[int], lengths: list[int]) -> dict:
    return {"ttft_s": ttfts, "loaded": loaded, "prompt_lengths": lengths}


def test_tier_served_requests_are_set_against_the_same_requests_recomputed() -> None:
    base = record([1.0, 4.0, 6.0, 2.0], [0, 0, 0, 0], [100, 3000, 3000, 100])
    tiered = record([1.0, 0.5, 1.0, 4.0], [0, 2048, 1024, 16], [100, 3000, 3000, 100])
    assert kv_tiers.against_recompute(tiered, base) == {
        "requests": 3, "speedup": 12 / 5.5, "worst": 0.5,
    }  # fmt: skip
    long = kv_tiers.against_recompute(tiered, base, 2048)
    assert long == {"requests": 2, "speedup": 10 / 1.5, "worst": 6.0}
    assert kv_tiers.against_recompute(base, base)["speedup"] is None


def test_goals_name_each_tier_row_met_or_missed() -> None:
    served = {"requests": 2, "speedup": 6.0, "worst": 0.8}
    rows = [
        {"workload": "prefix", "system": "none"},
        {"workload": "prefix", "system": "file", "tier_served": served, "hit_rate": 0.5,
         "tier_served_long": served, "oracle_hit_rate": 0.6},
        {"workload": "prefix", "system": "host", "tier_served": served, "hit_rate": 0.55,
         "tier_served_long": served, "oracle_hit_rate": 0.6},
    ]  # fmt: skip
    got = {g["goal"]: g["status"] for g in kv_tiers.goals(rows)}
    assert got == {
        "prefix, file: store hit TTFT speedup at ≥ 2048 tokens": "met",
        "prefix, file: worst tier-served request against recomputing": "missed",
        "prefix, file: prefix hit rate against Belady's": "missed",  # 0.83 of it
        "prefix, host: worst tier-served request against recomputing": "missed",
        "prefix, host: prefix hit rate against Belady's": "met",  # 0.92 of it
    }


def test_the_bench_runs_the_engines_default_load_policy_cost() -> None:
    assert options().kv_load_policy == CacheConfig().kv_load_policy == "cost"


def test_the_models_error_prices_a_load_by_its_latency_and_rate() -> None:
    """A request recomputing 16 tokens in 0.16 s (0.01 s a token) loads their 2 blocks (2000
    bytes) in 0.05 s + 2000 / 1e5 s instead: predicted 1.0 - 0.16 + 0.07 s."""
    model = {"step_model": [0.0, 0.01, 0.0], "prefill_tok_s": 100.0, "block_bytes": 1000,
             "load_bytes_s": {"redis": 1e5}, "load_latency_s": {"redis": 0.05}}  # fmt: skip
    tiered = {"model": model, "loaded": [16, 0], "cached": [16, 0], "ttft_s": [0.91, 0.5]}
    base = {"ttft_s": [1.0, 0.5]}
    assert kv_tiers.model_error(tiered, base, block_size=8) == pytest.approx(0.0, abs=1e-9)
    del model["load_latency_s"]  # a record from before the latency: its rate alone
    assert kv_tiers.model_error(tiered, base, block_size=8) == pytest.approx(0.05)


def test_repeated_runs_set_each_request_at_its_median_before_the_ratios() -> None:
    """Three runs of the same two requests: a moment of noise in one run (the tier's request
    0 at 3.0 s) does not make that request's ratio; a request any run loaded counts as
    tier-served; runs whose first tokens differ are refused."""
    same = {"first_tokens": [1, 2], "system": "file"}
    runs = [
        record([1.0, 2.0], [16, 0], [100, 100]) | {"ttft_cpu_s": [0.5, 1.0], **same},
        record([3.0, 2.2], [16, 8], [100, 100]) | {"ttft_cpu_s": [0.6, 1.1], **same},
        record([0.9, 1.8], [16, 0], [100, 100]) | {"ttft_cpu_s": [0.4, 0.9], **same},
    ]
    merged = kv_tiers.median_of_runs(runs)
    assert merged["ttft_s"] == [1.0, 2.0] and merged["ttft_cpu_s"] == [0.5, 1.0]
    assert merged["loaded"] == [16, 8]
    assert merged["runs_ttft_s"] == [[1.0, 2.0], [3.0, 2.2], [0.9, 1.8]]
    base = record([1.1, 2.0], [0, 0], [100, 100])
    assert kv_tiers.against_recompute(merged, base)["worst"] == pytest.approx(1.0)
    assert kv_tiers.against_recompute(runs[1], base)["worst"] == pytest.approx(1.1 / 3.0)
    assert kv_tiers.median_of_runs(runs[:1]) is runs[0]
    runs[2]["first_tokens"] = [7, 7]
    with pytest.raises(RuntimeError, match="first tokens differ"):
        kv_tiers.median_of_runs(runs)
