"""`pdserve bench replay FILE`: replay a captured request log (router `--request-log`) or a
Mooncake-format trace (kvcache-ai/Mooncake `FAST25-release/traces`) against a deployment.

Both formats give each request an arrival, its prompt's and answer's lengths and its prompt's
blocks as hash ids; equal ids are equal blocks. A replay synthesizes prompts of token ids where
each distinct id is one fixed random block of plain tokens, so that the prefix structure (which
requests share which leading blocks) is the trace's, and sends them at the trace's arrival
times times `--time-scale`, with lengths and block size times `--length-scale` (Mooncake's
512-token blocks of prompts of 12k tokens, say, as 8-token blocks at 1/64).

It reports, per deployment (`--url`, or one local deployment per `--policies` entry started
from `--model`): client TTFT and TPOT, the mean of every TTFT and hand-off stage (the router's
`pdserve:ttft_stage_seconds` and `pdserve:handoff_stage_seconds`, before and after), and the
prefix hit rate: prompt tokens a node had cached (`usage.prompt_tokens_details.cached_tokens`)
over prompt tokens. For a captured log, the original run's hit rate too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench import load

MOONCAKE_BLOCK = 512  # FAST25-release/README.md: "The block size is 512 tokens"
CAPS = load.ServerCaps(token_ids=True, eos_mode="ignore_eos", model=None)
STAGE_METRICS = ("pdserve:ttft_stage_seconds", "pdserve:handoff_stage_seconds")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: arrival (s from the trace's first), lengths, and its prompt's
    blocks as ids (equal ids: equal blocks of `block_size` tokens)."""

    at: float
    input_len: int
    output_len: int
    block_size: int
    hash_ids: tuple[int, ...]
    cached_tokens: int | None = None  # a captured log's: what the original run had cached


def parse(lines: Iterable[str]) -> list[TraceRequest]:
    """A captured log's or a Mooncake trace's requests, by arrival (ValueError on a line of
    neither format). Hash ids of a log (hex strings) become small ints, equal for equal."""
    ids: dict[Any, int] = {}
    out: list[TraceRequest] = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            out.append(_request(json.loads(line), ids, n))
    if not out:
        raise ValueError("the trace holds no request")
    first = min(r.at for r in out)
    return sorted((_shifted(r, first) for r in out), key=lambda r: r.at)


def _request(row: dict[str, Any], ids: dict[Any, int], n: int) -> TraceRequest:
    hashes = tuple(ids.setdefault(h, len(ids)) for h in row.get("hash_ids", ()))
    if "timestamp" in row:  # Mooncake: ms, 512-token blocks
        at, size = row["timestamp"] / 1000, MOONCAKE_BLOCK
        lengths, cached = (row["input_length"], row["output_length"]), None
    elif "arrival" in row:  # router --request-log
        at, size = row["arrival"], row["block_size"]
        lengths, cached = (row["prompt_tokens"], row["output_tokens"]), row["cached_tokens"]
    else:
        raise ValueError(f"line {n}: neither a Mooncake trace nor a request log line")
    if min(lengths) < 1:
        raise ValueError(f"line {n}: lengths must be >= 1, got {lengths}")
    return TraceRequest(float(at), *lengths, size, hashes, cached)


def _shifted(r: TraceRequest, first: float) -> TraceRequest:
    return TraceRequest(
        r.at - first, r.input_len, r.output_len, r.block_size, r.hash_ids, r.cached_tokens
    )


def scaled(
    r: TraceRequest, time_scale: float, length_scale: float, output_scale: float
) -> TraceRequest:
    """`r` at `time_scale` times its arrival, its prompt and blocks at `length_scale` times
    their tokens (a block at least 1), its answer at `output_scale` times (at least 1)."""
    size = max(1, round(r.block_size * length_scale))
    prompt = max(1, round(r.input_len * length_scale))
    answer = max(1, round(r.output_len * output_scale))
    return TraceRequest(r.at * time_scale, prompt, answer, size, r.hash_ids, r.cached_tokens)


