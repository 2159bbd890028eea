"""`pdserve bench chaos`: steady greedy load on `pdserve serve` with 2 prefill nodes, 2 decode
nodes and 2 routers while a seeded schedule kills (-9), stops (SIGSTOP for 2-6 s, then
SIGCONT) or restarts (SIGTERM) a random child every --interval seconds. `pdserve bench
reliability`: named fault scenarios instead of the schedule, each on a fresh cluster of the
test bed tests/e2e/test_faults.py asserts with. What each count means: docs/reliability.md."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench import load, report
from pdserve.bench.systems import environ, process_group, sigterm_raises, threads_env, wait_until
from pdserve.common.node.cli import parser
from pdserve.local_cluster import free_port
from pdserve.testbed import faults as fh
from pdserve.testbed import kvfaults
from pdserve.testbed.faults import wait_clean

TOPOLOGY = ["--num-prefill", "2", "--num-decode", "2", "--num-routers", "2"]
TOPOLOGY += ["--prefill-placement", "remote", "--drain-timeout", "5"]
NODES = ("prefill0", "prefill1", "decode0", "decode1")
TARGETS = (*NODES, "router0", "router1")
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "restart": signal.SIGTERM}
OUTCOMES = ("correct", "error", "dropped", "wrong", "hung")
SETTINGS = ("duration", "interval", "seed", "concurrency", "think_s")  # the JSON records them
PROMPTS, INPUT_LEN, OUTPUT_LEN = 32, 64, 16  # seeded prompts sent in turn; lengths +-50%
PAUSE_AFTER_FAILURE_S = 1.0  # a worker that failed waits: no busy loop against a dead router
SETTLE_S = 120.0  # after the load, for every node to be back and quiet
PACKAGE_DIR = re.compile(r'^"pdserve\.(\w+)" = "([\w./-]+)"$', re.M)
FLAGS = [  # flag, type, default, help
    ("--model", str, None, "model folder (default: a tiny random Llama)"),
    ("--duration", float, 600.0, "seconds of load"),
    ("--interval", float, 20.0, "seconds between faults"),
    ("--seed", int, 0, "seeds the fault schedule and the prompts"),
    ("--concurrency", int, 8, "requests in flight, sent to the two routers in turn"),
    ("--think-s", float, 0.0, "seconds a client waits after each answer before its next"),
    ("--request-timeout", float, 120.0, "an answer not ended after this long (s) is hung"),
    ("--serve-flags", str, "", "more `pdserve serve` flags, one string"),
    ("--server-src", Path, None, "a source tree (a git worktree) routers and nodes import from"),
]
OUTPUT_FLAGS = [
    ("--name", str, "chaos", "the page's section and the JSON's stem"),
    ("--out", Path, None, "folder for NAME.json and its own reliability.md (default: DOCS)"),
]


@dataclass(frozen=True, slots=True)
class Fault:
    at: float  # perf_counter time of the signal
    target: str
    action: str
    pid: int | None  # None: the child was not running (being restarted); nothing was sent
    pause_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Answer:
    router: str
    start: float  # perf_counter times
    end: float
    outcome: str
    error: str


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser("pdserve bench chaos", __doc__.split("\n\n")[0])
    for name, flags in (("run", FLAGS), ("output", OUTPUT_FLAGS)):
        group = p.add_argument_group(name)
        report.add_flags(group, flags)
    report.add_flags(group, [report.docs_dir_flag("reliability.md"), report.LOG_DIR_FLAG])
    return p.parse_args(argv)


def stage_source(src: Path, into: Path) -> Path:
    """A PYTHONPATH folder with `src` laid out as installed (pdserve/ holding links to its
    subpackages): src itself on the path would not do, since this checkout's editable install
    would still map `pdserve.common` and the others to its own folders."""
    package = into / "pdserve"
    shutil.rmtree(package, ignore_errors=True)  # a reused --log-dir's
    package.mkdir(parents=True)
    for entry in (src / "pdserve").iterdir():
        (package / entry.name).symlink_to(entry.resolve())
    for name, folder in PACKAGE_DIR.findall((src / "pyproject.toml").read_text()):
        (package / name).symlink_to((src / folder).resolve())
    return into


def server_env(args: argparse.Namespace, log_dir: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The children's environment (one torch thread each, --server-src first on the path), and
    where a process started with it imports pdserve.router from."""
    env = {**os.environ, **{k: v for k, v in threads_env(1).items() if v}}
    src = (args.server_src or report.checkout_root() or Path.cwd()).resolve()
    if args.server_src is not None:
        env["PYTHONPATH"] = str(stage_source(src, log_dir / "server-src"))
        env["PYTHONSAFEPATH"] = "1"  # the working directory first would win (a checkout's)
    code = "import os, pdserve.router as r; print(os.path.realpath(r.__file__))"
    run = dict(capture_output=True, text=True, timeout=120)
    done = subprocess.run([sys.executable, "-c", code], env=env, check=True, **run)
    imports = done.stdout.strip()
    if args.server_src is not None and not imports.startswith(f"{src}{os.sep}"):
        raise RuntimeError(f"the children would import pdserve.router from {imports}, not {src}")
    git = ["git", "-C", str(src), "describe", "--always", "--dirty"]
    commit = subprocess.run(git, **run).stdout.strip()
    return env, {"src": str(src), "imports": imports, "commit": commit or "unknown"}


