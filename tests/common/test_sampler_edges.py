"""Sampler edges that mutation testing showed no test pinned (scripts/mutation.sh): a batch
where every row is under a grammar, logprobs of constrained rows, top_p == 1 keeping the far
tail, the ranks score_tokens gives, a seeded sampler, and what misuse says."""

from __future__ import annotations

import pytest
import torch

from pdserve.common.engine.sampler import (
    Sampler,
    SamplingRow,
    _apply_top_k_top_p,
    make_generator,
    score_tokens,
)
from pdserve.common.wire.payloads import SamplingParams

VOCAB = 16


def row(seed: int | None = None, **kwargs: object) -> SamplingRow:
    params = SamplingParams(seed=seed, **kwargs)  # type: ignore[arg-type]
    return SamplingRow(params, None if seed is None else make_generator(seed, "cpu"))


def logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_batch_all_under_grammars_takes_only_allowed_tokens(temperature: float) -> None:
    raw = logits(2, seed=1)
    mask = torch.zeros(2, VOCAB, dtype=torch.bool)
    mask[0, [3, 4]] = True
    mask[1, [7]] = True
    rows = [row(seed=s, temperature=temperature) for s in (1, 2)]
    for _ in range(20):
        tokens = Sampler(seed=0)(raw, rows, ([0, 1], mask)).token_ids
        assert tokens[0] in (3, 4) and tokens[1] == 7


def test_a_constrained_rows_logprobs_are_of_the_raw_logits() -> None:
    """Masking works on a copy: the logprobs stay those of the model's distribution."""
    raw = logits(2, seed=2)
    expected = raw.log_softmax(dim=-1)
    best = int(raw[0].argmax())
    mask = torch.zeros(1, VOCAB, dtype=torch.bool)
    mask[0, (best + 1) % VOCAB] = True
    rows = [row(temperature=0.0, logprobs=2), row(temperature=0.0)]
    out = Sampler(seed=0)(raw, rows, ([0], mask))
    lp = out.logprobs[0]
    assert lp is not None and lp.token_id == (best + 1) % VOCAB
    assert lp.logprob == pytest.approx(float(expected[0, lp.token_id]), abs=1e-5)
    assert lp.top[0][0] == best  # the masked best token still heads the raw top-N
    assert torch.equal(raw, logits(2, seed=2))


def test_a_mixed_batch_whose_constrained_rows_match_the_vocabulary_size() -> None:
    raw = torch.zeros(3, 2)
    raw[:, 0] = 5.0
    mask = torch.tensor([[False, True], [False, True]])
    tokens = Sampler(seed=0)(raw, [row(temperature=0.0)] * 3, ([0, 2], mask)).token_ids
    assert tokens == [1, 0, 1]


def test_top_p_of_one_keeps_even_a_tail_that_rounds_away() -> None:
    """The tail's mass is below float32's resolution next to 1: the cumulative mass before it
    is exactly 1.0, and top_p == 1 must still keep it."""
    raw = torch.tensor([[0.0, -30.0, -30.0, -31.0]])
    for params in ([SamplingParams(top_k=3, top_p=1.0)], [SamplingParams(top_p=1.0, top_k=4)]):
        kept = _apply_top_k_top_p(raw, params)
        assert torch.isfinite(kept[0, :3]).all()


def test_score_tokens_ranks_from_one_and_ties_share_the_better_rank() -> None:
    raw = torch.tensor([[1.0, 3.0, 2.0, 3.0], [0.0, 0.0, 1.0, 0.0]])
    scored = score_tokens(raw, [2, 2], top_n=0)
    assert [s.rank for s in scored] == [3, 1]
    assert [s.top for s in scored] == [(), ()]
    assert [s.rank for s in score_tokens(raw, [3, 0], top_n=1, ranked=True)] == [1, 2]
    assert [s.rank for s in score_tokens(raw, [3, 0], top_n=1, ranked=False)] == [0, 0]


def test_a_seeded_sampler_repeats_its_draws() -> None:
    raw = logits(32, seed=3) / 6  # flat enough that two unseeded runs never agree
    rows = [row(temperature=1.0)] * 32
    first = [Sampler(seed=5)(raw, rows).token_ids for _ in range(2)]
    assert first[0] == first[1]
    runs = {tuple(Sampler(seed=s)(raw, rows).token_ids) for s in range(8)}
    assert len(runs) > 1


def test_misuse_names_the_shapes() -> None:
    with pytest.raises(AssertionError, match=r"^logits must be \[B, V\], got \(16,\)$"):
        Sampler(seed=0)(torch.zeros(VOCAB), [row()])
    with pytest.raises(AssertionError, match="^3 logit rows, 2 rows$"):
        Sampler(seed=0)(torch.zeros(3, VOCAB), [row(), row()])


def test_temperature_tempers_the_logits_before_top_p_truncates_them() -> None:
    """Tempered by 100, [3, 2, 1, 0] is nearly flat: top_p 0.5 keeps the best two tokens.
    Truncating the raw logits first would keep only the best (its mass is 0.64)."""
    raw = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).repeat(64, 1)
    rows = [row(temperature=100.0, top_p=0.5)] * 64
    assert set(Sampler(seed=0)(raw, rows).token_ids) == {0, 1}
