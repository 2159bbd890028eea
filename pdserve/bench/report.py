"""What every benchmark shares: where its outputs go, timing, the benchmark model, and its
report: JSON, figures, tables, goals met or missed, and its own fenced section of a page.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The benchmark model's geometry (pdserve.tiny_model arguments): a ~90M-parameter Llama with
# random weights, small enough for a CPU, big enough that matmuls dominate a step.
BENCH_MODEL_SIZES = dict(layers=12, hidden=768, heads=12, kv_heads=4, intermediate=2048,
                         vocab=8192, max_position=4096)  # fmt: skip
MODEL_STAMP = "pdserve-bench.json"  # the spec a cached model was built from


def checkout_root() -> Path | None:
    """The pdserve repository this package is imported from (a source tree or an editable
    install); None for an installed wheel."""
    root = Path(__file__).resolve().parents[2]
    pyproject = root / "pyproject.toml"
    if (root / "docs").is_dir() and pyproject.is_file():
        if 'name = "pdserve"' in pyproject.read_text():
            return root
    return None


def default_docs_dir() -> Path:
    """docs/ of the checkout pdserve runs from, else ./docs of the current directory."""
    root = checkout_root()
    return root / "docs" if root else Path.cwd() / "docs"


@dataclass(frozen=True, slots=True)
class Outputs:
    """Where one run writes: JSON and figures into `folder`, its section into `page`."""

    folder: Path
    page: Path

    def link(self, path: Path) -> str:
        """`path` as the page links it."""
        return os.path.relpath(path, self.page.parent)


def outputs(out: Path | None, docs_dir: Path | None) -> Outputs:
    """DOCS/bench and DOCS/benchmarks.md by default; an `out` folder elsewhere gets its own
    benchmarks.md, so a trial run leaves the docs alone."""
    docs = docs_dir or default_docs_dir()
    folder = out or docs / "bench"
    if folder.resolve() == (docs / "bench").resolve():
        return Outputs(folder, docs / "benchmarks.md")
    return Outputs(folder, folder / "benchmarks.md")


def docs_dir_flag(holds: str) -> tuple:
    """--docs-dir DOCS as a flag row (see SEED_FLAG); `holds` names what a run writes there."""
    text = f"docs folder for {holds} (default: docs/ of the checkout pdserve is imported from, "
    return ("--docs-dir", Path, None, text + "else ./docs)", {"metavar": "DOCS"})


def add_output_flags(
    p: argparse.ArgumentParser, files: str, saved: str = ""
) -> argparse._ArgumentGroup:
    """The group "output": --out DIR (which receives `files`), --docs-dir, and with `saved`
    (the JSON a run writes) --from-json: redraw its figure and section, measuring nothing."""
    out = f"folder for {files} (default: DOCS/bench); any other folder also gets its own "
    rows = [
        ("--out", Path, None, out + "benchmarks.md, and DOCS is left alone", {"metavar": "DIR"}),
        docs_dir_flag("benchmarks.md and bench/"),
    ]
    if saved:
        text = f"measure nothing: redraw the figure and section of a saved {saved}"
        rows.append(("--from-json", Path, None, text, {"metavar": "FILE"}))
    group = p.add_argument_group("output")
    add_flags(group, rows)
    return group


def outputs_from_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> Outputs:
    """The run's Outputs; a --quick run must name its own --out (it never writes into docs)."""
    if getattr(args, "quick", False) and args.out is None:
        p.error("--quick writes only under --out DIR, never into docs/")
    return outputs(args.out, args.docs_dir)


def command_line(script: str, argv: list[str]) -> str:
    """How to repeat this run, as the docs cite it: `python scripts/SCRIPT ARGS`."""
    return shlex.join(["python", f"scripts/{script}", *argv])


