"""Which cores each process of a local deployment runs on (`pdserve serve --cpu-placement`).

Without placement the kernel spreads a router, a prefill node and a decode node over the same
cores, and a decode step waits whenever a prefill chunk holds the core it last ran on: the
short requests' inter-token latency takes the prefill's time. `auto` splits the cores by the
work instead of evenly: a decode step at a few rows reads the weights once and gains little
from more threads, a prefill chunk is compute-bound and uses every core it gets, so the decode
nodes together get a quarter of the cores (at least one each), the prefill nodes the rest,
and the routers share the prefill nodes' cores (a router's work comes in bursts as prompts
arrive, with the prefills they start). Colocated nodes split the cores evenly and the routers
float. Where there are fewer cores than nodes, nothing is pinned.

A pinned node runs no more torch threads than its cores (`OMP_NUM_THREADS`, lowered only).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

PLACEMENTS = ("auto", "off")
DEFAULT_PLACEMENT = "auto"
DECODE_SHARE = 4  # the decode nodes together get 1/DECODE_SHARE of the cores (at least 1 each)


def plan(
    cpus: Sequence[int], prefill: Sequence[str], decode: Sequence[str], colocated: Sequence[str]
) -> dict[str, tuple[int, ...]]:
    """Cores by node name (an empty plan: nothing pinned); "router" names the routers' share.

    The decode nodes take the highest cores, away from core 0, where interrupts and the
    client usually run."""
    cpus = sorted(cpus)
    nodes = len(prefill) + len(decode) + len(colocated)
    if len(cpus) < max(2, nodes) or (colocated and (prefill or decode)):
        return {}
    if colocated:
        return _split(cpus, colocated)
    if not prefill or not decode:
        return {}
    n_decode = max(len(decode), -(-len(cpus) // DECODE_SHARE))
    n_decode = min(n_decode, len(cpus) - len(prefill))
    out = _split(cpus[len(cpus) - n_decode :], decode)
    out.update(_split(cpus[: len(cpus) - n_decode], prefill))
    out["router"] = tuple(cpus[: len(cpus) - n_decode])
    return out


def _split(cpus: Sequence[int], names: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """Consecutive runs of cpus, one per name, the earlier names one core more where the
    count does not divide."""
    share, extra = divmod(len(cpus), len(names))
    out, at = {}, 0
    for i, name in enumerate(names):
        n = share + (i < extra)
        out[name] = tuple(cpus[at : at + n])
        at += n
    return out


def threads_env(cpus: Sequence[int], env: dict[str, str]) -> dict[str, str]:
    """`env` with OMP_NUM_THREADS at most len(cpus): threads beyond a process's cores only
    take turns on them."""
    current = env.get("OMP_NUM_THREADS", "")
    n = len(cpus) if not current.isdigit() or int(current) < 1 else min(int(current), len(cpus))
    return {**env, "OMP_NUM_THREADS": str(n)}


@contextlib.contextmanager
def inherited(cpus: Sequence[int] | None) -> Iterator[None]:
    """This thread on `cpus` for the block: a child it forks or spawns starts there, before
    any thread of its own (None: as it is)."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def pin(pid: int, cpus: Sequence[int]) -> None:
    """Every thread of pid onto cpus (threads started later inherit it)."""
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), cpus)
