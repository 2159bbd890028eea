"""Tiny checkpoints must look like real Hugging Face ones to transformers and to us."""

from __future__ import annotations

import json
import runpy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pdserve.tiny_model import EOS, IM_END, IM_START, TINY_ARCHS, make_tiny_model

REPO = Path(__file__).resolve().parents[2]
TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "Ünïcödé ✓ 你好 — it's 2024! 🙂",
)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tokenizer_matches_config(tiny_model_dir: Callable[..., Path], arch: str) -> None:
    model_dir = tiny_model_dir(arch)
    tok = AutoTokenizer.from_pretrained(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    # transformers 5 loads model_type qwen2 through Qwen2Tokenizer, which rebuilds the
    # pipeline and adds its own specials: it must still see exactly our vocabulary.
    assert len(tok) == config.vocab_size
    assert tok.eos_token == EOS and tok.eos_token_id == config.eos_token_id
    assert (tok.bos_token_id, tok.pad_token_id) == (config.bos_token_id, config.pad_token_id)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids(IM_END)]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tokenizer_round_trips(tiny_model_dir: Callable[..., Path], arch: str) -> None:
    model_dir = tiny_model_dir(arch)
    tok = AutoTokenizer.from_pretrained(model_dir)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == raw.encode(text).ids
        assert tok.decode(ids) == text
    # Trained merges, not bare bytes: common words are single tokens.
    assert len(tok.encode(" the", add_special_tokens=False)) == 1


def test_chat_template(tiny_model_dir: Callable[..., Path]) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir("qwen3"))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello!"},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # transformers 5 returns a BatchEncoding here (4.x returned the id list).
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.convert_tokens_to_ids(IM_START)) == 3


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_output_is_not_degenerate(tiny_model_dir: Callable[..., Path], arch: str) -> None:
    model_dir = tiny_model_dir(arch)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = tok("Once upon a time the old king", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    new = out[0, prompt["input_ids"].shape[1] :].tolist()
    assert len(set(new)) >= 4, new


def test_weights_follow_the_seed(tmp_path: Path) -> None:
    a = load_file(make_tiny_model("llama", tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(make_tiny_model("llama", tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(make_tiny_model("llama", tmp_path / "c", seed=4) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_overrides_and_sliding_window(tiny_model_dir: Callable[..., Path]) -> None:
    assert AutoConfig.from_pretrained(tiny_model_dir("mistral")).sliding_window is None
    qwen = AutoConfig.from_pretrained(
        tiny_model_dir("qwen2", sliding_window=8, max_window_layers=1)
    )
    assert (qwen.use_sliding_window, qwen.sliding_window) == (True, 8)
    assert qwen.layer_types == ["full_attention", "sliding_attention"]
    with pytest.raises(ValueError, match="no sliding window"):
        make_tiny_model("llama", "/nonexistent", sliding_window=8)
    with pytest.raises(ValueError, match="unknown arch"):
        make_tiny_model("gpt2", "/nonexistent")


def test_cli(tmp_path: Path) -> None:
    cli = runpy.run_path(str(REPO / "scripts" / "make_tiny_model.py"), run_name="cli")
    out = tmp_path / "m"
    cli["main"](["--arch", "mistral", "--out", str(out), "--layers", "1", "--kv-heads", "1",
                 "--vocab", "300", "--sliding-window", "4"])  # fmt: skip
    config = AutoConfig.from_pretrained(out)
    assert (config.num_hidden_layers, config.num_key_value_heads) == (1, 1)
    assert (config.vocab_size, config.sliding_window) == (300, 4)
    assert len(AutoTokenizer.from_pretrained(out)) == 300
