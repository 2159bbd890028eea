"""Per-request sampling and stopping parameters, validated where the user hands them in."""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _check(self.max_tokens >= 1, "max_tokens", "must be at least 1")
        _check(self.min_tokens >= 0, "min_tokens", "must be non-negative")
        _check(self.min_tokens <= self.max_tokens, "min_tokens", "must not exceed max_tokens")
        _check(self.temperature >= 0.0, "temperature", "must be non-negative")
        _check(self.top_k >= 0 or self.top_k == -1, "top_k", "must be -1, 0 (off) or positive")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be 0..20")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def _check(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{name} {what}")
