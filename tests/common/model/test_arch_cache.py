"""ModelArchConfig.from_dir keeps what transformers read in the cache: the second read equals
the first (and transformers' own), without importing transformers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.common.model.checkpoint import Checkpoint
from pdserve.common.model.config import ModelArchConfig
from pdserve.tiny_model import make_tiny_model

CASES = {
    "llama": {},
    "llama-rope-llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "qwen2-window": {"sliding_window": 8},
    "qwen3": {},
    "mistral-window": {"sliding_window": 8},
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_cached_config_equals_transformers_reading(case, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model = make_tiny_model(case.split("-")[0], tmp_path / "m", **CASES[case])
    checkpoint = Checkpoint.resolve(model)
    direct = ModelArchConfig.from_hf(checkpoint.hf_config(), checkpoint.generation_config())
    first = ModelArchConfig.from_dir(model)  # reads through transformers, writes the cache
    assert list((tmp_path / "cache" / "arch").glob("*.json")), "nothing was cached"
    again = ModelArchConfig.from_dir(model)  # from the cache
    assert first == direct and again == direct
    # A changed config.json is another key: never a stale answer.
    config = model / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    assert ModelArchConfig.from_dir(model).rms_norm_eps == 1e-05


def test_a_cached_read_does_not_import_transformers(tmp_path):
    model = make_tiny_model("llama", tmp_path / "m")
    env = {"PDSERVE_CACHE_DIR": str(tmp_path / "cache")}
    code = (
        "import sys; from pdserve.common.model.config import ModelArchConfig as A; "
        f"a = A.from_dir({str(model)!r}); print('transformers' in sys.modules)"
    )
    run = lambda: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    import os

    env.update({k: v for k, v in os.environ.items() if k != "PDSERVE_CACHE_DIR"})
    first, second = run(), run()
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert first.stdout.strip() == "True"  # the first read needs transformers
    assert second.stdout.strip() == "False"
