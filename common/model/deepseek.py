"""DeepSeek-V3: multi-head latent attention (MLA) over a latent paged cache, and a mixture of
experts with grouped, bias-corrected routing and shared experts, on llama.py's decoder stack.

Each token caches one latent per layer: the normalized compressed KV (kv_lora_rank values) and
the rotated rope key (qk_rope_head_dim values), one row of a one-plane cache; no head holds a
copy. Prompt tokens attend with keys and values up-projected from the latents (kv_b_proj) for
the context they see; decode tokens attend in latent space with the projections absorbed (the
query's no-rope part through W_UK, the output through W_UV), so a decode step reads each cached
latent once and never materializes per-head keys.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.common.model.attention import (
    AttentionMetadata,
    KVCacheSpec,
    context_latents,
    store_latent,
)
from pdserve.common.model.config import ModelArchConfig
from pdserve.common.model.llama import MLP, DecoderLayer, RMSNorm, _reduced, apply_rope
from pdserve.common.model.moe import Experts, MoeForCausalLM, route_grouped, stack_experts
from pdserve.common.model.parallel import TPGroup, TPShard
from pdserve.kernels import ops

# transformers builds the two low-rank norms with its default eps, whatever rms_norm_eps says.
_LATENT_NORM_EPS = 1e-6


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rope over x [T, H, D]: lanes (0, 1), (2, 3), ... are pairs, each rotated by
    one frequency, and the result comes out de-interleaved (rotated even lanes, then odd), as
    transformers writes it; queries and keys agree, so their dot products are the rope's."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


def mla_softmax_scale(config: ModelArchConfig) -> float:
    """1/sqrt(qk_nope + qk_rope head dim), times yarn's mscale(factor, mscale_all_dim) squared
    when the rope is scaled (the rope's own attention factor is in cos/sin already)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = config.rope_scaling_dict()
    factor, all_dim = rope.get("factor", 1.0), rope.get("mscale_all_dim", 0)
    if config.rope_type != "default" and all_dim and factor > 1:
        mscale = 0.1 * all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def _causal_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over keys of scores [H, Q, S] whose Q queries are the last Q of S positions,
    each seeing the keys up to its own; in float32, back in the scores' dtype (as HF)."""
    q_len, keys = scores.shape[-2:]
    q_pos = torch.arange(keys - q_len, keys, device=scores.device)[:, None]
    seen = torch.arange(keys, device=scores.device)[None, :] <= q_pos
    scores = scores.masked_fill(~seen, -torch.inf)
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)


