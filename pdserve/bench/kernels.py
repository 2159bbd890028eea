"""Achieved memory bandwidth of each Triton kernel on one CUDA device (all three are memory
bound: bytes a perfect kernel moves / time), as JSON; without CUDA, nothing to time: exit 0.

    pdserve bench kernels --out bench.json      # = python scripts/bench_kernels.py
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch

from pdserve.common.node.cli import parser

DTYPE = torch.bfloat16
BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128


def time_ms(fn: Callable[[], object], iters: int = 50) -> float:
    """Mean milliseconds per call after a warm-up that also triggers compilation."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def result(name: str, nbytes: int, ms: float, **shape: int) -> dict:
    return {"kernel": name, **shape, "ms": ms, "gb_per_s": nbytes / ms / 1e6}


def layer_cache(num_blocks: int) -> torch.Tensor:
    shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape, dtype=DTYPE, device="cuda")


def bench_store_kv(num_tokens: int) -> dict:
    from pdserve.kernels.store_kv import store_kv_triton

    layer = layer_cache(num_tokens // BLOCK_SIZE + 1)
    key, value = torch.randn(2, num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    slots = torch.randperm(num_tokens, device="cuda")
    ms = time_ms(lambda: store_kv_triton(key, value, layer[0], layer[1], slots))
    return result("store_kv", 2 * (key.nbytes + value.nbytes), ms, tokens=num_tokens)


def bench_page_copy(num_pages: int) -> list[dict]:
    from pdserve.kernels.page_copy import gather_pages_triton, scatter_pages_triton

    layer = layer_cache(4 * num_pages)
    ids = torch.randperm(4 * num_pages, device="cuda")[:num_pages]
    pages = gather_pages_triton(layer, ids)
    gather_ms = time_ms(lambda: gather_pages_triton(layer, ids))
    scatter_ms = time_ms(lambda: scatter_pages_triton(layer, ids, pages))
    return [
        result("gather_pages", 2 * pages.nbytes, gather_ms, pages=num_pages),
        result("scatter_pages", 2 * pages.nbytes, scatter_ms, pages=num_pages),
    ]


def bench_decode(batch: int, context: int) -> dict:
    from pdserve.bench.gpu import attention_case
    from pdserve.kernels.paged_attention import paged_attention_triton

    case = attention_case(batch, context, DTYPE)  # the 8B layout's heads, as here
    kv_bytes = case.pop("kv_bytes")
    ms = time_ms(lambda: paged_attention_triton(**case))
    return result("paged_attention_decode", kv_bytes, ms, batch=batch, context=context)


def main(argv: list[str] | None = None) -> int:
    p = parser("pdserve bench kernels", __doc__.split("\n\n")[0])
    out = p.add_argument_group("output")
    out.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="the JSON results: GB/s and ms per call of each kernel and shape",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA device to time kernels; nothing to do")
        return 0
    results = [bench_store_kv(n) for n in (256, 4096)]
    results += [r for n in (16, 256) for r in bench_page_copy(n)]
    results += [bench_decode(32, ctx) for ctx in (512, 2048, 8192)]
    for r in results:
        print(json.dumps(r))
    meta = {"device": torch.cuda.get_device_name(), "dtype": str(DTYPE)}
    with open(args.out, "w") as f:
        json.dump({**meta, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
