"""What the HTTP layer needs from the serving cluster: submit, stream tokens, abort.

The HTTP layer (router/app.py and the modules below it) is written against `Backend` only, so
it can be tested with an in-process fake and served over the ZMQ node registry without change.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pdserve.common.engine.request import TokenLogprobs
from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.wire.messages import Failure


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One sequence to generate. request_id is made by the router, never taken from clients."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One or more new tokens of one request.

    logprobs holds one entry per token when the request asked for logprobs, else nothing.
    The last event of a request carries finish_reason ("stop", "length", "abort" or "error");
    with "error", error says what went wrong. cached_tokens (prompt tokens served from the
    prefix cache) is meaningful on the first event only.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: str | None = None
    cached_tokens: int = 0
    error: str | None = None
    failure: Failure | None = None  # with finish_reason "error": what kind of failure
    # Of prompt tokens 1, 2, ... (with ranks), on the first event, when the request asked.
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()

    @classmethod
    def failed(cls, failure: Failure, error: str) -> TokenEvent:
        """The last event of a request that failed."""
        return cls((), finish_reason="error", error=error, failure=failure)


class Backend(ABC):
    """The serving cluster as the HTTP layer sees it.

    max_model_len bounds prompt plus generated tokens of every request.
    """

    max_model_len: int

    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Submits request and yields its token events as they arrive.

        An async generator: it ends right after the event that carries a finish_reason. A
        failure is reported as an event with finish_reason "error", not as an exception, so
        the client still gets an answer. A caller that stops listening early calls abort()
        and closes the generator; the generator may free the request on close as well, since
        abort is idempotent.
        """

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stops request_id and frees its resources; idempotent, unknown ids are ignored."""

    @abstractmethod
    def ready(self) -> bool:
        """Whether requests can be served now (at least one usable route), for /health."""

    def unready_reason(self) -> str:
        """Why no request can be served now (for the 503 a client gets)."""
        return "no prefill/decode route is available"

    def stats(self) -> dict[str, float]:
        """Gauges exported on /metrics as pdserve_backend_<name>, read at scrape time."""
        return {}


async def get_within(queue: asyncio.Queue, timeout: float) -> Any:
    """`queue.get()` bounded by `timeout` (asyncio.TimeoutError past it). An item already
    waiting is taken at once: no timer and no task per item, which a streamed token would
    otherwise cost twice on its way through the router."""
    try:
        return queue.get_nowait()
    except asyncio.QueueEmpty:
        return await asyncio.wait_for(queue.get(), timeout)
