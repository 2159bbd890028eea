"""Mixture-of-experts GGUF files: the session's tiny Qwen3-MoE and Mixtral written as llama.cpp's
converter writes them (stacked expert tensors; Mixtral as "llama" with experts, q/k permuted),
read back to the same weights and run to the same greedy tokens as their HF originals; and
DeepSeek-V3's "deepseek2", which transformers builds no config for, refused by name."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="gguf is a pdserve dependency: install pdserve")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.common.model.checkpoint import Checkpoint  # noqa: E402
from pdserve.common.model.config import ModelArchConfig  # noqa: E402
from pdserve.common.model.gguf import permute_rotary, read_raw_tensors  # noqa: E402
from pdserve.common.model.moe import stack_experts  # noqa: E402
from pdserve.common.model.weights import load_model  # noqa: E402
from tests.common.model.test_gguf import (  # noqa: E402
    add_gpt2_tokenizer,
    add_model_metadata,
    write_tensors,
)
from tests.common.model.test_moe import make_tiny_moe  # noqa: E402

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}
# The largest difference from the original a Q8_0 block (scale max/127, f16) can leave on
# weights of these tiny models (about N(0, 0.1)).
Q8_0_TOLERANCE = 0.01


@pytest.fixture(scope="module")
def gguf_moe_dirs(moe_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The session's Mixtral, and a Qwen3-MoE with every layer sparse: the gguf library's
    qwen3moe tensors have no dense MLP (the session's has one dense layer)."""
    out = tmp_path_factory.mktemp("qwen3moe-sparse")
    return {**moe_dirs, "qwen3_moe": make_tiny_moe("qwen3_moe", out, mlp_only_layers=[])}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))


def original_weights(model_dir: str) -> dict[str, np.ndarray]:
    """The HF checkpoint's tensors under our parameter names (experts stacked)."""
    config = ModelArchConfig.from_dir(model_dir)
    tensors = load_file(Path(model_dir) / "model.safetensors").items()
    return {name: t.float().numpy() for name, t in stack_experts(tensors, config)}


def _add_metadata(w, arch: ModelArchConfig, prefix: str) -> None:
    add_model_metadata(w, arch)
    w.add_key_length(arch.head_dim)
    w.add_value_length(arch.head_dim)
    w.add_expert_count(arch.num_experts)
    w.add_expert_used_count(arch.num_experts_per_tok)
    if prefix == "llama":
        w.add_rope_dimension_count(arch.head_dim)
    else:
        w.add_expert_feed_forward_length(arch.moe_intermediate_size)


def _gguf_tensors(
    weights: dict[str, np.ndarray], arch: ModelArchConfig, prefix: str
) -> dict[str, np.ndarray]:
    """Our parameters under llama.cpp's names: gate_up_proj split into the gate and up expert
    stacks, a "llama" file's q/k rows permuted."""
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[prefix.upper()], arch.num_layers)
    out = {}
    for name, array in weights.items():
        if name.endswith("gate_up_proj"):
            stem = name.removesuffix("gate_up_proj")
            for half, part in zip(("gate_proj", "up_proj"), np.split(array, 2, axis=1)):
                out[name_map.get_name(stem + half) + ".weight"] = part
            continue
        if prefix == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = arch.num_heads if "q_proj" in name else arch.num_kv_heads
            array = permute_rotary(array, heads)
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        out[gguf_name if gguf_name.endswith(".weight") else gguf_name + ".weight"] = array
    return out


def write_moe_gguf(model_dir: str, out: Path, qtype: Q = Q.F32) -> Path:
    """An MoE HF directory as llama.cpp's converter writes it: matrices and expert stacks in
    `qtype`, norms F32 (and, as the converter falls back, rows not whole blocks of it)."""
    arch = ModelArchConfig.from_dir(model_dir)
    prefix = GGUF_ARCH["mixtral" if arch.architecture == "MixtralForCausalLM" else "qwen3_moe"]
    w = gguf.GGUFWriter(str(out), prefix)
    _add_metadata(w, arch, prefix)
    add_gpt2_tokenizer(w, Path(model_dir))
    tensors = {}
    for name, array in _gguf_tensors(original_weights(model_dir), arch, prefix).items():
        whole = array.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0
        tensors[name] = (array, qtype if array.ndim >= 2 and whole else Q.F32)
    write_tensors(w, tensors)
    return out


