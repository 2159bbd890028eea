"""`pdserve bench router`: how much one router can proxy, and what a second one adds, with
fake nodes that answer at once (`pdserve.testbed.fake_nodes`) behind the routers."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, astuple, dataclass
from pathlib import Path
from typing import Any

from pdserve.bench import load
from pdserve.bench import report as rp
from pdserve.bench.systems import RoutersOverFakes, routers_over_fakes, sigterm_raises
from pdserve.common.node.cli import parser
from pdserve.placement import pin

HOST = "127.0.0.1"
MODEL_NAME = "router-bench"  # the routers' --served-model-name (systems.routers_over_fakes)
MODEL_SPEC: dict[str, Any] = {}  # make_tiny_model's defaults: only its tokenizer matters here
PINS = ("split", "shared")
ROUTERS = (1, 2)
REQUEST_TIMEOUT_S = 30.0
PROMPTS = (
    "The quick brown fox jumps over the lazy dog near the river bank",
    "Write a short story about a cat who finds a map in an old house",
    "Explain why the sky is blue in one sentence for a child",
    "List three things a farmer does in the morning before sunrise",
)


@dataclass(frozen=True, slots=True)
class Sizes:
    concurrency: tuple[int, ...]
    max_tokens: int
    warmup_s: float
    duration_s: float
    pins: tuple[str, ...]


FULL = Sizes((8, 16, 32, 64, 128), 32, 1.0, 5.0, PINS)
QUICK = Sizes((4, 16), 16, 0.5, 2.0, ("split",))


def completion(i: int, max_tokens: int) -> dict[str, Any]:
    """The body of request i: one of PROMPTS, streamed, with usage."""
    prompt = PROMPTS[i % len(PROMPTS)]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    return {**body, "stream_options": {"include_usage": True}}


async def send_one(port: int, i: int, max_tokens: int, client: Any) -> load.RequestResult:
    """Request i through the router at `port` (py's client and SSE reader)."""
    body = completion(i, max_tokens)
    url = f"http://{HOST}:{port}"
    return await load.stream_one(client, url, body, keep_text=True, timeout_s=REQUEST_TIMEOUT_S)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:8]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # less idle and iowait
    return busy / os.sysconf("SC_CLK_TCK"), sum(ticks) / os.sysconf("SC_CLK_TCK")


async def cores_used(watched: dict[str, int], window: tuple[float, float]) -> dict[str, float]:
    """CPU cores each watched process used over the window; "machine": the host's busy CPU."""
    await asyncio.sleep(max(0.0, window[0] - time.monotonic()))
    cpu0 = {k: cpu_seconds(pid) for k, pid in watched.items()}
    machine0, t0 = machine_busy(), time.monotonic()
    await asyncio.sleep(max(0.0, window[1] - time.monotonic()))
    span, machine1 = time.monotonic() - t0, machine_busy()
    used = {k: (cpu_seconds(pid) - cpu0[k]) / span for k, pid in watched.items()}
    share = (machine1[0] - machine0[0]) / max(1e-9, machine1[1] - machine0[1])
    return {**used, "machine": share * (os.cpu_count() or 1)}


def pin_plan(plan: str, routers: int, cpus: Sequence[int]) -> dict[str, list[int]]:
    """Cores of "router0", "router1" and "load" (the client and fake nodes).

    split: k = min(routers, n - 1) cores (at least 1) go to the routers, the active ones
    spread over them (an idle router sits with them), the rest to the load; shared: all."""
    cpus = sorted(cpus)
    if plan == "shared" or len(cpus) == 1:
        return {"router0": cpus, "router1": cpus, "load": cpus}
    k = max(1, min(routers, len(cpus) - 1))
    mine = cpus[len(cpus) - k :]
    return {"router0": [mine[-1]], "router1": [mine[0]], "load": cpus[: len(cpus) - k]}


def percentiles(xs: list[float]) -> dict[str, float]:
    """p50, p90 and p99 of seconds, in milliseconds."""
    return {f"p{q}": load.percentile(xs, q) * 1000 for q in (50, 90, 99)}


