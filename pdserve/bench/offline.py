"""`pdserve bench offline`: pdserve's `LLM` against HF `generate` and the machine's floors, on
the engine sweep `bench compile` also runs; `pdserve bench structured`: a grammar's cost per
decode step. Definitions: docs/benchmarks.md."""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.bench import report as rp
from pdserve.common.engine import model_runner
from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.common.model.config import ModelArchConfig
from pdserve.common.node.cli import parser
from pdserve.common.wire.payloads import StructuredOutputsParams
from pdserve.kernels.ops import packed_numel

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

SWEEP_DEFAULTS = {"repeats": (3, 1), "copy_mib": (512, 64)}  # every sweep's, (full, quick)
SWEEP_HELP = {  # the sweep's flags; {means} and {least} come from its Sweep
    "batch_sizes": "{means}, a comma list",
    "prompt_len": "tokens per prompt",
    "max_tokens": "new tokens each, >= {least}",
    "repeats": "timed runs per batch size, the median kept",
    "copy_mib": "MiB of the copy-bandwidth probe",
}
Runs = dict[str, list[dict[str, Any]]]  # engine name -> its timed runs of one batch
Columns = list[tuple[str, Any]]  # a table's (header, key or function of a result row)


@dataclass(frozen=True, slots=True)
class Sweep:
    """An engine sweep's command and the defaults of its flags, each (full run, --quick)."""

    name: str  # `pdserve bench NAME`; also the section, NAME.json and NAME.png
    quick_help: str
    model_help: str
    defaults: dict[str, tuple[Any, Any]]  # batch_sizes (a comma list), prompt_len, max_tokens
    min_tokens: int
    threads: int
    batch_means: str = "sequences per generate call"


def sweep_parser(sweep: Sweep, doc: str) -> argparse.ArgumentParser:
    """The sweep's flags in the groups run, device and output."""
    p = parser(f"pdserve bench {sweep.name}", doc.split("\n\n")[0])
    run = [("--quick", bool, None, f"{sweep.quick_help} (needs --out)")]
    for key, (full, quick) in (sweep.defaults | SWEEP_DEFAULTS).items():
        kind = str if key == "batch_sizes" else int
        flag = "--" + key.replace("_", "-")
        text = SWEEP_HELP[key].format(means=sweep.batch_means, least=sweep.min_tokens)
        run.append((flag, kind, None, f"{text} (default: {full}; quick: {quick})"))
    run.append(("--model", str, None, sweep.model_help, {"metavar": "DIR"}))
    threads = "torch threads; 0 keeps torch's own (every core), 1 is steadier on a shared machine"
    device = [
        ("--device", str, "cpu", "cpu or cuda[:N]"),
        ("--dtype", str, "float32", "weights and activations", {"choices": sorted(DTYPES)}),
        ("--threads", int, sweep.threads, threads),
    ]
    rp.add_flags(p.add_argument_group("run"), run)
    rp.add_flags(p.add_argument_group("device"), device)
    rp.add_output_flags(p, f"{sweep.name}.json and {sweep.name}.png", "NAME.json")
    return p


def parse_sweep(
    p: argparse.ArgumentParser, sweep: Sweep, argv: Sequence[str] | None
) -> argparse.Namespace:
    """The flags with their full or quick defaults filled in, checked."""
    args = p.parse_args(argv)
    args.outputs = rp.outputs_from_args(p, args)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    for key, defaults in (sweep.defaults | SWEEP_DEFAULTS).items():
        setattr(args, key, getattr(args, key) or defaults[int(args.quick)])
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if min(args.batch_sizes) < 1 or args.prompt_len < 1 or args.max_tokens < sweep.min_tokens:
        p.error(f"batch sizes and --prompt-len must be >= 1, --max-tokens >= {sweep.min_tokens}")
    return args


def model_dir(args: argparse.Namespace, full: Callable[[], Path]) -> Path:
    """--model, else the tiny random Llama (--quick, built once into the cache), else full()."""
    if args.model:
        return Path(args.model)
    if args.quick:
        return rp.cached_model(Path(args.cache_dir), "llama-tiny", {})
    return full()


def make_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    # ids 0..4 are the tiny tokenizer's special tokens; keep prompts to ordinary ones
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(length)] for _ in range(batch)]


