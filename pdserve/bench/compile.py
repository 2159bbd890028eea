"""`pdserve bench compile`: compiled decode steps against eager ones and the weight-bandwidth
floor, on the engine sweep of `bench offline`. Definitions: docs/benchmarks.md."""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from pdserve.bench import offline
from pdserve.bench import report as rp

MODES = ("eager", "compiled")


def read_bandwidth(model: torch.nn.Module, device: str) -> float:
    """Bytes per second of reading every weight once: a `sum()` over each weight tensor."""
    weights = list(model.parameters())
    total = sum(w.numel() * w.element_size() for w in weights)
    return total / rp.best_time(lambda: [w.sum() for w in weights], device)


def floor_s(pd: offline.Pdserve, batch: int, args: argparse.Namespace, bandwidth: float) -> float:
    """Seconds a decode step of `batch` sequences takes just to read what it must."""
    context = args.prompt_len + args.max_tokens / 2
    item = offline.DTYPES[args.dtype].itemsize
    weights = offline.weight_bytes(pd.runner.model)
    return offline.decode_bytes(pd.runner.arch, weights, batch, context, item) / bandwidth


def compile_row(batch: int, runs: offline.Runs, floor: float) -> dict[str, Any]:
    row: dict[str, Any] = {"batch": batch, "floor_s": floor}
    for mode in MODES:
        step = statistics.median(r["decode_step_s"] for r in runs[mode])
        row[mode] = {
            "step_s": step,
            "tokens_per_s": batch / step,
            "of_floor": floor / step,
            # this process's CPU time: steadier than wall time on a shared machine
            "cpu_step_s": statistics.median(r["decode_step_cpu_s"] for r in runs[mode]),
        }
    row["speedup"] = row["eager"]["step_s"] / row["compiled"]["step_s"]
    return {
        **row,
        **offline.compare_tokens(runs["compiled"][0]["tokens"], runs["eager"][0]["tokens"]),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.models import smollm2

    path = offline.model_dir(args, smollm2)
    # the compiled engine compiles every bucket up to the largest batch as it is built
    pds = {mode: offline.Pdserve(path, args, enforce_eager=mode == "eager") for mode in MODES}
    compiled = pds["compiled"].runner.compiled
    assert compiled is not None, "enforce_eager=False must compile"
    # Graphs the compile cache had (hit) and compiled (miss): the compile time depends on it.
    counts = compiled.cache_counts
    assert counts is not None, "a compiled engine compiles through its compile cache"
    cache = {"hit": counts.hits, "miss": counts.misses}
    eager = pds["eager"]
    bandwidth = read_bandwidth(eager.runner.model, args.device)
    copy_bw = offline.copy_bandwidth(args.copy_mib << 20, offline.DTYPES[args.dtype], args.device)
    row = lambda b, runs: compile_row(b, runs, floor_s(eager, b, args, bandwidth))  # noqa: E731
    results = offline.sweep_batches(args, pds, eager.runner.arch.vocab_size, row, COLUMNS)
    return {**offline.sweep_fields(args, path, eager), "buckets": list(compiled.buckets),
            "compile_s": compiled.compile_seconds, "graphs_compiled": compiled.num_compiles,
            "inductor_cache": cache, "read_bytes_per_s": bandwidth, "copy_bytes_per_s": copy_bw,
            "results": results}  # fmt: skip


def goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals at batch 1 ("not measured" without it), and equal tokens."""
    one = next((r for r in report["results"] if r["batch"] == 1), None)
    eager, compiled, floor = (None, None, None)
    if one:
        eager, compiled = one["eager"]["tokens_per_s"], one["compiled"]["tokens_per_s"]
        floor = 1 / one["floor_s"]
    rs = report["results"]
    same, every = sum(r["matching_sequences"] for r in rs), sum(r["batch"] for r in rs)
    return [
        rp.goal("compiled batch-1 decode >= 1.5x eager", compiled, eager, ">=", 1.5),
        rp.goal("compiled batch-1 decode >= 60% of the bandwidth floor", compiled, floor, ">=",
                0.6),
        rp.goal("every sequence's compiled tokens equal eager's", same, every, ">=", 1.0),
    ]  # fmt: skip


def per_mode(header: str, value: Callable[[dict], Any]) -> offline.Columns:
    """The eager and the compiled column of one figure."""
    return [(f"{mode} {header}", lambda r, m=mode: value(r[m])) for mode in MODES]


COLUMNS: offline.Columns = [
    ("batch", "batch"),
    *per_mode("ms", lambda side: side["step_s"] * 1e3),
    *per_mode("tok/s", lambda side: side["tokens_per_s"]),
    ("speedup", lambda r: f"{r['speedup']:.2f}x"),
    ("floor ms", lambda r: r["floor_s"] * 1e3),
    *per_mode("% of floor", lambda side: f"{side['of_floor']:.0%}"),
    ("tokens equal", lambda r: f"{r['matching_sequences']}/{r['batch']}"),
]
SETUP: offline.Columns = [
    ("buckets", "buckets"), ("compile s", "compile_s"), ("graphs", "graphs_compiled"),
    ("inductor cache hits", lambda r: r["inductor_cache"]["hit"]),
    ("misses", lambda r: r["inductor_cache"]["miss"]),
    ("read GB/s (weights' `sum()`)", lambda r: r["read_bytes_per_s"] / 1e9),
    ("copy GB/s (read + write)", lambda r: r["copy_bytes_per_s"] / 1e9),
]  # fmt: skip


def section(report: dict[str, Any], figure: str) -> str:
    """The benchmarks.md section; `figure` is the plot's path as the page links it."""
    return "\n".join(
        ["## Compiled decode: `torch.compile` against eager", ""]
        + [*rp.run_header(report), offline.model_line(report), ""]
        + [rp.records_table(COLUMNS, report["results"]), "", f"![compiled decode]({figure})", ""]
        + [rp.records_table(SETUP, [report]), "", rp.goals_table(goals(report))]
    )


def plot(report: dict[str, Any], path: Path) -> Path:
    rs = report["results"]
    x = [r["batch"] for r in rs]
    panel = rp.Panel(report["model"]["description"], "batch size", "decode tokens / s", xlog=2,
                  xticks=x, ylog=True)  # fmt: skip
    for mode, style in (("eager", "s--"), ("compiled", "o-")):
        panel.lines.append((mode, x, [r[mode]["tokens_per_s"] for r in rs], style))
    panel.lines.append(("bandwidth floor", x, [r["batch"] / r["floor_s"] for r in rs], "k:"))
    return rp.plot_lines([panel], path, width=6.5)


SWEEP = replace(
    offline.SWEEP, name="compile",
    quick_help="tiny random model, batch 1 and 2, 8-token prompts, 4 new tokens, 1 run",
    model_help="checkpoint directory or GGUF (default: SmolLM2-135M-Instruct; quick: tiny)",
    defaults={"batch_sizes": ("1,8,32", "1,2"), "prompt_len": (64, 8), "max_tokens": (32, 4)},
    min_tokens=3, threads=0, batch_means="sequences per decode step",
)  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = offline.parse_sweep(offline.sweep_parser(SWEEP, __doc__), SWEEP, argv)
    args.cache_dir = args.outputs.folder / "models"  # the quick run's tiny model
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    write = lambda report, to: rp.publish("compile", report, to, plot, section)  # noqa: E731
    return rp.bench_main(argv, parse_args, "compile", measure, write)


if __name__ == "__main__":
    sys.exit(main())
