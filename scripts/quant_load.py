"""Load a checkpoint at one --quantization and report the peak and final RSS of loading, the
time of one prompt's prefill (--prompt-len tokens) and the decode-step time at a few batch
sizes (docs/quantization.md's tables).

    PYTHONPATH=. python scripts/quant_load.py MODEL --quantization int4 [--dtype bfloat16]

Run each mode in its own process: the peak is the process's own (VmHWM, reset before loading).
Decode steps run eager unless --compile-mode says otherwise (background would start a child
compiling the model beside the measurement). For a GGUF the figures are also given against
the file plus the KV pool (issue 36's load bound: peak <= 1.3x).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.kernels.ops import packed_numel


def _status(key: str) -> int:
    """A /proc/self/status figure in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) // 1024


def decode_step_ms(llm: LLM, batch: int, steps: int) -> tuple[float, float]:
    """The median wall and process-CPU milliseconds of one engine step with `batch` requests
    decoding (prefill excluded); CPU time is the steadier on a shared machine."""
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        llm.engine.add_request(f"b{batch}-{i}", [1, 2, 3, 4 + i], params)
    llm.engine.step()  # the prompts' prefill
    walls, cpus = [], []
    while llm.engine.has_unfinished:
        start, cpu = time.perf_counter(), time.process_time()
        llm.engine.step()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return 1000 * statistics.median(walls), 1000 * statistics.median(cpus)


def prefill_s(llm: LLM, prompt_len: int) -> float:
    """Seconds to prefill one prompt of `prompt_len` tokens (and sample its first token)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([list(range(100, 100 + prompt_len))], params)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--compile-mode", default="eager", choices=("eager", "background", "blocking"))
    p.add_argument("--max-num-seqs", type=int, default=None, help="the engine's (its buckets)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from the RSS now
    before = _status("VmRSS")
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        compile_mode=args.compile_mode,
        **({} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}),
        kv_cache_bytes=32 * 1024**2,
        skip_tokenizer_init=True,
    )
    gc.collect()
    model = llm.engine.runner.model
    tensors = [*model.parameters(), *model.buffers(), *llm.engine.runner.kv_caches]
    report = {
        "quantization": args.quantization,
        "dtype": args.dtype,
        "rss_before_mib": before,
        "load_peak_mib": _status("VmHWM") - before,
        "load_final_mib": _status("VmRSS") - before,
        "tensors_mib": sum(t.numel() * t.element_size() for t in tensors) >> 20,  # with the KV
        "packed_mib": packed_numel(model) * model.model.norm.weight.element_size() >> 20,
    }
    if args.model.endswith(".gguf"):
        kv = sum(t.numel() * t.element_size() for t in llm.engine.runner.kv_caches)
        file_and_kv = (os.path.getsize(args.model) + kv) / 2**20
        report["peak_of_file_and_kv"] = round(report["load_peak_mib"] / file_and_kv, 3)
        report["final_of_file_and_kv"] = round(report["load_final_mib"] / file_and_kv, 3)
    report["prefill_s"] = round(prefill_s(llm, args.prompt_len), 2)
    for batch in args.batches:
        wall, cpu = decode_step_ms(llm, batch, args.steps)
        report[f"decode_ms_b{batch}"] = round(wall, 2)
        report[f"decode_cpu_ms_b{batch}"] = round(cpu, 2)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