def serve_children(serve_pid: int, port: int) -> dict[str, tuple[int, str]]:
    """The running children of `pdserve serve`: name -> (pid, a router's --port or "")."""
    out = {}
    for proc in Path("/proc").iterdir():
        try:
            state, ppid = (proc / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, ValueError):  # not a process, or gone meanwhile
            continue
        if ppid == str(serve_pid) and state != "Z" and "pdserve" in argv:
            flag = dict(zip(argv, argv[1:]))
            router = "router0" if flag.get("--port") == str(port) else "router1"
            out[flag.get("--node-id", router)] = (int(proc.name), flag.get("--port", ""))
    return out


@dataclass(frozen=True, slots=True)
class Router:
    """One router, as `testbed.faults.wait_clean` asks it for its nodes' integrity."""

    url: str

    def integrity(self) -> dict:
        try:
            resp = httpx.get(f"{self.url}/internal/integrity", timeout=30.0, verify=False)
            return resp.json() if resp.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return {}


def routers(serve_pid: int, port: int) -> list[Router]:
    children = serve_children(serve_pid, port)
    return [Router(f"http://127.0.0.1:{children[r][1]}") for r in ("router0", "router1")]


def ready(serve_pid: int, port: int) -> bool:
    """Both routers run and every node registered with each."""
    try:
        return all(set(r.integrity()) == set(NODES) for r in routers(serve_pid, port))
    except KeyError:  # a router not started yet
        return False


def settle(router: Router, timeout: float) -> dict:
    """Until every node is back and quiet (wait_clean's test) or timeout: the last reports."""
    deadline = time.monotonic() + timeout
    while True:
        reports = wait_clean(router, max(0.0, deadline - time.monotonic()))  # type: ignore[arg-type]
        if set(reports) == set(NODES) or time.monotonic() > deadline:
            return reports
        time.sleep(1.0)


def expected_texts(model: str, requests: list[load.BenchRequest]) -> list[str]:
    """The colocated engine's greedy answers (float32, in process)."""
    from pdserve import LLM, SamplingParams

    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
              for r in requests]  # fmt: skip
    return [o.text or "" for o in LLM(model).generate([r.prompt for r in requests], params)]


def answer(router: str, res: load.RequestResult, want: str) -> Answer:
    outcome, error = "correct", res.error
    if res.error.startswith("timed out"):
        outcome = "hung"
    elif res.finish_reason == "error" or res.status >= 400 or error.startswith("stream error"):
        outcome, error = "error", error or "finish_reason error"
    elif not res.success:
        outcome = "dropped"
    elif res.text != want or res.finish_reason != "length":
        outcome, error = "wrong", f"{res.finish_reason}: {res.text!r} != {want!r}"
    return Answer(router, res.start, res.start + res.e2e, outcome, error)


async def inject(serve_pid: int, port: int, args: argparse.Namespace, faults: list) -> None:
    """Every interval: a seeded target and action, signalled to the child running now."""
    rng, start = random.Random(args.seed), time.perf_counter()
    for k in itertools.count(1):
        if k * args.interval >= args.duration:
            return
        await asyncio.sleep(start + k * args.interval - time.perf_counter())
        target, action, pause = rng.choice(TARGETS), rng.choice(list(SIGNALS)), rng.uniform(2, 6)
        pid = serve_children(serve_pid, port).get(target, (None,))[0]
        pause = round(pause, 1) if action == "stop" else 0.0
        faults.append(Fault(time.perf_counter(), target, action, pid, pause))
        print(f"fault {k}: {action} {target} (pid {pid})", flush=True)
        if pid is not None:
            os.kill(pid, SIGNALS[action])
            if action == "stop":
                try:
                    await asyncio.sleep(pause)
                finally:
                    os.kill(pid, signal.SIGCONT)


