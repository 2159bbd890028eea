"""DeepSeek-V3: the grouped router and the MoE block against HF's, latent attention over the
paged cache against HF's attention layer (prompt in chunks, then decode), the absorbed decode
path against the expanded one, the latent cache's size, the loader, and the offline engine
against HF greedy token for token (float32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdserve.common.model.attention import AttentionMetadata
from pdserve.common.model.config import ModelArchConfig
from pdserve.common.model.deepseek import (
    DeepseekMoE,
    DeepseekRouter,
    DeepseekV3ForCausalLM,
    MlaAttention,
    deepseek_tensors,
)
from pdserve.common.model.llama import RotaryEmbedding
from pdserve.common.model.weights import load_model
from pdserve.common.wire.payloads import KVLayout
from pdserve.tiny_model import train_tokenizer
from tests.common.model.test_moe import assert_block_equals_hf
from tests.common.test_llm_equivalence import VOCAB, assert_matches_hf, run_engine

KV_LORA_RANK, ROPE_DIM = 32, 8
LATENT = KV_LORA_RANK + ROPE_DIM
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def hf_config(tokenizer: Any = None, **fields: Any) -> Any:
    """A tiny DeepSeek-V3: 3 layers (the first dense), 8 routed experts in 2 groups, top-2
    within the best group, one shared expert, q through a low-rank bottleneck."""
    from transformers import DeepseekV3Config

    ids = {}
    if tokenizer is not None:
        ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    base = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 48,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "kv_lora_rank": KV_LORA_RANK,
        "q_lora_rank": 24,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": ROPE_DIM,
        "v_head_dim": 16,
        "max_position_embeddings": 512,
        "initializer_range": 0.1,  # spread logits and router scores: no near-ties
    }
    return DeepseekV3Config(**{**base, **ids, **fields})


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Weights N(0, 0.1); vectors (norms, the choice bias) moved off their init, so a norm or
    bias left out shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            noise = torch.randn(param.shape, generator=gen) * 0.1
            param.add_(noise) if param.ndim == 1 else param.copy_(noise)
        for name, buf in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)


def make_tiny_deepseek(out) -> str:
    """A random checkpoint with a tokenizer, written by transformers' save_pretrained."""
    from transformers import AutoModelForCausalLM

    tokenizer = train_tokenizer(VOCAB, 512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(tokenizer), dtype=torch.float32)
    randomize(model, 0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture
def model_dir(deepseek_dir: str) -> str:
    """The session's tiny DeepSeek-V3 (tests/conftest.py)."""
    return deepseek_dir


def test_config_reads_mla_and_grouped_routing():
    config = ModelArchConfig.from_hf(hf_config())
    assert config.is_mla and config.moe_layers == (1, 2)  # first_k_dense_replace = 1
    assert (config.kv_lora_rank, config.qk_rope_head_dim, config.q_lora_rank) == (32, 8, 24)
    assert (config.n_group, config.topk_group, config.n_shared_experts) == (2, 1, 1)
    assert config.routed_scaling_factor == 2.5 and config.rope_interleave
    assert not ModelArchConfig.from_hf(hf_config(q_lora_rank=None)).q_lora_rank
    with pytest.raises(ValueError, match="groups"):
        ModelArchConfig.from_hf(hf_config(n_group=3))


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_equals_hf(renormalize):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = hf_config(norm_topk_prob=renormalize, n_group=4, topk_group=2, num_experts_per_tok=3)
    hf = DeepseekV3TopkRouter(config)
    randomize(hf, 1)
    ours = DeepseekRouter(ModelArchConfig.from_hf(config))
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = torch.randn(57, config.hidden_size)
    _, want_w, want_ids = hf(x)
    got_w, got_ids = ours(x)
    # Both take top-k unsorted: compare as dense [T, E] weights.
    dense = lambda w, ids: torch.zeros(57, 8).scatter(1, ids, w)  # noqa: E731
    torch.testing.assert_close(dense(got_w, got_ids), dense(want_w, want_ids))
    # The choice bias matters here: without it some token picks other experts.
    ours.e_score_correction_bias.data.zero_()
    assert not torch.equal(dense(*ours(x)), dense(got_w, got_ids))


def test_moe_block_equals_hf():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = hf_config()
    hf = DeepseekV3MoE(config).eval()
    randomize(hf, 2)
    assert_block_equals_hf(DeepseekMoE(ModelArchConfig.from_hf(config)), hf, config.hidden_size)


def _chunk_metadata(table: torch.Tensor, block_size: int, done: int, n: int) -> AttentionMetadata:
    """One sequence's step: tokens done..done+n, its blocks in `table`."""
    pos = torch.arange(done, done + n)
    slots = table[pos // block_size].long() * block_size + pos % block_size
    return AttentionMetadata(
        slot_mapping=slots,
        block_tables=table[None].int(),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([done + n], dtype=torch.int32),
        max_query_len=n,
        max_seq_len=done + n,
    )


@pytest.mark.parametrize(
    "fields",
    [{}, {"q_lora_rank": None, "rope_interleave": False, "rope_parameters": YARN}],
    ids=["q-lora-interleaved", "q-proj-yarn"],
)
def test_attention_layer_equals_hf(fields):
    """HF's layer over 18 tokens at once; ours writes them into a paged latent cache (shuffled
    blocks of 4) as a 10-token chunk, a 7-token chunk over the cached 10, then one decode
    token (the absorbed path); every output row equals HF's."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    config = hf_config(**fields)
    config._attn_implementation = "eager"
    hf = DeepseekV3Attention(config, layer_idx=0).eval()
    randomize(hf, 3)
    arch = ModelArchConfig.from_hf(config)
    ours = MlaAttention(arch, 0)
    ours.load_state_dict(hf.state_dict(), strict=True)
    s = 18
    x = torch.randn(s, config.hidden_size)
    mask = torch.full((s, s), -torch.inf).triu(1)[None, None]
    with torch.no_grad():
        cos_sin = DeepseekV3RotaryEmbedding(config)(x, torch.arange(s)[None])
        want = hf(x[None], cos_sin, mask)[0][0]
        cos, sin = RotaryEmbedding(arch)(torch.arange(s), x.dtype)
        block_size, table = 4, torch.tensor([3, 0, 5, 1, 4, 2])
        cache = torch.full((1, 6, block_size, 1, LATENT), torch.nan)  # unread rows stay NaN
        got = []
        for done, n in ((0, 10), (10, 7), (17, 1)):
            rows = slice(done, done + n)
            meta = _chunk_metadata(table, block_size, done, n)
            got.append(ours(x[rows], cos[rows], sin[rows], meta, cache))
    torch.testing.assert_close(torch.cat(got), want, atol=1e-5, rtol=1e-4)
    assert arch.rope_type == fields.get("rope_parameters", {}).get("rope_type", "default")


@pytest.mark.parametrize("q_len", [1, 5])
def test_absorbed_equals_expanded(q_len):
    arch = ModelArchConfig.from_hf(hf_config())
    layer = MlaAttention(arch, 0)
    randomize(layer, 4)
    gen = torch.Generator().manual_seed(q_len)
    latents = torch.randn(13, LATENT, generator=gen)
    q_nope = torch.randn(q_len, 4, 16, generator=gen)
    q_pe = torch.randn(q_len, 4, ROPE_DIM, generator=gen)
    with torch.no_grad():
        expanded = layer.expanded(q_nope, q_pe, latents)
        absorbed = layer.absorbed(q_nope, q_pe, latents)
    assert expanded.shape == (q_len, 4, 16)
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)


def test_loaded_weights_equal_hf_in_memory(model_dir):
    """save_pretrained writes one matrix per routed expert; loaded, they equal transformers'
    own stacked parameters (the router's choice bias too)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        assert "model.layers.2.mlp.experts.7.up_proj.weight" in set(f.keys())
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model, _ = load_model(model_dir, torch.float32, "cpu")
    assert isinstance(model, DeepseekV3ForCausalLM)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["MLP", "DeepseekMoE", "DeepseekMoE"]
    ours, theirs = model.state_dict(), hf.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_multi_token_prediction_layers_are_left_out():
    config = ModelArchConfig.from_hf(hf_config())
    t = torch.zeros(2)
    names = ["model.layers.2.input_layernorm.weight", "model.layers.3.eh_proj.weight"]
    names += ["model.norm.weight", "lm_head.weight"]
    kept = [n for n, _ in deepseek_tensors(((n, t) for n in names), config)]
    assert kept == [names[0], names[2], names[3]]


def test_the_cache_holds_one_latent_per_token(model_dir):
    from pdserve.common.engine.llm import LLM

    llm = LLM(model_dir, block_size=16, num_blocks=8, enforce_eager=False, dtype="float32")
    runner = llm.engine.runner
    assert runner.compiled is None  # asked to compile, MLA decodes eager (host-planned)
    assert [tuple(c.shape) for c in runner.kv_caches] == [(1, 8, 16, 1, LATENT)] * 3
    assert runner.kv_spec.block_bytes(16, torch.float32) == 16 * LATENT * 4
    layout = runner.kv_layout("m")
    assert (layout.planes, layout.num_kv_heads, layout.head_dim) == (1, 1, LATENT)
    assert layout.page_bytes == 16 * LATENT * 4 and layout.block_bytes == 3 * 16 * LATENT * 4
    assert layout.page_shape(5) == (1, 5, 16, 1, LATENT)


def test_kv_layouts_of_kv_models_are_unchanged():
    """A K/V layout's wire map and digest are those of before latent caches (planes left out
    of the digest when 2); a latent layout differs from it and round-trips."""
    kv = KVLayout("m", "bfloat16", num_layers=2, num_kv_heads=4, head_dim=64, block_size=16)
    assert kv.digest() == "1d9186a36b05fee532a023b4877aa02d64a526f1c45a6f8055c96f710b4087bb"
    body = kv.to_dict()
    del body["planes"]  # as a node from before latent caches sends it
    assert KVLayout.from_dict(body) == kv
    latent = KVLayout(
        "m", "bfloat16", num_layers=2, num_kv_heads=1, head_dim=576, block_size=16, planes=1
    )
    assert KVLayout.from_dict(latent.to_dict()) == latent
    assert latent.digest() != KVLayout(**{**latent.to_dict(), "planes": 2}).digest()
    with pytest.raises(ValueError, match="planes"):
        KVLayout("m", "bfloat16", 2, 1, 576, 16, planes=3)


def test_offline_greedy_matches_hf_with_prefix_caching(model_dir):
    _, outs = run_engine(model_dir, block_size=16, max_num_batched_tokens=4096)
    assert_matches_hf(model_dir, outs)
    assert outs[-1].num_cached_tokens > 0  # the repeated prompt hit the prefix cache
    assert outs[9].num_cached_tokens >= 96  # the shared 100-token prefix


def test_offline_greedy_matches_hf_with_chunked_prefill(model_dir):
    _, outs = run_engine(model_dir, block_size=32, max_num_batched_tokens=33)
    assert_matches_hf(model_dir, outs)
