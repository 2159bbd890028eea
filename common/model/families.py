"""The model families pdserve runs, by the architecture name a checkpoint's config.json gives
(`architectures[0]`, transformers' class name): the one place those names are written.
`config` reads checkpoints by them, `registry` maps each to the model class that runs it,
`pdserve.tiny_model` writes test checkpoints of them. Pure Python (no torch)."""

from __future__ import annotations

LLAMA = "LlamaForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
QWEN3 = "Qwen3ForCausalLM"
MISTRAL = "MistralForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
MIXTRAL = "MixtralForCausalLM"
DEEPSEEK_V3 = "DeepseekV3ForCausalLM"

# transformers' model_type of each, for configs built in code (no `architectures` list).
MODEL_TYPES = {
    "llama": LLAMA,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "mistral": MISTRAL,
    "qwen3_moe": QWEN3_MOE,
    "mixtral": MIXTRAL,
    "deepseek_v3": DEEPSEEK_V3,
}
# Architectures whose forward pass a model class of ours reproduces exactly (`registry`).
SUPPORTED_ARCHITECTURES = tuple(MODEL_TYPES.values())
# The ones whose feed-forward blocks are (partly) mixtures of experts.
MOE_ARCHITECTURES = (QWEN3_MOE, MIXTRAL, DEEPSEEK_V3)
# The ones that RMS-normalize each head's query and key before rope.
QK_NORM_ARCHITECTURES = (QWEN3, QWEN3_MOE)
