"""The scenarios `pdserve bench compare` runs on every system: their sizes, and the requests
of each run (the same ones for every system: a fixed seed)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdserve.bench import load
from pdserve.bench.report import markdown_table


@dataclass(frozen=True, slots=True)
class Sizes:
    """Request counts and lengths of the three scenarios."""

    latency_n: int = 4
    latency_input: int = 1024
    latency_output: int = 16
    sat_n: int = 16
    sat_input: int = 96
    sat_output: int = 32
    sat_rates: tuple[float, ...] = (0.5, 1.0, math.inf)
    # The long prompts must arrive while the short requests decode, or the run mixes nothing:
    # with 64 output tokens and longs at 3 and 12 s, the shorts of every system had finished
    # by 2.6 s on the 2-core machine (the tenth session's compare), so their ITL was a plain
    # decode's. 256 tokens keep them decoding past 2 s at ITLs down to 8 ms.
    mixed_short_n: int = 6
    mixed_short_input: int = 32
    mixed_short_output: int = 256
    mixed_long_input: int = 1024
    mixed_long_output: int = 4
    mixed_long_at: tuple[float, ...] = (1.0, 2.0)  # seconds after the short ones start


QUICK_SIZES = Sizes(2, 64, 4, 4, 32, 6, (8.0, math.inf), 2, 16, 12, 256, 2, (0.3,))


@dataclass(frozen=True, slots=True)
class Run:
    """One benchmark run of a scenario: its requests and how they are sent."""

    scenario: str
    label: str
    requests: list[load.BenchRequest]
    request_rate: float = math.inf
    max_concurrency: int | None = None
    arrivals: list[float] | None = None


def run_keys(sizes: Sizes) -> list[str]:
    """ "scenario/label" of every run, in order: the keys of each system's results."""
    rates = [f"saturation/rate={rate:g}" for rate in sizes.sat_rates]
    return ["latency/concurrency=1", *rates, "serial/concurrency=1", "mixed/short+long"]


def scenario_runs(pool: load.TokenPool, sizes: Sizes, seed: int) -> list[Run]:
    """Every run of the three scenarios; each has prompts of its own (no cross-run cache hits)."""
    s = sizes
    latency = load.random_requests(pool, s.latency_n, s.latency_input, s.latency_output, 0, seed)
    runs = [Run("latency", "concurrency=1", latency, max_concurrency=1)]
    for i, rate in enumerate(s.sat_rates):
        reqs = load.random_requests(pool, s.sat_n, s.sat_input, s.sat_output, 0.25, seed + 1 + i)
        runs.append(Run("saturation", f"rate={rate:g}", reqs, request_rate=rate))
    serial = load.random_requests(pool, s.sat_n, s.sat_input, s.sat_output, 0.25, seed + 40)
    runs.append(Run("serial", "concurrency=1", serial, max_concurrency=1))
    short = load.random_requests(pool, s.mixed_short_n, s.mixed_short_input,
                                 s.mixed_short_output, 0, seed + 50, "short")  # fmt: skip
    long = load.random_requests(pool, len(s.mixed_long_at), s.mixed_long_input,
                                s.mixed_long_output, 0, seed + 51, "long")  # fmt: skip
    arrivals = [0.0] * len(short) + list(s.mixed_long_at)
    runs.append(Run("mixed", "short+long", short + long, arrivals=arrivals))
    return runs


def sat_key(sizes: Sizes) -> str:
    """The saturation run at the highest offered rate (inf: every request at once)."""
    return f"saturation/rate={max(sizes.sat_rates):g}"


def sizes_from_dict(d: dict[str, Any]) -> Sizes:
    """Sizes from its JSON form, where inf is the string "inf"."""
    return Sizes(**{k: tuple(map(float, v)) if isinstance(v, list) else v for k, v in d.items()})


def sizes_table(s: Sizes) -> str:
    """The scenarios' requests; every system gets the same ones (fixed seed)."""
    rates = ", ".join(f"{r:g}" for r in s.sat_rates)
    longs = ", ".join(f"{t:g}" for t in s.mixed_long_at)
    rows = [
        ["latency", s.latency_n, s.latency_input, s.latency_output, "one at a time"],
        ["saturation", s.sat_n, f"~{s.sat_input} (±25%)", f"~{s.sat_output}",
         f"Poisson at {rates} req/s"],
        ["serial", s.sat_n, f"~{s.sat_input} (±25%)", f"~{s.sat_output}", "one at a time"],
        ["mixed: short", s.mixed_short_n, s.mixed_short_input, s.mixed_short_output,
         "all at once"],
        ["mixed: long", len(s.mixed_long_at), s.mixed_long_input, s.mixed_long_output,
         f"at {longs} s"],
    ]  # fmt: skip
    header = ["scenario", "requests", "prompt tokens", "output tokens", "sent"]
    return markdown_table(header, rows)
