"""The VNNI GEMM (kernels/cpu_quant_gemm.cpp) at SmolLM2's prefill shapes against this core's
vpdpbusd peak, and optionally against the kernel of another git revision in the same process
(docs/quantization.md, "The GEMM's inner loop"):

    nice -n 19 python scripts/gemm_bench.py [--rows 64 128 256 512] [--baseline REV]
        [--shapes q/o head] [--dtype bfloat16]
        [--model GGUF --prompt-tokens 512 --batch 16 --batch-tokens 96]

The peak is a loop of 12 independent zmm vpdpbusd (inline asm: an array of accumulators went
through the stack) built as its own small extension. GEMM: int4 (the Q4_1/Q4_K form the model
holds, Int4Pack) and int8 per row, one thread, this thread's CPU time, the median of --repeats;
a MAC is two ops. With --baseline the old kernel's source (git show REV:kernels/..., or a
folder with the two files) is built beside this one, each measurement alternates the two, and
`equal` says whether their outputs are the same to the bit (`max_rel` by how much they differ,
relative to the largest output). A kernel with `int4_tiled_mm` is given int4 in tile order
(Int4Tiles, docs/quantization.md, "Int4 weights in tile order"), one without it Int4Pack's
rows; likewise int8 with `int8_tiled_mm`. With --dtype bfloat16 the rows are bf16: a kernel
that reads and writes bf16 gets them as they are, an older one x.float() and its output
.to(bfloat16) inside the time, as QuantizedLinear called it (docs/quantization.md, "bf16 rows in
and out, and int8 weights in tile order"). With --model the model's prefill is timed too
(bf16, eager, one thread): one --prompt-tokens prompt, and --batch prompts of --batch-tokens
added at once, each kernel in turn (kernels.cpu_quant's module swapped, the int4 and int8
layers' form and QuantizedLinear's float32 round trip with it), then each of --decode-batches
requests' decode steps with the kernels alternating step by step.
Prints JSON lines, each with the 1-minute load average.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

from pdserve.kernels import cpu_quant

# (N, K): SmolLM2-135M's q/o, k/v, gate/up and down.
SHAPES = {"q/o": (576, 576), "k/v": (192, 576), "gate/up": (1536, 576), "down": (576, 1536)}
HEAD = {"head": (49152, 576)}  # the tied Q8_0 embedding as the LM head (--shapes head)
PEAK_SOURCE = r"""
#include <cstdint>
#define D(r) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #r "\n\t"
// `iters` rounds of 12 independent zmm vpdpbusd (64 MACs, 128 ops each), in registers.
void vnni_peak(int64_t iters) {
  for (int64_t n = 0; n < iters; ++n) {
    asm volatile(D(0) D(1) D(2) D(3) D(4) D(5) D(6) D(7) D(8) D(9) D(10) D(11) :::
                 "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",
                 "xmm9", "xmm10", "xmm11");
  }
}
"""


def load() -> float:
    return os.getloadavg()[0]


def peak_gops(iters: int = 20_000_000) -> float:
    """This core's vpdpbusd rate: 12 chains of zmm vpdpbusd, CPU time."""
    mod = cpu_quant.load_extension("vnni_peak", PEAK_SOURCE, ["vnni_peak"], [])
    mod.vnni_peak(1000)
    best = 0.0
    for _ in range(3):
        start = time.thread_time()
        mod.vnni_peak(iters)
        best = max(best, iters * 12 * 128 / (time.thread_time() - start) / 1e9)
    return best


def baseline_module(rev: str):  # noqa: ANN201 (a compiled extension module)
    """The kernel as git revision `rev` had it (or a folder holding its two files), built under
    its own name."""
    names = ("kernels/cpu_quant.cpp", "kernels/cpu_quant_gemm.cpp")
    root = os.path.dirname(os.path.dirname(os.path.abspath(cpu_quant.__file__)))
    if os.path.isdir(rev):
        folder = [os.path.join(rev, os.path.basename(n)) for n in names]
        show = [open(path, encoding="utf-8").read() for path in folder]
    else:
        git = ["git", "show"]
        show = [subprocess.check_output([*git, f"{rev}:{n}"], cwd=root, text=True) for n in names]
    source = "\n".join(show)
    names = [f for f in cpu_quant._FUNCTIONS if f"torch::Tensor {f}(" in source]
    return cpu_quant.load_extension("cpu_quant", source, names, ["-mavx2", "-mfma"])


