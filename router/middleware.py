"""What stands between a client and the nodes. Pure-ASGI middlewares, run before any handler:
stamp a request's arrival, count every request by route and status, check the API key, bound
the body size. Admission,
once a handler knows a request's size: how much generation work the router lets in at once."""

from __future__ import annotations

import secrets
import time

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.router.cluster.timing import RouterMetrics
from pdserve.router.config import RouterLimits
from pdserve.router.errors import RETRY_AFTER_S, APIError

ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/live",
    "/metrics",
    "/tokenize",
    "/detokenize",
    "/openapi.json",
)
OPEN_ROUTES = ("/health", "/live")  # every other path, unknown ones included, wants the API key


class Entered:
    """ASGI middleware, the outermost: the first line of the router's code that a request runs
    stamps it (monotonic s, in its scope's state), where its TTFT starts (router_ingress,
    router/cluster/timing.py). An ASGI app cannot stamp earlier: before it, uvicorn read and
    parsed the request and started its task, all in uvicorn's own code (reached only by
    subclassing its internal protocol classes)."""

    KEY = "pdserve_entered"

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})[self.KEY] = time.monotonic()
        await self._app(scope, receive, send)

    @classmethod
    def at(cls, request: Request) -> float:
        """The request's stamp."""
        return request.scope["state"][cls.KEY]


async def _send_error(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    await error.response()(scope, receive, send)


class ApiKeyGuard:
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


class BodyLimit:
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


class RequestCounter:
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
