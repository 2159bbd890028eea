"""`pdserve bench spec`: speculative decoding (ngram, suffix, draft_model; mtp on a checkpoint
with an MTP layer) against no speculation, measured in the same run, one engine per system
(`LLM(model, speculative_config=...)`): output tokens/s at batch 1 and 8 on a repetitive
workload (code edits, quoting summaries, an agent loop that repeats its tool outputs) and on
free chat, and each method's acceptance length; with --pd-systems, the same through 1P1D
(spec_pd.py) and the accepted drafts per request against colocated. Definitions:
docs/benchmarks.md."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from pdserve.bench import offline
from pdserve.bench import report as rp
from pdserve.bench.spec_pd import ACCEPTED, DRAFTS, measure_pd
from pdserve.bench.spec_workloads import (  # noqa: F401 - the workloads' home, read as spec.*
    PASSAGES,
    WORKLOADS,
    agent_loop,
    code_edit,
    quoting_summary,
    tokenize_chats,
    workload_chats,
)
from pdserve.common.engine.drafting import create_drafter
from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.common.model.checkpoint import Checkpoint
from pdserve.common.model.config import ModelArchConfig
from pdserve.common.node.cli import parser
from pdserve.common.spec.config import SpeculativeConfig
from pdserve.common.spec.self_draft import write_self_draft

SECTION = "spec"
BASELINE = "none"
# system -> its --speculative-config (None: no speculation, the baseline)
SYSTEMS: dict[str, dict[str, Any] | None] = {
    BASELINE: None,
    "ngram k3": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
    "ngram k5 adaptive": {"method": "ngram", "num_speculative_tokens": 5, "adaptive": True},
    "suffix k3": {"method": "suffix", "num_speculative_tokens": 3, "adaptive": False},
    "suffix k5 adaptive": {"method": "suffix", "num_speculative_tokens": 5, "adaptive": True},
    # the model: the target's first --draft-layers layers (common/spec/self_draft.py)
    "draft_model k3 adaptive": {"method": "draft_model", "num_speculative_tokens": 3},
    # only on a DeepSeek checkpoint with an MTP layer (--model); SmolLM2 has none
    "mtp k3 adaptive": {"method": "mtp", "num_speculative_tokens": 3},
}
DEFAULT_SYSTEMS = [s for s in SYSTEMS if not s.startswith("mtp")]
# 1P1D rows by default: the adaptive drafters, and draft_model (its pages travel)
PD_SYSTEMS = [BASELINE, "ngram k5 adaptive", "suffix k5 adaptive", "draft_model k3 adaptive"]


def system_config(system: str, draft: str | None = None) -> dict[str, Any] | None:
    """A system's --speculative-config keys; draft_model's take the self-draft `draft`."""
    raw = SYSTEMS[system]
    if raw is not None and raw["method"] == "draft_model":
        return {**raw, "model": draft}
    return raw


def speculative_config(system: str, draft: str | None = None) -> SpeculativeConfig | None:
    return SpeculativeConfig.parse(system_config(system, draft))


def self_draft(path: Path, args: argparse.Namespace) -> str:
    """The target's first --draft-layers layers as a checkpoint, written once into the cache."""
    out = Path(args.cache_dir) / f"self-draft-{path.stem}-{args.draft_layers}"
    if not (out / "model.safetensors").is_file():
        write_self_draft(path, args.draft_layers, out)
    return str(out)


def make_engine(path: Path, args: argparse.Namespace, system: str, tokens: int) -> LLM:
    """One system's engine. The prefix cache holds every prompt (a warm-up fills it), so the
    timed runs measure decoding, which is what speculation changes."""
    kv_bytes = 2 * tokens * offline.kv_bytes_per_token(ModelArchConfig.from_dir(path))
    return LLM(str(path), speculative_config=speculative_config(system, args.draft),
               max_num_seqs=max(args.batch_sizes), device=args.device, dtype=args.dtype,
               kv_cache_bytes=max(256 << 20, kv_bytes), enable_prefix_caching=True)  # fmt: skip


def fresh_drafter(llm: LLM) -> Any:
    """A new drafter for one measurement: suffix decoding keeps finished outputs, so a repeat
    of the same prompts would draft from its own earlier answers and flatter the method. A
    draft model's proposer keeps nothing between requests (its KV is in their blocks): the
    new drafter takes it over."""
    old = llm.engine.scheduler.drafter
    if old is None:
        return None
    proposer = old.proposer if old.config.has_draft_kv else None
    drafter = create_drafter(old.config, proposer, old.cost)  # the engine's step costs
    llm.engine.scheduler.drafter = drafter
    return drafter


