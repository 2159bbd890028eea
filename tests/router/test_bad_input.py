"""Bad input and overload at the router: every refusal has vLLM's error envelope, the right
status and a message that names the problem, and never reaches the backend."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pdserve.router.__main__ import parse_args
from pdserve.router.app import RouterLimits, create_app
from pdserve.router.errors import RETRY_AFTER_S
from pdserve.router.openai_protocol import (
    MAX_CHOICES,
    MAX_PROMPTS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
)
from tests.router.fake_backend import FakeBackend, assert_error, tiny_tokenizer

MODEL = "tiny-llama"
MAX_MODEL_LEN = 32
MAX_BYTES = 4096
COMPLETION = {"prompt": "Hello", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestTooLargeError"}
TYPES |= {405: "MethodNotAllowedError", 415: "UnsupportedMediaTypeError"}
TYPES |= {503: "ServiceUnavailableError", 500: "InternalServerError"}


@dataclass(frozen=True)
class Raw:
    """A body sent as these bytes, with this content type (None: no content-type header)."""

    data: bytes
    content_type: str | None = "application/json"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny_tokenizer()


@pytest.fixture()
def backend(tokenizer: Any) -> FakeBackend:
    return FakeBackend(len(tokenizer), tokenizer.eos_token_id, max_model_len=MAX_MODEL_LEN)


@pytest.fixture()
def client(backend: FakeBackend, tokenizer: Any) -> Iterator[TestClient]:
    app = create_app(backend, tokenizer, MODEL, limits=RouterLimits(max_request_bytes=MAX_BYTES))
    with TestClient(app) as client:
        yield client


def send(client: TestClient, path: str, body: Any, method: str = "POST") -> httpx.Response:
    if isinstance(body, Raw):
        headers = {"content-type": body.content_type} if body.content_type else {}
        return client.request(method, path, content=body.data, headers=headers)
    return client.request(method, path, json=body)


def check_refused(response: httpx.Response, status: int, fragment: str) -> dict[str, Any]:
    error = assert_error(response, status, fragment)
    assert error["type"] == TYPES[status]
    assert len(error["message"]) <= 1000
    if status == 503:
        assert response.headers["retry-after"] == str(RETRY_AFTER_S)
    return error


def case(path: str, body: Any, status: int, fragment: str, param: str | None = "", id: str = ""):
    """One table row: param "" means "not checked"."""
    return pytest.param(path, body, status, fragment, param, id=id or f"{path}:{fragment}")


C, CC = "/v1/completions", "/v1/chat/completions"
MESSAGE = {"role": "user", "content": "Hello"}
LONG_TEXT = " ".join(["cat"] * 60)  # more than MAX_MODEL_LEN tokens

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def NAMED(name: str) -> dict:  # noqa: N802 (reads as the value it builds)
    return {"type": "function", "function": {"name": name}}


GENERATION_CASES = [
    # wrong types
    case(C, {**COMPLETION, "max_tokens": "10"}, 400, "max_tokens", "max_tokens", "str-int"),
    case(C, {**COMPLETION, "max_tokens": 2.5}, 400, "max_tokens", "max_tokens", "float-int"),
    case(C, {**COMPLETION, "temperature": "hot"}, 400, "temperature", "temperature"),
    case(C, {**COMPLETION, "temperature": True}, 400, "temperature", "temperature", "bool-float"),
    case(C, {**COMPLETION, "n": 1.5}, 400, "n", "n"),
    case(C, {**COMPLETION, "stream": "yes"}, 400, "stream", "stream"),
    case(C, {**COMPLETION, "seed": "x"}, 400, "seed", "seed"),
    case(C, {**COMPLETION, "logprobs": True}, 400, "logprobs", "logprobs"),
    case(C, {**COMPLETION, "prompt": 5}, 400, "prompt: must be a non-empty string", "prompt"),
    case(C, {**COMPLETION, "prompt": [1, "a"]}, 400, "prompt.tokens.1", "prompt"),
    case(C, {**COMPLETION, "prompt": ["a", 1]}, 400, "prompt.texts.1", "prompt"),
    case(C, {**COMPLETION, "stop": 5}, 400, "stop: must be a string or a list", "stop"),
    case(C, {**COMPLETION, "stop": [1]}, 400, "stop.texts.0", "stop"),
    case(C, {**COMPLETION, "user": 5}, 400, "user", "user"),
    case(C, {**COMPLETION, "model": 5}, 400, "model", "model"),
    case(C, {**COMPLETION, "ignore_eos": "true"}, 400, "ignore_eos", "ignore_eos"),
    case(CC, {**CHAT, "messages": "Hello"}, 400, "messages", "messages", "chat-str-messages"),
    case(CC, {**CHAT, "messages": [{"role": 5, "content": "x"}]}, 400, "messages.0.role"),
    case(CC, {**CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    case(CC, {**CHAT, "logprobs": "yes"}, 400, "logprobs", "logprobs"),
    # out-of-range values
    case(C, {**COMPLETION, "temperature": -0.1}, 400, "temperature", "temperature", "temp<0"),
    case(C, {**COMPLETION, "top_p": 0}, 400, "top_p", "top_p", "top_p=0"),
    case(C, {**COMPLETION, "top_p": 1.01}, 400, "top_p", "top_p", "top_p>1"),
    case(C, {**COMPLETION, "n": 0}, 400, "n", "n", "n=0"),
    case(C, {**COMPLETION, "n": 17}, 400, "n", "n", "n=17"),
    case(C, {**COMPLETION, "max_tokens": 0}, 400, "max_tokens", "max_tokens", "max_tokens=0"),
    case(C, {**COMPLETION, "max_tokens": -5}, 400, "max_tokens", "max_tokens", "max_tokens<0"),
    case(C, {**COMPLETION, "logprobs": -1}, 400, "logprobs", "logprobs", "logprobs<0"),
    case(C, {**COMPLETION, "logprobs": 21}, 400, "logprobs", "logprobs", "logprobs>20"),
    case(C, {**COMPLETION, "top_k": -2}, 400, "top_k", "top_k", "top_k<-1"),
    case(C, {**COMPLETION, "top_k": 2**31}, 400, "top_k", "top_k", "top_k>int32"),
    case(C, {**COMPLETION, "min_p": 1.5}, 400, "min_p", "min_p"),
    case(C, {**COMPLETION, "seed": 2**63}, 400, "seed", "seed", "seed>int64"),
    case(C, {**COMPLETION, "min_tokens": -1}, 400, "min_tokens", "min_tokens", "min_tokens<0"),
    case(C, {**COMPLETION, "min_tokens": 9}, 400, "min_tokens", "min_tokens", "min>max"),
    case(C, Raw(b'{"prompt": "x", "temperature": NaN}'), 400, "finite", "temperature", "NaN"),
    case(C, Raw(b'{"prompt": "x", "top_p": Infinity}'), 400, "finite", "top_p", "Infinity"),
    case(C, Raw(b'{"prompt": "x", "temperature": 1e999}'), 400, "finite", "temperature", "1e999"),
    case(CC, {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    case(CC, {**CHAT, "top_logprobs": 2}, 400, "top_logprobs requires logprobs"),
    case(CC, {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    case(CC, {**CHAT, "n": 0}, 400, "n", "n", "chat-n=0"),
    # lengths and counts
    case(C, {**COMPLETION, "stop": ["x"] * (MAX_STOP_STRINGS + 1)}, 400, "at most 16", "stop"),
    case(C, {**COMPLETION, "stop": "x" * (MAX_STOP_CHARS + 1)}, 400, "at most 256", "stop"),
    case(C, {**COMPLETION, "stop": ["x" * (MAX_STOP_CHARS + 1)]}, 400, "stop.texts.0", "stop"),
    case(C, {**COMPLETION, "stop_token_ids": [5] * 257}, 400, "at most 256", "stop_token_ids"),
    case(C, {**COMPLETION, "prompt": ["a"] * (MAX_PROMPTS + 1)}, 400, "at most 64", "prompt"),
    case(C, {**COMPLETION, "prompt": ["a"] * 20, "n": 16}, 400, f"at most {MAX_CHOICES}"),
    # token ids outside the vocabulary, empty prompts
    case(C, {**COMPLETION, "prompt": [1, 100000]}, 400, "outside the vocabulary", "prompt"),
    case(C, {**COMPLETION, "prompt": [[1], [512]]}, 400, "token id 512", "prompt", "ids-lists"),
    case(C, {**COMPLETION, "prompt": [-1]}, 400, "prompt.tokens.0", "prompt", "negative-id"),
    case(C, {**COMPLETION, "stop_token_ids": [512]}, 400, "outside the vocab", "stop_token_ids"),
    case(C, {**COMPLETION, "stop_token_ids": [-1]}, 400, "stop_token_ids.0", "stop_token_ids"),
    case(C, {**COMPLETION, "prompt": ""}, 400, "prompt.text", "prompt", "empty-str"),
    case(C, {**COMPLETION, "prompt": []}, 400, "prompt.tokens", "prompt", "empty-list"),
    case(C, {**COMPLETION, "prompt": ["a", ""]}, 400, "prompt.texts.1", "prompt", "empty-item"),
    case(C, {**COMPLETION, "prompt": [[1], []]}, 400, "prompt.token_lists.1", "prompt"),
    case(C, {"max_tokens": 3}, 400, "prompt: Field required", "prompt", "no-prompt"),
    case(CC, {**CHAT, "messages": []}, 400, "messages", "messages", "no-messages"),
    case(CC, {"max_tokens": 3}, 400, "messages: Field required", "messages"),
    # over-long requests: the message states the limit and the rule
    case(C, {"prompt": LONG_TEXT}, 400, "maximum context length is 32 tokens", "prompt"),
    case(C, {"prompt": "Hi", "max_tokens": 40}, 400, "32 tokens", "max_tokens", "prompt+max"),
    case(CC, {"messages": [{"role": "user", "content": LONG_TEXT}]}, 400, "32 tokens", "messages"),
    case(CC, {**CHAT, "max_completion_tokens": 99}, 400, "Please reduce", "max_completion_tokens"),
    # unknown fields, and known ones at a value this server cannot honour
    case(C, {**COMPLETION, "max_token": 4}, 400, 'unknown field "max_token"', "max_token"),
    case(CC, {**CHAT, "foo": {"bar": 1}}, 400, 'unknown field "foo"', "foo"),
    case(CC, {**CHAT, "messages": [{**MESSAGE, "x": 1}]}, 400, 'unknown field "messages.0.x"'),
    case(C, {**COMPLETION, "stream": True, "stream_options": {"bogus": 1}}, 400, "bogus"),
    case(C, {**COMPLETION, "presence_penalty": 0.5}, 400, "unsupported", "presence_penalty"),
    case(C, {**COMPLETION, "frequency_penalty": -1}, 400, "only 0 or null", "frequency_penalty"),
    case(C, {**COMPLETION, "logit_bias": {"5": 10}}, 400, "only {} or null", "logit_bias"),
    case(C, {**COMPLETION, "max_tokens": 0}, 400, "needs echo or prompt_logprobs", "max_tokens"),
    case(C, {**COMPLETION, "prompt_logprobs": 21}, 400, "prompt_logprobs", "prompt_logprobs"),
    case(C, {**COMPLETION, "suffix": "x"}, 400, "unsupported", "suffix"),
    case(C, {**COMPLETION, "best_of": 3}, 400, "best_of"),
    case(C, {**COMPLETION, "repetition_penalty": 1.2}, 400, "only 1 or null"),
    case(CC, {**CHAT, "tools": [{"type": "function"}]}, 400, "tools.0.function", "tools"),
    case(CC, {**CHAT, "tool_choice": "required"}, 400, "tool_choice needs tools", "tools"),
    case(CC, {**CHAT, "tools": [TOOL], "tool_choice": NAMED("nope")}, 400, "'nope'", "tool_choice"),
    case(CC, {**CHAT, "tools": [TOOL, TOOL]}, 400, "must be unique", "tool_choice"),
    case(
        CC, {**CHAT, "tools": [{**TOOL, "function": {"name": "a b"}}]}, 400, "tools.0.function.name"
    ),
    case(
        CC,
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
        400,
        "tools.0.function.parameters",
    ),
    case(CC, {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    case(CC, {**CHAT, "response_format": {"type": "json_schema"}}, 400, "json_schema is required"),
    case(
        C,
        {**COMPLETION, "guided_regex": "a+", "guided_choice": ["a"]},
        400,
        "not guided_regex and guided_choice",
        "structured_outputs",
    ),
    case(C, {**COMPLETION, "structured_outputs": {"regex": "a", "grammar": "g"}}, 400, "exactly"),
    case(C, {**COMPLETION, "structured_outputs": {"tag": 1}}, 400, 'unknown field "structured'),
    case(C, {**COMPLETION, "structured_outputs": {"choice": []}}, 400, "structured_outputs"),
    case(C, {**COMPLETION, "guided_json": "{not json"}, 400, "not valid JSON"),
    case(C, {**COMPLETION, "guided_json": "[1]"}, 400, "must be a JSON schema"),
    case(CC, {**CHAT, "store": True}, 400, "unsupported", "store"),
    case(CC, {**CHAT, "messages": [{**MESSAGE, "tool_calls": [{"id": "1"}]}]}, 400, "tool_calls.0"),
    # unknown model
    case(C, {**COMPLETION, "model": "gpt-9"}, 404, "gpt-9", "model", "unknown-model"),
    case(CC, {**CHAT, "model": "gpt-9"}, 404, "`gpt-9` does not exist", "model"),
    case(C, {**COMPLETION, "model": "m" * 3000}, 404, "does not exist", "model", "long-model"),
    # nested junk
    case(C, {**COMPLETION, "prompt": [[[1]]]}, 400, "prompt.token_lists.0.0", "prompt"),
    case(C, {**COMPLETION, "prompt": [{"a": 1}]}, 400, "prompt", "prompt", "prompt-objects"),
    case(CC, {**CHAT, "messages": [[["user"]]]}, 400, "messages.0", "messages", "nested-lists"),
    case(
        CC,
        {**CHAT, "messages": [{"role": "user", "content": {"a": [1, {"b": None}]}}]},
        400,
        "messages.0.content: must be a string or a list",
    ),
    case(
        CC,
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages.0.content.parts.0.type",
    ),
    case(C, Raw(b'{"prompt": ' + b"[" * 300 + b"]" * 300 + b"}"), 400, "recursion limit"),
    case(C, {**COMPLETION, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    # the body itself: broken JSON, not an object, empty, wrong content type, too large
    case(C, Raw(b'{"prompt": "hi"'), 400, "malformed JSON body", None, "json-eof"),
    case(CC, Raw(b"{messages: 1}"), 400, "malformed JSON body", None, "json-key"),
    case(C, Raw(b'{"prompt": "hi",}'), 400, "malformed JSON body", None, "json-comma"),
    case(C, Raw(b"\xff\xfe\x00garbage"), 400, "malformed JSON body", None, "json-binary"),
    case(C, Raw(b'{"prompt": "\\ud800"}'), 400, "malformed JSON body", None, "json-surrogate"),
    case(C, Raw(b""), 400, "the request body is empty", None, "empty-body"),
    case(CC, Raw(b"  \n "), 400, "the request body is empty", None, "blank-body"),
    case(C, Raw(b"[1, 2]"), 400, "must be a JSON object", None, "json-array"),
    case(CC, Raw(b'"text"'), 400, "must be a JSON object", None, "json-string"),
    case(C, Raw(b"null"), 400, "must be a JSON object", None, "json-null"),
    case(C, Raw(b"prompt=hi", "application/x-www-form-urlencoded"), 415, "content type"),
    case(CC, Raw(json.dumps(CHAT).encode(), "text/plain"), 415, "'text/plain'"),
    case(C, Raw(b"--x\r\n", "multipart/form-data; boundary=x"), 415, "multipart/form-data"),
    case(C, Raw(json.dumps(COMPLETION).encode() + b" " * MAX_BYTES), 413, "limit is 4096 bytes"),
]

OTHER_CASES = [
    case("/tokenize", {}, 400, "exactly one of prompt or messages", None, "tokenize-nothing"),
    case("/tokenize", {"prompt": "x", "messages": [MESSAGE]}, 400, "exactly one"),
    case("/tokenize", {"prompt": 5}, 400, "prompt", "prompt", "tokenize-type"),
    case("/tokenize", {"prompt": "x", "extra": 1}, 400, 'unknown field "extra"', "extra"),
    case("/tokenize", {"prompt": "x", "model": "gpt-9"}, 404, "gpt-9", "model"),
    case("/tokenize", {"messages": [{"content": "x"}]}, 400, "messages.0.role", "messages"),
    case("/tokenize", Raw(b"{"), 400, "malformed JSON body", None, "tokenize-json"),
    case("/tokenize", Raw(b'{"prompt": "x"}', "text/plain"), 415, "content type"),
    case("/tokenize", Raw(b'{"prompt": "' + b"x" * MAX_BYTES + b'"}'), 413, "too large"),
    case("/detokenize", {"tokens": [512]}, 400, "outside the vocabulary", "tokens"),
    case("/detokenize", {"tokens": "abc"}, 400, "tokens", "tokens", "detokenize-type"),
    case("/detokenize", {"tokens": [-1]}, 400, "tokens.0", "tokens", "detokenize-negative"),
    case("/detokenize", {}, 400, "tokens: Field required", "tokens"),
    case("/detokenize", {"tokens": [5], "x": 1}, 400, 'unknown field "x"', "x"),
    case("/detokenize", {"tokens": [5], "model": "gpt-9"}, 404, "gpt-9", "model"),
    case("/detokenize", Raw(b"[5, 6]"), 400, "must be a JSON object", None, "detokenize-list"),
]


@pytest.mark.parametrize("path, body, status, fragment, param", GENERATION_CASES + OTHER_CASES)
def test_bad_input_gets_the_envelope_and_never_reaches_the_backend(
    client: TestClient,
    backend: FakeBackend,
    path: str,
    body: Any,
    status: int,
    fragment: str,
    param: str | None,
) -> None:
    error = check_refused(send(client, path, body), status, fragment)
    if param != "":
        assert error["param"] == param, error
    assert backend.requests == []


@pytest.mark.parametrize(
    "raw",
    [b"x" * 3000, b'{"prompt": "' + b"\x00\xff" * 1500 + b"\n" + b"y" * 1000],
    ids=["garbage", "binary"],
)
def test_broken_json_echoes_only_a_bounded_fragment(client: TestClient, raw: bytes) -> None:
    error = check_refused(send(client, C, Raw(raw)), 400, "malformed JSON body")
    assert len(error["message"]) < 500  # the quoted 64 bytes may be escaped
    assert "x" * 65 not in error["message"] and "y" * 65 not in error["message"]


@pytest.mark.parametrize(
    "method, path, status, allow",
    [
        ("GET", "/v1/nothing", 404, None),
        ("POST", "/v2/completions", 404, None),
        ("GET", "/v1/completions", 405, "POST"),
        ("PUT", "/tokenize", 405, "POST"),
        ("DELETE", "/v1/models", 405, "GET"),
        ("POST", "/health", 405, "GET"),
    ],
)
def test_unknown_routes_and_methods(
    client: TestClient, method: str, path: str, status: int, allow: str | None
) -> None:
    check_refused(client.request(method, path), status, path)
    if allow is not None:
        assert client.request(method, path).headers["allow"] == allow


def test_well_formed_neutral_values_of_unsupported_fields_are_accepted(
    client: TestClient, backend: FakeBackend
) -> None:
    neutral = {
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "user": "user-1",
        "stream": None,
        "repetition_penalty": 1,
    }
    assert send(client, C, {**COMPLETION, **neutral, "echo": False, "suffix": None}).is_success
    chat = {
        **CHAT,
        **neutral,
        "tools": [],
        "tool_choice": "none",
        "parallel_tool_calls": True,
        "response_format": {"type": "text"},
        "store": False,
        "metadata": {"k": "v"},
        "messages": [{**MESSAGE, "refusal": None, "tool_calls": []}],
    }
    response = send(client, CC, chat)
    assert response.status_code == 200, response.text
    assert len(backend.requests) == 2


def test_a_body_over_the_limit_is_refused_while_it_streams_in(
    client: TestClient, backend: FakeBackend
) -> None:
    sent = 0

    def chunks() -> Iterator[bytes]:  # no Content-Length: the size is only known as it comes
        nonlocal sent
        yield b'{"prompt": "'
        for _ in range(1000):
            sent += 1024
            yield b"x" * 1024
        yield b'"}'

    response = client.post(C, content=chunks(), headers={"content-type": "application/json"})
    check_refused(response, 413, "more than 4096 bytes")
    assert backend.requests == []


@pytest.mark.parametrize(
    "headers, incoming, status, fragment",
    [
        ([(b"content-length", b"ten")], {"type": "http.request", "body": b"{}"}, 400, "Length"),
        ([], {"type": "http.disconnect"}, 499, "client closed the request"),
    ],
    ids=["invalid-content-length", "client-left-during-upload"],
)
def test_what_no_http_client_library_sends(
    backend: FakeBackend,
    tokenizer: Any,
    headers: list[tuple[bytes, bytes]],
    incoming: dict,
    status: int,
    fragment: str,
) -> None:
    app = create_app(backend, tokenizer, MODEL)
    start, *body = asyncio.run(_raw_call(app, headers, incoming))
    assert start["status"] == status
    error = json.loads(b"".join(m.get("body", b"") for m in body))["error"]
    assert fragment in error["message"] and error["code"] == status
    assert backend.requests == []


async def _raw_call(app: FastAPI, headers: list[tuple[bytes, bytes]], incoming: dict) -> list[dict]:
    """Calls app as a server would, with headers no HTTP client library would send, and
    incoming as the first thing the client sends. Returns what the app sent."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": C,
        "raw_path": C.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    sent: list[dict] = []

    async def receive() -> dict:
        return incoming

    async def record(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, record)
    return sent


