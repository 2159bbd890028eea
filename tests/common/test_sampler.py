"""Sampler: greedy, bans (and the step min_tokens lifts them), grammar masks in a mixed batch,
truncation, seeded reproducibility, distribution, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.common.engine.config import SchedulerConfig
from pdserve.common.engine.kv_cache_manager import KVCacheManager
from pdserve.common.engine.request import FinishReason, Request
from pdserve.common.engine.sampler import Sampler, SamplingRow, make_generator, skip_draws
from pdserve.common.engine.scheduler import SampledToken, Scheduler
from pdserve.common.wire.payloads import SamplingParams

VOCAB = 64


def _logits(batch: int, seed: int = 0) -> torch.Tensor:
    # Continuous random values: no ties, so "the best token" is unique.
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _row(seed: int | None = None, banned: tuple[int, ...] = (), **kwargs: object) -> SamplingRow:
    params = SamplingParams(seed=seed, **kwargs)  # type: ignore[arg-type]
    generator = None if seed is None else make_generator(seed, "cpu")
    return SamplingRow(params=params, generator=generator, banned_token_ids=banned)


def test_greedy_is_argmax_and_ignores_temperature() -> None:
    logits = _logits(8)
    expected = logits.argmax(dim=-1).tolist()
    for temperature in (0.0, 1e-7):
        out = Sampler(seed=0)(logits, [_row(temperature=temperature)] * 8)
        assert out.token_ids == expected
        assert out.logprobs == [None] * 8


def test_greedy_ties_take_lowest_id() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, [7, 3, 40]] = 5.0
    assert Sampler(seed=0)(logits, [_row(temperature=0.0)]).token_ids == [3]


def test_banned_ids_never_chosen() -> None:
    logits = _logits(4)
    best = logits.argmax(dim=-1).tolist()
    greedy = [_row(temperature=0.0, banned=(b,)) for b in best]
    out = Sampler(seed=0)(logits, greedy)
    assert all(t != b for t, b in zip(out.token_ids, best, strict=True))
    # A sampling row whose allowed set is one token must pick it every time.
    peaked = torch.zeros(1, VOCAB)
    banned = tuple(range(1, VOCAB))
    sampler = Sampler(seed=0)
    for _ in range(50):
        assert sampler(peaked, [_row(temperature=1.0, banned=banned)]).token_ids == [0]


def test_bans_do_not_touch_caller_logits() -> None:
    logits = _logits(1)
    before = logits.clone()
    Sampler(seed=0)(logits, [_row(temperature=1.0, banned=(0, 1, 2))])
    assert torch.equal(logits, before)


EOS, STOP, FILLER = 3, 7, 12


@pytest.mark.parametrize("favourite", [EOS, STOP], ids=["eos", "stop_id"])
@pytest.mark.parametrize("min_tokens", [0, 1, 3])
def test_eos_and_stop_ids_are_banned_until_exactly_min_tokens(
    min_tokens: int, favourite: int
) -> None:
    """The scheduler's bans, applied by the sampler, step by step: a model that always wants
    to stop (on EOS or on a stop id, the other one next best) says FILLER while fewer than
    min_tokens tokens are out, and stops at the very step whose count reaches min_tokens."""
    scheduler = Scheduler(SchedulerConfig(), KVCacheManager(16, 4), max_model_len=64)
    params = SamplingParams(
        max_tokens=8, min_tokens=min_tokens, temperature=0.0, stop_token_ids=(STOP,)
    )
    request = Request("r", [1, 2], params, eos_token_ids=(EOS,))
    scheduler.add_request(request)
    logits = torch.zeros(1, VOCAB)
    # Both stop kinds beat FILLER: a ban that misses either lets it through.
    logits[0, [favourite, EOS + STOP - favourite, FILLER]] = torch.tensor([3.0, 2.0, 1.0])
    sampler = Sampler(seed=0)
    while scheduler.has_unfinished:
        out = scheduler.schedule()
        seqs = [seq for seq in out.seqs if seq.sample]
        rows = [SamplingRow(seq.sampling, None, seq.banned_token_ids) for seq in seqs]
        chosen = sampler(logits.expand(len(rows), -1), rows).token_ids
        sampled = {s.request_id: SampledToken(s.request_id, t) for s, t in zip(seqs, chosen)}
        scheduler.update(out, sampled)
    assert request.output_token_ids == [FILLER] * min_tokens + [favourite]
    assert request.finish_reason is FinishReason.STOP


def test_mixed_batch_keeps_each_constrained_rows_mask() -> None:
    """Only some rows under a grammar (the mask names rows 0, 2 and 4 of five): each takes
    only its own allowed tokens, greedy, sampled or truncated, all of them reachable, and the
    free rows draw what they draw alone."""
    logits = _logits(5, seed=8)
    logits[:, 0] = 20.0  # every row's favourite and no grammar's: a lost mask picks it
    allowed = {0: [5, 9], 2: [9, 20, 33], 4: [40, 41]}  # distinct sets: a swap shows too
    logits[0, [5, 9]] = torch.tensor([0.5, 1.0])  # greedy under its mask: 9
    logits[2, [9, 20, 33]] = 0.0  # evenly likely, so a few draws reach each
    logits[4, [40, 41]] = 0.0
    mask = torch.zeros(len(allowed), VOCAB, dtype=torch.bool)
    for k, tokens in enumerate(allowed.values()):
        mask[k, tokens] = True

    def rows() -> list[SamplingRow]:  # fresh generators: each run starts from its seeds
        greedy, free_greedy = _row(temperature=0.0), _row(temperature=0.0)
        return [greedy, free_greedy, _row(seed=1), _row(seed=2), _row(seed=3, top_k=2)]

    sampler, batch, steps = Sampler(seed=0), rows(), 40
    drawn: list[list[int]] = [[] for _ in batch]
    for _ in range(steps):
        out = sampler(logits, batch, (list(allowed), mask))
        for i, token in enumerate(out.token_ids):
            drawn[i].append(token)
    assert drawn[0] == [9] * steps
    for i in (2, 4):
        assert set(drawn[i]) == set(allowed[i]), (i, drawn[i])
    assert drawn[1] == [0] * steps
    free = rows()[3]
    assert drawn[3] == [sampler(logits[3:4], [free]).token_ids[0] for _ in range(steps)]


@pytest.mark.parametrize(
    "truncation", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}], ids=["top_k", "top_p", "min_p"]
)
def test_extreme_truncation_equals_greedy(truncation: dict[str, float]) -> None:
    logits = _logits(16, seed=1)
    expected = logits.argmax(dim=-1).tolist()
    rows = [_row(seed=s, temperature=1.5, **truncation) for s in range(16)]
    assert Sampler(seed=0)(logits, rows).token_ids == expected


def test_sampled_tokens_stay_inside_top_k() -> None:
    logits = _logits(1, seed=2)
    allowed = set(logits[0].topk(5).indices.tolist())
    seen = set()
    for seed in range(300):
        (token,) = Sampler(seed=0)(logits, [_row(seed=seed, temperature=2.0, top_k=5)]).token_ids
        assert token in allowed
        seen.add(token)
    assert len(seen) > 1, "a temperature-2 top-5 draw should not be deterministic"


def test_sampled_tokens_stay_inside_top_p_nucleus() -> None:
    logits = _logits(1, seed=3)
    probs = logits[0].softmax(dim=-1)
    ordered, order = probs.sort(descending=True)
    # The nucleus is the smallest head whose mass reaches top_p.
    top_p = 0.6
    size = int((ordered.cumsum(dim=0) < top_p).sum()) + 1
    allowed = set(order[:size].tolist())
    assert 1 < size < VOCAB
    for seed in range(300):
        (token,) = Sampler(seed=0)(logits, [_row(seed=seed, top_p=top_p)]).token_ids
        assert token in allowed


@pytest.mark.parametrize("top_p, size", [(0.5, 1), (0.6, 2), (0.75, 2), (0.8, 3)])
def test_top_p_keeps_the_whole_nucleus_and_nothing_past_it(top_p: float, size: int) -> None:
    """Many draws reach every token of the smallest head whose mass reaches top_p, and none
    past it: the token whose mass crosses top_p stays (0.6, 0.8), and a head whose mass is
    top_p exactly is the whole nucleus (0.5, 0.75: these masses add up exactly in float)."""
    probs = torch.tensor([0.0625, 0.5, 0.125, 0.0625, 0.25])
    ranked = [1, 4, 2]  # then 0 and 3, tied: no boundary falls between them
    logits = probs.log()[None, :]
    assert logits[0].softmax(dim=-1).tolist() == probs.tolist()  # exact: boundaries need it
    draws = 2000  # the rarest kept token (1/7 of size 3) shows up all but surely
    rows = [_row(top_p=top_p)] * draws  # unseeded: one draw from the sampler's generator
    drawn = Sampler(seed=0)(logits.expand(draws, -1), rows).token_ids
    assert set(drawn) == set(ranked[:size])


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = _logits(3, seed=4)
    seeded = {0: 11, 2: 22}

    def run(order: list[int], with_noise: bool) -> dict[int, list[int]]:
        # Fresh generators per run: each seeded request starts from its own seed.
        gens = {i: make_generator(s, "cpu") for i, s in seeded.items()}
        sampler = Sampler(seed=123)
        tokens: dict[int, list[int]] = {i: [] for i in seeded}
        for _ in range(20):
            ids = [i for i in order if i in seeded or with_noise]
            rows = [SamplingRow(SamplingParams(temperature=1.0), gens.get(i), ()) for i in ids]
            out = sampler(logits[ids], rows)
            for i, token in zip(ids, out.token_ids, strict=True):
                if i in seeded:
                    tokens[i].append(token)
        return tokens

    alone = {i: run([i], with_noise=False)[i] for i in seeded}
    assert run([0, 1, 2], with_noise=True) == alone
    assert run([2, 1, 0], with_noise=True) == alone
    assert len(set(alone[0])) > 1


def test_empirical_distribution_matches_probs() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log()[None, :] * 0.5  # dividing by temperature 0.5 gives back log(probs)
    draws = 4000
    row = _row(seed=7, temperature=0.5)
    sampler = Sampler(seed=0)
    counts = [0] * 4
    for _ in range(draws):
        counts[sampler(logits, [row]).token_ids[0]] += 1
    for count, p in zip(counts, probs.tolist(), strict=True):
        sigma = math.sqrt(draws * p * (1 - p))
        assert abs(count - draws * p) < 4 * sigma, (counts, probs)


def test_logprobs_are_raw_log_softmax_with_sorted_top_n() -> None:
    logits = _logits(3, seed=5)
    rows = [
        _row(temperature=0.0, logprobs=3, banned=(int(logits[0].argmax()),)),
        _row(seed=1, temperature=0.7, top_k=4, logprobs=0),
        _row(seed=2),
    ]
    out = Sampler(seed=0)(logits, rows)
    expected = logits.log_softmax(dim=-1)
    for i in (0, 1):
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(float(expected[i, lp.token_id]), abs=1e-5)
    top = out.logprobs[0].top  # type: ignore[union-attr]
    ref_lp, ref_ids = expected[0].topk(3)
    assert [t for t, _ in top] == ref_ids.tolist()
    assert [v for _, v in top] == pytest.approx(ref_lp.tolist(), abs=1e-5)
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    # The banned best token still heads the raw top-N: bans are not part of logprobs.
    assert top[0][0] == int(logits[0].argmax())
    assert out.logprobs[1].top == ()  # type: ignore[union-attr]
    assert out.logprobs[2] is None


def test_shape_mismatch_is_misuse() -> None:
    with pytest.raises(AssertionError, match="rows"):
        Sampler(seed=0)(_logits(2), [_row()])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_seeded_rows_match_alone_and_greedy_matches_argmax() -> None:
    logits = _logits(3, seed=6).cuda()

    def rows() -> list[SamplingRow]:
        seeded = SamplingRow(SamplingParams(top_k=8, top_p=0.9), make_generator(5, "cuda"))
        return [seeded, SamplingRow(SamplingParams(), None), SamplingRow(SamplingParams(0.0), None)]

    batch = Sampler(seed=0, device="cuda")(logits, rows())
    alone = Sampler(seed=1, device="cuda")(logits[:1], rows()[:1])
    assert batch.token_ids[0] == alone.token_ids[0]
    assert batch.token_ids[2] == int(logits[2].argmax())


def test_skip_draws_continues_a_seeded_stream() -> None:
    """A node that takes over a seeded request after k sampled tokens draws what the first
    node would have drawn next."""
    logits = _logits(1, seed=6)
    row = lambda g: [SamplingRow(SamplingParams(temperature=1.0), g, ())]
    sampler = Sampler(seed=0)
    gen = make_generator(5, "cpu")
    whole = [sampler(logits, row(gen)).token_ids[0] for _ in range(12)]
    for k in (1, 5):
        resumed = make_generator(5, "cpu")
        skip_draws(resumed, k, VOCAB)
        assert [sampler(logits, row(resumed)).token_ids[0] for _ in range(12 - k)] == whole[k:]
    assert len(set(whole)) > 1  # the stream does vary, so the comparison means something