def timed_run(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int) -> dict[str, Any]:
    """The prompts greedy, `batch` at a time: wall time, output tokens and the drafts' counts
    (at batch 1 also their running totals after each request)."""
    drafter = fresh_drafter(llm)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs, start, cpu = [], time.perf_counter(), time.process_time()
    drafts_after, accepted_after = [], []
    for at in range(0, len(prompts), batch):
        outs += llm.generate(prompts[at : at + batch], params)
        if batch == 1 and drafter is not None:
            drafts_after.append(drafter.stats.num_drafts)
            accepted_after.append(drafter.stats.num_accepted_tokens)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = [o.token_ids for o in outs]
    n = sum(map(len, tokens))
    counts = drafter.stats.counters() if drafter is not None else {}
    return {"wall_s": wall, "cpu_s": cpu, "output_tokens": n, "tokens_per_s": n / wall,
            "cpu_tokens_per_s": n / cpu, "tokens": tokens,
            "drafts_after": drafts_after, "accepted_after": accepted_after, **counts}  # fmt: skip


def result_row(key: tuple[str, int, str], runs: list[dict], base: list[dict], greedy: dict,
               colocated: dict | None = None) -> dict:  # fmt: skip
    """One system on one (workload, batch size, system) `key`: median tokens/s over the
    repeats, its ratio to no speculation's (`base`, the same mode's), acceptance length
    (tokens a verify step emits: 1 + accepted / drafts), how many sequences equal `greedy`
    (colocated no speculation's) token for token; a 1P1D row (`colocated`: that run) also
    counts the requests whose accepted drafts equal colocated's (batch 1)."""
    speed = statistics.median(r["tokens_per_s"] for r in runs)
    base_speed = statistics.median(r["tokens_per_s"] for r in base)
    cpu = statistics.median(r.get("cpu_tokens_per_s", 0.0) for r in runs)
    base_cpu = statistics.median(r.get("cpu_tokens_per_s", 0.0) for r in base)
    first = runs[0]
    drafts, drafted = first.get(DRAFTS, 0), first.get("spec_decode_num_draft_tokens", 0)
    accepted = first.get(ACCEPTED, 0)
    same = sum(a == b for a, b in zip(first["tokens"], greedy["tokens"]))
    row = {"mode": "colocated" if colocated is None else "1P1D", "workload": key[0],
           "batch": key[1], "system": key[2], "tokens_per_s": speed,
           "ratio": speed / base_speed, "cpu_tokens_per_s": cpu,
           "cpu_ratio": cpu / base_cpu if base_cpu else None,
           "output_tokens": first["output_tokens"],
           "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
           "acceptance_length": 1 + accepted / drafts if drafts else None,
           "draft_acceptance": accepted / drafted if drafted else None,
           "sequences_equal": same, "sequences": len(first["tokens"])}  # fmt: skip
    if colocated is not None:
        theirs = colocated.get("accepted_after", [])
        pairs = zip(first.get("accepted_after", []), theirs)
        row["requests_compared"] = len(theirs)
        row["requests_same_acceptance"] = sum(a == b for a, b in pairs)
        row["accepted_after"], row["colocated_accepted_after"] = first["accepted_after"], theirs
    return row


def build_prompts(path: Path, n: int) -> dict[str, list[list[int]]]:
    tokenizer = Checkpoint.resolve(str(path)).tokenizer()
    return {w: tokenize_chats(tokenizer, workload_chats(w, n)) for w in WORKLOADS}


def rotated(systems: list[str], r: int) -> list[str]:
    """Repeat r's order: no system always runs first (or right after another's warm caches)."""
    r %= len(systems)
    return systems[r:] + systems[:r]


Runs = dict[tuple[str, int, str], list[dict]]


