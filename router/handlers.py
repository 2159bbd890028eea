"""The route handlers: validate, tokenize, length-check and split a request into choices,
then answer it as one JSON response or an SSE stream (opened only once the first delta is
known to be no error: an error before it gets an HTTP status instead)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from pdserve.common.wire.payloads import StructuredOutputsParams
from pdserve.router.backend import Backend, GenerateRequest
from pdserve.router.cluster.timing import RouterMetrics, valid_traceparent
from pdserve.router.config import RouterLimits
from pdserve.router.dialects import (
    ChatDialect,
    Collected,
    CompletionDialect,
    Dialect,
    TokenStrings,
    usage_info,
)
from pdserve.router.errors import APIError, body_error, client_gone, failure_error
from pdserve.router.generation import (
    Choice,
    Generation,
    IncrementalDetokenizer,
    StopStringMatcher,
    Tokenization,
    aclose,
)
from pdserve.router.middleware import Admission, Entered
from pdserve.router.openai_protocol import (
    BaseGenerationRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    RequestMetrics,
    TokenizeRequest,
    TokenizeResponse,
)
from pdserve.router.tools import ToolMode, messages_for_default

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_M = TypeVar("_M", bound=BaseModel)


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


async def parse_body(request: Request, model: type[_M]) -> _M:
    """The request's JSON body as `model`; what is wrong with one that is not: `body_error`."""
    _check_content_type(request)
    body = await request.body()
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise body_error(body, exc) from None


class Handlers:
    """Route handlers of one app, over one backend and tokenizer."""

    def __init__(
        self,
        backend: Backend,
        tokenizer: PreTrainedTokenizerBase,
        model: str,
        limits: RouterLimits,
        tool_call_parser: str = "hermes",
    ) -> None:
        self._backend = backend
        self._tool_call_parser = tool_call_parser
        self._tokenizer = tokenizer
        self._model = model
        self.tokenization = Tokenization(tokenizer)
        self._tokens = TokenStrings(tokenizer)
        self.metrics = RouterMetrics(backend)
        self.admission = Admission(limits)

    async def completions(self, request: Request) -> Response:
        started = time.monotonic()
        self.admission.check_room()
        body = await parse_body(request, CompletionRequest)
        self._check_model(body.model)
        prompts = await self._completion_prompts(body.prompt, body.add_special_tokens)
        dialect = CompletionDialect(
            self._model,
            self._tokens,
            body.logprobs,
            body.return_token_ids,
            want_prompt_logprobs=body.prompt_logprobs is not None,
        )
        echoes = None
        if body.echo:  # the prompt as the client wrote it; token prompts decoded
            if isinstance(body.prompt, str):
                echoes = [body.prompt]
            elif isinstance(body.prompt[0], str):
                echoes = list(body.prompt)
            else:
                echoes = [self._tokenizer.decode(ids) for ids in prompts]
        return await self._generate(request, body, prompts, dialect, started, "prompt", echoes)

    async def chat_completions(self, request: Request) -> Response:
        started = time.monotonic()
        self.admission.check_room()
        body = await parse_body(request, ChatCompletionRequest)
        self._check_model(body.model)
        try:
            tools = body.tool_mode(self._tool_call_parser)
        except ValueError as exc:
            raise APIError(400, str(exc), "tool_choice" if body.tools else "tools") from None
        prompt = await self._chat_prompt(body, tools)
        self.tokenization.check_ids(prompt, "messages")
        dialect = ChatDialect(
            self._model,
            self._tokens,
            body.logprobs_count() is not None,
            want_prompt_logprobs=body.prompt_logprobs is not None,
            tools=tools,
        )
        forced = tools.constraint() if tools is not None else None
        return await self._generate(
            request, body, [prompt], dialect, started, "messages", forced=forced
        )

    async def _chat_prompt(self, body: ChatCompletionRequest, tools: ToolMode | None) -> list[int]:
        """The chat's prompt ids: tools through the template when it renders them, else the
        default tool prompt (see tools.py); earlier calls and tool results either way."""
        messages = [m.template_dict() for m in body.messages]
        extra = dict(body.chat_template_kwargs or {})
        if body.documents is not None:
            extra["documents"] = body.documents
        listed = None
        if await self.tokenization.renders_tools():
            listed = [f.as_tool() for f in tools.functions] if tools is not None else None
        elif tools is not None or any(m.tool_calls or m.role == "tool" for m in body.messages):
            messages = messages_for_default(messages, tools.functions if tools else ())
        return await self.tokenization.chat(
            messages, body.add_generation_prompt, listed, extra, body.continue_final_message
        )

    async def models(self) -> ModelList:
        card = ModelCard(id=self._model, max_model_len=self._backend.max_model_len)
        return ModelList(data=[card])

    async def health(self) -> Response:
        if not self._backend.ready():
            return APIError(503, self._backend.unready_reason()).response()
        return JSONResponse({"status": "ok"})

    async def live(self) -> dict:
        """The router's event loop answers (whether or not any node is there)."""
        return {"status": "ok"}

    async def prometheus(self) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> TokenizeResponse:
        body = await parse_body(request, TokenizeRequest)
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
        body = await parse_body(request, DetokenizeRequest)
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
        self,
        rid: str,
        prompts: list[list[int]],
        body: BaseGenerationRequest,
        prompt_param: str,
        echoes: list[str] | None = None,
        forced: StructuredOutputsParams | None = None,
    ) -> list[Choice]:
        """One Choice per prompt and n; `echoes`: each prompt's text, returned before its
        completion (completions' echo)."""
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
                    sampling = body.sampling_params(max_tokens, seed, forced)
                except ValueError as exc:
                    # SamplingParams' messages start with the offending field's name.
                    raise APIError(400, str(exc), str(exc).split()[0]) from None
                request = GenerateRequest(rid if single else f"{rid}-{index}", tuple(ids), sampling)
                detok = IncrementalDetokenizer(self._tokenizer, ids, body.skip_special_tokens)
                echo = echoes[p] if echoes else None
                choices.append(Choice(index, p, request, detok, StopStringMatcher(stops), echo))
        return choices

    async def _generate(
        self,
        request: Request,
        body: BaseGenerationRequest,
        prompts: list[list[int]],
        dialect: Dialect,
        started: float,
        prompt_param: str,
        echoes: list[str] | None = None,
        forced: StructuredOutputsParams | None = None,
    ) -> Response:
        rid = dialect.id  # unique, whatever the client calls its request
        if body.request_id is not None:
            dialect.id = f"{dialect.prefix}-{body.request_id}"
        choices = self._make_choices(rid, prompts, body, prompt_param, echoes, forced)
        traceparent = valid_traceparent(request.headers.get("traceparent"))
        entered = Entered.at(request)
        for choice in choices:  # each choice's stages count from the request's arrival
            timing = choice.request.timing
            timing.entered, timing.arrival, timing.traceparent = entered, started, traceparent
        if not self._backend.ready():
            raise APIError(503, f"{self._backend.unready_reason()}; retry later")
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        gen = Generation(self._backend, choices, request, self.metrics, entered, self.admission)
        if body.stream:
            usage = (body.include_usage, body.continuous_usage, body.return_metrics)
            return await streaming_response(stream_events(gen, dialect, prompts, *usage))
        collected = await _collect(gen)
        if collected is None:
            return client_gone().response()
        answer = dialect.response(collected, usage_info(prompts, choices))
        if body.return_metrics:
            answer.metrics = _metrics(choices)
        # pydantic's JSON writes non-finite floats as null; json.dumps would refuse them.
        return Response(answer.model_dump_json(), media_type="application/json")


