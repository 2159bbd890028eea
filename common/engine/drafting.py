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
# What a verify step costs beyond a one-row decode step, as shares of that step (`StepCost`): a
# fixed part and one per row (the matmuls, the head, each query's attention). SmolLM2's Q4_1
# GGUF in bf16, one thread, eager, with a verify step's queries one row of the in-place
# attention kernel (8f8415d: before it they took the flash path past 192 keys, most of the
# fixed part): a step of 2 to 8 rows, widths interleaved step by step, costs 1.00-1.19,
# 1.13-1.24, 1.26-1.38, 1.42-1.57, 1.42-1.64, 1.59-1.80 and 1.56-1.86 one-row steps (medians,
# six runs); a line through each run's medians: v -0.06-0.08, r 0.09-0.13, means 0.01 and 0.11
# (scripts/spec_step_cost.py; docs/speculative.md, "Step costs"). Before it: 0.16 and 0.11.
VERIFY_COST = 0.01
ROW_COST = 0.11
# The same against a compiled plain step (the CPU's default decode), where verify steps run
# the compiled bucket that holds their rows (1 + k, padded up to 2, 4 or 8): one verify step of
# k = 1..7 drafts, in compiled one-row steps. Its shape is the buckets', not a line: 2 rows cost
# little more than one, 3 pad to 4, 5-8 all run bucket 8. SmolLM2's Q4_1 GGUF in bf16, one
# thread, widths interleaved step by step, six runs with the verify rows in the attention
# kernel: each bucket's median over the runs' median ratios of its rows (bucket 2 1.12-1.20,
# bucket 4 1.37-1.54, bucket 8 1.86-2.24; before the kernel took them 1.34, 1.67 and 2.12, and
# 1.43, 1.77 and 2.33 in five runs alternating with these; scripts/spec_step_cost.py;
# docs/speculative.md, "Step costs").
COMPILED_STEP_COSTS = (1.15, 1.48, 1.48, 2.05, 2.05, 2.05, 2.05)
# How much more a step's tokens per unit of time drafting must promise than a plain step before
# a request drafts at all. The tables above are each bucket's median over runs that spread by
# +-4-7% (bucket 2 1.12-1.20, bucket 4 1.37-1.54), and a request's acceptance is a decayed
# estimate over its last few steps; without a margin, free chat (14-15% of drafts accepted)
# sat on the compiled table's break-even (k = 1 pays from 0.15) and drafted at twice the steps
# for nothing (docs/benchmarks.md, spec section: 0.93-1.08x against none). With it a request
# drafts 1 from an acceptance of ~0.27 compiled, ~0.23 eager.
MIN_GAIN = 0.1
# How much of a request's acceptance estimate one verify step replaces.
DECAY = 0.8


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


@dataclass(frozen=True, slots=True)
class StepCost:
    """What a verify step costs beyond a one-row decode step, as shares of that step: a fixed
    part and one per row. Fixed, not fitted on the engine's steps as they run: a k chosen from
    timings would differ between a colocated engine and a decode node, and through P/D the
    drafts per request must equal colocated's (issue 38's parity bar)."""

    verify_cost: float = VERIFY_COST
    row_cost: float = ROW_COST
    # Measured steps of k = 1, 2, ... drafts, where a line is not their shape (compiled
    # buckets); past the last, row_cost a draft more.
    by_drafts: tuple[float, ...] = ()

    def relative(self, k: int) -> float:
        """A step of one request verifying k drafts, in one-row steps."""
        if not k:
            return 1.0
        if not self.by_drafts:
            return 1.0 + self.verify_cost + self.row_cost * k
        last = len(self.by_drafts)
        return self.by_drafts[min(k, last) - 1] + self.row_cost * max(k - last, 0)


def step_cost(compiled_verify: bool) -> StepCost:
    """The costs of the steps the engine runs: compiled where its verify steps run compiled
    (chosen by the configured compile mode, not by what a step ran: a background compile
    switches at a time another node does not share, and k must not depend on it)."""
    return StepCost(by_drafts=COMPILED_STEP_COSTS) if compiled_verify else StepCost()


