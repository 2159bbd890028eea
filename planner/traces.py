"""The simulator's traces: a sinusoidal burst (the arrival rate swings from 1x to `peak`x and
back every `period` seconds, a Poisson process thinned to it) and the Mooncake FAST'25 format,
read by `pdserve bench replay`'s own reader. Both give `replay.TraceRequest`s."""

from __future__ import annotations

import math
import random
from pathlib import Path

from pdserve.bench.load import sample_len
from pdserve.bench.replay import TraceRequest, parse, scaled


def sinusoid(
    duration: float,
    base_rate: float,
    prompt: int,
    output: int,
    *,
    peak: float = 8.0,
    period: float = 1200.0,
    spread: float = 0.5,
    seed: int = 0,
) -> list[TraceRequest]:
    """Arrivals at base_rate * (1 + (peak - 1) * (1 - cos(2 pi t / period)) / 2) requests/s,
    lengths uniform within `spread` of their means."""
    if not (duration > 0 and base_rate > 0 and peak >= 1 and period > 0):
        raise ValueError("need duration > 0, base_rate > 0, peak >= 1, period > 0")
    rng, t, top, out = random.Random(seed), 0.0, base_rate * peak, []
    while True:
        t += rng.expovariate(top)
        if t >= duration:
            return out
        swing = (1 - math.cos(2 * math.pi * t / period)) / 2
        if rng.random() * peak < 1 + (peak - 1) * swing:
            lengths = sample_len(rng, prompt, spread), sample_len(rng, output, spread)
            out.append(TraceRequest(t, *lengths, 1, ()))


def mooncake(
    path: Path, *, limit: int | None = None, time_scale: float = 1.0
) -> list[TraceRequest]:
    """A Mooncake-format trace (or a router request log), its first `limit` requests, its
    arrivals at `time_scale` times theirs; lengths as recorded (no prefix cache is modelled)."""
    with path.open() as f:
        trace = parse(f)
    return [scaled(r, time_scale, 1.0, 1.0) for r in trace[:limit]]