async def run_load(serve_pid: int, port: int, args: argparse.Namespace, requests: list,
                   wants: list[str]) -> tuple[list[Answer], list[Fault], float]:  # fmt: skip
    """The closed loop over both routers in turn, with the fault schedule beside it."""
    urls = [r.url for r in routers(serve_pid, port)]
    caps = load.ServerCaps(True, "ignore_eos", None)
    answers: list[Answer] = []
    faults: list[Fault] = []

    async def send(_worker: int, i: int) -> load.RequestResult:
        body = load.request_body(requests[i % len(requests)], caps, 0.0)
        timeout = args.request_timeout
        res = await load.stream_one(client, urls[i % 2], body, keep_text=True, timeout_s=timeout)
        answers.append(answer(f"router{i % 2}", res, wants[i % len(wants)]))
        failed = answers[-1].outcome != "correct"
        await asyncio.sleep(max(args.think_s, PAUSE_AFTER_FAILURE_S if failed else 0.0))
        return res

    start = time.perf_counter()
    async with load.make_client() as client:
        schedule = asyncio.create_task(inject(serve_pid, port, args, faults))
        try:
            await load.closed_loop(send, concurrency=args.concurrency, duration_s=args.duration)
        finally:
            schedule.cancel()
            await asyncio.gather(schedule, return_exceptions=True)
    return answers, faults, start


def recovery_s(fault: Fault, until: float, answers: list[Answer]) -> float | None:
    """From the fault to the end of the first correct answer through the hit role sent after it
    and after every failure through that role that ended before `until` (the next fault, or
    the load's end); None when no such answer came."""
    router = fault.target if fault.target.startswith("router") else None
    mine = [a for a in answers if a.start >= fault.at and router in (None, a.router)]
    failed = [a.start for a in mine if a.outcome != "correct" and a.end < until]
    since = max(failed, default=fault.at)
    ends = [a.end for a in mine if a.outcome == "correct" and a.start > since]
    return min(ends) - fault.at if ends else None


def zero(name: str, value: int) -> dict[str, Any]:
    """A goal of exactly 0, in the form report.goals_table takes."""
    met = "met" if value == 0 else "missed"
    return {"goal": f"{name} = 0", "value": value, "baseline": None, "ratio": None, "status": met}


def summarize(answers: list[Answer], faults: list[Fault], start: float, reports: dict) -> dict:
    counts = {o: sum(a.outcome == o for a in answers) for o in OUTCOMES}
    untils = [f.at for f in faults[1:]] + [max((a.end for a in answers), default=start)]
    rows = [{**asdict(f), "at": f.at - start, "recovery_s": recovery_s(f, until, answers)}
            for f, until in zip(faults, untils)]  # fmt: skip
    hit = [f for f in faults if f.pid is not None]
    last = max((f.at for f in hit), default=start)
    nodes = [r["report"] for n, r in reports.items() if n in NODES and r["report"] is not None]
    leaked = {"leaked_blocks": leaked_blocks(nodes),
              "leaked_requests": sum(len(r["live_requests"]) for r in nodes),
              "nodes_unchecked": len(NODES) - sum(r["ok"] for r in nodes)}  # fmt: skip
    # not_correct: start and end s into the load, router, outcome, error
    not_correct = [[round(a.start - start, 2), round(a.end - start, 2), a.router, a.outcome,
                    a.error] for a in answers if a.outcome != "correct"]  # fmt: skip
    goals = [zero("wrong", counts["wrong"]), zero("hung", counts["hung"]),
             zero("leaked", sum(leaked.values()))]  # fmt: skip
    return {
        "sent": len(answers), **counts, **leaked, "faults": rows, "faults_injected": len(hit),
        "availability": counts["correct"] / max(1, len(answers)),
        "roles_hit": sorted({f.target.rstrip("01") for f in hit}),
        "correct_after_last_fault": sum(a.outcome == "correct" and a.start > last for a in answers),
        "errors": sorted({a.error for a in answers if a.error})[:20],
        "not_correct": not_correct, "integrity": reports, "goals": goals,
    }  # fmt: skip


