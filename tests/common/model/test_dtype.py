"""`--dtype auto`: the decision table, the checkpoint's dtype, the CPU probe, and ModelConfig
resolving `auto` once into a concrete dtype."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from pdserve import LLM
from pdserve.common.engine.config import ModelConfig
from pdserve.common.model import dtype
from pdserve.common.node.cli import add_engine_args, engine_configs


def _checkpoint(tmp_path: Path, **config: object) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return str(tmp_path)


def _cpu(monkeypatch: pytest.MonkeyPatch, flag: str | None) -> None:
    monkeypatch.setattr(dtype, "cpu_bf16_flag", lambda: flag)


def _no_probe() -> str | None:
    raise AssertionError("a concrete dtype must not probe the CPU")


@pytest.mark.parametrize(
    ("stored", "device", "bf16", "want"),
    [
        ("float32", "cpu", True, "bfloat16"),
        ("bfloat16", "cpu", True, "bfloat16"),
        ("float16", "cpu", True, "bfloat16"),  # torch's CPU fp16 matmuls trail bf16's
        (None, "cpu", True, "bfloat16"),
        ("bfloat16", "cpu", False, "float32"),
        ("float16", "cpu", False, "float32"),
        ("float32", "cuda", False, "bfloat16"),
        ("bfloat16", "cuda:1", False, "bfloat16"),
        ("float16", "cuda", False, "float16"),
        (None, "cuda", False, "bfloat16"),
    ],
)
def test_the_decision(stored: str | None, device: str, bf16: bool, want: str) -> None:
    assert dtype.choose_dtype(stored, device, bf16) == want


def test_the_checkpoint_dtype(tmp_path: Path) -> None:
    for key, value, want in [
        ("torch_dtype", "bfloat16", "bfloat16"),
        ("torch_dtype", "float16", "float16"),
        ("dtype", "float32", "float32"),  # transformers 5 writes this name
        ("torch_dtype", "int8", None),  # not a float type we run
        ("other", "x", None),
    ]:
        assert dtype.checkpoint_dtype(_checkpoint(tmp_path, **{key: value})) == want, key
    assert dtype.checkpoint_dtype(str(tmp_path / "missing")) is None
    gguf_dir = tmp_path / "g"
    gguf_dir.mkdir()
    (gguf_dir / "m.gguf").write_bytes(b"GGUF")
    assert dtype.checkpoint_dtype(str(gguf_dir / "m.gguf")) == "bfloat16"
    assert dtype.checkpoint_dtype(str(gguf_dir)) == "bfloat16"


@pytest.mark.parametrize(
    ("flags", "capability", "want"),
    [
        ("fpu avx512f avx512_bf16 avx512_vnni", "AVX512", "avx512_bf16"),
        ("fpu avx512f amx_tile amx_bf16 avx512_bf16", "AVX512", "amx_bf16"),
        ("fpu avx2 avx512f", "AVX512", None),  # AVX512 without its bf16 instructions
        ("fpu avx512f avx512_bf16", "AVX2", None),  # torch told to use AVX2 kernels
    ],
)
def test_the_cpu_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: str, capability: str, want: str | None
) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("".join(f"processor\t: {i}\nflags\t\t: {flags}\n\n" for i in range(2)))
    monkeypatch.setattr(dtype, "_torch_cpu_capability", lambda: capability)
    assert dtype.cpu_bf16_flag(cpuinfo) == want
    assert dtype.cpu_bf16_flag(tmp_path / "no-such-file") is None


def test_model_config_resolves_auto_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = _checkpoint(tmp_path, torch_dtype="float16")
    _cpu(monkeypatch, "amx_bf16")
    with caplog.at_level(logging.INFO, logger=dtype.__name__):
        config = ModelConfig(model)
    assert config.dtype == "bfloat16"
    assert "dtype auto: bfloat16 (checkpoint float16, cpu amx_bf16)" in caplog.text
    _cpu(monkeypatch, None)
    assert ModelConfig(model).dtype == "float32"
    assert ModelConfig(model, device="cuda").dtype == "float16"
    # A concrete dtype is kept as given; a config rebuilt from its fields (a TP worker's) keeps
    # the resolved one and never probes again.
    monkeypatch.setattr(dtype, "cpu_bf16_flag", _no_probe)
    assert ModelConfig(model, dtype="float32").dtype == "float32"
    assert ModelConfig(**dataclasses.asdict(config)).dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        ModelConfig(model, dtype="bf16")


def test_auto_is_the_default_of_the_flag_and_of_llm(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args([])
    args.model = str(tiny_model_dir("llama"))
    _cpu(monkeypatch, "avx512_bf16")
    assert engine_configs(args)[0].dtype == "bfloat16"
    _cpu(monkeypatch, None)
    assert engine_configs(args)[0].dtype == "float32"
    assert p.parse_args(["--dtype", "float32"]).dtype == "float32"
    _cpu(monkeypatch, "avx512_bf16")
    llm = LLM(args.model, skip_tokenizer_init=True, num_blocks=8)
    assert llm.engine.model_config.dtype == "bfloat16"
    assert llm.engine.runner.dtype == torch.bfloat16  # the KV cache and the weights
    assert llm.engine.runner.kv_caches[0].dtype == torch.bfloat16