def _loaded(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {n: p.detach().float().numpy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_gguf_reads_back_the_weights_and_generates_as_its_original(
    gguf_moe_dirs: dict[str, str], tmp_path: Path, family: str
) -> None:
    model_dir = gguf_moe_dirs[family]
    path = write_moe_gguf(model_dir, tmp_path / f"{family}.gguf")
    got, want = ModelArchConfig.from_dir(path), ModelArchConfig.from_dir(model_dir)
    # GGUF stores eps as float32, the tokenizer's eos only, and no sliding window for "llama".
    same = {"rms_norm_eps": got.rms_norm_eps, "eos_token_ids": got.eos_token_ids}
    if family == "mixtral":
        same |= {"sliding_window": got.sliding_window, "sliding_layers": got.sliding_layers}
    assert got == dataclasses.replace(want, **same)
    model, _ = load_model(path, torch.float32, "cpu")
    weights, original = _loaded(model), original_weights(model_dir)
    assert weights.keys() == original.keys()
    for name, array in original.items():
        np.testing.assert_array_equal(weights[name], array, err_msg=name)
    if family == "qwen3_moe":  # transformers' own reader of the file sees the original too
        assert_transformers_reads(path, original)
    # Prompts inside Mixtral's 64-token window: the GGUF runs without one, as llama.cpp does.
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 300, 42], list(range(40, 80))]
    outs = {m: LLM(str(m), dtype="float32").generate(prompts, params) for m in (model_dir, path)}
    assert [o.token_ids for o in outs[path]] == [o.token_ids for o in outs[model_dir]]


def assert_transformers_reads(path: Path, original: dict[str, np.ndarray]) -> None:
    """transformers' GGUF loader (its own name map and expert stacking) finds the original
    weights in the file: the layout written here is the one llama.cpp's readers expect. It is
    given pdserve's config: its own lacks the expert width (768 by default, not the file's)."""
    from transformers import AutoModelForCausalLM

    config = Checkpoint.resolve(path).hf_config()
    hf = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float32
    )
    state = {n: t.numpy() for n, t in hf.state_dict().items()}
    for name, array in original.items():
        np.testing.assert_array_equal(state[name], array, err_msg=name)


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_a_q8_0_moe_gguf_reads_back_within_the_types_error(
    gguf_moe_dirs: dict[str, str], tmp_path: Path, quantization: str
) -> None:
    """Q8_0 expert stacks come dequantized (float) under every mode; under `auto` the
    attention linears stay int8 and the rest reads as with `none`."""
    model_dir = gguf_moe_dirs["qwen3_moe"]
    path = write_moe_gguf(model_dir, tmp_path / "q8.gguf", Q.Q8_0)
    model, _ = load_model(path, torch.bfloat16, "cpu", quantization=quantization)
    original = original_weights(model_dir)
    weights = _loaded(model)
    if quantization == "auto":
        assert type(model.model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
        assert not any(n.endswith("q_proj.weight") for n in weights)
    for name, array in weights.items():
        tolerance = Q8_0_TOLERANCE if original[name].ndim >= 2 else 0.0
        bf16 = np.abs(array).max() / 128  # the loaded copy is bfloat16
        assert np.abs(array - original[name]).max() <= tolerance + bf16, name
    stacks = [n for n in weights if n.endswith(("gate_up_proj", "down_proj")) and ".experts" in n]
    assert len(stacks) == 2 * len(ModelArchConfig.from_dir(model_dir).moe_layers)


def test_raw_expert_stacks_come_joined_and_dequantized(
    gguf_moe_dirs: dict[str, str], tmp_path: Path
) -> None:
    model_dir = gguf_moe_dirs["mixtral"]
    path = write_moe_gguf(model_dir, tmp_path / "q8.gguf", Q.Q8_0)
    arch = ModelArchConfig.from_dir(model_dir)
    names = list(original_weights(model_dir))
    args = (path, names, arch.num_layers, arch.num_heads, arch.num_kv_heads)
    raws = {t.name: t for t in read_raw_tensors(*args)}
    assert raws.keys() == set(names)
    gate_up = raws["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.qtype_name == "F32"
    assert gate_up.shape == (arch.num_experts, 2 * arch.moe_intermediate_size, arch.hidden_size)
    assert raws["model.layers.0.self_attn.q_proj.weight"].qtype_name == "Q8_0"


def test_a_gguf_missing_an_up_stack_names_the_gate_half(
    gguf_moe_dirs: dict[str, str], tmp_path: Path
) -> None:
    model_dir = gguf_moe_dirs["qwen3_moe"]
    arch = ModelArchConfig.from_dir(model_dir)
    tensors = _gguf_tensors(original_weights(model_dir), arch, "qwen3moe")
    del tensors["blk.0.ffn_up_exps.weight"]
    w = gguf.GGUFWriter(str(tmp_path / "cut.gguf"), "qwen3moe")
    _add_metadata(w, arch, "qwen3moe")
    add_gpt2_tokenizer(w, Path(model_dir))
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"unexpected weights.*layers\.0\.mlp\.experts\.gate_proj"):
        load_model(tmp_path / "cut.gguf", torch.float32, "cpu")


def test_deepseek2_is_refused_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "ds.gguf"
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'deepseek2' \\(transformers' GGUF reader builds no"):
        Checkpoint.resolve(path).hf_config()
    # The reason holds: transformers itself refuses the file (when it stops, load it).
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="deepseek2 is not supported"):
        AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