class Pdserve:
    """LLM with its engine steps timed (an instance attribute wraps `engine.step`); a call
    runs prompts greedy to exactly --max-tokens new tokens."""

    def __init__(self, path: Path, args: argparse.Namespace, enforce_eager: bool | None = None):
        batch = max(args.batch_sizes)
        tokens = batch * (args.prompt_len + args.max_tokens)
        kv_bytes = 2 * tokens * kv_bytes_per_token(ModelArchConfig.from_dir(path))
        self.llm = LLM(str(path), max_num_batched_tokens=max(batch * args.prompt_len, 16),
                       max_num_seqs=batch, enable_prefix_caching=False, device=args.device,
                       dtype=args.dtype, kv_cache_bytes=max(256 << 20, kv_bytes),
                       skip_tokenizer_init=True, enforce_eager=enforce_eager)  # fmt: skip
        self.runner = self.llm.engine.runner
        self.max_tokens, self.device = args.max_tokens, args.device
        self.steps: list[float] = []
        self.inside: list[tuple[float, float]] = []  # per step: CPU s, MoE experts' s (or nan)
        calls = time_experts(self.runner.model, self.device)
        inner = timing(self.llm.engine.step, self.steps, self.device)

        def timed_step() -> Any:
            n, cpu, out = len(calls or ()), time.process_time(), inner()
            experts = sum(calls[n:]) if calls is not None else float("nan")
            self.inside.append((time.process_time() - cpu, experts))
            return out

        self.llm.engine.step = timed_step

    def __call__(self, prompts: list[list[int]]) -> dict[str, Any]:
        params = SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)
        self.steps[:], self.inside[:] = [], []  # in place: `timing` holds self.steps
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params)
        rp.sync(self.device)
        step = statistics.median(self.steps[1:] or [float("nan")])
        cpu, share = zip(*[(c, e / s) for (c, e), s in zip(self.inside, self.steps)])
        decode = statistics.median(share[1:]) if self.runner.compiled is None else float("nan")
        return {"wall_s": time.perf_counter() - t0, "prefill_s": self.steps[0],
                "prefill_experts_share": share[0], "decode_experts_share": decode,
                "decode_step_s": step, "decode_step_cpu_s": statistics.median(cpu[1:]),
                "steps": len(self.steps), "tokens": [o.token_ids for o in outs]}  # fmt: skip


def timing(fn: Callable, seconds: list[float], device: str = "cpu") -> Callable:
    """`fn` timing each call into `seconds`, the device synced around it; bare when compiled."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        rp.sync(device)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            rp.sync(device)
            seconds.append(time.perf_counter() - start)

    return timed


def time_experts(model: torch.nn.Module, device: str) -> list[float] | None:
    """Each MoE expert block timed into the list returned (None: dense); CUDA: the fused kernel."""
    from pdserve.common.model.moe import Experts

    calls: list[float] = []
    for block in (blocks := [m for m in model.modules() if isinstance(m, Experts)]):
        block.forward = timing(block.forward, calls, device)
    return calls if blocks else None


def take_turns(engines: dict[str, Callable], prompts: list[list[int]], repeats: int) -> Runs:
    """One untimed warm-up each, then `repeats` runs with the engines taking turns, so a change
    in the machine's other load falls on all of them alike."""
    for engine in engines.values():
        engine(prompts)
    runs: Runs = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            runs[name].append(engine(prompts))
    return runs


def sweep_batches(args: argparse.Namespace, engines: dict[str, Callable], vocab: int,
                  row: Callable[[int, Runs], dict[str, Any]], columns: Columns
) -> list[dict[str, Any]]:  # fmt: skip
    """row(batch, runs) for each batch size, B random prompts the same for every engine; each
    row printed as it comes, in the section table's `columns`."""
    rows = []
    for batch in args.batch_sizes:
        prompts = make_prompts(batch, args.prompt_len, vocab, seed=batch)
        rows.append(row(batch, take_turns(engines, prompts, args.repeats)))
        print(rp.record_line(columns, rows[-1]), flush=True)
    return rows


def sweep_fields(args: argparse.Namespace, path: Path, pd: Pdserve) -> dict[str, Any]:
    """What every sweep records of its setup."""
    arch, model = pd.runner.arch, pd.runner.model
    description = (
        f"{arch.architecture} {arch.num_layers} layers, hidden {arch.hidden_size}, "
        f"{arch.num_heads} heads / {arch.num_kv_heads} KV heads, MLP {arch.intermediate_size}, "
        f"vocab {arch.vocab_size}"
    )
    e, width, top = arch.num_experts, arch.moe_intermediate_size, arch.num_experts_per_tok
    description += f"; {e} experts of {width}, top {top}" if e else ""  # MLP: the dense layers'
    keys = ("device", "dtype", "prompt_len", "max_tokens", "repeats")
    params = sum(p.numel() for p in model.parameters()) + packed_numel(model)
    model_fields = {"dir": str(path), "description": description, "params": params}
    return {**{k: getattr(args, k) for k in keys}, "model": model_fields}


