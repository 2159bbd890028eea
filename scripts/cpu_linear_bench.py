"""CPU ms per float32 (or bf16) linear call over SmolLM2's shapes, each kernel torch ships for
it (docs/quantization.md, "CPU linear"): F.linear (MKL), the weight transposed (`mm(x, w.T)`),
oneDNN's blocked layout (`PackedLinear`), MKL's packed SGEMM (one packing per row count) and,
for the head, `chunked_linear`. Weights are read from memory as in a decode step: each kernel
cycles through copies of its weight that together exceed the last-level cache.

    PYTHONPATH=. python scripts/cpu_linear_bench.py [--rows 1,4,16,64,256,512] [--only head]
        [--dtype bfloat16]   # F.linear, mm and oneDNN packed only (MKL's SGEMM is float32)
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.kernels.ops import PackedLinear, chunked_linear

# SmolLM2-135M: (out, in) of q/o, k/v, gate/up, down and the tied head.
SHAPES = {
    "q/o 576x576": (576, 576),
    "k/v 576x192": (192, 576),
    "gate/up 576x1536": (1536, 576),
    "down 1536x576": (576, 1536),
    "head 576x49152": (49152, 576),
}
COLD_BYTES = 96 * 2**20  # more than the EPYC's 32 MiB L3

Kernel = tuple[Callable[[], object], Callable[[torch.Tensor, object], torch.Tensor]]


def kernels(w: torch.Tensor, rows: int) -> dict[str, Kernel]:
    """name -> (make one copy of the weight in the kernel's form, call it on x)."""
    mkl = torch.ops.mkl
    found: dict[str, Kernel] = {
        "F.linear": (w.clone, lambda x, p: F.linear(x, p)),
        "mm(x, w.T)": (lambda: w.t().contiguous(), lambda x, p: torch.mm(x, p)),
        "oneDNN packed": (lambda: PackedLinear(w), lambda x, p: p(x)),
    }
    if w.dtype == torch.float32:
        found["MKL packed"] = (
            lambda: mkl._mkl_reorder_linear_weight(w, rows),
            lambda x, p: mkl._mkl_linear(x, p, w, None, rows),
        )
    if w.shape[0] > 8192:
        found["chunked"] = (w.clone, chunked_linear)
    return found


def time_kernels(w: torch.Tensor, rows: int, repeats: int) -> dict[str, float]:
    """Median CPU ms per call of each kernel, the kernels interleaved in each repeat."""
    copies = max(1, math.ceil(COLD_BYTES / (w.numel() * w.element_size())))
    calls = max(copies, min(200, int(2e9 / (2 * rows * w.numel()))))
    if w.shape[0] > 8192:
        calls = max(2, min(calls, 10))
    x = torch.randn(rows, w.shape[1]).to(w.dtype)
    found = kernels(w, rows)
    held = {name: [make() for _ in range(copies)] for name, (make, _) in found.items()}
    times: dict[str, list[float]] = {name: [] for name in found}
    for repeat in range(repeats + 1):  # the first warms up
        for name, (_, call) in found.items():
            start = time.thread_time()
            for i in range(calls):
                call(x, held[name][i % copies])
            if repeat:
                times[name].append((time.thread_time() - start) / calls * 1000)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default="1,4,16,64,256,512")
    p.add_argument("--only", default="", help="shapes whose name holds this")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for shape, (out, inp) in SHAPES.items():
        if args.only not in shape:
            continue
        w = (torch.randn(out, inp) * 0.05).to(getattr(torch, args.dtype))
        for rows in map(int, args.rows.split(",")):
            ms = time_kernels(w, rows, args.repeats)
            cells = "  ".join(f"{name} {t:.3f}" for name, t in ms.items())
            print(f"{shape:17s} M={rows:<4d} {cells}", flush=True)


if __name__ == "__main__":
    main()