async def drive(
    rig: RoutersOverFakes, routers: int, n: int, sizes: Sizes, watched: dict[str, int]
) -> tuple[list[load.RequestResult], dict[str, float]]:
    """n requests in flight, spread over the routers' ports, from this process: the results
    that ended inside the window after the warm-up, and the cores each process used in it."""
    start = time.monotonic() + sizes.warmup_s
    window = (start, start + sizes.duration_s)
    ports = [rig.ports[j % routers] for j in range(n)]
    results: list[load.RequestResult] = []

    def take(_: int, res: load.RequestResult) -> None:
        if window[0] <= time.monotonic() < window[1]:
            results.append(res)

    async with load.make_client() as client:
        send = lambda worker, i: send_one(ports[worker], i, sizes.max_tokens, client)  # noqa: E731
        left = window[1] - time.monotonic()
        sending = load.closed_loop(send, concurrency=n, duration_s=left, on_result=take)
        used, _ = await asyncio.gather(cores_used(watched, window), sending)
    return results, used


def measure(
    rig: RoutersOverFakes, plan: str, routers: int, n: int, sizes: Sizes, expected: str
) -> dict[str, Any]:
    """N requests in flight over `routers` routers under CPU plan `plan`, for one window."""
    cores = pin_plan(plan, routers, rig.cpus)
    for i, proc in enumerate(rig.routers):
        pin(proc.pid, cores[f"router{i}"])
    for pid in (rig.procs["fakes"].pid, os.getpid()):
        pin(pid, cores["load"])
    watched = {f"router{i}": p.pid for i, p in enumerate(rig.routers[:routers])}
    watched |= {"fakes": rig.procs["fakes"].pid, "clients": os.getpid()}
    results, used = asyncio.run(drive(rig, routers, n, sizes, watched))
    row = row_of(results, used, sizes, routers, expected)
    cpus = {k: v for k, v in cores.items() if k != "router1" or routers > 1}
    return {"pin": plan, "routers": routers, "concurrency": n, **row, "cpus": cpus}


def row_of(results: list[load.RequestResult], used: dict[str, float], sizes: Sizes, routers: int,
           want: str) -> dict[str, Any]:  # fmt: skip
    """One row from the requests of the window and the cores each process used."""
    ok = [r for r in results if not r.error]
    intact = (want, sizes.max_tokens, "length")
    corrupt = [r for r in ok if (r.text, r.output_tokens, r.finish_reason) != intact]
    samples = [r.error for r in results if r.error]
    samples += [f"corrupt: {r.text[:80]!r} ({r.output_tokens}, {r.finish_reason})" for r in corrupt]
    tokens, duration = sum(r.output_tokens for r in ok), sizes.duration_s
    router_cores = [used[f"router{i}"] for i in range(routers)]
    router_cpu = sum(router_cores) * duration
    machine = used.pop("machine")
    # other: whatever else ran on the host meanwhile (other work on a shared machine)
    cores = {"routers": router_cores, "fakes": used["fakes"], "clients": used["clients"],
             "machine": machine, "other": max(0.0, machine - sum(used.values()))}  # fmt: skip
    return {
        "duration_s": duration, "requests": len(ok), "requests_per_s": len(ok) / duration,
        "output_tokens": tokens, "tokens_per_s": tokens / duration,
        "chunks": sum(r.chunks for r in ok), "corrupt": len(corrupt),
        "errors": len(results) - len(ok), "error_samples": [s[:300] for s in samples[:5]],
        "ttft_ms": percentiles([r.ttft for r in ok if math.isfinite(r.ttft)]),
        "latency_ms": percentiles([r.e2e for r in ok]), "cpu_cores_used": cores,
        "router_cpu_ms_per_request": 1000 * router_cpu / max(1, len(ok)),
        "router_cpu_us_per_token": 1e6 * router_cpu / max(1, tokens),
    }  # fmt: skip


