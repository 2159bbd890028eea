"""What a verify step of 1 + k rows costs against a plain (one-row) decode step, compiled and
eager side by side: the measure adaptive k's constants (common/engine/drafting.py `StepCost`)
stand on (docs/speculative.md, "Step costs").

    nice -n 19 python scripts/spec_step_cost.py MODEL [--dtype bfloat16] [--steps 30]
        [--modes compiled,eager] [--widths 1-8]

One engine per mode (one request each, batch 1, one thread), its steps interleaved with the
other's step by step, so both see the same load. Each decode step asks for a fixed number of
drafts (the last token repeated, so the count never depends on the text), the widths in a
shuffled cycle, so every width sees the same contexts. The thread's CPU time of
`engine.step()` per width (least, 20th percentile, median), each width's median over its mode's
one-row median, and a least-squares line through those ratios at k = 1..: v (a verify step's
fixed part) and r (per row), in one-row steps. "compiled" is the CPU default's packages (their
buckets are compiled into the compile cache first when it lacks them: minutes each, cold).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from pdserve import LLM, SamplingParams

PATTERN = list(range(1000, 1024))  # a 24-token pattern five times: a 120-token prompt
PARAMS = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


def engine(model: str, dtype: str, mode: str, max_rows: int) -> LLM:
    """A batch-1 engine whose drafter asks for the width `set_width` last set."""
    compile_mode = "blocking" if mode == "compiled" else "eager"
    spec = {"method": "ngram", "num_speculative_tokens": max_rows - 1, "adaptive": False}
    llm = LLM(model, dtype=dtype, max_num_seqs=1, compile_mode=compile_mode,
              speculative_config=spec, skip_tokenizer_init=True)  # fmt: skip
    drafter = llm.engine.scheduler.drafter
    drafter.width = 1
    drafter.propose = lambda rid, tokens, limit: [tokens[-1]] * min(drafter.width - 1, limit)
    runner = llm.engine.runner
    runner.last = (0, False)  # the latest step's rows and whether it ran compiled
    choose = runner._compiled_step

    def chosen(seqs, on_layer):  # noqa: ANN001, ANN202 - the runner's own signature
        compiled = choose(seqs, on_layer)
        runner.last = (sum(len(s.token_ids) for s in seqs), compiled)
        return compiled

    runner._compiled_step = chosen
    return llm


def timed_step(llm: LLM, width: int, ids: list[int], mode: str) -> float | None:
    """One step at `width` rows: its CPU ms, or None for a step that was not a decode step
    of that width in that mode (a new request's prefill, fewer drafts near max_tokens, an
    eager step of a compiled engine)."""
    engine = llm.engine
    if not engine.has_unfinished:
        ids[0] += 1
        engine.add_request(f"r{ids[0]}", PATTERN * 5, PARAMS)
    decoding = all(r.num_output_tokens > 0 for r in engine.scheduler.running)
    decoding = decoding and bool(engine.scheduler.running)
    engine.scheduler.drafter.width = width
    start = time.thread_time()
    engine.step()
    spent = (time.thread_time() - start) * 1e3
    rows, compiled = engine.runner.last
    return spent if decoding and rows == width and compiled == (mode == "compiled") else None


def fit(ratios: dict[int, float]) -> tuple[float, float]:
    """v, r of ratio - 1 = v + r * k over the widths past one row (k = width - 1)."""
    ks = [w - 1 for w in ratios if w > 1]
    ys = [ratios[k + 1] - 1 for k in ks]
    mk, my = statistics.fmean(ks), statistics.fmean(ys)
    r = sum((k - mk) * (y - my) for k, y in zip(ks, ys)) / sum((k - mk) ** 2 for k in ks)
    return my - r * mk, r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=30, help="steps a width and mode")
    p.add_argument("--modes", default="compiled,eager")
    p.add_argument("--widths", default="1-8", help="rows a step: LO-HI")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    lo, hi = map(int, args.widths.split("-"))
    widths = list(range(lo, hi + 1))
    modes = args.modes.split(",")
    engines = {m: engine(args.model, args.dtype, m, hi) for m in modes}
    ids = {m: [0] for m in modes}
    times: dict[str, dict[int, list[float]]] = {m: {w: [] for w in widths} for m in modes}
    rng = random.Random(args.seed)
    while min(len(t) for m in modes for t in times[m].values()) < args.steps:
        cycle = widths[:]
        rng.shuffle(cycle)
        for width in cycle:
            for mode in modes:
                spent = timed_step(engines[mode], width, ids[mode], mode)
                if spent is not None:
                    times[mode][width].append(spent)
    for mode in modes:
        base = statistics.median(times[mode][1]) if 1 in widths else None
        print(f"{mode} ({args.dtype}, one thread; CPU ms a step)")
        print("| rows | least | 20th percentile | median | median / one row's |")
        print("|---|---|---|---|---|")
        ratios = {}
        for w in widths:
            t = sorted(times[mode][w])
            med = statistics.median(t)
            ratios[w] = med / base if base else float("nan")
            p20 = t[len(t) // 5]
            print(f"| {w} | {t[0]:.1f} | {p20:.1f} | {med:.1f} | {ratios[w]:.2f} |")
        if base and len(widths) > 2:
            v, r = fit(ratios)
            print(f"line through the median ratios: v {v:.2f}, r {r:.2f}\n")


if __name__ == "__main__":
    main()