def leaked_blocks(node_reports: list[dict]) -> int:
    """Blocks the nodes still hold after the run (their integrity reports)."""
    return sum(r["num_blocks"] - r["free_blocks"] for r in node_reports)


def recovery_rows(faults: list[dict]) -> list[list[Any]]:
    """One row per (role, action) hit: faults, recovered, min / median / max seconds."""
    rows = []
    for role, action in itertools.product(("prefill", "decode", "router"), SIGNALS):
        hit = [f for f in faults if f["pid"] and f["target"].startswith(role)
               and f["action"] == action]  # fmt: skip
        times = [f["recovery_s"] for f in hit if f["recovery_s"] is not None]
        stats = [load.percentile(times, q) for q in (0, 50, 100)] if times else ["—"] * 3
        rows += [[f"{action} {role}", len(hit), len(times), *stats]] if hit else []
    return rows


def section(run: dict) -> str:
    (start, end), server = run["load_avg"], run["server"]
    keys = ["sent", *OUTCOMES, "leaked_blocks", "leaked_requests", "availability"]
    header = ["fault", "injected", "recovered", "min s", "median s", "max s"]
    where = f"Machine: {report.describe_machine(run['machine'])}; load average {start:.1f} at "
    where += f"start, {end:.1f} at end. Routers and nodes ran `{server['commit']}` "
    where += f"(`pdserve.router` from `{server['imports']}`)."
    counts = report.markdown_table([k.replace("_", " ") for k in keys], [[run[k] for k in keys]])
    recovery = report.markdown_table(header, recovery_rows(run["faults"]))
    goals = report.goals_table(run["goals"])
    return f"Command: `{run['command']}`  \n{where}\n\n{counts}\n\n{recovery}\n\n{goals}"


