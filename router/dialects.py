"""Response shapes: a dialect (completions or chat) turns choice deltas into one API's
stream chunks and final response, logprobs and usage included."""

from __future__ import annotations

import re
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import BaseModel

from pdserve.common.wire.payloads import TokenLogprobs
from pdserve.router.generation import Choice, ChoiceDelta, PromptPart
from pdserve.router.openai_protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    FunctionCall,
    FunctionCallDelta,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    ToolCallDelta,
    ToolCallResponse,
    UsageInfo,
)
from pdserve.router.tools import CallPiece, ToolCall, ToolMode, ToolStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# JSON has no -inf; vLLM reports impossible tokens with this floor too.
_MIN_LOGPROB = -9999.0


class TokenStrings:
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
class Collected:
    """A whole choice, gathered for a non-streaming response."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    prompt: PromptPart | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.prompt = delta.prompt or self.prompt
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.finish_reason = delta.finish_reason or self.finish_reason


class Dialect(ABC):
    """Shapes deltas into one API's stream chunks and final response."""

    prefix: str

    def __init__(
        self,
        model: str,
        tokens: TokenStrings,
        want_logprobs: bool,
        want_prompt_logprobs: bool = False,
    ) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self._want_prompt_logprobs = want_prompt_logprobs
        self.created = int(time.time())
        self.model = model
        self._tokens = tokens
        self._want_logprobs = want_logprobs

    def opening(self, num_choices: int) -> list[BaseModel]:
        """Chunks sent before any token."""
        return []

    @abstractmethod
    def chunk(self, delta: ChoiceDelta) -> BaseModel | None: ...  # None: nothing to send yet

    @abstractmethod
    def usage_chunk(self, usage: UsageInfo) -> BaseModel: ...

    def wants(self, delta: ChoiceDelta) -> bool:
        """Whether a delta without text still makes a chunk (its token ids were asked for)."""
        return False

    @abstractmethod
    def response(self, choices: list[Collected], usage: UsageInfo) -> BaseModel: ...

    def _prompt_logprobs(self, prompt: PromptPart | None) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs: null for the first token, then the token's own entry and
        the top N at each position."""
        if prompt is None or prompt.logprobs is None:
            return None
        out: PromptLogprobs = [None]
        for lp in prompt.logprobs:
            entry = {
                str(t): PromptLogprob(logprob=_logprob(v), decoded_token=self._tokens.text(t))
                for t, v in lp.top
            }
            rank = lp.rank or None
            entry[str(lp.token_id)] = PromptLogprob(
                logprob=_logprob(lp.logprob),
                rank=rank,
                decoded_token=self._tokens.text(lp.token_id),
            )
            for rank_in_top, (t, _) in enumerate(lp.top, start=1):
                if t != lp.token_id:
                    entry[str(t)].rank = rank_in_top
            out.append(entry)
        return out


class CompletionDialect(Dialect):
    prefix = "cmpl"

    def __init__(
        self,
        model: str,
        tokens: TokenStrings,
        logprobs: int | None,
        want_ids: bool = False,
        want_prompt_logprobs: bool = False,
    ) -> None:
        super().__init__(model, tokens, logprobs is not None, want_prompt_logprobs)
        self._top_n = logprobs or 0
        self._want_ids = want_ids
        self._offsets: dict[int, int] = {}  # text_offset reached by each streamed choice

    def wants(self, delta: ChoiceDelta) -> bool:
        return (self._want_ids and bool(delta.token_ids)) or delta.prompt is not None

    def chunk(self, delta: ChoiceDelta) -> BaseModel:
        choice = self._choice(
            delta.index, delta.prompt, delta.text, delta.logprobs, delta.token_ids
        )
        choice.finish_reason = delta.finish_reason
        return self._wrap([choice])

    def _choice(
        self,
        index: int,
        prompt: PromptPart | None,
        text: str,
        lps: list[TokenLogprobs] | tuple[TokenLogprobs, ...],
        token_ids: list[int] | tuple[int, ...],
    ) -> CompletionChoice:
        """One choice's text, logprobs and ids; the prompt's first when it is echoed."""
        echoed = prompt is not None and prompt.text is not None
        logprobs = self._logprobs(index, lps, prompt if echoed else None)
        return CompletionChoice(
            index=index,
            text=(prompt.text if echoed else "") + text,
            logprobs=logprobs,
            token_ids=list(token_ids) if self._want_ids else None,
            prompt_logprobs=self._prompt_logprobs(prompt) if self._want_prompt_logprobs else None,
        )

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return self._wrap([], usage)

    def response(self, choices: list[Collected], usage: UsageInfo) -> BaseModel:
        out = []
        for c in choices:
            choice = self._choice(c.index, c.prompt, "".join(c.text), c.logprobs, c.token_ids)
            choice.finish_reason = c.finish_reason
            out.append(choice)
        return self._wrap(out, usage)

    def _wrap(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> BaseModel:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _logprobs(
        self,
        index: int,
        lps: list[TokenLogprobs] | tuple[TokenLogprobs, ...],
        echoed: PromptPart | None = None,
    ) -> CompletionLogprobs | None:
        if not self._want_logprobs:
            return None
        offset = self._offsets.get(index, 0)
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        if echoed is not None and echoed.token_ids:
            # The prompt's tokens first: the first has no logprob (nothing precedes it).
            first = self._tokens.text(echoed.token_ids[0])
            out.tokens.append(first)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(first)
            prompt_lps = [
                TokenLogprobs(lp.token_id, lp.logprob, lp.top[: self._top_n])
                for lp in echoed.logprobs or ()
            ]
            lps = [*prompt_lps, *lps]
        for lp in lps:
            text = self._tokens.text(lp.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(_logprob(lp.logprob))
            out.top_logprobs.append({self._tokens.text(t): _logprob(v) for t, v in lp.top})
            out.text_offset.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return out


class ChatDialect(Dialect):
    """Chat completions. With tools, each choice's text goes through a `ToolStream`: content
    streams as content, tool calls as OpenAI's tool-call deltas (index, id and name first,
    then argument fragments), as soon as the parser knows them."""

    prefix = "chatcmpl"

    def __init__(
        self,
        model: str,
        tokens: TokenStrings,
        want_logprobs: bool,
        want_prompt_logprobs: bool = False,
        tools: ToolMode | None = None,
    ) -> None:
        super().__init__(model, tokens, want_logprobs, want_prompt_logprobs)
        self._tools = tools
        self._streams: dict[int, ToolStream] = {}  # each choice's parser, with tools
        self._called: set[int] = set()  # choices that streamed a tool call

    def _message(
        self, text: str, finish: str | None
    ) -> tuple[str | None, list[ToolCall], str | None]:
        """Content, tool calls and finish reason of a whole reply."""
        if self._tools is None:
            return text, [], finish
        content, calls = self._tools.parse(text, finish or "stop")
        return content, calls, _tool_finish(finish, bool(calls))

    def opening(self, num_choices: int) -> list[BaseModel]:
        # OpenAI's first delta of each choice names the role, before any content.
        role = DeltaMessage(role="assistant", content="")
        return [self._wrap([ChatStreamChoice(index=i, delta=role)]) for i in range(num_choices)]

    def chunk(self, delta: ChoiceDelta) -> BaseModel | None:
        if self._tools is not None:
            return self._tool_chunk(delta)
        choice = ChatStreamChoice(
            index=delta.index,
            delta=DeltaMessage(content=delta.text or None),
            logprobs=self._logprobs(delta.logprobs),
            finish_reason=delta.finish_reason,
        )
        return self._wrap([choice])

    def _tool_chunk(self, delta: ChoiceDelta) -> BaseModel | None:
        """What the choice's parser lets out of this delta (None: nothing to send yet)."""
        assert self._tools is not None
        stream = self._streams.setdefault(delta.index, ToolStream(self._tools))
        pieces = stream.feed(delta.text)
        finish = delta.finish_reason
        if finish is not None:
            pieces += stream.finish(finish)
            del self._streams[delta.index]
        content = "".join(p for p in pieces if isinstance(p, str))
        calls = [
            ToolCallDelta(
                index=p.index,
                id=p.id,
                type="function" if p.id else None,
                function=FunctionCallDelta(name=p.name, arguments=p.arguments),
            )
            for p in pieces
            if isinstance(p, CallPiece)
        ]
        if calls:
            self._called.add(delta.index)
        if not content and not calls and finish is None:
            return None
        if finish is not None:
            finish = _tool_finish(finish, delta.index in self._called)
        message = DeltaMessage(content=content or None, tool_calls=calls or None)
        choice = ChatStreamChoice(index=delta.index, delta=message, finish_reason=finish)
        return self._wrap([choice])

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return self._wrap([], usage)

    def response(self, choices: list[Collected], usage: UsageInfo) -> BaseModel:
        out = []
        for c in choices:
            content, calls, finish = self._message("".join(c.text), c.finish_reason)
            tool_calls = [
                ToolCallResponse(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments))
                for t in calls
            ]
            message = ChatResponseMessage(content=content, tool_calls=tool_calls)
            out.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._logprobs(c.logprobs),
                    finish_reason=finish,
                )
            )
        prompt = choices[0].prompt if choices and self._want_prompt_logprobs else None
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=out,
            usage=usage,
            prompt_logprobs=self._prompt_logprobs(prompt),
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


def _tool_finish(finish: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for a reply that stopped after calling; others keep theirs."""
    return "tool_calls" if called and finish == "stop" else finish


def usage_info(prompts: list[list[int]], choices: list[Choice]) -> UsageInfo:
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
