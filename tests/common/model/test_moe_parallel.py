"""Tensor and expert parallelism for Qwen3-MoE, Mixtral and DeepSeek-V3: what each rank holds
(on the meta device), that the ranks' partial expert sums add up to the whole block's, the
error when experts do not split, and the engine at TP 2 with and without expert parallelism
(its worker rank a process, on gloo) against HF greedy token for token (float32); a prefill
node at TP 2 feeding a decode node at TP 1 for Qwen3-MoE."""

from __future__ import annotations

import pytest
import torch

from pdserve.common.engine.llm import LLM
from pdserve.common.model.config import ModelArchConfig
from pdserve.common.model.moe import Experts, experts_gathered, experts_grouped, route
from pdserve.common.model.parallel import TPGroup, TPShard
from pdserve.common.model.registry import model_class
from tests.common.model.test_mla import hf_config as deepseek_config
from tests.common.model.test_moe import MIXTRAL, QWEN3_MOE, make_tiny_moe
from tests.common.model.test_moe import hf_config as moe_config
from tests.common.node import test_tp_nodes
from tests.common.node.test_tp_nodes import PROMPTS as NODE_PROMPTS
from tests.common.node.test_tp_nodes import answers, free, pair, serve, settle
from tests.common.test_llm_equivalence import GREEDY, PROMPTS, hf_greedy

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")
# Prompts of 1, 40, 160 and 121 tokens: a decode batch of four, prompts over several blocks.
CHOSEN = (0, 4, 6, 9)
# Each rank on one thread: the machine's two cores hold both.
TP2 = {"tensor_parallel_size": 2, "threads_per_rank": 1, "skip_tokenizer_init": True}

# test_tp_nodes' autouse fixture, used here: it gives this process back the torch threads a
# group's rank 0 takes.
keep_threads = test_tp_nodes.keep_threads


@pytest.fixture
def model_dirs(moe_dirs: dict[str, str], deepseek_dir: str) -> dict[str, str]:
    """The session's tiny checkpoints (tests/conftest.py): HF's answers for them are
    computed once, by whichever module asks first."""
    return {**moe_dirs, "deepseek_v3": deepseek_dir}


def arch_of(family: str, **fields) -> ModelArchConfig:
    """The tiny configs the checkpoints below are made of, with `fields` changed."""
    if family == "deepseek_v3":
        return ModelArchConfig.from_hf(deepseek_config(**fields))
    base = QWEN3_MOE if family == "qwen3_moe" else MIXTRAL
    return ModelArchConfig.from_hf(moe_config(family, **{**base, **fields}))