def weights(n: int, k: int) -> dict[str, tuple]:
    """The int4 pack and the int8 weight (values, scales) of a random [n, k] weight: int4 as
    Int4Pack's fields, and (`int4_tiled`, `int8_tiled`) in tile order."""
    torch.manual_seed(n * 7 + k)
    values = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = torch.rand(n, k // 32) / 16
    zeros = torch.randn(n, k // 32) / 8
    pack = cpu_quant.pack_int4(values, scales, zeros, 32)
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scales8 = torch.rand(n) / 64
    return {
        "int4": (pack.nibbles, pack.scales, pack.mins),
        "int4_tiled": (*dataclasses.astuple(cpu_quant.tile_int4(pack)),),
        "int8": (q8, scales8),
        "int8_tiled": (cpu_quant.tile_int8(q8), scales8, n),
    }


@functools.cache
def takes_bf16(mod: object) -> bool:
    """Whether a kernel's VNNI path reads and writes bf16 rows (else float32 only)."""
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    try:
        mod.int8_mm(x, torch.zeros(16, 32, dtype=torch.int8), torch.ones(16), True)
    except RuntimeError:
        return False
    return True


def call(mod: object, kind: str, x: torch.Tensor, args: tuple) -> Callable[[], torch.Tensor]:
    """The module's kernel for `kind` on x (args: the weight in the form `form` names): in tile
    order where the module has `{kind}_tiled_mm`; bf16 rows through float32 for a module that
    takes float32 only."""
    tiled = getattr(mod, f"{kind}_tiled_mm", None)
    kernel = getattr(mod, f"{kind}_mm")

    def fn(x: torch.Tensor) -> torch.Tensor:
        return tiled(x, *args) if tiled else kernel(x, *args, True)

    if x.dtype == torch.bfloat16 and not takes_bf16(mod):
        return lambda: fn(x.float()).to(torch.bfloat16)
    return lambda: fn(x)


def form(mod: object, kind: str) -> str:
    """The weight form `call` gives a module's kernel for `kind`."""
    return f"{kind}_tiled" if hasattr(mod, f"{kind}_tiled_mm") else kind


def cpu_ms(fn: Callable[[], object], calls: int) -> float:
    start = time.thread_time()
    for _ in range(calls):
        fn()
    return 1000 * (time.thread_time() - start) / calls


def gemm_ab(mods: dict[str, object], args: argparse.Namespace, peak: float) -> None:
    """Each shape, kind and row count: every module's ms a call, alternating, median of repeats."""
    dtype = getattr(torch, args.dtype)
    for name in args.shapes:
        n, k = {**SHAPES, **HEAD}[name]
        w = weights(n, k)
        for m in args.rows:
            x = torch.randn(m, k).to(dtype)
            for kind in args.kinds:
                calls = max(3, int(2e8 / (m * n * k)))
                fns = {label: call(mod, kind, x, w[form(mod, kind)]) for label, mod in mods.items()}
                times: dict[str, list[float]] = {label: [] for label in fns}
                for fn in fns.values():
                    fn()
                for _ in range(args.repeats):
                    for label, fn in fns.items():
                        times[label].append(cpu_ms(fn, calls))
                row = {"shape": name, "N": n, "K": k, "rows": m, "kind": kind, "dtype": args.dtype}
                row["load"] = load()
                outs = [fn() for fn in fns.values()]
                row["equal"] = all(torch.equal(outs[0], out) for out in outs[1:])
                top = outs[0].float().abs().max().item()
                row["max_rel"] = max(
                    [(o - outs[0]).float().abs().max().item() / top for o in outs[1:]] + [0]
                )
                for label, ts in times.items():
                    ms = statistics.median(ts)
                    gops = 2 * m * n * k / ms / 1e6
                    share = round(gops / peak, 3)
                    row[label] = {"ms": round(ms, 3), "gops": round(gops, 1), "of_peak": share}
                print(json.dumps(row), flush=True)


def prefill_ab(mods: dict[str, object], args: argparse.Namespace) -> None:
    """The model's prefill with each kernel in turn: CPU ms of engine steps to the first tokens."""
    from pdserve import LLM, SamplingParams

    llm = LLM(args.model, dtype="bfloat16", kv_cache_bytes=256 * 1024**2,
              skip_tokenizer_init=True, enforce_eager=True)  # fmt: skip
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    loads = {"prompt": [(args.prompt_tokens, 1)], "batch": [(args.batch_tokens, args.batch)]}
    seed = 0

    def run(load_: list[tuple[int, int]]) -> float:
        nonlocal seed
        for tokens, count in load_:
            for _ in range(count):
                seed += 1
                prompt = [(seed * 7919 + j * 31) % 40000 + 100 for j in range(tokens)]
                llm.engine.add_request(f"p{seed}", prompt, params)
        start = time.thread_time()
        while llm.engine.has_unfinished:
            llm.engine.step()
        return 1000 * (time.thread_time() - start)

    original = cpu_quant._module
    try:
        for label, load_ in loads.items():
            times: dict[str, list[float]] = {m: [] for m in mods}
            for i in range(args.prefill_repeats + 1):
                for mlabel, mod in mods.items():
                    use(llm, mod)
                    ms = run(load_)
                    if i:  # the first round warms up
                        times[mlabel].append(ms)
            out = {"prefill": label, "load": load()}
            out.update({m: {"cpu_ms": round(statistics.median(t), 1), "all": [round(v) for v in t]}
                        for m, t in times.items()})  # fmt: skip
            print(json.dumps(out), flush=True)
        for batch in args.decode_batches:
            decode_ab(mods, llm, batch, args.decode_steps)
    finally:
        cpu_quant._module = original
        if hasattr(use, "gemv"):
            from pdserve.common.model.quant import QuantizedLinear

            QuantizedLinear._gemv = use.gemv


def _float32_gemv(layer: object, x: torch.Tensor) -> torch.Tensor:
    """QuantizedLinear._gemv before the kernel took bf16: the rows through float32."""
    return layer._gemv_rows(x.float()).to(x.dtype)


def use(llm: object, mod: object) -> None:
    """`mod` as the kernel, the model's int4 and int8 VNNI layers in the form it reads (tiles
    where it has int4_tiled_mm or int8_tiled_mm, else rows; converted outside the time
    measured), and bf16 rows passed through float32 where it takes float32 only."""
    from pdserve.common.model.quant import QuantizedLinear

    cpu_quant._module = lambda: mod
    for layer in llm.engine.runner.model.modules():
        if isinstance(layer, QuantizedLinear) and layer.bits == 8 and layer.vnni:
            int8_form(layer, hasattr(mod, "int8_tiled_mm"))
    if not hasattr(use, "gemv"):
        use.gemv = QuantizedLinear._gemv  # type: ignore[attr-defined]
    QuantizedLinear._gemv = use.gemv if takes_bf16(mod) else _float32_gemv  # type: ignore
    tiled = hasattr(mod, "int4_tiled_mm")
    for layer in llm.engine.runner.model.modules():
        if not isinstance(layer, QuantizedLinear) or layer.bits != 4 or not layer.vnni:
            continue
        if layer.tiled == tiled:
            continue
        pack = layer._pack()
        pack = cpu_quant.tile_int4(pack) if tiled else cpu_quant.untile_int4(pack)
        layer.qweight, layer.scales, layer.mins = pack.nibbles, pack.scales, pack.mins
        layer.tiled = tiled


def int8_form(layer: object, tiled: bool) -> None:
    """An int8 VNNI layer's weight in tile order or in rows (the one copy converted)."""
    if layer.tiled == tiled or layer.in_features % cpu_quant.BLOCK:
        return
    values = layer.qweight
    if tiled:
        layer.qweight = cpu_quant.tile_int8(values)
    else:
        layer.qweight = cpu_quant.untile_int8(values, 0, layer.out_features)
    layer.tiled = tiled


def decode_ab(mods: dict[str, object], llm: object, batch: int, steps: int) -> None:
    """Batch-`batch` decode steps, the kernels alternating step by step: CPU ms of a step."""
    from pdserve import SamplingParams

    params = SamplingParams(max_tokens=steps * len(mods) + 4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [(i * 7919 + j * 31) % 40000 + 100 for j in range(32)]
        llm.engine.add_request(f"d{i}", prompt, params)
    for _ in range(2):  # the prompts' prefill, then a first decode step
        llm.engine.step()
    times: dict[str, list[float]] = {m: [] for m in mods}
    for _ in range(steps):
        for label, mod in mods.items():
            use(llm, mod)
            start = time.thread_time()
            llm.engine.step()
            times[label].append(1000 * (time.thread_time() - start))
    out = {"decode_batch": batch, "steps": steps, "load": load()}
    out.update({m: {"cpu_ms": round(statistics.median(t), 2)} for m, t in times.items()})
    print(json.dumps(out), flush=True)
    while llm.engine.has_unfinished:
        llm.engine.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=[*SHAPES, *HEAD])
    p.add_argument("--kinds", nargs="+", default=["int4", "int8"], choices=["int4", "int8"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--baseline", help="a git revision (or folder) whose kernel is timed beside")
    p.add_argument("--no-gemm", action="store_true", help="skip the per-shape GEMM timings")
    p.add_argument("--model", help="a GGUF or HF folder: time its prefill too")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--batch-tokens", type=int, default=96)
    p.add_argument("--prefill-repeats", type=int, default=3)
    p.add_argument("--decode-steps", type=int, default=30, help="per kernel and batch")
    p.add_argument("--decode-batches", type=int, nargs="+", default=[16])
    args = p.parse_args()
    torch.set_num_threads(1)
    mods = {"now": cpu_quant._module()}
    if args.baseline:
        mods = {"base": baseline_module(args.baseline), **mods}
    peak = peak_gops()
    print(json.dumps({"vnni_peak_gops": round(peak, 1), "load": load()}), flush=True)
    if not args.no_gemm:
        gemm_ab(mods, args, peak)
    if args.model:
        prefill_ab(mods, args)


if __name__ == "__main__":
    main()
