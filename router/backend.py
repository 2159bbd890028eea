"""What the HTTP layer needs from the serving cluster: submit, stream tokens, abort.

The HTTP layer (router/app.py and the modules below it) is written against `Backend` only, so
it can be tested with an in-process fake and served over the ZMQ node registry without change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.common.wire.messages import Error, Tokens
from pdserve.common.wire.payloads import SamplingParams
from pdserve.router.cluster.timing import RequestTiming


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One sequence to generate. request_id is made by the router, never taken from clients."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    # Its stages on the way to the first token: the backend stamps, the HTTP layer reads.
    timing: RequestTiming = field(default_factory=RequestTiming, compare=False)


class Backend(ABC):
    """The serving cluster as the HTTP layer sees it.

    max_model_len bounds prompt plus generated tokens of every request.
    """

    max_model_len: int

    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[Tokens | Error]:
        """Submits request and yields its events as they arrive: the nodes' own Tokens
        messages (cached_tokens and prompt_logprobs on the first), as decoded off the wire.

        An async generator: it ends right after a Tokens that carries a finish_reason, or an
        Error. A failure is reported as an Error event, not as an exception, so the client
        still gets an answer. A caller that stops listening early calls abort()
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

    def failovers(self) -> dict[str, int]:
        """Requests failed over since the start, by cause (`Failover.cause`)."""
        return {}

    def stats(self) -> dict[str, float]:
        """Gauges exported on /metrics as pdserve_backend_<name>, read at scrape time."""
        return {}