# ---------------------------------------------------------------- overload


@pytest.fixture()
def overload_app(backend: FakeBackend, tokenizer: Any) -> Callable[..., FastAPI]:
    """Factory: an app with these admission limits over backend."""

    def make(**limits: int) -> FastAPI:
        return create_app(backend, tokenizer, MODEL, limits=RouterLimits(**limits))

    return make


async def _burst(
    app: FastAPI, backend: FakeBackend, bodies: list[tuple[str, dict]], refused: int, held: int
) -> list[httpx.Response]:
    """Sends every body at once while the backend holds its requests; once `refused` of
    them were answered and `held` backend requests wait, lets the backend go on."""
    backend.gate = asyncio.Event()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        tasks = [asyncio.create_task(client.post(path, json=body)) for path, body in bodies]
        for _ in range(1000):
            if sum(t.done() for t in tasks) >= refused and len(backend.requests) >= held:
                break
            await asyncio.sleep(0.01)
        early = [t.result() for t in tasks if t.done()]
        assert len(early) == refused and len(backend.requests) == held
        assert all(r.status_code == 503 for r in early)  # at once, while the others wait
        backend.gate.set()
        return await asyncio.gather(*tasks)


def _finish_reason(response: httpx.Response) -> str:
    if response.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in response.text.split("\n\n") if line]
        assert lines[-1] == "data: [DONE]"
        return json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"]
    return response.json()["choices"][0]["finish_reason"]


