"""Where a 16-at-once run's time goes (`bench compare`'s saturation at rate inf, offline): the
compare's requests (16 prompts of ~96 tokens, ~32 output tokens, +-25%, greedy, EOS ignored)
added at once to an `LLM`, then every `engine.step()` timed by wall clock and this thread's
CPU time and put in one bin: prefill steps (any prompt token in the batch), decode steps, and
inside each the model runner's `execute` (the forward, its input building and sampling) against
the engine's own work around it (scheduling, the update of requests).

    PYTHONPATH=. python scripts/saturation_profile.py MODEL [--threads 1] [--repeats 3]

The router's work (tokenizing, detokenizing, the HTTP stream) runs in its own process on a
served node and is not here: py-spy on the router under the same load (docs/quantization.md).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

import torch

from pdserve import LLM, SamplingParams
from pdserve.kernels import cpu

sys.path.insert(0, str(Path(__file__).parent))
from decode_profile import Clock, instrument  # noqa: E402 (a script beside this one)


def requests(n: int, prompt: int, output: int, spread: float, seed: int, vocab: int, salt: int = 0):
    """`n` (prompt tokens, SamplingParams): lengths drawn within +-spread like the compare's,
    by `seed`; the tokens by `seed` and `salt` (the same lengths with other tokens: a run that
    the prefix cache does not serve)."""
    rng, tokens_rng = random.Random(seed), random.Random(seed * 1000 + salt + 1)

    def drawn(mean: int) -> int:
        return max(1, round(mean * rng.uniform(1 - spread, 1 + spread)))

    out = []
    for _ in range(n):
        tokens = [tokens_rng.randrange(100, vocab) for _ in range(drawn(prompt))]
        params = SamplingParams(max_tokens=drawn(output), temperature=0.0, ignore_eos=True)
        out.append((tokens, params))
    return out


def one_run(llm: LLM, batch: list, tag: str, clock: Clock | None = None) -> dict[str, float]:
    """Milliseconds (wall and CPU) per bin over one run of the batch, and the step counts;
    with a `clock` (`decode_profile.instrument`'s) the CPU ms of each part per bin too."""
    engine, totals = llm.engine, collections.defaultdict(float)
    execute, kind = engine.runner.execute, ["decode"]

    def timed_execute(output, *args, **kwargs):  # noqa: ANN001, ANN202
        # A step that runs more tokens than sequences carries prompt tokens: a prefill step
        # (a decode row mixed into it counts there too).
        kind[0] = "prefill" if output.num_batched_tokens > len(output.seqs) else "decode"
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return execute(output, *args, **kwargs)
        finally:
            totals[f"{kind[0]} execute wall"] += time.perf_counter() - wall
            totals[f"{kind[0]} execute cpu"] += time.thread_time() - cpu

    engine.runner.execute = timed_execute
    try:
        for i, (tokens, params) in enumerate(batch):
            engine.add_request(f"{tag}-{i}", tokens, params)
        while engine.has_unfinished:
            parts = dict(clock.cpu) if clock is not None else {}
            wall, cpu = time.perf_counter(), time.thread_time()
            engine.step()
            for name, seconds in (clock.cpu if clock is not None else {}).items():
                totals[f"{kind[0]} {name} cpu"] += seconds - parts.get(name, 0.0)
            totals[f"{kind[0]} steps"] += 1
            totals[f"{kind[0]} wall"] += time.perf_counter() - wall
            totals[f"{kind[0]} cpu"] += time.thread_time() - cpu
    finally:
        engine.runner.execute = execute
    return {k: (v if k.endswith("steps") else round(1000 * v, 1)) for k, v in totals.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="runs; each shown, the median last")
    p.add_argument("--compile", action="store_true", help="decode through the compiled model")
    p.add_argument("--parts", action="store_true", help="time the step's parts (eager)")
    p.add_argument(
        "--in-place-keys",
        type=int,
        nargs="+",
        help="kernels/cpu.IN_PLACE_KEYS per run, in turn (A/B: 192 0): 0 sends prefill to flash",
    )
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--prompt", type=int, default=96)
    p.add_argument("--output", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        skip_tokenizer_init=True,
        enforce_eager=not args.compile,
    )
    vocab = llm.engine.runner.arch.vocab_size
    warm = requests(2, 16, 4, 0.0, 99, vocab)
    one_run(llm, warm, "warm")
    clock = Clock() if args.parts else None
    if clock is not None:
        instrument(llm, clock)
    settings = args.in_place_keys or [cpu.IN_PLACE_KEYS]
    runs: dict[int, list[dict[str, float]]] = {keys: [] for keys in settings}
    for r in range(args.repeats):
        for j, keys in enumerate(settings):  # the same lengths under each setting, in turn
            batch = requests(args.n, args.prompt, args.output, 0.25, r, vocab, j)
            cpu.IN_PLACE_KEYS = keys
            runs[keys].append(one_run(llm, batch, f"run{r}-{keys}", clock))
            print(json.dumps({"in_place_keys": keys, **runs[keys][-1]}))
    for keys, done in runs.items():
        done.sort(key=lambda run: run["prefill cpu"] + run["decode cpu"])
        head = {"threads": args.threads, "in_place_keys": keys}
        print(json.dumps({**head, "median": done[len(done) // 2]}, indent=1))


if __name__ == "__main__":
    main()
