"""The architecture facts the engine needs from a Hugging Face model directory.

Everything downstream (model, weight loader, KV-cache layout, scheduler limits) reads this one
frozen dataclass instead of poking at a transformers config, whose attribute names moved between
transformers 4.x and 5.x.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from pdserve.common.model.families import (
    DEEPSEEK_V3,
    MISTRAL,
    MIXTRAL,
    MODEL_TYPES,
    MOE_ARCHITECTURES,
    QK_NORM_ARCHITECTURES,
    QWEN2,
    QWEN3,
    QWEN3_MOE,
    SUPPORTED_ARCHITECTURES,
)

# RoPE variants with position-independent frequencies, so one inv_freq serves every position.
# "dynamic" qualifies below max_position_embeddings: HF recomputes only for longer sequences.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")

# Rope dict keys that are not scaling parameters (kept in their own fields instead).
_ROPE_META_KEYS = ("rope_type", "type", "rope_theta")


@dataclass(frozen=True, slots=True)
class ModelArchConfig:
    """Shape and behaviour of one Llama-family checkpoint, independent of transformers' version.

    rope_scaling holds the scaling parameters of a non-default rope type as sorted
    (key, value) pairs (lists turned into tuples) so the dataclass stays hashable;
    `rope_scaling_dict()` gives them back as a dict. sliding_layers lists the layer indices
    that attend through a sliding window of `sliding_window` tokens (Qwen2/3 only apply it from
    max_window_layers on).

    moe_layers lists the layers whose feed-forward block is a mixture of `num_experts` experts
    of width moe_intermediate_size, `num_experts_per_tok` of them per token, their router
    weights renormalized to sum to 1 when norm_topk_prob; the other layers run the dense MLP of
    width intermediate_size. Qwen3-MoE's decoder_sparse_step and mlp_only_layers are resolved
    into moe_layers here, so the model asks one question per layer.

    DeepSeek-V3 adds grouped routing (experts in `n_group` groups, tokens choose among the best
    `topk_group` groups), `routed_scaling_factor` on the routed weights and `n_shared_experts`
    always-on experts; its first_k_dense_replace is resolved into moe_layers. Its attention is
    multi-head latent attention (MLA, `is_mla`): keys and values come from one latent of
    kv_lora_rank values per token, queries through a q_lora_rank bottleneck when it is set;
    head_dim is then the rope part of a head (qk_rope_head_dim), as transformers sets it.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    sliding_layers: tuple[int, ...]
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    rope_theta: float
    rope_type: str = "default"
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    num_nextn_predict_layers: int = 0  # DeepSeek's MTP layers, after num_layers (deepseek_mtp.py)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {self.rope_type!r}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if dict(self.rope_scaling).get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial rotary embeddings are not supported")
        if (self.sliding_window is None) != (not self.sliding_layers):
            raise ValueError("sliding_window and sliding_layers must be set together")
        if self.moe_layers:
            self._check_moe()

    def _check_moe(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                f"[1, num_experts ({self.num_experts})]"
            )
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size {self.moe_intermediate_size} must be positive")
        if not set(self.moe_layers) <= set(range(self.num_layers)):
            raise ValueError(f"moe_layers {self.moe_layers} outside 0..{self.num_layers - 1}")
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(
                f"{self.num_experts} experts in {self.n_group} groups, top {self.topk_group} "
                "groups: the groups must split the experts evenly and topk_group fit in them"
            )

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (one cached latent per token)."""
        return self.kv_lora_rank > 0

    @property
    def qk_rope_head_dim(self) -> int:
        """The rotated part of an MLA query or key head (head_dim, where rope reads it)."""
        return self.head_dim

    def rope_scaling_dict(self) -> dict[str, Any]:
        """The rope scaling parameters as transformers spells them (without type and theta)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.rope_scaling}

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer's feed-forward block is the mixture of experts."""
        return layer in self.moe_layers

    def layer_sliding_window(self, layer: int) -> int | None:
        """The attention window of one layer, or None when it attends to its whole context."""
        return self.sliding_window if layer in self.sliding_layers else None

    @classmethod
    def from_hf(cls, hf_config: Any, generation_config: Any | None = None) -> ModelArchConfig:
        """Build from a transformers config (4.x or 5.x style) and its optional generation config.

        eos_token_ids is the union of both configs' eos ids (config first): chat models often
        list their end-of-turn token only in generation_config.json.
        """
        arch = _architecture(hf_config)
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; the MLP is SwiGLU (silu)")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        is_qwen2 = arch == QWEN2
        rope_type, rope_theta, rope_scaling = _rope_settings(hf_config)
        window, sliding_layers = _sliding_window(arch, hf_config)
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            # Qwen2 hard-codes bias on q/k/v and none on o_proj, whatever the config says.
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=not is_qwen2 and attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            sliding_window=window,
            sliding_layers=sliding_layers,
            max_position_embeddings=hf_config.max_position_embeddings,
            eos_token_ids=_eos_ids(hf_config, generation_config),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_scaling=rope_scaling,
            **_moe_settings(arch, hf_config),
            **_mla_settings(arch, hf_config),
        )

    @classmethod
    def from_dir(cls, model: str | Path) -> ModelArchConfig:
        """Read a checkpoint's config: config.json (and generation_config.json when present)
        of a directory, or a GGUF file's metadata.

        transformers reads them (its AutoConfig fills defaults and normalizes rope settings),
        but importing its config classes costs a node about 3 s of CPU at every start (they
        pull in torch._dynamo and torch.distributed). So the result is kept as JSON in the
        cache, keyed by both files' bytes, transformers' version and these fields: a node
        started again on the same checkpoint reads it back without transformers."""
        from pdserve.common.model.checkpoint import Checkpoint, cache_dir

        checkpoint = Checkpoint.resolve(model)
        hf_dir = checkpoint.hf_dir()
        path = cache_dir() / "arch" / f"{_config_key(hf_dir)}.json"
        try:
            return cls._from_json(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            pass  # not cached yet (or unreadable): read it through transformers
        arch = cls.from_hf(checkpoint.hf_config(), checkpoint.generation_config())
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(dataclasses.asdict(arch)))
            os.replace(tmp, path)  # atomic: processes starting together may all write it
        except OSError:
            pass  # a read-only cache only costs the next start the same time again
        return arch

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> ModelArchConfig:
        """The inverse of `dataclasses.asdict` through JSON (lists back into tuples)."""
        d = dict(d)
        d["sliding_layers"] = tuple(d["sliding_layers"])
        d["moe_layers"] = tuple(d["moe_layers"])
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        d["rope_scaling"] = tuple(
            (k, tuple(v) if isinstance(v, list) else v) for k, v in d["rope_scaling"]
        )
        return cls(**d)