def _check_overload(
    app: FastAPI, backend: FakeBackend, responses: list[httpx.Response], admitted: int, flag: str
) -> None:
    ok = [r for r in responses if r.status_code == 200]
    assert len(ok) == admitted
    assert all(_finish_reason(r) == "length" for r in ok)  # every admitted one ran to its end
    for response in responses:
        if response.status_code != 200:
            check_refused(response, 503, flag)
    assert backend.live == 0
    assert (app.state.admission.requests, app.state.admission.tokens) == (0, 0)


def test_requests_beyond_the_queue_bound_get_503_and_admitted_ones_finish(
    overload_app: Callable[..., FastAPI], backend: FakeBackend
) -> None:
    app = overload_app(max_queued_requests=4)
    streamed = (C, {**COMPLETION, "stream": True})
    bodies = [(C, COMPLETION), (CC, CHAT), streamed] * 4
    responses = asyncio.run(_burst(app, backend, bodies, refused=len(bodies) - 4, held=4))
    _check_overload(app, backend, responses, 4, "--max-queued-requests")


def test_choices_count_against_the_queue_bound(
    overload_app: Callable[..., FastAPI], backend: FakeBackend
) -> None:
    app = overload_app(max_queued_requests=4)
    bodies = [(C, {**COMPLETION, "n": 3}), (C, {**COMPLETION, "n": 2}), (C, COMPLETION)]
    responses = asyncio.run(_burst(app, backend, bodies, refused=1, held=4))
    assert [r.status_code for r in responses] == [200, 503, 200]
    _check_overload(app, backend, responses, 2, "this one adds 2")