def synthesize(r: TraceRequest, index: int, pool: load.TokenPool, seed: int) -> list[int]:
    """The prompt of `r`: the fixed block of each hash id in turn, cut or filled (with tokens
    of this request alone) to its length."""
    ids: list[int] = []
    for h in r.hash_ids:
        if len(ids) >= r.input_len:
            break
        ids += pool.token_ids(random.Random(f"{seed}:block:{h}"), r.block_size)
    if len(ids) < r.input_len:
        ids += pool.token_ids(random.Random(f"{seed}:tail:{index}"), r.input_len - len(ids))
    return ids[: r.input_len]


def requests_of(
    trace: Sequence[TraceRequest], pool: load.TokenPool, seed: int
) -> list[load.BenchRequest]:
    return [
        load.BenchRequest(synthesize(r, i, pool, seed), None, r.input_len, r.output_len, exact=True)
        for i, r in enumerate(trace)
    ]


def hit_rate(cached: Iterable[int], prompts: Iterable[int]) -> float:
    total = sum(prompts)
    return sum(cached) / total if total else 0.0


def stage_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean ms per stage over the run, from the stage histograms' sums and counts."""
    out: dict[str, float] = {}
    for key, total in after.items():
        if not key.endswith("_sum"):
            continue
        count = after.get(key[:-4] + "_count", 0.0) - before.get(key[:-4] + "_count", 0.0)
        if count > 0:
            out[key[:-4]] = round(1000 * (total - before.get(key, 0.0)) / count, 2)
    return out


async def _stage_totals(client: Any) -> dict[str, float]:
    resp = await client.get("/metrics")
    resp.raise_for_status()
    out: dict[str, float] = {}
    for line in resp.text.splitlines():
        for name in STAGE_METRICS:
            if line.startswith(name) and ("_sum{" in line or "_count{" in line):
                series, _, value = line.rpartition(" ")
                kind = "sum" if "_sum{" in series else "count"
                stage = series.split('stage="', 1)[1].split('"', 1)[0]
                out[f"{stage}_{kind}"] = float(value)
    return out


async def replay(url: str, trace: Sequence[TraceRequest], requests: Sequence[load.BenchRequest],
                 max_concurrency: int | None, timeout_s: float) -> dict[str, Any]:  # fmt: skip
    """Send every request at its arrival against the deployment at `url`; the report."""
    async with load.make_client(url) as client:
        sender = load.Sender(client, url, CAPS, timeout_s=timeout_s)
        before = await _stage_totals(client)
        results, duration = await load.send_all(
            sender, requests, [r.at for r in trace], max_concurrency
        )
        after = await _stage_totals(client)
    return report(results, duration, stage_means(before, after))


def report(
    results: Sequence[load.RequestResult], duration: float, stages: dict[str, float]
) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": round(duration, 2),
        "hit_rate": round(
            hit_rate((r.cached_tokens for r in ok), (r.prompt_tokens for r in ok)), 4
        ),
        "lengths": [[r.prompt_tokens, r.output_tokens] for r in results],
        **load.distribution("ttft", [r.ttft for r in ok], (90, 99)),
        **load.distribution("tpot", tpots, (90,)),
        "stage_mean_ms": stages,
    }


