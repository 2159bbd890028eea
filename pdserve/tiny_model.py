"""Tiny random Llama-family checkpoints with a real tokenizer, built locally in about a second.

Tests and benchmarks use them in place of downloaded models: the directory looks exactly like a
Hugging Face one (config.json, generation_config.json, model.safetensors, tokenizer files with a
ChatML chat template), so `AutoModelForCausalLM` / `AutoTokenizer` and our loader all read it.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pdserve.common.model.families import MODEL_TYPES, QWEN3_MOE

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")

# Qwen's own pad token: AutoTokenizer loads model_type qwen2 through Qwen2Tokenizer, whose
# default unk is "<|endoftext|>"; were it missing, that class would append it past the vocab.
PAD, BOS, EOS, IM_START, IM_END = "<|endoftext|>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
# Trained first, so their ids are 0..4 whatever the vocab size.
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Short names (the CLI's flags) for the transformers config fields they set.
_SHORT_NAMES = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "vocab": "vocab_size",
    "intermediate": "intermediate_size",
    "max_position": "max_position_embeddings",
}

_DEFAULTS = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    # Wider than HF's 0.02 so a 64-wide model's logits are spread out, not near-ties.
    "initializer_range": 0.1,
}

# Noise on 1-D parameters: HF initializes norms to 1 and biases to 0, which would hide a
# model that forgets to apply them.
_VECTOR_NOISE_STD = 0.1

_WORDS = (
    "the a one some every this that my your our their his her its no any each "
    "cat dog bird fish horse river mountain city village forest ocean garden house road bridge "
    "teacher doctor farmer child friend king queen soldier artist engineer student captain "
    "book letter song story map key door window table lamp stone tree flower cloud storm "
    "runs walks sings writes reads builds finds sees hears carries opens closes paints "
    "likes loves hates wants needs keeps loses gives takes brings sends follows watches "
    "quickly slowly quietly loudly happily sadly carefully bravely often never always "
    "red blue green old young tall small bright dark cold warm quiet loud strange gentle "
    "in on under over near behind beside across through with without before after "
    "and but or because while when if although so then yet "
    "morning evening night winter summer spring autumn today tomorrow yesterday"
).split()
_SYLLABLES = (
    "ka lo mi ne tu ra si po fe da ri vo sa le ku ta ni mo be zo "
    "qua tri ex ion ing est ful ish ent ous er an in al"
).split()
_PUNCTUATION = (".", ".", ".", "!", "?", ",")


def corpus(seed: int = 0, sentences: int = 4000) -> Iterator[str]:
    """Deterministic English-like sentences (real words, made-up words, digits, punctuation).

    Made-up words from syllables give the BPE trainer enough distinct pieces to fill a few
    thousand merges; digits and capitals make sure those appear in the merges too.
    """
    rng = random.Random(seed)
    for _ in range(sentences):
        words = []
        for _ in range(rng.randint(4, 14)):
            roll = rng.random()
            if roll < 0.75:
                words.append(rng.choice(_WORDS))
            elif roll < 0.95:
                words.append("".join(rng.choices(_SYLLABLES, k=rng.randint(2, 4))))
            else:
                words.append(str(rng.randint(0, 2024)))
        words[0] = words[0].capitalize()
        yield " ".join(words) + rng.choice(_PUNCTUATION)


def train_tokenizer(vocab_size: int, max_length: int, seed: int = 0) -> Any:
    """A byte-level BPE `PreTrainedTokenizerFast` with exactly vocab_size tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import (
        PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX,
    )

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab size {vocab_size} is below the byte-level minimum")
    tok = Tokenizer(models.BPE())
    # Exactly the pipeline Qwen2Tokenizer rebuilds around our vocab and merges (AutoTokenizer
    # picks that class for model_type qwen2), so every arch tokenizes like tokenizer.json.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the built-in corpus yields {tok.get_vocab_size()} tokens, not {vocab_size}"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_length,
        # Byte-level BPE round-trips NFC text exactly; cleanup would drop spaces before "."
        clean_up_tokenization_spaces=False,
    )


