"""One HTTP request's text on the router. Prompts become token ids off the event loop
(`Tokenization`, with the checks of the token ids a request carries); its choices (n per
prompt), each one backend request, run concurrently; the nodes' Tokens and Error messages
become text deltas (incremental detokenization, stop strings). Whatever ends a request early
aborts its unfinished backend requests and releases its admission."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import Request

from pdserve.common.wire.messages import Error, Failure, Tokens
from pdserve.common.wire.payloads import TokenLogprobs
from pdserve.router.backend import Backend, GenerateRequest
from pdserve.router.cluster.streams import get_within
from pdserve.router.cluster.timing import RouterMetrics, TokenClock
from pdserve.router.errors import APIError
from pdserve.router.middleware import Admission, Ticket

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# How often a request waiting for tokens checks whether its client is still there; a token
# that arrives meanwhile is handled at once, so this bounds only how long an abandoned request
# keeps running on the nodes.
DISCONNECT_POLL_S = 0.5
# Bound on aborting and on tearing down a request, so a stuck backend cannot hang the router.
CLEANUP_TIMEOUT_S = 5.0

# Prompt tokens decoded ahead of the first output token, so that it is decoded in context
# (decoders that strip a leading space or join pieces look at their neighbours).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"

# apply_chat_template's own arguments: a client's template variables may not set them.
_RENDER_ARGS = frozenset(
    "conversation messages tools add_generation_prompt continue_final_message tokenize padding"
    " truncation max_length return_tensors return_dict return_assistant_tokens_mask"
    " tokenizer_kwargs chat_template processor_kwargs".split()
)


class Tokenization:
    """Runs the tokenizer on one worker thread: long prompts would otherwise stall every
    stream on the event loop, and one thread keeps the tokenizer free of concurrent use."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._executor: ThreadPoolExecutor | None = None  # made on first use, so the app
        self.vocab_size = len(tokenizer)  # serves again after a lifespan's shutdown
        self._renders_tools: bool | None = None

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(fn, *args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        encode = self._tokenizer.encode
        return list(await self.run(encode, text, add_special_tokens=add_special_tokens))

    async def chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final: bool = False,
    ) -> list[int]:
        """The messages through the chat template; `template_kwargs` (vLLM's
        chat_template_kwargs, documents) become template variables, never the renderer's own
        arguments."""
        template_kwargs = template_kwargs or {}
        taken = sorted(set(template_kwargs) & _RENDER_ARGS)
        if taken:
            raise APIError(
                400,
                f"chat_template_kwargs cannot set {', '.join(taken)}: they are the renderer's",
                "chat_template_kwargs",
            )
        try:
            ids = await self.run(
                self._tokenizer.apply_chat_template,
                messages,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                tools=tools,
                continue_final_message=continue_final,
                **template_kwargs,
            )
        except Exception as exc:  # template errors (roles, no template) are the client's to fix
            raise APIError(400, f"cannot apply the chat template: {exc}", "messages") from None
        # transformers 5 returns a BatchEncoding, earlier versions a list.
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    async def renders_tools(self) -> bool:
        """Whether the chat template writes `tools` into the prompt (checked once: a template
        that ignores them renders the same text with or without)."""
        if self._renders_tools is None:
            probe = [{"role": "user", "content": "hi"}]
            tool = {"type": "function", "function": {"name": "probe", "parameters": {}}}

            def render(tools: list | None) -> str:
                return self._tokenizer.apply_chat_template(probe, tokenize=False, tools=tools)

            try:
                self._renders_tools = await self.run(render, [tool]) != await self.run(render, None)
            except Exception:  # a template that fails on tools does not render them
                self._renders_tools = False
        return self._renders_tools

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


class IncrementalDetokenizer:
    """Turns output token ids into text deltas without re-decoding the whole output.

    Keeps two offsets into the token list: text of tokens[prefix_offset:read_offset] has
    already been emitted, so each push decodes only tokens[prefix_offset:] and emits what lies
    beyond the prefix text. Text ending in U+FFFD is held back: with byte-level tokens a
    multi-byte character may be split across tokens, and its first bytes alone decode to
    U+FFFD. flush() emits whatever is still held back at the end.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        self._token_ids: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return self._text

    def push(self, new_token_ids: list[int]) -> str:
        """Adds newly generated tokens and returns the text they finalize (maybe "")."""
        self._token_ids.extend(new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Returns the held-back text, even if it ends in an incomplete character."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""
        if new_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""
        delta = new_text[len(prefix_text) :]
        # Drop tokens no window will need again, so the list stays as short as the window.
        del self._token_ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._text += delta
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


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
class PromptPart:
    """The prompt as a choice's first delta returns it: its text when echoed, its token ids,
    and its tokens' logprobs (of tokens 1, 2, ...) when they were asked for."""

    text: str | None
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None


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
    prompt: PromptPart | None = None  # on the first delta, with echo or prompt logprobs