def measure_all(args: argparse.Namespace, engines: dict[str, LLM],
                prompts: dict[str, list[list[int]]]) -> Runs:  # fmt: skip
    """Every (workload, batch size, system) colocated, args.repeats times."""
    runs: Runs = {}
    for r in range(args.repeats):
        for workload in WORKLOADS:
            for batch in args.batch_sizes:
                ps = prompts[workload][: args.batch1_prompts] if batch == 1 else prompts[workload]
                for system in rotated(args.systems, r):
                    run = timed_run(engines[system], ps, batch, args.max_tokens)
                    runs.setdefault((workload, batch, system), []).append(run)
                    print(f"{workload} batch {batch} {system}: {run['tokens_per_s']:.2f} tok/s"
                          f" ({run['cpu_tokens_per_s']:.2f} a CPU second)", flush=True)  # fmt: skip
    return runs


def result_rows(args: argparse.Namespace, runs: Runs, pd: dict[tuple, dict]) -> list[dict]:
    """The colocated rows, then the 1P1D rows (each against 1P1D's none for speed, and
    against colocated for tokens and accepted drafts)."""
    keys = [(w, b) for w in WORKLOADS for b in args.batch_sizes]
    rows = [result_row((w, b, s), runs[w, b, s], runs[w, b, BASELINE], runs[w, b, BASELINE][0])
            for w, b in keys for s in args.systems]  # fmt: skip
    for w, b in keys:
        for s in [s for s in args.pd_systems if (w, b, s) in pd]:
            base, greedy = [pd[w, b, BASELINE]], runs[w, b, BASELINE][0]
            rows.append(result_row((w, b, s), [pd[w, b, s]], base, greedy, runs[w, b, s][0]))
    return rows


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.models import smollm2

    path = offline.model_dir(args, smollm2)
    drafts = any(s.startswith("draft_model") for s in [*args.systems, *args.pd_systems])
    args.draft = self_draft(path, args) if drafts else None
    prompts = build_prompts(path, args.prompts)
    every = [p for ps in prompts.values() for p in ps]
    kv_tokens = sum(map(len, every)) + max(args.batch_sizes) * args.max_tokens
    engines = {s: make_engine(path, args, s, kv_tokens) for s in args.systems}
    warm = SamplingParams(max_tokens=1, temperature=0.0)
    for llm in engines.values():
        llm.generate(every, warm)  # fills the prefix cache; one-time costs
    runs = measure_all(args, engines, prompts)
    configs_json = {s: c.to_json() if (c := speculative_config(s, args.draft)) else None
                    for s in args.pd_systems}  # fmt: skip
    pd = measure_pd(args, path, prompts, configs_json, runs) if args.pd_systems else {}
    results = result_rows(args, runs, pd)
    args.prompt_len = round(statistics.mean(map(len, every)))  # what sweep_fields records
    runner = engines[BASELINE].engine.runner
    configs = {s: system_config(s, args.draft) for s in args.systems}
    return {**offline.sweep_fields(args, path, SimpleNamespace(runner=runner)),
            "systems": args.systems, "pd_systems": args.pd_systems,
            "speculative_configs": configs, "prompts": args.prompts,
            "batch1_prompts": min(args.batch1_prompts, args.prompts),
            "batch_sizes": args.batch_sizes, "results": results}  # fmt: skip


def find(report: dict[str, Any], workload: str, batch: int, system: str,
         mode: str = "colocated") -> dict | None:  # fmt: skip
    key = (mode, workload, batch, system)
    rows = report["results"]
    at = lambda r: (r.get("mode", "colocated"), r["workload"], r["batch"], r["system"])  # noqa: E731
    return next((r for r in rows if at(r) == key), None)


def speed_goal(report: dict[str, Any], name: str, workload: str, batch: int,
               systems: Sequence[str], target: float) -> dict[str, Any]:  # fmt: skip
    """`name`: the best of `systems` on (workload, batch) against no speculation."""
    rows = [r for s in systems if (r := find(report, workload, batch, s)) is not None]
    best = max(rows, key=lambda r: r["ratio"], default=None)
    base = find(report, workload, batch, BASELINE)
    value = best["tokens_per_s"] if best else None
    label = f"{name} (best: {best['system']})" if best and len(systems) > 1 else name
    return rp.goal(label, value, base["tokens_per_s"] if base else None, ">=", target)


def goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 38's goals: >= 1.5x batch-1 tokens/s with ngram or suffix on the repetitive
    workload; adaptive k no worse than 0.95x on free chat; greedy tokens equal; through 1P1D
    the accepted drafts of each request equal colocated's."""
    spec = [s for s in report["systems"] if s != BASELINE]
    adaptive = [s for s in spec if (SYSTEMS.get(s) or {}).get("adaptive", True)]
    lookup = [s for s in spec if (SYSTEMS.get(s) or {}).get("method") in ("ngram", "suffix")]
    out = [speed_goal(report, "repetitive, batch 1: ngram or suffix >= 1.5x no speculation",
                      "repetitive", 1, lookup, 1.5)]  # fmt: skip
    for batch in report["batch_sizes"]:
        for system in adaptive:
            name = f"free chat, batch {batch}: {system} >= 0.95x no speculation"
            out.append(speed_goal(report, name, "chat", batch, [system], 0.95))
    same = sum(r["sequences_equal"] for r in report["results"])
    every = sum(r["sequences"] for r in report["results"])
    out.append(rp.goal("greedy tokens equal no speculation's", same, every, ">=", 1.0))
    pd = [r for r in report["results"] if r.get("requests_compared")]
    same, every = (sum(r[k] for r in pd) for k in ("requests_same_acceptance", "requests_compared"))
    name = "1P1D accepted drafts per request = colocated (batch 1)"
    out.append(rp.goal(name, same if pd else None, every if pd else None, ">=", 1.0))
    return out


def _maybe(key: str, form: str) -> Any:
    return lambda r: "—" if r[key] is None else format(r[key], form)


def _parity(r: dict[str, Any]) -> str:
    """1P1D's requests whose accepted drafts equal colocated's, of those compared."""
    if not r.get("requests_compared"):
        return "—"
    return f"{r['requests_same_acceptance']}/{r['requests_compared']}"


COLUMNS = [
    ("mode", lambda r: r.get("mode", "colocated")),
    ("workload", "workload"), ("batch", "batch"), ("system", "system"),
    ("output tok/s", "tokens_per_s"), ("vs none", lambda r: f"{r['ratio']:.2f}x"),
    ("acceptance length", _maybe("acceptance_length", ".2f")),
    ("drafts accepted", _maybe("draft_acceptance", ".0%")),
    ("tokens equal", lambda r: f"{r['sequences_equal']}/{r['sequences']}"),
    ("accepted = colocated", _parity),
]  # fmt: skip


def model_line(report: dict[str, Any]) -> str:
    m = report["model"]
    return (f"Model: {m['description']} ({m['params'] / 1e6:.1f} M parameters); prompts of "
            f"{report['prompt_len']} tokens on average.")  # fmt: skip


def section(report: dict[str, Any], figure: str) -> str:
    """The benchmarks.md section; `figure` is the plot's path as the page links it."""
    configs = "; ".join(
        f"{s} `{json.dumps(c)}`" for s, c in report["speculative_configs"].items() if c
    )
    at_one = report.get("batch1_prompts", report["prompts"])
    how = (f"{report['prompts']} prompts per workload through the model's chat template, greedy, "
           f"up to {report['max_tokens']} new tokens; batch 1 runs the first {at_one} one by one. "
           "The prompts "
           "are in the prefix cache (a warm-up run), so the time is decoding; each measurement "
           "starts with a fresh drafter. Systems: " + configs + ".")  # fmt: skip
    if report.get("pd_systems"):
        how += (" 1P1D rows: router, prefill and decode processes (zmq), the config on both "
                "nodes, a new deployment per measurement, no warm-up (the time includes "
                "prefill and the KV transfer), against 1P1D's none; tokens compared with "
                "colocated none's; accepted drafts per request (batch 1) read from the decode "
                "node's spec_decode_* counters after each request.")  # fmt: skip
    return "\n".join(
        ["## Speculative decoding: each method against none, colocated and 1P1D", ""]
        + [*rp.run_header(report), model_line(report), "", how, ""]
        + [rp.records_table(COLUMNS, report["results"]), "", f"![spec]({figure})", ""]
        + [rp.goals_table(goals(report))]
    )


