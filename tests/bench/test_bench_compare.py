"""pdserve bench compare --quick (scripts/bench_compare.py): both pdserve systems measured,
results, plots and the markdown section written into the given directory (nothing under
docs/)."""

from __future__ import annotations

import json

from pdserve.bench import compare as bc
from pdserve.bench.load import load_pool
from pdserve.bench.report import goal

SYSTEMS = ["pdserve-colocated", "pdserve-1p1d"]


def test_goal_status_follows_the_ratio():
    assert goal("g", 30.0, 10.0, ">=", 2.0)["status"] == "met"
    assert goal("g", 4.0, 10.0, "<=", 1 / 3)["status"] == "missed"
    assert goal("g", None, 10.0, "<=", 1.1)["status"] == "not measured"
    assert bc.batch_tokens(["--max-num-batched-tokens", "96"]) == 96
    assert bc.batch_tokens(["--max-num-batched-tokens=64", "--num-blocks", "9"]) == 64
    assert bc.batch_tokens([]) == 512


def test_quick_run_writes_results_plots_and_section(tmp_path):
    out = tmp_path / "out"
    argv = ["--quick", "--out", str(out), "--cache-dir", str(tmp_path / "cache")]
    report = bc.main([*argv, "--disable-tqdm", "--max-num-batched-tokens", "128"])
    assert report["systems"] == SYSTEMS and report["notes"] == []

    data = json.loads((out / "compare.json").read_text())
    runs = bc.scenario_runs(load_pool(data["model"]), bc.QUICK_SIZES, 0)
    keys = [f"{r.scenario}/{r.label}" for r in runs]
    assert set(data["results"]) == set(SYSTEMS)
    for system in SYSTEMS:
        assert sorted(data["results"][system]) == sorted(keys)
        for key, run in zip(keys, runs):
            res = data["results"][system][key]
            assert res["completed"] == len(run.requests) and res["failed"] == 0, res["errors"]
            assert res["output_len_mismatches"] == 0
        mixed = data["results"][system]["mixed/short+long"]["by_tag"]
        assert set(mixed) == {"short", "long"}
    assert data["engine_args"] == ["--max-num-batched-tokens", "128"]
    assert data["batch_tokens"] == 128
    goals = {g["goal"]: g["status"] for g in data["goals"]}
    assert len(goals) == 3
    assert [s for g, s in goals.items() if "transformers" in g] == ["not measured"]
    assert all(s in ("met", "missed") for g, s in goals.items() if "transformers" not in g)

    for name in ("compare_ttft.png", "compare_itl.png", "compare_throughput.png"):
        assert (out / name).stat().st_size > 1000, name
    doc = (out / "benchmarks.md").read_text()
    assert "<!-- BEGIN compare -->" in doc and "<!-- END compare -->" in doc
    assert "python scripts/bench_compare.py --quick" in doc
    assert all(system in doc for system in SYSTEMS)
    assert "![compare_ttft](compare_ttft.png)" in doc
    assert "CPU cores" in doc

    assert "engine_profile" not in doc and "profile" not in data

    # Redrawn from the JSON alone (nothing measured): the same section.
    again = tmp_path / "again"
    bc.main(["--from-json", str(out / "compare.json"), "--out", str(again)])
    redrawn = (again / "benchmarks.md").read_text()
    assert (
        redrawn.split("### Results")[1].split("### Plots")[0]
        == (doc.split("### Results")[1].split("### Plots")[0])
    )
    assert (again / "compare_throughput.png").exists()
