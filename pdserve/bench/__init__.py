"""`pdserve bench NAME ...`: the benchmarks, each measured against a baseline of the same run
(`pdserve bench --help` lists them)."""

from __future__ import annotations

import importlib
import sys

# command name -> (module, or module:function when not its main; one line)
BENCHMARKS = {
    "serve": ("serve", "a running server under load: TTFT, ITL, throughput"),
    "kv-transfer": ("kv_transfer", "each KV connector against its raw transport"),
    "offline": ("offline", "LLM against HF generate and the hardware floor"),
    "compare": ("compare", "colocated, 1P1D and transformers serve, side by side"),
    "kernels": ("gpu:kernels_main", "Triton kernels against their torch references"),
    "attention": ("attention", "CPU paged attention against the KV bandwidth floor"),
    "reliability": ("chaos:reliability_main", "fault-injection scenarios (docs/reliability.md)"),
    "chaos": ("chaos", "2P2D, 2 routers under load while children are killed or stopped"),
    "structured": ("offline:structured_main", "a grammar's cost per decode step, with and without"),
    "router": ("router", "one router's ceiling with instant nodes, against two routers"),
    "multihost": ("multihost", "TTFT across hosts with added KV-link latency (root)"),
    "compile": ("compile", "compiled decode steps against eager and the bandwidth floor"),
    "multiturn": ("multiturn", "multi-turn chat: KV moved per turn, TTFT, P/D vs colocated"),
    "tp": ("tp", "TP 1 against TP 2: decode step, all-reduce share, KV GB/s per (p, d)"),
    "gpu": ("gpu", "one CUDA GPU against its floor, HF generate, KV transfer (docs/gpu.md)"),
    "spec": ("spec", "speculative decoding (ngram, suffix) against none: tok/s, acceptance"),
    "replay": ("replay", "a captured request log or Mooncake trace: TTFT stages, prefix hits"),
    "tracing": ("tracing", "saturation tok/s with tracing off, a 10% sample, every request"),
    "kv-tiers": ("kv_tiers", "KV tiers under the pool (host, file, redis) against none: TTFT"),
}


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [f"  {name:<{width}}  {text}" for name, (_, text) in BENCHMARKS.items()]
    end = "\n\n`pdserve bench NAME --help` shows a benchmark's flags."
    return "usage: pdserve bench NAME [flags]\n\nbenchmarks:\n" + "\n".join(lines) + end


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return
    if argv[0] not in BENCHMARKS:
        sys.exit(f"pdserve bench: unknown benchmark {argv[0]!r}\n\n{usage()}")
    module, _, function = BENCHMARKS[argv[0]][0].partition(":")
    run = getattr(importlib.import_module(f"pdserve.bench.{module}"), function or "main")
    result = run(argv[1:])
    if isinstance(result, int) and result:
        sys.exit(result)
