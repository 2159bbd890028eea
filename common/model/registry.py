"""Which model class runs a checkpoint's architecture, and how its tensors are named for it.

Every family module takes `(config, tp)` and names its parameters as transformers does in
memory, so the weight loader builds whichever class this returns and assigns weights by name
(after `checkpoint_tensors` has renamed and stacked what a checkpoint stores otherwise).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pdserve.common.model.config import ModelArchConfig
from pdserve.common.model.deepseek import DeepseekV3ForCausalLM, deepseek_tensors
from pdserve.common.model.families import DEEPSEEK_V3, MOE_ARCHITECTURES
from pdserve.common.model.llama import LlamaFamilyForCausalLM
from pdserve.common.model.moe import MoeForCausalLM, stack_experts


def model_class(config: ModelArchConfig) -> type[nn.Module]:
    """The class whose forward reproduces `config.architecture` exactly (each names the cache
    it needs through its `kv_cache_spec`)."""
    if config.architecture == DEEPSEEK_V3:
        return DeepseekV3ForCausalLM
    if config.architecture in MOE_ARCHITECTURES:
        return MoeForCausalLM
    return LlamaFamilyForCausalLM


def checkpoint_tensors(
    config: ModelArchConfig, tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) pairs under the names of `model_class(config)`'s
    parameters (per-expert matrices stacked for the MoE families; dense ones as stored)."""
    if config.architecture == DEEPSEEK_V3:
        return deepseek_tensors(tensors, config)
    if config.architecture in MOE_ARCHITECTURES:
        return stack_experts(tensors, config)
    return iter(tensors)
