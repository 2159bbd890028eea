"""Which pdserve files one streaming chat completion crosses, measured in every process.

    python scripts/request_path.py                       # this checkout
    python scripts/request_path.py --src /tmp/path-before  # another tree (a git worktree)
    python scripts/request_path.py --lines-only           # lines per folder alone

A 1-prefill 1-decode cluster (`LocalCluster`, zmq connector, `--prefill-placement remote`) on
the tiny model is warmed with one request; then one streaming `/v1/chat/completions` (greedy,
8 tokens, `ignore_eos`) is traced in the router, the prefill node and the decode node.

How it traces, without touching production code: each child finds a generated
`sitecustomize.py` first on its PYTHONPATH, which installs a profile hook (`sys.setprofile`,
and `threading.setprofile` for every thread started later). While a window is open it records
every call of a pdserve function with its caller (the nearest pdserve function up the stack,
through library frames such as torch's `Module.__call__`), the first and the last call's
CLOCK_MONOTONIC time (one clock for the whole host). This script opens and closes windows by
writing their name into a control file the children poll.

The rules (docs/architecture.md, "A request's path, measured", states the same):

- Three windows of the same length: idle before, request (the request is sent as it opens and
  must end well within it), idle after. A function is on the request's path when it ran in the
  request window and in neither idle window; a call (caller -> callee) likewise. Heartbeats,
  lease ticks and the loops' idle polls run in all three windows and drop out.
- A file is on the path when one of its functions is; only the tree's `.py` files outside
  `tests/` and `scripts/` count. A file crossed by several processes counts once.
- A process's files are ordered by their first call. The path is shown router -> prefill ->
  decode -> router: the router's files first called before either node's first call, the
  prefill node's, the decode node's, then the router's files that ran after that.
- A folder is a file's directory (`router/cluster`, `common/wire`).
- A zigzag is a way back: in one process, the path's calls between folders make a directed
  graph (folder X -> folder Y when a function in X calls one in Y); the zigzags are its
  independent cycles, that is for each set of folders that reach each other by calls, its
  edges minus its folders plus one. X calls Y and Y calls X (a callback, a lower layer calling
  up) is one zigzag; a call down and its return is none; going from one process to the next
  over a socket is the path itself, never a zigzag.
- Also printed, not the goal's figure: the returns along each process's first-call order (a
  first call in a folder the order had entered and left before). They count the returns from
  calls too, and the order of concurrent threads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import astuple, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROCESSES = ("router", "prefill0", "decode0")
IDLE_WINDOWS = ("idle-before", "idle-after")
NOT_SOURCE = ("tests/", "scripts/")
START_TIMEOUT_S = 600.0  # three processes' imports beside seven engineers' jobs took over 120 s

# Written into a temporary folder first on every child's PYTHONPATH: stdlib only, since it
# runs before anything is imported.
TRACER = """
import json, os, sys, threading, time


def _trace(control, out_dir, sources):
    state = {"seen": None}
    known = {}

    def is_source(code):
        mine = known.get(code)
        if mine is None:
            mine = known[code] = os.path.realpath(code.co_filename) in sources
        return mine

    def profile(frame, event, arg):
        seen = state["seen"]
        if seen is None or event != "call" or not is_source(frame.f_code):
            return
        caller = frame.f_back
        while caller is not None and not is_source(caller.f_code):
            caller = caller.f_back
        key = (caller.f_code if caller is not None else None, frame.f_code)
        times = seen.get(key)
        if times is None:
            thread = threading.current_thread().name
            seen[key] = [time.monotonic_ns(), time.monotonic_ns(), thread]
        else:
            times[1] = time.monotonic_ns()

    def where(code):
        if code is None:
            return None
        return [os.path.realpath(code.co_filename), code.co_firstlineno, code.co_qualname]

    def dump(window, seen):
        calls = [[where(c), where(f), *times] for (c, f), times in seen.items()]
        pdserve = sys.modules.get("pdserve.router") or sys.modules.get("pdserve")
        imports = os.path.realpath(getattr(pdserve, "__file__", "") or "")
        body = {"window": window, "imports": imports, "calls": calls}
        tmp = os.path.join(out_dir, f"{os.getpid()}.{window}.tmp")
        with open(tmp, "w") as f:
            json.dump(body, f)
        os.replace(tmp, os.path.join(out_dir, f"{os.getpid()}.{window}.json"))

    def poll():
        window = ""
        while True:
            time.sleep(0.02)
            try:
                with open(control) as f:
                    wanted = f.read().strip()
            except OSError:
                continue
            if wanted == window:
                continue
            seen, state["seen"] = state["seen"], ({} if wanted else None)
            if window and seen is not None:
                dump(window, dict(seen))
            window = wanted
            now = os.path.join(out_dir, f"{os.getpid()}.now")
            with open(now + ".tmp", "w") as f:
                f.write(window)
            os.replace(now + ".tmp", now)

    threading.Thread(target=poll, name="request-path-tracer", daemon=True).start()
    threading.setprofile(profile)
    sys.setprofile(profile)