def shapes(arch: ModelArchConfig, shard: TPShard | None) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape in the model a rank with `shard` builds (None: the whole)."""
    tp = None if shard is None else TPGroup(shard, None, "unused")
    with torch.device("meta"):
        model = model_class(arch)(arch, tp)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


# (parameter, its shape at TP 2, at TP 2 with expert parallelism) on every rank. The tiny
# configs: hidden 64, 8 experts, 4 query heads; Qwen3-MoE and Mixtral heads of 16, experts
# 32 and 48 wide, dense MLPs 48; DeepSeek experts 32 wide, one shared, heads of q 16 + 8 rope
# and v 16, latent 32 + 8, q_lora_rank 24.
HELD = {
    "qwen3_moe": [
        ("model.layers.0.mlp.experts.gate_up_proj", (8, 32, 64), (4, 64, 64)),
        ("model.layers.0.mlp.experts.down_proj", (8, 64, 16), (4, 64, 32)),
        ("model.layers.0.mlp.gate.weight", (8, 64), (8, 64)),  # the router, whole
        ("model.layers.1.mlp.up_proj.weight", (24, 64), (24, 64)),  # a dense layer
        ("model.layers.0.self_attn.q_proj.weight", (32, 64), (32, 64)),
        ("model.layers.0.self_attn.k_norm.weight", (16,), (16,)),  # per head, whole
    ],
    "mixtral": [
        ("model.layers.1.mlp.experts.gate_up_proj", (8, 48, 64), (4, 96, 64)),
        ("model.layers.1.mlp.experts.down_proj", (8, 64, 24), (4, 64, 48)),
        ("model.layers.1.self_attn.o_proj.weight", (64, 32), (64, 32)),
    ],
    "deepseek_v3": [
        ("model.layers.1.mlp.experts.gate_up_proj", (8, 32, 64), (4, 64, 64)),
        ("model.layers.1.mlp.gate.weight", (8, 64), (8, 64)),
        ("model.layers.1.mlp.gate.e_score_correction_bias", (8,), (8,)),
        ("model.layers.1.mlp.shared_experts.gate_proj.weight", (16, 64), (16, 64)),
        ("model.layers.1.mlp.shared_experts.down_proj.weight", (64, 16), (64, 16)),
        ("model.layers.0.mlp.gate_proj.weight", (24, 64), (24, 64)),
        ("model.layers.0.self_attn.q_a_proj.weight", (24, 64), (24, 64)),
        ("model.layers.0.self_attn.q_b_proj.weight", (48, 24), (48, 24)),
        ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", (40, 64), (40, 64)),
        ("model.layers.0.self_attn.kv_a_layernorm.weight", (32,), (32,)),
        ("model.layers.0.self_attn.kv_b_proj.weight", (64, 32), (64, 32)),
        ("model.layers.0.self_attn.o_proj.weight", (64, 32), (64, 32)),
    ],
}


@pytest.mark.parametrize("experts_whole", [False, True], ids=["tp", "ep"])
@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_holds_its_share(family: str, experts_whole: bool) -> None:
    """The named parameters have their expected shapes on both ranks, and `TPShard.shard`
    cuts every checkpoint tensor to exactly the shape the rank's model holds."""
    arch = arch_of(family)
    whole = shapes(arch, None)
    for rank in range(2):
        shard = TPShard(rank, 2, experts_whole)
        shard.check(arch)
        held = shapes(arch, shard)
        assert held.keys() == whole.keys()
        for name, at_tp, at_ep in HELD[family]:
            assert held[name] == (at_ep if experts_whole else at_tp), name
        for name, shape in whole.items():
            assert tuple(shard.shard(name, torch.zeros(shape), arch).shape) == held[name], name
    if arch.is_mla:  # every rank caches the whole latent
        cls = model_class(arch)
        assert cls.kv_cache_spec(arch, TPShard(1, 2)) == cls.kv_cache_spec(arch)


def test_gate_and_up_rows_are_sliced_apart() -> None:
    """A rank's stacked gate_up rows are its slice of the gate rows, then of the up rows."""
    arch = arch_of("qwen3_moe")
    full = torch.randn(8, 64, 64)  # [E, 2I, H], I = 32
    gate, up = full[:, :32], full[:, 32:]
    name = "model.layers.0.mlp.experts.gate_up_proj"
    got = TPShard(1, 2).shard(name, full, arch)
    assert torch.equal(got, torch.cat([gate[:, 16:], up[:, 16:]], dim=1))
    assert torch.equal(TPShard(1, 2, expert_parallel=True).shard(name, full, arch), full[4:])


@pytest.mark.parametrize("run", [experts_grouped, experts_gathered])
@pytest.mark.parametrize("experts_whole", [False, True], ids=["tp", "ep"])
def test_ranks_partial_sums_add_up_to_the_whole(run, experts_whole: bool) -> None:
    """Each rank's Experts over its shard of the weights; the sum of the partials (what the
    all-reduce computes) equals the unsharded block's output, on either expert path."""
    arch = arch_of("mixtral")
    gen = torch.Generator().manual_seed(3)
    whole = Experts(arch)
    for param in whole.parameters():
        param.data = torch.randn(param.shape, generator=gen) * 0.2
    x = torch.randn(29, 64, generator=gen)
    weights, ids = route(torch.randn(29, 8, generator=gen), 2, renormalize=True)
    want = run(x, whole.gate_up_proj, whole.down_proj, weights, ids)
    partials = []
    for rank in range(4):
        shard = TPShard(rank, 4, experts_whole)
        part = Experts(arch, shard)
        for name, param in part.named_parameters():
            param.data = shard.shard(f"mlp.experts.{name}", getattr(whole, name).data, arch)
        local = part.local_ids(ids)
        held = part.gate_up_proj.shape[0]
        assert held == (2 if experts_whole else 8)
        # Under expert parallelism a rank meets pairs of other ranks' experts and skips them.
        assert (local == held).any() == experts_whole
        partials.append(run(x, part.gate_up_proj, part.down_proj, weights, local))
    assert all(p.abs().sum() > 0 for p in partials)
    torch.testing.assert_close(sum(partials), want, atol=1e-5, rtol=1e-5)


