"""scripts/bench_compile.py --quick, one batch size: the compiled engine gives the eager one's
tokens, and the report has the shape docs/benchmarks.md is built from (no timing thresholds)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.bench.helpers import positive, quick_run
from tests.common.model.test_compile import (
    COMPILE_WAIT_S,
    QWEN2_SLIDING,
    SHARES_QWEN2_PACKAGES,
    waits_for_a_compile,
)

# Each test may be the first to read `quick`, whose run compiles bucket 1 when
# test_compile.py has not yet (its 300 s default cut that run at load 15).
pytestmark = [SHARES_QWEN2_PACKAGES, waits_for_a_compile]


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("compile")
    # One batch size: one bucket to compile, the slow part of the run. One thread: compiled
    # kernels on cores that other tests keep busy can take seconds a step. The model, dtype
    # and thread count of tests/common/model/test_compile.py: its bucket 1 is this run's (the
    # compile cache keys each bucket apart), so the suite compiles that package once.
    model = str(tiny_model_dir("qwen2", **QWEN2_SLIDING))
    args = ("--model", model, "--dtype", "float32", "--batch-sizes", "1", "--threads", "1")
    quick_run("bench_compile.py", out, *args, timeout=COMPILE_WAIT_S)
    return out, json.loads((out / "compile.json").read_text())


def test_compiled_tokens_equal_eager_and_buckets_compile_once(quick) -> None:
    _, report = quick
    assert [r["batch"] for r in report["results"]] == [1]
    assert report["buckets"] == [1] and report["graphs_compiled"] == 1
    assert positive(report["compile_s"])
    for r in report["results"]:
        assert r["tokens_equal"], r["first_mismatch"]


def test_ratios_and_floors_are_consistent(quick) -> None:
    _, report = quick
    assert positive(report["read_bytes_per_s"]) and positive(report["copy_bytes_per_s"])
    for r in report["results"]:
        assert positive(r["floor_s"])
        for mode in ("eager", "compiled"):
            side = r[mode]
            assert positive(side["step_s"])
            assert side["tokens_per_s"] == pytest.approx(r["batch"] / side["step_s"])
            assert side["of_floor"] == pytest.approx(r["floor_s"] / side["step_s"])
        assert r["speedup"] == pytest.approx(r["eager"]["step_s"] / r["compiled"]["step_s"])


def test_writes_its_section_and_figure(quick) -> None:
    out, report = quick
    page = (out / "benchmarks.md").read_text()
    assert page.count("<!-- BEGIN compile -->") == 1 and page.count("<!-- END compile -->") == 1
    assert report["command"] in page and "![compiled decode](compile.png)" in page
    assert (out / "compile.png").stat().st_size > 0
    goals = [line for line in page.splitlines() if line.startswith("| compiled batch-1 ")]
    assert len(goals) == 2  # speedup and floor, met or missed, each with its ratio
    assert all(line.endswith(("| met |", "| missed |")) for line in goals), goals
    assert "| every sequence's compiled tokens equal eager's | 1 | 1 | 1 | met |" in page
    assert set(report["inductor_cache"]) == {"hit", "miss"}