def _start():
    if not os.environ.get("PDSERVE_PATH_CONTROL"):
        return
    with open(os.environ["PDSERVE_PATH_SOURCES"]) as f:
        sources = frozenset(f.read().split())
    _trace(os.environ["PDSERVE_PATH_CONTROL"], os.environ["PDSERVE_PATH_OUT"], sources)


_start()
"""


# ---------------------------------------------------------------- analysis (pure)

Function = tuple[str, int, str]  # file relative to the tree, first line, qualified name


@dataclass(frozen=True, slots=True)
class Call:
    """Calls of `function` from `caller` (the nearest pdserve function up the stack, None at
    a thread's or the event loop's root) in one window: the first's and the last's time."""

    caller: Function | None
    function: Function
    first: int  # CLOCK_MONOTONIC ns
    last: int
    thread: str = "MainThread"  # the first call's

    @property
    def path(self) -> str:
        return self.function[0]


@dataclass(frozen=True, slots=True)
class Zigzag:
    """A set of folders that call each other along the path (a cycle of the folder graph),
    the calls that close it, and how many independent cycles it holds."""

    process: str
    folders: tuple[str, ...]
    calls: tuple[tuple[Function, Function], ...]  # one (caller, callee) per folder edge

    @property
    def count(self) -> int:
        return len(self.calls) - len(self.folders) + 1


def folder_of(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else "."


def request_calls(windows: dict[str, list[Call]], source: set[str]) -> list[Call]:
    """The request window's calls of `source` functions that ran in no idle window."""
    idle = {c.function for w in IDLE_WINDOWS for c in windows.get(w, [])}
    return [c for c in windows["request"] if c.path in source and c.function not in idle]


def request_edges(windows: dict[str, list[Call]], source: set[str]) -> list[Call]:
    """The request window's calls from one folder into another that no idle window made."""
    idle = {(c.caller, c.function) for w in IDLE_WINDOWS for c in windows.get(w, [])}
    return [
        c
        for c in windows["request"]
        if c.caller is not None
        and {c.caller[0], c.path} <= source
        and folder_of(c.caller[0]) != folder_of(c.path)
        and (c.caller, c.function) not in idle
    ]


def first_touches(calls: list[Call]) -> list[str]:
    """Each file once, in the order of its first call."""
    return list(dict.fromkeys(c.path for c in sorted(calls, key=lambda c: c.first)))


def returns(files: list[str]) -> list[tuple[str, str]]:
    """Steps of a first-touch order back into a folder it had left: (from, to) files."""
    out: list[tuple[str, str]] = []
    left: set[str] = set()
    for before, file in zip(files, files[1:]):
        if folder_of(before) != folder_of(file):
            left.add(folder_of(before))
            if folder_of(file) in left:
                out.append((before, file))
    return out


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph.get(todo.pop(), set()) - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def zigzags(process: str, edges: list[Call]) -> list[Zigzag]:
    """The folder graph's strongly connected sets (folders that reach each other by calls),
    each with one call per folder edge inside it, the earliest."""
    first: dict[tuple[str, str], Call] = {}
    for call in sorted(edges, key=lambda c: c.first):
        first.setdefault((folder_of(call.caller[0]), folder_of(call.path)), call)
    graph: dict[str, set[str]] = {}
    for a, b in first:
        graph.setdefault(a, set()).add(b)
    reach = {f: reachable(graph, f) for f in {f for pair in first for f in pair}}
    out, done = [], set()
    for folder in sorted(reach):
        group = {f for f in reach[folder] if folder in reach[f]}
        if len(group) > 1 and folder not in done:
            done |= group
            inside = [c for (a, b), c in first.items() if a in group and b in group]
            calls = tuple((c.caller, c.function) for c in inside)
            out.append(Zigzag(process, tuple(sorted(group)), calls))
    return out


def path_segments(calls: dict[str, list[Call]]) -> list[tuple[str, list[str]]]:
    """router -> each node -> router: the router's files first called before either node's
    first call, each node's files, then the router's files that ran after it (again or
    first), each part in first-touch order."""
    router = calls.get("router", [])
    nodes = {p: c for p, c in calls.items() if p != "router"}
    start = min((c.first for node in nodes.values() for c in node), default=None)
    if start is None:
        return [("router", first_touches(router))]
    before = {c.path for c in router if c.first < start}
    after = {c.path for c in router if c.last >= start}
    order = first_touches(router)
    return [
        ("router, before the nodes", [f for f in order if f in before]),
        *((name, first_touches(node)) for name, node in nodes.items()),
        ("router, after the nodes' first call", [f for f in order if f in after]),
    ]