def cost_split(rig: RoutersOverFakes, n: int, sizes: Sizes, expected: str) -> dict[str, Any]:
    """One router (`split`) at n in flight, its requests' tokens streamed as usual against
    all of them in one `tokens` message (the fake nodes switch on SIGUSR1, back on SIGUSR2):
    the router's fixed CPU per request, and what each further streamed token adds."""
    streamed = measure(rig, "split", 1, n, sizes, expected)
    print(f"[cost, streamed] {rp.record_line(ROW_COLUMNS, streamed)}", flush=True)
    os.kill(rig.procs["fakes"].pid, signal.SIGUSR1)
    try:
        one = measure(rig, "split", 1, n, sizes, expected)
    finally:
        os.kill(rig.procs["fakes"].pid, signal.SIGUSR2)
    print(f"[cost, one message] {rp.record_line(ROW_COLUMNS, one)}", flush=True)
    ms, one_ms = streamed["router_cpu_ms_per_request"], one["router_cpu_ms_per_request"]
    return {"concurrency": n, "streamed_ms_per_request": ms, "one_message_ms_per_request": one_ms,
            "per_streamed_token_us": 1000 * (ms - one_ms) / max(1, sizes.max_tokens - 1),
            "rows": {"streamed": streamed, "one_message": one}}  # fmt: skip


def word_tokens(model: Path, k: int = 4) -> tuple[list[int], Any]:
    """The k longest token ids that each decode to a space and a lowercase word, and the
    tokenizer (tokenizers' own: the router's fast tokenizer decodes the same)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    words = []
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i], skip_special_tokens=True)
        if text.startswith(" ") and text[1:].isalpha() and text[1:].islower():
            words.append((-len(text), i))
    found = [i for _, i in sorted(words)[:k]]
    if not found:  # no such words: any tokens that decode to something
        found = [i for i in range(16, tok.get_vocab_size()) if tok.decode([i])][:k]
    return found, tok


def probe(port: int, max_tokens: int) -> dict[str, Any]:
    """One streamed request through a router, read whole: the text it returned."""

    async def once() -> load.RequestResult:
        async with load.make_client() as client:
            return await send_one(port, 0, max_tokens, client)

    res = asyncio.run(once())
    keys = ("status", "text", "finish_reason", "chunks", "error")
    return {"completion_tokens": res.output_tokens, **{k: getattr(res, k) for k in keys}}


def machine_info() -> dict[str, Any]:
    import importlib.util

    found = {m: importlib.util.find_spec(m) is not None for m in ("uvloop", "httptools")}
    # uvicorn runs the router on uvloop and httptools when they are installed
    # (uvicorn[standard]); else on asyncio's loop and h11, both pure Python.
    return {"cpu_count": os.cpu_count(), "cpus_allowed": sorted(os.sched_getaffinity(0)),
            "platform": platform.platform(), "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(), **found}  # fmt: skip


def _cores(r: dict[str, Any], *who: str) -> float:
    return sum(r["cpu_cores_used"][k] for k in who)


ROW_COLUMNS = [
    ("CPU plan", "pin"), ("routers", "routers"), ("in flight", "concurrency"),
    ("req/s", "requests_per_s"), ("tokens/s", "tokens_per_s"),
    *[(f"{name} {p} ms", lambda r, k=key, p=p: r[k][p]) for name, key in
      (("TTFT", "ttft_ms"), ("latency", "latency_ms")) for p in ("p50", "p99")],
    ("router cores", lambda r: " + ".join(f"{u:.2f}" for u in r["cpu_cores_used"]["routers"])),
    ("client+fakes cores", lambda r: _cores(r, "clients", "fakes")),
    ("other cores", lambda r: _cores(r, "other")),
    ("router ms/req", "router_cpu_ms_per_request"), ("errors", "errors"), ("corrupt", "corrupt"),
]  # fmt: skip


def setup_table(report: dict[str, Any]) -> str:
    """Where and how the run was made, one row each."""
    m, s = report["machine"], report["sizes"]
    plans = []
    for plan in s["pins"]:
        for routers in ROUTERS:
            cores = pin_plan(plan, routers, m["cpus_allowed"])
            where = ", ".join(f"{n} on {cores[n]}" for n in ["router0", "router1"][:routers])
            plans.append(f"`{plan}`, {routers}: {where}, client+fakes on {cores['load']}")
    rows = [
        ["measured", report["date"]],
        ["machine", f"{m['processor']} x{m['cpu_count']} ({m['platform']})"],
        ["Python, uvloop, httptools", f"{m['python']}, {m['uvloop']}, {m['httptools']}"],
        ["fake colocated nodes", report["nodes"]],
        ["tokens per request, per `tokens` message",
         f"{s['max_tokens']}, {report['tokens_per_message']}"],
        ["window, warm-up (s)", f"{s['duration_s']:g}, {s['warmup_s']:g}"],
        ["tries per row", "1 (a shared machine is never quiet: one run, stated as such)"],
        ["CPU plans (routers: cores)", "; ".join(plans)],
    ]  # fmt: skip
    return rp.markdown_table(["run", ""], rows)


def cost_table(cost: dict[str, Any] | None) -> list[str]:
    """One router's CPU per request with tokens streamed and all in one message."""
    if not cost:
        return []
    keys = ("concurrency", "streamed_ms_per_request", "one_message_ms_per_request",
            "per_streamed_token_us")  # fmt: skip
    names = ("requests in flight", "router ms per request, tokens streamed",
             "router ms per request, all tokens in one message",
             "router µs per further streamed token")  # fmt: skip
    rows = [[name, cost[k]] for name, k in zip(names, keys)]
    return [rp.markdown_table(["cost split (`split`, 1 router)", ""], rows), ""]


