"""scripts/bench_router.py, a short run: fake nodes' tokens come through one router and two
intact, and the report has the shape docs/benchmarks.md is built from (no timing thresholds)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.router import completion, pin_plan

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_router.py"
CONCURRENCY = (4,)
MAX_TOKENS = 12


def positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> tuple[Path, dict, Path]:
    out = tmp_path_factory.mktemp("router")
    model = tiny_model_dir("llama")
    cmd = [sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--model", str(model)]
    cmd += ["--concurrency", ",".join(map(str, CONCURRENCY)), "--max-tokens", str(MAX_TOKENS)]
    cmd += ["--duration", "1", "--warmup", "0.3"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, json.loads((out / "router_ceiling.json").read_text()), model


def test_tokens_arrive_intact_through_each_router(run) -> None:
    _, report, model = run
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)  # the router's own tokenizer class
    ids = report["token_ids"]
    assert ids and all(isinstance(i, int) for i in ids)
    expected = tok.decode([ids[i % len(ids)] for i in range(MAX_TOKENS)])
    assert report["expected_text"] == expected and expected.strip()
    assert len(report["probes"]) == 2  # one per router
    for probe in report["probes"]:
        assert probe["status"] == 200 and not probe["error"], probe
        assert probe["text"] == expected
        assert probe["completion_tokens"] == MAX_TOKENS
        assert probe["finish_reason"] == "length"
        assert probe["chunks"] >= MAX_TOKENS  # one token per `tokens` message, one per chunk
    fakes = report["fake_nodes"]
    assert fakes["prefills"] >= sum(r["requests"] for r in report["rows"]) + 2
    assert fakes["tokens"] == fakes["prefills"] * MAX_TOKENS == fakes["messages"]


def test_every_row_measures_clean_traffic(run) -> None:
    _, report, _ = run
    rows = report["rows"]
    assert {(r["pin"], r["routers"], r["concurrency"]) for r in rows} == {
        ("split", k, n) for k in (1, 2) for n in CONCURRENCY
    }
    for r in rows:
        assert r["requests"] > 0 and r["errors"] == 0 and r["corrupt"] == 0, r
        assert r["output_tokens"] == r["requests"] * MAX_TOKENS
        assert r["chunks"] >= r["output_tokens"]
        assert positive(r["requests_per_s"]) and positive(r["tokens_per_s"])
        for key in ("ttft_ms", "latency_ms"):
            assert set(r[key]) == {"p50", "p90", "p99"}
            assert all(positive(v) for v in r[key].values())
            assert r[key]["p50"] <= r[key]["p99"]
        cpu = r["cpu_cores_used"]
        assert len(cpu["routers"]) == r["routers"]
        assert set(cpu) == {"routers", "fakes", "clients", "machine", "other"}
        assert positive(r["router_cpu_ms_per_request"]) and positive(r["router_cpu_us_per_token"])
        assert set(r["cpus"]) == {"load", "router0"} | ({"router1"} if r["routers"] > 1 else set())


def test_report_has_machine_command_and_page(run) -> None:
    out, report, _ = run
    m = report["machine"]
    assert m["cpu_count"] >= 1 and m["platform"] and m["cpus_allowed"]
    assert report["command"].startswith("python scripts/bench_router.py --quick")
    assert report["sizes"]["max_tokens"] == MAX_TOKENS
    page = (out / "benchmarks.md").read_text()
    assert "## Router ceiling: one router against two (`pdserve bench router`)" in page
    assert "<!-- BEGIN router -->" in page and "<!-- END router -->" in page
    assert (out / "router_ceiling.png").stat().st_size > 0


def test_requests_cycle_the_prompts_and_ask_for_usage() -> None:
    first, fifth = completion(0, 7), completion(4, 7)
    assert first == fifth and first["stream"] and first["max_tokens"] == 7
    assert first["stream_options"] == {"include_usage": True}
    assert completion(1, 7)["prompt"] != first["prompt"]


def test_pin_plans() -> None:
    assert pin_plan("split", 1, [0, 1]) == {"router0": [1], "router1": [1], "load": [0]}
    assert pin_plan("split", 2, [0, 1]) == {"router0": [1], "router1": [1], "load": [0]}
    assert pin_plan("split", 2, range(8)) == {
        "router0": [7],
        "router1": [6],
        "load": [0, 1, 2, 3, 4, 5],
    }
    assert pin_plan("shared", 2, [0, 1]) == {"router0": [0, 1], "router1": [0, 1], "load": [0, 1]}
