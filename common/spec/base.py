"""The drafter interface, below its implementations so that `proposer.create_proposer` can
import them all without a cycle."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class Proposer(ABC):
    """Drafts tokens that may continue a request; the engine verifies them with the target
    model, so a wrong draft costs time, never correctness. One proposer serves every request of
    an engine, keyed by request id; calls for one request come from one thread."""

    @abstractmethod
    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that may follow `tokens` (the request's prompt and verified output so
        far); fewer or none when the drafter has no good guess. Between calls for one request,
        `tokens` only grows (a verify step appends its accepted tokens); a sequence that does
        not extend the last one is taken as a fresh start of the request."""

    @abstractmethod
    def finish(self, request_id: str, tokens: Sequence[int]) -> None:
        """The request ended (finished or aborted) with `tokens`: free its state. A drafter
        that learns across requests may keep what the request generated. Unknown ids are
        ignored, so finishing twice is harmless."""


def extends(length: int, last: int, tokens: Sequence[int]) -> bool:
    """Whether `tokens` may continue a sequence of `length` tokens that ended with `last`: the
    append-only contract of `propose`, checked in O(1) (a drafter that indexed the old sequence
    rebuilds when this fails)."""
    if len(tokens) < length:
        return False
    return length == 0 or tokens[length - 1] == last
