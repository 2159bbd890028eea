"""Where a decode step's time goes (docs/quantization.md's profile table): each part of
`engine.step()` timed around the engine's and the model's own functions, by wall clock and by
this thread's CPU time (with --threads 1 the CPU time is the step's work, whatever else runs
on the machine), then torch.profiler's busiest operations.

    PYTHONPATH=. python scripts/decode_profile.py MODEL [--threads 1] [--steps 64] [--batch 16]
        [--compile]

"forward, rest" is the forward less the parts named inside it: residual adds, SiLU * up,
views, and Python and dispatch between operations.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from pdserve import LLM, SamplingParams
from pdserve.common.engine import compiled_decode
from pdserve.common.model import llama
from pdserve.common.model.quant import QuantizedLinear
from pdserve.kernels.ops import PackedLinear

# Parts of the forward (children of "forward"), and the step's other parts.
_INSIDE = ("decoder matmuls", "attention", "rmsnorm", "rope")
_OUTSIDE = ("schedule", "prepare inputs", "forward", "LM head", "sampling", "update")


class Clock:
    """Seconds (wall, this thread's CPU) per named part, summed over the calls."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = collections.defaultdict(float)
        self.cpu: dict[str, float] = collections.defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[name] += time.perf_counter() - wall
                self.cpu[name] += time.thread_time() - cpu

        return call

    def clear(self) -> None:
        self.wall.clear()
        self.cpu.clear()


def instrument(llm: LLM, clock: Clock) -> None:
    """Time the step's parts: the engine's calls, and inside the forward the model's."""
    engine, runner = llm.engine, llm.engine.runner
    engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)
    engine.scheduler.update = clock.wrap("update", engine.scheduler.update)
    runner.prepare = clock.wrap("prepare inputs", runner.prepare)
    runner.sampler = clock.wrap("sampling", runner.sampler)
    if runner.compiled is not None:  # one graph from the embedding to the logits
        runner.compiled.logits = clock.wrap("forward", runner.compiled.logits)
        return
    runner.model.forward = clock.wrap("forward", runner.model.forward)
    runner.model.compute_logits = clock.wrap("LM head", runner.model.compute_logits)
    for layer in runner.model.model.layers:
        for module in layer.modules():
            if isinstance(module, QuantizedLinear | torch.nn.Linear | PackedLinear):
                module.forward = clock.wrap("decoder matmuls", module.forward)
    llama.paged_attention = clock.wrap("attention", llama.paged_attention)
    llama.RMSNorm.forward = clock.wrap("rmsnorm", llama.RMSNorm.forward)
    llama.apply_rope = clock.wrap("rope", llama.apply_rope)
    llama.RotaryEmbedding.forward = clock.wrap("rope", llama.RotaryEmbedding.forward)


def start_decoding(llm: LLM, steps: int, batch: int) -> None:
    """`batch` requests past their prefill (one step: 16 prompt tokens each), with `steps`
    decode steps ahead of them."""
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = list(range(100 + i, 116 + i))  # distinct prompts: no prefix-cache hits
        llm.engine.add_request(f"p{time.time()}-{i}", prompt, params)
    llm.engine.step()
    assert not llm.engine.scheduler.waiting, "the prefill must take every prompt in one step"


def step_parts(llm: LLM, clock: Clock, steps: int, batch: int) -> dict[str, dict[str, float]]:
    """Milliseconds per decode step of each part, wall and CPU, and of the whole step."""
    start_decoding(llm, steps, batch)
    clock.clear()
    n, wall, cpu = 0, time.perf_counter(), time.thread_time()
    while llm.engine.has_unfinished:
        llm.engine.step()
        n += 1
    clock.wall["step"], clock.cpu["step"] = time.perf_counter() - wall, time.thread_time() - cpu
    for totals in (clock.wall, clock.cpu):
        if "decoder matmuls" in totals:  # eager: the forward's parts were timed
            totals["forward, rest"] = totals["forward"] - sum(totals[p] for p in _INSIDE)
        totals["engine, rest"] = totals["step"] - sum(totals.get(p, 0.0) for p in _OUTSIDE)
    names = [*_OUTSIDE, *_INSIDE, "forward, rest", "engine, rest", "step"]
    return {
        kind: {k: round(1000 * totals[k] / n, 3) for k in names if k in totals}
        for kind, totals in (("wall_ms", clock.wall), ("cpu_ms", clock.cpu))
    }


def busiest_ops(llm: LLM, steps: int, batch: int, rows: int = 20) -> str:
    """torch.profiler's table of the operations with the most self time over `steps` steps."""
    start_decoding(llm, steps, batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while llm.engine.has_unfinished:
            llm.engine.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    p.add_argument("--repeats", type=int, default=3, help="runs of --steps; the median shown")
    p.add_argument("--compile", action="store_true", help="decode through the compiled model")
    p.add_argument("--ops", action="store_true", help="also torch.profiler's busiest ops")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.compile:
        # Only the batch's own bucket (a cold one of SmolLM2 takes minutes): the packages are
        # kept per bucket in the default compile cache, so a second run loads it.
        compiled_decode.decode_buckets = lambda max_num_seqs: (max_num_seqs,)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_bytes=32 * 1024**2,
        skip_tokenizer_init=True,
        enforce_eager=not args.compile,
        max_num_seqs=args.batch,  # compiled: one bucket holds the batch
    )
    if args.ops:
        print(busiest_ops(llm, args.steps, args.batch))
    clock = Clock()
    instrument(llm, clock)
    runs = [step_parts(llm, clock, args.steps, args.batch) for _ in range(args.repeats)]
    runs.sort(key=lambda r: r["cpu_ms"]["step"])
    head = {"threads": args.threads, "batch": args.batch}
    print(json.dumps({**head, **runs[len(runs) // 2]}, indent=1))


if __name__ == "__main__":
    main()
