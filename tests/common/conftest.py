"""Tiny mixture-of-experts checkpoints made once per session: several modules serve them
(offline, at TP, through nodes), and HF's greedy reference (`hf_greedy`, cached by
directory) is then computed once per model too."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    """Qwen3-MoE and Mixtral (tests/common/model/test_moe.py's configs)."""
    from tests.common.model.test_moe import make_tiny_moe

    root = tmp_path_factory.mktemp("moe")
    return {a: make_tiny_moe(a, root / a) for a in ("qwen3_moe", "mixtral")}


@pytest.fixture(scope="session")
def deepseek_dir(tmp_path_factory) -> str:
    """DeepSeek-V3 (tests/common/model/test_mla.py's config)."""
    from tests.common.model.test_mla import make_tiny_deepseek

    return make_tiny_deepseek(tmp_path_factory.mktemp("deepseek"))
