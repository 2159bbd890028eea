"""Speculative decoding on the scheduler's side: which tokens to draft for a request this step
(its proposer and its adaptive k) and what the drafts earned (vLLM's `spec_decode_*`
counters). Pure Python; the model runner verifies the drafts (`Sampler.verify`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.common.engine.request import Request
from pdserve.common.spec.config import SpeculativeConfig
from pdserve.common.spec.proposer import Proposer, create_proposer

# Decode steps a request whose k fell to 0 goes without drafting before it tries k = 1
# again: its text may have turned repetitive since (a quote, a copied block of code).
PROBE_AFTER_STEPS = 16


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since the engine started, under vLLM's names: verify steps of a request that
    had drafts, drafted tokens, accepted drafts, and accepted drafts by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        grow = drafted - len(self.accepted_per_position)
        self.accepted_per_position.extend([0] * max(grow, 0))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_length(self) -> float:
        """Tokens a verify step emits on average (accepted drafts plus the target's own)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def counters(self) -> dict[str, float]:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }


@dataclass(slots=True)
class _Budget:
    """One request's adaptive k, and how many steps it still sits out at k = 0."""

    k: int
    idle: int = 0


class Drafter:
    """The proposer of one engine and each running request's k.

    Adaptive k (config.adaptive): a request starts at num_speculative_tokens; after a verify
    step that accepted every draft its k grows by one (up to the configured k); after one that
    rejected a draft it becomes accepted + 1 (what just worked and one more), and after one
    that accepted none it halves, down to 0: a plain decode step, no drafting cost, for
    PROBE_AFTER_STEPS steps, then a probe at k = 1. Steps where the proposer has no guess do
    not count.
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.proposer = proposer or create_proposer(config)
        self.max_k = config.num_speculative_tokens
        self.stats = SpecDecodeStats()
        self._budgets: dict[str, _Budget] = {}

    def drafts(self, request: Request, limit: int) -> list[int]:
        """Drafts for a request's next verify step, at most limit and what max_tokens leaves
        room for, cut where a request's grammar refuses one; none for a seeded sampled request
        (its draws must not depend on what else is batched)."""
        params = request.sampling
        if params.seed is not None and not params.greedy:
            return []
        limit = min(limit, params.max_tokens - request.num_output_tokens - 1)
        drafts = self.propose(request.request_id, request.all_token_ids, limit)
        if request.grammar is not None and drafts:
            del drafts[request.grammar.allowed_drafts(drafts) :]
        return drafts

    def propose(self, request_id: str, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to min(k, limit) drafts to follow `tokens` (the request's known tokens)."""
        budget = self._budgets.setdefault(request_id, _Budget(self.max_k))
        if budget.k == 0:
            budget.idle -= 1
            if budget.idle > 0:
                return []
            budget.k = 1
        k = min(budget.k, limit)
        return self.proposer.propose(request_id, tokens, k)[:k] if k > 0 else []

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verify step of `drafted` drafts accepted the first `accepted` of them."""
        self.stats.observe(drafted, accepted)
        budget = self._budgets.get(request_id)
        if budget is None or not self.config.adaptive:
            return
        if accepted == drafted:
            budget.k = min(budget.k + 1, self.max_k)
        elif accepted:
            budget.k = accepted + 1
        else:
            budget.k //= 2
            budget.idle = PROBE_AFTER_STEPS

    def finish(self, request_id: str, tokens: Sequence[int]) -> None:
        """The request ended: drop its k, let the proposer keep what it learns from it."""
        self._budgets.pop(request_id, None)
        self.proposer.finish(request_id, tokens)


def create_drafter(
    config: SpeculativeConfig | None, proposer: Proposer | None = None
) -> Drafter | None:
    """The engine's drafter, or None without speculation; `proposer` is one the model runner
    built (draft_model), else the config's method makes its own."""
    return None if config is None else Drafter(config, proposer)
