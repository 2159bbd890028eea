"""The router's OpenAI-compatible HTTP API, served over any `Backend`.

A request is validated, tokenized (off the event loop), length-checked and split into choices
(n per prompt), each one backend request. `_Generation` runs the choices concurrently and turns
their token events into text deltas (incremental detokenization, stop strings); a dialect
(completions or chat) shapes the deltas into SSE chunks or one JSON response. Whatever ends a
request early (client gone, error, cancellation) aborts its unfinished backend requests.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.detokenizer import IncrementalDetokenizer
from common.request import TokenLogprobs
from router.backend import Backend, GenerateRequest, TokenEvent
from router.openai_protocol import (
    BaseGenerationRequest,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/metrics",
    "/tokenize",
    "/detokenize",
)
# How often a request waiting for tokens checks whether its client is still there; a token
# that arrives meanwhile is handled at once, so this bounds only how long an abandoned request
# keeps running on the nodes.
DISCONNECT_POLL_S = 0.5
# Bound on aborting and on tearing down a request, so a stuck backend cannot hang the router.
CLEANUP_TIMEOUT_S = 5.0
# JSON has no -inf; vLLM reports impossible tokens with this floor too.
_MIN_LOGPROB = -9999.0
_CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

_M = TypeVar("_M", bound=BaseModel)


# ---------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered with vLLM's envelope and the given HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> ErrorResponse:
        kind = _ERROR_TYPES.get(self.status, "Error")
        info = ErrorInfo(message=self.message, type=kind, param=self.param, code=self.status)
        return ErrorResponse(error=info)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body().model_dump(), self.status, headers=headers)


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """A readable message and the first offending parameter, from pydantic's errors."""
    parts, params = [], []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"])
        # The top-level field: deeper parts name union members ("prompt.list[str]").
        params.append(str(err["loc"][0]) if err["loc"] else None)
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts), params[0] if params else None


async def _parse(request: Request, model: type[_M]) -> _M:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        message, param = _validation_message(exc)
        raise APIError(400, message, param) from None


def _install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return APIError(exc.status_code, str(exc.detail)).response()

    async def validation_error(_: Request, exc: Exception) -> Response:
        return APIError(400, str(exc)).response()

    async def unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)
        return APIError(500, f"internal error: {type(exc).__name__}").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)


# ---------------------------------------------------------------- metrics


