"""Llama, Qwen2, Qwen3 and Mistral as one flat-batch module over a paged KV cache.

The math mirrors transformers' modeling code operation for operation (same casts, same order)
so greedy output equals HF's token for token in float32. Parameter names equal the HF checkpoint
names, so loading weights is a name lookup. `fuse_projections` then joins q/k/v and gate/up into
one matrix each (the model runner does it on GPUs, where a decode step reads every weight once
and one wide GEMV streams at full bandwidth where three narrow ones do not).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.common.model.attention import AttentionMetadata, KVCacheSpec, paged_attention
from pdserve.common.model.config import ModelArchConfig
from pdserve.common.model.dtype import cpu_bf16_flag
from pdserve.common.model.parallel import TPGroup, TPShard
from pdserve.common.model.quant import QuantizedEmbedding, QuantizedLinear, release_freed_heap
from pdserve.kernels import cpu_fused
from pdserve.kernels.ops import PackedLinear, chunked_linear, cpu_linear_enabled, packs


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, weight applied in the input dtype (as HF)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_fused.serves(x, self.weight):  # a bf16 eager CPU step: one pass, same roundings
            return cpu_fused.rms_norm(x, self.weight, self.eps)
        # The casts are skipped, not run as no-ops, in float32: 122 dispatches a step.
        x32 = x if x.dtype == torch.float32 else x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (x32 if x.dtype == torch.float32 else x32.to(x.dtype))

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(x + delta, its norm): a residual add and the norm it feeds, one pass where fused."""
        if cpu_fused.serves(x, delta, self.weight):
            return cpu_fused.add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self(x)


@dataclass
class _RopeConfigView:
    """The attributes transformers' ROPE_INIT_FUNCTIONS read, in both 4.x and 5.x spelling.

    5.x reads `rope_parameters` (after `standardize_rope_params()`), 4.x reads `rope_theta`
    and `rope_scaling`; handing them this view instead of a PreTrainedConfig keeps the model
    independent of transformers' config classes.
    """

    hidden_size: int
    num_attention_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any]
    rope_parameters: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}

    def standardize_rope_params(self) -> None:
        """Already standard: the fields were filled from a standardized ModelArchConfig."""


