"""Limits and admission: how much generation work the router lets in at once."""

from __future__ import annotations

from pdserve.router.config import RouterLimits
from pdserve.router.errors import RETRY_AFTER_S, APIError

__all__ = ["Admission", "RouterLimits", "Ticket"]


class Admission:
    """Counts the generation work in flight and refuses what would pass RouterLimits."""

    def __init__(self, limits: RouterLimits) -> None:
        self._limits = limits
        self.requests = 0  # backend requests admitted and not finished
        self.tokens = 0  # their prompt tokens

    def check_room(self) -> None:
        """APIError 503 if the router is full already, before a request is even read: under
        overload, refusing must cost less than parsing and tokenizing."""
        self._check(1, 1)

    def admit(self, requests: int, tokens: int) -> Ticket:
        """A ticket for requests backend requests of tokens prompt tokens; APIError 503 if
        they do not fit now."""
        self._check(requests, tokens)
        self.requests += requests
        self.tokens += tokens
        return Ticket(self, requests, tokens)

    def _check(self, requests: int, tokens: int) -> None:
        limits = self._limits
        if self.requests and self.requests + requests > limits.max_queued_requests:
            raise APIError(
                503,
                f"the server is overloaded: {self.requests} requests are in flight and this "
                f"one adds {requests}; the limit is {limits.max_queued_requests} "
                f"(--max-queued-requests). Retry after {RETRY_AFTER_S} s.",
            )
        if self.requests and self.tokens + tokens > limits.max_queued_tokens:
            raise APIError(
                503,
                f"the server is overloaded: {self.tokens} prompt tokens are in flight and "
                f"this request adds {tokens}; the limit is {limits.max_queued_tokens} "
                f"(--max-queued-tokens). Retry after {RETRY_AFTER_S} s.",
            )

    def _release(self, requests: int, tokens: int) -> None:
        self.requests -= requests
        self.tokens -= tokens
        assert self.requests >= 0 and self.tokens >= 0, "admission released more than admitted"


class Ticket:
    """One admitted request's share of Admission; release() is idempotent."""

    def __init__(self, admission: Admission, requests: int, tokens: int) -> None:
        self._admission = admission
        self._share: tuple[int, int] | None = (requests, tokens)

    def release(self) -> None:
        if self._share is not None:
            self._admission._release(*self._share)
            self._share = None
