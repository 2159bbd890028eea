"""Every error the API answers, in vLLM's envelope {"error": {"message", "type", "param",
"code"}}: the APIError type, what is wrong with a body that does not parse, the status of a
failed generation, and the app's exception handlers (whatever the cause, the envelope).
Nothing here runs for a request that succeeds."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pdserve.common.wire.messages import Failure
from pdserve.router.openai_protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a 503 tells the client to wait before trying again
_MAX_MESSAGE_CHARS = 1000  # an error message never echoes more of the input than this
_ECHO_BYTES = 64  # of a malformed JSON body, at most this much is quoted back
_MAX_REPORTED_ERRORS = 3
ERROR_TYPES = {
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
        kind = ERROR_TYPES.get(self.status, "Error")
        info = ErrorInfo(message=self.message, type=kind, param=self.param, code=self.status)
        return ErrorResponse(error=info)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), self.status, headers=self.headers)


def client_gone() -> APIError:
    # nginx's status for a client that left before the answer; nobody reads it, but the
    # access log and the request metrics do.
    return APIError(499, "the client closed the request before the answer was ready")


def failure_error(error: str | None, failure: Failure | None, first: bool) -> APIError:
    """The HTTP error for a failed choice: 503 when no node could take it (retry later),
    400 when a node refused it as invalid, 500 otherwise."""
    error = error or "generation failed"
    status = _FAILURE_STATUS.get(failure, 500) if first else 500
    return APIError(status, f"{error}; retry later" if status == 503 else error)


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


def body_error(body: bytes, exc: ValidationError) -> APIError:
    """The 400 for a body that does not parse as the request's model: not JSON at all (quoting
    a little of it), or JSON that breaks the model's rules (naming the first parameter)."""
    json_error = _json_error(body, exc)
    if json_error is not None:
        return json_error
    message, param = _validation_message(exc)
    return APIError(400, message, param)


def install_error_handlers(app: FastAPI) -> None:
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

    async def client_left(_: Request, exc: Exception) -> Response:
        return client_gone().response()  # it left while its body was being read

    async def unexpected(_: Request, exc: Exception) -> Response:
        # The log gets the details; the client only learns that it was not its fault.
        logger.exception("unhandled error", exc_info=exc)
        return APIError(500, "internal server error").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(ClientDisconnect, client_left)
    app.add_exception_handler(Exception, unexpected)
