"""`pdserve bench serve`: what `vllm bench serve` reports, of any OpenAI-compatible server."""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pdserve.bench import load
from pdserve.bench.report import SEED_FLAG, TIMEOUT_FLAG, TQDM_FLAG, add_flags, cell, save_json
from pdserve.common.node.cli import parser

SERVER_FLAGS = [
    ("--base-url", str, "http://127.0.0.1:8000", "the OpenAI-compatible server"),
    ("--api-key", str, None, "sent as a Bearer token"),
    ("--model", str, None, "model name to send (default: the first of /v1/models)"),
    ("--tokenizer", str, None, "the model's tokenizer", {"required": True, "metavar": "DIR"}),
]
DATASET_FLAGS = [
    ("--dataset", str, "random", "random: completions; multiturn: chat conversations",
     {"choices": ["random", "multiturn"]}),
    ("--num-prompts", int, 32, "random: requests"),
    ("--input-len", int, 256, "tokens per prompt, on average"),
    ("--output-len", int, 64, "tokens per output, on average"),
    ("--range-ratio", float, 0.0, "lengths uniform in len * [1 - r, 1 + r]"),
    ("--num-conversations", int, 8, "multiturn: conversations"),
    ("--turns", int, 3, "multiturn: turns per conversation"),
    ("--system-prompt-len", int, 256, "multiturn: tokens of the shared system prompt"),
    ("--structured-output", str, None, "constrain requests with this structured output",
     {"choices": sorted(load.STRUCTURED_FIELDS)}),
    ("--structured-output-ratio", float, 1.0, "share of the requests constrained"),
    SEED_FLAG,
    ("--quick", bool, None, "a few short requests, no warm-up (for tests)"),
]  # fmt: skip
LOAD_FLAGS = [
    ("--request-rate", float, math.inf, "requests per second, Poisson (inf: all at once)"),
    ("--max-concurrency", int, None, "requests in flight at most (default: no limit)"),
    ("--temperature", float, 0.0, "0: greedy"),
    TIMEOUT_FLAG,
    ("--num-warmups", int, 1, "untimed requests sent before the run"),
    ("--goodput", str, None, f"SLOs NAME:MS, NAME in {','.join(load.SLO_METRICS)}",
     {"nargs": "*", "metavar": "NAME:MS"}),
    ("--percentiles", str, "50,90,99", "percentiles reported, a comma list"),
]  # fmt: skip
OUTPUT_FLAGS = [
    ("--result-file", str, None, "write the result as JSON here", {"metavar": "FILE"}),
    TQDM_FLAG,
]
QUICK = dict(num_prompts=6, input_len=32, output_len=6, num_conversations=2, turns=2,
             system_prompt_len=32, num_warmups=0)  # fmt: skip
COUNTS = ("completed", "failed", "request_rate", "max_concurrency", "duration_s")
COUNTS += ("total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput")
COUNTS += ("output_throughput", "total_token_throughput", "structured_valid", "structured_invalid")


def format_report(result: dict[str, Any]) -> str:
    """The run's counts, throughputs and latency percentiles (ms), one aligned line each."""
    keys = [k for k in COUNTS if result.get(k) is not None]
    keys += [k for k in result if k.endswith("_ms") and not k.startswith("std")]
    lines = [f"{k:<40}{cell(result[k]):>16}" for k in keys]
    if result["input_len_mismatches"] or result["output_len_mismatches"]:
        lines.append(
            f"note: {result['input_len_mismatches']} prompts and {result['output_len_mismatches']}"
            " outputs differ in length from what was asked (usage counts are reported)"
        )
    return "\n".join(lines)


def with_structured(requests: Sequence[load.BenchRequest], kind: str, ratio: float = 1.0,
                    seed: int = 0) -> list[load.BenchRequest]:  # fmt: skip
    """The requests with a share `ratio` (drawn with `seed`) constrained by `kind` and tagged
    "structured", the others tagged "free"."""
    if kind not in load.STRUCTURED_FIELDS:
        kinds = sorted(load.STRUCTURED_FIELDS)
        raise ValueError(f"unknown structured output {kind!r}; use {kinds}")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError("structured output ratio must be within [0, 1]")
    rng = random.Random(seed + 1)
    out = []
    for r in requests:
        on = rng.random() < ratio
        out.append(replace(r, structured=kind if on else None, tag="structured" if on else "free"))
    return out


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0}; ValueError on bad input."""
    slos = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in load.SLO_METRICS:
            want = f"NAME:MS, NAME in {load.SLO_METRICS}"
            raise ValueError(f"bad --goodput item {item!r}: want {want}")
        slos[name] = float(value)
    return slos


def build_parser() -> argparse.ArgumentParser:
    p = parser("pdserve bench serve", "Stream requests at an OpenAI-compatible server.")
    add_flags(p.add_argument_group("server"), SERVER_FLAGS)
    add_flags(p.add_argument_group("dataset"), DATASET_FLAGS)
    add_flags(p.add_argument_group("load and metrics"), LOAD_FLAGS)
    add_flags(p.add_argument_group("output"), OUTPUT_FLAGS)
    return p


def dataset_from_args(args: argparse.Namespace, pool: load.TokenPool) -> list[load.BenchRequest]:
    if args.dataset == "multiturn":
        n, spread = args.input_len, args.range_ratio
        lens = (n, n, spread, args.output_len, spread, args.system_prompt_len)
        w = load.ChatWorkload(args.num_conversations, args.turns, *lens, False, args.seed)
        requests = [r for turn in load.chat_turns(pool, w) for r in turn]
    else:
        n, lens = args.num_prompts, (args.input_len, args.output_len, args.range_ratio)
        requests = load.random_requests(pool, n, *lens, args.seed)
    if args.structured_output is None:
        return requests
    kind, ratio = args.structured_output, args.structured_output_ratio
    return with_structured(requests, kind, ratio, args.seed)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    try:
        pcts = tuple(float(q) for q in args.percentiles.split(",") if q)
        slos = parse_goodput(args.goodput)
        config = load.BenchConfig.from_args(args, goodput=slos, percentiles=pcts)
        pool = load.load_pool(args.tokenizer)
        requests = dataset_from_args(args, pool)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    result = load.run_benchmark(config, requests, pool)
    cli = sys.argv[1:] if argv is None else list(argv)
    result.update(dataset=args.dataset, tokenizer=args.tokenizer, argv=cli)
    print(format_report(result))
    if args.result_file:
        print(f"wrote {save_json(args.result_file, result)}")
    return result


if __name__ == "__main__":
    main()
