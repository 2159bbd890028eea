"""Pydantic models of the OpenAI-compatible API: requests, responses, stream chunks, errors.

Requests are validated strictly (a string is not an int, 1.5 is not an int, NaN is not a
number) and within bounds that keep one request's cost bounded (choices, prompts, stop strings).

Unknown fields: a field this server does not know is refused (400 naming it) rather than
ignored, so a misspelt `max_token` or a feature we lack never silently changes the answer.
The standard OpenAI fields (and a few of vLLM's) that this server cannot honour are still
accepted at their neutral value (`presence_penalty: 0`, `logit_bias: {}`, `tools: []`,
`user: "..."`, null for any of them), since clients and SDKs send them routinely; any other
value of them is refused with 400, so a client never gets a different sampling than it asked
for. The same rule holds inside chat messages, where clients echo back the fields of an
earlier response (`refusal`, `tool_calls`, ...).
"""

from __future__ import annotations

import json
import time
from abc import abstractmethod
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    WithJsonSchema,
    model_serializer,
    model_validator,
)

from pdserve.common.wire.payloads import SamplingParams, StructuredOutputsParams
from pdserve.router.tools import Function, ToolMode

MAX_N = 16  # choices per prompt: each one is a backend request holding its own KV blocks
MAX_PROMPTS = 64  # prompts in one completions request
MAX_CHOICES = 256  # prompts x n: backend requests one HTTP request may start
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # the stop-string matcher's work per token grows with the longest one
MAX_STOP_TOKEN_IDS = 256
MAX_CHOICE_STRINGS = 256  # structured_outputs.choice alternatives
MAX_GRAMMAR_CHARS = 64 * 1024  # a regex, an EBNF grammar or a JSON schema's text
_INT32_MAX = 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def Neutral(*values: Any) -> Any:  # capitalized: it is used as a type annotation
    """Annotated metadata of a parameter this server cannot honour: only null or one of
    values (its neutral ones) is accepted, and the schema says so."""
    shown = " or ".join(json.dumps(v) for v in (*values, None))

    def check(value: Any) -> Any:
        if value is not None and value not in values:
            raise ValueError(f"unsupported by this server: only {shown} is accepted")
        return value

    return Annotated[Any, AfterValidator(check), WithJsonSchema({"enum": [*values, None]})]


def _shape(value: Any, empty: str) -> str | None:
    """The member of a string-or-list union that value's JSON shape asks for (empty: the one
    for an empty list), so a wrong value gets one precise error, not one per member."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    if not value:
        return empty
    if isinstance(value[0], str):
        return "texts"
    if isinstance(value[0], list):
        return "token_lists"
    if isinstance(value[0], dict):
        return "parts"
    return "tokens"


TokenId = Annotated[int, Field(ge=0)]
RequestId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]
Prompt = Annotated[
    Annotated[Text, Tag("text")]
    | Annotated[list[Text], Tag("texts"), Field(min_length=1, max_length=MAX_PROMPTS)]
    | Annotated[TokenIds, Tag("tokens")]
    | Annotated[list[TokenIds], Tag("token_lists"), Field(min_length=1, max_length=MAX_PROMPTS)],
    Discriminator(
        lambda v: _shape(v, "tokens"),
        custom_error_type="prompt_type",
        custom_error_message="must be a non-empty string, list of strings, list of token ids "
        "or list of token id lists",
    ),
]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Stop = Annotated[
    Annotated[StopString, Tag("text")]
    | Annotated[list[StopString], Tag("texts"), Field(max_length=MAX_STOP_STRINGS)],
    Discriminator(
        lambda v: "text" if isinstance(v, str) else "texts" if isinstance(v, list) else None,
        custom_error_type="stop_type",
        custom_error_message="must be a string or a list of strings",
    ),
]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- requests


class StreamOptions(_Request):
    """OpenAI stream_options: include_usage adds a final chunk with the usage; vLLM's
    continuous_usage_stats (with include_usage) puts the usage so far on every chunk too."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


GrammarText = Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]
Choices = Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICE_STRINGS)]
JsonSchema = dict[str, Any] | GrammarText  # a schema object, or its JSON text


class JsonSchemaFormat(_Request):
    """OpenAI response_format.json_schema: a named schema the output must follow."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced here


class ResponseFormat(_Request):
    """OpenAI response_format: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only then')
        return self


