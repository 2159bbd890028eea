"""`pdserve bench tracing`: what OpenTelemetry tracing costs at saturation, measured against
tracing off in the same run.

Three local deployments of `--model` (router + `--prefill` prefill and `--decode` decode
nodes each): tracing off (no endpoint: nothing of the SDK imported), a `--trace-sample-ratio`
0.1 sample, and every request traced. The traced ones' router and nodes export to an OTLP/HTTP
receiver in a process of its own (`common/tracing_receiver.py`: the load generator shares no
interpreter with it), which reads every batch and drops it (a collector on the same host would
take the same batches). Each round drives each deployment in turn with the same closed
loop (`--concurrency` streams, each sending its next request when its last one ended, for
`--duration` s), in an order that rotates by round, so that no setting always runs first;
the idle deployments wait meanwhile. Reported per setting: output tokens/s of the requests
that ended within the window and the CPU ms per request of the router and each node (from
/proc: what the neighbours' load moves least), their medians over rounds and ratios to tracing
off, and the batches the receiver got.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from pdserve.bench import load
from pdserve.bench.router import cpu_seconds
from pdserve.common.tracing_receiver import ReceiverProcess

# setting -> the sample ratio its router starts traces at (None: tracing off)
SETTINGS: dict[str, float | None] = {"off": None, "sample 10%": 0.1, "every request": 1.0}
BASELINE = "off"
CAPS = load.ServerCaps(token_ids=True, eos_mode="ignore_eos", model=None)


def tracing_flags(ratio: float | None, url: str) -> tuple[list[str], list[str]]:
    """The router's and the nodes' flags of one setting."""
    if ratio is None:
        return [], []
    nodes = ["--otlp-traces-endpoint", url]
    return [*nodes, "--trace-sample-ratio", str(ratio)], nodes


@contextmanager
def deployments(args: argparse.Namespace, url: str) -> Iterator[dict[str, Any]]:
    """Every setting's deployment, started one after another, stopped together."""
    from pdserve.local_cluster import LocalCluster

    with ExitStack() as stack:
        out = {}
        for name, ratio in SETTINGS.items():
            router, nodes = tracing_flags(ratio, url)
            cluster = LocalCluster(
                args.model,
                args.prefill,
                args.decode,
                engine_args=[*args.engine_args, *nodes],
                router_args=[*args.router_args, *router],
            )
            stack.callback(cluster.stop)
            cluster.start(timeout=args.start_timeout)
            out[name] = cluster
        yield out


def cpu_of(cluster: Any) -> dict[str, float]:
    """CPU seconds so far of each of a deployment's processes (router, nodes), by name."""
    return {name: cpu_seconds(proc.pid) for name, proc in cluster.procs.items()}