def compare_tokens(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    same = [a == b for a, b in zip(ours, theirs)]
    first = same.index(False) if False in same else None
    mismatch = first if first is None else {"sequence": first, "pdserve": ours[first],
                                            "hf": theirs[first]}  # fmt: skip
    return {"tokens_equal": all(same) and len(ours) == len(theirs),
            "matching_sequences": sum(same), "first_mismatch": mismatch}  # fmt: skip


def model_line(report: dict[str, Any]) -> str:
    m, n = report["model"], report["prompt_len"]
    return (f"Model: {m['description']} ({m['params'] / 1e6:.1f} M parameters); prompts of {n} "
            f"random tokens, {report['max_tokens']} greedy new tokens each.")  # fmt: skip


def copy_bandwidth(nbytes: int, dtype: torch.dtype, device: str) -> float:
    """Bytes per second read plus written by a large `copy_`."""
    src = torch.ones(nbytes // dtype.itemsize, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / rp.best_time(lambda: dst.copy_(src), device)


def gemm_flops(m: int, k: int, n: int, dtype: torch.dtype, device: str) -> float:
    """FLOP/s of one [m, k] @ [k, n] matmul."""
    a, b = (torch.randn(shape, device=device).to(dtype) for shape in ((m, k), (k, n)))
    return 2 * m * k * n / rp.best_time(lambda: a @ b, device, repeats=7)


def kv_bytes_per_token(arch: Any, itemsize: int = 4) -> int:
    return arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * itemsize


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameter bytes, embedding table bytes)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += 4 * packed_numel(model)  # a float32 head packed for oneDNN
    embed = model.model.embed_tokens.weight
    return total, embed.numel() * embed.element_size()


def decode_bytes(arch: Any, weights: tuple[int, int], batch: int, context: float, item: int):
    """Bytes one decode step of `batch` sequences must read at mean context `context`."""
    total, embed = weights
    row = embed // arch.vocab_size
    read_weights = total if arch.tie_word_embeddings else total - embed + batch * row
    return read_weights + batch * context * kv_bytes_per_token(arch, item)


def floors_at(batch: int, pd: Pdserve, args: argparse.Namespace, copy_bw: float) -> dict:
    """Floor times of one prefill and one decode step at `batch`: FLOPs are 2 x the parameters
    every token multiplies by (not the embedding table or lm_head), attention and the last
    rows' logits; matmul rates are measured at each phase's own shape (tokens x hidden -> MLP)."""
    arch, (total, embed) = pd.runner.arch, weight_bytes(pd.runner.model)
    item, dtype = DTYPES[args.dtype].itemsize, DTYPES[args.dtype]
    context = args.prompt_len + args.max_tokens / 2
    dense = 2 * (total - embed - (0 if arch.tie_word_embeddings else embed)) / item
    logits = 2 * batch * arch.hidden_size * arch.vocab_size
    attention = 2 * batch * arch.num_heads * arch.head_dim * arch.num_layers  # x keys x queries
    step_flops = dense * batch + 2 * attention * context + logits
    flops = dense * batch * args.prompt_len + attention * args.prompt_len**2 + logits
    rate = lambda m: gemm_flops(m, arch.hidden_size, arch.intermediate_size, dtype, args.device)  # noqa: E731
    prefill_rate, decode_rate = rate(batch * args.prompt_len), rate(batch)
    step_bytes = decode_bytes(arch, (total, embed), batch, context, item)
    decode = {"bytes_per_step": step_bytes, "floor_s": step_bytes / copy_bw, "flops": step_flops,
              "gemm_flop_s": decode_rate, "compute_floor_s": step_flops / decode_rate}  # fmt: skip
    prefill = {"flops": flops, "gemm_flop_s": prefill_rate, "floor_s": flops / prefill_rate}
    return {"decode": decode, "prefill": prefill}


class HF:
    """transformers AutoModelForCausalLM, greedy, EOS off, no padding (equal-length rows)."""

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        from transformers import AutoModelForCausalLM

        dtype = DTYPES[args.dtype]
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
        self.model.generation_config.eos_token_id = None
        self.max_tokens, self.device = args.max_tokens, args.device

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
        from transformers import GenerationConfig

        config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        ids = torch.tensor(prompts, device=self.device)
        rp.sync(self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            mask = torch.ones_like(ids)
            out = self.model.generate(ids, attention_mask=mask, generation_config=config)
        rp.sync(self.device)
        return time.perf_counter() - t0, out[:, ids.shape[1] :].tolist()

    def __call__(self, prompts: list[list[int]]) -> dict[str, Any]:
        prefill, _ = self.generate(prompts, 1)
        wall, tokens = self.generate(prompts, self.max_tokens)
        step = (wall - prefill) / max(self.max_tokens - 1, 1)
        return {"wall_s": wall, "prefill_s": prefill, "decode_step_s": step, "tokens": tokens}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k, v in runs[0].items() if isinstance(v, float)]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def offline_row(
    batch: int, runs: Runs, pd: Pdserve, args: argparse.Namespace, copy_bw: float
) -> dict[str, Any]:
    ours, theirs = median_run(runs["pdserve"]), median_run(runs["hf"])
    for side in (ours, theirs):
        side["tokens_per_s"] = batch * args.max_tokens / side["wall_s"]
    floor = floors_at(batch, pd, args, copy_bw)
    decode, prefill = floor["decode"], floor["prefill"]
    roofline = max(decode["floor_s"], decode["compute_floor_s"])
    for name, side in (("pdserve", ours), ("hf", theirs)):
        decode |= {name: decode["floor_s"] / side["decode_step_s"],
                   f"{name}_roofline": roofline / side["decode_step_s"]}  # fmt: skip
        prefill[name] = prefill["floor_s"] / side["prefill_s"]
    return {"batch": batch, "pdserve": ours, "hf": theirs, "steps": runs["pdserve"][0]["steps"],
            "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
            **compare_tokens(runs["pdserve"][0]["tokens"], runs["hf"][0]["tokens"]),
            "decode_floor": decode, "prefill_floor": prefill}  # fmt: skip


def measure(args: argparse.Namespace) -> dict[str, Any]:
    name = "llama-" + "-".join(map(str, rp.BENCH_MODEL_SIZES.values()))
    full = lambda: rp.cached_model(Path(args.cache_dir), name, rp.BENCH_MODEL_SIZES)  # noqa: E731
    path = model_dir(args, full)
    copy_bw = copy_bandwidth(args.copy_mib << 20, DTYPES[args.dtype], args.device)
    pd = Pdserve(path, args)
    engines = {"pdserve": pd, "hf": HF(path, args)}
    row = lambda batch, runs: offline_row(batch, runs, pd, args, copy_bw)  # noqa: E731
    results = sweep_batches(args, engines, pd.runner.arch.vocab_size, row, COLUMNS)
    fields = sweep_fields(args, path, pd)
    return {**fields, "floors": {"copy_bytes_per_s": copy_bw}, "results": results}


def goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    rs = report["results"]
    same, every = sum(r["matching_sequences"] for r in rs), sum(r["batch"] for r in rs)
    speed = [rp.goal(f"pdserve tokens/s >= HF's, batch {r['batch']}", r["pdserve"]["tokens_per_s"],
                  r["hf"]["tokens_per_s"], ">=", 1.0) for r in rs]  # fmt: skip
    return [rp.goal("every sequence's tokens equal HF's", same, every, ">=", 1.0), *speed]


def both(key: str, value: Callable[[dict, str], float], form: str = ".2f") -> tuple[str, Any]:
    """A column of pdserve's value with HF's in brackets."""
    return (f"{key} (HF)", lambda r: f"{value(r, 'pdserve'):{form}} ({value(r, 'hf'):{form}})")


COLUMNS: Columns = [
    ("batch", "batch"),
    ("pdserve tok/s", lambda r: r["pdserve"]["tokens_per_s"]),
    ("HF tok/s", lambda r: r["hf"]["tokens_per_s"]),
    ("pdserve / HF", "ratio"),
    ("tokens equal", lambda r: f"{r['matching_sequences']}/{r['batch']}"),
    both("prefill s", lambda r, side: r[side]["prefill_s"], ".3g"),
    both("prefill vs compute floor", lambda r, side: r["prefill_floor"][side]),
    both("decode step ms", lambda r, side: r[side]["decode_step_s"] * 1e3, ".3g"),
    both("decode vs bandwidth floor", lambda r, side: r["decode_floor"][side]),
    both("decode vs roofline", lambda r, side: r["decode_floor"][f"{side}_roofline"]),
]


def section(report: dict[str, Any], figure: str) -> str:
    """The benchmarks.md section; `figure` is the plot's path as the page links it."""
    copy_gb_s = report["floors"]["copy_bytes_per_s"] / 1e9
    return "\n".join([
        "## Offline throughput: `LLM.generate` against HF `generate`", "",
        *rp.run_header(report), model_line(report), "",
        rp.records_table(COLUMNS, report["results"]), "", f"![offline throughput]({figure})", "",
        f"Copy bandwidth measured in the same run: {copy_gb_s:.1f} GB/s (read + write).", "",
        rp.goals_table(goals(report)),
    ])  # fmt: skip


def plot(report: dict[str, Any], path: Path) -> Path:
    rs = report["results"]
    x = [r["batch"] for r in rs]
    left = rp.Panel("offline throughput", "batch size", "new tokens / s", xlog=2, xticks=x)
    left.lines = [(name, x, [r[side]["tokens_per_s"] for r in rs], style) for name, side, style
                  in (("pdserve LLM", "pdserve", "o-"), ("HF generate", "hf", "s--"))]  # fmt: skip
    right = rp.Panel("against bandwidth (decode) and matmul (prefill) floors", "batch size",
                  "floor time / measured time", xlog=2, xticks=x, hline=1.0)  # fmt: skip
    for key, label, mark in (("decode_floor", "decode step", "o"),
                             ("prefill_floor", "prefill", "^")):  # fmt: skip
        right.lines.append((f"pdserve {label}", x, [r[key]["pdserve"] for r in rs], mark + "-"))
        right.lines.append((f"HF {label}", x, [r[key]["hf"] for r in rs], mark + "--"))
    return rp.plot_lines([left, right], path, report["model"]["description"])


SWEEP = Sweep(
    "offline", "tiny model, batch 1 and 2, 16-token prompts, 8 new tokens, 1 repeat: seconds",
    "an HF checkpoint directory (default: the random-weight benchmark Llama)",
    {"batch_sizes": ("1,4,16", "1,2"), "prompt_len": (128, 16), "max_tokens": (64, 8)}, 2, 1,
)  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = sweep_parser(SWEEP, __doc__)
    text = f"{rp.CACHE_DIR_FLAG[3]} (default: {rp.CACHE_DIR_FLAG[2]}; quick: OUT/models)"
    flag = ("--cache-dir", Path, None, text, {"metavar": "DIR"})
    rp.add_flags(p.add_argument_group("model"), [flag])
    args = parse_sweep(p, SWEEP, argv)
    quick_dir = args.outputs.folder / "models"
    args.cache_dir = args.cache_dir or (quick_dir if args.quick else rp.CACHE_DIR_FLAG[2])
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    write = lambda report, to: rp.publish("offline", report, to, plot, section)  # noqa: E731
    return rp.bench_main(argv, parse_args, "offline", measure, write)


SCHEMA = {"type": "object", "required": ["name", "age", "favorite_color", "hobbies", "address"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "favorite_color": {"enum": ["red", "green", "blue"]},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                     "maxItems": 3},
                         "address": {"type": "object", "required": ["city"], "properties": {
                             "city": {"type": "string", "maxLength": 40}}}}}  # fmt: skip