def test_prompt_tokens_beyond_the_token_bound_get_503(
    overload_app: Callable[..., FastAPI], backend: FakeBackend, tokenizer: Any
) -> None:
    prompt = " ".join(["cat"] * 8)
    app = overload_app(max_queued_tokens=2 * len(tokenizer.encode(prompt)))
    bodies = [(C, {"prompt": prompt, "max_tokens": 4})] * 5
    responses = asyncio.run(_burst(app, backend, bodies, refused=3, held=2))
    _check_overload(app, backend, responses, 2, "--max-queued-tokens")


def test_a_full_router_refuses_before_reading_the_body(
    overload_app: Callable[..., FastAPI], backend: FakeBackend
) -> None:
    app = overload_app(max_queued_requests=1)
    app.state.admission.admit(1, 10)  # as if one request were in flight
    with TestClient(app) as client:
        for path in (C, CC):  # even broken JSON: refusing must cost less than reading
            check_refused(send(client, path, Raw(b"{broken")), 503, "--max-queued-requests")
        assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 200
    assert backend.requests == []


def test_a_request_over_the_token_bound_alone_is_admitted_when_idle(
    overload_app: Callable[..., FastAPI], backend: FakeBackend
) -> None:
    app = overload_app(max_queued_tokens=1, max_queued_requests=1)
    with TestClient(app) as client:
        response = client.post(C, json={**COMPLETION, "n": 3})
    assert response.status_code == 200 and len(response.json()["choices"]) == 3


