"""`pdserve bench router`: how much one router can proxy, and what a second one adds, with
fake nodes that answer at once (`pdserve.testbed.fake_nodes`) behind the routers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path
from typing import Any

from pdserve.bench.load import RequestResult, closed_loop, make_client, percentile, stream_one
from pdserve.bench.report import (
    CACHE_DIR_FLAG,
    add_flags,
    add_output_flags,
    cached_model,
    markdown_table,
    measure_or_load,
    outputs_from_args,
    publish,
    pyplot,
    records_table,
    save_figure,
    sigterm_raises,
)
from pdserve.bench.systems import RoutersOverFakes, routers_over_fakes
from pdserve.common.node.cli import parser

HOST = "127.0.0.1"
MODEL_NAME = "router-bench"  # the routers' --served-model-name (systems.routers_over_fakes)
MODEL_SPEC: dict[str, Any] = {}  # make_tiny_model's defaults: only its tokenizer matters here
PINS = ("split", "shared")
ROUTERS = (1, 2)
REQUEST_TIMEOUT_S = 30.0
CHILD_START_S = 1.0  # the client processes start (~0.6 s with httpx) before the warm-up
DRAIN_TIMEOUT_S = 60.0
QUIET_CORES = 0.25  # busy CPU of a host taken as idle (our idle routers use ~0.01)
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
    repeats: int


FULL = Sizes((8, 16, 32, 64, 128), 32, 1.0, 5.0, PINS, 2)
QUICK = Sizes((4, 16), 16, 0.5, 2.0, ("split",), 1)


# -- the load (client child processes) ------------------------------------------------------------


def completion(i: int, max_tokens: int) -> dict[str, Any]:
    """The body of request i: one of PROMPTS, streamed, with usage."""
    prompt = PROMPTS[i % len(PROMPTS)]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    return {**body, "stream_options": {"include_usage": True}}


async def send_one(port: int, i: int, max_tokens: int, client: Any) -> RequestResult:
    """Request i through the router at `port` (load.py's client and SSE reader)."""
    url = f"http://{HOST}:{port}"
    body = completion(i, max_tokens)
    return await stream_one(client, url, body, keep_text=True, timeout_s=REQUEST_TIMEOUT_S)


@dataclass
class ClientStats:
    """What one client process saw of the requests that ended inside its window."""

    window: tuple[float, float]
    expected: str
    max_tokens: int
    requests: int = 0
    tokens: int = 0
    chunks: int = 0
    corrupt: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)

    def take(self, res: RequestResult, now: float) -> None:
        if not self.window[0] <= now < self.window[1]:
            return
        if res.error:
            self.errors += 1
            self._sample(res.error)
            return
        if (res.text, res.output_tokens, res.finish_reason) != (
            self.expected, self.max_tokens, "length"
        ):  # fmt: skip
            self.corrupt += 1
            self._sample(f"corrupt: {res.text[:80]!r} ({res.output_tokens}, {res.finish_reason})")
        self.requests += 1
        self.tokens += res.output_tokens
        self.chunks += res.chunks
        self.latency.append(res.e2e)
        if math.isfinite(res.ttft):
            self.ttft.append(res.ttft)

    def _sample(self, why: str) -> None:
        if len(self.error_samples) < 5:
            self.error_samples.append(why[:300])


async def _client(spec: dict[str, Any]) -> ClientStats:
    window, ports, max_tokens = (
        (spec["window_start"], spec["window_end"]),
        spec["ports"],
        spec["max_tokens"],
    )
    stats = ClientStats(window, spec["expected_text"], max_tokens)
    async with make_client() as client:
        await closed_loop(
            lambda worker, i: send_one(ports[worker], i, max_tokens, client),
            concurrency=len(ports),
            duration_s=window[1] - time.monotonic(),
            on_result=lambda _, res: stats.take(res, time.monotonic()),
        )
    return stats


