"""The router's OpenAI-compatible HTTP API, served over any `Backend`.

Pure-ASGI middlewares count every request, check the API key and bound the body size before
any handler runs. A request is then validated, tokenized (off the event loop), length-checked
and split into choices (n per prompt), each one backend request; `Admission` refuses it with
503 when the work in flight would pass `RouterLimits`. `_Generation` runs the choices
concurrently and turns their token events into text deltas (incremental detokenization, stop
strings); a dialect (completions or chat) shapes the deltas into SSE chunks or one JSON
response. Whatever ends a request early (client gone, error, cancellation) aborts its
unfinished backend requests and releases its admission. Every error, whatever its cause, is
answered in vLLM's envelope {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
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

from pdserve.common.engine.request import TokenLogprobs
from pdserve.common.wire.messages import Failure
from pdserve.router.backend import Backend, GenerateRequest, TokenEvent
from pdserve.router.detokenizer import IncrementalDetokenizer
from pdserve.router.openai_protocol import (
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
    "/openapi.json",
)
OPEN_ROUTES = ("/health",)  # every other path, unknown ones included, wants the API key
# How often a request waiting for tokens checks whether its client is still there; a token
# that arrives meanwhile is handled at once, so this bounds only how long an abandoned request
# keeps running on the nodes.
DISCONNECT_POLL_S = 0.5
# Bound on aborting and on tearing down a request, so a stuck backend cannot hang the router.
CLEANUP_TIMEOUT_S = 5.0
RETRY_AFTER_S = 1  # what a 503 tells the client to wait before trying again
# JSON has no -inf; vLLM reports impossible tokens with this floor too.
_MIN_LOGPROB = -9999.0
_MAX_MESSAGE_CHARS = 1000  # an error message never echoes more of the input than this
_ECHO_BYTES = 64  # of a malformed JSON body, at most this much is quoted back
_MAX_REPORTED_ERRORS = 3
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
# A failure before any output has its own status: the client should retry when no node can
# take the request (503), and fix a request a node refused as invalid (400); else 500.
_FAILURE_STATUS = {Failure.UNAVAILABLE: 503, Failure.BAD_REQUEST: 400}

_M = TypeVar("_M", bound=BaseModel)


# ---------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered with vLLM's envelope and the given HTTP status.

    The message is cut to a bounded length, so no input is ever echoed back in full; a 503
    carries Retry-After, a 401 WWW-Authenticate.
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if len(message) > _MAX_MESSAGE_CHARS:
            message = message[: _MAX_MESSAGE_CHARS - 3] + "..."
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = dict(headers or {})
        if status == 401:
            self.headers["WWW-Authenticate"] = "Bearer"
        if status == 503:
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S))

    def body(self) -> ErrorResponse:
        kind = _ERROR_TYPES.get(self.status, "Error")
        info = ErrorInfo(message=self.message, type=kind, param=self.param, code=self.status)
        return ErrorResponse(error=info)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), self.status, headers=self.headers)


def _client_gone() -> APIError:
    # nginx's status for a client that left before the answer; nobody reads it, but the
    # access log and the request metrics do.
    return APIError(499, "the client closed the request before the answer was ready")


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """A readable message and the first offending parameter, from pydantic's errors."""
    parts, params = [], []
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    for err in errors[:_MAX_REPORTED_ERRORS]:
        loc = ".".join(str(p) for p in err["loc"])
        # The top-level field: deeper parts name union members ("prompt.tokens.3").
        params.append(str(err["loc"][0]) if err["loc"] else None)
        if err["type"] == "extra_forbidden":
            # The name may be anything a client sent: quoted, and cut to a sane length.
            parts.append(f"unknown field {json.dumps(loc[:100])}: this server does not support it")
            continue
        if err["type"] == "model_type" and not err["loc"]:
            msg = "the request body must be a JSON object"
        else:
            msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    if len(errors) > _MAX_REPORTED_ERRORS:
        parts.append(f"and {len(errors) - _MAX_REPORTED_ERRORS} more errors")
    return "; ".join(parts), params[0] if params else None


