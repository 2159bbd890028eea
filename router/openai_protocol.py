"""Pydantic models of the OpenAI-compatible API: requests, responses, stream chunks, errors.

Requests are validated strictly (a string is not an int, 1.5 is not an int) but unknown fields
are ignored, as OpenAI clients send fields this server has no use for. Parameters whose
effect this server cannot honour (penalties, logit_bias, echo, ...) are accepted only at their
neutral value, so a client never silently gets a different sampling than it asked for.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from common.sampling_params import SamplingParams

MAX_N = 16  # choices per prompt: each one is a backend request holding its own KV blocks
MAX_LOGPROBS = 20
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _neutral_only(value: Any) -> Any:
    if value:
        raise ValueError("unsupported by this server: only 0, false or empty is accepted")
    return value


TokenId = Annotated[int, Field(ge=0)]
# A parameter this server cannot honour, accepted only at its neutral value.
Unsupported = AfterValidator(_neutral_only)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- requests


class StreamOptions(_Request):
    """OpenAI stream_options: include_usage adds a final chunk with the usage."""

    include_usage: bool = False


class BaseGenerationRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the served model, as vLLM allows
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM's extension: the generated ids in each choice
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: Annotated[float | None, Unsupported] = None
    frequency_penalty: Annotated[float | None, Unsupported] = None
    logit_bias: Annotated[dict[str, float] | None, Unsupported] = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> BaseGenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings; empty ones are dropped, since they would match at once."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stops if s)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @abstractmethod
    def logprobs_count(self) -> int | None:
        """Top alternatives per token to return (0: only the chosen one), None for no logprobs."""

    def sampling_params(self, max_tokens: int, seed: int | None) -> SamplingParams:
        """SamplingParams for one choice; raises ValueError for inconsistent values."""
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p or 0.0,
            seed=seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs_count(),
        )


Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(BaseGenerationRequest):
    """POST /v1/completions. Several prompts give n choices each, indexed prompt-major."""

    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Annotated[bool, Unsupported] = False
    suffix: Annotated[str | None, Unsupported] = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: Prompt) -> Prompt:
        if not value:
            raise ValueError("must not be empty")
        if isinstance(value, list) and any(isinstance(p, (str, list)) and not p for p in value):
            raise ValueError("must not contain an empty prompt")
        return value

    @model_validator(mode="after")
    def _best_of_is_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is unsupported: it must be omitted or equal n")
        return self

    def logprobs_count(self) -> int | None:
        return self.logprobs


class ContentPart(_Request):
    """One part of a message's content; only text parts are supported."""

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text" or self.text is None:
            raise ValueError(f"unsupported content part type {self.type!r}: only text")
        return self


class ChatMessage(_Request):
    """One chat message; a list of text parts is joined into one string."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def template_dict(self) -> dict[str, str]:
        """The message as the chat template expects it: role and content strings."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text or "" for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(BaseGenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[Any] | None, Unsupported] = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's newer name; it wins when both are given.
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Request):
    """POST /tokenize: either a prompt or chat messages (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Request):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


# ---------------------------------------------------------------- responses


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(_Response):
    """vLLM's error envelope: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)


class CompletionResponse(_Response):
    """A whole completion, or (object "text_completion" too) one stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(_Response):
    """A chat stream delta; fields left None are left out, so a final delta is {}."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pdserve"
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str
