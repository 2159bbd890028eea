"""A decode step of B sequences, the bucket's AOTInductor package against eager, on one runner:
this thread's CPU ms (with --threads 1 the step's own work, whatever else runs) and wall ms,
medians of alternating steps, and how far the logits differ (docs/benchmarks.md).

    PYTHONPATH=. python scripts/compiled_step_bench.py MODEL CACHE_ROOT 1,16 [--threads 1]
        [--dtype float32|bfloat16]

The buckets given are compiled into CACHE_ROOT first when it lacks them (minutes each, cold).
Eager is what an eager CPU engine runs (its float32 LM head on kernels/ops.py); the
package is exported without that head, as a compiled engine's is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve import LLM, SamplingParams
from pdserve.common.engine.compile_cache import CompileCache, compile_key
from pdserve.common.engine.compiled_decode import CompiledDecode, code_hash
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.scheduler import ScheduledSeq

CONTEXT = 64  # tokens each sequence holds before the step


def compile_buckets(runner: ModelRunner, buckets: tuple[int, ...], root: Path) -> CompiledDecode:
    model, chunk = runner.model, runner.model.chunk_head
    model.chunk_head = False  # a compiled engine never calls use_cpu_head
    compiled = CompiledDecode(model, max(buckets), buckets=buckets)
    flags = {"buckets": compiled.buckets, "block_size": runner.block_size, "device": "cpu"}
    key = compile_key(model, runner.arch, runner.dtype, {**flags, "tp": None}, code_hash())
    wall, cpu = time.perf_counter(), time.process_time()
    compiled.warm_up(runner.kv_caches, CompileCache(root, key))
    took = f"{time.perf_counter() - wall:.1f} s wall, {time.process_time() - cpu:.1f} s CPU"
    print(f"packages ready in {took}: {compiled.cache_counts}", flush=True)
    model.chunk_head = chunk
    return compiled


def decode_args(runner: ModelRunner, batch: int) -> tuple:
    """Prefill `batch` sequences of CONTEXT tokens (eager); their decode step's arguments."""
    params, bs = SamplingParams(max_tokens=1, temperature=0.0), runner.block_size
    prefill, decode, block = [], [], 1
    for i in range(batch):
        blocks = tuple(range(block, block + CONTEXT // bs + 1))
        block += len(blocks)
        tokens = tuple((7 * i + 3 * j) % 1000 + 10 for j in range(CONTEXT))
        prefill.append(ScheduledSeq(f"p{i}", tokens[:-1], 0, blocks, False, params))
        decode.append(ScheduledSeq(f"d{i}", tokens[-1:], CONTEXT - 1, blocks, True, params))
    inputs = runner.prepare(tuple(prefill))
    runner.model(inputs.input_ids, inputs.positions, inputs.attn, runner.kv_caches)
    inputs = runner.prepare(tuple(decode))
    return inputs.input_ids, inputs.positions, inputs.attn, runner.kv_caches


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return 1e3 * (time.thread_time() - cpu), 1e3 * (time.perf_counter() - wall)


def measure(runner: ModelRunner, compiled: CompiledDecode, batch: int, repeat: int) -> dict:
    args, model = decode_args(runner, batch), runner.model
    steps = {
        "eager": lambda: model.compute_logits(model(*args)),
        "compiled": lambda: compiled.packages[batch](*args)[:batch],
    }
    eager, comp = steps["eager"](), steps["compiled"]()
    times = {name: [] for name in steps}
    for _ in range(repeat):  # alternating, so load changes hit both alike
        for name, fn in steps.items():
            times[name].append(timed(fn))
    row: dict = {
        name: {"cpu_ms": statistics.median(t[0] for t in ts),
               "wall_ms": statistics.median(t[1] for t in ts)}
        for name, ts in times.items()
    }  # fmt: skip
    row["cpu_speedup"] = row["eager"]["cpu_ms"] / row["compiled"]["cpu_ms"]
    row["wall_speedup"] = row["eager"]["wall_ms"] / row["compiled"]["wall_ms"]
    row["max_abs_diff"] = (eager - comp).abs().max().item()
    row["same_argmax"] = bool(torch.equal(eager.argmax(-1), comp.argmax(-1)))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("cache_root", type=Path)
    p.add_argument("buckets", help="comma-separated batch sizes, each its own bucket")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    buckets = tuple(sorted(int(b) for b in args.buckets.split(",")))
    llm = LLM(args.model, enforce_eager=True, max_num_seqs=max(buckets), dtype=args.dtype,
              kv_cache_bytes=256 << 20, skip_tokenizer_init=True)  # fmt: skip
    runner = llm.engine.runner
    compiled = compile_buckets(runner, buckets, args.cache_root)
    with torch.inference_mode():
        for batch in buckets:
            print(batch, json.dumps(measure(runner, compiled, batch, args.repeat)), flush=True)
    print("loadavg", Path("/proc/loadavg").read_text().strip())


if __name__ == "__main__":
    main()