def _json_error(body: bytes, exc: ValidationError) -> APIError | None:
    """400 for a body that is not JSON at all, quoting at most _ECHO_BYTES of it."""
    err = exc.errors(include_url=False, include_input=False)[0]
    if err["type"] != "json_invalid":
        return None
    if not body.strip():
        return APIError(400, "the request body is empty; expected a JSON object")
    at = re.search(r"line (\d+) column (\d+)", err["msg"])
    offset = 0
    if at is not None:
        line, column = int(at.group(1)), int(at.group(2))
        offset = sum(len(row) + 1 for row in body.split(b"\n")[: line - 1]) + column
    start = max(0, min(offset, len(body)) - _ECHO_BYTES // 2)
    fragment = body[start : start + _ECHO_BYTES].decode("utf-8", "replace")
    where = f"bytes {start}..{start + len(body[start : start + _ECHO_BYTES])}"
    return APIError(400, f"malformed JSON body: {err['msg']} (near {where}: {fragment!r})")


def _check_content_type(request: Request) -> None:
    """JSON bodies only; a missing content type is taken as JSON, as FastAPI does."""
    content_type = request.headers.get("content-type")
    if content_type is None:
        return
    mime = content_type.split(";", 1)[0].strip().lower()
    if mime != "application/json" and not (
        mime.startswith("application/") and mime.endswith("+json")
    ):
        raise APIError(415, f"unsupported content type {mime[:64]!r}: send application/json")


async def _parse(request: Request, model: type[_M]) -> _M:
    _check_content_type(request)
    body = await request.body()
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        json_error = _json_error(body, exc)
        if json_error is not None:
            raise json_error from None
        message, param = _validation_message(exc)
        raise APIError(400, message, param) from None


def _install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        what = f"{request.method} {request.url.path}"
        message = {
            404: f"no such route: {what}",
            405: f"method not allowed: {what}",
        }.get(exc.status_code, str(exc.detail))
        return APIError(exc.status_code, message, headers=exc.headers).response()

    async def validation_error(_: Request, exc: Exception) -> Response:
        # Handlers parse their own bodies, so only parameters declared on a route get here.
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        return APIError(400, str(errors[0].get("msg")) if errors else "invalid request").response()

    async def client_gone(_: Request, exc: Exception) -> Response:
        return _client_gone().response()  # it left while its body was being read

    async def unexpected(_: Request, exc: Exception) -> Response:
        # The log gets the details; the client only learns that it was not its fault.
        logger.exception("unhandled error", exc_info=exc)
        return APIError(500, "internal server error").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(ClientDisconnect, client_gone)
    app.add_exception_handler(Exception, unexpected)


async def _send_error(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    await error.response()(scope, receive, send)


class _ApiKeyGuard:
    """ASGI middleware: with an API key, every path but OPEN_ROUTES wants `Authorization:
    Bearer <key>`, unknown paths too (a scanner learns nothing), before any body is read."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self._app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES:
            if not self._authorized(scope):
                error = APIError(401, "invalid or missing API key (Authorization: Bearer <key>)")
                await _send_error(error, scope, receive, send)
                return
        await self._app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        values = [v for k, v in scope["headers"] if k.lower() == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = values[0].partition(b" ")
        # compare_digest: the time taken must not tell how much of a guessed key was right.
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self._key)


class _BodyLimit:
    """ASGI middleware bounding request bodies: 413 at once when Content-Length says too
    much, else the bytes are counted as they arrive and the read fails at the bound, so no
    body larger than max_bytes is ever held in memory (chunked uploads included)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self._app = app
        self._max = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        error = self._check_declared(scope)
        if error is not None:
            await _send_error(error, scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self._max:
                    # Raised inside the handler's body read: the app answers it like any
                    # other APIError.
                    raise self._too_large(f"more than {self._max} bytes")
            return message

        await self._app(scope, counting_receive, send)

    def _check_declared(self, scope: Scope) -> APIError | None:
        values = [v for k, v in scope["headers"] if k.lower() == b"content-length"]
        if not values:
            return None
        try:
            declared = int(values[0])
        except ValueError:
            return APIError(400, "invalid Content-Length header")
        if declared > self._max:
            return self._too_large(f"{declared} bytes")
        return None

    def _too_large(self, size: str) -> APIError:
        return APIError(413, f"request body too large: {size}; the limit is {self._max} bytes")


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
    failure: Failure | None = None


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
        return ChoiceDelta(
            self.index, text, event.logprobs, finish, event.error, event.token_ids, event.failure
        )

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
        admission: Admission,
    ) -> None:
        self._backend = backend
        self.choices = choices
        self._http = http_request
        self._metrics = metrics
        self._started = started
        self._admission = admission
        self._ticket: _Ticket | None = None
        self._queue: asyncio.Queue[ChoiceDelta] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._remaining = len(choices)
        self._first_token_seen = False
        self.failed = False
        self.disconnected = False

    async def __aenter__(self) -> _Generation:
        """Admits the request (APIError 503 when the router is full) and starts its choices."""
        tokens = sum(len(c.request.prompt_token_ids) for c in self.choices)
        self._ticket = self._admission.admit(len(self.choices), tokens)
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
        self._tasks = []
        assert self._ticket is not None, "left a generation that was never entered"
        self._ticket.release()
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
        except Exception:  # any backend failure must reach the client as an error
            logger.exception("request %s failed", choice.request.request_id)
            if choice.finish_reason is None:  # one finishing delta per choice, never two
                # The log has the details; the client is not told the router's internals.
                self._queue.put_nowait(choice.fail("backend failure: the request was stopped"))

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

    def wants(self, delta: ChoiceDelta) -> bool:
        """Whether a delta without text still makes a chunk (its token ids were asked for)."""
        return False

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

    def wants(self, delta: ChoiceDelta) -> bool:
        return self._want_ids and bool(delta.token_ids)

    def chunk(self, delta: ChoiceDelta) -> BaseModel:
        logprobs = self._logprobs(delta.index, delta.logprobs)
        choice = CompletionChoice(
            index=delta.index,
            text=delta.text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            token_ids=list(delta.token_ids) if self._want_ids else None,
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
    """An SSE stream of a first line already produced and the rest. It always closes the
    rest of the stream, so its cleanup (the backend aborts, the admission release) runs at
    once even when a send fails, is cancelled mid-chunk, or the response never starts."""

    def __init__(self, first: str, rest: AsyncGenerator[str, None]) -> None:
        super().__init__(_prepend(first, rest), media_type="text/event-stream")
        self._rest = rest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:
            pass  # an ASGI 2.4 server's way to say the client left; already cleaned up
        finally:
            await self._close()

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self._close()

    async def _close(self) -> None:
        # Shielded: a cancelled response must still release what its stream holds. The rest
        # is closed on its own too: a wrapper that never started has nothing to close.
        with anyio.CancelScope(shield=True):
            await _aclose(self.body_iterator)
            await self._rest.aclose()


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for line in rest:
        yield line


# ---------------------------------------------------------------- limits and admission


@dataclass(frozen=True, slots=True)
class RouterLimits:
    """Bounds that keep the router's memory and the cluster's queues finite.

    max_request_bytes bounds one request body. max_queued_requests bounds the backend
    requests (choices) admitted and not yet finished, and max_queued_tokens their prompt
    tokens; the router does not know how many of them the nodes run at once, so the bounds
    count running and waiting ones alike. Beyond either bound a request gets 503 with
    Retry-After at once, without reaching the backend. A request larger than the token
    bound alone is still admitted when nothing else is in flight, so every valid request can
    eventually be served.
    """

    max_request_bytes: int = 16 * 1024**2
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1024**2

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_queued_requests", "max_queued_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


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

    def admit(self, requests: int, tokens: int) -> _Ticket:
        """A ticket for requests backend requests of tokens prompt tokens; APIError 503 if
        they do not fit now."""
        self._check(requests, tokens)
        self.requests += requests
        self.tokens += tokens
        return _Ticket(self, requests, tokens)

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


class _Ticket:
    """One admitted request's share of Admission; release() is idempotent."""

    def __init__(self, admission: Admission, requests: int, tokens: int) -> None:
        self._admission = admission
        self._share: tuple[int, int] | None = (requests, tokens)

    def release(self) -> None:
        if self._share is not None:
            self._admission._release(*self._share)
            self._share = None


# ---------------------------------------------------------------- the server


def _too_long(limit: int, prompt_len: int, max_tokens: int | None, param: str) -> APIError:
    """vLLM's rule and wording: the prompt plus max_tokens must fit max_model_len; with
    max_tokens omitted, the prompt must leave room for at least one token."""
    if max_tokens is None:
        return APIError(
            400,
            f"This model's maximum context length is {limit} tokens (max_model_len). However, "
            f"your prompt has {prompt_len} tokens, which leaves no room for the completion. "
            "Please reduce the length of the prompt.",
            param,
        )
    return APIError(
        400,
        f"This model's maximum context length is {limit} tokens (max_model_len). However, you "
        f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
        "for the completion). Please reduce the length of the prompt or max_tokens.",
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
        self._executor: ThreadPoolExecutor | None = None  # made on first use, so the app
        self.vocab_size = len(tokenizer)  # serves again after a lifespan's shutdown

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
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
        self.check_vocab(ids, param)

    def check_vocab(self, ids: list[int] | tuple[int, ...], param: str) -> None:
        if ids and max(ids) >= self.vocab_size:
            raise APIError(
                400,
                f"token id {max(ids)} is outside the vocabulary (ids 0..{self.vocab_size - 1})",
                param,
            )

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


class _Server:
    """Route handlers of one app, over one backend and tokenizer."""

    def __init__(
        self,
        backend: Backend,
        tokenizer: PreTrainedTokenizerBase,
        model: str,
        limits: RouterLimits,
    ) -> None:
        self._backend = backend
        self._tokenizer = tokenizer
        self._model = model
        self.tokenization = _Tokenization(tokenizer)
        self._tokens = _TokenStrings(tokenizer)
        self.metrics = RouterMetrics(backend)
        self.admission = Admission(limits)

    async def completions(self, request: Request) -> Response:
        started = time.monotonic()
        self.admission.check_room()
        body = await _parse(request, CompletionRequest)
        self._check_model(body.model)
        prompts = await self._completion_prompts(body.prompt, body.add_special_tokens)
        dialect = _CompletionDialect(
            self._model, self._tokens, body.logprobs is not None, body.return_token_ids
        )
        return await self._generate(request, body, prompts, dialect, started, "prompt")

    async def chat_completions(self, request: Request) -> Response:
        started = time.monotonic()
        self.admission.check_room()
        body = await _parse(request, ChatCompletionRequest)
        self._check_model(body.model)
        messages = [m.template_dict() for m in body.messages]
        prompt = await self.tokenization.chat(messages, body.add_generation_prompt)
        self.tokenization.check_ids(prompt, "messages")
        dialect = _ChatDialect(self._model, self._tokens, body.logprobs_count() is not None)
        return await self._generate(request, body, [prompt], dialect, started, "messages")

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
        self.tokenization.check_vocab(body.tokens, "tokens")
        text = await self.tokenization.run(self._tokenizer.decode, body.tokens)
        return DetokenizeResponse(prompt=text)

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self._model:
            shown = name if len(name) <= 100 else name[:100] + "..."
            raise APIError(
                404,
                f"The model `{shown}` does not exist; this server serves `{self._model}`.",
                "model",
            )

    async def _completion_prompts(
        self, prompt: str | list[Any], add_special_tokens: bool
    ) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [await self.tokenization.encode(prompt, add_special_tokens)]
        elif isinstance(prompt[0], int):
            prompts = [list(prompt)]
        elif isinstance(prompt[0], str):
            prompts = [await self.tokenization.encode(p, add_special_tokens) for p in prompt]
        else:
            prompts = [list(p) for p in prompt]
        for ids in prompts:
            self.tokenization.check_ids(ids, "prompt")
        return prompts

    def _max_tokens(
        self, prompt_len: int, requested: int | None, prompt_param: str, max_tokens_param: str
    ) -> int:
        """requested, or the room left when omitted; 400 if it does not fit the context."""
        limit = self._backend.max_model_len
        if requested is None:
            if prompt_len >= limit:
                raise _too_long(limit, prompt_len, None, prompt_param)
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise _too_long(limit, prompt_len, requested, max_tokens_param)
        return requested

    def _make_choices(
        self, rid: str, prompts: list[list[int]], body: BaseGenerationRequest, prompt_param: str
    ) -> list[_Choice]:
        stops = body.stop_strings()
        self.tokenization.check_vocab(body.stop_token_ids or (), "stop_token_ids")
        single = len(prompts) * body.n == 1
        choices = []
        for p, ids in enumerate(prompts):
            max_tokens = self._max_tokens(
                len(ids), body.requested_max_tokens(), prompt_param, body.max_tokens_param()
            )
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
        prompt_param: str,
    ) -> Response:
        choices = self._make_choices(dialect.id, prompts, body, prompt_param)
        if not self._backend.ready():
            raise APIError(503, "no prefill/decode route is available; retry later")
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        gen = _Generation(self._backend, choices, request, self.metrics, started, self.admission)
        if body.stream:
            return await _stream_response(_stream(gen, dialect, prompts, body.include_usage))
        collected = await _collect(gen)
        if collected is None:
            return _client_gone().response()
        answer = dialect.response(collected, _usage(prompts, choices))
        # pydantic's JSON writes non-finite floats as null; json.dumps would refuse them.
        return Response(answer.model_dump_json(), media_type="application/json")


def _failure(delta: ChoiceDelta, first: bool) -> APIError:
    """The HTTP error for a failed choice: 503 when no node could take it (retry later),
    500 otherwise."""
    error = delta.error or "generation failed"
    status = _FAILURE_STATUS.get(delta.failure, 500) if first else 500
    return APIError(status, f"{error}; retry later" if status == 503 else error)


async def _collect(gen: _Generation) -> list[_Collected] | None:
    """Every choice in full; None if the client left; APIError 500/503 if a choice failed."""
    collected = [_Collected(c.index) for c in gen.choices]
    first = True
    async with gen:
        async for delta in gen:
            if delta.finish_reason == "error":
                raise _failure(delta, first)
            first = False
            collected[delta.index].add(delta)
    return None if gen.disconnected else collected


async def _stream(
    gen: _Generation, dialect: _Dialect, prompts: list[list[int]], include_usage: bool
) -> AsyncGenerator[str, None]:
    """SSE lines: opening chunks, a chunk per delta, usage if asked, then [DONE].

    Nothing is yielded before the first delta: if that one is an error (no node could take
    the request, or it failed before any token), APIError is raised instead, so the client
    gets an HTTP error status rather than a 200 stream. A later failed choice ends the
    stream with its finish_reason "error" chunk, an error line in the error envelope, and
    [DONE]. A gone client gets nothing more.
    """
    exclude = None if include_usage else {"usage"}
    opened = False
    async with gen:
        async for delta in gen:
            if not opened:
                if delta.finish_reason == "error":
                    raise _failure(delta, first=True)
                opened = True
                for chunk in dialect.opening(len(gen.choices)):
                    yield _sse(chunk, exclude)
            if delta.text or delta.logprobs or delta.finish_reason or dialect.wants(delta):
                yield _sse(dialect.chunk(delta), exclude)
            if delta.finish_reason == "error":
                yield _sse(_failure(delta, first=False).body())
    if gen.disconnected:
        return
    if include_usage and not gen.failed:
        yield _sse(dialect.usage_chunk(_usage(prompts, gen.choices)))
    yield _SSE_DONE


async def _stream_response(events: AsyncGenerator[str, None]) -> Response:
    """Waits for the stream's first line before answering, so admission and failures before
    the first token become HTTP errors; then streams the rest."""
    try:
        first = await anext(events)
    except StopAsyncIteration:  # the client left before the first token
        return _client_gone().response()
    except BaseException:
        await events.aclose()
        raise
    return _SSEResponse(first, events)


# ---------------------------------------------------------------- app


def _openapi(app: FastAPI, bodies: Mapping[str, type[BaseModel]], api_key: bool) -> dict:
    """FastAPI's schema plus the request bodies the handlers parse themselves (for 400s in
    the error envelope), and the bearer scheme when an API key is set."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in bodies.items():
        model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(model_schema.pop("$defs", {}))
        components[model.__name__] = model_schema
        ref = {"$ref": f"#/components/schemas/{model.__name__}"}
        operation = schema["paths"][path]["post"]
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": ref}},
        }
    if api_key:
        schemes = schema["components"].setdefault("securitySchemes", {})
        schemes["bearer"] = {"type": "http", "scheme": "bearer"}
        schema["security"] = [{"bearer": []}]
        refused = {
            "description": _ERROR_TYPES[401],
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
            },
        }
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                if path in OPEN_ROUTES:
                    operation["security"] = []
                else:
                    operation["responses"].setdefault("401", refused)
    return schema


def _responses(ok: type[BaseModel] | None, *errors: int, stream: bool = False) -> dict:
    """The documented answers of a route: ok's schema (or an SSE stream too), and the error
    envelope for each status in errors."""
    out: dict[int | str, dict[str, Any]] = {}
    if ok is not None:
        content: dict[str, Any] = {"application/json": {}}
        if stream:
            content["text/event-stream"] = {"schema": {"type": "string"}}
        out[200] = {"model": ok, "content": content}
    for status in errors:
        out[status] = {"model": ErrorResponse, "description": _ERROR_TYPES[status]}
    return out


def create_app(
    backend: Backend,
    tokenizer: PreTrainedTokenizerBase,
    model_name: str,
    api_key: str | None = None,
    limits: RouterLimits | None = None,
) -> FastAPI:
    """The router's FastAPI app: OpenAI-compatible routes plus /health, /metrics, /tokenize,
    /detokenize and /openapi.json. With api_key every path but /health wants
    `Authorization: Bearer <key>`. Every error, whatever its cause, has vLLM's envelope."""
    limits = limits or RouterLimits()
    server = _Server(backend, tokenizer, model_name, limits)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        server.tokenization.close()

    # No /docs: it loads its page from a CDN. /openapi.json is served (behind the API key).
    app = FastAPI(title="pdserve router", lifespan=lifespan, docs_url=None, redoc_url=None)
    _install_error_handlers(app)
    # Added innermost first: requests are counted, then authorized, then size-bounded.
    app.add_middleware(_BodyLimit, max_bytes=limits.max_request_bytes)
    if api_key is not None:
        app.add_middleware(_ApiKeyGuard, api_key=api_key)
    app.add_middleware(_RequestCounter, metrics=server.metrics)
    generation = (400, 404, 413, 415, 500, 503)
    app.post("/v1/completions", responses=_responses(CompletionResponse, *generation, stream=True))(
        server.completions
    )
    app.post(
        "/v1/chat/completions",
        responses=_responses(ChatCompletionResponse, *generation, stream=True),
    )(server.chat_completions)
    app.get("/v1/models", response_model=ModelList)(server.models)
    app.get("/health", responses=_responses(None, 503))(server.health)
    app.get("/metrics", response_class=PlainTextResponse)(server.prometheus)
    app.post("/tokenize", response_model=TokenizeResponse, responses=_responses(None, 400, 404))(
        server.tokenize
    )
    app.post(
        "/detokenize", response_model=DetokenizeResponse, responses=_responses(None, 400, 404)
    )(server.detokenize)
    bodies = {
        "/v1/completions": CompletionRequest,
        "/v1/chat/completions": ChatCompletionRequest,
        "/tokenize": TokenizeRequest,
        "/detokenize": DetokenizeRequest,
    }
    schema: dict[str, Any] = {}

    def openapi() -> dict:
        if not schema:
            schema.update(_openapi(app, bodies, api_key is not None))
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.state.admission = server.admission  # for tests and operators: work in flight
    return app