def tiny_config(arch: str, tokenizer: Any, **overrides: Any) -> Any:
    """A transformers config for `arch` with small defaults, ids taken from the tokenizer.

    overrides may use the CLI's short names (layers, hidden, heads, kv_heads, vocab,
    intermediate, max_position), `sliding_window`, or any field of the transformers config
    (rope_scaling, rope_theta, tie_word_embeddings, head_dim, attention_bias, ...).
    """
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    classes["mistral"] = MistralConfig
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(TINY_ARCHS)}")
    cls, architecture = classes[arch], MODEL_TYPES[arch]
    # Deep copy: transformers' configs write defaults into the rope dict they are handed.
    given = {_SHORT_NAMES.get(k, k): copy.deepcopy(v) for k, v in overrides.items()}
    fields = {**_DEFAULTS, **given}
    window = fields.pop("sliding_window", None)
    if arch == "mistral":
        # Mistral's config defaults to a 4096 window; tiny models attend fully unless asked.
        fields["sliding_window"] = window
    elif arch in ("qwen2", "qwen3") and window is not None:
        fields.update(use_sliding_window=True, sliding_window=window)
        fields.setdefault("max_window_layers", 0)
    elif window is not None:
        raise ValueError(f"{arch} has no sliding window")
    return cls(
        architectures=[architecture],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **fields,
    )


def make_tiny_model(
    arch: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    **overrides: Any,
) -> Path:
    """Write a random `arch` checkpoint plus tokenizer to out_dir and return its path.

    Weights are a function of seed and the config only. config.eos_token_id is the
    tokenizer's eos (`</s>`); generation_config.json also lists `<|im_end|>`, the end of a
    ChatML turn, as instruct models such as Qwen do. max_shard_size (e.g. "20KB") writes a
    sharded checkpoint with an index.
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    vocab = overrides.get("vocab", overrides.get("vocab_size", _DEFAULTS["vocab_size"]))
    max_len = overrides.get(
        "max_position",
        overrides.get("max_position_embeddings", _DEFAULTS["max_position_embeddings"]),
    )
    tokenizer = train_tokenizer(vocab, max_len, seed)
    config = tiny_config(arch, tokenizer, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_vectors(model)
    model.generation_config.eos_token_id = [
        tokenizer.eos_token_id,
        tokenizer.convert_tokens_to_ids(IM_END),
    ]
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **save_kwargs)
    tokenizer.save_pretrained(out)
    return out


@torch.no_grad()
def _perturb_vectors(model: torch.nn.Module) -> None:
    for param in model.parameters():
        if param.ndim == 1:
            param.add_(torch.randn_like(param) * _VECTOR_NOISE_STD)


# The MoE benchmark's pair (docs/benchmarks.md, "MoE and MLA"): a Qwen3-MoE of 8 experts, top 2,
# and a dense Qwen3 whose MLP is top_k x moe_intermediate_size wide. Same attention, norms and
# embeddings, so a token multiplies by the same weights in both (the router's 8 x hidden apart);
# the MoE holds num_experts / top_k times the dense MLP's weights.
MOE_BENCH_SIZES = dict(layers=8, hidden=512, heads=8, kv_heads=2, head_dim=64, vocab=8192,
                       max_position=4096)  # fmt: skip
MOE_BENCH_EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512)


def make_moe_bench_models(
    out_dir: str | Path, *, seed: int = 0, experts: dict[str, int] | None = None, **sizes: Any
) -> tuple[Path, Path]:
    """Write the random Qwen3-MoE (out_dir/qwen3-moe) and its dense counterpart
    (out_dir/qwen3-dense), both float32 with a tokenizer; `sizes` and `experts` override
    MOE_BENCH_SIZES and MOE_BENCH_EXPERTS (tests make a small pair)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    out, sizes = Path(out_dir), {**MOE_BENCH_SIZES, **sizes}
    experts = {**MOE_BENCH_EXPERTS, **(experts or {})}
    width = experts["num_experts_per_tok"] * experts["moe_intermediate_size"]
    dense = make_tiny_model("qwen3", out / "qwen3-dense", seed=seed, intermediate=width, **sizes)
    tokenizer = train_tokenizer(sizes["vocab"], sizes["max_position"], seed)
    fields = {**_DEFAULTS, **{_SHORT_NAMES.get(k, k): v for k, v in sizes.items()}}
    # Every layer sparse; intermediate_size (unused then) names the dense twin's width.
    config = Qwen3MoeConfig(
        architectures=[QWEN3_MOE], bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        **{**fields, "intermediate_size": width}, **experts, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_vectors(model)
    model.save_pretrained(out / "qwen3-moe")
    tokenizer.save_pretrained(out / "qwen3-moe")
    return out / "qwen3-moe", dense


if __name__ == "__main__":  # python -m pdserve.tiny_model DIR: the MoE benchmark's pair
    import sys

    print(*make_moe_bench_models(sys.argv[1]))
