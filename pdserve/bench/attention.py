"""`pdserve bench attention`: the CPU paged attention of a decode step against the bandwidth
floor of the KV bytes it must read, at batch 1 and 16 and 1K and 4K context: the in-place decode
kernel, next to the flash path and the reference it replaced (which gathers each sequence's
whole context per call).

The floor is the time a `sum()` takes to read those bytes at the read bandwidth measured in
the same run, with the same thread count. Definitions: docs/benchmarks.md."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import benchmark

from pdserve.bench import report as rp
from pdserve.common.node.cli import parser
from pdserve.kernels.cpu import make_plan, paged_attention_cpu
from pdserve.kernels.reference import paged_attention_ref

# in_place: decode rows through kernels/cpu_attention (one C++ call a layer); flash: the
# chunked gathers and flash calls it replaced for them; reference: the whole-context gathers.
IMPLS: dict[str, Callable[..., torch.Tensor]] = {
    "in_place": paged_attention_cpu,
    "flash": functools.partial(paged_attention_cpu, decode_kernel=False),
    "reference": paged_attention_ref,
}
BLOCK_SIZE = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def decode_case(batch: int, context: int, dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    """One layer's decode call on the bench model's heads: `batch` sequences of about
    `context` tokens (tails differ, so blocks end part-full) in randomly placed blocks."""
    heads, kv_heads = rp.BENCH_MODEL_SIZES["heads"], rp.BENCH_MODEL_SIZES["kv_heads"]
    dim = rp.BENCH_MODEL_SIZES["hidden"] // heads
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * per_seq].view(batch, per_seq)
    lens = [context - (b * 5) % BLOCK_SIZE for b in range(batch)]
    return {
        "query": torch.randn(batch, heads, dim, generator=gen).to(dtype),
        "k_cache": cache[0],
        "v_cache": cache[1],
        "block_tables": tables.int(),
        "query_start_loc": torch.arange(batch + 1, dtype=torch.int32),
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
        "scale": dim**-0.5,
    }


def kv_bytes(case: dict[str, Any]) -> int:
    """Bytes of K and V the call must read: every token of every sequence, once."""
    k = case["k_cache"]
    return 2 * int(case["seq_lens"].sum()) * k.shape[2] * k.shape[3] * k.element_size()


def median_s(fn: Callable[[], object], threads: int, min_run_time: float) -> float:
    timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=threads)
    return timer.blocked_autorange(min_run_time=min_run_time).median


def read_bandwidth(nbytes: int, threads: int, min_run_time: float) -> float:
    """Bytes per second a `sum()` over a fresh nbytes tensor reads, with `threads` threads."""
    big = torch.ones(nbytes // 4)
    return nbytes / median_s(big.sum, threads, min_run_time)


def plan_s(case: dict[str, Any], threads: int, min_run_time: float) -> float:
    """Seconds to make a step's plan (once per step; each layer then reuses it)."""
    meta = (case["block_tables"], case["query_start_loc"], case["seq_lens"])
    k = case["k_cache"]
    token_bytes = k.shape[2] * k.shape[3] * k.element_size()
    return median_s(lambda: make_plan(*meta, BLOCK_SIZE, None, token_bytes), threads, min_run_time)


def case_rows(case: dict[str, Any], shape: dict[str, Any], bandwidth: float,
              args: argparse.Namespace) -> list[dict[str, Any]]:  # fmt: skip
    """Each implementation's row for one case (its output checked against the reference's)."""
    nbytes, threads = kv_bytes(case), shape["threads"]
    expected = paged_attention_ref(**case).float()
    rows = []
    for name, fn in IMPLS.items():
        error = (fn(**case).float() - expected).abs().max().item()
        seconds = median_s(lambda f=fn: f(**case), threads, args.min_run_time)
        rows.append({**shape, "impl": name, "ms": seconds * 1e3, "kv_bytes": nbytes,
                     "gb_s": nbytes / seconds / 1e9, "floor_ms": nbytes / bandwidth * 1e3,
                     "of_floor": nbytes / bandwidth / seconds, "max_abs_error": error})  # fmt: skip
    rows[0]["plan_ms"] = plan_s(case, threads, args.min_run_time) * 1e3
    return rows


