"""The batch-N decode step's CPU time by context length, offline: what a served 16-at-once run's
steps cost against the offline figure measured at a few tokens of context (issue 36, h5).

`scripts/quant_load.py --batches 16` times steps of 16 requests with 4-token prompts (contexts
5-37 tokens); the compare's saturation run decodes 16 requests at ~96 +-25% prompt tokens plus
up to ~40 output tokens. This script adds `--batch` requests of each `--contexts` prompt length
at once to one `LLM` (compiled decode by default: the packages the compile cache holds), lets
the prompts prefill, and times every following step whose batch is all `--batch` sequences
decoding, by this thread's CPU time (the steadier on a shared machine) and wall; the lengths
run in turn, `--rounds` times, so a change in the machine's load falls on all of them alike.

    PYTHONPATH=. python scripts/decode_step_context.py MODEL --contexts 4 48 96 128 [--eager]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pdserve import LLM, SamplingParams


def step_ms(llm: LLM, batch: int, prompt: int, steps: int, tag: str) -> tuple[list, list]:
    """CPU and wall ms of each step in which `batch` requests of `prompt` tokens all decode."""
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    vocab = llm.engine.runner.arch.vocab_size
    for i in range(batch):
        tokens = [(100 + 7919 * (i * prompt + j)) % vocab for j in range(prompt)]
        llm.engine.add_request(f"{tag}-{i}", tokens, params)
    cpus, walls = [], []
    while llm.engine.has_unfinished:
        output = llm.engine.scheduler.schedule()
        decoding = len(output.seqs) == batch and output.num_batched_tokens == batch
        wall, cpu = time.perf_counter(), time.thread_time()
        llm.engine.run(output)
        if decoding:
            cpus.append(1000 * (time.thread_time() - cpu))
            walls.append(1000 * (time.perf_counter() - wall))
    return cpus, walls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--contexts", type=int, nargs="+", default=[4, 48, 96, 128])
    p.add_argument("--steps", type=int, default=16, help="decode steps a request")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--eager", action="store_true", help="decode eager (default: compiled)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        skip_tokenizer_init=True,
        compile_mode="eager" if args.eager else "background",
    )
    step_ms(llm, 2, 16, 4, "warm")  # a background load of the packages is adopted by now
    compiled = llm.engine.runner.compiled
    ready = compiled is not None and compiled.runs(args.batch)
    print(json.dumps({"compiled_bucket_ready": ready, "threads": args.threads}))
    got: dict[int, list[float]] = {n: [] for n in args.contexts}
    for r in range(args.rounds):
        for n in args.contexts:
            cpus, walls = step_ms(llm, args.batch, n, args.steps, f"r{r}-{n}")
            got[n] += cpus
            row = {"round": r, "prompt": n, "steps": len(cpus)}
            row |= {"cpu_ms_median": round(statistics.median(cpus), 1)}
            row |= {"wall_ms_median": round(statistics.median(walls), 1)}
            print(json.dumps(row), flush=True)
    for n, cpus in got.items():
        mid = statistics.median(cpus)
        print(json.dumps({"prompt": n, "contexts": [n + 1, n + args.steps], "cpu_ms_median": mid}))


if __name__ == "__main__":
    main()
