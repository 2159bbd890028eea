"""Which model class runs a checkpoint's architecture.

Every family module takes `(config, tp)` and names its parameters as the HF checkpoint does, so
the weight loader builds whichever class this returns and assigns weights by name.
"""

from __future__ import annotations

from torch import nn

from pdserve.common.model.config import ModelArchConfig
from pdserve.common.model.llama import LlamaFamilyForCausalLM


def model_class(config: ModelArchConfig) -> type[nn.Module]:
    """The class whose forward reproduces `config.architecture` exactly."""
    return LlamaFamilyForCausalLM