GRAMMAR_MODES = ("plain", "first", "worker")  # no grammar; mask filled first; on a worker


@contextmanager
def fill_timer() -> Iterator[list[float]]:
    """The runner's mask fill wrapped to time it: yields the seconds of each fill."""
    fill, seconds = model_runner.fill_bitmask, []
    model_runner.fill_bitmask = timing(fill, seconds)
    try:
        yield seconds
    finally:
        model_runner.fill_bitmask = fill


def chat_prompts(llm: LLM, batch: int) -> list[list[int]]:
    tok = llm.tokenizer
    chats = [[{"role": "user", "content": f"Invent person number {i} and describe them in JSON."}]
             for i in range(batch)]  # fmt: skip
    return [tok(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)).input_ids
            for c in chats]  # fmt: skip


def grammar_steps(llm: LLM, prompts: list[list[int]], steps: int, mode: str) -> dict[str, float]:
    """The median of `steps` decode steps of the batch in `mode`, and the worker's fill time per
    step (s); prefill steps untimed."""
    so = StructuredOutputsParams(json=SCHEMA) if mode != "plain" else None
    # Long enough that no request ends within the timed steps, constrained or not.
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True,
                            structured_outputs=so)  # fmt: skip
    engine, default = llm.engine, llm.engine.runner.overlap_masks
    engine.runner.overlap_masks = mode == "worker"
    for i, ids in enumerate(prompts):
        engine.add_request(f"bench-{mode}-{len(prompts)}-{i}", ids, params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()  # prefill (and the first token) of every request
    times = []
    with fill_timer() as fills:
        for _ in range(steps):
            start = time.perf_counter()
            updates = engine.step()
            times.append(time.perf_counter() - start)
            assert len(updates) == len(prompts), "a request ended inside the timed steps"
    while engine.has_unfinished:
        engine.step()
    engine.runner.overlap_masks = default
    return {"step_s": statistics.median(times), "fill_s": sum(fills) / max(len(fills), 1)}


def grammar_row(batch: int, runs: Runs) -> dict[str, Any]:
    """The best run of each mode (the modes took turns, so drifts hit each alike)."""
    best = {m: min(r["step_s"] for r in runs[m]) for m in GRAMMAR_MODES}
    fill = min(r["fill_s"] for m in GRAMMAR_MODES[1:] for r in runs[m])
    row = {"batch": batch, "step_ms": best["plain"] * 1e3, "fill_ms": fill * 1e3}
    for mode in GRAMMAR_MODES[1:]:
        t = best[mode]
        row.update({f"{mode}_ms": t * 1e3, f"{mode}_overhead_ms": (t - best["plain"]) * 1e3,
                    f"{mode}_share": (t - best["plain"]) / t})  # fmt: skip
    return row


def _ms_and_share(mode: str) -> Any:
    return lambda r: f"{r[f'{mode}_overhead_ms']:.1f} ms ({r[f'{mode}_share']:.1%})"


GRAMMAR_COLUMNS: Columns = [
    ("batch", "batch"),
    ("no grammar (ms)", lambda r: f"{r['step_ms']:.1f}"),
    ("mask filled first (ms)", lambda r: f"{r['first_ms']:.1f}"),
    ("overhead", _ms_and_share("first")),
    ("mask on a worker beside the forward (ms)", lambda r: f"{r['worker_ms']:.1f}"),
    ("overhead", _ms_and_share("worker")),
    ("fill alone (share of the step)",
     lambda r: f"{r['fill_ms']:.2f} ms ({r['fill_ms'] / r['step_ms']:.1%})"),
]  # fmt: skip
GRAMMAR_FLAGS = [
    ("--model", str, None, "checkpoint (default: SmolLM2-135M-Instruct)"),
    ("--batches", int, [1, 32], "decode batch sizes", {"nargs": "+"}),
    ("--steps", int, 24, "timed decode steps per batch"),
    ("--repeats", int, 3, "alternated runs; the best counts"),
]


def structured_main(argv: list[str] | None = None) -> None:
    from pdserve.models import smollm2

    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser("pdserve bench structured", "A grammar's cost per decode step on one engine.")
    rp.add_flags(p.add_argument_group("run"), GRAMMAR_FLAGS)
    rp.add_output_flags(p, "structured.json")
    args = p.parse_args(argv)
    to = rp.outputs_from_args(p, args)
    llm = LLM(args.model or str(smollm2()), max_num_seqs=max(args.batches),
              max_num_batched_tokens=2048)  # fmt: skip
    grammar_steps(llm, chat_prompts(llm, 1), 4, "first")  # compile the schema, scan the vocab
    rows = []
    for batch in args.batches:
        engines = {m: lambda ps, m=m: grammar_steps(llm, ps, args.steps, m) for m in GRAMMAR_MODES}
        rows.append(grammar_row(batch, take_turns(engines, chat_prompts(llm, batch), args.repeats)))
    text = rp.records_table(GRAMMAR_COLUMNS, rows)
    print(text)
    rp.save_json(to.folder / "structured.json", {"machine": rp.machine(), "rows": rows})
    setup = (f"{rp.describe_machine(rp.machine())}. SmolLM2-135M-Instruct (float32), greedy, a "
             "JSON schema with nested objects, an enum, bounded strings and a list; the best of "
             f"{args.repeats} alternated runs of the median of {args.steps} decode steps, every "
             "column from the same run.")  # fmt: skip
    title = "## Structured outputs: the grammar mask per decode step"
    command = f"Command: `{shlex.join(['pdserve', 'bench', 'structured', *argv])}`"
    body = "\n\n".join([title, command, setup, text])
    print(f"wrote {rp.write_section('structured', body, to.page)}")


if __name__ == "__main__":
    sys.exit(main())
