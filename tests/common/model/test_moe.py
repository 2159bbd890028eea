"""Qwen3-MoE and Mixtral: the batched expert block against a per-token reference and HF's own
block, the loader against per-expert and stacked checkpoints, and the offline engine against
HF greedy token for token (float32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from pdserve.common.model.config import ModelArchConfig
from pdserve.common.model.moe import (
    MoeForCausalLM,
    SparseMoeBlock,
    experts_gathered,
    experts_grouped,
    route,
    stack_experts,
)
from pdserve.common.model.weights import load_model
from pdserve.tiny_model import train_tokenizer
from tests.common.test_llm_equivalence import VOCAB, assert_matches_hf, run_engine

NUM_EXPERTS = 8
TOP_K = 2

# Three layers: layer 1 dense through mlp_only_layers, the others sparse.
QWEN3_MOE = {
    "num_hidden_layers": 3,
    "mlp_only_layers": [1],
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "num_experts": NUM_EXPERTS,
}
# Every Mixtral layer is sparse; its experts are intermediate_size wide.
MIXTRAL = {"num_hidden_layers": 2, "num_local_experts": NUM_EXPERTS, "sliding_window": 64}


def hf_config(arch: str, tokenizer: Any = None, **fields: Any) -> Any:
    """A tiny transformers config of `arch` (qwen3_moe or mixtral), several experts, top-2."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    cls, name = {
        "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM"),
        "mixtral": (MixtralConfig, "MixtralForCausalLM"),
    }[arch]
    ids = {}
    if tokenizer is not None:
        ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    return cls(
        architectures=[name],
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=512,
        initializer_range=0.1,  # spread logits and router scores: no near-ties
        **ids,
        **fields,
    )


def make_tiny_moe(arch: str, out: Path, **fields: Any) -> str:
    """A random checkpoint with a tokenizer, written by transformers' save_pretrained."""
    from transformers import AutoModelForCausalLM

    tokenizer = train_tokenizer(VOCAB, 512)
    config = hf_config(
        arch, tokenizer, **{**(QWEN3_MOE if arch == "qwen3_moe" else MIXTRAL), **fields}
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:  # norms away from 1, so a norm left out shows
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture
def model_dirs(moe_dirs: dict[str, str]) -> dict[str, str]:
    """The session's tiny Qwen3-MoE and Mixtral (tests/conftest.py)."""
    return moe_dirs


def naive_experts(x, gate_up, down, weights, ids) -> torch.Tensor:
    """One token and one chosen expert at a time: the definition, not a fast path."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, e in zip(weights[t], ids[t].tolist()):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += weight * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("run", [experts_grouped, experts_gathered])
@pytest.mark.parametrize("tokens", [1, 3, 37])
def test_batched_experts_equal_the_per_token_reference(run, tokens):
    gen = torch.Generator().manual_seed(tokens)
    h, i = 16, 24
    x = torch.randn(tokens, h, generator=gen)
    gate_up = torch.randn(NUM_EXPERTS, 2 * i, h, generator=gen) * 0.2
    down = torch.randn(NUM_EXPERTS, h, i, generator=gen) * 0.2
    logits = torch.randn(tokens, NUM_EXPERTS, generator=gen)
    weights, ids = route(logits, TOP_K, renormalize=False)
    got = run(x, gate_up, down, weights, ids)
    want = naive_experts(x, gate_up, down, weights, ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got.abs().sum() > 0


@pytest.mark.parametrize("run", [experts_grouped, experts_gathered])
def test_an_empty_batch_gives_an_empty_result(run):
    x, weights, ids = torch.zeros(0, 4), torch.zeros(0, TOP_K), torch.zeros(0, TOP_K).long()
    out = run(x, torch.randn(3, 6, 4), torch.randn(3, 4, 3), weights, ids)
    assert out.shape == (0, 4)


def test_routing_renormalizes_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    raw, ids = route(logits, 2, renormalize=False)
    scaled, same_ids = route(logits, 2, renormalize=True)
    assert ids.tolist() == same_ids.tolist() == [[0, 1]]
    assert raw.sum().item() < 0.99
    torch.testing.assert_close(scaled.sum(-1), torch.ones(1))
    torch.testing.assert_close(scaled, raw / raw.sum())


@pytest.mark.parametrize(
    "arch,fields",
    [
        ("qwen3_moe", {"num_experts": NUM_EXPERTS, "moe_intermediate_size": 32}),
        (
            "qwen3_moe",
            {"num_experts": NUM_EXPERTS, "moe_intermediate_size": 32, "norm_topk_prob": True},
        ),
        ("mixtral", {"num_local_experts": NUM_EXPERTS}),
    ],
)
def test_block_equals_hf_sparse_moe_block(arch, fields):
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = hf_config(arch, **fields)
    hf_cls = Qwen3MoeSparseMoeBlock if arch == "qwen3_moe" else MixtralSparseMoeBlock
    torch.manual_seed(1)
    hf = hf_cls(config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, 0.1)
    assert_block_equals_hf(SparseMoeBlock(ModelArchConfig.from_hf(config)), hf, config.hidden_size)


def assert_block_equals_hf(ours: torch.nn.Module, hf: torch.nn.Module, hidden: int) -> None:
    """Our MoE block, given HF's block's weights (same names and shapes), on a [2, 19] batch:
    HF's output on the flat [38] tokens."""
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = torch.randn(2, 19, hidden)
    with torch.no_grad():
        want = hf(x)
        got = ours(x.view(-1, hidden)).view_as(x)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_config_resolves_sparse_layers():
    qwen = ModelArchConfig.from_hf(
        hf_config("qwen3_moe", num_hidden_layers=6, mlp_only_layers=[3], decoder_sparse_step=2)
    )
    assert qwen.moe_layers == (1, 5)  # every second layer, less layer 3
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.qk_norm) == (128, TOP_K, True)
    assert not qwen.norm_topk_prob  # Qwen3-MoE's default
    mixtral = ModelArchConfig.from_hf(hf_config("mixtral", num_hidden_layers=3, sliding_window=8))
    assert mixtral.moe_layers == (0, 1, 2) and mixtral.norm_topk_prob
    assert mixtral.moe_intermediate_size == 48 and not mixtral.qk_norm
    assert mixtral.sliding_layers == (0, 1, 2) and mixtral.sliding_window == 8
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelArchConfig.from_hf(hf_config("mixtral", num_local_experts=1))