def run_client(spec: dict[str, Any]) -> int:
    """A client child: one worker per entry of its ports until the window ends, then drain;
    prints what it saw as JSON."""
    stats = asyncio.run(_client(spec))
    fields = ("requests", "tokens", "chunks", "corrupt", "errors", "error_samples")
    out = {k: getattr(stats, k) for k in (*fields, "ttft", "latency")}
    print(json.dumps(out), flush=True)
    return 0


# -- processes, CPU, pinning ----------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks[:8]) - idle) / hz, sum(ticks[:8]) / hz


def busy_cores(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Cores the whole machine kept busy between two `machine_busy` readings."""
    return (after[0] - before[0]) / max(1e-9, after[1] - before[1]) * (os.cpu_count() or 1)


def wait_quiet(limit_s: float, cores: float = QUIET_CORES, step_s: float = 0.5) -> float:
    """Wait, up to limit_s, until the host has been nearly idle (under `cores` busy) for two
    steps in a row: on a shared machine a try then starts without other work beside it.
    Returns the seconds waited (limit_s or more: it never got quiet)."""
    t0 = time.monotonic()
    quiet = 0
    prev = machine_busy()
    while quiet < 2 and time.monotonic() - t0 < limit_s:
        time.sleep(step_s)
        cur = machine_busy()
        quiet = quiet + 1 if busy_cores(prev, cur) < cores else 0
        prev = cur
    return time.monotonic() - t0


def pin(pid: int, cpus: Sequence[int]) -> None:
    """Every thread of pid onto cpus (threads started later inherit it)."""
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), cpus)


def pin_plan(plan: str, routers: int, cpus: Sequence[int]) -> dict[str, list[int]]:
    """Cores of "router0", "router1" and "load" (the client and fake nodes).

    split: k = min(routers, n - 1) cores (at least 1) go to the routers, the active ones
    spread over them (an idle router sits with them), the rest to the load; shared: all."""
    cpus = sorted(cpus)
    if plan == "shared" or len(cpus) == 1:
        return {"router0": cpus, "router1": cpus, "load": cpus}
    k = max(1, min(routers, len(cpus) - 1))
    mine = cpus[len(cpus) - k :]
    return {
        "router0": [mine[-1]],
        "router1": [mine[0]],
        "load": cpus[: len(cpus) - k],
    }


def client_cmd() -> list[str]:
    return [sys.executable, "-m", "pdserve.bench.router", "--client"]


# -- one row --------------------------------------------------------------------------------------


def percentiles(xs: list[float]) -> dict[str, float]:
    """p50, p90 and p99 of seconds, in milliseconds."""
    return {f"p{q}": percentile(xs, q) * 1000 for q in (50, 90, 99)}


def start_clients(
    ports: list[int], procs: int, spec: dict[str, Any], cores: list[int]
) -> list[subprocess.Popen]:
    """`procs` client children sharing the connections (one per entry of ports)."""
    clients = []
    for c in range(procs):
        mine = json.dumps({**spec, "ports": ports[c::procs]})
        clients.append(
            subprocess.Popen(
                [*client_cmd(), mine],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        pin(clients[-1].pid, cores)
    return clients


def client_results(clients: list[subprocess.Popen]) -> list[dict[str, Any]]:
    """What each client child printed, once it has drained."""
    results = []
    for c, proc in enumerate(clients):
        try:
            out, err = proc.communicate(timeout=DRAIN_TIMEOUT_S + REQUEST_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=10)
        if proc.returncode != 0 or not out.strip():
            raise RuntimeError(f"client{c} failed ({proc.returncode}):\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def cores_used(watched: dict[str, int], window: tuple[float, float]) -> dict[str, float]:
    """CPU cores each watched process used over the window (sleeps until it ends); "machine"
    is the whole host's busy CPU."""
    time.sleep(max(0.0, window[0] - time.monotonic()))
    cpu0 = {k: cpu_seconds(pid) for k, pid in watched.items()}
    machine0 = machine_busy()
    t0 = time.monotonic()
    time.sleep(max(0.0, window[1] - time.monotonic()))
    cpu1 = {k: cpu_seconds(pid) for k, pid in watched.items()}
    machine1 = machine_busy()
    span = time.monotonic() - t0
    used = {k: (cpu1[k] - cpu0[k]) / span for k in watched}
    used["machine"] = busy_cores(machine0, machine1)
    return used


def measure(
    rig: RoutersOverFakes,
    plan: str,
    routers: int,
    concurrency: int,
    sizes: Sizes,
    args: argparse.Namespace,
    expected_text: str,
) -> dict[str, Any]:
    """N requests in flight over `routers` routers under CPU plan `plan`, for one window."""
    cores = pin_plan(plan, routers, sorted(os.sched_getaffinity(0)))
    for i, proc in enumerate(rig.routers):
        pin(proc.pid, cores[f"router{i}"])
    pin(rig.procs["fakes"].pid, cores["load"])
    start = time.monotonic() + CHILD_START_S + sizes.warmup_s
    spec = {"max_tokens": sizes.max_tokens, "expected_text": expected_text}
    spec |= {"window_start": start, "window_end": start + sizes.duration_s}
    procs = max(1, min(args.client_procs, concurrency))
    ports = [rig.ports[j % routers] for j in range(concurrency)]
    clients = start_clients(ports, procs, spec, cores["load"])
    watched = {f"router{i}": p.pid for i, p in enumerate(rig.routers[:routers])}
    watched |= {"fakes": rig.procs["fakes"].pid}
    watched |= {f"client{c}": p.pid for c, p in enumerate(clients)}
    used = cores_used(watched, (spec["window_start"], spec["window_end"]))
    row = row_of(client_results(clients), used, sizes, routers, procs)
    cpus = {k: v for k, v in cores.items() if k != "router1" or routers > 1}
    return {"pin": plan, "routers": routers, "concurrency": concurrency, **row, "cpus": cpus}


def row_of(
    results: list[dict[str, Any]],
    used: dict[str, float],
    sizes: Sizes,
    routers: int,
    procs: int,
) -> dict[str, Any]:
    """One row from the clients' counts and the cores each process used."""
    total = {k: sum(r[k] for r in results) for k in ("requests", "tokens", "chunks")}
    duration = sizes.duration_s
    router_cores = [used[f"router{i}"] for i in range(routers)]
    router_cpu = sum(router_cores) * duration
    machine = used.pop("machine")
    return {
        "client_procs": procs,
        "duration_s": duration,
        "requests": total["requests"],
        "requests_per_s": total["requests"] / duration,
        "output_tokens": total["tokens"],
        "tokens_per_s": total["tokens"] / duration,
        "chunks": total["chunks"],
        "corrupt": sum(r["corrupt"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "error_samples": [s for r in results for s in r["error_samples"]][:5],
        "ttft_ms": percentiles([x for r in results for x in r["ttft"]]),
        "latency_ms": percentiles([x for r in results for x in r["latency"]]),
        "cpu_cores_used": {
            "routers": router_cores,
            "fakes": used["fakes"],
            "clients": sum(used[f"client{c}"] for c in range(procs)),
            "machine": machine,
            # whatever else ran on the host meanwhile (this process, other work)
            "other": max(0.0, machine - sum(used.values())),
        },
        "router_cpu_ms_per_request": 1000 * router_cpu / max(1, total["requests"]),
        "router_cpu_us_per_token": 1e6 * router_cpu / max(1, total["tokens"]),
    }


def cost_split(
    rig: RoutersOverFakes, n: int, sizes: Sizes, args: argparse.Namespace, expected: str
) -> dict[str, Any]:
    """One router (`split`) at n in flight, its requests' tokens streamed as usual against
    all of them in one `tokens` message (the fake nodes switch on SIGUSR1, back on SIGUSR2):
    the router's fixed CPU per request, and what each further streamed token adds."""
    fakes = rig.procs["fakes"].pid
    tries: dict[str, list[dict[str, Any]]] = {"streamed": [], "one_message": []}
    for _ in range(sizes.repeats):
        for mode, rows in tries.items():
            if args.quiet_wait:
                wait_quiet(args.quiet_wait)
            if mode == "one_message":
                os.kill(fakes, signal.SIGUSR1)
            try:
                rows.append(measure(rig, "split", 1, n, sizes, args, expected))
            finally:
                if mode == "one_message":
                    os.kill(fakes, signal.SIGUSR2)
            print(f"[cost, {mode}] {_row_line(rows[-1])}", flush=True)
    streamed = min(r["router_cpu_ms_per_request"] for r in tries["streamed"])
    one = min(r["router_cpu_ms_per_request"] for r in tries["one_message"])
    return {
        "concurrency": n,
        "streamed_ms_per_request": streamed,
        "one_message_ms_per_request": one,
        "per_streamed_token_us": 1000 * (streamed - one) / max(1, sizes.max_tokens - 1),
        "rows": {mode: best_try(rows) for mode, rows in tries.items()},
    }


# -- tokens the fake nodes send, and a probe ------------------------------------------------------


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

    async def once() -> RequestResult:
        async with make_client() as client:
            return await send_one(port, 0, max_tokens, client)

    res = asyncio.run(once())
    keys = ("status", "text", "finish_reason", "chunks", "error")
    return {"completion_tokens": res.output_tokens, **{k: getattr(res, k) for k in keys}}


# -- the report -----------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    import importlib.util

    has = importlib.util.find_spec
    return {
        "cpu_count": os.cpu_count(),
        "cpus_allowed": sorted(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        # uvicorn runs the router on uvloop and httptools when they are installed
        # (uvicorn[standard]); else on asyncio's loop and h11, both pure Python.
        "uvloop": has("uvloop") is not None,
        "httptools": has("httptools") is not None,
    }


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """2 routers / 1 router, per CPU plan and concurrency."""
    by = {(r["pin"], r["concurrency"], r["routers"]): r for r in rows}
    keys = ("requests_per_s", "tokens_per_s", "router_cpu_ms_per_request")
    return [
        {"pin": plan, "concurrency": n, **{k: two[k] / max(1e-9, one[k]) for k in keys}}
        for (plan, n, routers), two in by.items()
        if routers == 2 and (one := by.get((plan, n, 1))) is not None
    ]


def ceilings(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The best row of each (plan, routers), keyed "plan/routers"."""
    best: dict[str, dict[str, Any]] = {}
    for r in sorted(rows, key=lambda r: r["requests_per_s"]):
        best[f"{r['pin']}/{r['routers']}"] = {
            "requests_per_s": r["requests_per_s"],
            "tokens_per_s": r["tokens_per_s"],
            "concurrency": r["concurrency"],
            "router_cores_used": sum(r["cpu_cores_used"]["routers"]),
            "router_cpu_ms_per_request": r["router_cpu_ms_per_request"],
        }
    return best


def best_try(tries: list[dict[str, Any]]) -> dict[str, Any]:
    """The try with the most requests/s (other work on the host only ever slows a row down),
    with every try's requests/s beside it."""
    best = dict(max(tries, key=lambda r: r["requests_per_s"]))
    best["tries_requests_per_s"] = [r["requests_per_s"] for r in tries]
    return best


def _cores(r: dict[str, Any], *who: str) -> float:
    return sum(r["cpu_cores_used"][k] for k in who)


ROW_COLUMNS = [
    ("CPU plan", "pin"),
    ("routers", "routers"),
    ("in flight", "concurrency"),
    ("req/s", "requests_per_s"),
    ("tokens/s", "tokens_per_s"),
    ("TTFT p50 ms", lambda r: r["ttft_ms"]["p50"]),
    ("TTFT p99 ms", lambda r: r["ttft_ms"]["p99"]),
    ("latency p50 ms", lambda r: r["latency_ms"]["p50"]),
    ("latency p99 ms", lambda r: r["latency_ms"]["p99"]),
    ("router cores", lambda r: " + ".join(f"{u:.2f}" for u in r["cpu_cores_used"]["routers"])),
    ("client+fakes cores", lambda r: _cores(r, "clients", "fakes")),
    ("other cores", lambda r: _cores(r, "other")),
    ("router ms/req", "router_cpu_ms_per_request"),
    ("errors", "errors"),
    ("corrupt", "corrupt"),
]


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
        ["tries per row (best kept), quiet wait (s)",
         f"{s.get('repeats', 1)}, {report.get('quiet_wait_s') or 0:g}"],
        ["CPU plans (routers: cores)", "; ".join(plans)],
    ]  # fmt: skip
    return markdown_table(["run", ""], rows)


def cost_table(cost: dict[str, Any] | None) -> list[str]:
    """One router's CPU per request with tokens streamed and all in one message."""
    if not cost:
        return []
    rows = [
        ["requests in flight", cost["concurrency"]],
        ["router ms per request, tokens streamed", cost["streamed_ms_per_request"]],
        ["router ms per request, all tokens in one message", cost["one_message_ms_per_request"]],
        ["router µs per further streamed token", cost["per_streamed_token_us"]],
    ]
    return [markdown_table(["cost split (`split`, 1 router)", ""], rows), ""]


def section(report: dict[str, Any], figure: str) -> str:
    return "\n".join(
        [
            "## Router ceiling: one router against two (`pdserve bench router`)",
            "",
            f"    {report['command']}",
            "",
            setup_table(report),
            "",
            records_table(ROW_COLUMNS, report["rows"]),
            "",
            *cost_table(report.get("cost_split")),
            f"![requests/s and router CPU per request]({figure})",
        ]
    )


def plot(report: dict[str, Any], path: Path) -> Path:
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(10, 4))
    for plan in report["sizes"]["pins"]:
        for routers in ROUTERS:
            rows = [r for r in report["rows"] if r["pin"] == plan and r["routers"] == routers]
            if not rows:
                continue
            xs = [r["concurrency"] for r in rows]
            style = "-o" if routers == 1 else "--s"
            label = f"{plan}, {routers} router{'s' * (routers > 1)}"
            left.plot(xs, [r["requests_per_s"] for r in rows], style, label=label)
            right.plot(xs, [r["router_cpu_ms_per_request"] for r in rows], style, label=label)
    concurrency = report["sizes"]["concurrency"]
    for ax, title in ((left, "requests/s"), (right, "router CPU ms per request")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrency, [str(n) for n in concurrency])
        ax.minorticks_off()
        ax.set(xlabel="requests in flight", title=title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    return save_figure(fig, path)


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
    ("--repeats", int, None, "tries of every row, in whole passes; each row's best is kept "
     "(2; quick 1)"),
    ("--pins", _names, None, f"CPU plans, comma-separated, of {', '.join(PINS)}"),
    ("--tokens-per-message", int, 1, "token ids per `tokens` message (1: a decode node's "
     "streaming)"),
    ("--nodes", int, 2, "fake colocated nodes"),
    ("--client-procs", int, 1, "client processes sharing the connections"),
    ("--router-arg", str, [], "one more flag for both routers (repeat; e.g. "
     "--router-arg=--policy=round_robin)", {"action": "append", "metavar": "ARG"}),
    ("--quiet-wait", float, None, "before each try, wait up to S seconds for the host to be "
     "idle; 0: never (default 30; quick 0)", {"metavar": "S"}),
    ("--cost-split", None, None, "after the rows, one router's CPU per request with its tokens "
     "streamed against all in one message (default: on; quick: off)",
     {"action": argparse.BooleanOptionalAction}),
    ("--model", Path, None, "HF directory for the tokenizer (default: tiny)"),
    CACHE_DIR_FLAG,
    ("--client", bool, None, argparse.SUPPRESS),
]  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser("pdserve bench router", __doc__.split("\n\n")[0])
    p.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    add_flags(p.add_argument_group("run"), RUN_FLAGS)
    add_output_flags(p, "router_ceiling.json and router_ceiling.png", "router_ceiling.json")
    args = p.parse_args(argv)
    if args.client:
        return args
    base = QUICK if args.quick else FULL
    given = (args.concurrency, args.max_tokens, args.warmup, args.duration, args.pins, args.repeats)
    args.sizes = Sizes(*(b if g is None else g for g, b in zip(given, astuple(base))))
    args.cost_split = not args.quick if args.cost_split is None else args.cost_split
    args.quiet_wait = (0.0 if args.quick else 30.0) if args.quiet_wait is None else args.quiet_wait
    args.outputs = outputs_from_args(p, args)
    return args


def measure_rows(
    rig: RoutersOverFakes, sizes: Sizes, args: argparse.Namespace, expected: str
) -> list[dict[str, Any]]:
    """Every row, each the best of its tries; tries are taken in whole passes, so a burst of
    other work on the host hits one try of a row, not all of them."""
    tries: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for rep in range(sizes.repeats):
        for plan in sizes.pins:
            for n in sizes.concurrency:
                for routers in ROUTERS:
                    waited = wait_quiet(args.quiet_wait) if args.quiet_wait else 0.0
                    row = measure(rig, plan, routers, n, sizes, args, expected)
                    row["quiet_wait_s"] = waited
                    tries.setdefault((plan, n, routers), []).append(row)
                    print(f"[{rep + 1}/{sizes.repeats}] {_row_line(row)}", flush=True)
    return [best_try(t) for t in tries.values()]


def _row_line(r: dict[str, Any]) -> str:
    return (
        f"{r['pin']:>6} routers={r['routers']} N={r['concurrency']:<4} "
        f"{r['requests_per_s']:8.1f} req/s {r['tokens_per_s']:9.0f} tok/s "
        f"ttft p50 {r['ttft_ms']['p50']:7.1f} ms  "
        f"router cores {sum(r['cpu_cores_used']['routers']):.2f}  "
        f"{r['router_cpu_ms_per_request']:.2f} ms/req  other {_cores(r, 'other'):.2f}  "
        f"errors {r['errors']} corrupt {r['corrupt']}"
    )


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
            rows = measure_rows(rig, sizes, args, expected)
            cost = None
            ones = [r for r in rows if r["routers"] == 1 and r["pin"] == "split"]
            if args.cost_split and ones:
                n = max(ones, key=lambda r: r["requests_per_s"])["concurrency"]
                cost = cost_split(rig, n, sizes, args, expected)
        fake_counts = json.loads(counts.read_text()) if counts.exists() else {}
    return {"probes": probes, "fake_nodes": fake_counts, "rows": rows, "cost_split": cost}


def measure_all(args: argparse.Namespace) -> dict[str, Any]:
    """The whole run: the report's fields."""
    model = args.model or cached_model(args.cache_dir, "tiny-llama-router", MODEL_SPEC)
    token_ids, tok = word_tokens(model)
    cycle = [token_ids[i % len(token_ids)] for i in range(args.sizes.max_tokens)]
    expected = tok.decode(cycle, skip_special_tokens=True)
    measured = run(args, model, token_ids, expected)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine_info(),
        "quick": args.quick,
        "sizes": asdict(args.sizes),
        "nodes": args.nodes,
        "tokens_per_message": args.tokens_per_message,
        "client_procs": args.client_procs,
        "quiet_wait_s": args.quiet_wait,
        "router_args": args.router_arg,
        "token_ids": token_ids,
        "expected_text": expected,
        **measured,
        "ratios": ratios(measured["rows"]),
        "ceilings": ceilings(measured["rows"]),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.client:
        return run_client(json.loads(args.spec))
    measure_now = functools.partial(measure_all, args)
    report = measure_or_load(args, "router", "bench_router.py", argv, measure_now)
    publish("router", report, args.outputs, plot, section, stem="router_ceiling")
    return 0


if __name__ == "__main__":
    sys.exit(main())
