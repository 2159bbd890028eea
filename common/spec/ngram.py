"""Prompt lookup (`ngram`): draft what followed the latest earlier occurrence of the request's
longest suffix n-gram. Each request keeps a map from every n-gram to where it last ended, grown
by the tokens appended since the last call, so a step costs O(new tokens * n range), not a scan
of the whole context."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.common.spec.base import Proposer, extends
from pdserve.common.spec.config import SpeculativeConfig


def copy_forward(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """k tokens copied from `start` on, where a copy that runs past the end continues with the
    tokens it has just drafted (LZ77's overlapping copy): a match one period back in a repeating
    run drafts the run's next k tokens instead of stopping at the end."""
    out: list[int] = []
    n = len(tokens)
    for i in range(k):
        at = start + i
        out.append(tokens[at] if at < n else out[at - n])
    return out


@dataclass(slots=True)
class _Index:
    """One request's n-grams: gram -> the position right after its latest occurrence, for
    occurrences whose next token exists (end <= indexed - 1)."""

    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    length: int = 0  # tokens seen; grams ending at 1..length-1 are indexed
    last: int = -1  # tokens[length - 1], a cheap check that the next call extends this one


class NgramProposer(Proposer):
    """vLLM's `ngram` method: n from prompt_lookup_max down to prompt_lookup_min."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self._low = config.prompt_lookup_min
        self._high = config.prompt_lookup_max
        self._indexes: dict[str, _Index] = {}

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        index = self._grow(request_id, tokens)
        n_tokens = len(tokens)
        for n in range(min(self._high, n_tokens - 1), self._low - 1, -1):
            end = index.ends.get(tuple(tokens[n_tokens - n :]))
            if end is not None:
                return copy_forward(tokens, end, k)
        return []

    def finish(self, request_id: str, tokens: Sequence[int]) -> None:
        self._indexes.pop(request_id, None)

    def live_requests(self) -> list[str]:
        """Ids with an index (finish frees it)."""
        return list(self._indexes)

    def _grow(self, request_id: str, tokens: Sequence[int]) -> _Index:
        index = self._indexes.get(request_id)
        if index is None or not extends(index.length, index.last, tokens):
            index = self._indexes[request_id] = _Index()
        ends = index.ends
        # A gram ending at `end` is indexed once its next token, tokens[end], exists.
        for end in range(max(index.length, 1), len(tokens)):
            for n in range(self._low, min(self._high, end) + 1):
                ends[tuple(tokens[end - n : end])] = end
        index.length = len(tokens)
        index.last = tokens[-1] if tokens else -1
        return index
