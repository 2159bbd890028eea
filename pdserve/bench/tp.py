"""`pdserve bench tp`: decode steps at each TP size on TinyLlama-1.1B's shape (random bf16
weights), the all-reduces' share of a step, and KV GB/s of each (prefill TP, decode TP) mapping
against TP 1 to TP 1. Reading: docs/benchmarks.md."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from pdserve.bench import report as rp
from pdserve.bench.kv_transfer import group_transfer_s
from pdserve.common.engine.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.node.cli import parser
from pdserve.common.wire.messages import Message
from pdserve.common.wire.payloads import KVLayout, SamplingParams
from pdserve.common.wire.ranks import Handlers, RankCommand, RankPlane

SHAPES = {  # TinyLlama-1.1B's shape; quick: a tiny one of the same proportions
    "1b": (2048, 5632, 22, 32, 4, 32000),
    "quick": (256, 704, 2, 8, 4, 4096),
}
MAPPINGS = ((1, 1), (2, 2), (1, 2), (2, 1), (1, 4), (4, 1))
PROBE = "pdserve.bench.tp:Probe"
PROBES = RankPlane("bench probes")


@dataclass(frozen=True, slots=True)
class Millis(Message):
    TYPE: ClassVar[str] = "probe.ms"
    ms: float


@PROBES.command
@dataclass(frozen=True, slots=True)
class TimeAllReduce(RankCommand):
    """Time `repeats` all-reduces of a [rows, hidden] bf16 tensor (after 3 to warm up)."""

    TYPE: ClassVar[str] = "probe.all_reduce"
    REPLY: ClassVar[type[Message]] = Millis
    rows: int
    hidden: int
    repeats: int


class Probe:
    """The bench's rank agent: times the all-reduce a layer issues, on every rank at once."""

    PLANE = PROBES

    def __init__(self, runner: Any, group: Any) -> None:
        self.group = group

    def handlers(self) -> Handlers:
        return {TimeAllReduce: self.all_reduce_ms}

    def all_reduce_ms(self, cmd: TimeAllReduce) -> Millis:
        x = torch.randn(cmd.rows, cmd.hidden, dtype=torch.bfloat16)
        for _ in range(3):
            self.group.all_reduce(x)
        start = time.perf_counter()
        for _ in range(cmd.repeats):
            self.group.all_reduce(x)
        return Millis((time.perf_counter() - start) * 1000 / cmd.repeats)