async def _collect(gen: Generation) -> list[Collected] | None:
    """Every choice in full; None if the client left; APIError 500/503 if a choice failed."""
    collected = [Collected(c.index) for c in gen.choices]
    first = True
    async with gen:
        async for delta in gen:
            if delta.finish_reason == "error":
                raise failure_error(delta.error, delta.failure, first)
            first = False
            collected[delta.index].add(delta)
    return None if gen.disconnected else collected


def _metrics(choices: list[Choice]) -> list[RequestMetrics]:
    return [RequestMetrics(index=c.index, **c.request.timing.metrics()) for c in choices]


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
            await aclose(self.body_iterator)
            await self._rest.aclose()


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for line in rest:
        yield line


async def stream_events(
    gen: Generation,
    dialect: Dialect,
    prompts: list[list[int]],
    include_usage: bool,
    continuous_usage: bool = False,
    metrics: bool = False,
) -> AsyncGenerator[str, None]:
    """SSE lines: opening chunks, a chunk per delta, usage if asked, then [DONE].
    `continuous_usage` puts the usage so far on every chunk after the opening ones (vLLM's
    continuous_usage_stats; GuideLLM asks for it); `metrics`, a choice's metrics on its last.

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
                    raise failure_error(delta.error, delta.failure, first=True)
                opened = True
                for chunk in dialect.opening(len(gen.choices)):
                    yield _sse(chunk, exclude)
            if delta.text or delta.logprobs or delta.finish_reason or dialect.wants(delta):
                chunk = dialect.chunk(delta)
                if chunk is None:  # held back (a chat reply with tools until it ends)
                    continue
                if continuous_usage:
                    chunk.usage = usage_info(prompts, gen.choices)
                choice = gen.choices[delta.index]
                if metrics and delta.finish_reason:
                    choice.request.timing.wrote()  # no chunk carries its own write's time
                    chunk.metrics = _metrics([choice])
                yield _sse(chunk, exclude)
                choice.request.timing.wrote()  # resumed once the server's send returned
            if delta.finish_reason == "error":
                yield _sse(failure_error(delta.error, delta.failure, first=False).body())
    if gen.disconnected:
        return
    if include_usage and not gen.failed:
        yield _sse(dialect.usage_chunk(usage_info(prompts, gen.choices)))
    yield _SSE_DONE


async def streaming_response(events: AsyncGenerator[str, None]) -> Response:
    """Waits for the stream's first line before answering, so admission and failures before
    the first token become HTTP errors; then streams the rest."""
    try:
        first = await anext(events)
    except StopAsyncIteration:  # the client left before the first token
        return client_gone().response()
    except BaseException:
        await events.aclose()
        raise
    return _SSEResponse(first, events)
