"""Speculative decoding's pure parts (issue 38): `Sampler.verify` (greedy acceptance, the
rejection rule's output distribution), the scheduler's stop checks over a verify step's
tokens and its budget for drafts, and adaptive k."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from pdserve.common.engine.config import SchedulerConfig
from pdserve.common.engine.drafting import (
    COMPILED_STEP_COSTS,
    MIN_GAIN,
    PROBE_AFTER_STEPS,
    ROW_COST,
    VERIFY_COST,
    Drafter,
    StepCost,
    best_k,
    step_cost,
)
from pdserve.common.engine.kv_cache_manager import KVCacheManager
from pdserve.common.engine.request import FinishReason, Request
from pdserve.common.engine.sampler import Sampler, SamplingRow
from pdserve.common.engine.scheduler import SampledToken, Scheduler
from pdserve.common.spec.base import Proposer
from pdserve.common.spec.config import SpeculativeConfig
from pdserve.common.wire.payloads import SamplingParams

VOCAB = 6
DRAWS = 4000


def _peaked(*best: int) -> torch.Tensor:
    """Logits [len(best), VOCAB] whose argmax in row i is best[i]."""
    logits = torch.zeros(len(best), VOCAB)
    for i, token in enumerate(best):
        logits[i, token] = 5.0
    return logits


@pytest.mark.parametrize(
    "target,drafts,emitted",
    [
        ((1, 2, 3, 4), (1, 2, 3), [1, 2, 3, 4]),  # all accepted, then the bonus token
        ((1, 2, 3, 4), (1, 5, 3), [1, 2]),  # the target's token at the first mismatch
        ((1, 2), (0,), [1]),
    ],
)
def test_greedy_accepts_while_equal(target, drafts, emitted) -> None:
    row = SamplingRow(SamplingParams(temperature=0.0, logprobs=0), None)
    out = Sampler(seed=0).verify(_peaked(*target), row, drafts)
    assert out.token_ids == emitted
    assert [lp.token_id for lp in out.logprobs] == emitted


def _tables(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A toy target model two tokens deep: logits of the first token, and of the second
    given the first."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, generator=g) * 1.5, torch.randn(VOCAB, VOCAB, generator=g) * 1.5


def _counts(pairs: Sequence[tuple[int, int]]) -> list[int]:
    """Counts of each (t1, t2), flat index t1 * VOCAB + t2."""
    counts = [0] * VOCAB * VOCAB
    for t1, t2 in pairs:
        counts[t1 * VOCAB + t2] += 1
    return counts


def _within_sampling_error(counts: Sequence[int], probs: Sequence[float]) -> bool:
    """Every cell within 4.5 standard deviations of its expected count (a false alarm in
    about 1 of 10^4 runs for 36 cells), and the total variation distance within 4 times its
    expected size under exact sampling."""
    tv_scale = sum(math.sqrt(p * (1 - p) / DRAWS) for p in probs) / 2
    tv = sum(abs(c / DRAWS - p) for c, p in zip(counts, probs, strict=True)) / 2
    cells = all(
        abs(c - DRAWS * p) <= 4.5 * math.sqrt(DRAWS * p * (1 - p)) + 1e-9
        for c, p in zip(counts, probs, strict=True)
    )
    return cells and tv <= 4 * tv_scale


@pytest.mark.parametrize("likely", [True, False])
def test_sampled_tokens_follow_the_target_distribution(likely: bool) -> None:
    """4,000 draws of two tokens at temperature 0.8, top-p 0.9, two drafts per step (the
    first draft the target's likeliest token, or one top-p cuts: always rejected): the pairs
    are distributed as without drafts, within sampling error of the target's joint
    distribution, which plain sampling meets too."""
    first, second = _tables()
    row = SamplingRow(SamplingParams(temperature=0.8, top_p=0.9), None)
    p1 = Sampler._probs(first[None], [row])[0]
    p2 = Sampler._probs(second, [row] * VOCAB)
    joint = (p1[:, None] * p2).flatten().tolist()
    d1 = int(p1.argmax() if likely else p1.argmin())
    d2 = int(p2[d1].argsort(descending=True)[1])  # accepted some of the time
    sampler = Sampler(seed=1)

    def then(t1s: list[int]) -> list[tuple[int, int]]:
        """Each first token and a second one drawn after it by a plain step."""
        t2s = sampler(second[t1s], [row] * len(t1s)).token_ids
        return list(zip(t1s, t2s, strict=True))

    plain = then(sampler(first.expand(DRAWS, VOCAB), [row] * DRAWS).token_ids)
    assert _within_sampling_error(_counts(plain), joint)
    logits = torch.stack([first, second[d1], torch.zeros(VOCAB)])  # bonus row: unused
    runs = [sampler.verify(logits, row, (d1, d2)).token_ids for _ in range(DRAWS)]
    pairs = [(r[0], r[1]) for r in runs if len(r) >= 2]
    pairs += then([r[0] for r in runs if len(r) == 1])  # rejected at once: the next step
    assert 0 < sum(r[0] == d1 for r in runs) if likely else not any(r[0] == d1 for r in runs)
    assert _within_sampling_error(_counts(pairs), joint)


# -- the scheduler's side -------------------------------------------------------------------


class FixedDrafts(Proposer):
    """Drafts the same tokens every step."""

    def __init__(self, drafts: Sequence[int]) -> None:
        self.drafts = list(drafts)

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        return self.drafts[:k]

    def finish(self, request_id: str, tokens: Sequence[int]) -> None:
        pass


def _scheduler(k: int = 3, budget: int = 512, drafts=(7, 8, 9)) -> Scheduler:
    spec = SpeculativeConfig("ngram", k, adaptive=False)  # every step asks for k drafts
    config = SchedulerConfig(max_num_batched_tokens=budget, speculative_config=spec)
    scheduler = Scheduler(config, KVCacheManager(64, 4), 512)
    scheduler.drafter = Drafter(spec, FixedDrafts(drafts))
    return scheduler


def _decoding(scheduler: Scheduler, rid: str, prompt=(1, 2, 4, 5, 5), **params) -> Request:
    """A request past its prefill, its first token sampled."""
    return _prefilled(scheduler, [Request(rid, list(prompt), SamplingParams(**params), (3,))])[0]


def _prefilled(scheduler: Scheduler, requests: list[Request]) -> list[Request]:
    """Requests past their prefill (one step), their first token (6) sampled."""
    for request in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update(out, {r.request_id: SampledToken(r.request_id, 6) for r in requests})
    return requests


def _verify(scheduler: Scheduler, emitted: dict[str, Sequence[int]]):
    """One step whose verify emits `emitted` per request; its updates and the schedule."""
    out = scheduler.schedule()
    sampled = {rid: tuple(SampledToken(rid, t) for t in ts) for rid, ts in emitted.items()}
    return scheduler.update(out, sampled), out


def test_tokens_past_a_stop_token_are_dropped() -> None:
    scheduler = _scheduler()
    request = _decoding(scheduler, "r", stop_token_ids=(8,))
    (update,), out = _verify(scheduler, {"r": (7, 8, 9, 10)})
    assert out.seqs[0].token_ids == (6, 7, 8, 9) and out.seqs[0].num_drafts == 3
    assert update.new_token_ids == (7, 8) and update.finish_reason is FinishReason.STOP
    assert request.output_token_ids == [6, 7, 8]
    scheduler.kv.check_integrity()
    assert scheduler.kv.num_free_blocks == 63


def test_drafts_stop_at_max_tokens() -> None:
    scheduler = _scheduler()
    request = _decoding(scheduler, "r", max_tokens=3)
    (update,), out = _verify(scheduler, {"r": (7, 8)})
    assert out.seqs[0].num_drafts == 1  # max_tokens leaves room for one draft and the bonus
    assert update.new_token_ids == (7, 8) and update.finish_reason is FinishReason.LENGTH
    assert request.output_token_ids == [6, 7, 8]


def test_accepted_drafts_count_as_computed_and_rejected_blocks_go_back() -> None:
    scheduler = _scheduler(k=8, drafts=range(10, 18))
    request = _decoding(scheduler, "r")
    assert len(scheduler.kv.block_ids("r")) == 2  # 5 prompt tokens + room for the 6th
    (update,), out = _verify(scheduler, {"r": (10, 11, 99)})  # 2 accepted, then the target's
    assert out.seqs[0].num_drafts == 8 and update.new_token_ids == (10, 11, 99)
    assert request.num_computed_tokens == 8  # 5 + the sampled 6 + 2 accepted drafts
    assert len(scheduler.kv.block_ids("r")) == 3  # 9 known tokens; 14 slots were reserved
    scheduler.kv.check_integrity()


def test_drafts_leave_every_later_decode_its_token() -> None:
    scheduler = _scheduler(k=5, budget=4)
    _prefilled(scheduler, [Request(rid, [1], SamplingParams(), (3,)) for rid in "abc"])
    out = scheduler.schedule()
    assert [len(seq.token_ids) for seq in out.seqs] == [2, 1, 1]
    assert out.num_batched_tokens == 4


def _cost(verify: float, row: float) -> StepCost:
    return StepCost(verify, row)


def test_best_k_weighs_acceptance_against_a_verify_steps_cost() -> None:
    rows = _cost(0.0, 0.25)  # a row costs a quarter of a step, nothing else
    assert best_k(0.0, rows, 5) == 0  # nothing accepted: a plain step
    assert best_k(0.5, rows, 5) == 1  # 1.5 tokens for 1.25 steps; a second draft: 1.75 for 1.5
    assert best_k(0.8, rows, 5) == 3  # 2.95 / 1.75 beats 2.44 / 1.5 and 3.36 / 2
    assert best_k(0.95, rows, 5) == 5
    assert best_k(0.95, rows, 2) == 2  # never past the limit
    assert best_k(0.9, _cost(0.0, 1.0), 5) == 0  # a row costs a whole step: no draft pays
    assert best_k(0.8, _cost(0.0, 0.05), 5) == 5  # near-free rows: draft all
    # a gain under MIN_GAIN is no gain: 1.2 tokens for 1.1 steps is 1.09x a plain step
    assert MIN_GAIN == 0.1 and best_k(0.2, _cost(0.0, 0.1), 5) == 0
    assert best_k(0.25, _cost(0.0, 0.1), 5) == 1  # 1.25 / 1.1 = 1.14x
    # a verify step's fixed cost: half the drafts accepted no longer pay for one
    assert best_k(0.5, _cost(0.3, 0.25), 5) == 0
    assert best_k(0.8, _cost(0.3, 0.25), 5) == 4  # 3.36 / 2.3 beats 2.95 / 2.05, 3.69 / 2.55


def test_step_cost_is_a_verify_steps_parts_in_one_row_steps() -> None:
    cost = StepCost()
    assert (cost.verify_cost, cost.row_cost) == (VERIFY_COST, ROW_COST)
    assert cost.relative(0) == 1.0  # a plain step
    assert StepCost(0.2, 0.1).relative(3) == pytest.approx(1.5)


def test_compiled_step_costs_are_the_buckets_measured() -> None:
    """Where verify steps run compiled, k is chosen against the compiled buckets' measured
    costs, whose shape no line has: one draft (bucket 2) a sixth of a step, two or three
    (bucket 4) one price, four to seven (bucket 8) one price."""
    compiled, eager = step_cost(True), step_cost(False)
    assert eager == StepCost()
    assert [compiled.relative(k) for k in range(8)] == [1.0, *COMPILED_STEP_COSTS]
    assert compiled.relative(9) == pytest.approx(COMPILED_STEP_COSTS[-1] + 2 * ROW_COST)
    assert best_k(0.15, compiled, 5) == 0  # 1.15 tokens for 1.15 steps
    assert best_k(0.15, eager, 5) == 0  # 1.15 for 1.12: a gain under MIN_GAIN
    assert best_k(0.25, compiled, 5) == 0  # 1.09x a plain step's rate: under MIN_GAIN
    assert best_k(0.3, compiled, 5) == 1  # 1.13x
    assert best_k(0.25, eager, 5) == 1  # 1.25 / 1.12 = 1.12x
    assert best_k(0.45, compiled, 5) == 1  # 1.45 / 1.15 beats k = 3's 1.74 / 1.48
    assert best_k(0.7, compiled, 5) == 3  # 2.53 / 1.48 beats 1.7 / 1.15 and k = 5's 2.94 / 2.05
    assert best_k(0.9, compiled, 5) == 3  # 3.44 / 1.48 beats 4.69 / 2.05
    assert best_k(0.95, compiled, 5) == 5  # 5.30 / 2.05 beats 3.71 / 1.48
    assert best_k(0.9, compiled, 2) == 2  # 2.71 / 1.48 beats 1.9 / 1.15


def test_adaptive_k_follows_acceptance_then_sits_out_and_probes() -> None:
    drafter = Drafter(SpeculativeConfig("ngram", 4), FixedDrafts(range(10)))
    ks = []
    for _ in range(6):  # every draft accepted: k climbs to the configured 4
        ks.append(len(drafter.propose("r", [1], limit=9)))
        drafter.observe("r", drafted=ks[-1], accepted=ks[-1])
    # a new request drafts at once, at the k its prior (one hit in two) is worth
    assert ks[0] == best_k(0.5, StepCost(), 4) >= 1 and ks[-1] == 4 and ks == sorted(ks), ks
    drafter.cost = StepCost(0.0, 1.0)  # a row costs a whole step: no draft pays
    assert drafter.propose("r", [1], limit=9) == []
    skipped = 1
    while not drafter.propose("r", [1], limit=9):
        skipped += 1
    assert skipped == PROBE_AFTER_STEPS  # plain steps, then a probe at k = 1
    fixed = Drafter(SpeculativeConfig("ngram", 4, adaptive=False), FixedDrafts(range(10)))
    fixed.observe("r", drafted=4, accepted=0)
    assert len(fixed.propose("r", [1], limit=9)) == 4


def test_failing_drafts_stop_paying_within_a_few_steps() -> None:
    drafter = Drafter(SpeculativeConfig("ngram", 5), FixedDrafts(range(10)))
    drafted = 0
    for _ in range(100):
        k = len(drafter.propose("r", [1], limit=9))
        if k:
            drafter.observe("r", drafted=k, accepted=0)
        drafted += k
    # The first tries (four steps, 5 drafts: at eager's costs a failed draft costs ~0.12 of a
    # step, so the prior of one hit in two takes four misses to fall under k 1's ~0.13), then
    # one probe each PROBE_AFTER_STEPS steps sat out.
    assert drafted <= 5 + 100 // PROBE_AFTER_STEPS, drafted


@pytest.mark.parametrize(
    "params,drafted",
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0.8}, True),
        ({"temperature": 0.8, "seed": 1}, False),  # its draws must not depend on the batch
        ({"temperature": 0.0, "seed": 1}, True),  # greedy draws nothing
        ({"temperature": 0.0, "min_tokens": 2}, False),  # the next token is the 2nd: banned
    ],
)
def test_who_is_drafted_for(params, drafted: bool) -> None:
    scheduler = _scheduler()
    _decoding(scheduler, "r", **params)
    assert (scheduler.schedule().seqs[0].num_drafts > 0) is drafted


class RefusesAfter:
    """A grammar that allows the first `n` tokens of any draft."""

    def __init__(self, n: int) -> None:
        self.n = n

    def allowed_drafts(self, drafts: Sequence[int]) -> int:
        return min(self.n, len(drafts))


def test_drafts_under_bans_stop_before_min_tokens() -> None:
    """Bans hold until min_tokens outputs; a verify step bans alike at every position, so
    its last position may sample at most the min_tokens-th output."""
    scheduler = _scheduler(k=5)
    _decoding(scheduler, "r", min_tokens=4)  # 1 output so far: the 2nd to 4th are banned
    seq = scheduler.schedule().seqs[0]
    assert seq.num_drafts == 2 and seq.banned_token_ids == (3,)


def test_a_request_under_a_grammar_is_drafted_for_up_to_its_first_refusal() -> None:
    scheduler = _scheduler()
    request = _decoding(scheduler, "r")
    request.grammar = RefusesAfter(1)
    seq = scheduler.schedule().seqs[0]
    assert (seq.num_drafts, seq.draft_token_ids) == (1, (7,))