def measure(args: argparse.Namespace) -> dict[str, Any]:
    rows, bandwidths = [], {}
    for threads in args.threads:
        bandwidth = read_bandwidth(args.floor_mib << 20, threads, args.min_run_time)
        bandwidths[threads] = bandwidth
        for dtype in args.dtypes:
            for batch in args.batches:
                for context in args.contexts:
                    case = decode_case(batch, context, DTYPES[dtype])
                    shape = {"threads": threads, "dtype": dtype, "batch": batch,
                             "context": context}  # fmt: skip
                    rows += case_rows(case, shape, bandwidth, args)
    return {"device": "cpu", "read_bytes_per_s": bandwidths, "rows": rows,
            "block_size": BLOCK_SIZE, "heads": rp.BENCH_MODEL_SIZES["heads"],
            "kv_heads": rp.BENCH_MODEL_SIZES["kv_heads"]}  # fmt: skip


COLUMNS = [
    ("threads", lambda r: r["threads"]),
    ("dtype", lambda r: r["dtype"]),
    ("batch", lambda r: r["batch"]),
    ("context", lambda r: r["context"]),
    ("impl", lambda r: r["impl"]),
    ("KV MB", lambda r: r["kv_bytes"] / 1e6),
    ("ms", lambda r: r["ms"]),
    ("GB/s", lambda r: r["gb_s"]),
    ("floor ms", lambda r: r["floor_ms"]),
    ("of floor", lambda r: f"{r['of_floor']:.0%}"),
    ("plan ms", lambda r: r.get("plan_ms", "")),
]


def section(report: dict[str, Any]) -> str:
    start, end = report["load_avg"]
    floors = ", ".join(f"{bw / 1e9:.1f} GB/s at {t} thread(s)"
                       for t, bw in report["read_bytes_per_s"].items())  # fmt: skip
    lines = [
        "## Paged attention on the CPU against the KV bandwidth floor",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {rp.describe_machine(report['machine'])}; load average {start:.1f} at "
        f"start, {end:.1f} at end. Read bandwidth (a `sum()`): {floors}.  ",
        f"One layer's decode call: {report['heads']} query heads over {report['kv_heads']} KV "
        f"heads of dim 64, blocks of {report['block_size']} tokens placed at random; ms is "
        "the median of `torch.utils.benchmark`; floor ms is the KV bytes at the read "
        "bandwidth; plan ms is the step's plan, made once for all layers.",
        "",
        rp.records_table(COLUMNS, report["rows"]),
    ]
    return "\n".join(lines)


def write(report: dict[str, Any], to: rp.Outputs) -> None:
    data = rp.save_json(to.folder / "attention.json", report)
    page = rp.write_section("attention", section(report), to.page)
    print(rp.records_table(COLUMNS, report["rows"]))
    print(f"wrote {data}, {page}")


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = parser("pdserve bench attention", __doc__.split("\n\n")[0])
    quick = "batch 1 and 2, context 64 and 100, 1 thread, float32, a 16 MiB floor tensor"
    rp.add_flags(p.add_argument_group("run"), [
        ("--quick", bool, False, quick, {}),
        ("--threads", ints, [1, 2], "torch thread counts, comma-separated", {}),
        ("--dtypes", str, "float32,bfloat16", "comma-separated, of " + ", ".join(DTYPES), {}),
        ("--min-run-time", float, 0.3, "seconds `blocked_autorange` times each call", {}),
    ])  # fmt: skip
    rp.add_output_flags(p, "attention.json")
    args = p.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    args.batches, args.contexts, args.floor_mib = [1, 16], [1024, 4096], 256
    if args.quick:
        args.threads, args.dtypes, args.min_run_time = [1], ["float32"], 0.01
        args.batches, args.contexts, args.floor_mib = [1, 2], [64, 100], 16
    args.outputs = rp.outputs_from_args(p, args)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return rp.bench_main(argv, parse_args, "attention", measure, write)


if __name__ == "__main__":
    sys.exit(main())
