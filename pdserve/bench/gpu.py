"""`pdserve bench gpu`: pdserve on one CUDA GPU against the measured floor, HF transformers
and KV transfer (docs/gpu.md); `pdserve bench kernels`: each Triton kernel's GB/s."""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pdserve.bench import report as rp
from pdserve.bench.report import cuda_ms, markdown_table
from pdserve.common.node.cli import parser

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=128000,
    eos_token_id=128001,
)  # fmt: skip
BLOCK_SIZE = 16


def graph_ms(fn: Callable[[], Any], calls: int = 20) -> float:
    """Median milliseconds of one fn() inside a CUDA graph of `calls` back-to-back calls: the
    device's time, without the host's launch costs (a decode step replays graphs too)."""
    fn()  # compile, allocate
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_ms(graph.replay, iters=20) / calls


def ceilings() -> dict[str, float]:
    """Device copy bandwidth (bytes read + written) and the bf16 matmul rate, random data."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = cuda_ms(lambda: dst.copy_(src))
    copy_gb_s = 2 * n / ms / 1e6
    a, b = (torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    ms = cuda_ms(lambda: a @ b)
    return {"copy_gb_s": copy_gb_s, "matmul_tflops": 2 * 8192**3 / ms / 1e9}


def attention_case(batch: int, context: int, dtype=torch.bfloat16) -> dict[str, Any]:
    """Paged decode inputs of the 8B layout: `batch` sequences of `context` keys each."""
    hq, hkv, d = 32, 8, 128
    blocks = batch * context // BLOCK_SIZE
    k = torch.randn(blocks + 1, BLOCK_SIZE, hkv, d, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    perm = torch.randperm(blocks, device="cuda").to(torch.int32) + 1
    return {"query": torch.randn(batch, hq, d, dtype=dtype, device="cuda"), "k_cache": k,
            "v_cache": v, "block_tables": perm.view(batch, context // BLOCK_SIZE),
            "query_start_loc": torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
            "seq_lens": torch.full((batch,), context, dtype=torch.int32, device="cuda"),
            "scale": d**-0.5,
            "kv_bytes": 2 * batch * context * hkv * d * k.element_size()}  # fmt: skip


def bench_attention(copy_gb_s: float) -> list[dict[str, Any]]:
    """Decode attention GB/s: the split-K kernel at its defaults and a small tuning sweep, and
    the one-program-per-head kernel it replaced for decode steps."""
    from pdserve.kernels.paged_attention import paged_attention_triton
    from pdserve.kernels.paged_decode import paged_decode_triton
    from pdserve.kernels.reference import paged_attention_ref

    rows = []
    for batch, context in ((1, 1024), (1, 4096), (1, 16384), (32, 1024), (32, 4096), (32, 16384)):
        case = attention_case(batch, context)
        kv_bytes = case.pop("kv_bytes")
        ref = paged_attention_ref(**case).float()
        variants: dict[str, Callable[[], torch.Tensor]] = {
            "no-split": lambda c=case: paged_attention_triton(**c),
        }
        for block_n, warps in ((32, 4), (32, 8), (64, 4), (128, 8)):
            variants[f"split n{block_n} w{warps}"] = lambda bn=block_n, w=warps, c=case: (
                paged_decode_triton(**c, block_n=bn, num_warps=w)
            )
        variants["split default"] = lambda c=case: paged_decode_triton(**c)
        for name, fn in variants.items():
            err = ((fn().float() - ref).norm() / ref.norm()).item()
            ms = graph_ms(fn)
            gb_s = kv_bytes / ms / 1e6
            rows.append({"batch": batch, "context": context, "kernel": name, "ms": ms,
                         "gb_s": gb_s, "of_copy": gb_s / copy_gb_s, "rel_err": err})  # fmt: skip
    return rows


def bench_prefill_attention() -> list[dict[str, Any]]:
    """The prefill kernel on one 8k-token sequence of the 8B layout, over its tuning knobs."""
    from pdserve.kernels.paged_attention import paged_attention_triton

    rows = []
    for tokens in (1024, 8192):
        case = attention_case(1, tokens)
        case.pop("kv_bytes")
        case["query"] = torch.randn(tokens, 32, 128, dtype=torch.bfloat16, device="cuda")
        case["query_start_loc"] = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
        flops = 4 * 32 * 128 * tokens * tokens / 2  # causal: half of QK^T and PV
        configs = [(64, 32, 4), (128, 32, 4), (128, 64, 8), (None, 32, 4)]
        for prefill_rows, block_n, warps in configs:
            fn = lambda r=prefill_rows, n=block_n, w=warps, c=case: paged_attention_triton(  # noqa: E731
                **c, prefill_rows=r, block_n=n, num_warps=w
            )
            ms = cuda_ms(fn, iters=10)
            rows.append({"tokens": tokens, "rows": prefill_rows or "default", "block_n": block_n,
                         "warps": warps, "ms": ms, "tflops": flops / ms / 1e9})  # fmt: skip
    return rows


def make_llm(model_dir: Path, max_num_seqs: int, **kwargs: Any):
    """The engine on the random 8B, its decode steps compiled and captured for the batch sizes
    measured only (every power of two up to 128 would compile eight graphs of a 32-layer model)."""
    from pdserve.common.engine.compiled_decode import CompiledDecode
    from pdserve.common.engine.llm import LLM

    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", load_format="dummy",
              skip_tokenizer_init=True, block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs,
              max_model_len=16384, max_num_batched_tokens=8192, gpu_memory_utilization=0.6,
              enforce_eager=True, **kwargs)  # fmt: skip
    runner = llm.engine.runner
    width = -(-llm.engine.max_model_len // BLOCK_SIZE)
    runner.compiled = CompiledDecode(runner.model, max_num_seqs, width, buckets=(1, 8, 32, 128))
    runner.compiled.warm_up(runner.kv_caches)
    return llm


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads of the weights: all but the embedding table (a few rows)."""
    params = model.named_parameters()
    return sum(p.numel() * p.element_size() for n, p in params if "embed_tokens" not in n)


