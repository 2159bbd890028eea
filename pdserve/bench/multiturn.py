"""`pdserve bench multiturn`: multi-turn chat, colocated against 1P1D setups on the same
conversations: KV moved into decode nodes per turn, TTFT, the router's placement counters."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench import compare, load, systems
from pdserve.bench import report as rp
from pdserve.bench.systems import REMOTE, System

SECTION = "multiturn"
THRESHOLD = 128  # tokens the decode node may lack and still prefill (the `threshold` system)
REFERENCE = "colocated"  # whose answers the others' must equal
DEFAULT_BLOCK_SIZE = 16  # the engine's --block-size default (pdserve.common.node.cli)
KV_GOAL = 0.1  # KV bytes per later turn, against remote-nocache's
SETTLE_S = 1.5  # after a turn: nodes publish their gauges every heartbeat (0.5 s)
CAPS = load.ServerCaps(token_ids=False, eos_mode="ignore_eos", model=None)
TURN_METRICS = ("completed", "failed", "errors", "duration_s", "cached_prompt_tokens")
TURN_METRICS += ("mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms")
AUTO = ("--prefill-placement", "auto")
SYSTEM_SPECS = {s.name: s for s in (
    System("colocated", (0, 0, 1), REMOTE),
    System("remote-nocache", (1, 1, 0), REMOTE, ("--no-prefix-caching",)),
    System("remote", (1, 1, 0), REMOTE),
    System("conditional", (1, 1, 0), AUTO),
    System("threshold", (1, 1, 0), (*AUTO, "--local-prefill-threshold", str(THRESHOLD))),
)}  # fmt: skip
SYSTEMS = tuple(SYSTEM_SPECS)
QUICK_WORKLOAD = load.ChatWorkload(2, 2, first_len=48, message_len=16, answer_len=8)
ROUTER_COUNTERS = ("prefills_local", "prefills_remote", "kv_tokens_reused_on_decode")
ROUTER_COUNTERS += ("kv_tokens_sent",)


def scrape(text: str, prefix: str) -> dict[str, float]:
    """Prometheus text -> {name without prefix: value summed over label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            series, _, value = line.rpartition(" ")
            name = series.split("{", 1)[0][len(prefix) :]
            out[name] = out.get(name, 0.0) + float(value)
    return out


async def read_counters(client: httpx.AsyncClient, health_urls: Sequence[str]) -> dict:
    """The router's placement counters and the KV bytes decode nodes received, now."""
    resp = await client.get("/metrics")
    resp.raise_for_status()
    router = scrape(resp.text, "pdserve_backend_")
    out = {k: router.get(k, 0.0) for k in ROUTER_COUNTERS} | {"kv_bytes": 0.0}
    for url in health_urls:
        node = await client.get(f"{url}/metrics")
        node.raise_for_status()
        out["kv_bytes"] += scrape(node.text, "pdserve_node_").get("kv_received_bytes", 0.0)
    return out


async def run_turns(url: str, health_urls: list[str], pool: load.TokenPool,
                    args: argparse.Namespace, turns: list) -> None:  # fmt: skip
    """Every turn of every conversation against one running system, a record per turn into
    `turns`. A turn with a failed reply ends the run (the conversation cannot go on)."""
    async with load.make_client(url) as client:
        sender = load.Sender(client, url, CAPS, timeout_s=args.request_timeout)
        # The first request of a fresh cluster pays one-time costs, and nodes measure their
        # prefill rates (the cost model's input).
        await load.warm_up(sender, pool, 1, chat=True)
        await asyncio.sleep(SETTLE_S)
        before = await read_counters(client, health_urls)
        for t, requests in enumerate(load.chat_turns(pool, args.workload)):
            load_avg = os.getloadavg()[0]
            start = time.perf_counter()
            replies = await asyncio.gather(*(sender.send(r) for r in requests))
            duration = time.perf_counter() - start
            await asyncio.sleep(SETTLE_S)
            after = await read_counters(client, health_urls)
            delta = {k: after[k] - before[k] for k in after}
            turns.append(turn_record(t, replies, duration, delta, load_avg))
            print(rp.record_line([TURN_COLUMNS[0], *TURN_COLUMNS[2:]], turns[-1]), flush=True)
            if not all(r.success for r in replies):
                break
            before = after


def turn_record(t: int, replies: Sequence[load.RequestResult], duration: float, delta: dict,
                load_avg: float) -> dict[str, Any]:  # fmt: skip
    m = load.metrics(replies, duration, load.BenchConfig("", percentiles=(90.0,)))
    return {"turn": t + 1, **{k: m[k] for k in TURN_METRICS},
            "prompt_tokens": m["total_input_tokens"], "output_tokens": m["total_output_tokens"],
            "output_tokens_per_s": m["output_throughput"], **{k: int(v) for k, v in delta.items()},
            "load_avg_1m": load_avg, "replies": [load.per_request(r) for r in replies]}  # fmt: skip


def overall(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """All turns, and the turns after the first, of one system."""

    def ttfts(ts: list[dict]) -> list[float]:
        return [r["ttft_s"] for t in ts for r in t["replies"] if not r["error"]]

    later, duration = turns[1:], sum(t["duration_s"] for t in turns)
    total = lambda key, ts=turns: sum(t[key] for t in ts)  # noqa: E731
    return {
        "mean_ttft_ms": load.distribution("ttft", ttfts(turns), ())["mean_ttft_ms"],
        "mean_ttft_ms_after_turn_1": load.distribution("ttft", ttfts(later), ())["mean_ttft_ms"],
        "kv_bytes": total("kv_bytes"), "kv_bytes_after_turn_1": total("kv_bytes", later),
        "output_tokens_per_s": total("output_tokens") / duration if duration > 0 else math.nan,
        "prefills_local": total("prefills_local"), "prefills_remote": total("prefills_remote"),
    }  # fmt: skip


def reusable_tokens(turns: list[dict[str, Any]], block_size: int) -> list[int]:
    """Per turn, the prompt tokens a decode node could hold from the turn before: the full
    blocks of each conversation's previous prompt and answer (its last token never computed).
    0 for the first turn."""
    out = [0]
    for prev, cur in zip(turns, turns[1:]):
        held = {r["conversation"]: (r["prompt_tokens"] + r["output_tokens"] - 1) // block_size
                for r in prev["replies"]}  # fmt: skip
        out.append(block_size * sum(held.get(r["conversation"], 0) for r in cur["replies"]))
    return out


def compare_answers(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each P/D system's answers against the reference's, conversation by conversation and
    turn by turn (the same text, as both answered the same messages greedily)."""
    ref = results.get(REFERENCE)
    if ref is None:
        return {}

    def texts(res: dict) -> dict[tuple[int, int], str]:
        return {(r["conversation"], t["turn"]): r["text"]
                for t in res["turns"] for r in t["replies"] if not r["error"]}  # fmt: skip

    want = texts(ref)
    out = {}
    for system, res in results.items():
        if system == REFERENCE:
            continue
        got = texts(res)
        both = sorted(set(want) & set(got))
        bad = [k for k in both if got[k] != want[k]]
        out[system] = {"compared": len(both), "mismatches": len(bad), "where": bad}
    return out


# (system, baseline, the key of "overall" over turns 2+, target ratio, what)
GOALS = (
    ("conditional", "remote-nocache", "kv_bytes_after_turn_1", KV_GOAL, "KV bytes"),
    ("conditional", "colocated", "mean_ttft_ms_after_turn_1", 1.0, "mean TTFT"),
    ("threshold", "remote-nocache", "kv_bytes_after_turn_1", KV_GOAL, "KV bytes"),
    ("threshold", "colocated", "mean_ttft_ms_after_turn_1", 1.0, "mean TTFT"),
    ("conditional", "colocated", "mean_ttft_ms", 1.0, "mean TTFT"),
)


def evaluate_goals(results: dict[str, dict], turns: int) -> list[dict[str, Any]]:
    """The goals over turns 2+ and (TTFT) over all turns, each met, missed or not measured;
    turn by turn they read from the per-turn table."""

    def total(system: str, key: str) -> float | None:
        res = results.get(system)
        return res["overall"][key] if res and len(res["turns"]) == turns else None

    goals = []
    for system, base, key, target, what in GOALS:
        than = f"<= {target:.0%} of {base}'s" if target < 1 else f"<= {base}'s"
        which = "turns 2+" if key.endswith("_after_turn_1") else "all turns"
        name = f"{system}: {what} of {which} {than}"
        goals.append(rp.goal(name, total(system, key), total(base, key), "<=", target))
    return goals


def plot_turns(results: dict[str, dict], path: Path) -> Path:
    """Per turn: KV MB moved, mean TTFT and output tokens/s, one line per system."""
    panels = []
    for key, scale, title in (("kv_bytes", 1e-6, "KV moved into decode caches (MB)"),
                              ("mean_ttft_ms", 1.0, "mean TTFT (ms)"),
                              ("output_tokens_per_s", 1.0, "output tokens/s")):  # fmt: skip
        panel = rp.Panel(title, "turn", ymin=0)
        for system, res in results.items():
            xs, ys = [t["turn"] for t in res["turns"]], [t[key] * scale for t in res["turns"]]
            panel.lines.append((system, xs, ys, "o-"))
        panels.append(panel)
    return rp.plot_lines(panels, path)


def _mb(key: str) -> Any:
    return lambda r: f"{r[key] / 1e6:.2f}"


def _placed(r: dict[str, Any]) -> str:
    return f"{r['prefills_local']}/{r['prefills_remote']}"


TURN_COLUMNS = [
    ("turn", "turn"), ("system", "system"),
    ("ok/sent", lambda t: f"{t['completed']}/{t['completed'] + t['failed']}"),
    ("KV MB", _mb("kv_bytes")), ("local/remote", _placed), ("prompt tokens", "prompt_tokens"),
    ("cached", "cached_prompt_tokens"), ("reused on D", "kv_tokens_reused_on_decode"),
    ("sent", "kv_tokens_sent"), ("TTFT mean ms", "mean_ttft_ms"),
    ("TTFT med ms", "median_ttft_ms"), ("out tok/s", "output_tokens_per_s"),
]  # fmt: skip
OVERALL_COLUMNS = [
    ("system", "system"), ("KV MB, all turns", _mb("kv_bytes")),
    ("KV MB, turns 2+", _mb("kv_bytes_after_turn_1")), ("local/remote prefills", _placed),
    ("TTFT mean ms, all", "mean_ttft_ms"), ("TTFT mean ms, turns 2+", "mean_ttft_ms_after_turn_1"),
    ("out tok/s", "output_tokens_per_s"),
]  # fmt: skip


def answers_table(answers: dict[str, dict[str, Any]]) -> str:
    """Each P/D system's answers against the reference's, same conversation and turn."""
    columns = [
        ("system", "system"), ("answers compared", "compared"),
        (f"equal to {REFERENCE}'s", lambda a: a["compared"] - a["mismatches"]),
        ("mismatches", "mismatches"),
        ("where", lambda a: ", ".join(f"conversation {c} turn {t}" for c, t in a["where"][:4])
         or "—"),
    ]  # fmt: skip
    return rp.records_table(columns, [{**answers[s], "system": s} for s in SYSTEMS if s in answers])


def reuse_table(results: dict[str, dict], block_size: int) -> str:
    """What chat re-tokenization left of the reuse in turns 2+: the tokens the full blocks of
    each previous prompt and answer could cover, against what colocated's prefix cache served
    and what `remote`'s decode node reused."""
    rows = []
    for system, key in (("colocated", "cached_prompt_tokens"),
                        ("remote", "kv_tokens_reused_on_decode")):  # fmt: skip
        turns = results.get(system, {}).get("turns", [])
        could = sum(reusable_tokens(turns, block_size)[1:]) if len(turns) > 1 else 0
        if could:
            got = sum(t[key] for t in turns[1:])
            rows.append([system, key, could, got, f"{got / could:.0%}"])
    header = ["system", "counted as", "reusable tokens, turns 2+", "reused", "share"]
    return rp.markdown_table(header, rows)


def setup_table(report: dict[str, Any]) -> str:
    """Where and how the run was made, and the workload, one row each."""
    w = report["workload"]
    loads = [t["load_avg_1m"] for r in report["results"].values() for t in r["turns"]]
    rows = [
        *rp.setup_rows(report),
        ["block size, KV connector", f"{report['block_size']}, zmq"],
        compare.loads_row(loads, "at the turns' starts"),
        ["conversations x turns", f"{w['conversations']} x {w['turns']}"],
        ["first user message, tokens", w["first_len"]],
        ["later user messages, tokens", f"{w['message_len']} ± {w['range_ratio']:.0%}"],
        ["answer, tokens (greedy, `min_tokens` = `max_tokens`)", w["answer_len"]],
        ["seed", w["seed"]],
    ]  # fmt: skip
    return rp.markdown_table(["run", ""], rows)


def render_section(report: dict[str, Any], to: rp.Outputs, plot: Path | None) -> str:
    results = report["results"]
    most = max((len(r["turns"]) for r in results.values()), default=0)
    turns = [{**r["turns"][i], "system": s} for i in range(most)
             for s, r in results.items() if i < len(r["turns"])]  # fmt: skip
    overall = [{**r["overall"], "system": s} for s, r in results.items()]
    tables = [rp.records_table(OVERALL_COLUMNS, overall), rp.records_table(TURN_COLUMNS, turns)]
    data = to.link(to.folder / f"{SECTION}.json")
    title = "## Multi-turn chat: decode-side prefix cache and conditional disaggregation"
    return compare.scenario_page(report, f"{title} (`pdserve bench multiturn`)", {
        "": [setup_table(report), "\n".join(f"- `{s}`: {SYSTEM_SPECS[s].what}" for s in results)],
        "Goals": [rp.goals_table(report["goals"]), reuse_table(results, report["block_size"]),
                  answers_table(report["answers"])],
        "Results": [*tables, *([f"![multiturn]({to.link(plot)})"] if plot else []),
                    f"Raw results, every reply included: `{data}`."],
    })  # fmt: skip


def publish(report: dict[str, Any], to: rp.Outputs) -> None:
    """The JSON, the plot and the section of a report (fresh, or read back from JSON)."""
    results = {s: report["results"][s] for s in SYSTEMS if s in report["results"]}
    goals = evaluate_goals(results, report["workload"]["turns"])  # the goals as defined now
    report = {**report, "results": results, "goals": goals}
    to.folder.mkdir(parents=True, exist_ok=True)
    plot = plot_turns(results, to.folder / "multiturn.png") if results else None
    compare.write_report(report, to, SECTION, render_section(report, to, plot))
    print(answers_table(report["answers"]))


_W = load.ChatWorkload()
RUN_FLAGS = [
    ("--quick", bool, None, "tiny random model, 2 conversations x 2 short turns (needs --out)"),
    ("--conversations", int, None, f"default {_W.conversations}"),
    ("--turns", int, None, f"per conversation, default {_W.turns}"),
    ("--first-len", int, None, f"first message tokens, default {_W.first_len}"),
    ("--message-len", int, None, f"later messages' mean tokens (±{_W.range_ratio:.0%}%), "
     f"default {_W.message_len}"),
    ("--answer-len", int, None, f"tokens per answer, default {_W.answer_len}"),
]  # fmt: skip
MODEL_FLAGS = [
    ("--model", str, None, "a checkpoint directory or .gguf file (default: SmolLM2-135M-"
     "Instruct; quick: the tests' tiny random Llama)", {"metavar": "PATH"}),
]  # fmt: skip
WORKLOAD_FLAGS = ("conversations", "turns", "first_len", "message_len", "answer_len")


def parse_args(argv: list[str]) -> argparse.Namespace:
    files = "multiturn.json and multiturn.png"
    flags = (RUN_FLAGS, MODEL_FLAGS)
    p, _ = compare.scenario_parser("multiturn", __doc__, (SYSTEMS, SYSTEMS), flags, files)
    args = compare.parse_scenario(p, argv, SYSTEMS, SYSTEMS)
    base = QUICK_WORKLOAD if args.quick else load.ChatWorkload()
    given = {k: getattr(args, k) for k in WORKLOAD_FLAGS if getattr(args, k) is not None}
    try:
        args.workload = load.ChatWorkload(**{**asdict(base), **given, "seed": args.seed})
    except ValueError as exc:
        p.error(str(exc))
    args.outputs = rp.outputs_from_args(p, args)
    return args


def resolve_model(args: argparse.Namespace) -> tuple[str, str]:
    """MODEL as the nodes take it, and its description."""
    if args.model:
        return args.model, Path(args.model).name
    if args.quick:
        tiny = rp.cached_model(args.cache_dir, "tiny-llama", {})
        return str(tiny), "the tests' tiny random Llama"
    from pdserve.models import smollm2

    return str(smollm2()), "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every system through the conversations: the report's measured fields."""
    from pdserve.common.model.checkpoint import Checkpoint

    model, desc = resolve_model(args)
    # A GGUF's config and tokenizer are converted once here, not by every node at once.
    pool = load.load_pool(str(Checkpoint.resolve(model).hf_dir()))

    def measure_one(_: System, url: str, health: list[str], into: dict[str, Any]) -> None:
        into["turns"] = []
        asyncio.run(run_turns(url, health, pool, args, into["turns"]))

    with systems.sigterm_raises(), tempfile.TemporaryDirectory(prefix="bench-multiturn-") as tmp:
        args.log_dir = args.log_dir or Path(tmp)
        results, notes = systems.measure_systems(args, SYSTEM_SPECS, model, measure_one)
    for name, res in results.items():
        turns = res.setdefault("turns", [])
        res["overall"] = overall(turns)
        if failed := [t["turn"] for t in turns if t["failed"]]:
            notes.append(f"{name}: turn {failed[0]} had failed replies: {turns[-1]['errors']}")
    block = systems.engine_flag(args.engine_args, "--block-size", DEFAULT_BLOCK_SIZE)
    return compare.scenario_fields(args, model, desc, (results, notes), block_size=block,
                                   workload=asdict(args.workload),
                                   answers=compare_answers(results))  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return rp.bench_main(argv, parse_args, SECTION, measure, publish)


if __name__ == "__main__":
    main()
