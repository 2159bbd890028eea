"""Our Llama-family model over a paged KV cache must give HF transformers' logits (float32)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.common.model.attention import AttentionMetadata
from pdserve.common.model.config import ModelArchConfig
from pdserve.common.model.llama import LlamaFamilyForCausalLM
from pdserve.common.model.weights import load_model

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
BLOCK_SIZE = 16
NUM_BLOCKS = 12
PROMPT_LEN = 40
ATOL = 1e-4

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so the head's frequencies fall in all three llama3 bands.
    "original_max_position_embeddings": 64,
}

# (arch, overrides): each changes something a wrong model would get wrong.
VARIANTS = {
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "yarn-rope": (
        "qwen2",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "max_position": 2048},
    ),
    # Equal to default below max_position_embeddings; checks the init path runs.
    "dynamic-rope": ("mistral", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "llama-bias-gqa1": ("llama", {"attention_bias": True, "mlp_bias": True, "kv_heads": 1}),
    "qwen3-wide-head": ("qwen3", {"head_dim": 32, "attention_bias": True}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    # Window 8 with the first layer full: Qwen slides only from max_window_layers on.
    "qwen2-sliding": ("qwen2", {"sliding_window": 8, "max_window_layers": 1}),
    "mistral-sliding": ("mistral", {"sliding_window": 8}),
}


class PagedSequence:
    """One sequence's tokens scattered over shuffled physical blocks of a fresh KV cache."""

    def __init__(self, config: ModelArchConfig, length: int, seed: int, caches=None) -> None:
        gen = torch.Generator().manual_seed(seed)
        n_blocks = -(-length // BLOCK_SIZE)
        self.blocks = torch.randperm(NUM_BLOCKS, generator=gen)[:n_blocks]
        self.token_ids = torch.randint(0, config.vocab_size, (length,), generator=gen)
        shape = (2, NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        self.kv_caches = caches or [torch.zeros(shape) for _ in range(config.num_layers)]

    def slots(self, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return self.blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE


def _metadata(seqs: list[PagedSequence], spans: list[tuple[int, int]]) -> AttentionMetadata:
    """Flat-batch metadata where sequence i computes its tokens spans[i] = (start, end)."""
    q_lens = [end - start for start, end in spans]
    width = max(len(s.blocks) for s in seqs)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, s in enumerate(seqs):
        tables[i, : len(s.blocks)] = s.blocks
    return AttentionMetadata(
        slot_mapping=torch.cat([s.slots(a, b) for s, (a, b) in zip(seqs, spans, strict=True)]),
        block_tables=tables,
        query_start_loc=torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32),
        seq_lens=torch.tensor([end for _, end in spans], dtype=torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=max(end for _, end in spans),
    )


def _step(
    model: LlamaFamilyForCausalLM, seqs: list[PagedSequence], spans: list[tuple[int, int]]
) -> torch.Tensor:
    """One forward over the given spans of several sequences; logits of every new token."""
    ids = torch.cat([s.token_ids[a:b] for s, (a, b) in zip(seqs, spans, strict=True)])
    positions = torch.cat([torch.arange(a, b) for a, b in spans])
    hidden = model(ids, positions, _metadata(seqs, spans), seqs[0].kv_caches)
    return model.compute_logits(hidden)


def _hf_logits(model_dir: Path, token_ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(token_ids[None]).logits[0].float()


def _assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    diff = (ours - theirs).abs().max().item()
    assert diff <= ATOL, f"max abs logit difference {diff:.2e} > {ATOL}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def _check_against_hf(model_dir: Path, fused: bool = False) -> None:
    model, config = load_model(model_dir, torch.float32, "cpu")
    if fused:
        model.fuse_projections()
    seq = PagedSequence(config, PROMPT_LEN, seed=1)
    expected = _hf_logits(model_dir, seq.token_ids)
    _assert_close(_step(model, [seq], [(0, PROMPT_LEN)]), expected)

    # Prefill a prefix into a fresh cache, then decode the rest one token per step.
    seq = PagedSequence(config, PROMPT_LEN, seed=1)
    prefill = 23
    rows = [_step(model, [seq], [(0, prefill)])]
    rows += [_step(model, [seq], [(t, t + 1)]) for t in range(prefill, PROMPT_LEN)]
    _assert_close(torch.cat(rows), expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_hf(tiny_model_dir: Callable[..., Path], arch: str) -> None:
    _check_against_hf(tiny_model_dir(arch))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_matches_hf(tiny_model_dir: Callable[..., Path], variant: str) -> None:
    arch, overrides = VARIANTS[variant]
    _check_against_hf(tiny_model_dir(arch, **overrides))


@pytest.mark.parametrize("variant", ["llama-bias-gqa1", "qwen3-wide-head", "qwen2-sliding"])
def test_fused_projections_match_hf(tiny_model_dir: Callable[..., Path], variant: str) -> None:
    """q/k/v and gate/up joined (as the runner does on GPUs): same logits, biases included."""
    arch, overrides = VARIANTS[variant]
    _check_against_hf(tiny_model_dir(arch, **overrides), fused=True)
    model, _ = load_model(tiny_model_dir(arch, **overrides), torch.float32, "cpu")
    model.fuse_projections()
    names = {name for name, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in names)


def test_mixed_batch_chunk_and_decode(tiny_model_dir: Callable[..., Path]) -> None:
    """A chunk with a cached prefix and another sequence's decode token share one forward."""
    model_dir = tiny_model_dir("qwen3")
    model, config = load_model(model_dir, torch.float32, "cpu")
    a = PagedSequence(config, PROMPT_LEN, seed=2)
    # b shares a's cache tensors but owns other blocks, as two requests of one engine do.
    b = PagedSequence(config, 31, seed=3, caches=a.kv_caches)
    b.blocks = torch.tensor([i for i in range(NUM_BLOCKS) if i not in a.blocks.tolist()][:2])
    _step(model, [a], [(0, 20)])
    _step(model, [b], [(0, 30)])
    logits = _step(model, [a, b], [(20, PROMPT_LEN), (30, 31)])
    _assert_close(logits[:-1], _hf_logits(model_dir, a.token_ids)[20:])
    _assert_close(logits[-1:], _hf_logits(model_dir, b.token_ids)[30:])


def test_config_fields(tiny_model_dir: Callable[..., Path]) -> None:
    qwen2 = ModelArchConfig.from_dir(tiny_model_dir("qwen2", sliding_window=8, max_window_layers=1))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    assert (qwen2.sliding_window, qwen2.sliding_layers) == (8, (1,))
    assert qwen2.layer_sliding_window(0) is None and qwen2.layer_sliding_window(1) == 8
    # config.json names </s>; generation_config.json adds the ChatML end of turn.
    assert qwen2.eos_token_ids == (2, 4)
    mistral = ModelArchConfig.from_dir(tiny_model_dir("mistral"))
    assert mistral.sliding_window is None and mistral.head_dim == 16
    llama3 = ModelArchConfig.from_dir(tiny_model_dir("llama", rope_scaling=LLAMA3_ROPE))
    assert llama3.rope_type == "llama3"
    assert llama3.rope_scaling_dict()["low_freq_factor"] == 1.0


def test_config_transformers4_style() -> None:
    """4.x configs keep rope_theta apart and may spell rope_scaling's type as "type"."""
    hf = SimpleNamespace(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        rope_theta=1e6,
        rope_scaling={"type": "yarn", "factor": 4.0},
        use_sliding_window=True,
        sliding_window=32,
        max_window_layers=2,
        eos_token_id=[7, 8],
    )
    config = ModelArchConfig.from_hf(hf, SimpleNamespace(eos_token_id=9))
    assert (config.rope_type, config.rope_theta) == ("yarn", 1e6)
    assert config.rope_scaling_dict() == {"factor": 4.0, "original_max_position_embeddings": 256}
    assert (config.head_dim, config.num_kv_heads, config.tie_word_embeddings) == (16, 2, False)
    assert (config.sliding_window, config.sliding_layers) == (32, (2,))
    assert config.eos_token_ids == (7, 8, 9)


def test_unsupported_architecture_is_rejected() -> None:
    from transformers import GPT2Config, LlamaConfig

    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelArchConfig.from_hf(GPT2Config(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="hidden_act"):
        ModelArchConfig.from_hf(LlamaConfig(hidden_act="gelu"))


def _state(model: LlamaFamilyForCausalLM) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def test_sharded_checkpoint_loads(tiny_model_dir: Callable[..., Path]) -> None:
    sharded = tiny_model_dir("llama", max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    whole, _ = load_model(tiny_model_dir("llama"), torch.float32, "cpu")
    parts, _ = load_model(sharded, torch.float32, "cpu")
    assert _state(parts).keys() == _state(whole).keys()
    for name, tensor in _state(whole).items():
        assert torch.equal(_state(parts)[name], tensor), name


def test_tied_embeddings_share_one_tensor(tiny_model_dir: Callable[..., Path]) -> None:
    model_dir = tiny_model_dir("qwen2", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(model_dir / "model.safetensors")
    model, config = load_model(model_dir, torch.float32, "cpu")
    assert config.tie_word_embeddings and model.lm_head is None
    hidden = torch.randn(3, config.hidden_size)
    expected = hidden @ model.model.embed_tokens.weight.T
    torch.testing.assert_close(model.compute_logits(hidden), expected)


def _rewrite_weights(src: Path, dst: Path, edit: Callable[[dict], None]) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_weight_is_named(tiny_model_dir: Callable[..., Path], tmp_path: Path) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    bad = _rewrite_weights(tiny_model_dir("llama"), tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"missing weights \(1\): {name}"):
        load_model(bad, torch.float32, "cpu")


def test_unexpected_weight_is_named(tiny_model_dir: Callable[..., Path], tmp_path: Path) -> None:
    def add_extra(tensors: dict) -> None:
        tensors["model.layers.0.extra.weight"] = torch.zeros(2)
        # Old checkpoints store rope buffers; those are skipped, never "unexpected".
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)

    bad = _rewrite_weights(tiny_model_dir("llama"), tmp_path / "m", add_extra)
    with pytest.raises(ValueError, match=r"unexpected weights \(1\): model.layers.0.extra"):
        load_model(bad, torch.float32, "cpu")


def test_pytorch_bin_fallback(tiny_model_dir: Callable[..., Path], tmp_path: Path) -> None:
    src = tiny_model_dir("mistral")
    dst = tmp_path / "bin"
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    torch.save(load_file(src / "model.safetensors"), dst / "pytorch_model.bin")
    from_bin, _ = load_model(dst, torch.float32, "cpu")
    from_st, _ = load_model(src, torch.float32, "cpu")
    for name, tensor in _state(from_st).items():
        assert torch.equal(_state(from_bin)[name], tensor), name


def test_stray_consolidated_file_is_ignored(
    tiny_model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    """Mistral repos ship consolidated.safetensors (other names) beside model.safetensors."""
    dst = tmp_path / "m"
    shutil.copytree(tiny_model_dir("mistral"), dst)
    save_file({"tok_embeddings.weight": torch.zeros(2)}, dst / "consolidated.safetensors")
    load_model(dst, torch.float32, "cpu")


def test_load_casts_to_dtype(tiny_model_dir: Callable[..., Path]) -> None:
    model, _ = load_model(tiny_model_dir("llama"), torch.bfloat16, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters())
    # Rope frequencies stay float32, as in HF, whatever the weights' dtype.
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_dummy_load_format_needs_only_config_json(
    tiny_model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    """vLLM's load_format="dummy": random weights from config.json alone, the same for the same
    seed (every node of a benchmark deployment holds the same model), and it serves."""
    from pdserve.common.engine.llm import LLM, SamplingParams

    shutil.copy(tiny_model_dir("qwen2") / "config.json", tmp_path / "config.json")
    first, second, other = (
        LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, seed=s) for s in (3, 3, 4)
    )
    state = lambda llm: llm.engine.runner.model.state_dict()  # noqa: E731
    a, b, c = state(first), state(second), state(other)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the embedding: an eager bf16 engine on AMX holds its linears packed, outside state_dict
    key = "model.embed_tokens.weight"
    assert not torch.equal(a[key], c[key])
    assert torch.equal(a["model.norm.weight"], torch.ones_like(a["model.norm.weight"]))
    (out,) = first.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out.token_ids) == 4
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(tmp_path), load_format="npz")
