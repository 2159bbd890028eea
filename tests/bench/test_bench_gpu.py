"""pdserve.bench.gpu (bench gpu and bench kernels) off a GPU: their CPU-side parts (the model
they build, the KV part's flags, tables, what they do without CUDA); the measurements need a
GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.bench import gpu, kv_transfer
from pdserve.common.model.config import ModelArchConfig


def test_help_works_without_a_gpu() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.bench.gpu", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.startswith("usage: pdserve bench gpu")
    assert "--parts" in done.stdout and "--out" in done.stdout


def test_the_8b_model_matches_the_kv_benchmarks_8b_layout(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(gpu.LLAMA3_8B))
    arch = ModelArchConfig.from_dir(tmp_path)
    layout = kv_transfer.make_layouts("cuda")["llama3-8b"]
    assert (arch.num_layers, arch.num_kv_heads, arch.head_dim) == (
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
    )
    assert layout.block_size == gpu.BLOCK_SIZE and layout.dtype == "bfloat16"


def test_the_kv_part_passes_flags_the_kv_benchmark_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --device cuda is checked
    args = kv_transfer.parse_args(gpu.kv_transfer_argv(tmp_path))
    assert args.device == "cuda" and args.layouts == ["llama3-8b"]
    assert args.tokens == [2048, 8192] and args.max_bytes == 2 << 30 and args.repeats == 3
    assert args.outputs.folder == tmp_path / "kv"  # where bench_kv_transfer reads the JSON


def test_table_makes_a_column_of_every_key() -> None:
    text = gpu.table([{"batch": 1, "ms": 0.5}, {"batch": 8, "gb_s": 2000.0}])
    assert text.splitlines() == [
        "| batch | ms | gb_s |",
        "|---|---|---|",
        "| 1 | 0.5 |  |",
        "| 8 |  | 2,000 |",
    ]


def test_without_cuda_gpu_refuses_and_kernels_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        gpu.main(["--out", str(tmp_path / "g")])
    out = tmp_path / "k.json"
    assert gpu.kernels_main(["--out", str(out)]) == 0
    assert "needs a CUDA device" in capsys.readouterr().out and not out.exists()