def write_model(folder: Path, shape: str) -> Path:
    """config.json of a Llama of `shape` (the weights: vLLM's load_format "dummy")."""
    hidden, inter, layers, heads, kv, vocab = SHAPES[shape]
    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden,
        intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu", torch_dtype="bfloat16",
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def build(model: Path, tp: int, args: argparse.Namespace) -> LLMEngine:
    threads = max(1, args.threads // tp)
    return LLMEngine(
        ModelConfig(str(model), dtype="bfloat16", load_format="dummy", enforce_eager=True),
        CacheConfig(num_blocks=args.batch * (args.prompt_len + args.steps) // 16 + 8),
        SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=2048),
        ParallelConfig(tp, threads_per_rank=threads, rank_agent=PROBE),
    )


def decode_row(engine: LLMEngine, tp: int, args: argparse.Namespace) -> dict[str, Any]:
    """Median decode step (every step after the batch's one prefill step) and the time one
    step spends in its all-reduces (two per layer and the embedding's), timed apart."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)
    vocab = engine.runner.arch.vocab_size
    for i in range(args.batch):
        prompt = torch.randint(vocab, (args.prompt_len,), generator=gen).tolist()
        engine.add_request(f"r{i}", prompt, params)
    times = []
    while engine.has_unfinished:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    step = statistics.median(times[1:])
    row = {"tp": tp, "batch": args.batch, "step_s": step, "tokens_per_s": args.batch / step}
    if tp > 1:
        arch = engine.runner.arch
        cmd = TimeAllReduce(args.batch, arch.hidden_size, 20)
        local = Probe(engine.runner, engine.runner.tp)
        answers = engine.runner.driver.call(PROBES, cmd, lambda: local.all_reduce_ms(cmd))
        ms = max(a.ms for a in answers)
        row["all_reduce_ms"] = ms
        row["all_reduce_share"] = (2 * arch.num_layers + 1) * ms / 1000 / step
    return row


def kv_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    hidden, _, layers, heads, kv, _ = SHAPES[args.shape]
    layout = KVLayout("bench", "bfloat16", layers, kv, hidden // heads, 16)
    nbytes = args.kv_blocks * layers * layout.page_bytes

    def seconds(p: int, d: int) -> float:
        runs = [group_transfer_s(layout, p, d, args.kv_blocks) for _ in range(args.repeats)]
        return statistics.median(runs)

    timed = [(p, d, seconds(p, d)) for p, d in MAPPINGS]
    base = next(s for p, d, s in timed if (p, d) == (1, 1))
    rows = []
    for p, d, s in timed:
        row = {"p": p, "d": d, "bytes": nbytes, "s": s, "gb_per_s": nbytes / s / 1e9}
        rows.append({**row, "of_tp1": base / s})
    return rows


def measure(args: argparse.Namespace) -> dict[str, Any]:
    decode = []
    with tempfile.TemporaryDirectory() as folder:  # config.json only: the weights are random
        model = write_model(Path(folder), args.shape)
        for tp in args.tp:
            engine = build(model, tp, args)
            try:
                decode.append(decode_row(engine, tp, args))
            finally:
                engine.close()
    return {"shape": args.shape, "dtype": "bfloat16", "device": "cpu", "repeats": args.repeats,
            "decode": decode, "kv": kv_rows(args)}  # fmt: skip


def section(report: dict[str, Any], figure: str) -> str:
    d = [[r["tp"], r["batch"], r["step_s"] * 1000, r["tokens_per_s"], r.get("all_reduce_ms", "—"),
          r.get("all_reduce_share", "—")] for r in report["decode"]]  # fmt: skip
    k = [[f"{r['p']} -> {r['d']}", r["bytes"] / 1e6, r["s"] * 1000, r["gb_per_s"], r["of_tp1"]]
         for r in report["kv"]]  # fmt: skip
    return "\n".join([
        *rp.run_header(report), "",
        rp.markdown_table(["TP", "batch", "decode step ms", "output tok/s", "all-reduce ms",
                        "all-reduces' share of the step"], d), "",
        rp.markdown_table(["prefill TP -> decode TP", "MB", "ms", "GB/s", "speed of 1 -> 1"],
                          k), "",
        f"![tp]({figure})",
    ])  # fmt: skip


def plot(report: dict[str, Any], path: Path) -> Path:
    decode, kv = report["decode"], report["kv"]
    tps, rates = [r["tp"] for r in decode], [r["tokens_per_s"] for r in decode]
    tokens = [("output tok/s", tps, rates, "o-")]
    mapped = [(f"{r['p']}->{r['d']}", [i], [r["gb_per_s"]], "o") for i, r in enumerate(kv)]
    return rp.plot_lines([
        rp.Panel("decode, the run's batch", "TP", "output tokens/s", tokens, ymin=0),
        rp.Panel("KV transfer by (prefill TP -> decode TP)", "mapping", "GB/s", mapped, ymin=0),
    ], path)  # fmt: skip


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = parser("pdserve bench tp", __doc__.split("\n\n")[0])
    rp.add_flags(p.add_argument_group("run"), [
        ("--quick", bool, False, "a tiny model, few steps, 1 repeat (a check, not a figure)"),
        ("--tp", int, [1, 2], "TP sizes to time decode steps at", {"nargs": "+"}),
        ("--batch", int, 8, "sequences decoding together"),
        ("--prompt-len", int, 64, "tokens of each prompt"),
        ("--steps", int, 16, "decode steps timed"),
        ("--threads", int, torch.get_num_threads(), "torch threads in all (each rank a share)"),
        ("--kv-blocks", int, 64, "blocks of one request's KV transferred per mapping"),
        ("--repeats", int, 3, "transfers per mapping (median)"),
    ])  # fmt: skip
    rp.add_output_flags(p, "tp.json, tp.png", saved="tp.json")
    args = p.parse_args(list(argv))
    if args.quick:
        args.steps, args.kv_blocks, args.repeats, args.prompt_len = 3, 8, 1, 16
    args.shape = "quick" if args.quick else "1b"
    args.outputs = rp.outputs_from_args(p, args)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    write = lambda report, to: rp.publish("tp", report, to, plot, section)  # noqa: E731
    return rp.bench_main(argv, parse, "tp", measure, write)