def run_local(args: argparse.Namespace, policy: str, trace: Sequence[TraceRequest],
              requests: Sequence[load.BenchRequest]) -> dict[str, Any]:  # fmt: skip
    """One local deployment of `args.model` under `policy`, replayed against; its request log
    is kept beside the report (`--out`) or in a temporary folder."""
    from pdserve.local_cluster import LocalCluster

    log_dir = Path(args.out).parent if args.out else Path(tempfile.mkdtemp(prefix="replay-"))
    request_log = log_dir / f"replay-{policy}.jsonl"
    router = ["--policy", policy, "--request-log", str(request_log), *args.router_args]
    cluster = LocalCluster(args.model, args.prefill, args.decode, args.colocated,
                           engine_args=args.engine_args, router_args=router)  # fmt: skip
    try:  # a start that fails stops what it started too
        cluster.start(timeout=args.start_timeout)
        done = asyncio.run(replay(cluster.url, trace, requests, args.max_concurrency, args.timeout))
    finally:
        cluster.stop()
    return done | {"policy": policy, "request_log": str(request_log)}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench replay", description=__doc__.split("\n")[0])
    p.add_argument("trace", help="a router --request-log file or a Mooncake-format trace (JSONL)")
    p.add_argument("--url", help="a running deployment's router (else --model: local ones)")
    p.add_argument("--model", help="model directory for local deployments, and the tokenizer")
    p.add_argument("--tokenizer", help="tokenizer directory for prompts (default: --model)")
    p.add_argument("--policies", default="round_robin,least_loaded,prefix_aware",
                   help="local deployments' routing policies, one run each")  # fmt: skip
    p.add_argument("--prefill", type=int, default=1, help="local prefill nodes")
    p.add_argument("--decode", type=int, default=1, help="local decode nodes")
    p.add_argument("--colocated", type=int, default=0, help="local colocated nodes")
    p.add_argument("--engine-args", nargs=argparse.REMAINDER, default=[],
                   help="the rest: flags every local node gets")  # fmt: skip
    p.add_argument("--router-args", type=str.split, default=[], help="flags the router gets")
    p.add_argument("--time-scale", type=float, default=1.0, help="arrival times times this")
    p.add_argument("--length-scale", type=float, default=1.0, help="prompts and blocks times this")
    p.add_argument("--output-scale", type=float, help="answers times this (default: length)")
    p.add_argument("--limit", type=int, help="replay the first N requests only")
    p.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    p.add_argument("--timeout", type=float, default=600.0, help="per request (s)")
    p.add_argument("--start-timeout", type=float, default=120.0, help="a local deployment's (s)")
    p.add_argument("--seed", type=int, default=0, help="of the blocks' tokens")
    p.add_argument_group("output").add_argument("--out", help="the report (JSON), logs beside")
    args = p.parse_args(argv)
    if (args.url is None) == (args.model is None):
        p.error("give one of --url (a running deployment) or --model (local ones)")
    if args.tokenizer is None and args.model is None:
        p.error("--url needs --tokenizer (the prompts are made of its plain tokens)")
    return args


def load_trace(args: argparse.Namespace) -> list[TraceRequest]:
    with open(args.trace, encoding="utf-8") as f:
        trace = parse(f)[: args.limit]
    output = args.length_scale if args.output_scale is None else args.output_scale
    return [scaled(r, args.time_scale, args.length_scale, output) for r in trace]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    trace = load_trace(args)
    requests = requests_of(trace, load.load_pool(args.tokenizer or args.model), args.seed)
    result: dict[str, Any] = {"trace": args.trace, "runs": []}
    if all(r.cached_tokens is not None for r in trace):  # a captured log: its own hit rate
        cached = (r.cached_tokens or 0 for r in trace)
        result["original_hit_rate"] = round(hit_rate(cached, (r.input_len for r in trace)), 4)
    if args.url:
        run = asyncio.run(replay(args.url, trace, requests, args.max_concurrency, args.timeout))
        result["runs"].append(run | {"policy": "as deployed"})
    else:
        for policy in args.policies.split(","):
            result["runs"].append(run_local(args, policy, trace, requests))
    print(render(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def render(result: dict[str, Any]) -> str:
    """The report as a text table: one row per run."""
    lines = [f"trace {result['trace']}"]
    if "original_hit_rate" in result:
        lines.append(f"original run's prefix hit rate {100 * result['original_hit_rate']:.1f}%")
    lines.append(
        "policy          ok/n   hit %   TTFT p50 ms  p90 ms  TPOT p50 ms  stages (mean ms)"
    )
    for r in result["runs"]:
        stages = ", ".join(f"{k} {v:.1f}" for k, v in r["stage_mean_ms"].items())
        lines.append(
            f"{r['policy']:<14} {r['completed']:>3}/{r['requests']:<3} {100 * r['hit_rate']:6.1f}"
            f"  {r['median_ttft_ms']:11.1f} {r['p90_ttft_ms']:7.1f}  {r['median_tpot_ms']:11.1f}"
            f"  {stages}"
        )
    return "\n".join(lines)
