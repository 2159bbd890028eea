"""Suffix decoding: drafts from the request's own tokens and from earlier requests' outputs,
bounded by the cache, with per-request state freed on finish."""

from __future__ import annotations

import random

from pdserve.common.spec.config import SpeculativeConfig
from pdserve.common.spec.suffix import SuffixProposer, SuffixTrie

PROMPT_END = [90, 91, 92]  # stands in for a chat template's "assistant" header
ANSWER = list(range(200, 240))


def suffix(k: int = 8, cached: int = 10, **kw) -> SuffixProposer:
    return SuffixProposer(SpeculativeConfig("suffix", k, suffix_max_cached_requests=cached, **kw))


def serve(proposer: SuffixProposer, rid: str, prompt: list[int], answer: list[int]) -> int:
    """Generates `answer` token by token as an engine would (accepted drafts skip ahead);
    returns the number of verify steps it took."""
    tokens, steps = list(prompt), 0
    while len(tokens) < len(prompt) + len(answer):
        draft = proposer.propose(rid, tokens, 8)
        steps += 1
        truth = answer[len(tokens) - len(prompt) :]
        accepted = 0
        while accepted < min(len(draft), len(truth)) and draft[accepted] == truth[accepted]:
            accepted += 1
        tokens.extend(truth[: accepted + 1])
    proposer.finish(rid, tokens)
    return steps


def test_an_earlier_answer_repeated_by_a_later_request_drafts_long_runs():
    proposer = suffix(k=8)
    first = serve(proposer, "turn-1", [1, 2, 3, *PROMPT_END], ANSWER)
    assert first == len(ANSWER)  # nothing to draft from: one token per step
    # An agent loop's next turn: a different prompt, the same answer.
    again = serve(proposer, "turn-2", [4, 5, 6, 7, *PROMPT_END], ANSWER)
    assert again <= len(ANSWER) // 4
    assert proposer.cached_requests() == ["turn-1", "turn-2"]


def test_a_repeated_answer_drafts_the_full_k_once_matched():
    proposer = suffix(k=8)
    serve(proposer, "a", [1, *PROMPT_END], ANSWER)
    tokens = [7, *PROMPT_END, *ANSWER[:10]]
    assert proposer.propose("b", tokens, 8) == ANSWER[10:18]


def test_the_request_s_own_tokens_are_drafted_from():
    proposer = suffix(k=4)
    quote = [50, 51, 52, 53, 54, 55, 56]
    tokens = [1, *quote, 2, 3, *quote[:4]]
    assert proposer.propose("r", tokens, 4) == quote[4:] + [2]


def test_the_most_frequent_continuation_wins():
    proposer = suffix(k=1, suffix_min_token_prob=0.0)
    tokens = [5, 6, 1, 5, 6, 2, 5, 6, 1, 9, 5, 6]
    assert proposer.propose("r", tokens, 1) == [1]  # "5 6" -> 1 twice, 2 once


def test_a_weak_continuation_is_not_drafted():
    # after "5 6": 1, 2, 3, 4 once each; 0.25 < 0.3
    tokens = [5, 6, 1, 5, 6, 2, 5, 6, 3, 5, 6, 4, 8, 5, 6]
    assert suffix(k=2, suffix_min_token_prob=0.3).propose("r", tokens, 2) == []
    assert suffix(k=2, suffix_min_token_prob=0.2).propose("r", tokens, 2) != []


def test_nothing_known_drafts_nothing():
    proposer = suffix()
    assert proposer.propose("r", [1, 2, 3, 4], 8) == []
    assert proposer.propose("r", [1, 2, 3, 4], 0) == []
    assert proposer.propose("s", [], 8) == []


def test_oldest_cached_output_is_evicted():
    proposer = suffix(k=4, cached=2)
    answers = {rid: [100 * (i + 1) + j for j in range(12)] for i, rid in enumerate("abc")}
    for rid, answer in answers.items():
        serve(proposer, rid, [1, *PROMPT_END], answer)
    assert proposer.cached_requests() == ["b", "c"]
    probe = [9, *PROMPT_END]
    assert proposer.propose("p", [*probe, *answers["a"][:4]], 4) == []
    assert proposer.propose("q", [*probe, *answers["b"][:4]], 4) == answers["b"][4:8]


def test_eviction_gives_the_global_trie_back_exactly():
    proposer = suffix(cached=1)
    serve(proposer, "a", [1], [5, 6, 7, 5, 6, 8])
    empty_after = suffix(cached=1)
    serve(empty_after, "b", [1], [3, 4])
    serve(proposer, "b", [1], [3, 4])  # evicts "a"
    assert _shape(proposer._global.root) == _shape(empty_after._global.root)


def test_finish_frees_per_request_state_and_ignores_unknown_ids():
    proposer = suffix()
    proposer.propose("a", [1, 2, 1], 2)
    proposer.propose("b", [1, 2, 1], 2)
    proposer.finish("a", [1, 2, 1, 2])
    proposer.finish("a", [1, 2, 1, 2])
    proposer.finish("never-seen", [1, 2])
    assert proposer.live_requests() == ["b"]
    assert proposer.cached_requests() == ["a"]


def test_no_cache_keeps_no_outputs():
    proposer = suffix(cached=0)
    serve(proposer, "a", [1], ANSWER)
    assert proposer.cached_requests() == [] and proposer.live_requests() == []


def test_trie_counts_every_substring_up_to_its_depth():
    rng = random.Random(3)
    text = [rng.randrange(4) for _ in range(60)]
    trie = SuffixTrie(depth=5)
    trie.add(text)
    for n in range(1, 6):
        for start in range(0, len(text) - n + 1, 7):
            gram = text[start : start + n]
            expected = sum(text[i : i + n] == gram for i in range(len(text) - n + 1))
            assert trie.find(gram).count == expected
    assert trie.find(text[:6]) is None  # deeper than the trie


def _shape(node) -> dict:
    return {t: (c.count, _shape(c)) for t, c in (node.children or {}).items()}


def test_the_draft_stops_on_its_cumulative_probability():
    # after "5 6": 1 three times in four; after "5 6 1": 7 two times in three. The two-token
    # draft "1 7" is right with probability 3/4 * 2/3 = 1/2, under 0.6: only "1" is drafted.
    tokens = [5, 6, 1, 7, 20, 5, 6, 1, 7, 21, 5, 6, 1, 8, 22, 5, 6, 2, 23, 30, 5, 6]
    assert suffix(k=2, suffix_min_token_prob=0.6).propose("r", tokens, 2) == [1]
    assert suffix(k=2, suffix_min_token_prob=0.45).propose("r", tokens, 2) == [1, 7]