def summarize(windows: dict[str, dict[str, list[Call]]], source: set[str]) -> dict:
    """Files, folders and zigzags of the request from every process's windows; `source` is
    the files that count (the tree's, outside tests/ and scripts/)."""
    calls = {p: request_calls(w, source) for p, w in windows.items()}
    order = {p: first_touches(c) for p, c in calls.items()}
    files = sorted({f for o in order.values() for f in o})
    cycles = [z for p, w in windows.items() for z in zigzags(p, request_edges(w, source))]
    return {
        "segments": path_segments(calls),
        "per_process": {p: len(o) for p, o in order.items()},
        "files": files,
        "folders": sorted({folder_of(f) for f in files}),
        "zigzags": sum(z.count for z in cycles),
        "cycles": [
            {"process": z.process, "folders": z.folders, "count": z.count, "calls": z.calls}
            for z in cycles
        ],
        "returns": {p: returns(o) for p, o in order.items()},
    }


def render(summary: dict, header: str) -> str:
    lines = [header, ""]
    for name, files in summary["segments"]:
        lines += [f"{name}: {len(files)} files"] + [f"  {f}" for f in files] + [""]
    per = ", ".join(f"{p} {n}" for p, n in summary["per_process"].items())
    lines.append(f"files: {len(summary['files'])} ({per}; a file in several processes once)")
    lines.append(f"folders: {len(summary['folders'])} ({', '.join(summary['folders'])})")
    lines.append(f"zigzags: {summary['zigzags']}")
    for cycle in summary["cycles"]:
        folders = " <-> ".join(cycle["folders"])
        lines.append(f"  {cycle['process']}: {folders} ({cycle['count']})")
        for (path, _, caller), (callee_path, _, callee) in cycle["calls"]:
            lines.append(f"    {path}:{caller} -> {callee_path}:{callee}")
    back = sum(len(r) for r in summary["returns"].values())
    lines.append(f"returns into a folder left before, along each first-touch order: {back}")
    return "\n".join(lines)


