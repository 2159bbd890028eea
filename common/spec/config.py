"""`SpeculativeConfig`: which drafter proposes tokens and how many, parsed from vLLM's
`--speculative-config` JSON keys. Pure Python; validated on construction."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix", "draft_model", "mtp")
# Methods vLLM names that pdserve will build (issue 38) but has not: refused by name, so a
# deployment does not silently run without the drafter it asked for.
NOT_BUILT = ("eagle", "eagle3", "medusa")
# vLLM's keys for the suffix drafter, mapped to the shorter field names used here.
VLLM_ALIASES = {
    "suffix_decoding_max_tree_depth": "suffix_max_tree_depth",
    "suffix_decoding_max_cached_requests": "suffix_max_cached_requests",
    "suffix_decoding_min_token_prob": "suffix_min_token_prob",
    "suffix_decoding_max_spec_factor": "suffix_max_spec_factor",
}
MAX_SPECULATIVE_TOKENS = 64  # a verify step costs k + 1 positions of every budget it meets


def _field_error(name: str, problem: str) -> ValueError:
    return ValueError(f"speculative_config.{name}: {problem}")


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _field_error(name, f"must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise _field_error(name, f"must be {bound}, got {value}")


def _check_float(name: str, value: Any, low: float, high: float, low_open: bool) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _field_error(name, f"must be a number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        left = "(" if low_open else "["
        raise _field_error(name, f"must be in {left}{low}, {high}], got {value}")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How the engine drafts tokens for verification (docs/speculative.md).

    method: "ngram" (prompt lookup in the request's own tokens), "suffix" (suffix trees over
    the request's tokens and recent requests' outputs) or "draft_model" (a smaller model with
    the target's vocabulary drafts greedily from its own KV, a page group of the target's
    blocks: common/spec/draft_model.py) or "mtp" (DeepSeek-V3's multi-token-prediction layer
    drafts from the target's last hidden state, its KV and the hidden states a page group of
    the target's blocks: common/spec/mtp.py).
    model: draft_model's checkpoint directory (vLLM's key); no other method takes one.
    num_speculative_tokens: k, the most tokens drafted per step for one request.
    prompt_lookup_min/max: the n-gram lengths ngram tries, longest first.
    suffix_max_tree_depth: D, the longest token run a suffix tree stores (pattern + draft).
    suffix_max_cached_requests: finished requests whose outputs the global tree keeps (oldest
    evicted first; 0 keeps none).
    suffix_min_token_prob: a suffix draft stops where the estimated probability that the whole
    draft so far is right falls below this.
    suffix_max_spec_factor: a suffix draft is at most this times the matched pattern's length
    (short, weak matches draft little).
    adaptive: the engine shrinks k per request while its drafts keep failing.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    suffix_max_tree_depth: int = 24
    suffix_max_cached_requests: int = 1000
    suffix_min_token_prob: float = 0.1
    suffix_max_spec_factor: float = 1.0
    adaptive: bool = True
    model: str | None = None

    def __post_init__(self) -> None:
        self._check_method()
        self._check_model()
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise _field_error(
                "prompt_lookup_max",
                f"must be >= prompt_lookup_min ({self.prompt_lookup_min}), "
                f"got {self.prompt_lookup_max}",
            )
        _check_int("suffix_max_tree_depth", self.suffix_max_tree_depth, 2)
        _check_int("suffix_max_cached_requests", self.suffix_max_cached_requests, 0)
        _check_float("suffix_min_token_prob", self.suffix_min_token_prob, 0.0, 1.0, False)
        _check_float("suffix_max_spec_factor", self.suffix_max_spec_factor, 0.0, 1e6, True)
        if not isinstance(self.adaptive, bool):
            raise _field_error("adaptive", f"must be true or false, got {self.adaptive!r}")

    def _check_method(self) -> None:
        if self.method in NOT_BUILT:
            raise _field_error(
                "method", f"{self.method!r} is not built yet (built: {', '.join(METHODS)})"
            )
        if self.method not in METHODS:
            raise _field_error(
                "method", f"unknown method {self.method!r} (built: {', '.join(METHODS)})"
            )

    def _check_model(self) -> None:
        if self.method != "draft_model":
            if self.model is not None:
                raise _field_error("model", f"only draft_model takes a model, not {self.method}")
            return
        if not isinstance(self.model, str) or not self.model.strip():
            raise _field_error(
                "model", f"draft_model needs a checkpoint directory, got {self.model!r}"
            )

    @property
    def has_draft_kv(self) -> bool:
        """Whether the drafter keeps KV of its own: a page group of every block, computed
        with the target's and shipped with it from a prefill node."""
        return self.method in ("draft_model", "mtp")

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """A config from vLLM's --speculative-config JSON (text or an already decoded map);
        None or empty text means no speculation. Unknown keys are refused by name."""
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        raw = _decode(value) if isinstance(value, str) else value
        if not isinstance(raw, Mapping):
            raise ValueError(f"speculative_config: must be a JSON object, got {raw!r}")
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, item in raw.items():
            name = VLLM_ALIASES.get(key, key)
            if name not in known:
                raise _field_error(str(key), f"unknown key (known: {', '.join(sorted(known))})")
            if item is not None:  # vLLM's JSON spells "use the default" as null
                kwargs[name] = item
        return cls._build(kwargs)

    @classmethod
    def _build(cls, kwargs: dict[str, Any]) -> SpeculativeConfig:
        if "method" not in kwargs:
            raise _field_error("method", f"required (one of {', '.join(METHODS)})")
        if "num_speculative_tokens" not in kwargs:
            if kwargs["method"] != "suffix":
                raise _field_error("num_speculative_tokens", "required")
            # vLLM's default for suffix: as deep as the tree lets a draft go.
            # (a slotted class's attribute is the slot, not the default: read the field's)
            default = next(f.default for f in fields(cls) if f.name == "suffix_max_tree_depth")
            depth = kwargs.get("suffix_max_tree_depth", default)
            kwargs["num_speculative_tokens"] = depth
        return cls(**kwargs)

    def as_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready: `parse(as_dict())` gives this config back."""
        return asdict(self)

    def to_json(self) -> str:
        """The --speculative-config text that parses back to this config (a child's flags)."""
        return json.dumps(self.as_dict(), sort_keys=True)

    def check_decoding_tp(self, tensor_parallel_size: int) -> None:
        """ValueError, before any rank starts, for a node that decodes at TP > 1 with
        draft_model: a proposal runs k forwards of the draft on rank 0, which the other ranks'
        shards of the draft do not join (not built), so it would draft nothing. A prefill node
        at TP > 1 takes it (it computes and ships the draft's pages to a TP 1 decode node)."""
        if self.method == "draft_model" and tensor_parallel_size > 1:
            raise _field_error(
                "method",
                f"draft_model drafts at tensor parallel size 1 only, not {tensor_parallel_size} "
                "(a prefill node at TP > 1 may carry it for a TP 1 decode node)",
            )


def _decode(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"speculative_config: not valid JSON ({exc.msg} at {exc.pos})") from exc