class StructuredOutputsRequest(_Request):
    """vLLM's structured_outputs: exactly one constraint."""

    json_: JsonSchema | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: GrammarText | None = None
    choice: Choices | None = None
    grammar: GrammarText | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class BaseGenerationRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the served model, as vLLM allows
    max_tokens: int | None = Field(None, ge=0)  # 0: score the prompt (with echo/prompt_logprobs)
    min_tokens: int = Field(0, ge=0)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=_INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM's extension: the generated ids in each choice
    # pdserve's, in the way of return_token_ids: each choice's TTFT and its stages ("metrics")
    return_metrics: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # the client's end-user id: no effect on the answer
    # Accepted at their neutral value only (see the module docstring).
    presence_penalty: Neutral(0) = None
    frequency_penalty: Neutral(0) = None
    repetition_penalty: Neutral(1) = None
    logit_bias: Neutral({}) = None
    include_stop_str_in_output: Neutral(False) = None
    spaces_between_special_tokens: Neutral(True) = None
    # vLLM's: the logprob of every prompt token and the top N at its position.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    truncate_prompt_tokens: Neutral() = None
    priority: Neutral(0) = None
    use_beam_search: Neutral(False) = None
    length_penalty: Neutral(1) = None
    allowed_token_ids: Neutral() = None
    bad_words: Neutral([]) = None
    logits_processors: Neutral([]) = None
    return_tokens_as_token_ids: Neutral(False) = None
    cache_salt: Neutral() = None
    kv_transfer_params: Neutral() = None  # vLLM's P/D proxy fields: pdserve routes its own
    vllm_xargs: Neutral({}) = None
    mm_processor_kwargs: Neutral({}) = None
    # vLLM's: the response id is "<cmpl|chatcmpl>-<request_id>" (internal ids stay unique).
    request_id: RequestId | None = None
    best_of: int | None = None  # only equal to n: one sample per choice here
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, and vLLM's
    # older guided_* fields; at most one constraint in all (see structured_outputs_params).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: JsonSchema | None = None
    guided_regex: GrammarText | None = None
    guided_choice: Choices | None = None
    guided_grammar: GrammarText | None = None
    guided_decoding_backend: Neutral("xgrammar", "auto") = None  # xgrammar is the one here
    guided_whitespace_pattern: Neutral() = None
    structural_tag: Neutral() = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> BaseGenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is unsupported: it must be omitted or equal n")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (vLLM's rule: only together with include_usage)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings; empty ones are dropped, since they would match at once."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stops if s)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def max_tokens_param(self) -> str:
        """The field that set requested_max_tokens(), for error messages."""
        return "max_tokens"

    @abstractmethod
    def logprobs_count(self) -> int | None:
        """Top alternatives per token to return (0: only the chosen one), None for no logprobs."""

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one output constraint the request sets, wherever it sets it; ValueError naming
        the fields when it sets several (or a structured_outputs with several in it)."""
        found: dict[str, dict[str, Any]] = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found["response_format"] = {"json_object": True}
        elif fmt is not None and fmt.json_schema is not None:
            found["response_format"] = {"json": fmt.json_schema.schema_}
        if self.structured_outputs is not None:
            given = self.structured_outputs.model_dump(exclude_none=True, exclude_defaults=True)
            found["structured_outputs"] = {k.rstrip("_"): v for k, v in given.items()}
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                found[f"guided_{name}"] = {name: value}
        if len(found) > 1:
            raise ValueError(
                f"structured_outputs takes one output constraint, not {' and '.join(found)}"
            )
        if not found:
            return None
        (fields,) = found.values()
        if fields.get("json_object") is False:
            fields.pop("json_object")
        return StructuredOutputsParams(**fields)

    def prompt_logprobs_count(self) -> int | None:
        """Top alternatives per prompt token to compute (None: no prompt logprobs)."""
        return self.prompt_logprobs

    def sampling_params(
        self,
        max_tokens: int,
        seed: int | None,
        forced: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """SamplingParams for one choice; raises ValueError for inconsistent values.
        `forced`: the constraint of a forced tool call (never with another constraint)."""
        constraint = self.structured_outputs_params()
        if forced is not None:
            if constraint is not None:
                raise ValueError("structured_outputs cannot be combined with a forced tool_choice")
            constraint = forced
        return SamplingParams(
            prompt_logprobs=self.prompt_logprobs_count(),
            structured_outputs=constraint,
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


class CompletionRequest(BaseGenerationRequest):
    """POST /v1/completions. Several prompts give n choices each, indexed prompt-major."""

    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool = True  # vLLM's extension: BOS and the like around the prompt
    echo: bool | None = False  # the prompt before the completion (and its logprobs)
    suffix: Neutral("") = None
    prompt_embeds: Neutral() = None

    @model_validator(mode="after")
    def _bounded_choices(self) -> CompletionRequest:
        single = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        prompts = 1 if single else len(self.prompt)
        if prompts * self.n > MAX_CHOICES:
            raise ValueError(
                f"{prompts} prompts x n={self.n} make {prompts * self.n} choices; "
                f"at most {MAX_CHOICES} are allowed per request"
            )
        return self

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_count(self) -> int | None:
        # echo with logprobs scores the prompt too: the larger of the two asks.
        asks = [self.prompt_logprobs, self.logprobs if self.echo else None]
        if self.echo and self.requested_max_tokens() == 0:
            asks.append(0)  # echo of a prompt alone: it must still be computed
        given = [n for n in asks if n is not None]
        return max(given) if given else None


class ContentPart(_Request):
    """One part of a message's content; only text parts are supported."""

    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionParam(_Request):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # forced calls always follow the schema here


class ToolParam(_Request):
    type: Literal["function"]
    function: FunctionParam


class FunctionRef(_Request):
    name: FunctionName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionRef


class CalledFunction(_Request):
    name: str
    arguments: str  # JSON text


class ToolCallParam(_Request):
    """A tool call of an earlier assistant message, as clients send it back."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Request):
    """One chat message; a list of text parts is joined into one string."""

    role: str
    content: (
        Annotated[
            Annotated[str, Tag("text")] | Annotated[list[ContentPart], Tag("parts")],
            Discriminator(
                lambda v: _shape(v, "parts") if isinstance(v, (str, list)) else None,
                custom_error_type="content_type",
                custom_error_message="must be a string or a list of content parts",
            ),
        ]
        | None
    ) = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # Fields of an earlier response that clients send back: only empty ones.
    refusal: Neutral("") = None
    function_call: Neutral() = None
    audio: Neutral() = None
    annotations: Neutral([]) = None
    reasoning_content: Neutral("") = None

    def template_dict(self) -> dict[str, str]:
        """The message as the chat template expects it: role and content strings."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            # Templates take arguments as a mapping (they write it with tojson).
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function)},
                }
                for c in self.tool_calls
            ]
        return message


def _arguments(fn: CalledFunction) -> Any:
    try:
        return json.loads(fn.arguments)
    except ValueError:
        return fn.arguments


class ChatCompletionRequest(BaseGenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM's extension
    tools: list[ToolParam] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # the model may call several: no effect here
    # OpenAI fields this server cannot honour: neutral values only (see the module docstring).
    functions: Neutral([]) = None
    function_call: Neutral("none", "auto") = None
    modalities: Neutral(["text"]) = None
    store: Neutral(False) = None
    metadata: dict[str, str] | None = None  # stored with the completion by OpenAI: no effect
    service_tier: Neutral("auto", "default") = None
    reasoning_effort: Neutral() = None
    audio: Neutral() = None
    prediction: Neutral() = None
    web_search_options: Neutral() = None
    echo: Neutral(False) = None
    add_special_tokens: Neutral(False) = None
    # vLLM's: the last (assistant) message stays open and the model continues it.
    continue_final_message: bool = False
    chat_template: Neutral() = None  # a client's own Jinja template is not run here
    # vLLM's: variables for the chat template (e.g. Qwen3's enable_thinking), and documents
    # for templates that render them (RAG).
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = Field(None, max_length=64)
    include_reasoning: bool = True  # no reasoning parser here: the text is content either way

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:  # 0 is vLLM's default: sent as such
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true "
                "(set add_generation_prompt to false)"
            )
        return self

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's newer name; it wins when both are given.
        return self.max_completion_tokens or self.max_tokens

    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_mode(self, parser: str) -> ToolMode | None:
        """What to do with tools (None: no tools, or tool_choice "none"); ValueError when
        tool_choice names a function that is not in tools, or names repeat."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none", "auto"):
                raise ValueError("tool_choice needs tools: no tools were given")
            return None
        if choice == "none":
            return None
        functions = tuple(
            Function(t.function.name, t.function.description, t.function.parameters)
            for t in self.tools
        )
        names = [f.name for f in functions]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names the function {choice.function.name!r}, "
                    f"which is not in tools ({', '.join(names)})"
                )
            return ToolMode(functions, "function", parser, choice.function.name)
        return ToolMode(functions, choice or "auto", parser)


class TokenizeRequest(_Request):
    """POST /tokenize: either a prompt or chat messages (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: Neutral(False) = None

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
    """OpenAI's; with echo the prompt's entries come first, the first token's null."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(_Response):
    """vLLM's entry of prompt_logprobs: one token's logprob, rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# Per prompt token: null for the first, else {token id: its entry} for the prompt's token and
# the top N at that position.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=lambda v: v is None)


class RequestMetrics(_Response):
    """One choice's time to first token and its stages in seconds (router/cluster/timing.py),
    when the request asked (return_metrics): in the body, or on the stream chunk that ends the
    choice.
    A stage list is null when its stages did not run (no KV moved) or did not report."""

    index: int
    time_to_first_token: float | None
    ttft_stages: dict[str, float] | None
    handoff_stages: dict[str, float] | None


Metrics = list[RequestMetrics] | None
_NO_METRICS = Field(None, exclude_if=lambda v: v is None)


class CompletionResponse(_Response):
    """A whole completion, or (object "text_completion" too) one stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    metrics: Metrics = _NO_METRICS


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text


class ToolCallResponse(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _Sparse(_Response):
    """Streamed pieces leave out what they do not carry, as OpenAI's do."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCallDelta(_Sparse):
    name: str | None = None
    arguments: str


class ToolCallDelta(_Sparse):
    """A piece of a streamed tool call: a call's first piece has its id, type and name, and
    every piece a fragment of its arguments (clients join them by index)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallResponse] = Field(default_factory=list)


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
    # vLLM's, with prompt_logprobs (one prompt for all choices)
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=lambda v: v is None)
    metrics: Metrics = _NO_METRICS


class DeltaMessage(_Response):
    """A chat stream delta; fields left None are left out, so a final delta is {}."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

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
    metrics: Metrics = _NO_METRICS


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
