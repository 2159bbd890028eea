"""One layer's CPU paged attention call at small decode batches and short contexts, where
per-call costs (masks, zeroing, gathers) weigh more than the KV bytes: this thread's CPU
microseconds per call, the best of --repeats (less disturbed by other processes than wall
time). The cases are `pdserve bench attention`'s (its model's heads, blocks of 16, tails
part-full); that bench reports 1K and 4K contexts against the bandwidth floor.

    PYTHONPATH=. python scripts/attention_call_bench.py [--batch 1 16] [--context 37 100]
        [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pdserve.bench.attention import DTYPES, decode_case
from pdserve.kernels.cpu import paged_attention_cpu


def call_us(case: dict, calls: int, repeats: int) -> float:
    """The best over `repeats` of the mean CPU microseconds per call (one plan per step:
    the case's metadata stays the same, as for a step's layers)."""
    args = list(case.values())
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms up and makes the plan
        start = time.thread_time()
        for _ in range(calls):
            paged_attention_cpu(*args)
        best = min(best, (time.thread_time() - start) / calls)
    return round(1e6 * best, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, nargs="+", default=[37, 100])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    torch.set_num_threads(1)
    result = {
        f"batch {b}, context {c}": call_us(
            decode_case(b, c, DTYPES[args.dtype]), args.calls, args.repeats
        )
        for b in args.batch
        for c in args.context
    }
    print(json.dumps({"dtype": args.dtype, "cpu_us_per_call": result}))


if __name__ == "__main__":
    main()
