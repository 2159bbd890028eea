"""`python -m pdserve.planner.compare`: the planner against static P:D allocations in the
simulator, on a sinusoidal burst or a Mooncake-format trace. Sweeps static (P, D), finds the
cheapest that meets the goodput goal (fewest node-seconds), the cheapest 1:1, and runs the
planner from 1P1D; prints one markdown table (docs/planner.md holds the runs) and, with
`--plot PATH`, draws the planner's run from 1P1D over time (`drawing.draw`)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdserve.planner.config import PlannerConfig
from pdserve.planner.drawing import draw
from pdserve.planner.policy import Policy
from pdserve.planner.sim import NodeModel, Sim, SimResult
from pdserve.planner.traces import mooncake, sinusoid


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    nodes: str
    result: SimResult


def sweep(
    trace: Sequence[Any],
    model: NodeModel,
    slos: tuple[float, float],
    goal: float,
    max_prefill: int,
    max_decode: int,
) -> list[Row]:
    """Static allocations: for each decode count, the fewest prefill nodes that meet the goal,
    by bisection (goodput does not fall as a pool grows). Decode grows until one more decode
    node saves no prefill node: past that, every allocation costs more."""
    rows: list[Row] = []
    fewest_before = None
    for d in range(1, max_decode + 1):
        fewest = _fewest_prefill(trace, model, slos, goal, d, max_prefill, rows)
        if fewest is not None and fewest == fewest_before:
            break
        fewest_before = fewest
    return rows


def _fewest_prefill(
    trace: Sequence[Any],
    model: NodeModel,
    slos: tuple[float, float],
    goal: float,
    d: int,
    most: int,
    rows: list[Row],
) -> int | None:
    low, high, found = 1, most, None
    while low <= high:
        p = (low + high) // 2
        rows.append(Row("static", f"{p}P{d}D", Sim(trace, model, slos, (p, d)).run()))
        if rows[-1].result.goodput >= goal:
            found, high = p, p - 1
        else:
            low = p + 1
    return found


def cheapest(rows: Sequence[Row], goal: float) -> Row | None:
    met = [r for r in rows if r.result.goodput >= goal]
    return min(met, key=lambda r: r.result.node_seconds) if met else None


def one_to_one(
    trace: Sequence[Any], model: NodeModel, slos: tuple[float, float], goal: float, most: int
) -> Row:
    """The smallest n:n that meets the goal (n = most if none does)."""
    for n in range(1, most + 1):
        row = Row("fixed 1:1", f"{n}P{n}D", Sim(trace, model, slos, (n, n)).run())
        if row.result.goodput >= goal:
            break
    return row


def compare(
    trace: Sequence[Any],
    model: NodeModel,
    config: PlannerConfig,
    goal: float,
    most: tuple[int, int],
) -> tuple[list[Row], list[Row]]:
    """The sweep, and the summary rows: best static, 1:1, planner."""
    slos = (config.ttft_slo, config.itl_slo)
    rows = sweep(trace, model, slos, goal, *most)
    best = cheapest(rows, goal) or max(rows, key=lambda r: r.result.goodput)
    pair = one_to_one(trace, model, slos, goal, max(most))
    summary = [replace(best, name="best static"), pair]
    for start in {(1, 1): None, _counts(best.nodes): None}:
        planned = Sim(trace, model, slos, start, Policy(config)).run()
        summary.append(Row("planner", f"from {start[0]}P{start[1]}D", planned))
    return rows, summary


def _counts(nodes: str) -> tuple[int, int]:
    p, d = nodes.rstrip("D").split("P")
    return int(p), int(d)


def table(rows: Sequence[Row], base: SimResult) -> str:
    heads = ("allocation", "nodes", "goodput", "node-seconds", "vs best static", "TTFT p90 (s)")
    lines = ["| " + " | ".join(heads) + " | ITL p90 (ms) |", "|---" * (len(heads) + 1) + "|"]
    for r in rows:
        x, cost = r.result, r.result.node_seconds / base.node_seconds
        lines.append(
            f"| {r.name} | {r.nodes} | {x.goodput:.1%} | {x.node_seconds:,.0f} | "
            f"{cost:.2f}x | {x.ttft_p90:.2f} | {x.tpot_p90 * 1000:.1f} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pdserve.planner.compare", description=__doc__)
    p.add_argument("--trace", default="sinusoid", help="'sinusoid' or a Mooncake-format JSONL")
    p.add_argument("--duration", type=float, default=3600.0, help="sinusoid: seconds")
    p.add_argument("--rate", type=float, default=2.0, help="sinusoid: requests/s at 1x")
    p.add_argument("--peak", type=float, default=8.0, help="sinusoid: the peak's multiple")
    p.add_argument("--period", type=float, default=1200.0, help="sinusoid: seconds per swing")
    p.add_argument("--prompt", type=int, default=2048, help="sinusoid: mean prompt tokens")
    p.add_argument("--output", type=int, default=256, help="sinusoid: mean answer tokens")
    p.add_argument("--limit", type=int, default=None, help="trace file: its first N requests")
    p.add_argument("--ttft-slo", type=float, default=2.0)
    p.add_argument("--itl-slo", type=float, default=0.05)
    p.add_argument("--prefill-rate", type=float, default=NodeModel().prefill_rate)
    p.add_argument("--start-delay", type=float, default=NodeModel().start_delay)
    p.add_argument("--goal", type=float, default=0.95, help="goodput a static allocation must meet")
    p.add_argument("--max-prefill", type=int, default=24)
    p.add_argument("--max-decode", type=int, default=8)
    p.add_argument("--sweep", action="store_true", help="print every static allocation too")
    p.add_argument("--plot", type=Path, default=None, help="PNG: the planner's run over time")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a PlannerConfig field (util_high=0.95), repeatable")  # fmt: skip
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> str:
    args = parse_args(argv)
    if args.trace == "sinusoid":
        trace = sinusoid(
            args.duration, args.rate, args.prompt, args.output, peak=args.peak, period=args.period
        )
    else:
        trace = mooncake(Path(args.trace), limit=args.limit)
    model = NodeModel(prefill_rate=args.prefill_rate, start_delay=args.start_delay)
    given = {k: float(v) for k, v in (item.split("=", 1) for item in args.set)}
    config = PlannerConfig(ttft_slo=args.ttft_slo, itl_slo=args.itl_slo, **given)
    started = time.process_time()
    rows, summary = compare(trace, model, config, args.goal, (args.max_prefill, args.max_decode))
    out = table((rows if args.sweep else []) + summary, summary[0].result)
    cpu = time.process_time() - started
    if args.plot:
        name = "sinusoid" if args.trace == "sinusoid" else Path(args.trace).name
        runs = [(r.nodes, r.result.decisions) for r in summary[2:]]
        goodput = ", ".join(f"{r.nodes} {r.result.goodput:.1%}" for r in summary[2:])
        title = f"{name}: the planner's runs (goodput {goodput}), best static {summary[0].nodes}"
        draw(trace, runs, _counts(summary[0].nodes), title, args.plot)
    out += f"\n\n{len(trace)} requests; {len(rows) + 4} simulations in {cpu:.1f} CPU s; {config}"
    print(out)
    return out


if __name__ == "__main__":
    main()
