"""A simulated run drawn over time (`python -m pdserve.planner.compare --plot PATH`): the load
the trace brings (requests and prompt tokens per second, per minute) above the node counts the
planner's decisions set, beside the cheapest static allocation that meets the goal."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.planner.policy import Decision

BIN = 60.0  # seconds per point of the load


def load_per_bin(trace: Sequence[Any]) -> tuple[list[float], list[float], list[float]]:
    """The trace's arrivals per `BIN`: (bin starts, requests/s, prompt tokens/s)."""
    bins = int(max(r.at for r in trace) // BIN) + 1
    requests, tokens = [0.0] * bins, [0.0] * bins
    for r in trace:
        i = int(r.at // BIN)
        requests[i] += 1 / BIN
        tokens[i] += r.input_len / BIN
    return [i * BIN for i in range(bins)], requests, tokens


def draw(
    trace: Sequence[Any],
    runs: Sequence[tuple[str, Sequence[Decision]]],
    static: tuple[int, int],
    title: str,
    path: Path,
) -> None:
    """Two panels sharing time: the load, and each planner run's counts (prefill, decode: the
    nodes it counted at each decision, starting ones included; `runs`: (its start, its
    decisions), the first solid, the next dotted) against `static` (P, D) dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    starts, requests, tokens = load_per_bin(trace)
    top.step(starts, requests, where="post", color="grey", label="requests/s")
    top.set_ylabel("requests per second")
    top.legend(loc="upper left")
    right = top.twinx()
    right.step(starts, [t / 1000 for t in tokens], where="post", color="tab:green", lw=0.8,
               label="prompt ktokens/s")  # fmt: skip
    right.set_ylabel("prompt ktokens per second")
    right.legend(loc="upper right")
    top.set_title(title, fontsize=9)
    for i, (role, color) in enumerate((("prefill", "tab:blue"), ("decode", "tab:orange"))):
        for (start, decisions), style in zip(runs, ("-", ":")):
            counts = [d.current[i] for d in decisions]
            label = f"{role}, planner {start}"
            bottom.step([d.at for d in decisions], counts, where="post", color=color, ls=style,
                        label=label)  # fmt: skip
        bottom.axhline(static[i], color=color, ls="--", lw=0.8, label=f"{role}, best static")
    bottom.set_xlabel("seconds")
    bottom.set_ylabel("nodes")
    bottom.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