def best_k(acceptance: float, cost: StepCost, limit: int) -> int:
    """The draft count in [0, limit] with the most tokens per unit of step time, drafts
    accepted in turn each with probability `acceptance` (k drafts emit 1 + a + ... + a^k
    tokens on average, for cost.relative(k) one-row steps); 0 unless drafting beats a plain
    step by MIN_GAIN."""
    best, best_rate, emitted = 0, 1.0 + MIN_GAIN, 1.0
    for k in range(1, limit + 1):
        emitted += acceptance**k
        rate = emitted / cost.relative(k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


@dataclass(slots=True)
class _Budget:
    """One request's recent acceptance (decayed counts of accepted drafts and of drafts
    tried in turn: a rejected draft ends its step's run), and the steps it sits out at k = 0."""

    hits: float = 1.0  # a prior of one hit in two tries: a new request starts at k = 1
    tries: float = 2.0
    idle: int = 0

    @property
    def acceptance(self) -> float:
        return self.hits / self.tries


class Drafter:
    """The proposer of one engine and each running request's k.

    Adaptive k (config.adaptive): each step a request drafts the k that gives the most tokens
    per unit of step time (`best_k`) from its recent acceptance and what a row of a step costs
    (`StepCost`), up to the configured k. Where no k beats a plain decode step the request
    goes without drafting (no drafting cost) for PROBE_AFTER_STEPS steps, then probes at
    k = 1. Steps where the proposer has no guess do
    not count. Without adaptive k every step drafts the configured k.
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer | None = None,
        cost: StepCost | None = None,
    ) -> None:
        self.config = config
        self.proposer = proposer or create_proposer(config)
        self.max_k = config.num_speculative_tokens
        self.stats = SpecDecodeStats()
        self.cost = cost or StepCost()
        self._budgets: dict[str, _Budget] = {}
        # The same counters per running request that drafted (from its first drafts to
        # `finish`): a node's trace of the request keeps its own reference to them.
        self.by_request: dict[str, SpecDecodeStats] = {}

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
        k = self.max_k
        if self.config.adaptive:
            budget = self._budgets.setdefault(request_id, _Budget())
            if budget.idle > 0:
                budget.idle -= 1
                if budget.idle > 0:
                    return []
                k = 1  # the probe after sitting out
            else:
                k = best_k(budget.acceptance, self.cost, self.max_k)
                if k == 0:
                    budget.idle = PROBE_AFTER_STEPS
                    return []
        k = min(k, limit)
        drafts = self.proposer.propose(request_id, tokens, k)[:k] if k > 0 else []
        if drafts and request_id not in self.by_request:
            self.by_request[request_id] = SpecDecodeStats()
        return drafts

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verify step of `drafted` drafts accepted the first `accepted` of them."""
        self.stats.observe(drafted, accepted)
        own = self.by_request.get(request_id)
        if own is not None:
            own.observe(drafted, accepted)
        budget = self._budgets.get(request_id)
        if budget is None:
            return
        budget.hits = DECAY * budget.hits + accepted
        budget.tries = DECAY * budget.tries + accepted + (accepted < drafted)

    def finish(self, request_id: str, tokens: Sequence[int]) -> None:
        """The request ended: drop its k, let the proposer keep what it learns from it."""
        self._budgets.pop(request_id, None)
        self.by_request.pop(request_id, None)
        self.proposer.finish(request_id, tokens)


def create_drafter(
    config: SpeculativeConfig | None,
    proposer: Proposer | None = None,
    cost: StepCost | None = None,
) -> Drafter | None:
    """The engine's drafter, or None without speculation; `proposer` is one the model runner
    built (draft_model), else the config's method makes its own; `cost`: its steps'
    (`step_cost`; eager's by default)."""
    return None if config is None else Drafter(config, proposer, cost)