class Choice:
    """One choice of a response: its backend request, detokenizer and stop-string matcher."""

    def __init__(
        self,
        index: int,
        prompt_index: int,
        request: GenerateRequest,
        detokenizer: IncrementalDetokenizer,
        stops: StopStringMatcher,
        echo: str | None = None,
    ) -> None:
        """`echo`: the prompt's text, to return before the completion."""
        self.index = index
        self._echo = echo
        self.prompt_index = prompt_index
        self.request = request
        self._detok = detokenizer
        self._stops = stops
        self.num_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.backend_done = False  # the backend ended this request; no abort needed
        self._seen_event = False

    def on_event(self, event: Tokens | Error) -> ChoiceDelta:
        """What one backend event means for this choice: an Error ends it with finish_reason
        "error" (text held back for a possible stop string goes out with it)."""
        first = not self._seen_event
        self._seen_event = True
        if isinstance(event, Error):
            text, finish = self._advance((), "error")
            return ChoiceDelta(
                self.index, text, finish_reason=finish, error=event.message, failure=event.kind
            )
        prompt = None
        if first:  # the nodes report cached tokens and prompt logprobs on the first message
            self.cached_tokens = event.cached_tokens
            prompt = self._prompt_part(event)
        text, finish = self._advance(event.token_ids, event.finish_reason or None)
        return ChoiceDelta(
            self.index, text, event.logprobs, finish, token_ids=event.token_ids, prompt=prompt
        )

    def _advance(self, token_ids: tuple[int, ...], finish: str | None) -> tuple[str, str | None]:
        """Detokenize new tokens and look for stop strings: the text safe to emit and how the
        choice ends (a stop string overrides the backend's reason)."""
        self.num_tokens += len(token_ids)
        self.backend_done = finish is not None
        # Like vLLM, stop strings only count once min_tokens have been generated.
        search = self.num_tokens >= self.request.sampling.min_tokens
        text, hit = self._stops.push(self._detok.push(list(token_ids)), search)
        if hit:
            finish = "stop"
        elif finish is not None:
            tail, hit = self._stops.push(self._detok.flush(), search)
            text += tail if hit else tail + self._stops.flush()
            finish = "stop" if hit else finish
        self.finish_reason = finish
        return text, finish

    def _prompt_part(self, event: Tokens) -> PromptPart | None:
        asked = self.request.sampling.prompt_logprobs is not None
        if self._echo is None and not asked:
            return None
        if event.finish_reason == "error":
            return None  # nothing was computed: the error says why
        lps = event.prompt_logprobs if asked else None
        return PromptPart(self._echo, self.request.prompt_token_ids, lps)

    def fail(self, message: str) -> ChoiceDelta:
        self.finish_reason = "error"
        return ChoiceDelta(self.index, finish_reason="error", error=message)


async def aclose(events: AsyncIterator[Tokens | Error]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()


class Generation:
    """Runs the choices of one HTTP request concurrently; yields their deltas as they come.

    Use as `async with gen: async for delta in gen: ...`. Iteration ends when every choice has
    finished, after the first error delta (yielded), or when the client has gone
    (`disconnected`). Leaving the block aborts every backend request that has not ended,
    whatever the reason: disconnect, error, an exception or cancellation of the caller.
    """

    def __init__(
        self,
        backend: Backend,
        choices: list[Choice],
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
        self._ticket: Ticket | None = None
        self._queue: asyncio.Queue[ChoiceDelta] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._remaining = len(choices)
        self.failed = False
        self.disconnected = False

    async def __aenter__(self) -> Generation:
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
        for choice in self.choices:  # after the writes: a stream may end before its first one
            if choice.finish_reason is not None:
                self._metrics.observe_stages(choice.request.timing)
        assert self._ticket is not None, "left a generation that was never entered"
        self._ticket.release()
        self._metrics.in_flight.dec()

    def __aiter__(self) -> Generation:
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
                return await get_within(self._queue, DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await self._http.is_disconnected():
                    return None

    async def _pump(self, choice: Choice) -> None:
        try:
            await self._consume(choice)
        except Exception:  # any backend failure must reach the client as an error
            logger.exception("request %s failed", choice.request.request_id)
            if choice.finish_reason is None:  # one finishing delta per choice, never two
                # The log has the details; the client is not told the router's internals.
                self._queue.put_nowait(choice.fail("backend failure: the request was stopped"))

    async def _consume(self, choice: Choice) -> None:
        events = self._backend.generate(choice.request)
        clock = TokenClock(self._started)
        try:
            async for event in events:
                if isinstance(event, Tokens):
                    self._metrics.on_tokens(clock, len(event.token_ids))
                delta = choice.on_event(event)
                if delta.finish_reason is not None and not choice.backend_done:
                    await self._abort(choice)  # a stop string ended it before the backend did
                self._queue.put_nowait(delta)
                if delta.finish_reason is not None:
                    if delta.finish_reason != "error":
                        self._metrics.finished(clock)
                    return
            self._queue.put_nowait(choice.fail("backend stream ended without a finish reason"))
        finally:
            await aclose(events)

    async def _abort(self, choice: Choice) -> None:
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
