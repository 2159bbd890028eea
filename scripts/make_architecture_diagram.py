"""Draw docs/architecture.png: the processes of a 1P1D deployment and one request's path."""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

BOXES = {  # x, y of the lower-left corner, text
    "client": (0.3, 4.6, "client\n(OpenAI API)"),
    "router": (4.6, 4.6, "router\nFastAPI + node registry\ntokenize, detokenize, SSE"),
    "prefill": (0.3, 0.6, "prefill node\nchunked prefill\nprefix cache"),
    "decode": (6.6, 0.6, "decode node\nreserved blocks\ncontinuous batching"),
}
W, H = 2.8, 1.3
# (start, end, label, label position)
ARROWS = [
    ((3.1, 5.5), (4.6, 5.5), "HTTP request", (3.85, 5.75)),
    ((4.6, 4.9), (3.1, 4.9), "SSE stream", (3.85, 4.65)),
    ((5.2, 4.6), (2.6, 1.9), "2 Prefill(dest blocks)", (4.35, 3.0)),
    ((2.1, 1.9), (4.8, 4.6), "first token", (2.9, 3.5)),
    ((6.9, 4.6), (7.6, 1.9), "1 ReserveKV ->\n<- Reserved", (6.3, 3.2)),
    ((8.5, 1.9), (7.2, 4.6), "4 tokens\nevery step", (8.5, 3.5)),
    (
        (3.1, 1.25),
        (6.6, 1.25),
        "3 KV pages, one frame per layer\n(zmq | nccl | shm | nixl) + done, checksum",
        (4.85, 0.65),
    ),
]


def draw(out: str) -> None:
    fig, ax = plt.subplots(figsize=(10, 6.4))
    for x, y, text in BOXES.values():
        ax.add_patch(
            FancyBboxPatch(
                (x, y), W, H, boxstyle="round,pad=0.05", fc="#e8f0fe", ec="#1a4d8f", lw=1.5
            )
        )
        ax.text(x + W / 2, y + H / 2, text, ha="center", va="center", fontsize=10)
    for a, b, label, (lx, ly) in ARROWS:
        ax.add_patch(
            FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=14, lw=1.3, color="#333")
        )
        ax.text(
            lx,
            ly,
            label,
            fontsize=9,
            ha="center",
            va="center",
            bbox={"fc": "white", "ec": "none", "alpha": 0.9},
        )
    ax.set_xlim(0, 9.8)
    ax.set_ylim(0.2, 6.3)
    ax.axis("off")
    ax.set_title("pdserve: one request through the router, a prefill node and a decode node")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="docs/architecture.png")
    draw(p.parse_args().out)
