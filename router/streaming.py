"""SSE streaming: a generation's deltas as server-sent events, opened only once the first
delta is known to be no error (an error before it gets an HTTP status instead)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

import anyio
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from pdserve.router.dialects import Dialect, usage_info
from pdserve.router.errors import client_gone, failure_error
from pdserve.router.generation import Generation, aclose


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
) -> AsyncGenerator[str, None]:
    """SSE lines: opening chunks, a chunk per delta, usage if asked, then [DONE].
    `continuous_usage` puts the usage so far on every chunk after the opening ones (vLLM's
    continuous_usage_stats; GuideLLM asks for it).

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
                yield _sse(chunk, exclude)
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
