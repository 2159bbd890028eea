"""Rounds of a comparison (`bench compare --repeats N`): every system started, measured and
stopped once a round, the systems' order reversed every other round, each metric at its median
over the rounds, and each goal's ratio in every round beside the ratio of the medians.

On a shared machine one system's rate moves 15-25% between runs minutes apart, so one run of
each cannot settle a goal of 1.2x; the median of N rounds can, and the reversed order keeps a
drift over the minutes from favouring the system that always ran first."""

from __future__ import annotations

import argparse
import math
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pdserve.bench.systems import Measure, System, measure_systems

Results = dict[str, dict[str, Any]]  # system -> "scenario/label" -> one run's record


def round_orders(names: Sequence[str], repeats: int) -> list[list[str]]:
    """The systems' order in each round: as given, then reversed (A B C, C B A, A B C, ...)."""
    return [list(names)[:: -1 if r % 2 else 1] for r in range(repeats)]


def measure_rounds(args: argparse.Namespace, systems: dict[str, System], model: Path | str,
                   measure: Measure) -> tuple[list[dict[str, Any]], list[str]]:  # fmt: skip
    """args.repeats rounds of measure_systems (one system up at a time, as in one run); a
    round's record: its number, order, 1-minute load average at its start and end, results.
    Notes name their round when there is more than one."""
    rounds: list[dict[str, Any]] = []
    notes: list[str] = []
    for i, order in enumerate(round_orders(args.systems, args.repeats), 1):
        if args.repeats > 1:
            print(f"== round {i} of {args.repeats}: {', '.join(order)}", flush=True)
        start = os.getloadavg()[0]
        results, said = measure_systems(args, systems, model, measure, order)
        loads = [start, os.getloadavg()[0]]
        rounds.append({"round": i, "order": order, "load_avg_1m": loads, "results": results})
        notes += [f"round {i}: {n}" for n in said] if args.repeats > 1 else said
    return rounds, notes


def median_results(rounds: Sequence[Results]) -> Results:
    """Every system's runs with each field at its median over the rounds that ran it (see
    median_record); one round's results as they are."""
    if len(rounds) == 1:
        return rounds[0]
    merged: Results = {}
    for system in dict.fromkeys(s for r in rounds for s in r):
        per = [r[system] for r in rounds if system in r]
        keys = dict.fromkeys(k for runs in per for k in runs)
        merged[system] = {k: median_record([runs[k] for runs in per if k in runs]) for k in keys}
    return merged


def median_record(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One run's record from the same run in several rounds: numbers at their median (NaN, a
    metric of a run that completed nothing, left out; counts at the lower median, so a count
    stays a count), lists joined (every round's requests, which the CDFs pool), dicts field by
    field, anything else (dates, URLs, flags) the first round's."""
    return {key: _median([r[key] for r in records if key in r])
            for key in dict.fromkeys(k for r in records for k in r)}  # fmt: skip


def _median(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, dict):
        return median_record(values)
    if isinstance(first, list):
        return [x for v in values for x in v]
    if isinstance(first, bool) or not isinstance(first, (int, float)):
        return first
    numbers = [v for v in values if isinstance(v, (int, float)) and not math.isnan(v)]
    if not numbers:
        return math.nan
    if all(isinstance(v, int) for v in numbers):
        return statistics.median_low(numbers)
    return statistics.median(numbers)


def with_round_ratios(goals: list[dict[str, Any]], rounds: Sequence[dict[str, Any]],
                      evaluate: Callable[[Results], list[dict[str, Any]]]
                      ) -> list[dict[str, Any]]:  # fmt: skip
    """The goals (judged on the ratio of the medians) with the ratio each round gave (that
    round's systems paired, `evaluate` of its results) and each round's load average; as
    they are with one round."""
    if len(rounds) == 1:
        return goals
    ratios = [{g["goal"]: g["ratio"] for g in evaluate(r["results"])} for r in rounds]
    loads = [r["load_avg_1m"] for r in rounds]
    return [{**g, "rounds": [r.get(g["goal"]) for r in ratios], "round_loads": loads}
            for g in goals]  # fmt: skip


def failed_notes(rounds: Sequence[dict[str, Any]]) -> list[str]:
    """A note for each run with failed requests in a round: the medians' table may not show
    them (a count at its median), so they are said here; none with one round."""
    notes: list[str] = []
    for r in rounds if len(rounds) > 1 else []:
        for system, runs in r["results"].items():
            for key, res in [(k, res) for k, res in runs.items() if res.get("failed")]:
                sent, first = res["completed"] + res["failed"], (res.get("errors") or ["?"])[0]
                notes.append(f"round {r['round']}: {system} {key}: {res['failed']} of {sent} "
                             f"requests failed (first error: {first})")  # fmt: skip
    return notes


def rounds_row(report: dict[str, Any]) -> list[list[str]]:
    """The setup table's row of a report of several rounds (none for one): N, each round's
    order and load, and how the figures are read."""
    rounds = report.get("rounds", [])
    if len(rounds) < 2:
        return []
    each = "; ".join(f"{r['round']}: {', '.join(r['order'])} (load {_loads(r)})" for r in rounds)
    text = (f"{len(rounds)}, the systems' order reversed every other round ({each}); every "
            "figure is the median over the rounds (the CDFs pool every round's requests), "
            "and each goal also shows the ratio of each round's own two systems")  # fmt: skip
    return [["rounds (`--repeats`)", text]]


def _loads(r: dict[str, Any]) -> str:
    start, end = r["load_avg_1m"]
    return f"{start:.1f} to {end:.1f}"
