"""The router's OpenAI-compatible HTTP app, served over any `Backend`.

Pure-ASGI middlewares stamp and count every request, check the API key and bound the body
size before any handler runs. A request is then validated, tokenized (off the event loop),
length-checked and split into choices (n per prompt), each one backend request; `Admission`
refuses it with 503 when the work in flight would pass `RouterLimits`. A generation runs the choices
concurrently and turns their token events into text deltas (incremental detokenization, stop
strings); a dialect (completions or chat) shapes the deltas into SSE chunks or one JSON
response. Whatever ends a request early (client gone, error, cancellation) aborts its
unfinished backend requests and releases its admission. Every error, whatever its cause, is
answered in vLLM's envelope {"error": {"message", "type", "param", "code"}}.

Modules, from the bottom up: errors, metrics (router/cluster/timing.py); middleware (and
admission); generation (and tokenization); dialects; handlers (and streaming); app.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from pdserve.router.backend import Backend
from pdserve.router.config import RouterLimits
from pdserve.router.errors import ERROR_TYPES, install_error_handlers
from pdserve.router.handlers import Handlers
from pdserve.router.middleware import (
    OPEN_ROUTES,
    ApiKeyGuard,
    BodyLimit,
    Entered,
    RequestCounter,
)
from pdserve.router.openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["RouterLimits", "create_app"]


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
            "description": ERROR_TYPES[401],
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
        out[status] = {"model": ErrorResponse, "description": ERROR_TYPES[status]}
    return out


def create_app(
    backend: Backend,
    tokenizer: PreTrainedTokenizerBase,
    model_name: str,
    api_key: str | None = None,
    limits: RouterLimits | None = None,
    tool_call_parser: str = "hermes",
) -> FastAPI:
    """The router's FastAPI app: OpenAI-compatible routes plus /health (a route to nodes
    exists: readiness), /live (the process serves: liveness), /metrics, /tokenize,
    /detokenize and /openapi.json. With api_key every path but /health and /live wants
    `Authorization: Bearer <key>`. Every error, whatever its cause, has vLLM's envelope."""
    limits = limits or RouterLimits()
    handlers = Handlers(backend, tokenizer, model_name, limits, tool_call_parser)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        handlers.tokenization.close()

    # No /docs: it loads its page from a CDN. /openapi.json is served (behind the API key).
    app = FastAPI(title="pdserve router", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    # Added innermost first: requests are stamped, counted, authorized, then size-bounded.
    app.add_middleware(BodyLimit, max_bytes=limits.max_request_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyGuard, api_key=api_key)
    app.add_middleware(RequestCounter, metrics=handlers.metrics)
    app.add_middleware(Entered)  # outermost: the first line a request runs
    _add_routes(app, handlers)
    _serve_openapi(app, api_key is not None)
    app.state.admission = handlers.admission  # for tests and operators: work in flight
    return app


def _add_routes(app: FastAPI, handlers: Handlers) -> None:
    """Every route to its handler, with the responses the OpenAPI schema lists for it."""
    generation = (400, 404, 413, 415, 500, 503)
    app.post("/v1/completions", responses=_responses(CompletionResponse, *generation, stream=True))(
        handlers.completions
    )
    app.post(
        "/v1/chat/completions",
        responses=_responses(ChatCompletionResponse, *generation, stream=True),
    )(handlers.chat_completions)
    app.get("/v1/models", response_model=ModelList)(handlers.models)
    app.get("/health", responses=_responses(None, 503))(handlers.health)
    app.get("/live")(handlers.live)
    app.get("/metrics", response_class=PlainTextResponse)(handlers.prometheus)
    app.post("/tokenize", response_model=TokenizeResponse, responses=_responses(None, 400, 404))(
        handlers.tokenize
    )
    app.post(
        "/detokenize", response_model=DetokenizeResponse, responses=_responses(None, 400, 404)
    )(handlers.detokenize)


def _serve_openapi(app: FastAPI, keyed: bool) -> None:
    """/openapi.json built once, on first request, with the request bodies the handlers
    read themselves (`keyed`: the routes want the API key)."""
    bodies = {
        "/v1/completions": CompletionRequest,
        "/v1/chat/completions": ChatCompletionRequest,
        "/tokenize": TokenizeRequest,
        "/detokenize": DetokenizeRequest,
    }
    schema: dict[str, Any] = {}

    def openapi() -> dict:
        if not schema:
            schema.update(_openapi(app, bodies, keyed))
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