def section(report: dict[str, Any], figure: str) -> str:
    return "\n".join([
        "## Router ceiling: one router against two (`pdserve bench router`)", "",
        f"    {report['command']}", "", setup_table(report), "",
        rp.records_table(ROW_COLUMNS, report["rows"]), "", *cost_table(report.get("cost_split")),
        f"![requests/s and router CPU per request]({figure})",
    ])  # fmt: skip


def plot(report: dict[str, Any], path: Path) -> Path:
    ticks = report["sizes"]["concurrency"]
    panels = [rp.Panel(title, "requests in flight", xlog=2, xticks=ticks, ymin=0) for title in
              ("requests/s", "router CPU ms per request")]  # fmt: skip
    for plan, routers in itertools.product(report["sizes"]["pins"], ROUTERS):
        rows = [r for r in report["rows"] if r["pin"] == plan and r["routers"] == routers]
        xs, style = [r["concurrency"] for r in rows], "-o" if routers == 1 else "--s"
        label = f"{plan}, {routers} router{'s' * (routers > 1)}"
        for panel, key in zip(panels, ("requests_per_s", "router_cpu_ms_per_request")):
            panel.lines.append((label, xs, [r[key] for r in rows], style))
    return rp.plot_lines(panels, path)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _names(text: str) -> tuple[str, ...]:
    if set(names := tuple(text.split(","))) - set(PINS):
        raise argparse.ArgumentTypeError(f"choose from {', '.join(PINS)}")
    return names