def _config_key(hf_dir: Path) -> str:
    """What a cached ModelArchConfig depends on: the config files' bytes, transformers'
    version (its defaults and rope normalization) and the dataclass's fields."""
    h = hashlib.sha256()
    for name in ("config.json", "generation_config.json"):
        f = hf_dir / name
        h.update(name.encode() + (f.read_bytes() if f.is_file() else b"-"))
    try:
        h.update(metadata.version("transformers").encode())
    except metadata.PackageNotFoundError:
        h.update(b"-")
    h.update(" ".join(f.name for f in dataclasses.fields(ModelArchConfig)).encode())
    return h.hexdigest()[:32]


def _architecture(hf_config: Any) -> str:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    # A config built in code (not read from disk) has no architectures list; its model_type
    # still names the family unambiguously.
    model_type = getattr(hf_config, "model_type", None)
    if not archs and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise ValueError(
        f"unsupported architecture {archs or model_type!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope_settings(hf_config: Any) -> tuple[str, float, tuple[tuple[str, Any], ...]]:
    """(rope_type, rope_theta, scaling pairs) from either config style.

    transformers 5.x keeps everything in `rope_parameters` (theta included); 4.x has a separate
    `rope_theta` and an optional `rope_scaling` dict that older checkpoints spell with "type".
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
        scaling = dict(params)
    else:
        theta = getattr(hf_config, "rope_theta", None)
        scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    extra = {k: v for k, v in scaling.items() if k not in _ROPE_META_KEYS}
    if rope_type in ("llama3", "yarn"):
        # Both transformers versions fall back to max_position_embeddings when this is missing.
        extra.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    pairs = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in extra.items()))
    return rope_type, float(10000.0 if theta is None else theta), pairs


def _sliding_window(arch: str, hf_config: Any) -> tuple[int | None, tuple[int, ...]]:
    """(window, layers that use it); (None, ()) when no layer slides."""
    window = getattr(hf_config, "sliding_window", None)
    n = hf_config.num_hidden_layers
    if arch in (MISTRAL, MIXTRAL):
        layers = tuple(range(n)) if window is not None else ()
    elif arch == QWEN3_MOE:
        # Every layer slides when the flag is on (its config has no max_window_layers).
        on = getattr(hf_config, "use_sliding_window", False) and window is not None
        layers = tuple(range(n)) if on else ()
    elif arch in (QWEN2, QWEN3):
        # transformers keeps sliding_window set when use_sliding_window is False (4.x), so the
        # flag decides; 5.x also records the per-layer choice in layer_types.
        if not getattr(hf_config, "use_sliding_window", False) or window is None:
            layers = ()
        elif getattr(hf_config, "layer_types", None):
            layers = tuple(
                i for i, t in enumerate(hf_config.layer_types) if t == "sliding_attention"
            )
        else:
            first = getattr(hf_config, "max_window_layers", 0)
            layers = tuple(range(first, n))
    else:
        layers = ()
    return (int(window), layers) if layers else (None, ())


def _moe_settings(arch: str, hf_config: Any) -> dict[str, Any]:
    """The MoE fields of ModelArchConfig; none for a dense architecture."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    n = hf_config.num_hidden_layers
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0)
    if arch == MIXTRAL:
        # Every layer is sparse, its experts as wide as intermediate_size, weights renormalized.
        width, renormalize, layers = hf_config.intermediate_size, True, tuple(range(n))
    elif arch == DEEPSEEK_V3:
        experts = hf_config.n_routed_experts
        width, renormalize = hf_config.moe_intermediate_size, bool(hf_config.norm_topk_prob)
        layers = tuple(range(hf_config.first_k_dense_replace or 0, n)) if experts else ()
    else:
        width, renormalize = hf_config.moe_intermediate_size, bool(hf_config.norm_topk_prob)
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
        sparse = range(n) if experts > 0 else ()
        layers = tuple(i for i in sparse if i not in dense and (i + 1) % step == 0)
    settings = {
        "num_experts": int(experts),
        "num_experts_per_tok": int(hf_config.num_experts_per_tok),
        "moe_intermediate_size": int(width),
        "norm_topk_prob": renormalize,
        "moe_layers": layers,
    }
    if arch == DEEPSEEK_V3:  # grouped routing and always-on shared experts
        settings |= {
            "n_group": int(hf_config.n_group or 1),
            "topk_group": int(hf_config.topk_group or 1),
            "routed_scaling_factor": float(hf_config.routed_scaling_factor),
            "n_shared_experts": int(hf_config.n_shared_experts or 0),
        }
    return settings


def _mla_settings(arch: str, hf_config: Any) -> dict[str, Any]:
    """The latent-attention fields of ModelArchConfig; none for other attention."""
    if arch != DEEPSEEK_V3:
        return {}
    return {
        "kv_lora_rank": int(hf_config.kv_lora_rank),
        "q_lora_rank": hf_config.q_lora_rank,
        "qk_nope_head_dim": int(hf_config.qk_nope_head_dim),
        "v_head_dim": int(hf_config.v_head_dim),
        "rope_interleave": bool(getattr(hf_config, "rope_interleave", False)),
        "num_nextn_predict_layers": int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0),
    }


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _eos_ids(hf_config: Any, generation_config: Any | None) -> tuple[int, ...]:
    ids = _as_ids(getattr(hf_config, "eos_token_id", None))
    if generation_config is not None:
        ids += _as_ids(getattr(generation_config, "eos_token_id", None))
    return tuple(dict.fromkeys(ids))
