"""The measurements behind docs/quantization.md: matmul times per row count and weight shape for
float32, bf16 and the quantized paths, and each GGUF type's error held as int4 or as int8.

    PYTHONPATH=. python scripts/quant_kernels.py [--gguf FILE] [--reps 20]

The K-quant encoders are the tests' (gguf cannot write those types), hence PYTHONPATH=.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from pdserve.common.model.gguf import RawTensor, read_raw_tensors
from pdserve.common.model.quant import (
    QuantizedLinear,
    QuantizedWeight,
    from_gguf_blocks,
    quantize_int4,
    quantize_int8,
)
from tests.common.model.test_quant import _weights, encode

SHAPES = [(1536, 576), (14336, 4096)]  # [out, in]: SmolLM2's MLP, a 7B's MLP
ROWS = [1, 4, 16, 64, 256]
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0]


def best_ms(fn: Callable[[], object], reps: int) -> float:
    """The fastest of `reps` runs: the machine is shared, the minimum is the kernel's own."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def row_timings(w: torch.Tensor, layers: list[QuantizedLinear], rows: int, n: int) -> list[float]:
    """ms for float32 and bf16 matmuls of `rows` rows by w, then each layer on bf16 rows."""
    x, wb = torch.randn(rows, w.shape[1]), w.bfloat16()
    xb = x.bfloat16()
    cells = [best_ms(lambda: x @ w.T, n), best_ms(lambda: xb @ wb.T, n)]
    return cells + [best_ms(lambda layer=layer: layer(xb), n) for layer in layers]


def timings(reps: int) -> None:
    print(
        "| weight [out, in] | rows | float32 | bf16 | int8 w-o | int4 w-o | int8 deq+bf16 "
        "| int4 deq+bf16 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for out, cols in SHAPES:
        w = torch.randn(out, cols) * 0.05
        int8, int4 = quantize_int8(w), quantize_int4(w)
        kernel = [QuantizedLinear(q, dense=False) for q in (int8, int4)]
        layers = kernel + [QuantizedLinear(q, dense_rows=1) for q in (int8, int4)]
        n = reps if out * cols < 10**7 else max(3, reps // 4)
        for rows in ROWS:
            cells = row_timings(w, layers, rows, n)
            print(f"| {out}x{cols} | {rows} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def accuracy(weights: list[np.ndarray]) -> None:
    """Relative Frobenius error of each holding against the type's own float32, beside the
    type's error against the weight it encoded."""
    print("| type | type vs original | int4 g32 vs type | int8/row vs type | chosen, bf16 scales |")
    print("|---|---|---|---|---|")
    for qtype in TYPES:
        own, int4, int8, stored = [], [], [], []
        for w in weights:
            blocks = encode(w, qtype)
            raw = RawTensor("w", qtype.name, blocks, w.shape)
            floats = torch.from_numpy(quants.dequantize(blocks, qtype).reshape(w.shape))
            own.append(_error(floats, torch.from_numpy(w)))
            int4.append(_error(from_gguf_blocks(raw, 4).dequantize(), floats))
            int8.append(_error(from_gguf_blocks(raw, 8).dequantize(), floats))
            stored.append(_error(_bf16_scales(from_gguf_blocks(raw)).dequantize(), floats))
        row = [np.mean(own), np.mean(int4), np.mean(int8), np.mean(stored)]
        print(f"| {qtype.name} | " + " | ".join(f"{e:.4f}" for e in row) + " |")


def _bf16_scales(weight: QuantizedWeight) -> QuantizedWeight:
    """The weight as a layer holds it by default: scales and zeros rounded to bf16."""
    zeros = None if weight.zeros is None else weight.zeros.bfloat16().float()
    return dataclasses.replace(weight, scales=weight.scales.bfloat16().float(), zeros=zeros)


def gguf_weights(path: str) -> list[np.ndarray]:
    """The 2-D weights of a GGUF file's first 8 layers whose rows are whole K-quant blocks of
    256 (SmolLM2: ffn_down only), as float32."""
    layers = tuple(f"blk.{i}." for i in range(8))
    tensors = read_raw_tensors(Path(path), [], 1, 1, 1)  # GGUF names: nothing unpermuted
    picked = [t for t in tensors if len(t.shape) == 2 and t.name.startswith(layers)]
    return [_off_grid(t) for t in picked if t.shape[1] % 256 == 0]


def _off_grid(raw: RawTensor) -> np.ndarray:
    """A 4-bit file's values lie on 16 levels per block of 32, which int4 group 32 holds
    exactly and would flatter; up to half a level of noise stands in for the weight they
    were rounded from."""
    w = quants.dequantize(raw.blocks, Q[raw.qtype_name]).reshape(-1, 32)
    step = (w.max(axis=1, keepdims=True) - w.min(axis=1, keepdims=True)) / 15
    noise = np.random.default_rng(0).uniform(-0.5, 0.5, w.shape).astype(np.float32)
    return (w + noise * step).reshape(raw.shape)


def conversion_peak(qtype: Q, out: int = 14336, cols: int = 4096) -> None:
    """Run alone (the high-water mark is the process's): RSS beyond the file's blocks while
    one tensor converts, against the layer it becomes."""
    per_block, bytes_per_block = gguf.GGML_QUANT_SIZES[qtype]
    shape = (out, cols // per_block, bytes_per_block)
    blocks = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    blocks[..., :4] = np.full(2, 1e-3, np.float16).view(np.uint8)  # Q4_0/1, Q8_0, Q4_K, Q5_K: d
    blocks[..., -2:] = np.array([1e-3], np.float16).view(np.uint8)  # Q6_K: d is last
    blocks = blocks.reshape(out, -1)
    QuantizedLinear.from_gguf(RawTensor("w", qtype.name, blocks[:64], (64, cols)))  # torch's own
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    layer = QuantizedLinear.from_gguf(RawTensor("w", qtype.name, blocks, (out, cols)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    size = sum(b.numel() * b.element_size() for b in layer.buffers()) / 2**20
    print(
        f"{qtype.name} {out}x{cols}: file {blocks.nbytes / 2**20:.0f} MiB, layer "
        f"{size:.0f} MiB, peak beyond the blocks {peak / 2**10:.0f} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", help="measure accuracy on this file's weights too")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--peak", help="only the conversion peak of one tensor of this type")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.peak:
        return conversion_peak(Q[args.peak])
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{torch.backends.cpu.get_cpu_capability()}\n"
    )
    timings(args.reps)
    print("\nsynthetic Gaussian, 8 tensors of 256x1536:")
    accuracy([np.random.default_rng(s).standard_normal((256, 1536), np.float32) for s in range(8)])
    print("\nthe same with 4 columns of 8x the others (outlier input channels):")
    accuracy([_weights(256, 1536, seed) for seed in range(8)])
    if args.gguf:
        print(f"\n{args.gguf}, layers 0-7, rows of whole 256-blocks, off the 4-bit grid:")
        accuracy(gguf_weights(args.gguf))


if __name__ == "__main__":
    main()