RUN_FLAGS = [
    ("--quick", bool, None, "seconds: 2 concurrencies, short windows, `split` only"),
    ("--concurrency", _ints, None, "requests in flight, comma-separated (8,16,32,64,128)"),
    ("--max-tokens", int, None, "output tokens per request"),
    ("--warmup", float, None, "seconds before each window"),
    ("--duration", float, None, "seconds each row counts"),
    ("--pins", _names, None, f"CPU plans, comma-separated, of {', '.join(PINS)}"),
    ("--tokens-per-message", int, 1, "token ids per `tokens` message (1: a decode node's "
     "streaming)"),
    ("--nodes", int, 2, "fake colocated nodes"),
    ("--router-arg", str, [], "one more flag for both routers (repeat; e.g. "
     "--router-arg=--policy=round_robin)", {"action": "append", "metavar": "ARG"}),
    ("--cost-split", None, None, "after the rows, one router's CPU per request with its tokens "
     "streamed against all in one message (default: on; quick: off)",
     {"action": argparse.BooleanOptionalAction}),
    ("--model", Path, None, "HF directory for the tokenizer (default: tiny)"),
    rp.CACHE_DIR_FLAG,
]  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser("pdserve bench router", __doc__.split("\n\n")[0])
    rp.add_flags(p.add_argument_group("run"), RUN_FLAGS)
    rp.add_output_flags(p, "router_ceiling.json and router_ceiling.png", "router_ceiling.json")
    args = p.parse_args(argv)
    base = QUICK if args.quick else FULL
    given = (args.concurrency, args.max_tokens, args.warmup, args.duration, args.pins)
    args.sizes = Sizes(*(b if g is None else g for g, b in zip(given, astuple(base))))
    args.cost_split = not args.quick if args.cost_split is None else args.cost_split
    args.outputs = rp.outputs_from_args(p, args)
    return args


def measure_rows(rig: RoutersOverFakes, sizes: Sizes, expected: str) -> list[dict[str, Any]]:
    """Every row, once: the machine is shared and never quiet, so each row is one run."""
    rows = []
    for plan, n, routers in itertools.product(sizes.pins, sizes.concurrency, ROUTERS):
        rows.append(measure(rig, plan, routers, n, sizes, expected))
        print(rp.record_line(ROW_COLUMNS, rows[-1]), flush=True)
    return rows


def run(args: argparse.Namespace, model: Path, token_ids: list[int], expected: str) -> dict:
    """The routers and fake nodes up, probed, measured, stopped: the report's measurements."""
    sizes: Sizes = args.sizes
    config = json.loads((model / "config.json").read_text())
    max_len = int(config.get("max_position_embeddings", 2048))
    with sigterm_raises(), tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        counts = Path(tmp) / "fake_counts.json"
        fakes = {"nodes": args.nodes, "token_ids": token_ids, "num_blocks": 65536}
        fakes |= {"tokens_per_message": args.tokens_per_message, "max_model_len": max_len}
        fakes["counts_file"] = str(counts)
        with routers_over_fakes(model, len(ROUTERS), fakes, Path(tmp), args.router_arg) as rig:
            probes = [probe(port, sizes.max_tokens) for port in rig.ports]
            for i, pr in enumerate(probes):
                if pr["error"] or pr["text"] != expected:
                    raise RuntimeError(f"router{i} probe: {pr} != {expected!r}")
            rows = measure_rows(rig, sizes, expected)
            cost = None
            ones = [r for r in rows if r["routers"] == 1 and r["pin"] == "split"]
            if args.cost_split and ones:
                n = max(ones, key=lambda r: r["requests_per_s"])["concurrency"]
                cost = cost_split(rig, n, sizes, expected)
        fake_counts = json.loads(counts.read_text()) if counts.exists() else {}
    return {"probes": probes, "fake_nodes": fake_counts, "rows": rows, "cost_split": cost}


def measure_all(args: argparse.Namespace) -> dict[str, Any]:
    """The whole run: the report's fields."""
    model = args.model or rp.cached_model(args.cache_dir, "tiny-llama-router", MODEL_SPEC)
    token_ids, tok = word_tokens(model)
    cycle = [token_ids[i % len(token_ids)] for i in range(args.sizes.max_tokens)]
    expected = tok.decode(cycle, skip_special_tokens=True)
    measured = run(args, model, token_ids, expected)
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_info(),
            "quick": args.quick, "sizes": asdict(args.sizes), "nodes": args.nodes,
            "tokens_per_message": args.tokens_per_message, "router_args": args.router_arg,
            "token_ids": token_ids, "expected_text": expected, **measured}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    write = lambda report, to: rp.publish("router", report, to, plot, section, "router_ceiling")  # noqa: E731
    return rp.bench_main(argv, parse_args, "router", measure_all, write)


if __name__ == "__main__":
    sys.exit(main())
