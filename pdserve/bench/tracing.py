"""`pdserve bench tracing`: what OpenTelemetry tracing costs at saturation, measured against
tracing off in the same run.

Three local deployments of `--model` (router + `--prefill` prefill and `--decode` decode
nodes each): tracing off (no endpoint: nothing of the SDK imported), a `--trace-sample-ratio`
0.1 sample, and every request traced. The traced ones' router and nodes export to an OTLP/HTTP
receiver this process runs, which reads every batch and drops it (a collector on the same host
would take the same batches). Each round drives each deployment in turn with the same closed
loop (`--concurrency` streams, each sending its next request when its last one ended, for
`--duration` s), in an order that rotates by round, so that no setting always runs first;
the idle deployments wait meanwhile. Reported per setting: output tokens/s of the requests
that ended within the window, its median over rounds and its ratio to tracing off, and the
spans the receiver got.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from pdserve.bench import load

# setting -> the sample ratio its router starts traces at (None: tracing off)
SETTINGS: dict[str, float | None] = {"off": None, "sample 10%": 0.1, "every request": 1.0}
BASELINE = "off"
CAPS = load.ServerCaps(token_ids=True, eos_mode="ignore_eos", model=None)


class DropReceiver:
    """An OTLP/HTTP endpoint on loopback that reads each export whole and drops it; it counts
    the batches and their bytes."""

    def __init__(self) -> None:
        self.batches = 0
        self.bytes = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                n = len(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.batches += 1
                receiver.bytes += n
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/traces"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


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


async def saturate(url: str, requests: Sequence[load.BenchRequest], concurrency: int,
                   duration: float) -> dict[str, float]:  # fmt: skip
    """One closed-loop window against the router at `url`: output tokens/s and requests/s of
    the requests that ended well within it."""
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
    return {
        "tokens_per_s": sum(r.output_tokens for r in ok) / wall,
        "requests_per_s": len(ok) / wall,
        "errors": len(results) - len(ok),
        "wall_s": wall,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    pool = load.load_pool(args.model)
    requests = load.random_requests(pool, 256, args.input_len, args.output_len, seed=args.seed)
    receiver = DropReceiver()
    rounds: list[dict[str, Any]] = []
    try:
        with deployments(args, receiver.url) as clusters:
            names = list(SETTINGS)
            for name in names:  # a short warm-up each: first requests, first exports
                asyncio.run(saturate(clusters[name].url, requests, args.concurrency, 3.0))
            for r in range(args.rounds):
                order = names[r % len(names) :] + names[: r % len(names)]
                for name in order:
                    window = saturate(clusters[name].url, requests, args.concurrency, args.duration)
                    rounds.append({"round": r, "setting": name, **asyncio.run(window)})
                    print(json.dumps(rounds[-1]), file=sys.stderr)
    finally:
        receiver.close()
    return {"rounds": rounds, "settings": summary(rounds), "otlp_batches": receiver.batches,
            "otlp_bytes": receiver.bytes}  # fmt: skip


def summary(rounds: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setting: median tokens/s over the rounds, its ratio to tracing off's median."""
    median = {
        name: statistics.median(r["tokens_per_s"] for r in rounds if r["setting"] == name)
        for name in SETTINGS
    }
    base = median[BASELINE]
    return [
        {"setting": name, "median_tokens_per_s": round(m, 2),
         "ratio_to_off": round(m / base, 4) if base else None,
         "per_round": [round(r["tokens_per_s"], 2) for r in rounds if r["setting"] == name]}
        for name, m in median.items()
    ]  # fmt: skip


def render(result: dict[str, Any]) -> str:
    lines = ["setting          tok/s (median)  ratio to off  per round"]
    for s in result["settings"]:
        rounds = ", ".join(f"{v:.1f}" for v in s["per_round"])
        lines.append(
            f"{s['setting']:<16} {s['median_tokens_per_s']:14.1f}  {s['ratio_to_off']:12.3f}"
            f"  {rounds}"
        )
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