class MlaAttention(nn.Module):
    """Multi-head latent attention writing one latent per token into a one-plane cache
    [1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]. Parameter names are
    transformers'; queries go through q_a/q_b (with a norm between) when q_lora_rank is set,
    through one q_proj otherwise.

    Under tensor parallelism a rank holds its share of the query heads (q_b_proj or q_proj,
    kv_b_proj and o_proj cut by head) and the latent projection whole, so every rank writes
    the same latent into its own cache and o_proj's partial outputs are all-reduced."""

    def __init__(self, config: ModelArchConfig, layer: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        h = config.hidden_size
        heads = (tp.shard if tp is not None else TPShard()).num_heads(config)
        self.num_heads, self.tp = heads, tp
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.rank, self.v_dim = config.kv_lora_rank, config.v_head_dim
        qk = self.nope + self.rope
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=config.qkv_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope, bias=config.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, _LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=config.o_bias)
        self.scale = mla_softmax_scale(config)
        self.rotate = apply_rope_interleaved if config.rope_interleave else apply_rope

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self._queries(x).view(t, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        q_pe = self.rotate(q_pe, cos, sin)
        k_pe = self.rotate(k_pe[:, None], cos, sin)[:, 0]
        store_latent(
            torch.cat((self.kv_a_layernorm(kv_c), k_pe), dim=-1), kv_cache, attn.slot_mapping
        )
        out = self._attend(q_nope, q_pe, kv_cache, attn)
        return _reduced(self.o_proj(out.reshape(t, self.num_heads * self.v_dim)), self.tp)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _attend(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        """Output [T, H, v_head_dim]: each sequence's queries over its cached latents, decode
        rows (one query) absorbed, prompt chunks expanded. A decode step on the CPU (one row
        per sequence) reads the latents in place, all rows at once; else the loop is over
        sequences."""
        starts = attn.query_start_loc.tolist()
        if q_nope.shape[0] == len(starts) - 1 and cache.device.type == "cpu":
            return self.absorbed_paged(q_nope, q_pe, cache, attn)
        out = q_nope.new_zeros(q_nope.shape[0], self.num_heads, self.v_dim)
        for b, seq_len in enumerate(attn.seq_lens.tolist()):
            lo, hi = starts[b], starts[b + 1]
            if hi == lo:
                continue
            latents = context_latents(cache, attn.block_tables[b], seq_len)
            run = self.absorbed if hi - lo == 1 else self.expanded
            out[lo:hi] = run(q_nope[lo:hi], q_pe[lo:hi], latents)
        return out

    def expanded(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor
    ) -> torch.Tensor:
        """Attention of Q queries (the last Q positions) over S latents [S, rank + rope] with
        per-head keys and values up-projected from them, as transformers computes it."""
        kv_c, k_pe = latents.split([self.rank, self.rope], dim=-1)
        s = latents.shape[0]
        kv = self.kv_b_proj(kv_c).view(s, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_pe[:, None].expand(s, self.num_heads, self.rope)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        probs = _causal_softmax(torch.einsum("qhd,khd->hqk", q, k) * self.scale)
        return torch.einsum("hqk,khd->qhd", probs, v)

    def absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor
    ) -> torch.Tensor:
        """The same attention in latent space: q_nope through W_UK scores against the cached
        latents directly, the weighted latents go through W_UV (kv_b_proj's two halves)."""
        kv_c, k_pe = latents.split([self.rank, self.rope], dim=-1)
        w_uk, w_uv = self._absorbed_weights()
        q_latent = torch.einsum("qhn,hnr->qhr", q_nope, w_uk)
        scores = torch.einsum("qhr,kr->hqk", q_latent, kv_c)
        scores = scores + torch.einsum("qhd,kd->hqk", q_pe, k_pe)
        probs = _causal_softmax(scores * self.scale)
        return torch.einsum("qhr,hvr->qhv", torch.einsum("hqk,kr->qhr", probs, kv_c), w_uv)

    def absorbed_paged(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        """`absorbed` for one query per sequence, all sequences in one paged attention call:
        the latent rows are the keys of one KV head and, their first `rank` dims, its values,
        so the kernel reads each cached latent once, where it lies."""
        w_uk, w_uv = self._absorbed_weights()
        q = torch.cat((torch.einsum("qhn,hnr->qhr", q_nope, w_uk), q_pe), dim=-1)
        latent = cache[0]
        meta = (attn.block_tables, attn.query_start_loc, attn.seq_lens)
        context = ops.paged_attention(q, latent, latent, *meta, self.scale)
        return torch.einsum("qhr,hvr->qhv", context[..., : self.rank], w_uv)

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, rank] and W_UV [H, v_dim, rank]: kv_b_proj's two halves per head."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w.split([self.nope, self.v_dim], dim=1)
        return w_uk, w_uv

    def fuse(self) -> None:
        """Nothing to join: the latent projections are one matrix each already."""


class DeepseekRouter(nn.Module):
    """The router (`weight`, one row per expert) and its per-expert choice bias, computed in
    float32 whatever the model's dtype, as transformers keeps them."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts))
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.groups = (config.n_group, config.topk_group)
        self.scale = config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        bias = self.e_score_correction_bias
        return route_grouped(logits, bias, self.top_k, self.groups, self.renormalize, self.scale)


class DeepseekMoE(nn.Module):
    """Routed experts (moe.py's stacked `Experts`) plus `n_shared_experts` always-on experts,
    held as one dense MLP of n_shared_experts * moe_intermediate_size.

    Under tensor parallelism the router is whole, the routed experts split as `TPShard` says
    and the shared ones as an MLP; their two partial sums are added, then all-reduced once."""

    def __init__(self, config: ModelArchConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.gate = DeepseekRouter(config)
        self.experts = Experts(config, tp.shard if tp is not None else None)
        width = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = MLP(config, tp, width=width) if width else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts.partial(x)
        return _reduced(out, self.tp)

    def fuse(self) -> None:
        """Join the shared experts' gate and up projections (the routed ones are stacked)."""
        if self.shared_experts is not None:
            self.shared_experts.fuse()


class DeepseekDecoderLayer(DecoderLayer):
    """Latent attention, then the dense MLP (the first_k_dense_replace layers) or the MoE."""

    def attention(self, config: ModelArchConfig, layer: int, tp: TPGroup | None) -> nn.Module:
        return MlaAttention(config, layer, tp)

    def feed_forward(self, config: ModelArchConfig, layer: int, tp: TPGroup | None) -> nn.Module:
        return DeepseekMoE(config, tp) if config.is_moe_layer(layer) else MLP(config, tp)


class DeepseekV3ForCausalLM(MoeForCausalLM):
    """DeepSeek-V3 (and R1): the Llama-family stack with DeepSeek's layers; one latent per
    token per layer in the cache. Under tensor parallelism query heads split and every rank
    keeps the whole latent: `kv_cache_spec` is the same for every shard."""

    layer_class = DeepseekDecoderLayer
    # The reference MLA path plans on the host (a loop over sequences): decode runs eager
    # until a sync-free latent decode kernel takes it.
    compiles_decode = False

    @classmethod
    def kv_cache_spec(cls, config: ModelArchConfig, shard: TPShard | None = None) -> KVCacheSpec:
        """One plane of one "head": the latent, kv_lora_rank + qk_rope_head_dim values."""
        return KVCacheSpec(planes=1, heads=1, dim=config.kv_lora_rank + config.qk_rope_head_dim)


def deepseek_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], config: ModelArchConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """A DeepSeek checkpoint's tensors under our names: per-expert matrices stacked (as for
    Qwen3-MoE), the multi-token-prediction layers past num_layers (Hub checkpoints hold one,
    `model.layers.61.*`; serving does not run it) left out."""
    prefixes = tuple(f"model.layers.{i}." for i in range(config.num_layers))
    kept = (
        (n, t) for n, t in tensors if not n.startswith("model.layers.") or n.startswith(prefixes)
    )
    return stack_experts(kept, config)
