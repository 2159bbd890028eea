"""`pdserve bench spec`: speculative decoding (ngram, suffix) against no speculation, measured in
the same run, one engine per system (`LLM(model, speculative_config=...)`): output tokens/s at
batch 1 and 8 on a repetitive workload (code edits, quoting summaries, an agent loop that
repeats its tool outputs) and on free chat, and each method's acceptance length. Definitions:
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
from pdserve.common.engine.drafting import create_drafter
from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.common.model.checkpoint import Checkpoint
from pdserve.common.model.config import ModelArchConfig
from pdserve.common.node.cli import parser
from pdserve.common.spec.config import SpeculativeConfig

SECTION = "spec"
BASELINE = "none"
# system -> its --speculative-config (None: no speculation, the baseline)
SYSTEMS: dict[str, dict[str, Any] | None] = {
    BASELINE: None,
    "ngram k3": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
    "ngram k5 adaptive": {"method": "ngram", "num_speculative_tokens": 5, "adaptive": True},
    "suffix k3": {"method": "suffix", "num_speculative_tokens": 3, "adaptive": False},
    "suffix k5 adaptive": {"method": "suffix", "num_speculative_tokens": 5, "adaptive": True},
}
WORKLOADS = ("repetitive", "chat")
Chat = list[dict[str, str]]

FUNCTIONS = (
    "def moving_average(values, window):\n    x = 0.0\n    out = []\n"
    "    for i, value in enumerate(values):\n        x += value\n        if i >= window:\n"
    "            x -= values[i - window]\n        if i >= window - 1:\n"
    "            out.append(x / window)\n    return out\n",
    "def count_words(text):\n    x = {}\n    for word in text.lower().split():\n"
    "        word = word.strip('.,;:!?')\n        if word:\n"
    "            x[word] = x.get(word, 0) + 1\n"
    "    return sorted(x.items(), key=lambda item: -item[1])\n",
    "def clamp_all(items, low, high):\n    x = []\n    for item in items:\n"
    "        if item < low:\n            x.append(low)\n        elif item > high:\n"
    "            x.append(high)\n        else:\n            x.append(item)\n    return x\n",
)
PASSAGES = (
    "The lighthouse at Port Ellen was built in 1832. Its keeper climbed 121 steps every evening "
    "to light the lamp. In winter storms the light could be seen from twenty miles away. The "
    'keeper wrote in his log: "The sea was angry tonight, but the lamp never faltered." The '
    "lighthouse was automated in 1978, and the keeper's cottage became a museum.",
    "Honeybees share the way to food with a movement called the waggle dance. A forager back "
    "at the hive dances a figure of eight. The angle of the dance tells the other bees the "
    "direction of the flowers relative to the sun, and the length of the waggle run tells them "
    'the distance. The scientist who decoded it called it "the most remarkable language in the '
    'animal kingdom."',
    'The town council met on Tuesday to discuss the new bridge. The mayor said: "The bridge '
    'will open in the spring, and it will cut the drive to the hospital by ten minutes." Two '
    "members asked about the cost, which has risen to 4.2 million pounds. The council voted "
    "seven to two to continue the work.",
)
QUESTIONS = (
    "Write a short poem about the sea.",
    "What are three tips for learning a new language?",
    "Explain why the sky is blue.",
    "Describe your ideal weekend.",
    "Tell me a story about a dragon who loves baking.",
    "What is the difference between weather and climate?",
    "Give me ideas for a birthday party.",
    "How do plants make their food?",
)


def code_edit(i: int) -> Chat:
    code = FUNCTIONS[i % len(FUNCTIONS)]
    ask = "Here is a function. Rename the variable x to y and return the whole function."
    return [{"role": "user", "content": f"{ask}\n\n```python\n{code}```"}]


def quoting_summary(i: int) -> Chat:
    ask = "Summarize this passage in two sentences, quoting its most important sentence exactly."
    return [{"role": "user", "content": f"{ask}\n\n{PASSAGES[i % len(PASSAGES)]}"}]


def agent_loop(i: int) -> Chat:
    """An agent's conversation whose later turns repeat an earlier tool output."""
    listing = "\n".join(f"src/module_{i}_{n}.py  {1200 * (n + 1) + 37 * i} bytes" for n in range(6))
    call = {"role": "assistant", "content": 'Calling list_files(path="src/").'}
    return [
        {"role": "system", "content": "You are a coding agent. Report tool outputs exactly."},
        {"role": "user", "content": "List the files in src/ with their sizes."},
        call,
        {"role": "user", "content": f"Tool output:\n{listing}"},
        {"role": "assistant", "content": f"The files in src/ are:\n{listing}"},
        {"role": "user", "content": "List them again and report the output exactly as before."},
        call,
        {"role": "user", "content": f"Tool output:\n{listing}"},
    ]


