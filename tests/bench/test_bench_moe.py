"""The MoE and MLA benchmarks (docs/benchmarks.md, "MoE and MLA"), quick and tiny: kv-transfer's
DeepSeek-V3 (MLA) and Llama-3-70B (GQA) layouts with the connectors' own byte counters, the
MoE/dense benchmark pair and offline's expert share of a step (no timing thresholds)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open

from pdserve.tiny_model import make_moe_bench_models
from tests.bench.helpers import quick_run

TOKENS = 32  # two blocks of 16
SIZES = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=512, max_position=512)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def test_mla_and_gqa_bytes_on_the_link_are_the_connectors_counts(tmp_path: Path) -> None:
    args = ["--layouts", "deepseek-v3,llama3-70b", "--tokens", str(TOKENS), "--repeats", "1"]
    quick_run("bench_kv_transfer.py", tmp_path, *args, "--connectors", "zmq,shm")
    report = json.loads((tmp_path / "kv_transfer.json").read_text())
    # per token and layer: one latent of 512 + 64 against K and V of 8 heads of 128, float32
    per_layer = {"deepseek-v3": (512 + 64) * 4, "llama3-70b": 2 * 8 * 128 * 4}
    layers = {"deepseek-v3": 61, "llama3-70b": 80}
    assert {(r["layout"], r["connector"]) for r in report["results"]} == {
        (lay, c) for lay in per_layer for c in ("zmq", "shm")
    }
    for r in report["results"]:
        expected = TOKENS * per_layer[r["layout"]] * layers[r["layout"]]
        assert r["ok"], r["errors"]
        assert r["bytes_sent"] == r["bytes_received"] == r["bytes"] == expected, r
    for name, layout in report["layouts"].items():
        assert layout["bytes_per_token"] == per_layer[name] * layers[name]
    assert report["layouts"]["deepseek-v3"]["planes"] == 1
    page = (tmp_path / "benchmarks.md").read_text()
    assert f"| {61 * 576 * 4} ({576 * 4}) |" in page  # counted bytes per token (per layer)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_moe_bench_models(tmp_path_factory.mktemp("pair"), experts=EXPERTS, **SIZES)


def parameters(model: Path) -> dict[str, list[int]]:
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        return {name: f.get_slice(name).get_shape() for name in f.keys()}


def numel(shapes: dict[str, list[int]], where: str) -> int:
    return sum(math.prod(shape) for name, shape in shapes.items() if where in name)


def test_moe_pair_has_the_same_weights_per_token(pair: tuple[Path, Path]) -> None:
    moe, dense = pair
    moe_shapes, dense_shapes = parameters(moe), parameters(dense)
    e, k, width, h = 4, 2, 32, SIZES["hidden"]
    assert json.loads((dense / "config.json").read_text())["intermediate_size"] == k * width
    # attention, norms and embeddings alike, name for name
    shared = {n: s for n, s in dense_shapes.items() if ".mlp." not in n}
    assert {n: s for n, s in moe_shapes.items() if ".mlp." not in n} == shared
    # a token multiplies by k experts of `width`: the dense MLP's weights; the rest are idle
    per_expert = 3 * h * width
    router = e * h
    moe_mlp, dense_mlp = numel(moe_shapes, ".mlp."), numel(dense_shapes, ".mlp.")
    assert dense_mlp == SIZES["layers"] * k * per_expert
    assert moe_mlp == SIZES["layers"] * (e * per_expert + router)


@pytest.mark.parametrize("which", ["moe", "dense"])
def test_offline_records_the_experts_share_of_each_step(pair, tmp_path: Path, which: str) -> None:
    model = pair[0] if which == "moe" else pair[1]
    quick_run("bench_offline.py", tmp_path, "--model", str(model), "--batch-sizes", "2")
    report = json.loads((tmp_path / "offline.json").read_text())
    assert ("4 experts of 32, top 2" in report["model"]["description"]) == (which == "moe")
    (row,) = report["results"]
    assert row["tokens_equal"], row["first_mismatch"]  # the MoE equals HF's greedy tokens too
    assert row["pdserve"]["decode_step_cpu_s"] > 0  # the process's CPU seconds per decode step
    shares = [row["pdserve"][f"{phase}_experts_share"] for phase in ("prefill", "decode")]
    if which == "moe":  # eager on CPU: the experts' torch path, timed inside the step
        assert all(0 < s < 1 for s in shares), shares
    else:
        assert shares == ["nan", "nan"]  # strict JSON's nan: no experts to time