class RouterMetrics:
    """Prometheus metrics of one app, in the app's own registry (tests build many apps)."""

    def __init__(self, backend: Backend) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            "pdserve_router_requests", "HTTP requests", ["route", "status"], registry=reg
        )
        self.prompt_tokens = Counter(
            "pdserve_router_prompt_tokens", "Prompt tokens submitted", registry=reg
        )
        self.generation_tokens = Counter(
            "pdserve_router_generation_tokens", "Tokens generated", registry=reg
        )
        self.ttft = Histogram(
            "pdserve_router_time_to_first_token_seconds",
            "Request arrival to first generated token",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=reg,
        )
        self.e2e = Histogram(
            "pdserve_router_e2e_request_latency_seconds",
            "Request arrival to last token",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=reg,
        )
        self.in_flight = Gauge(
            "pdserve_router_requests_in_flight", "Generation requests being served", registry=reg
        )
        reg.register(_BackendStatsCollector(backend))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _BackendStatsCollector:
    """Exports Backend.stats() as gauges, read at scrape time."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def describe(self) -> list[Metric]:
        # Names are only known at scrape time; an empty description keeps the registry from
        # calling collect() (and so the backend) when the collector is registered.
        return []

    def collect(self) -> list[Metric]:
        try:
            stats = self._backend.stats()
        except Exception:  # a broken gauge must not take the other metrics down with it
            logger.exception("backend.stats() failed")
            return []
        metrics: list[Metric] = []
        for key, value in sorted(stats.items()):
            name = "pdserve_backend_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            metrics.append(GaugeMetricFamily(name, f"backend gauge {key}", value=float(value)))
        return metrics


class _RequestCounter:
    """ASGI middleware counting requests by route and status; pure ASGI, unlike Starlette's
    BaseHTTPMiddleware, so it neither buffers streams nor hides client disconnects."""

    def __init__(self, app: ASGIApp, metrics: RouterMetrics) -> None:
        self._app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        status = 500  # what the client gets if the app raises before starting a response

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._app(scope, receive, send_status)
        finally:
            # Unknown paths share one label, so scanners cannot blow up the label space.
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self._metrics.requests.labels(route=route, status=str(status)).inc()


# ---------------------------------------------------------------- stop strings and choices


class StopStringMatcher:
    """Cuts streamed text at the first stop string, holding back a tail that may begin one.

    Text already returned never ends with a proper prefix of a stop string, so a stop string
    can only start in the held-back tail or in new text: searching pending + new is enough.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._pending = ""

    def push(self, text: str, search: bool = True) -> tuple[str, bool]:
        """Returns the text safe to emit and whether a stop string ended it (text cut before)."""
        buf = self._pending + text
        self._pending = ""
        if not self._stops or not search:
            return buf, False
        cut = self._first_stop(buf)
        if cut is not None:
            return buf[:cut], True
        keep = self._partial_stop_len(buf)
        self._pending = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back tail, once no more text will come."""
        out, self._pending = self._pending, ""
        return out

    def _first_stop(self, buf: str) -> int | None:
        """Where the stop string that ends first begins (the longer one on a tie): the one a
        generator would have hit first, whatever the chunking of the text."""
        found = [(i + len(s), i) for s in self._stops if (i := buf.find(s)) >= 0]
        return min(found)[1] if found else None

    def _partial_stop_len(self, buf: str) -> int:
        longest = max(len(s) for s in self._stops) - 1
        for size in range(min(longest, len(buf)), 0, -1):
            tail = buf[-size:]
            if any(s.startswith(tail) for s in self._stops):
                return size
        return 0


@dataclass(frozen=True, slots=True)
class ChoiceDelta:
    """What one backend event means for one choice: new text, logprobs, maybe its end."""

    index: int
    text: str = ""
    logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: str | None = None
    error: str | None = None
    token_ids: tuple[int, ...] = ()


class _Choice:
    """One choice of a response: its backend request, detokenizer and stop-string matcher."""

    def __init__(
        self,
        index: int,
        prompt_index: int,
        request: GenerateRequest,
        detokenizer: IncrementalDetokenizer,
        stops: StopStringMatcher,
    ) -> None:
        self.index = index
        self.prompt_index = prompt_index
        self.request = request
        self._detok = detokenizer
        self._stops = stops
        self.num_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.backend_done = False  # the backend ended this request; no abort needed
        self._seen_event = False

    def on_event(self, event: TokenEvent) -> ChoiceDelta:
        if not self._seen_event:  # the backend reports cached_tokens on the first event
            self._seen_event = True
            self.cached_tokens = event.cached_tokens
        self.num_tokens += len(event.token_ids)
        self.backend_done = event.finish_reason is not None
        # Like vLLM, stop strings only count once min_tokens have been generated.
        search = self.num_tokens >= self.request.sampling.min_tokens
        text, hit = self._stops.push(self._detok.push(list(event.token_ids)), search)
        finish = "stop" if hit else event.finish_reason
        if not hit and finish is not None:
            tail, hit = self._stops.push(self._detok.flush(), search)
            text += tail if hit else tail + self._stops.flush()
            finish = "stop" if hit else finish
        self.finish_reason = finish
        return ChoiceDelta(self.index, text, event.logprobs, finish, event.error, event.token_ids)

    def fail(self, message: str) -> ChoiceDelta:
        self.finish_reason = "error"
        return ChoiceDelta(self.index, finish_reason="error", error=message)


async def _aclose(events: AsyncIterator[TokenEvent]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()


class _Generation:
    """Runs the choices of one HTTP request concurrently; yields their deltas as they come.

    Use as `async with gen: async for delta in gen: ...`. Iteration ends when every choice has
    finished, after the first error delta (yielded), or when the client has gone
    (`disconnected`). Leaving the block aborts every backend request that has not ended,
    whatever the reason: disconnect, error, an exception or cancellation of the caller.
    """

    def __init__(
        self,
        backend: Backend,
        choices: list[_Choice],
        http_request: Request,
        metrics: RouterMetrics,
        started: float,
    ) -> None:
        self._backend = backend
        self.choices = choices
        self._http = http_request
        self._metrics = metrics
        self._started = started
        self._queue: asyncio.Queue[ChoiceDelta] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._remaining = len(choices)
        self._first_token_seen = False
        self.failed = False
        self.disconnected = False

    async def __aenter__(self) -> _Generation:
        self._metrics.in_flight.inc()
        self._tasks = [asyncio.create_task(self._pump(c)) for c in self.choices]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # Shielded: this also runs when the caller is being cancelled (client disconnect), and
        # the aborts must still reach the backend.
        with anyio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._abort_unfinished()
        self._metrics.in_flight.dec()
        if self._remaining == 0 and not self.failed:
            self._metrics.e2e.observe(time.monotonic() - self._started)

    def __aiter__(self) -> _Generation:
        return self

    async def __anext__(self) -> ChoiceDelta:
        if self._remaining == 0 or self.failed or self.disconnected:
            raise StopAsyncIteration
        delta = await self._next_delta()
        if delta is None:
            self.disconnected = True
            raise StopAsyncIteration
        if delta.finish_reason is not None:
            self._remaining -= 1
            self.failed = delta.finish_reason == "error"
        return delta

    async def _next_delta(self) -> ChoiceDelta | None:
        """The next delta, or None once the client has disconnected."""
        while True:
            try:
                return await asyncio.wait_for(self._queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await self._http.is_disconnected():
                    return None

    async def _pump(self, choice: _Choice) -> None:
        try:
            await self._consume(choice)
        except Exception as exc:  # any backend failure must reach the client as an error
            logger.exception("request %s failed", choice.request.request_id)
            if choice.finish_reason is None:  # one finishing delta per choice, never two
                self._queue.put_nowait(choice.fail(f"backend error: {exc}"))

    async def _consume(self, choice: _Choice) -> None:
        events = self._backend.generate(choice.request)
        try:
            async for event in events:
                self._on_tokens(len(event.token_ids))
                delta = choice.on_event(event)
                if delta.finish_reason is not None and not choice.backend_done:
                    await self._abort(choice)  # a stop string ended it before the backend did
                self._queue.put_nowait(delta)
                if delta.finish_reason is not None:
                    return
            self._queue.put_nowait(choice.fail("backend stream ended without a finish reason"))
        finally:
            await _aclose(events)

    def _on_tokens(self, count: int) -> None:
        self._metrics.generation_tokens.inc(count)
        if count and not self._first_token_seen:
            self._first_token_seen = True
            self._metrics.ttft.observe(time.monotonic() - self._started)

    async def _abort(self, choice: _Choice) -> None:
        rid = choice.request.request_id
        try:
            with anyio.fail_after(CLEANUP_TIMEOUT_S):
                await self._backend.abort(rid)
            choice.backend_done = True
        except Exception:  # the lease on the nodes frees the blocks eventually anyway
            logger.exception("abort of %s failed", rid)

    async def _abort_unfinished(self) -> None:
        unfinished = [c for c in self.choices if not c.backend_done]
        await asyncio.gather(*(self._abort(c) for c in unfinished))


# ---------------------------------------------------------------- response shapes


class _TokenStrings:
    """Text and UTF-8 bytes of single tokens, as logprobs report them; cached per id."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            self._cache[token_id] = self._compute(token_id)
        return self._cache[token_id]

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, list(text.encode())
        # Part of a multi-byte character: its real bytes are in the raw token string, in
        # byte-level BPE's printable alphabet or as SentencePiece's <0xNN> byte fallback.
        raw = self._tokenizer.convert_ids_to_tokens(token_id)
        byte_fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", raw)
        if byte_fallback:
            return text, [int(byte_fallback.group(1), 16)]
        if all(ch in _BYTE_LEVEL_DECODER for ch in raw):
            return text, [_BYTE_LEVEL_DECODER[ch] for ch in raw]
        return text, list(text.encode())


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-printable-character table, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, shift = dict.fromkeys(printable, 0), 0
    table = {}
    for byte in range(256):
        if byte in chars:
            table[chr(byte)] = byte
        else:
            table[chr(256 + shift)] = byte
            shift += 1
    return table