def measure(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from pdserve.tiny_model import make_tiny_model

    model = args.model or str(make_tiny_model("llama", log_dir / "tiny", seed=args.seed))
    pool = load.load_pool(model)
    requests = load.random_requests(pool, PROMPTS, INPUT_LEN, OUTPUT_LEN, 0.5, args.seed)
    wants = expected_texts(model, requests)
    env, server = server_env(args, log_dir)
    port = free_port()
    isolate = ["-E"] if args.server_src else []  # serve itself ignores the PYTHONPATH it hands on
    cmd = [sys.executable, *isolate, "-m", "pdserve", "serve", model, *TOPOLOGY, "--port"]
    cmd += [str(port), "--control-port", str(free_port()), "--log-dir", str(log_dir / "children")]
    with process_group(cmd + shlex.split(args.serve_flags), log_dir / "serve.log", env) as proc:
        up = lambda: ready(proc.pid, port)
        wait_until(up, {"pdserve serve": proc}, 300.0, f"pdserve serve (logs in {log_dir})")
        answers, faults, start = asyncio.run(run_load(proc.pid, port, args, requests, wants))
        reports = settle(Router(f"http://127.0.0.1:{port}"), SETTLE_S)
    settings = {k: getattr(args, k) for k in SETTINGS}
    result = summarize(answers, faults, start, reports)
    return {"model": model, "server": server, **settings, **result}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    docs = args.docs_dir or report.default_docs_dir()
    folder, page = args.out or docs / "bench", (args.out or docs) / "reliability.md"
    with tempfile.TemporaryDirectory() as tmp, sigterm_raises():
        log_dir = args.log_dir or Path(tmp)
        measured = lambda: measure(args, log_dir)  # noqa: E731
        run = report.measure_or_load(args, "chaos", "bench_chaos.py", argv, measured)
    data = report.save_json(folder / f"{args.name}.json", run)
    print(f"wrote {data}, {report.write_section(args.name, section(run), page)}")
    print(section(run))
    return 0 if all(g["status"] == "met" for g in run["goals"]) else 1


SCENARIO_COLUMNS = [
    *[(k, k) for k in ("scenario", "requests", "ok")], ("explicit error", "error"),
    ("left", "disconnected"),
    *[(k.replace("_", " "), k) for k in ("wrong", "failovers", "leaked_blocks")],
    ("recovery s", lambda s: f"{s['recovery_s']:.1f}"),
]  # fmt: skip


def signal_fault(name: str, sig: signal.Signals, hold_s: float = 0.0) -> Any:
    """Send `sig` to one process of the cluster; a SIGSTOP is held hold_s, then SIGCONT."""

    def fault(cluster: Any) -> None:
        pid = cluster.procs[name].pid
        os.kill(pid, sig)
        if sig == signal.SIGSTOP:
            time.sleep(hold_s)
            os.kill(pid, signal.SIGCONT)

    return fault


def scenarios() -> list[tuple[str, dict, dict]]:
    """(name, cluster kwargs, run kwargs); cluster kwarg "env" sets the KV frame faults."""
    kill, stop, term = signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM
    small = {"num_prefill": 1, "num_decode": 1}
    return [
        ("no fault (2P2D)", {}, {}),
        ("kill -9 prefill0 at 0.8 s (2P2D)", {},
         {"fault": signal_fault("prefill0", kill), "fault_after_s": 0.8}),
        ("kill -9 decode0 at 2 s (2P2D)", {},
         {"fault": signal_fault("decode0", kill), "fault_after_s": 2.0}),
        ("SIGSTOP decode1 for 3 s (2P2D)", {},
         {"fault": signal_fault("decode1", stop, 3.0), "fault_after_s": 1.5}),
        ("SIGTERM decode0 at 1 s (1P2D)", {"num_prefill": 1},
         {"fault": signal_fault("decode0", term)}),
        ("KV frames: 3% dropped (1P1D)", {**small, "env": "drop=0.03,seed=1"}, {}),
        ("KV frames: 3% corrupted (1P1D)", {**small, "env": "corrupt=0.03,seed=2"}, {}),
        ("KV frames: 20% delayed 20 ms (1P1D)", {**small, "env": "delay=0.2,delay_s=0.02"}, {}),
        ("30% of clients disconnect (1P1D)", small, {"disconnect_fraction": 0.3}),
        ("10x overload, queue 10 (1P1D)",
         {**small, "router_extra": ("--max-queued-requests", "10")}, {}),
    ]  # fmt: skip


def run_scenario(model: str, prompts: list, wants: list, scenario: tuple[str, dict, dict]) -> dict:
    """One scenario on a fresh cluster: its summary, and the blocks its nodes still held."""
    name, cluster_kw, run_kw = scenario
    env = kvfaults.child_env(cluster_kw.get("env"))
    cluster_kw = {k: v for k, v in cluster_kw.items() if k != "env"}
    with environ(env), fh.cluster_for(model, **cluster_kw) as cluster:
        run = fh.run_scenario(name, cluster, prompts, wants, **run_kw)
        reports = fh.wait_clean(cluster)
    held = [r["report"] for r in reports.values() if r["report"] is not None]
    return {**run.summary(), "leaked_blocks": leaked_blocks(held), "nodes": sorted(reports)}


def reliability_main(argv: list[str] | None = None) -> None:
    p = parser("pdserve bench reliability", "The fault-injection scenarios of docs/reliability.md.")
    requests = ("--requests", int, fh.NUM_REQUESTS, "greedy requests per scenario")
    report.add_flags(p.add_argument_group("run"), [requests])
    page = ("--out", Path, None, "the Markdown page (default: DOCS/reliability.md)",
            {"metavar": "FILE"})  # fmt: skip
    docs_flag = report.docs_dir_flag("reliability.md and bench/reliability.json")
    report.add_flags(p.add_argument_group("output"), [page, docs_flag])
    args = p.parse_args(argv)
    docs = args.docs_dir or report.default_docs_dir()
    from pdserve.tiny_model import make_tiny_model

    model = str(make_tiny_model("llama", Path(tempfile.mkdtemp()) / "m", max_position=2048))
    prompts = fh.make_prompts(512, args.requests)
    wants, summaries = fh.reference(model, prompts), []
    for scenario in scenarios():
        summaries.append(run_scenario(model, prompts, wants, scenario))
        print(summaries[-1], flush=True)
    report.save_json(docs / "bench" / "reliability.json", {"scenarios": summaries})
    body = (
        f"`python scripts/reliability_report.py` ({args.requests} greedy requests at once, "
        f"{fh.MAX_TOKENS} tokens each, tiny Llama, zmq connector, router heartbeat timeout "
        "1.5 s, lease timeout 6 s).\n\n" + report.records_table(SCENARIO_COLUMNS, summaries)
    )
    report.write_section("reliability", body, args.out or docs / "reliability.md")
