"""Where a long prompt's prefill goes (docs/benchmarks.md, "Batch 16 and the 1K prefill on
AVX512"): one prompt of --prompt-tokens at a time through the engine (chunks of the token
budget, 512), its parts timed as `decode_profile.py` times a decode step's, by wall clock and by
this thread's CPU time, per prompt.

    PYTHONPATH=. python scripts/prefill_profile.py MODEL [--prompt-tokens 1024] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from pdserve import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from decode_profile import Clock, instrument  # noqa: E402 (a script beside this one)


def prefill_ms(llm: LLM, prompt_tokens: int, seed: int) -> tuple[float, float]:
    """(wall, CPU) ms from adding one distinct prompt to its first token."""
    prompt = [(seed * 7919 + j * 31) % 40000 + 100 for j in range(prompt_tokens)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.engine.add_request(f"prefill-{seed}", prompt, params)
    wall, cpu_s = time.perf_counter(), time.thread_time()
    while llm.engine.has_unfinished:
        llm.engine.step()
    return 1000 * (time.perf_counter() - wall), 1000 * (time.thread_time() - cpu_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="prompts timed; the median shown")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_bytes=64 * 1024**2,
        skip_tokenizer_init=True,
        enforce_eager=True,
    )
    prefill_ms(llm, args.prompt_tokens, 0)  # warm-up
    clock = Clock()
    instrument(llm, clock)
    runs = sorted(prefill_ms(llm, args.prompt_tokens, i + 1) for i in range(args.repeats))
    parts = {k: round(1000 * v / args.repeats, 1) for k, v in sorted(clock.cpu.items())}
    wall, cpu_ms = runs[len(runs) // 2]
    head = {"prompt_tokens": args.prompt_tokens}
    result = {**head, "wall_ms": round(wall, 1), "cpu_ms": round(cpu_ms, 1), "cpu_parts_ms": parts}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