def test_expert_parallel_needs_experts_that_split(tmp_path) -> None:
    """6 experts on 4 ranks: expert parallelism is refused naming both numbers, before any
    worker starts; tensor parallelism alone splits each expert's width instead."""
    arch = arch_of("mixtral", num_local_experts=6)
    TPShard(0, 4).check(arch)
    with pytest.raises(ValueError, match="6 experts do not split across 4 ranks"):
        TPShard(0, 4, expert_parallel=True).check(arch)
    model = make_tiny_moe("mixtral", tmp_path / "six", num_local_experts=6)
    with pytest.raises(ValueError, match="6 experts do not split across 4 ranks"):
        LLM(model, **{**TP2, "tensor_parallel_size": 4}, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="expert intermediate size 32 does not split across 3"):
        TPShard(0, 3).check(arch_of("deepseek_v3", num_attention_heads=3, num_key_value_heads=3))


# Each family once, TP or EP: the split itself is checked for both on every path above
# (partial sums), so these are the whole engine's check; DeepSeek under EP adds its shared
# experts to the reduce, and at TP its MLA prefill node is tested in test_mla_nodes.py.
@pytest.mark.parametrize(
    ("family", "experts_whole"),
    [("qwen3_moe", True), ("mixtral", False), ("deepseek_v3", True)],
    ids=["qwen3_moe-ep", "mixtral-tp", "deepseek_v3-ep"],
)
def test_greedy_at_tp2_equals_hf(model_dirs, family: str, experts_whole: bool) -> None:
    model_dir = model_dirs[family]
    hf_tokens, _ = hf_greedy(model_dir)
    prompts = [PROMPTS[i] for i in CHOSEN]
    with LLM(model_dir, dtype="float32", enable_expert_parallel=experts_whole, **TP2) as llm:
        outs = llm.generate(prompts, GREEDY)
        llm.engine.check_integrity()
        layer = llm.engine.runner.model.model.layers[-1]
        held = layer.mlp.experts.gate_up_proj.shape[0]
    assert held == (4 if experts_whole else 8)
    for i, out in zip(CHOSEN, outs, strict=True):
        assert out.token_ids == hf_tokens[i], f"prompt {i}"


def test_the_flag_reaches_the_engine_and_serve_hands_it_to_the_nodes(model_dirs) -> None:
    import argparse

    from pdserve.common.node.cli import add_engine_args, engine_configs
    from pdserve.serve import _engine_flags

    p = argparse.ArgumentParser()
    p.add_argument("--model")
    add_engine_args(p)
    args = p.parse_args(["--model", model_dirs["mixtral"], "--enable-expert-parallel"])
    assert engine_configs(args)[0].enable_expert_parallel
    assert "--enable-expert-parallel" in _engine_flags(args)
    plain = p.parse_args(["--model", model_dirs["mixtral"]])
    assert not engine_configs(plain)[0].enable_expert_parallel
    assert "--enable-expert-parallel" not in _engine_flags(plain)


def test_prefill_at_tp2_feeds_decode_at_tp1(model_dirs) -> None:
    """Qwen3-MoE through P/D: a prefill node at TP 2 (experts and KV heads split) sends each
    decode-rank slice; the answers equal the engine's at TP 1 (itself equal to HF)."""
    model = model_dirs["qwen3_moe"]
    expected = answers(model)
    with pair(model, 2, 1, "zmq") as (router, prefill, decode_):
        before = (free(prefill), free(decode_))
        for i, prompt in enumerate(NODE_PROMPTS):
            assert serve(router, prefill, decode_, f"r{i}", prompt, 2) == expected[i], i
        settle(prefill, decode_, before)
        assert (free(prefill), free(decode_)) == before