def rope_inv_freq(config: ModelArchConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32 on CPU, attention scaling) exactly as transformers does."""
    dim = config.head_dim
    if config.rope_type == "default":
        # HF's default init; kept local because it is not in ROPE_INIT_FUNCTIONS.
        exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        return 1.0 / (config.rope_theta**exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    view = _RopeConfigView(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_heads,
        head_dim=dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta,
        rope_scaling={**config.rope_scaling_dict(), "rope_type": config.rope_type},
    )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[config.rope_type](view, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """cos/sin of each token's position, computed per forward like HF (no table to keep exact)."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        # The explicit CPU device wins over an enclosing `torch.device("meta")` (the weight
        # loader builds the model on meta), so this buffer is always real.
        with torch.device("cpu"):
            inv_freq, self.attention_scaling = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by per-token cos/sin [T, D] (HF's rotate-half convention)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + _rotate_half(x) * sin


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated: by the fused kernel each (bit-equal, no cat) in a bf16 eager CPU step,
    else by one `apply_rope` of their heads together (half the rope's calls; elementwise, so
    each head's values are those of its own rotation)."""
    if cpu_fused.serves(q, k, cos, sin):
        return cpu_fused.rope(q, cos, sin), cpu_fused.rope(k, cos, sin)
    q, k = apply_rope(torch.cat((q, k), 1), cos, sin).split([q.shape[1], k.shape[1]], 1)
    return q, k


class Attention(nn.Module):
    """GQA self-attention that writes its K/V into the paged cache, then attends over it."""

    def __init__(self, config: ModelArchConfig, layer: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        shard = tp.shard if tp is not None else TPShard()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.head_dim = shard.num_heads(config), d
        self.num_kv_heads = shard.num_kv_heads(config)
        self.tp = tp
        self.scale = d**-0.5
        self.sliding_window = config.layer_sliding_window(layer)
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=config.o_bias)
        self.qkv_proj: nn.Module | None = None  # set by fuse(): [q; k; v] in one matrix
        if config.qk_norm:
            # Qwen3 normalizes each head's q and k before rope.
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_proj is not None:
            kv = self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([self.num_heads * self.head_dim, kv, kv], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope_qk(q, k, cos, sin)
        out = paged_attention(q, k, v, kv_cache, attn, self.scale, self.sliding_window)
        return _reduced(self.o_proj(out.reshape(t, self.num_heads * self.head_dim)), self.tp)

    def fuse(self, quantized_only: bool = False) -> bool:
        """Replace q/k/v_proj by one qkv_proj holding their rows in that order (see `_fused`);
        whether it did."""
        fused = _fused((self.q_proj, self.k_proj, self.v_proj), quantized_only)
        if fused is not None:
            self.qkv_proj = fused
            del self.q_proj, self.k_proj, self.v_proj
        return fused is not None


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), intermediate_size wide unless `width`
    says otherwise (DeepSeek's shared experts)."""

    def __init__(
        self, config: ModelArchConfig, tp: TPGroup | None = None, width: int | None = None
    ) -> None:
        super().__init__()
        size = tp.size if tp is not None else 1
        i = (config.intermediate_size if width is None else width) // size
        h, bias = config.hidden_size, config.mlp_bias
        self.tp = tp
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.gate_up_proj: nn.Module | None = None  # set by fuse(): [gate; up] in one matrix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _reduced(self.partial(x), self.tp)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the all-reduce: a block that adds it to
        another partial sum (DeepSeek's shared experts beside the routed ones) reduces once."""
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(silu_mul(gate, up))

    def fuse(self, quantized_only: bool = False) -> bool:
        """Replace gate/up_proj by one gate_up_proj holding their rows in that order; whether
        it did."""
        fused = _fused((self.gate_proj, self.up_proj), quantized_only)
        if fused is not None:
            self.gate_up_proj = fused
            del self.gate_proj, self.up_proj
        return fused is not None


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up: one fused pass in a bf16 eager CPU step, same roundings."""
    if cpu_fused.serves(gate, up):
        return cpu_fused.silu_mul(gate, up)
    return F.silu(gate) * up


def _reduced(partial: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """A row-parallel layer's output: the sum of every rank's partial product."""
    return partial if tp is None else tp.all_reduce(partial)


class VocabEmbedding(nn.Module):
    """The token embedding; under tensor parallelism each rank holds a range of vocabulary
    rows, looks up the tokens in it (zeros for the others) and the ranks sum their rows."""

    def __init__(self, config: ModelArchConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        if tp is None:
            self.first, rows = 0, config.vocab_size
        else:
            self.first, _, rows = tp.shard.vocab_rows(config.vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, config.hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill(outside[:, None], 0.0))


# Llama-family projections that forward only calls (DeepSeek's kv_b_proj, whose weight MLA
# reads, and MoE's router gate stay plain).
_PACKED_LINEARS = frozenset(
    ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj")
    + ("gate_up_proj",)
)


def _fused(parts: tuple[nn.Module, ...], quantized_only: bool) -> nn.Module | None:
    """One projection for `parts`, or None where they stay apart: quantized parts join by
    their packed rows (`QuantizedLinear.stacked`, exact: one kernel call instead of several);
    float ones unless `quantized_only` (on the CPU a fused float GEMM may round otherwise than
    HF's separate ones, so there only quantized layers fuse: `fuse_quantized`)."""
    if all(isinstance(m, QuantizedLinear) for m in parts):
        return QuantizedLinear.stacked(parts)
    if not quantized_only and all(isinstance(m, nn.Linear) for m in parts):
        return _stacked(*parts)
    return None


def fuse_quantized(model: nn.Module) -> None:
    """Join each block's quantized q/k/v and gate/up (the runner does it on the CPU, where a
    batch-1 decode step pays per kernel call: docs/quantization.md); float ones stay."""
    blocks = [m for m in model.modules() if isinstance(m, (Attention, MLP))]
    if any([block.fuse(quantized_only=True) for block in blocks]):
        release_freed_heap()  # the parts' buffers, now copied into the fused ones


def _stacked(*linears: nn.Linear) -> nn.Linear:
    """One Linear whose output is the given ones' outputs, concatenated (weights moved, not
    copied twice: each source is dropped by the caller)."""
    first = linears[0]
    fused = nn.Linear(0, 0, bias=first.bias is not None, device="meta")
    fused.in_features = first.in_features
    fused.out_features = sum(lin.out_features for lin in linears)
    fused.weight = nn.Parameter(torch.cat([lin.weight for lin in linears]), requires_grad=False)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([lin.bias for lin in linears]), requires_grad=False)
    return fused


class DecoderLayer(nn.Module):
    """Pre-norm attention block followed by a pre-norm MLP block, each with a residual."""

    def __init__(self, config: ModelArchConfig, layer: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.self_attn = self.attention(config, layer, tp)
        self.mlp = self.feed_forward(config, layer, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        delta = self.self_attn(self.input_layernorm(x), cos, sin, attn, kv_cache)
        x, h = self.post_attention_layernorm.add_forward(x, delta)
        return x + self.mlp(h)

    def attention(self, config: ModelArchConfig, layer: int, tp: TPGroup | None) -> nn.Module:
        """The attention block (a hook: DeepSeek puts its latent attention here)."""
        return Attention(config, layer, tp)

    def feed_forward(self, config: ModelArchConfig, layer: int, tp: TPGroup | None) -> nn.Module:
        """The block after attention (a hook: the MoE families put their expert block here)."""
        return MLP(config, tp)


class LlamaFamilyModel(nn.Module):
    """The decoder stack; its attribute names give HF's `model.*` parameter names."""

    def __init__(
        self,
        config: ModelArchConfig,
        tp: TPGroup | None = None,
        layer_class: type[DecoderLayer] = DecoderLayer,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config, tp)
        self.layers = nn.ModuleList(layer_class(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        assert len(kv_caches) == len(self.layers), (
            f"{len(kv_caches)} KV caches for {len(self.layers)} layers"
        )
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = layer(x, cos, sin, attn, kv_cache)
            if on_layer is not None:
                on_layer(i)  # layer i's K/V of this step are in the cache (or queued on device)
        return self.norm(x)


class LlamaFamilyForCausalLM(nn.Module):
    """Llama / Qwen2 / Qwen3 / Mistral causal LM over a flat batch of T tokens.

    One forward serves prefill chunks and decode tokens together: `attn` says which tokens
    belong to which sequence and where their K/V live. kv_caches holds one tensor per layer,
    shaped [2, num_blocks, block_size, num_kv_heads, head_dim] (K at [0], V at [1]): what
    `kv_cache_spec` asks the runner for.
    With tied embeddings there is no lm_head module, so the parameter names equal exactly
    what a tied checkpoint stores.
    """

    layer_class: type[DecoderLayer] = DecoderLayer  # a family subclass names its own layer
    # Whether a decode step can run compiled, in a CUDA graph (no host sync in its attention).
    compiles_decode = True

    def __init__(self, config: ModelArchConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = LlamaFamilyModel(config, tp, self.layer_class)
        rows = config.vocab_size if tp is None else tp.shard.vocab_rows(config.vocab_size)[2]
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, rows, bias=False)
        )
        self.chunk_head = False  # set by use_cpu_head: a tied float32 head chunked on the CPU

    @classmethod
    def kv_cache_spec(cls, config: ModelArchConfig, shard: TPShard | None = None) -> KVCacheSpec:
        """What each layer's cache holds per token: K and V of the KV heads `shard` holds
        (all of them without one)."""
        heads = config.num_kv_heads if shard is None else shard.num_kv_heads(config)
        return KVCacheSpec(planes=2, heads=heads, dim=config.head_dim)

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Join each layer's q/k/v and gate/up projections (see the module docstring). The
        outputs are the same products; only the parameter names change."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden_size] after the final norm; writes each token's K/V.

        `on_layer(i)` runs as soon as layer i has written its K/V, before layer i + 1 starts:
        a prefill node ships layer i's pages from there while the later layers compute."""
        return self.model(input_ids, positions, attn, kv_caches, on_layer)

    @torch.no_grad()
    def use_cpu_head(self, keep_plain: bool = False) -> str:
        """Give the CPU's eager steps faster linears (kernels/ops.py). A float32 head: an
        untied one reordered into oneDNN's layout in place of the plain weight, a tied one
        (whose rows the embedding reads) chunked. bf16 on a CPU with native bf16 (AMX or
        AVX512-BF16): the decoder's float linears and the head packed, a tied head as a
        packed copy (vocab x hidden more), as oneDNN's prepacked bf16 GEMM takes about half
        F.linear's time at 1-16 rows (docs/quantization.md). `keep_plain` (a runner whose
        decode steps also run compiled): packed layers keep their plain weights, which the
        compiled steps read, and no head is chunked (that would change the traced step).
        Returns which: "packed", "chunked", "bf16 packed", or "" (nothing, or
        PDSERVE_CPU_LINEAR=off)."""
        head, embed = self.lm_head, self.model.embed_tokens
        if not cpu_linear_enabled():
            return ""
        # the final norm's dtype is the model's (a GGUF's embedding may be quantized: no weight)
        if self.model.norm.weight.dtype == torch.bfloat16 and cpu_bf16_flag() is not None:
            return self._pack_bf16(keep_plain)
        if type(head) is nn.Linear and packs(head.weight):
            self.lm_head = PackedLinear(head.weight, head.bias, keep_plain)
            return "packed"
        if keep_plain:
            return ""
        if head is None and type(embed) is VocabEmbedding and packs(embed.weight):
            self.chunk_head = True
            return "chunked"
        return ""

    def _pack_bf16(self, keep_plain: bool) -> str:
        """The bf16 decoder linears (those only called, never read: _PACKED_LINEARS) and the
        head in oneDNN's layout: "bf16 packed", or "" where none was float."""
        packed = 0
        for parent in self.model.layers.modules():
            for name, child in parent.named_children():
                if name in _PACKED_LINEARS and type(child) is nn.Linear:
                    if packs(child.weight, native_bf16=True):
                        layer = PackedLinear(child.weight, child.bias, keep_plain)
                        setattr(parent, name, layer)
                        packed += 1
        head, embed = self.lm_head, self.model.embed_tokens
        if head is None and type(embed) is VocabEmbedding:
            head = embed  # tied: packed as a copy, the embedding keeps its rows
        if type(head) in (nn.Linear, VocabEmbedding) and packs(head.weight, native_bf16=True):
            bias = getattr(head, "bias", None)  # a kept tied weight shares the embedding's rows
            self.lm_head = PackedLinear(head.weight, bias, keep_plain)
            packed += 1
        return "bf16 packed" if packed else ""

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab_size] in float32 for the N rows the sampler needs (on every rank:
        under tensor parallelism each computes its vocabulary rows and they are gathered)."""
        embed, head = self.model.embed_tokens, self.lm_head
        if head is None and isinstance(embed, QuantizedEmbedding):
            head = embed.head  # the tied head, held int8 (docs/quantization.md)
        if isinstance(head, QuantizedLinear | PackedLinear):
            logits = head(hidden)
        elif self.chunk_head:
            logits = chunked_linear(hidden, embed.weight)
        else:
            logits = F.linear(hidden, embed.weight if head is None else head.weight)
        if self.tp is not None:
            logits = self.tp.gather_last_dim(logits)[:, : self.config.vocab_size]
        return logits.float()