def sync(device: str) -> None:
    """Wait for the device's queued work, so a wall-clock span covers it (nothing on CPU)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def best_time(fn: Callable[[], object], device: str, repeats: int = 3) -> float:
    """Best wall seconds of `repeats` calls of fn, after one untimed warm-up call."""
    fn()
    best = math.inf
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def cuda_ms(fn: Callable[[], Any], iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() between CUDA events, after warm-up runs."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cached_model(cache_dir: Path, name: str, spec: dict[str, Any]) -> Path:
    """The random-weight Llama of `spec` (make_tiny_model's arguments) at cache_dir/name,
    built once. Built aside and renamed, so a concurrent run never reads half a model; a stamp
    names the spec, so a changed spec builds it again."""
    out = cache_dir / name
    stamp = out / MODEL_STAMP
    if stamp.is_file() and json.loads(stamp.read_text()) == spec:
        return out
    from pdserve.tiny_model import make_tiny_model

    print(f"building {name} into {out}", flush=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        built = make_tiny_model("llama", Path(tmp) / "m", **spec)
        (built / MODEL_STAMP).write_text(json.dumps(spec))
        shutil.rmtree(out, ignore_errors=True)  # built from another spec
        with contextlib.suppress(OSError):  # another run got there first
            os.rename(built, out)
    return out


def machine() -> dict[str, Any]:
    """Where a result was measured, stored next to it."""
    import torch

    gpu = {"gpu": torch.cuda.get_device_name()} if torch.cuda.is_available() else {}
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(), **gpu}  # fmt: skip


def describe_machine(m: dict[str, Any], threads: str = "torch threads") -> str:
    """One line for a report from machine()'s record; `threads` names its thread count."""
    where = m.get("gpu") or f"{m['cpu']} x{m['cpu_count']} cores"
    return f"{where}, torch {m['torch']}, {threads}: {m['threads']}"


def strict_json(x: Any) -> Any:
    """inf and nan as strings, so the file is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json(v) for v in x]
    return x


def save_json(path: str | Path, result: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(strict_json(result), indent=2, sort_keys=True) + "\n")
    return path


@dataclass
class Panel:
    """One panel of a figure of lines; each line is (label, xs, ys, matplotlib style)."""

    title: str
    xlabel: str
    ylabel: str = ""
    lines: list[tuple[str, Sequence[float], Sequence[float], str]] = field(default_factory=list)
    xlog: int = 0  # the x axis's log base (0: linear)
    xticks: Sequence[float] = ()  # ticks labelled as plain numbers (the log axis's own else)
    ylog: bool = False
    ymin: float | None = None  # 0 starts the y axis at zero
    hline: float | None = None  # a grey reference line


def plot_lines(panels: Sequence[Panel], path: Path, title: str = "", width: float = 5.5) -> Path:
    """The panels side by side in one figure, saved at `path` (matplotlib imported only when a
    figure is drawn, drawing off-screen)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), 4.0), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        draw_panel(ax, panel)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_panel(ax: Any, p: Panel) -> None:
    for label, xs, ys, style in p.lines:
        steps = {"drawstyle": "steps-post"} if style == "step" else {}  # a CDF
        ax.plot(xs, ys, "-" if steps else style, label=label, **steps)
    if p.xlog:
        ax.set_xscale("log", base=p.xlog)
    if p.xticks:
        ax.set_xticks(p.xticks, [f"{x:g}" for x in p.xticks])
        ax.minorticks_off()
    ax.set(title=p.title, xlabel=p.xlabel, ylabel=p.ylabel)
    if p.ylog:
        ax.set_yscale("log")
    if p.ymin is not None:
        ax.set_ylim(bottom=p.ymin)
    if p.hline is not None:
        ax.axhline(p.hline, color="gray", lw=0.8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def write_section(name: str, body: str, doc: str | Path) -> Path:
    """Replace the section `name` of `doc` (append it, or create the page, when missing).
    ValueError when the page holds the section's markers other than once each, in order: a
    guess there could overwrite the prose between two stray markers."""
    doc = Path(doc)
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    counts = (text.count(begin), text.count(end))
    if counts == (1, 1) and text.index(begin) < text.index(end):
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    elif counts == (0, 0):
        text = text.rstrip() + "\n\n" + block + "\n"
    else:
        raise ValueError(f"{doc}: the markers of section {name!r} are broken; fix them by hand")
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    return doc


def publish(name: str, report: dict[str, Any], to: Outputs,
            plot: Callable[[dict[str, Any], Path], Path],
            section: Callable[[dict[str, Any], str], str], stem: str | None = None
) -> tuple[Path, Path, Path]:  # fmt: skip
    """Write one run: STEM.json, its figure STEM.png (`plot(report, path)`) and the page's
    section `name` (`section(report, the figure's link)`); STEM defaults to `name`. Prints
    and returns the three paths."""
    stem = stem or name
    data = save_json(to.folder / f"{stem}.json", report)
    figure = plot(report, to.folder / f"{stem}.png")
    page = write_section(name, section(report, to.link(figure)), to.page)
    print(f"wrote {data}, {figure}, {page}")
    return data, figure, page


def measure_or_load(args: argparse.Namespace, benchmark: str, script: str, argv: Sequence[str],
                    measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """The run's report: read back from --from-json FILE (to redraw its figure and section),
    else measure()'s fields after what every run records: its name, the command that repeats
    it, the machine, and the load average at start and end (other work on a shared machine)."""
    if getattr(args, "from_json", None):
        return json.loads(args.from_json.read_text())
    load = os.getloadavg()[0]
    fields = measure()
    return {"benchmark": benchmark, "command": command_line(script, list(argv)),
            "machine": machine(), "load_avg": [load, os.getloadavg()[0]], **fields}  # fmt: skip


def bench_main(argv: Sequence[str] | None, parse: Callable[[list[str]], argparse.Namespace],
               name: str, measure: Callable[[argparse.Namespace], dict[str, Any]],
               write: Callable[[dict[str, Any], Outputs], object]) -> dict[str, Any]:  # fmt: skip
    """A benchmark's main: parse, measure (or read back --from-json), write(report, its
    Outputs). Pages cite the run as `python scripts/bench_NAME.py ARGS`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    report = measure_or_load(args, name, f"bench_{name}.py", argv, lambda: measure(args))
    write(report, args.outputs)
    return report


def run_header(report: dict[str, Any], threads: str = "torch threads") -> list[str]:
    """A section's first lines: the command that repeats the run, and where and how it ran."""
    dtype = f", {report['dtype']}" if "dtype" in report else ""
    start, end = report["load_avg"]
    return [
        f"Command: `{report['command']}`  ",
        f"Machine: {describe_machine(report['machine'], threads)}; device `{report['device']}`"
        f"{dtype}; median of {report['repeats']} repeats; load average {start:.1f} at start, "
        f"{end:.1f} at end.  ",
    ]


def goal(name: str, value: float | None, base: float | None, op: str, target: float) -> dict:
    """One goal of a run: value / base against target (op ">=" or "<="); "not measured" when
    either side is missing."""
    ratio = value / base if value is not None and base is not None and base > 0 else None
    met = ratio is not None and (ratio >= target if op == ">=" else ratio <= target)
    status = "not measured" if ratio is None else "met" if met else "missed"
    return {"goal": name, "value": value, "baseline": base, "ratio": ratio, "status": status}


def goals_table(goals: list[dict[str, Any]]) -> str:
    """The goals of a run as a table: goal, value, baseline, ratio, met or missed; goals of
    several rounds (`rounds`: each round's ratio, `round_loads`) add each round's ratio."""
    keys = ("goal", "value", "baseline", "ratio", "status")
    rows = [["—" if g[k] is None else g[k] for k in keys] for g in goals]
    if not any("rounds" in g for g in goals):
        return markdown_table(list(keys), rows)
    each = [round_ratios(g.get("rounds", []), g.get("round_loads", [])) for g in goals]
    header = [*keys, "each round's ratio (1-min load at its start, end)"]
    return markdown_table(header, [[*row, text] for row, text in zip(rows, each)])


def round_ratios(ratios: Sequence[float | None], loads: Sequence[Sequence[float]]) -> str:
    """A goal's ratio in each round with the round's load average: `1.13 (2.1, 3.0); ...`
    (— for a goal no round measured)."""
    if all(r is None for r in ratios):
        return "—"
    return "; ".join(f"{'—' if r is None else cell(r)} ({a:.1f}, {b:.1f})"
                     for r, (a, b) in zip(ratios, loads))  # fmt: skip


def cell(v: Any) -> str:
    """A value as a table shows it: floats to three digits, large ones with separators."""
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# A flag as a row: (flag, type, default, help) and optionally a dict of more add_argument
# keywords; type bool makes a switch. The rows below are flags several benchmarks take.
SEED_FLAG = ("--seed", int, 0, "seed of the requests (prompts, lengths, arrivals)")
TIMEOUT_FLAG = ("--request-timeout", float, 600.0, "seconds one request may take")
TQDM_FLAG = ("--disable-tqdm", bool, None, "no progress bar")
THREADS_FLAG = ("--threads", int, 1, "torch threads of every server process (0: torch's own)")
LOG_DIR_FLAG = ("--log-dir", Path, None, "server logs (default: a temporary folder, removed at "
                "the end)", {"metavar": "DIR"})  # fmt: skip
CACHE_DIR_FLAG = ("--cache-dir", Path, Path.home() / ".cache" / "pdserve-bench",
                  "where built or converted models are kept", {"metavar": "DIR"})  # fmt: skip


def add_flags(group: argparse._ArgumentGroup, rows: Sequence[tuple]) -> None:
    """Add flags written as rows (see SEED_FLAG)."""
    for flag, kind, default, text, *more in rows:
        keywords = more[0] if more else {}
        if kind is bool:
            group.add_argument(flag, action="store_true", help=text, **keywords)
        else:
            group.add_argument(flag, type=kind, default=default, help=text, **keywords)


def records_table(columns: Sequence[tuple[str, Any]], records: Iterable[Any]) -> str:
    """One row per record, one column per (header, key or function of the record)."""
    rows = [record_cells(columns, r) for r in records]
    return markdown_table([header for header, _ in columns], rows)


def record_cells(columns: Sequence[tuple[str, Any]], record: Any) -> list[Any]:
    return [f(record) if callable(f) else record[f] for _, f in columns]


def record_line(columns: Sequence[tuple[str, Any]], record: Any) -> str:
    """One record as `header value, ...`: a run's progress, in its table's columns."""
    cells = record_cells(columns, record)
    return ", ".join(f"{header} {cell(v)}" for (header, _), v in zip(columns, cells))


def flags_text(args: Sequence[str]) -> str:
    return f"`{shlex.join(args)}`" if args else "none"


def setup_rows(report: dict[str, Any]) -> list[list[Any]]:
    """The rows a run's setup table starts with: when, where, what model, which flags."""
    m, args = report["machine"], report["engine_args"]
    dtype = dict(zip(args, args[1:])).get("--dtype", "dtype auto")
    return [
        ["measured", f"{report['date']} at pdserve {report['git']}"],
        ["machine", f"{m['cpu']}, {m['cpu_count']} CPU cores, torch {m['torch']}, {dtype}"],
        ["model", report["model_desc"]],
        ["pdserve engine flags", flags_text(report["engine_args"])],
        ["torch threads per server process (`--threads`)", report["threads"]],
    ]


def git_state() -> str:
    """HEAD and whether the tree had changes: what exactly was measured."""
    root = checkout_root()
    if root is None:
        return "unknown (not run from a checkout)"

    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        return run.stdout

    try:
        dirty = " with uncommitted changes" if git("status", "--porcelain", "-uno").strip() else ""
        return git("rev-parse", "--short", "HEAD").strip() + dirty
    except (OSError, subprocess.SubprocessError):
        return "unknown"
