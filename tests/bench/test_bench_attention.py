"""`pdserve bench attention --quick`: the report docs/benchmarks.md is built from has every
field, its numbers agree with each other, and both implementations gave the same outputs
(no timing thresholds)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from pdserve.bench import attention
from tests.bench.helpers import positive


def test_quick_run_reports_each_case_against_its_floor(tmp_path: Path) -> None:
    attention.main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "attention.json").read_text())
    assert positive(report["read_bytes_per_s"]["1"])
    rows = report["rows"]
    cases = {(r["batch"], r["context"], r["impl"]) for r in rows}
    assert cases == {(b, c, i) for b in (1, 2) for c in (64, 100) for i in attention.IMPLS}
    for r in rows:
        assert positive(r["ms"]) and positive(r["floor_ms"]) and r["max_abs_error"] < 1e-5
        # 12 heads over 4 KV heads of dim 64, float32: 2 KiB of K and V a token.
        lens = [r["context"] - (b * 5) % 16 for b in range(r["batch"])]
        assert r["kv_bytes"] == 2048 * sum(lens)
        assert math.isclose(r["gb_s"], r["kv_bytes"] / r["ms"] / 1e6)
        assert math.isclose(r["of_floor"], r["floor_ms"] / r["ms"])
        assert ("plan_ms" in r) == (r["impl"] == "in_place")
    section = (tmp_path / "benchmarks.md").read_text()
    assert (
        "<!-- BEGIN attention -->" in section
        and "| in_place |" in section
        and "| flash |" in section
    )
