"""Per-request sampling and stopping parameters, validated where the user hands them in.

These dataclasses are also the wire form: a message field typed SamplingParams travels as a
map, checked field by field and then by __post_init__ (common/wire/messages.py), so a node
receives the same validated value the router built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5
_CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One constraint on the output, as vLLM's `structured_outputs` (exactly one is set):

    - json: a JSON schema (a dict, or its JSON text); the output is one JSON value of it
    - json_object: any JSON object
    - regex: the output matches the regular expression
    - choice: the output is one of these strings
    - grammar: the output derives from this EBNF grammar (GBNF: `root ::= ...`)

    The schema is kept as JSON text, in the order given (properties are generated in the
    schema's order), so that the value travels on the wire and keys a cache of compiled
    grammars. Nothing is compiled here: nodes compile with xgrammar and answer a grammar that
    does not compile as a bad request.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            object.__setattr__(self, "json", _schema_text(self.json))
        elif isinstance(self.json, str):
            _schema_text(_parse_schema(self.json))
        if self.choice is not None:
            choice = tuple(self.choice)
            _check(bool(choice), "structured_outputs.choice", "must list at least one string")
            _check(
                all(isinstance(c, str) and c for c in choice),
                "structured_outputs.choice",
                "must hold non-empty strings",
            )
            object.__setattr__(self, "choice", choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value != ""), name, "is empty")
        given = [n for n in _CONSTRAINTS if getattr(self, n) not in (None, False)]
        _check(
            len(given) == 1,
            "structured_outputs",
            f"must set exactly one of {', '.join(_CONSTRAINTS)} (got {', '.join(given) or 'none'})",
        )

    @property
    def kind(self) -> str:
        return next(n for n in _CONSTRAINTS if getattr(self, n) not in (None, False))

    @property
    def key(self) -> tuple[str, Any]:
        """What a compiled grammar is cached under (with the tokenizer's identity)."""
        return self.kind, getattr(self, self.kind)


def _parse_schema(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None


def _schema_text(schema: Any) -> str:
    if not isinstance(schema, dict | bool):
        raise ValueError("structured_outputs.json must be a JSON schema (an object)")
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop, as in vLLM/OpenAI.

    temperature 0 means greedy. logprobs=N returns the chosen token's logprob and the top N
    (0: only the chosen one; None: none). Logprobs are those of the raw model distribution,
    before temperature or truncation, like vLLM's default.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    # The logprob of every prompt token after the first and the top N at its position (0:
    # only the prompt's own token); computed while the prompt is prefilled, so a request
    # that asks skips the prefix cache.
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _check(
            self.max_tokens >= 1 or (self.max_tokens == 0 and self.prompt_logprobs is not None),
            "max_tokens",
            "must be at least 1 (0 only with prompt_logprobs: the prompt is scored, nothing "
            "generated)",
        )
        _check(self.min_tokens >= 0, "min_tokens", "must be non-negative")
        _check(self.min_tokens <= self.max_tokens, "min_tokens", "must not exceed max_tokens")
        _check(self.temperature >= 0.0, "temperature", "must be non-negative")
        _check(self.top_k >= 0 or self.top_k == -1, "top_k", "must be -1, 0 (off) or positive")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be 0..20")
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
            "prompt_logprobs",
            "must be 0..20",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def _check(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{name} {what}")
