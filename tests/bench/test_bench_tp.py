"""scripts/bench_tp.py --quick: a decode row per TP size (the all-reduce's share where there
are several ranks) and a KV-transfer row per (prefill TP, decode TP) mapping, each slice
verified by its receiver; the figure and section written (no timing thresholds)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_reports_every_tp_and_mapping(tmp_path: Path) -> None:
    cmd = [sys.executable, str(REPO / "scripts" / "bench_tp.py"), "--quick", "--out", str(tmp_path)]
    proc = subprocess.run(
        cmd + ["--threads", "2"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "tp.json").read_text())
    assert [r["tp"] for r in report["decode"]] == [1, 2]
    for r in report["decode"]:
        assert math.isfinite(r["step_s"]) and r["step_s"] > 0
        assert math.isclose(r["tokens_per_s"], r["batch"] / r["step_s"])
    assert 0 < report["decode"][1]["all_reduce_share"] and report["decode"][1]["all_reduce_ms"] > 0
    mappings = [(r["p"], r["d"]) for r in report["kv"]]
    assert mappings == [(1, 1), (2, 2), (1, 2), (2, 1), (1, 4), (4, 1)]
    assert report["kv"][0]["of_tp1"] == 1.0
    assert len({r["bytes"] for r in report["kv"]}) == 1  # the same bytes in every mapping
    page = (tmp_path / "benchmarks.md").read_text()
    assert "<!-- BEGIN tp -->" in page and (tmp_path / "tp.png").stat().st_size > 0
