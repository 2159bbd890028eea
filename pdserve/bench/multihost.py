"""`pdserve bench multihost` (needs root, like the hosts of `pdserve.testbed`): TTFT through
1P1D on separate hosts, the KV link direct and through a relay host that adds a fixed one-way
delay (`DelayProxy`; `tc netem` where the kernel has it), sequential streaming requests."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
from typing import Any

from pdserve.bench import load
from pdserve.bench import report as rp
from pdserve.bench.systems import sigterm_raises
from pdserve.common.node.cli import parser
from pdserve.testbed.cluster import KV_PORT, HostCluster
from pdserve.testbed.hosts import Hosts, netem_reason, skip_reason


def _first_tokens(url: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """Seconds from sending a streaming request to its first token (the prefill node's) and
    to its second (the decode node's first: it needs the KV to have arrived)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}

    async def once() -> load.RequestResult:
        async with load.make_client() as client:
            return await load.stream_one(client, url, body, keep_text=False, timeout_s=120.0)

    res = asyncio.run(once())
    if res.error or not res.itl:
        raise RuntimeError(f"no second token: {res.error or f'{res.chunks} chunk(s)'}")
    return res.ttft, res.ttft + res.itl[0]


FLAGS = [
    ("--model", str, None, "default: the real SmolLM2 (pdserve.models)"),
    ("--delays-ms", str, "0,5,20,100", "one-way KV-link delays (ms)"),
    ("--prompt-tokens", int, 512, "tokens per prompt"),
    ("--requests", int, 12, "sequential requests per row"),
    ("--max-tokens", int, 4, "output tokens per request"),
    ("--log-dir", str, "/tmp/pdserve-bench-multihost", "child logs"),
    ("--quick", bool, None, "tiny model, few requests"),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser("pdserve bench multihost", __doc__.split("\n\n")[0])
    rp.add_flags(p.add_argument_group("run"), FLAGS)
    rp.add_output_flags(p, "multihost_kv_latency.json")
    args = p.parse_args(argv)
    args.outputs = rp.outputs_from_args(p, args)
    return args


def measure_rows(hosts: Hosts, model: str, prompts: list[list[int]], delays: list[float],
                 args: argparse.Namespace) -> list[dict]:  # fmt: skip
    """The direct KV link, then each delay through the relay: one row each."""
    cluster = HostCluster(hosts, model, args.log_dir, ["--max-model-len", "2048"])
    rows = []
    try:
        url = cluster.router("router", ("--prefill-placement", "remote"))  # the KV link
        p = cluster.node("prefill", "prefill", ["router"])
        for delay in [None, *delays]:  # None: the direct link, no relay
            extra: tuple[str, ...] = ()
            proxy = None  # the relay of a delayed link
            if delay is not None:
                proxy = hosts.start_proxy("relay", KV_PORT, "decode", KV_PORT, delay / 1000)
                extra = ("--advertise-host", hosts.addr("relay"))
            d = cluster.node("decode", "decode", ["router"], extra=extra)
            cluster.wait_ready("router", [p, d])
            for prompt in prompts[:2]:  # warm-up
                _first_tokens(url, prompt[: args.prompt_tokens // 2], args.max_tokens)
            firsts = [_first_tokens(url, pr, args.max_tokens) for pr in prompts[2:]]
            cluster.stop(d)
            rows.append(_row(delay, firsts, proxy.close() if proxy is not None else {}))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        cluster.close()
    return rows


def _row(delay: float | None, firsts: list[tuple[float, float]], relayed: dict) -> dict:
    ttfts, seconds = [f for f, _ in firsts], [s for _, s in firsts]
    # handoff gap, per request: the decode node's start after the prefill node's token, the
    # part of the wait the KV link's delay lands on
    return {
        "kv_link": "direct" if delay is None else f"relay +{delay:g} ms",
        "one_way_delay_ms": delay, "ttfts_s": ttfts, "second_tokens_s": seconds,
        "ttft_median_s": statistics.median(ttfts),
        "ttft_p90_s": sorted(ttfts)[int(0.9 * (len(ttfts) - 1))],
        "second_token_median_s": statistics.median(seconds),
        "handoff_gap_median_s": statistics.median(b - a for a, b in zip(ttfts, seconds)),
        "relay_bytes": relayed,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    why = skip_reason()
    if why:
        print(f"pdserve bench multihost: cannot build hosts here: {why}", file=sys.stderr)
        return 2
    if args.quick:
        from pdserve.tiny_model import make_tiny_model

        model = str(make_tiny_model("llama", os.path.join(args.log_dir, "tiny"), max_position=2048))
        args.requests, args.delays_ms = 3, "0,5"
    else:
        from pdserve.models import smollm2

        model = args.model or str(smollm2())
    delays = [float(d) for d in args.delays_ms.split(",")]
    vocab = 512 if args.quick else 49152
    prompts = [[(i * 7919 + k * 104729) % (vocab - 10) + 5 for k in range(args.prompt_tokens)]
               for i in range(args.requests + 2)]  # fmt: skip
    with sigterm_raises(), Hosts(["router", "prefill", "decode", "relay"]) as hosts:
        rows = measure_rows(hosts, model, prompts, delays, args)
    for key in ("ttft", "second_token"):
        for row in rows:
            row[f"{key}_vs_direct"] = row[f"{key}_median_s"] / rows[0][f"{key}_median_s"]
    result = {"command": rp.command_line("bench_multihost.py", argv), "model": model,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "prompt_tokens": args.prompt_tokens, "requests_per_row": args.requests,
              "netem": netem_reason() or "available", "rows": rows}  # fmt: skip
    out = args.outputs
    out.folder.mkdir(parents=True, exist_ok=True)
    rp.save_json(out.folder / "multihost_kv_latency.json", result)
    rp.write_section("multihost", section(result), out.page)
    print(rp.records_table(COLUMNS, rows))
    print(f"wrote {out.folder / 'multihost_kv_latency.json'} and the section of {out.page}")
    return 0


def _ms(key: str) -> Any:
    return lambda r: f"{r[key] * 1000:.1f}"


COLUMNS = [
    ("KV link", "kv_link"),
    ("TTFT median ms", _ms("ttft_median_s")),
    ("TTFT p90 ms", _ms("ttft_p90_s")),
    ("TTFT vs direct", lambda r: f"{r['ttft_vs_direct']:.2f}x"),
    ("2nd token median ms", _ms("second_token_median_s")),
    ("1st to 2nd token ms", _ms("handoff_gap_median_s")),
    ("relayed MB (P to D)", lambda r: f"{r['relay_bytes'].get('up', 0) / 1e6:.1f}"
     if r["relay_bytes"] else "-"),
]  # fmt: skip


def section(result: dict) -> str:
    setup = [
        ["model", result["model"].rsplit("/", 1)[-1]],
        ["prompt tokens, sequential streaming requests per row",
         f"{result['prompt_tokens']}, {result['requests_per_row']}"],
        ["netem", result["netem"]],
    ]  # fmt: skip
    return "\n\n".join([
        "## TTFT across hosts with added KV-link latency (`pdserve bench multihost`)",
        f"    {result['command']}", rp.markdown_table(["run", ""], setup),
        rp.records_table(COLUMNS, result["rows"]),
    ])  # fmt: skip
