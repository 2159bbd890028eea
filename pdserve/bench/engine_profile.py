"""Where a serving benchmark's engine time goes: `bench compare`'s saturation requests through
the engine alone, in this process (no HTTP, router or detokenizer), timed, then under
torch.profiler, its CPU time split into matmuls, attention and the rest."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import torch

from pdserve.bench.serve import BenchRequest

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_softmax")


def _engine(model: str, engine_args: Sequence[str]) -> Any:
    """An LLMEngine with the nodes' engine flags (defaults where none are given)."""
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.node.cli import add_engine_args, engine_configs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns, _ = p.parse_known_args(list(engine_args))
    ns.model = model
    # Each timed run repeats the same prompts: no run may hit an earlier one's blocks (within
    # one run the prompts share nothing, as in the served run).
    ns.no_prefix_caching = True
    return LLMEngine(*engine_configs(ns))


def _run(engine: Any, requests: Sequence[BenchRequest], tag: str) -> tuple[float, int]:
    """Every request added at once, steps until done: seconds and output tokens."""
    from pdserve.common.engine.sampling_params import SamplingParams

    for i, r in enumerate(requests):
        params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
        engine.add_request(f"{tag}-{i}", list(r.prompt), params)
    start, out = time.perf_counter(), 0
    while engine.has_unfinished:
        out += sum(len(u.new_token_ids) for u in engine.step())
    return time.perf_counter() - start, out


def profile_engine(
    model: str, engine_args: Sequence[str], requests: Sequence[BenchRequest], threads: int
) -> dict[str, Any]:
    """Seconds of the requests through the engine alone (best of two timed runs), and a
    profiled run's CPU seconds in matmuls, attention and the rest (with the top ops)."""
    previous = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        engine = _engine(model, engine_args)
        _run(engine, requests[:2], "warm")
        seconds, tokens = min(_run(engine, requests, f"t{k}") for k in range(2))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            profiled_s, _ = _run(engine, requests, "prof")
    finally:
        torch.set_num_threads(previous)
    ops = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    total = sum(ops.values())
    matmul = sum(ops.get(k, 0.0) for k in MATMUL_OPS)
    attention = sum(ops.get(k, 0.0) for k in ATTENTION_OPS)
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:8]
    return {
        "requests": len(requests),
        "prompt_tokens": sum(r.prompt_len for r in requests),
        "output_tokens": tokens,
        "engine_s": seconds,
        "engine_tokens_per_s": tokens / seconds,
        "profiled_s": profiled_s,
        "cpu_s": total,
        "matmul_s": matmul,
        "attention_s": attention,
        "other_s": total - matmul - attention,
        "matmul_share": matmul / total if total else 0.0,
        "top_ops": [{"op": k, "s": v} for k, v in top],
        "threads": threads,
    }