def workload_chats(workload: str, n: int) -> list[Chat]:
    """n conversations of a workload: repetitive cycles code edit, quoting summary, agent loop."""
    if workload == "chat":
        return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]
    kinds = (code_edit, quoting_summary, agent_loop)
    return [kinds[i % len(kinds)](i // len(kinds)) for i in range(n)]


def tokenize_chats(tokenizer: Any, chats: list[Chat]) -> list[list[int]]:
    """Each conversation through the model's chat template, ready for the assistant's turn."""
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
             for c in chats]  # fmt: skip
    return [tokenizer(t).input_ids for t in texts]


def speculative_config(system: str) -> SpeculativeConfig | None:
    return SpeculativeConfig.parse(SYSTEMS[system])


def make_engine(path: Path, args: argparse.Namespace, system: str, tokens: int) -> LLM:
    """One system's engine. The prefix cache holds every prompt (a warm-up fills it), so the
    timed runs measure decoding, which is what speculation changes."""
    kv_bytes = 2 * tokens * offline.kv_bytes_per_token(ModelArchConfig.from_dir(path))
    return LLM(str(path), speculative_config=speculative_config(system),
               max_num_seqs=max(args.batch_sizes), device=args.device, dtype=args.dtype,
               kv_cache_bytes=max(256 << 20, kv_bytes), enable_prefix_caching=True)  # fmt: skip


def fresh_drafter(llm: LLM, system: str) -> Any:
    """A new drafter for one measurement: suffix decoding keeps finished outputs, so a repeat
    of the same prompts would draft from its own earlier answers and flatter the method."""
    drafter = create_drafter(speculative_config(system))
    llm.engine.scheduler.drafter = drafter
    return drafter


def timed_run(llm: LLM, system: str, prompts: list[list[int]], batch: int,
              max_tokens: int) -> dict[str, Any]:  # fmt: skip
    """The prompts greedy, `batch` at a time: wall time, output tokens and the drafts' counts."""
    drafter = fresh_drafter(llm, system)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs, start = [], time.perf_counter()
    for at in range(0, len(prompts), batch):
        outs += llm.generate(prompts[at : at + batch], params)
    wall = time.perf_counter() - start
    tokens = [o.token_ids for o in outs]
    n = sum(map(len, tokens))
    counts = drafter.stats.counters() if drafter is not None else {}
    return {"wall_s": wall, "output_tokens": n, "tokens_per_s": n / wall, "tokens": tokens,
            **counts}  # fmt: skip


def result_row(workload: str, batch: int, system: str, runs: list[dict], base: list[dict]) -> dict:
    """One system on one workload and batch size: median tokens/s over the repeats, its ratio
    to no speculation's, acceptance length (tokens a verify step emits: 1 + accepted / drafts)
    and how many sequences equal no speculation's token for token."""
    speed = statistics.median(r["tokens_per_s"] for r in runs)
    base_speed = statistics.median(r["tokens_per_s"] for r in base)
    first = runs[0]
    drafts, drafted = (
        first.get("spec_decode_num_drafts", 0),
        first.get("spec_decode_num_draft_tokens", 0),
    )
    accepted = first.get("spec_decode_num_accepted_tokens", 0)
    same = sum(a == b for a, b in zip(first["tokens"], base[0]["tokens"]))
    return {"workload": workload, "batch": batch, "system": system, "tokens_per_s": speed,
            "ratio": speed / base_speed, "output_tokens": first["output_tokens"],
            "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_length": 1 + accepted / drafts if drafts else None,
            "draft_acceptance": accepted / drafted if drafted else None,
            "sequences_equal": same, "sequences": len(first["tokens"])}  # fmt: skip


def build_prompts(path: Path, n: int) -> dict[str, list[list[int]]]:
    tokenizer = Checkpoint.resolve(str(path)).tokenizer()
    return {w: tokenize_chats(tokenizer, workload_chats(w, n)) for w in WORKLOADS}


def rotated(systems: list[str], r: int) -> list[str]:
    """Repeat r's order: no system always runs first (or right after another's warm caches)."""
    r %= len(systems)
    return systems[r:] + systems[:r]


def measure_all(args: argparse.Namespace, engines: dict[str, LLM],
                prompts: dict[str, list[list[int]]]) -> list[dict[str, Any]]:  # fmt: skip
    runs: dict[tuple[str, int, str], list[dict]] = {}
    for r in range(args.repeats):
        for workload in WORKLOADS:
            for batch in args.batch_sizes:
                ps = prompts[workload][: args.batch1_prompts] if batch == 1 else prompts[workload]
                for system in rotated(args.systems, r):
                    run = timed_run(engines[system], system, ps, batch, args.max_tokens)
                    runs.setdefault((workload, batch, system), []).append(run)
                    print(f"{workload} batch {batch} {system}: {run['tokens_per_s']:.2f} tok/s",
                          flush=True)  # fmt: skip
    return [result_row(w, b, s, runs[w, b, s], runs[w, b, BASELINE])
            for w in WORKLOADS for b in args.batch_sizes for s in args.systems]  # fmt: skip


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.models import smollm2

    path = offline.model_dir(args, smollm2)
    prompts = build_prompts(path, args.prompts)
    every = [p for ps in prompts.values() for p in ps]
    kv_tokens = sum(map(len, every)) + max(args.batch_sizes) * args.max_tokens
    engines = {s: make_engine(path, args, s, kv_tokens) for s in args.systems}
    warm = SamplingParams(max_tokens=1, temperature=0.0)
    for llm in engines.values():
        llm.generate(every, warm)  # fills the prefix cache; one-time costs
    results = measure_all(args, engines, prompts)
    args.prompt_len = round(statistics.mean(map(len, every)))  # what sweep_fields records
    runner = engines[BASELINE].engine.runner
    configs = {s: SYSTEMS[s] for s in args.systems}
    return {**offline.sweep_fields(args, path, SimpleNamespace(runner=runner)),
            "systems": args.systems, "speculative_configs": configs, "prompts": args.prompts,
            "batch1_prompts": min(args.batch1_prompts, args.prompts),
            "batch_sizes": args.batch_sizes, "results": results}  # fmt: skip


def find(report: dict[str, Any], workload: str, batch: int, system: str) -> dict | None:
    key = (workload, batch, system)
    rows = report["results"]
    return next((r for r in rows if (r["workload"], r["batch"], r["system"]) == key), None)


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
    workload; adaptive k no worse than 0.95x on free chat; greedy tokens equal."""
    spec = [s for s in report["systems"] if s != BASELINE]
    adaptive = [s for s in spec if (SYSTEMS.get(s) or {}).get("adaptive", True)]
    out = [speed_goal(report, "repetitive, batch 1: ngram or suffix >= 1.5x no speculation",
                      "repetitive", 1, spec, 1.5)]  # fmt: skip
    for batch in report["batch_sizes"]:
        for system in adaptive:
            name = f"free chat, batch {batch}: {system} >= 0.95x no speculation"
            out.append(speed_goal(report, name, "chat", batch, [system], 0.95))
    same = sum(r["sequences_equal"] for r in report["results"])
    every = sum(r["sequences"] for r in report["results"])
    out.append(rp.goal("greedy tokens equal no speculation's", same, every, ">=", 1.0))
    out.append(rp.goal("1P1D acceptance = colocated", None, None, ">=", 1.0))
    return out


def _maybe(key: str, form: str) -> Any:
    return lambda r: "—" if r[key] is None else format(r[key], form)


COLUMNS = [
    ("workload", "workload"), ("batch", "batch"), ("system", "system"),
    ("output tok/s", "tokens_per_s"), ("vs none", lambda r: f"{r['ratio']:.2f}x"),
    ("acceptance length", _maybe("acceptance_length", ".2f")),
    ("drafts accepted", _maybe("draft_acceptance", ".0%")),
    ("tokens equal", lambda r: f"{r['sequences_equal']}/{r['sequences']}"),
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
    return "\n".join(
        ["## Speculative decoding: ngram and suffix against none", ""]
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
        for system in report["systems"]:
            rows = [r for r in report["results"]
                    if r["workload"] == workload and r["system"] == system]  # fmt: skip
            panel.lines.append((system, [r["batch"] for r in rows], [r["ratio"] for r in rows],
                                "o-"))  # fmt: skip
        panels.append(panel)
    return rp.plot_lines(panels, path)


FLAGS = [
    ("--quick", bool, None, "tiny random model, 2 prompts, batch 1 and 2, 6 new tokens (needs "
     "--out)"),
    ("--systems", str, ",".join(SYSTEMS), "comma list of systems (none is always measured)"),
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
QUICK = {"batch_sizes": ("1,8", "1,2"), "prompts": (8, 2), "max_tokens": (128, 6)}


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
    chosen = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SYSTEMS))
    if unknown:
        p.error(f"unknown systems {unknown} (known: {', '.join(SYSTEMS)})")
    args.systems = [BASELINE, *dict.fromkeys(s for s in chosen if s != BASELINE)]
    if min(args.batch_sizes) < 1 or args.prompts < 1 or args.max_tokens < 1 or args.repeats < 1:
        p.error("batch sizes, --prompts, --max-tokens and --repeats must be >= 1")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    write = lambda report, to: rp.publish(SECTION, report, to, plot, section)  # noqa: E731
    return rp.bench_main(argv, parse_args, SECTION, measure, write)


if __name__ == "__main__":
    sys.exit(main())