async def saturate(cluster: Any, requests: Sequence[load.BenchRequest], concurrency: int,
                   duration: float) -> dict[str, Any]:  # fmt: skip
    """One closed-loop window against `cluster`'s router: output tokens/s and requests/s of the
    requests that ended well within it, and the CPU milliseconds each of its processes spent
    per such request (what the neighbours' load on the box changes least)."""
    url, cpu = cluster.url, cpu_of(cluster)
    results: list[load.RequestResult] = []
    async with load.make_client(url) as client:
        sender = load.Sender(client, url, CAPS, timeout_s=duration + 120)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await load.closed_loop(
            lambda _w, i: sender.send(requests[i % len(requests)]),
            concurrency=concurrency,
            duration_s=duration,
            on_result=lambda _i, r: results.append(r),
        )
        wall = loop.time() - start
    ok = [r for r in results if r.success]
    spent = {name: seconds - cpu[name] for name, seconds in cpu_of(cluster).items()}
    return {
        "tokens_per_s": sum(r.output_tokens for r in ok) / wall,
        "requests_per_s": len(ok) / wall,
        "errors": len(results) - len(ok),
        "wall_s": wall,
        "cpu_ms_per_request": {n: round(1e3 * s / max(1, len(ok)), 3) for n, s in spent.items()},
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    pool = load.load_pool(args.model)
    requests = load.random_requests(pool, 256, args.input_len, args.output_len, seed=args.seed)
    receiver = ReceiverProcess()
    rounds: list[dict[str, Any]] = []
    received = {"batches": 0, "bytes": 0}
    try:
        with deployments(args, receiver.url) as clusters:
            names = list(SETTINGS)
            for name in names:  # a short warm-up each: first requests, first exports
                asyncio.run(saturate(clusters[name], requests, args.concurrency, 3.0))
            for r in range(args.rounds):
                order = names[r % len(names) :] + names[: r % len(names)]
                for name in order:
                    window = saturate(clusters[name], requests, args.concurrency, args.duration)
                    rounds.append({"round": r, "setting": name, **asyncio.run(window)})
                    print(json.dumps(rounds[-1]), file=sys.stderr)
    finally:
        received = receiver.close()
    return {"rounds": rounds, "settings": summary(rounds), "otlp_batches": received["batches"],
            "otlp_bytes": received["bytes"]}  # fmt: skip


def summary(rounds: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setting: median tokens/s over the rounds and the deployment's median CPU ms per
    request (all its processes), each with its ratio to tracing off's; the CPU ms by process."""
    out = []
    for name in SETTINGS:
        mine = [r for r in rounds if r["setting"] == name]
        cpu = [r.get("cpu_ms_per_request", {}) for r in mine]
        out.append({
            "setting": name,
            "median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in mine), 2),
            "per_round": [round(r["tokens_per_s"], 2) for r in mine],
            "median_cpu_ms_per_request": round(statistics.median(sum(c.values()) for c in cpu), 3),
            "cpu_ms_by_process": {
                p: round(statistics.median(c[p] for c in cpu), 3) for p in cpu[0]
            },
        })  # fmt: skip
    base = out[list(SETTINGS).index(BASELINE)]
    for s in out:
        s["ratio_to_off"] = _ratio(s["median_tokens_per_s"], base["median_tokens_per_s"])
        s["cpu_ratio_to_off"] = _ratio(
            s["median_cpu_ms_per_request"], base["median_cpu_ms_per_request"]
        )
    return out


def _ratio(value: float, base: float) -> float | None:
    return round(value / base, 4) if base else None


def render(result: dict[str, Any]) -> str:
    lines = ["setting          tok/s (median)  ratio to off  CPU ms/req  ratio  per round (tok/s)"]
    for s in result["settings"]:
        rounds = ", ".join(f"{v:.1f}" for v in s["per_round"])
        lines.append(
            f"{s['setting']:<16} {s['median_tokens_per_s']:14.1f}  {s['ratio_to_off']:12.3f}"
            f"  {s['median_cpu_ms_per_request']:10.2f}  {s['cpu_ratio_to_off']:5.3f}  {rounds}"
        )
        lines.append(f"{'':16} CPU ms/req by process: {s['cpu_ms_by_process']}")
    lines.append(f"OTLP batches received {result['otlp_batches']} ({result['otlp_bytes']} bytes)")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench tracing", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="model directory (and its tokenizer)")
    p.add_argument("--prefill", type=int, default=1, help="prefill nodes per deployment")
    p.add_argument("--decode", type=int, default=1, help="decode nodes per deployment")
    p.add_argument("--concurrency", type=int, default=16, help="closed-loop streams")
    p.add_argument("--duration", type=float, default=30.0, help="one window (s)")
    p.add_argument("--rounds", type=int, default=3, help="windows per setting")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=32, help="answer tokens")
    p.add_argument("--start-timeout", type=float, default=300.0, help="a deployment's start (s)")
    p.add_argument("--seed", type=int, default=0, help="of the prompts")
    p.add_argument("--router-args", type=str.split, default=[], help="flags every router gets")
    p.add_argument("--engine-args", nargs=argparse.REMAINDER, default=[],
                   help="the rest: flags every node gets")  # fmt: skip
    p.add_argument_group("output").add_argument("--out", help="the report (JSON)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    result = {"command": ["pdserve", "bench", "tracing", *(argv or sys.argv[1:])]}
    result |= measure(args)
    print(render(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result