def decode_inputs(runner, batch: int, context: int):
    """A decode step of `batch` sequences with `context` cached tokens each, random K/V."""
    from pdserve.common.engine.scheduler import ScheduledSeq
    from pdserve.common.wire.payloads import SamplingParams

    per_seq = context // BLOCK_SIZE + 1
    params = SamplingParams(max_tokens=1, temperature=0.0)
    blocks = [tuple(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(batch)]
    seqs = tuple(ScheduledSeq(f"d{b}", (b + 1,), context, blocks[b], True, params)
                 for b in range(batch))  # fmt: skip
    for cache in runner.kv_caches:
        cache[:, 1 : 1 + batch * per_seq].normal_()
    return runner.prepare(seqs)


def bench_decode(llm, copy_gb_s: float, context: int) -> list[dict[str, Any]]:
    runner = llm.engine.runner
    model, arch = runner.model, runner.arch
    wbytes = weight_bytes(model)
    kv_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2
    rows = []
    for batch in (1, 8, 32, 128):
        inputs = decode_inputs(runner, batch, context)
        args = (inputs.input_ids, inputs.positions, inputs.attn, runner.kv_caches)
        eager = lambda a=args: model.compute_logits(model(*a))  # noqa: E731
        compiled = runner.compiled
        graphs, compiled.graphs = compiled.graphs, None
        with torch.inference_mode():
            ms_eager = cuda_ms(eager)
            ms_compiled = cuda_ms(lambda a=args, c=compiled: c.logits(*a))
            no_graph = compiled.logits(*args).clone()
            compiled.graphs = graphs
            ms_graph = cuda_ms(lambda a=args, c=compiled: c.logits(*a), iters=50)
            want, got = eager(), compiled.logits(*args)
        rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
        floor_ms = (wbytes + batch * (context + 1) * kv_token) / copy_gb_s / 1e6
        rows.append({
            "batch": batch, "context": context, "eager_ms": ms_eager, "compiled_ms": ms_compiled,
            "graph_ms": ms_graph, "floor_ms": floor_ms, "bw_util": floor_ms / ms_graph,
            "tokens_s": batch / ms_graph * 1e3,
            "compiled_vs_eager": rel(no_graph, want), "graph_vs_compiled": rel(got, no_graph),
        })  # fmt: skip
    return rows


def bench_prefill(llm, matmul_tflops: float) -> list[dict[str, Any]]:
    from pdserve.common.engine.scheduler import ScheduledSeq
    from pdserve.common.wire.payloads import SamplingParams

    runner = llm.engine.runner
    model, arch = runner.model, runner.arch
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    rows = []
    for tokens in (1024, 8192):
        blocks = tuple(range(1, tokens // BLOCK_SIZE + 2))
        seq = ScheduledSeq("p", tuple(range(1, tokens + 1)), 0, blocks, True,
                           SamplingParams(max_tokens=1))  # fmt: skip
        x = runner.prepare((seq,))
        step = lambda x=x: model.compute_logits(  # noqa: E731
            model(x.input_ids, x.positions, x.attn, runner.kv_caches)[x.logit_indices]
        )
        with torch.inference_mode():
            ms = cuda_ms(step, iters=5, warmup=2)
        lm_flops = 2 * (params - arch.vocab_size * arch.hidden_size) * tokens
        lm_flops += 2 * arch.vocab_size * arch.hidden_size  # the last token's logits
        attn_flops = 4 * arch.num_layers * arch.num_heads * arch.head_dim * tokens * tokens / 2
        tflops = (lm_flops + attn_flops) / ms / 1e9
        rows.append({"tokens": tokens, "ms": ms, "tflops": tflops,
                     "of_matmul": tflops / matmul_tflops,
                     "attention_share_of_flops": attn_flops / (lm_flops + attn_flops)})  # fmt: skip
    return rows


def generate_rate(generate: Callable[[list[list[int]], int], None], batch: int, prompt: int,
                  new: int) -> float:  # fmt: skip
    """Output tokens per second of generate(prompts, new tokens) on `batch` prompts of `prompt`
    tokens, prefill included, after a 4-token warm-up on two of them."""
    prompts = [[(7 * b + 3 * i) % 1000 + 1 for i in range(prompt)] for b in range(batch)]
    generate(prompts[:2], 4)
    torch.cuda.synchronize()
    start = time.perf_counter()
    generate(prompts, new)
    torch.cuda.synchronize()
    return batch * new / (time.perf_counter() - start)


def bench_engine(llm, batch: int, prompt: int, new: int) -> float:
    """The engine's generate: output tokens per second, prefill included."""
    from pdserve.common.wire.payloads import SamplingParams

    def generate(prompts: list[list[int]], n: int) -> None:
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        assert all(len(o.token_ids) == n for o in outs)

    return generate_rate(generate, batch, prompt, new)


def bench_hf(model_dir: Path, batch: int, prompt: int, new: int) -> float:
    """HF transformers generate on the same shape, random bf16 weights, sdpa attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()

    def generate(prompts: list[list[int]], n: int) -> None:
        ids = torch.tensor(prompts, device="cuda")
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)  # fmt: skip
        assert out.shape[1] == ids.shape[1] + n

    return generate_rate(generate, batch, prompt, new)  # the model goes with this frame


def bench_hf_part(report: dict[str, Any], model_dir: Path, _context: int) -> None:
    report["hf_tokens_s"] = {b: bench_hf(model_dir, b, 128, 128) for b in (1, 32)}
    print("hf", report["hf_tokens_s"], flush=True)


def kv_transfer_argv(out: Path) -> list[str]:
    """The flags of the KV part's `pdserve bench kv-transfer`: the 8B layout on the device."""
    return ["--device", "cuda", "--layouts", "llama3-8b", "--tokens", "2k,8k",
            "--max-bytes", "2G", "--repeats", "3", "--out", str(out / "kv")]  # fmt: skip


def bench_kv_transfer(out: Path) -> dict[str, Any]:
    """`pdserve bench kv-transfer` on the device, 8B layout: each connector vs its transport."""
    cmd = [sys.executable, "-m", "pdserve.bench.kv_transfer", *kv_transfer_argv(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=160)
    print(done.stdout[-3000:], done.stderr[-3000:], flush=True)
    path = out / "kv" / "kv_transfer.json"
    return json.loads(path.read_text()) if path.is_file() else {"error": done.stderr[-2000:]}


def table(rows: list[dict[str, Any]]) -> str:
    """Rows of differing keys as one table: every key a column, in first-seen order."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return markdown_table(keys, [[r.get(k, "") for k in keys] for r in rows])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser("pdserve bench gpu", __doc__.split("\n\n")[0])
    parts = "ceilings,attention,prefill-attention,model,hf,kv"
    rp.add_flags(p.add_argument_group("run"), [
        ("--parts", str, parts, "a comma list of the parts to run"),
        ("--context", int, 1024, "cached tokens per decode sequence"),
    ])  # fmt: skip
    out = ("--out", Path, None, "folder for gpu.json (and kv/ of the KV part)", {"required": True})
    rp.add_flags(p.add_argument_group("output"), [out])
    return p.parse_args(argv)


def bench_model(report: dict[str, Any], model_dir: Path, context: int) -> None:
    """The engine on the random 8B: start-up, decode and prefill steps, generate throughput."""
    ceil = report["ceilings"]
    start = time.perf_counter()
    llm = make_llm(model_dir, max_num_seqs=128)
    report["engine_start_s"] = time.perf_counter() - start
    report["compile_s"] = llm.engine.runner.compiled.compile_seconds
    report["decode"] = bench_decode(llm, ceil["copy_gb_s"], context)
    print(f"\n## decode\n{table(report['decode'])}", flush=True)
    report["prefill"] = bench_prefill(llm, ceil["matmul_tflops"])
    print(f"\n## prefill\n{table(report['prefill'])}", flush=True)
    report["engine_tokens_s"] = {b: bench_engine(llm, b, 128, 128) for b in (1, 32)}
    print("engine", report["engine_tokens_s"], flush=True)
    del llm


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("pdserve bench gpu: needs a CUDA device")
    parts = set(args.parts.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    save = lambda: (args.out / "gpu.json").write_text(json.dumps(report, indent=1))  # noqa: E731
    report["ceilings"] = ceil = ceilings()
    print(json.dumps(report), flush=True)
    sections = [("attention", lambda: bench_attention(ceil["copy_gb_s"])),
                ("prefill-attention", bench_prefill_attention)]  # fmt: skip
    for name, fn in sections:
        if name in parts:
            report[name] = fn()
            print(f"\n## {name}\n{table(report[name])}", flush=True)
            save()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(LLAMA3_8B))
        for part, run in (("hf", bench_hf_part), ("model", bench_model)):
            if part in parts:
                run(report, model_dir, args.context)
                gc.collect()
                torch.cuda.empty_cache()
                save()
    if "kv" in parts:
        report["kv_transfer"] = bench_kv_transfer(args.out)
        save()
    print(json.dumps({k: v for k, v in report.items() if not isinstance(v, list)}, indent=1))
    return 0


KERNEL_DTYPE = torch.bfloat16
NUM_KV_HEADS, HEAD_DIM = 8, 128


def kernel_result(name: str, nbytes: int, ms: float, **shape: int) -> dict:
    return {"kernel": name, **shape, "ms": ms, "gb_per_s": nbytes / ms / 1e6}


def layer_cache(num_blocks: int) -> torch.Tensor:
    shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape, dtype=KERNEL_DTYPE, device="cuda")


def kernel_store_kv(num_tokens: int) -> dict:
    from pdserve.kernels.store_kv import store_kv_triton

    layer = layer_cache(num_tokens // BLOCK_SIZE + 1)
    key, value = torch.randn(2, num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=KERNEL_DTYPE,
                             device="cuda")  # fmt: skip
    slots = torch.randperm(num_tokens, device="cuda")
    ms = cuda_ms(lambda: store_kv_triton(key, value, layer[0], layer[1], slots), iters=50)
    return kernel_result("store_kv", 2 * (key.nbytes + value.nbytes), ms, tokens=num_tokens)


def kernel_page_copy(num_pages: int) -> list[dict]:
    from pdserve.kernels.page_copy import gather_pages_triton, scatter_pages_triton

    layer = layer_cache(4 * num_pages)
    ids = torch.randperm(4 * num_pages, device="cuda")[:num_pages]
    pages = gather_pages_triton(layer, ids)
    gather_ms = cuda_ms(lambda: gather_pages_triton(layer, ids), iters=50)
    scatter_ms = cuda_ms(lambda: scatter_pages_triton(layer, ids, pages), iters=50)
    return [
        kernel_result("gather_pages", 2 * pages.nbytes, gather_ms, pages=num_pages),
        kernel_result("scatter_pages", 2 * pages.nbytes, scatter_ms, pages=num_pages),
    ]


def kernel_decode(batch: int, context: int) -> dict:
    from pdserve.kernels.paged_attention import paged_attention_triton

    case = attention_case(batch, context, KERNEL_DTYPE)
    kv_bytes = case.pop("kv_bytes")
    ms = cuda_ms(lambda: paged_attention_triton(**case), iters=50)
    return kernel_result("paged_attention_decode", kv_bytes, ms, batch=batch, context=context)


def kernels_main(argv: list[str] | None = None) -> int:
    """`pdserve bench kernels --out FILE`; without CUDA, nothing to time: exit 0."""
    p = parser("pdserve bench kernels", "Each Triton kernel's GB/s on one CUDA device, as JSON.")
    out = ("--out", str, None, "the JSON: GB/s and ms per kernel and shape",
           {"required": True, "metavar": "FILE"})  # fmt: skip
    rp.add_flags(p.add_argument_group("output"), [out])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA device to time kernels; nothing to do")
        return 0
    results = [kernel_store_kv(n) for n in (256, 4096)]
    results += [r for n in (16, 256) for r in kernel_page_copy(n)]
    results += [kernel_decode(32, ctx) for ctx in (512, 2048, 8192)]
    for r in results:
        print(json.dumps(r))
    meta = {"device": torch.cuda.get_device_name(), "dtype": str(KERNEL_DTYPE)}
    Path(args.out).write_text(json.dumps({**meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