def test_dense_and_sparse_layers_where_the_config_says(model_dirs):
    model, config = load_model(model_dirs["qwen3_moe"], torch.float32, "cpu")
    assert isinstance(model, MoeForCausalLM) and config.moe_layers == (0, 2)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["SparseMoeBlock", "MLP", "SparseMoeBlock"]
    assert model.model.layers[1].mlp.gate_proj.weight.shape == (48, 64)  # intermediate_size


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_loaded_weights_equal_hf_in_memory(model_dirs, arch):
    """save_pretrained writes one matrix per expert (Mixtral's as block_sparse_moe w1/w2/w3),
    as Hub checkpoints do; loaded, they equal transformers' own stacked parameters."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with safe_open(f"{model_dirs[arch]}/model.safetensors", "pt") as f:
        stored = list(f.keys())
    per_expert = "block_sparse_moe.experts.7.w3" if arch == "mixtral" else "mlp.experts.7.up_proj"
    assert any(per_expert in name for name in stored)
    hf = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32)
    model, _ = load_model(model_dirs[arch], torch.float32, "cpu")
    ours, theirs = model.state_dict(), hf.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_stacked_checkpoint_loads_as_well(model_dirs, tmp_path):
    """A checkpoint written with the stacked names (as transformers holds them) needs no
    stacking; both forms load to the same weights."""
    import shutil

    src = Path(model_dirs["qwen3_moe"])
    want, _ = load_model(src, torch.float32, "cpu")
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    save_file(
        {k: v.contiguous() for k, v in want.state_dict().items()}, tmp_path / "model.safetensors"
    )
    got, _ = load_model(tmp_path, torch.float32, "cpu")
    for name, tensor in want.state_dict().items():
        assert torch.equal(got.state_dict()[name], tensor), name


def test_incomplete_experts_are_named(model_dirs, tmp_path):
    import shutil

    from safetensors.torch import load_file

    src = Path(model_dirs["mixtral"])
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    state = load_file(src / "model.safetensors")
    del state["model.layers.1.block_sparse_moe.experts.5.w1.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as err:
        load_model(tmp_path, torch.float32, "cpu")
    message = str(err.value)
    assert "missing weights (1): model.layers.1.mlp.experts.gate_up_proj" in message
    # The layer's other gate and up matrices (7 + 8) come back under their own names.
    assert "unexpected weights (15): model.layers.1.mlp.experts.0.gate_proj.weight" in message
    assert "model.layers.0.mlp" not in message  # layer 0 stacked as usual


def test_stacking_keeps_expert_order_whatever_the_file_order():
    config = ModelArchConfig.from_hf(hf_config("mixtral", num_local_experts=3))
    gen = torch.Generator().manual_seed(0)
    parts = {
        f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight": torch.randn(4, 2, generator=gen)
        for e in range(3)
        for w in ("w1", "w2", "w3")
    }
    shuffled = sorted(parts.items(), key=lambda kv: hash(kv[0][::-1]) % 97)
    stacked = dict(stack_experts(shuffled, config))
    assert stacked.keys() == {
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    }
    gate_up = stacked["model.layers.0.mlp.experts.gate_up_proj"]
    for e in range(3):
        prefix = f"model.layers.0.block_sparse_moe.experts.{e}"
        assert torch.equal(gate_up[e, :4], parts[f"{prefix}.w1.weight"])  # gate rows first
        assert torch.equal(gate_up[e, 4:], parts[f"{prefix}.w3.weight"])
        assert torch.equal(
            stacked["model.layers.0.mlp.experts.down_proj"][e], parts[f"{prefix}.w2.weight"]
        )


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_offline_greedy_matches_hf_with_prefix_caching(model_dirs, arch):
    _, outs = run_engine(model_dirs[arch], block_size=16, max_num_batched_tokens=4096)
    assert_matches_hf(model_dirs[arch], outs)
    assert outs[-1].num_cached_tokens > 0  # the repeated prompt hit the prefix cache
    assert outs[9].num_cached_tokens >= 96  # the shared 100-token prefix


def test_offline_greedy_matches_hf_with_chunked_prefill(model_dirs):
    """Mixtral in chunks of a 33-token budget (all three families are chunked through real
    prefill and decode processes in tests/e2e/test_moe_serving.py)."""
    model_dir = model_dirs["mixtral"]
    _, outs = run_engine(model_dir, block_size=32, max_num_batched_tokens=33)
    assert_matches_hf(model_dir, outs)