def tracked_py(src: Path) -> list[str]:
    """The tree's .py files git tracks, relative to it."""
    listed = subprocess.run(
        ["git", "-C", str(src), "ls-files", "*.py"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return listed.stdout.split()


def lines_per_folder(src: Path) -> dict[str, int]:
    """Lines of the tree's .py files outside tests/, folder by folder (as `wc -l` counts)."""
    counts: Counter[str] = Counter()
    for path in tracked_py(src):
        if not path.startswith("tests/"):
            counts[folder_of(path)] += (src / path).read_bytes().count(b"\n")
    return dict(sorted(counts.items()))


def render_lines(counts: dict[str, int]) -> str:
    total = sum(counts.values())
    rows = [f"  {folder + '/':<22} {n:>6}  {100 * n / total:4.1f}%" for folder, n in counts.items()]
    head = "lines per folder (.py outside tests/):"
    return "\n".join([head, *rows, f"  {'total':<22} {total:>6}"])


# ---------------------------------------------------------------- the traced run


def child_env(src: Path, work: Path) -> dict[str, str]:
    """PYTHONPATH: the tracer, then (for another tree) that tree staged as installed: src
    itself on the path would not do, since this checkout's editable install maps
    `pdserve.common` and the others to its own folders."""
    (work / "tracer").mkdir()
    (work / "tracer" / "sitecustomize.py").write_text(TRACER)
    path = [str(work / "tracer")]
    if src != REPO:
        from pdserve.bench.chaos import stage_source  # the chaos run stages trees the same way

        path.append(str(stage_source(src, work / "src")))
    (work / "out").mkdir()
    return {
        "PYTHONPATH": os.pathsep.join(path),
        "PYTHONSAFEPATH": "1",  # the working directory first would win (a checkout's pdserve)
        "PDSERVE_PATH_CONTROL": str(work / "window"),
        "PDSERVE_PATH_OUT": str(work / "out"),
        "PDSERVE_PATH_SOURCES": str(work / "sources"),
    }


def chat(url: str, model: str, content: str, timeout: float) -> str:
    """One streaming chat completion; its text, after checking the stream ended with [DONE]."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    text, done = [], False
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                for choice in json.loads(line[6:]).get("choices", []):
                    text.append(choice.get("delta", {}).get("content") or "")
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    return "".join(text)


def open_window(work: Path, name: str, pids: list[int], timeout: float = 60.0) -> None:
    """Switch every child to window `name` ("" closes); wait until each says it did (having
    written the window it closed)."""
    (work / "window").write_text(name)
    deadline = time.monotonic() + timeout
    while not all(window_of(work, pid) == name for pid in pids):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the children did not switch to window {name!r} in {timeout}s")
        time.sleep(0.02)


def window_of(work: Path, pid: int) -> str | None:
    """The window child `pid` last switched to (None before its first switch)."""
    try:
        return (work / "out" / f"{pid}.now").read_text()
    except FileNotFoundError:
        return None


def traced_run(cluster, work: Path, window: float) -> float:
    """Idle, request, idle windows of `window` seconds; the request's duration."""
    pids = [cluster.procs[name].pid for name in PROCESSES]
    model = cluster.get("/v1/models")["data"][0]["id"]
    chat(cluster.url, model, "Warm the cluster up, please.", timeout=120)
    time.sleep(window)  # the warm request's tail (frees, lease ends) before the first window
    open_window(work, "idle-before", pids)
    time.sleep(window)
    open_window(work, "request", pids)
    start = time.monotonic()
    chat(cluster.url, model, "Tell me a short story about a fox.", timeout=window)
    took = time.monotonic() - start
    if took > window / 2:
        raise RuntimeError(f"the request took {took:.1f}s: give a --window over {2 * took:.0f}s")
    time.sleep(window - took)
    open_window(work, "idle-after", pids)
    time.sleep(window)
    open_window(work, "", pids)
    return took


def relative(where: list | None, src: Path) -> Function | None:
    return None if where is None else (str(Path(where[0]).relative_to(src)), *where[1:])


def read_windows(work: Path, src: Path, pids: dict[str, int]) -> dict[str, dict[str, list]]:
    """Every process's windows as calls relative to src; refuses code imported from elsewhere."""
    out: dict[str, dict[str, list]] = {}
    for name, pid in pids.items():
        out[name] = {}
        for window in ("request", *IDLE_WINDOWS):
            body = json.loads((work / "out" / f"{pid}.{window}.json").read_text())
            if not body["imports"].startswith(f"{src}{os.sep}"):
                raise RuntimeError(f"{name} imported pdserve from {body['imports']}, not {src}")
            out[name][window] = [
                Call(relative(caller, src), relative(function, src), *times)
                for caller, function, *times in body["calls"]
            ]
    return out


def measure(src: Path, window: float, log_dir: str | None, traces: Path | None) -> dict:
    """Start the cluster with the tracer, trace one request, summarize (and with `traces`,
    write every process's windows there)."""
    from pdserve.local_cluster import LocalCluster
    from pdserve.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="request-path-") as tmp:
        work = Path(tmp)
        model = str(make_tiny_model("llama", work / "model", max_position=2048))
        source = {p for p in tracked_py(src) if not p.startswith(NOT_SOURCE)}
        (work / "sources").write_text("".join(f"{(src / p).resolve()}\n" for p in source))
        os.environ.update(child_env(src, work))  # LocalCluster hands its environment on
        flags = ["--block-size", "16", "--max-model-len", "1024"]
        router = ["--prefill-placement", "remote"]
        args = dict(kv_connector="zmq", engine_args=flags, router_args=router, log_dir=log_dir)
        cluster = LocalCluster(model, 1, 1, **args)
        try:
            cluster.start(timeout=START_TIMEOUT_S)
            took = traced_run(cluster, work, window)
            pids = {name: cluster.procs[name].pid for name in PROCESSES}
        finally:
            cluster.stop()
        windows = read_windows(work, src, pids)
    if traces:
        raw = {
            p: {w: [astuple(c) for c in calls] for w, calls in ws.items()}
            for p, ws in windows.items()
        }
        traces.write_text(json.dumps(raw) + "\n")
    summary = summarize(windows, source)
    return {**summary, "request_s": round(took, 3), "window_s": window}


def describe(src: Path) -> str:
    git = ["git", "-C", str(src), "describe", "--always", "--dirty"]
    commit = subprocess.run(git, capture_output=True, text=True, timeout=30).stdout.strip()
    return f"{src} at {commit or 'unknown'}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", type=Path, default=REPO, help="the tree the children run")
    p.add_argument("--window", type=float, default=4.0, help="each window's seconds")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--log-dir", help="the children's logs")
    p.add_argument("--traces", type=Path, help="write every process's windows here (JSON)")
    p.add_argument("--lines-only", action="store_true", help="lines per folder alone")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    src = args.src.resolve()
    counts = lines_per_folder(src)
    result: dict = {"src": describe(src), "lines": counts}
    if not args.lines_only:
        result.update(measure(src, args.window, args.log_dir, args.traces))
        header = f"one streaming chat completion, remote prefill over zmq: {result['src']}"
        print(render(result, header), end="\n\n")
    print(render_lines(counts))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