_BYTE_LEVEL_DECODER = _byte_level_decoder()


def _logprob(value: float) -> float:
    return max(value, _MIN_LOGPROB)


@dataclass(slots=True)
class _Collected:
    """A whole choice, gathered for a non-streaming response."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)

    def add(self, delta: ChoiceDelta) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.finish_reason = delta.finish_reason or self.finish_reason


class _Dialect(ABC):
    """Shapes deltas into one API's stream chunks and final response."""

    prefix: str

    def __init__(self, model: str, tokens: _TokenStrings, want_logprobs: bool) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self._tokens = tokens
        self._want_logprobs = want_logprobs

    def opening(self, num_choices: int) -> list[BaseModel]:
        """Chunks sent before any token."""
        return []

    @abstractmethod
    def chunk(self, delta: ChoiceDelta) -> BaseModel: ...

    @abstractmethod
    def usage_chunk(self, usage: UsageInfo) -> BaseModel: ...

    @abstractmethod
    def response(self, choices: list[_Collected], usage: UsageInfo) -> BaseModel: ...


class _CompletionDialect(_Dialect):
    prefix = "cmpl"

    def __init__(
        self, model: str, tokens: _TokenStrings, want_logprobs: bool, want_ids: bool = False
    ) -> None:
        super().__init__(model, tokens, want_logprobs)
        self._want_ids = want_ids
        self._offsets: dict[int, int] = {}  # text_offset reached by each streamed choice

    def chunk(self, delta: ChoiceDelta) -> BaseModel:
        logprobs = self._logprobs(delta.index, delta.logprobs)
        choice = CompletionChoice(
            index=delta.index, text=delta.text, logprobs=logprobs, finish_reason=delta.finish_reason
        )
        return self._wrap([choice])

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return self._wrap([], usage)

    def response(self, choices: list[_Collected], usage: UsageInfo) -> BaseModel:
        out = [
            CompletionChoice(
                index=c.index,
                text="".join(c.text),
                logprobs=self._logprobs(c.index, c.logprobs),
                finish_reason=c.finish_reason,
                token_ids=c.token_ids if self._want_ids else None,
            )
            for c in choices
        ]
        return self._wrap(out, usage)

    def _wrap(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> BaseModel:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _logprobs(
        self, index: int, lps: list[TokenLogprobs] | tuple[TokenLogprobs, ...]
    ) -> CompletionLogprobs | None:
        if not self._want_logprobs:
            return None
        offset = self._offsets.get(index, 0)
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for lp in lps:
            text = self._tokens.text(lp.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(_logprob(lp.logprob))
            out.top_logprobs.append({self._tokens.text(t): _logprob(v) for t, v in lp.top})
            out.text_offset.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return out


class _ChatDialect(_Dialect):
    prefix = "chatcmpl"

    def opening(self, num_choices: int) -> list[BaseModel]:
        # OpenAI's first delta of each choice names the role, before any content.
        role = DeltaMessage(role="assistant", content="")
        return [self._wrap([ChatStreamChoice(index=i, delta=role)]) for i in range(num_choices)]

    def chunk(self, delta: ChoiceDelta) -> BaseModel:
        choice = ChatStreamChoice(
            index=delta.index,
            delta=DeltaMessage(content=delta.text or None),
            logprobs=self._logprobs(delta.logprobs),
            finish_reason=delta.finish_reason,
        )
        return self._wrap([choice])

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return self._wrap([], usage)

    def response(self, choices: list[_Collected], usage: UsageInfo) -> BaseModel:
        out = [
            ChatChoice(
                index=c.index,
                message=ChatResponseMessage(content="".join(c.text)),
                logprobs=self._logprobs(c.logprobs),
                finish_reason=c.finish_reason,
            )
            for c in choices
        ]
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=out, usage=usage
        )

    def _wrap(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> BaseModel:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _logprobs(
        self, lps: list[TokenLogprobs] | tuple[TokenLogprobs, ...]
    ) -> ChatLogprobs | None:
        if not self._want_logprobs:
            return None
        return ChatLogprobs(content=[self._token_logprob(lp) for lp in lps])

    def _token_logprob(self, lp: TokenLogprobs) -> ChatTokenLogprob:
        text, raw = self._tokens.get(lp.token_id)
        top = [self._top(t, v) for t, v in lp.top]
        return ChatTokenLogprob(
            token=text, logprob=_logprob(lp.logprob), bytes=raw, top_logprobs=top
        )

    def _top(self, token_id: int, logprob: float) -> ChatTopLogprob:
        text, raw = self._tokens.get(token_id)
        return ChatTopLogprob(token=text, logprob=_logprob(logprob), bytes=raw)


def _usage(prompts: list[list[int]], choices: list[_Choice]) -> UsageInfo:
    """Each prompt counts once however many choices it has, as OpenAI counts it."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(c.num_tokens for c in choices)
    cached = sum(
        max(c.cached_tokens for c in choices if c.prompt_index == i) for i in range(len(prompts))
    )
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _sse(payload: BaseModel, exclude: set[str] | None = None) -> str:
    return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its iterator, so the iterator's cleanup (the
    backend aborts) runs at once even when a send fails or is cancelled mid-chunk."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:
            pass  # an ASGI 2.4 server's way to say the client left; already cleaned up

    async def stream_response(self, send: Send) -> None:
        iterator = self.body_iterator
        try:
            await super().stream_response(send)
        finally:
            close = getattr(iterator, "aclose", None)
            if close is not None:
                await close()


# ---------------------------------------------------------------- the server


def _too_long(limit: int, prompt_len: int, max_tokens: int, param: str) -> APIError:
    return APIError(
        400,
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
        "completion). Please reduce the length of the prompt or max_tokens.",
        param,
    )


def _wrap_int64(value: int) -> int:
    # seed + i of the last choices may pass int64's top; wrap like the int64 it becomes.
    return (value + 2**63) % 2**64 - 2**63


class _Tokenization:
    """Runs the tokenizer on one worker thread: long prompts would otherwise stall every
    stream on the event loop, and one thread keeps the tokenizer free of concurrent use."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self.vocab_size = len(tokenizer)

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(fn, *args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        encode = self._tokenizer.encode
        return list(await self.run(encode, text, add_special_tokens=add_special_tokens))

    async def chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        try:
            ids = await self.run(
                self._tokenizer.apply_chat_template,
                messages,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
            )
        except Exception as exc:  # template errors (roles, no template) are the client's to fix
            raise APIError(400, f"cannot apply the chat template: {exc}", "messages") from None
        # transformers 5 returns a BatchEncoding, earlier versions a list.
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    def check_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(400, "the prompt has no tokens", param)
        if max(ids) >= self.vocab_size:
            raise APIError(400, f"token id {max(ids)} is outside the vocabulary", param)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class _Server:
    """Route handlers of one app, over one backend and tokenizer."""

    def __init__(self, backend: Backend, tokenizer: PreTrainedTokenizerBase, model: str) -> None:
        self._backend = backend
        self._tokenizer = tokenizer
        self._model = model
        self.tokenization = _Tokenization(tokenizer)
        self._tokens = _TokenStrings(tokenizer)
        self.metrics = RouterMetrics(backend)

    async def completions(self, request: Request) -> Response:
        started = time.monotonic()
        body = await _parse(request, CompletionRequest)
        self._check_model(body.model)
        prompts = await self._completion_prompts(body.prompt)
        dialect = _CompletionDialect(
            self._model, self._tokens, body.logprobs is not None, body.return_token_ids
        )
        return await self._generate(request, body, prompts, dialect, started)

    async def chat_completions(self, request: Request) -> Response:
        started = time.monotonic()
        body = await _parse(request, ChatCompletionRequest)
        self._check_model(body.model)
        messages = [m.template_dict() for m in body.messages]
        prompt = await self.tokenization.chat(messages, add_generation_prompt=True)
        dialect = _ChatDialect(self._model, self._tokens, body.logprobs_count() is not None)
        return await self._generate(request, body, [prompt], dialect, started)

    async def models(self) -> ModelList:
        card = ModelCard(id=self._model, max_model_len=self._backend.max_model_len)
        return ModelList(data=[card])

    async def health(self) -> Response:
        if not self._backend.ready():
            return APIError(503, "no prefill/decode route is available").response()
        return JSONResponse({"status": "ok"})

    async def prometheus(self) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> TokenizeResponse:
        body = await _parse(request, TokenizeRequest)
        self._check_model(body.model)
        if body.messages is not None:
            messages = [m.template_dict() for m in body.messages]
            ids = await self.tokenization.chat(messages, body.add_generation_prompt)
        else:
            ids = await self.tokenization.encode(body.prompt or "", body.add_special_tokens)
        return TokenizeResponse(
            count=len(ids), max_model_len=self._backend.max_model_len, tokens=ids
        )

    async def detokenize(self, request: Request) -> DetokenizeResponse:
        body = await _parse(request, DetokenizeRequest)
        self._check_model(body.model)
        if body.tokens and max(body.tokens) >= self.tokenization.vocab_size:
            raise APIError(400, f"token id {max(body.tokens)} is outside the vocabulary", "tokens")
        text = await self.tokenization.run(self._tokenizer.decode, body.tokens)
        return DetokenizeResponse(prompt=text)

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self._model:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    async def _completion_prompts(self, prompt: str | list[Any]) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [await self.tokenization.encode(prompt)]
        elif isinstance(prompt[0], int):
            prompts = [list(prompt)]
        elif isinstance(prompt[0], str):
            prompts = [await self.tokenization.encode(p) for p in prompt]
        else:
            prompts = [list(p) for p in prompt]
        for ids in prompts:
            self.tokenization.check_ids(ids, "prompt")
        return prompts

    def _max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """requested, or the room left when omitted; 400 if it does not fit the context."""
        limit = self._backend.max_model_len
        if requested is None:
            if prompt_len >= limit:
                raise _too_long(limit, prompt_len, 1, "prompt")
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise _too_long(limit, prompt_len, requested, "max_tokens")
        return requested

    def _make_choices(
        self, rid: str, prompts: list[list[int]], body: BaseGenerationRequest
    ) -> list[_Choice]:
        stops = body.stop_strings()
        single = len(prompts) * body.n == 1
        choices = []
        for p, ids in enumerate(prompts):
            max_tokens = self._max_tokens(len(ids), body.requested_max_tokens())
            for i in range(body.n):
                index = p * body.n + i
                seed = None if body.seed is None else _wrap_int64(body.seed + i)
                try:
                    sampling = body.sampling_params(max_tokens, seed)
                except ValueError as exc:
                    # SamplingParams' messages start with the offending field's name.
                    raise APIError(400, str(exc), str(exc).split()[0]) from None
                request = GenerateRequest(rid if single else f"{rid}-{index}", tuple(ids), sampling)
                detok = IncrementalDetokenizer(self._tokenizer, ids, body.skip_special_tokens)
                choices.append(_Choice(index, p, request, detok, StopStringMatcher(stops)))
        return choices

    async def _generate(
        self,
        request: Request,
        body: BaseGenerationRequest,
        prompts: list[list[int]],
        dialect: _Dialect,
        started: float,
    ) -> Response:
        choices = self._make_choices(dialect.id, prompts, body)
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        gen = _Generation(self._backend, choices, request, self.metrics, started)
        if body.stream:
            events = _stream(gen, dialect, prompts, body.include_usage)
            return _SSEResponse(events, media_type="text/event-stream")
        collected = await _collect(gen)
        if collected is None:
            return Response(status_code=_CLIENT_CLOSED_REQUEST)
        answer = dialect.response(collected, _usage(prompts, choices))
        # pydantic's JSON writes non-finite floats as null; json.dumps would refuse them.
        return Response(answer.model_dump_json(), media_type="application/json")


async def _collect(gen: _Generation) -> list[_Collected] | None:
    """Every choice in full; None if the client left; APIError 500 if a choice failed."""
    collected = [_Collected(c.index) for c in gen.choices]
    async with gen:
        async for delta in gen:
            if delta.finish_reason == "error":
                raise APIError(500, delta.error or "generation failed")
            collected[delta.index].add(delta)
    return None if gen.disconnected else collected


async def _stream(
    gen: _Generation, dialect: _Dialect, prompts: list[list[int]], include_usage: bool
) -> AsyncIterator[str]:
    """SSE lines: opening chunks, a chunk per delta, usage if asked, then [DONE].

    A failed choice ends the stream with its finish_reason "error" chunk, an error line in
    the error envelope, and [DONE]. A gone client gets nothing more.
    """
    exclude = None if include_usage else {"usage"}
    async with gen:
        for chunk in dialect.opening(len(gen.choices)):
            yield _sse(chunk, exclude)
        async for delta in gen:
            if delta.text or delta.logprobs or delta.finish_reason:
                yield _sse(dialect.chunk(delta), exclude)
            if delta.finish_reason == "error":
                yield _sse(APIError(500, delta.error or "generation failed").body())
    if gen.disconnected:
        return
    if include_usage and not gen.failed:
        yield _sse(dialect.usage_chunk(_usage(prompts, gen.choices)))
    yield _SSE_DONE


# ---------------------------------------------------------------- app


def _auth(api_key: str | None) -> Callable[[Request], Any]:
    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken must not tell how much of a guessed key was right.
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)")

    return check


def create_app(
    backend: Backend,
    tokenizer: PreTrainedTokenizerBase,
    model_name: str,
    api_key: str | None = None,
) -> FastAPI:
    """The router's FastAPI app: OpenAI-compatible routes plus /health, /metrics, /tokenize,
    /detokenize. With api_key every route but /health wants `Authorization: Bearer <key>`."""
    server = _Server(backend, tokenizer, model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        server.tokenization.close()

    # No /docs or /openapi.json: they would bypass the API key, and the handlers parse their
    # bodies themselves (for 400s in the error envelope), so the schema would be empty anyway.
    app = FastAPI(
        title="pdserve router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    _install_error_handlers(app)
    app.add_middleware(_RequestCounter, metrics=server.metrics)
    guarded = [Depends(_auth(api_key))]
    app.post("/v1/completions", dependencies=guarded)(server.completions)
    app.post("/v1/chat/completions", dependencies=guarded)(server.chat_completions)
    app.get("/v1/models", dependencies=guarded)(server.models)
    app.get("/health")(server.health)
    app.get("/metrics", dependencies=guarded)(server.prometheus)
    app.post("/tokenize", dependencies=guarded)(server.tokenize)
    app.post("/detokenize", dependencies=guarded)(server.detokenize)
    app.state.guarded = guarded  # for routes the launcher adds (same API-key rule)
    return app