def test_backend_without_a_route_gets_503_without_being_asked(
    client: TestClient, backend: FakeBackend
) -> None:
    backend.is_ready = False
    for path, body in ((C, COMPLETION), (CC, {**CHAT, "stream": True})):
        check_refused(send(client, path, body), 503, "no prefill/decode route")
    check_refused(client.get("/health"), 503, "no prefill/decode route")
    assert backend.requests == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_cluster_with_no_room_gives_503_not_500(
    client: TestClient, backend: FakeBackend, stream: bool
) -> None:
    backend.unavailable = "no decode node has room for this request"
    for path, body in ((C, COMPLETION), (CC, CHAT)):
        check_refused(send(client, path, {**body, "stream": stream}), 503, "has room")


def test_a_stream_that_fails_before_its_first_token_gets_a_500_status(
    client: TestClient, backend: FakeBackend
) -> None:
    backend.crash = "node crashed"  # not a capacity problem
    check_refused(send(client, CC, {**CHAT, "stream": True}), 500, "node crashed")


def test_router_limits_come_from_the_command_line() -> None:
    flags = ["--max-request-bytes", "10", "--max-queued-requests", "3", "--max-queued-tokens", "7"]
    assert parse_args(["--model", "m", *flags]).limits == RouterLimits(10, 3, 7)
    assert parse_args(["--model", "m"]).limits == RouterLimits()


def test_router_limits_are_validated() -> None:
    for name in ("max_request_bytes", "max_queued_requests", "max_queued_tokens"):
        with pytest.raises(ValueError, match=name):
            RouterLimits(**{name: 0})
