"""DeepSeek-V3's multi-token-prediction (MTP) layer: the checkpoint's layer `num_layers`
(`model.layers.{n}.*`), which the target's loader leaves out.

It predicts the token after next from two inputs: the target's last hidden state at a position
(after the final norm) and the embedding of the token that follows it (the target's shared
embedding). Each is RMS-normed (`hnorm`, `enorm`), the two are joined [embedding; hidden] and
projected back to the model's width (`eh_proj`), then one full decoder layer (latent attention
over the MTP layer's own paged cache, and the MoE where the target's last layer has it) runs;
`shared_head.norm` and `shared_head.head` give the logits. Its output hidden state (before
`shared_head.norm`) is the "last hidden state" of the next draft when one layer drafts k
tokens. The checkpoint's copy of the embedding (`model.layers.{n}.embed_tokens`) is not read:
the target's is the same matrix.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.common.model.attention import AttentionMetadata
from pdserve.common.model.checkpoint import Checkpoint
from pdserve.common.model.config import ModelArchConfig
from pdserve.common.model.deepseek import DeepseekDecoderLayer, DeepseekMoE
from pdserve.common.model.llama import MLP, RMSNorm
from pdserve.common.model.moe import stack_experts
from pdserve.common.model.parallel import TPGroup
from pdserve.common.model.weights import _check_names, _iter_checkpoint, _random_state

# Tensors of the MTP layer that hold nothing of its own (the shared embedding's copy).
_SHARED = ("embed_tokens.weight",)


class SharedHead(nn.Module):
    """The MTP layer's output norm and LM head (HF's `shared_head.norm` / `.head`)."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class DeepseekMtpLayer(DeepseekDecoderLayer):
    """One MTP layer: a DeepSeek decoder layer (its attention and feed-forward parameters
    under the decoder layer's names) with the input joint and the output head around it."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config, config.num_layers)
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(config)

    def feed_forward(self, config: ModelArchConfig, layer: int, tp: TPGroup | None) -> nn.Module:
        """The MoE when the target's last layer has one (DeepSeek-V3's layer 61 does)."""
        if config.is_moe_layer(config.num_layers - 1):
            return DeepseekMoE(config, tp)
        return MLP(config, tp)

    def forward(  # type: ignore[override]
        self,
        embeds: torch.Tensor,
        previous: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] (before `shared_head.norm`) from each token's embedding
        and the hidden state before it; writes each token's latent into `kv_cache`."""
        joint = torch.cat((self.enorm(embeds), self.hnorm(previous)), dim=-1)
        return super().forward(self.eh_proj(joint), cos, sin, attn, kv_cache)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in float32."""
        return F.linear(self.shared_head.norm(hidden), self.shared_head.head.weight).float()


def mtp_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], config: ModelArchConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """The MTP layer's tensors of a checkpoint under `DeepseekMtpLayer`'s names (experts
    stacked); everything else, and the shared embedding's copy, left out."""
    prefix = f"model.layers.{config.num_layers}."
    own = ((n, t) for n, t in tensors if n.startswith(prefix) and not n.endswith(_SHARED))
    for name, tensor in stack_experts(own, config):
        yield name.removeprefix(prefix), tensor


def load_mtp(
    model_dir: str | Path,
    config: ModelArchConfig,
    dtype: torch.dtype,
    device: torch.device,
    dummy_seed: int | None = None,
) -> DeepseekMtpLayer:
    """The first MTP layer of a DeepSeek-V3 checkpoint (random weights from `dummy_seed`);
    ValueError naming what is missing when the checkpoint has none."""
    if config.num_nextn_predict_layers < 1:
        raise ValueError(
            "speculative_config.method: mtp needs a checkpoint with an MTP layer "
            f"(num_nextn_predict_layers >= 1), {model_dir} has none"
        )
    with torch.device("meta"):
        layer = DeepseekMtpLayer(config)
    shapes = {name: p.shape for name, p in layer.named_parameters()}
    if dummy_seed is not None:
        state = _random_state(shapes, dtype, device, dummy_seed)
    else:
        checkpoint = Checkpoint.resolve(model_dir)
        if checkpoint.is_gguf:
            raise ValueError("speculative_config.method: mtp reads safetensors checkpoints only")
        read = _iter_checkpoint(checkpoint, config, shapes, raw=False)
        state = {n: t.to(device=device, dtype=dtype) for n, t in mtp_tensors(read, config)}
    _check_names(shapes, {n: t.shape for n, t in state.items()}, Path(model_dir))
    layer.load_state_dict(state, strict=True, assign=True)
    layer.to(device)
    layer.requires_grad_(False)
    return layer.eval()
