"""The compile cache's key and directory (common/engine/compile_cache.py): a changed model,
torch, code or engine flag never reads another's compiled graphs, and engines that differ only in
their bucket lists share the buckets they have in common. That a second start compiles nothing is
tested with a real second process in tests/common/model/test_compile.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pdserve.common.engine.compile_cache import DIR_ENV, cache_root, compile_key
from pdserve.common.engine.config import ModelConfig
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.model.config import ModelArchConfig

FLAGS = {"block_size": 16, "device": "cpu", "tp": None}


@pytest.fixture(scope="module")
def arch(tiny_model_dir) -> ModelArchConfig:
    return ModelArchConfig.from_dir(tiny_model_dir("llama"))


def digest(base: ModelArchConfig, **changes: object) -> str:
    given = {"model": torch.nn.Linear(2, 2), "arch": base, "dtype": torch.float32}
    given.update(flags=FLAGS, code="c0")
    return compile_key(**{**given, **changes}).digest()


def test_the_same_model_and_flags_give_the_same_key(arch: ModelArchConfig) -> None:
    assert digest(arch) == digest(arch, model=torch.nn.Linear(2, 2))  # weights' values aside


def test_a_changed_model_gives_another_key(arch: ModelArchConfig) -> None:
    deeper = dataclasses.replace(arch, num_layers=arch.num_layers + 1)
    keys = {
        digest(arch),
        digest(arch, arch=deeper),
        digest(arch, dtype=torch.bfloat16),
        digest(arch, model=torch.nn.Conv1d(2, 2, 1)),  # another class of the same shapes
    }
    assert len(keys) == 4


def test_changed_torch_code_or_flags_give_another_key(
    arch: ModelArchConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = {
        digest(arch),
        digest(arch, code="c1"),
        digest(arch, flags={**FLAGS, "block_size": 32}),
        digest(arch, flags={**FLAGS, "tp": "0/2"}),
    }
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    keys.add(digest(arch))
    assert len(keys) == 5


def runner_key(arch: ModelArchConfig, buckets: tuple[int, ...], block_size: int = 16) -> str:
    """The key a compiling ModelRunner's `_compile_cache` gives (its attributes stood in)."""
    compiled = SimpleNamespace(buckets=buckets)
    runner = SimpleNamespace(compiled=compiled, block_size=block_size, tp=None, arch=arch,
                             model=torch.nn.Linear(2, 2), dtype=torch.float32,
                             device=torch.device("cpu"))  # fmt: skip
    cache = ModelRunner._compile_cache(runner, ModelConfig(model_dir="unused"))
    return cache.key.digest()


def test_engines_with_other_bucket_lists_share_a_bucket(arch: ModelArchConfig) -> None:
    """A bucket is one package, the same graph whatever the other buckets: the key leaves the
    list out, so the suite's buckets 1, 2, 4 and another module's bucket 1 compile it once."""
    assert runner_key(arch, (1,)) == runner_key(arch, (1, 2, 4)) == runner_key(arch, (1, 2))
    assert runner_key(arch, (1,), block_size=32) != runner_key(arch, (1,))


def test_another_thread_count_gives_another_key(
    arch: ModelArchConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU kernels fix their parallel loops' thread count when compiled."""
    before = digest(arch)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    assert digest(arch) != before


def test_cache_root_is_the_flag_then_the_environment_then_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "env"))
    assert cache_root(str(tmp_path / "flag")) == tmp_path / "flag"
    assert cache_root(None) == tmp_path / "env"
    monkeypatch.delenv(DIR_ENV)
    assert cache_root(None) == Path.home() / ".cache" / "pdserve" / "compile"
