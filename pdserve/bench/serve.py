"""`pdserve bench serve`: stream requests at any OpenAI-compatible server and report what
`vllm bench serve` reports (throughput, TTFT, TPOT, ITL, E2E latency, goodput); the load and
its metrics are `pdserve.bench.load`'s, the flags are described in docs/benchmarks.md."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import Any

from pdserve.bench.load import (
    SLO_METRICS,
    STRUCTURED_FIELDS,
    BenchConfig,
    BenchRequest,
    ChatWorkload,
    TokenPool,
    chat_turns,
    load_pool,
    random_requests,
    run_benchmark,
    with_structured,
)
from pdserve.bench.report import save_json
from pdserve.common.node.cli import parser

# ---------------------------------------------------------------- text report


def format_report(result: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """The result as the aligned text block a terminal shows."""
    width = 56
    lines = [f" {title} ".center(width, "=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{text:>16}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    row("Request rate (req/s):", result["request_rate"])
    row("Max concurrency:", result["max_concurrency"])
    row("Benchmark duration (s):", result["duration_s"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    for name, label in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        lines.append(f" {label} ".center(width, "-"))
        for key, value in result.items():
            if key.endswith(f"_{name}_ms") and not key.startswith("std"):
                stat = key.split("_")[0].capitalize()
                row(f"{stat} {name.upper()} (ms):", value)
    if "structured_valid" in result:
        row("Structured outputs valid:", result["structured_valid"])
        row("Structured outputs invalid:", result["structured_invalid"])
    if result["input_len_mismatches"] or result["output_len_mismatches"]:
        lines.append(
            f"note: {result['input_len_mismatches']} prompts and {result['output_len_mismatches']}"
            " outputs differ in length from what was asked (usage counts are reported)"
        )
    lines.append("=" * width)
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0}; ValueError on bad input."""
    slos = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"bad --goodput item {item!r}: want NAME:MS, NAME in {SLO_METRICS}")
        slos[name] = float(value)
    return slos


def _server_flags(p: argparse.ArgumentParser) -> None:
    server = p.add_argument_group("server")
    server.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="the OpenAI-compatible server"
    )
    server.add_argument("--api-key", default=None, help="sent as a Bearer token")
    server.add_argument(
        "--model", default=None, help="model name to send (default: the first of /v1/models)"
    )
    server.add_argument(
        "--tokenizer",
        required=True,
        metavar="DIR",
        help="tokenizer directory (the model's): builds prompts and counts their tokens",
    )


def _dataset_flags(p: argparse.ArgumentParser) -> None:
    data = p.add_argument_group("dataset")
    data.add_argument(
        "--dataset",
        default="random",
        choices=["random", "multiturn"],
        help="random: /v1/completions; multiturn: /v1/chat/completions conversations",
    )
    data.add_argument("--num-prompts", type=int, default=32, help="random: requests")
    data.add_argument("--input-len", type=int, default=256, help="tokens per prompt, on average")
    data.add_argument("--output-len", type=int, default=64, help="tokens per output, on average")
    data.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in len * [1 - r, 1 + r]",
    )
    data.add_argument("--num-conversations", type=int, default=8, help="multiturn: conversations")
    data.add_argument("--turns", type=int, default=3, help="multiturn: turns per conversation")
    data.add_argument(
        "--system-prompt-len",
        type=int,
        default=256,
        help="multiturn: tokens of the system prompt all conversations share",
    )
    data.add_argument(
        "--structured-output",
        default=None,
        choices=sorted(STRUCTURED_FIELDS),
        help="constrain requests with this structured output (default: none)",
    )
    data.add_argument(
        "--structured-output-ratio",
        type=float,
        default=1.0,
        help="share of the requests constrained; the rest run free in the same run",
    )
    data.add_argument("--seed", type=int, default=0, help="seed of lengths, prompts, arrivals")
    data.add_argument(
        "--quick", action="store_true", help="a few short requests, no warm-up (for tests)"
    )


def _load_flags(p: argparse.ArgumentParser) -> None:
    load = p.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (inf: all at once)",
    )
    load.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at most (default: no limit)",
    )
    load.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    load.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds one request may take"
    )
    load.add_argument(
        "--num-warmups", type=int, default=1, help="untimed requests sent before the run"
    )
    metrics = p.add_argument_group("metrics")
    metrics.add_argument(
        "--goodput",
        nargs="*",
        default=None,
        metavar="NAME:MS",
        help=f"SLOs in milliseconds, NAME in {','.join(SLO_METRICS)}, e.g. ttft:500 tpot:50 "
        "(default: no goodput)",
    )
    metrics.add_argument(
        "--percentiles", default="50,90,99", help="percentiles reported, a comma list"
    )
    out = p.add_argument_group("output")
    out.add_argument(
        "--result-file", default=None, metavar="FILE", help="write the result as JSON here"
    )
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    p = parser(
        "pdserve bench serve",
        "Stream requests at an OpenAI-compatible server: TTFT, ITL, throughput.",
    )
    _server_flags(p)
    _dataset_flags(p)
    _load_flags(p)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    try:
        return BenchConfig(
            base_url=args.base_url,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            temperature=args.temperature,
            goodput=parse_goodput(args.goodput),
            percentiles=tuple(float(q) for q in args.percentiles.split(",") if q),
            request_timeout=args.request_timeout,
            num_warmups=args.num_warmups,
            api_key=args.api_key,
            model=args.model,
            disable_tqdm=args.disable_tqdm,
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def dataset_from_args(args: argparse.Namespace, pool: TokenPool) -> list[BenchRequest]:
    requests = _dataset(args, pool)
    if args.structured_output is None:
        return requests
    try:
        return with_structured(
            requests, args.structured_output, args.structured_output_ratio, args.seed
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def _dataset(args: argparse.Namespace, pool: TokenPool) -> list[BenchRequest]:
    if args.dataset == "multiturn":
        w = ChatWorkload(
            conversations=args.num_conversations,
            turns=args.turns,
            first_len=args.input_len,
            message_len=args.input_len,
            range_ratio=args.range_ratio,
            answer_len=args.output_len,
            answer_range=args.range_ratio,
            system_len=args.system_prompt_len,
            exact=False,
            seed=args.seed,
        )
        return [r for turn in chat_turns(pool, w) for r in turn]
    return random_requests(
        pool, args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed
    )


QUICK = {
    "num_prompts": 6,
    "input_len": 32,
    "output_len": 6,
    "num_conversations": 2,
    "turns": 2,
    "system_prompt_len": 32,
    "num_warmups": 0,
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    config = config_from_args(args)
    pool = load_pool(args.tokenizer)
    requests = dataset_from_args(args, pool)
    result = run_benchmark(config, requests, pool)
    cli = sys.argv[1:] if argv is None else list(argv)
    result.update(dataset=args.dataset, tokenizer=args.tokenizer, argv=cli)
    print(format_report(result))
    if args.result_file:
        print(f"wrote {save_json(args.result_file, result)}")
    return result


if __name__ == "__main__":
    main()
