"""The int8/int4 GEMV (kernels/cpu_quant.py), its AVX2 path and (where the CPU has it) its
AVX512-VNNI one, against float32 F.linear and torch's packed weight-only kernels, per SmolLM2
shape and row count, at one thread by default (docs/quantization.md, "AVX2 GEMV" and
"AVX512-VNNI GEMV"):

    PYTHONPATH=. python scripts/cpu_quant_bench.py [--threads 1] [--rows 1 4 8] [--repeats 5]

Each weight set is larger than the L2 cache (copies cycled), so weights come from memory as a
decode step reads them. Prints one JSON line per (shape, rows): milliseconds per call, the
median of --repeats timings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.common.model import quant
from pdserve.common.model.quant import QuantizedLinear, quantize_int4, quantize_int8
from pdserve.kernels import cpu_quant

# (out, in): SmolLM2-135M's q/o, k/v, gate/up, down and its tied head.
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
_COPIES_BYTES = 64 * 1024**2  # float32 bytes of weight copies cycled per measurement
# The GEMV's paths measured: AVX2's, and AVX512-VNNI's where this CPU has it.
PATHS = [False] + ([True] if cpu_quant.cpu_has_avx512_vnni() else [])


def per_call_ms(fns: list[Callable[[], torch.Tensor]], repeats: int) -> float:
    """Median over `repeats` of the mean ms per call, cycling through the copies."""
    calls = max(8, 2 * len(fns))
    times = []
    for _ in range(repeats + 1):  # the first warms up
        start = time.perf_counter()
        for i in range(calls):
            fns[i % len(fns)]()
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times[1:])


def layers(out: int, cols: int) -> dict[str, list[Callable[..., torch.Tensor]]]:
    """Per kind, copies of the weight as one-argument callables."""
    copies = max(1, min(8, _COPIES_BYTES // (out * cols * 4)))
    kinds: dict[str, list[Callable[..., torch.Tensor]]] = {}
    for _ in range(copies):
        w = torch.randn(out, cols)
        q8, q4 = quantize_int8(w), quantize_int4(w)
        s8 = q8.scales[:, 0].contiguous()
        pack = cpu_quant.pack_int4(q4.values, q4.scales, q4.zeros, q4.group_size)
        torch8 = QuantizedLinear(q8, scale_dtype=torch.float32, dense=False)
        kinds.setdefault("f32 F.linear", []).append(lambda x, w=w: F.linear(x, w))
        for vnni in PATHS:
            name = "vnni" if vnni else "avx2"
            kinds.setdefault(f"ours int8 {name}", []).append(
                lambda x, q=q8.values, s=s8, v=vnni: cpu_quant.int8_mm(x, q, s, v)
            )
            kinds.setdefault(f"ours int4 {name}", []).append(
                lambda x, p=pack, v=vnni: cpu_quant.int4_mm(x, p, v)
            )
        kinds.setdefault("torch int8", []).append(
            lambda x, m=torch8: torch.ops.aten._weight_int8pack_mm(x, m.qweight, m.scales)
        )
        packed = quant._pack_int4(q4.values)  # torch's int4 packing, as before this kernel
        sz = torch.stack([q4.scales, q4.zeros], dim=2).transpose(0, 1).contiguous()
        kinds.setdefault("torch int4", []).append(
            lambda x, w=packed, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, 32, sz)
        )
    return kinds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_quant.available():
        raise SystemExit("the GEMV is not available here (see the log)")
    for out, cols in SHAPES:
        kinds = layers(out, cols)
        for rows in args.rows:
            x = torch.randn(rows, cols)
            ms = {
                kind: round(per_call_ms([lambda f=f, x=x: f(x) for f in fns], args.repeats), 3)
                for kind, fns in kinds.items()
            }
            print(json.dumps({"shape": f"{out}x{cols}", "rows": rows, **ms}), flush=True)


if __name__ == "__main__":
    main()
