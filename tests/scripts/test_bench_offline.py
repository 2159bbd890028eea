"""scripts/bench_offline.py --quick: pdserve's LLM and HF generate on a tiny model give the same
tokens, and the report has the shape docs/benchmarks.md is built from (no timing thresholds)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.bench.helpers import positive, quick_run


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("offline")
    quick_run("bench_offline.py", out, timeout=180)
    return out, json.loads((out / "offline.json").read_text())


def test_pdserve_tokens_equal_hf(quick) -> None:
    _, report = quick
    assert [r["batch"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        assert r["tokens_equal"], r["first_mismatch"]
        assert r["matching_sequences"] == r["batch"] and r["first_mismatch"] is None
        # one prefill step that samples the first token, then one step per further token
        assert r["steps"] >= report["max_tokens"]


def test_throughput_and_floors_are_sane(quick) -> None:
    _, report = quick
    assert positive(report["floors"]["copy_bytes_per_s"])
    for r in report["results"]:
        for side in ("pdserve", "hf"):
            for key in ("tokens_per_s", "wall_s", "prefill_s", "decode_step_s"):
                assert positive(r[side][key]), (side, key)
            new_tokens = r["batch"] * report["max_tokens"]
            assert r[side]["tokens_per_s"] == pytest.approx(new_tokens / r[side]["wall_s"])
        assert r["ratio"] == pytest.approx(r["pdserve"]["tokens_per_s"] / r["hf"]["tokens_per_s"])
        for floor in ("decode_floor", "prefill_floor"):
            assert positive(r[floor]["floor_s"])
            assert positive(r[floor]["pdserve"]) and positive(r[floor]["hf"])
        decode = r["decode_floor"]
        for key in ("bytes_per_step", "flops", "compute_floor_s", "pdserve_roofline"):
            assert positive(decode[key]), key
        assert decode["pdserve_roofline"] >= decode["pdserve"]
        assert positive(r["prefill_floor"]["flops"]) and positive(r["prefill_floor"]["gemm_flop_s"])


def test_bigger_batches_need_more_bytes_and_flops(quick) -> None:
    _, report = quick
    one, two = report["results"]
    assert two["decode_floor"]["bytes_per_step"] > one["decode_floor"]["bytes_per_step"]
    assert two["prefill_floor"]["flops"] == pytest.approx(2 * one["prefill_floor"]["flops"])


def test_plot_and_section_land_in_out(quick) -> None:
    out, report = quick
    assert (out / "offline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "benchmarks.md").read_text()
    section = page.split("<!-- BEGIN offline -->")[1].split("<!-- END offline -->")[0]
    assert report["command"] in section and "--quick" in report["command"]
    goals = [line for line in section.splitlines() if line.startswith("| every sequence's tok")]
    assert goals == ["| every sequence's tokens equal HF's | 3 | 3 | 1 | met |"]
    assert report["model"]["params"] > 0 and "2 layers" in report["model"]["description"]