def plot(report: dict[str, Any], path: Path) -> Path:
    """Per workload: tokens/s against no speculation's, by batch size, a line per system."""
    panels = []
    for workload in WORKLOADS:
        panel = rp.Panel(workload, "batch size", "output tok/s vs none", xlog=2,
                         xticks=report["batch_sizes"], hline=1.0)  # fmt: skip
        lines = [("colocated", s, s, "o-") for s in report["systems"]]
        lines += [("1P1D", s, f"{s} (1P1D)", "s--") for s in report.get("pd_systems", [])]
        for mode, system, label, style in lines:
            rows = [r for r in report["results"] if r.get("mode", "colocated") == mode
                    and r["workload"] == workload and r["system"] == system]  # fmt: skip
            panel.lines.append((label, [r["batch"] for r in rows], [r["ratio"] for r in rows],
                                style))  # fmt: skip
        panels.append(panel)
    return rp.plot_lines(panels, path)


FLAGS = [
    ("--quick", bool, None, "tiny random model, 2 prompts, batch 1 and 2, 6 new tokens (needs "
     "--out)"),
    ("--systems", str, ",".join(DEFAULT_SYSTEMS), "comma list of systems (none is always "
     "measured; mtp needs a --model with an MTP layer)"),
    ("--pd-systems", str, None, "comma list of systems also run through 1P1D, each in its own "
     "deployment (none is always measured; empty: no 1P1D rows; default: "
     f"{', '.join(PD_SYSTEMS[1:])} of --systems; quick: none)"),
    ("--draft-layers", int, None, "draft_model's self-draft: the target's first N layers "
     "(default: 8; quick: 1)", {"metavar": "N"}),
    ("--batch-sizes", str, None, "comma list of batch sizes (default: 1,8; quick: 1,2)"),
    ("--prompts", int, None, "prompts per workload (default: 8; quick: 2)"),
    ("--batch1-prompts", int, None, "batch 1 runs only the first N prompts of each workload "
     "(one by one, the slow part; default: all)", {"metavar": "N"}),
    ("--max-tokens", int, None, "most new tokens per prompt (default: 128; quick: 6)"),
    ("--repeats", int, 1, "timed runs of each measurement (the median is reported)"),
    ("--model", str, None, "checkpoint directory or GGUF (default: SmolLM2-135M-Instruct; "
     "quick: tiny)", {"metavar": "DIR"}),
    ("--device", str, "cpu", "cpu or cuda[:N]"),
    ("--dtype", str, "float32", "weights and activations", {"choices": sorted(offline.DTYPES)}),
    ("--threads", int, 1, "torch threads (0: torch's own, every core)"),
    rp.CACHE_DIR_FLAG,
]  # fmt: skip
QUICK = {"batch_sizes": ("1,8", "1,2"), "prompts": (8, 2), "max_tokens": (128, 6),
         "draft_layers": (8, 1)}  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = parser("pdserve bench spec", __doc__.split("\n\n")[0])
    rp.add_flags(p.add_argument_group("run"), FLAGS)
    rp.add_output_flags(p, "spec.json and spec.png", "spec.json")
    args = p.parse_args(argv)
    args.outputs = rp.outputs_from_args(p, args)
    for key, defaults in QUICK.items():
        setattr(args, key, getattr(args, key) or defaults[int(args.quick)])
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",")]
    args.batch1_prompts = args.batch1_prompts or args.prompts
    args.systems = _systems(p, args.systems)
    if args.pd_systems is None:
        default = [s for s in PD_SYSTEMS if s in args.systems and not args.quick]
        args.pd_systems = ",".join(default)
    pd = _systems(p, args.pd_systems)
    args.pd_systems = pd if len(pd) > 1 else []
    if set(args.pd_systems) - set(args.systems):  # their rows compare with colocated's
        p.error(f"--pd-systems {sorted(set(pd) - set(args.systems))} are not in --systems")
    if args.draft_layers < 1:
        p.error("--draft-layers must be >= 1")
    if min(args.batch_sizes) < 1 or args.prompts < 1 or args.max_tokens < 1 or args.repeats < 1:
        p.error("batch sizes, --prompts, --max-tokens and --repeats must be >= 1")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    return args


def _systems(p: argparse.ArgumentParser, text: str) -> list[str]:
    """A comma list of systems, none first; unknown names are an error."""
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SYSTEMS))
    if unknown:
        p.error(f"unknown systems {unknown} (known: {', '.join(SYSTEMS)})")
    return [BASELINE, *dict.fromkeys(s for s in chosen if s != BASELINE)]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    write = lambda report, to: rp.publish(SECTION, report, to, plot, section)  # noqa: E731
    return rp.bench_main(argv, parse_args, SECTION, measure, write)


if __name__ == "__main__":
    sys.exit(main())
