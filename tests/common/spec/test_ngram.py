"""Prompt lookup: the longest suffix n-gram, its latest earlier occurrence, and an incremental
index that always equals a from-scratch scan."""

from __future__ import annotations

import random

import pytest

from pdserve.common.spec.config import SpeculativeConfig
from pdserve.common.spec.ngram import NgramProposer


def ngram(low: int = 1, high: int = 4) -> NgramProposer:
    return NgramProposer(
        SpeculativeConfig("ngram", 3, prompt_lookup_min=low, prompt_lookup_max=high)
    )


def scan(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    """The definition, O(L^2): n from high down to low, the latest earlier occurrence, and a
    copy that continues into its own output when it runs past the end."""
    length = len(tokens)
    for n in range(min(high, length - 1), low - 1, -1):
        gram = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == gram:
                seq = list(tokens)
                for i in range(k):
                    seq.append(seq[start + n + i])
                return seq[length:]
    return []


def test_latest_occurrence_wins():
    # "1 2" occurs at 0 (then 7) and at 3 (then 8); the latest is drafted.
    assert ngram(2, 2).propose("r", [1, 2, 7, 1, 2, 8, 5, 1, 2], 1) == [8]


def test_longest_match_wins_over_a_later_shorter_one():
    # "4 1 2" matches at 0 (then 9); "1 2" alone matches later (then 8).
    tokens = [4, 1, 2, 9, 6, 1, 2, 8, 4, 1, 2]
    assert ngram(1, 3).propose("r", tokens, 1) == [9]
    assert ngram(1, 2).propose("r", tokens, 1) == [8]


def test_no_match_drafts_nothing():
    assert ngram().propose("r", [1, 2, 3, 4, 5], 3) == []
    assert ngram().propose("r", [7], 3) == []
    assert ngram().propose("r", [], 3) == []


def test_min_length_is_honoured():
    tokens = [1, 9, 5, 2, 9]  # only the 1-gram "9" recurs
    assert ngram(1, 3).propose("r", tokens, 2) == [5, 2]
    assert ngram(2, 3).propose("r", tokens, 2) == []


def test_k_bounds_the_draft_and_zero_drafts_nothing():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert ngram().propose("r", tokens, 3) == [3, 4, 5]
    assert ngram().propose("r", tokens, 1) == [3]
    assert ngram().propose("r", tokens, 0) == []


def test_a_repeating_run_drafts_past_the_end():
    # the latest "5 6" is one period back: the copy continues the cycle.
    assert ngram(2, 2).propose("r", [5, 6, 5, 6], 5) == [5, 6, 5, 6, 5]


def test_requests_are_independent_and_finish_frees_state():
    proposer = ngram()
    assert proposer.propose("a", [1, 2, 3, 1, 2], 1) == [3]
    assert proposer.propose("b", [1, 2, 4, 1, 2], 1) == [4]
    proposer.finish("a", [1, 2, 3, 1, 2])
    proposer.finish("a", [1, 2, 3, 1, 2])  # twice is harmless
    assert proposer.live_requests() == ["b"]


def test_a_sequence_that_does_not_extend_the_last_one_starts_over():
    proposer = ngram()
    assert proposer.propose("r", [1, 2, 3, 1, 2], 1) == [3]
    assert proposer.propose("r", [1, 2, 4, 1, 2], 1) == [4]  # same length, new content
    assert proposer.propose("r", [5, 5], 1) == [5]  # shorter


@pytest.mark.parametrize("seed", range(6))
def test_incremental_equals_from_scratch(seed):
    rng = random.Random(seed)
    low = rng.randint(1, 3)
    high = rng.randint(low, 5)
    proposer = ngram(low, high)
    # A small vocabulary with copied stretches, so matches of every length happen.
    tokens = [rng.randrange(6) for _ in range(5)]
    for _ in range(120):
        k = rng.randint(0, 6)
        assert proposer.propose("r", tokens, k) == scan(tokens, k, low, high)
        if rng.random() < 0.3 and len(tokens) > 8:
            at = rng.randrange(len(tokens) - 4)
            tokens.extend(tokens[at : at + rng.randint(1, 4)])
        else:
            tokens.extend(rng.randrange(6) for _ in range(rng.randint(1, 3)))
