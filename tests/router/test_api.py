"""The router's HTTP API against FakeBackend: every route, streaming and not, errors."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pdserve.common.wire.messages import Error, Failure, Tokens
from pdserve.router.app import RouterLimits, create_app
from pdserve.router.backend import GenerateRequest
from pdserve.router.generation import Generation, StopStringMatcher
from tests.router.fake_backend import FakeBackend, assert_error, tiny_tokenizer

MODEL = "tiny-llama"
TEXT = " the cat sat on the mat"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny_tokenizer()


def make_backend(tokenizer: Any, **kwargs: Any) -> FakeBackend:
    return FakeBackend(len(tokenizer), tokenizer.eos_token_id, **kwargs)


@pytest.fixture()
def make_client(tokenizer: Any) -> Iterator[Callable[..., TestClient]]:
    """Factory: make_client(backend=None, api_key=None) -> a TestClient of a fresh app."""
    with ExitStack() as stack:

        def make(backend: FakeBackend | None = None, api_key: str | None = None) -> TestClient:
            backend = backend or make_backend(tokenizer)
            app = create_app(backend, tokenizer, MODEL, api_key=api_key)
            return stack.enter_context(TestClient(app))  # runs the app's lifespan

        yield make


@pytest.fixture()
def scripted(tokenizer: Any) -> tuple[FakeBackend, str]:
    """A backend that answers the prompt "Once" with TEXT, one token per event."""
    prompt_ids = tuple(tokenizer.encode("Once"))
    backend = make_backend(tokenizer, outputs={prompt_ids: tokenizer.encode(TEXT)})
    return backend, "Once"


def sse_payloads(body: str) -> list[dict[str, Any]]:
    """The JSON payloads of an SSE body, which must end with [DONE]."""
    lines = [line for line in body.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines), body
    assert lines[-1] == "data: [DONE]", body
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def streamed_text(payloads: list[dict[str, Any]], index: int = 0) -> str:
    return "".join(
        c.get("text") or c.get("delta", {}).get("content") or ""
        for p in payloads
        for c in p["choices"]
        if c["index"] == index
    )


def test_router_api_imports_no_torch() -> None:
    # The router process must stay free of torch model code (DESIGN.md).
    code = "import sys, pdserve.router.app; sys.exit('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=root)


# ---------------------------------------------------------------- simple routes


def test_models_lists_the_served_model(make_client: Callable[..., TestClient]) -> None:
    body = make_client().get("/v1/models").json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [
        (MODEL, "model", 256)
    ]


def test_health_follows_backend_readiness(make_client: Callable[..., TestClient], tokenizer: Any):
    backend = make_backend(tokenizer)
    client = make_client(backend)
    assert client.get("/health").json() == {"status": "ok"}
    backend.is_ready = False
    assert_error(client.get("/health"), 503)


def test_tokenize_prompt_and_messages(make_client: Callable[..., TestClient], tokenizer: Any):
    client = make_client()
    body = client.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert body["tokens"] == tokenizer.encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    messages = [{"role": "user", "content": "hi"}]
    body = client.post("/tokenize", json={"messages": messages}).json()
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert body["tokens"] == list(expected)
    assert_error(client.post("/tokenize", json={}), 400, "exactly one of prompt or messages")


def test_detokenize(make_client: Callable[..., TestClient], tokenizer: Any) -> None:
    client = make_client()
    ids = tokenizer.encode("Hello world")
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "Hello world"}
    assert_error(client.post("/detokenize", json={"tokens": [len(tokenizer)]}), 400, "vocab")
    assert_error(client.post("/detokenize", json={"tokens": ["a"]}), 400, "tokens.0")


def test_metrics_count_requests_tokens_and_latency(
    make_client: Callable[..., TestClient], tokenizer: Any
) -> None:
    backend = make_backend(tokenizer)
    backend.gauges = {"decode_nodes": 2.0, "kv usage": 0.5}
    client = make_client(backend)
    body = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5}).json()
    client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": "x"})
    text = client.get("/metrics").text
    prompt_len = body["usage"]["prompt_tokens"]
    for line in (
        'pdserve_router_requests_total{route="/v1/completions",status="200"} 1.0',
        'pdserve_router_requests_total{route="/v1/completions",status="400"} 1.0',
        f"pdserve_router_prompt_tokens_total {float(prompt_len)}",
        "pdserve_router_generation_tokens_total 5.0",
        "pdserve:time_to_first_token_seconds_count 1.0",
        "pdserve:e2e_request_latency_seconds_count 1.0",
        "pdserve:request_time_per_output_token_seconds_count 1.0",
        "pdserve:request_decode_time_seconds_count 1.0",
        "pdserve_router_requests_in_flight 0.0",
        "pdserve_backend_decode_nodes 2.0",
        "pdserve_backend_kv_usage 0.5",
    ):
        assert line in text.splitlines(), line


# ---------------------------------------------------------------- completions


def test_completion_returns_the_backend_tokens_as_text(
    make_client: Callable[..., TestClient], tokenizer: Any
) -> None:
    backend = make_backend(tokenizer)
    body = make_client(backend).post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 7}
    )
    body = body.json()
    (request,) = backend.requests
    expected = backend.expected_tokens(request)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert request.request_id == body["id"]
    assert body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice == {
        "index": 0,
        "text": tokenizer.decode(expected, skip_special_tokens=True),
        "logprobs": None,
        "finish_reason": "length",
    }
    assert body["usage"] == {
        "prompt_tokens": len(request.prompt_token_ids),
        "completion_tokens": 7,
        "total_tokens": len(request.prompt_token_ids) + 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_streamed_completion_equals_the_whole_one(
    make_client: Callable[..., TestClient], tokenizer: Any
) -> None:
    client = make_client(make_backend(tokenizer, eos_at=9))
    request = {"prompt": "Hello", "max_tokens": 20, "seed": 3}
    whole = client.post("/v1/completions", json=request).json()
    response = client.post("/v1/completions", json={**request, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(response.text)
    assert streamed_text(payloads) == whole["choices"][0]["text"]
    assert [p["choices"][0]["finish_reason"] for p in payloads][-1] == "stop"
    assert all("usage" not in p for p in payloads)
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] == 10  # EOS at step 9 counts


def test_prompt_forms_and_n_give_prompt_major_choices(
    make_client: Callable[..., TestClient], tokenizer: Any
) -> None:
    backend = make_backend(tokenizer)
    client = make_client(backend)
    a, b = tokenizer.encode("Hello"), tokenizer.encode("Good night")
    for prompt in (["Hello", "Good night"], [a, b]):
        backend.requests.clear()
        body = client.post(
            "/v1/completions", json={"prompt": prompt, "n": 2, "max_tokens": 3, "seed": 10}
        ).json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        rid = body["id"]
        by_id = {r.request_id: r for r in backend.requests}
        assert sorted(by_id) == [f"{rid}-{i}" for i in range(4)]
        assert [list(by_id[f"{rid}-{i}"].prompt_token_ids) for i in range(4)] == [a, a, b, b]
        assert [by_id[f"{rid}-{i}"].sampling.seed for i in range(4)] == [10, 11, 10, 11]
        assert body["usage"]["prompt_tokens"] == len(a) + len(b)  # each prompt once
        assert body["usage"]["completion_tokens"] == 12
    body = client.post("/v1/completions", json={"prompt": a, "max_tokens": 2}).json()
    assert backend.requests[-1].prompt_token_ids == tuple(a)


def test_n2_streaming_interleaves_two_choices(
    make_client: Callable[..., TestClient], tokenizer: Any
) -> None:
    backend = make_backend(tokenizer)
    client = make_client(backend)
    request = {"prompt": "Hello", "n": 2, "max_tokens": 6, "seed": 1}
    whole = client.post("/v1/completions", json=request).json()
    payloads = sse_payloads(client.post("/v1/completions", json={**request, "stream": True}).text)
    for index in (0, 1):
        assert streamed_text(payloads, index) == whole["choices"][index]["text"]
    assert whole["choices"][0]["text"] != whole["choices"][1]["text"]  # seeds 1 and 2
    finishes = [c for p in payloads for c in p["choices"] if c["finish_reason"]]
    assert sorted(c["index"] for c in finishes) == [0, 1]


def test_sampling_fields_reach_the_backend(
    make_client: Callable[..., TestClient], tokenizer: Any
) -> None:
    backend = make_backend(tokenizer)
    fields = {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "min_p": 0.1,
        "seed": 42,
        "min_tokens": 2,
        "stop_token_ids": [9, 10],
        "ignore_eos": True,
        "presence_penalty": 0,
        "user": "someone",
        "logit_bias": {},
    }
    response = make_client(backend).post(
        "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, **fields}
    )
    assert response.status_code == 200, response.text
    sampling = backend.requests[0].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (
        0.5,
        0.9,
        7,
        0.1,
    )
    assert (sampling.seed, sampling.min_tokens, sampling.max_tokens) == (42, 2, 4)
    assert sampling.stop_token_ids == (9, 10) and sampling.ignore_eos
    assert sampling.logprobs is None


@pytest.mark.parametrize(
    "extra, tokens, finish",
    [({}, 3, "stop"), ({"ignore_eos": True}, 8, "length"), ({"min_tokens": 5}, 8, "length")],
)
def test_eos_ends_generation_unless_ignored_or_too_early(
    make_client: Callable[..., TestClient],
    tokenizer: Any,
    extra: dict[str, Any],
    tokens: int,
    finish: str,
) -> None:
    client = make_client(make_backend(tokenizer, eos_at=2))
    body = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 8, **extra}).json()
    assert body["usage"]["completion_tokens"] == tokens
    assert body["choices"][0]["finish_reason"] == finish


def test_stop_token_ids_end_generation(
    make_client: Callable[..., TestClient], tokenizer: Any, scripted: tuple[FakeBackend, str]
) -> None:
    backend, prompt = scripted
    stop_id = tokenizer.encode(TEXT)[3]
    body = {"prompt": prompt, "max_tokens": 20, "stop_token_ids": [stop_id]}
    choice = make_client(backend).post("/v1/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == tokenizer.decode(tokenizer.encode(TEXT)[:4])


def test_omitted_max_tokens_takes_the_remaining_room(
    make_client: Callable[..., TestClient], tokenizer: Any
) -> None:
    backend = make_backend(tokenizer, max_model_len=40, eos_at=3)
    make_client(backend).post("/v1/completions", json={"prompt": "Hello"})
    request = backend.requests[0]
    assert request.sampling.max_tokens == 40 - len(request.prompt_token_ids)


def test_cached_tokens_reach_usage(make_client: Callable[..., TestClient], tokenizer: Any):
    client = make_client(make_backend(tokenizer, cached_tokens=2))
    body = client.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": 3})
    assert body.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_include_usage_adds_a_final_usage_chunk(
    make_client: Callable[..., TestClient], tokenizer: Any
) -> None:
    client = make_client(make_backend(tokenizer, cached_tokens=1))
    for path, body in (
        ("/v1/completions", {"prompt": "Hello"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
    ):
        body = {**body, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
        payloads = sse_payloads(client.post(path, json=body).text)
        *chunks, last = payloads
        assert all(p["usage"] is None for p in chunks)
        assert last["choices"] == []
        assert last["usage"]["completion_tokens"] == 4
        assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
        assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 4


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(
    make_client: Callable[..., TestClient], tokenizer: Any
) -> None:
    """GuideLLM's streamed requests, field for field: usage grows chunk by chunk; without
    include_usage, continuous_usage_stats adds nothing (vLLM's rule)."""
    client = make_client(make_backend(tokenizer))
    guidellm = {
        "max_completion_tokens": 5,
        "max_tokens": 5,
        "stop": None,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    for path, body in (
        ("/v1/completions", {"prompt": "Hello", **guidellm}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], **guidellm}),
    ):
        if path == "/v1/completions":
            body.pop("max_completion_tokens")
        response = client.post(path, json=body)
        assert response.status_code == 200, response.text
        *chunks, last = sse_payloads(response.text)
        counted = [p["usage"]["completion_tokens"] for p in chunks if p["usage"] is not None]
        assert counted == sorted(counted) and counted[-1] == 5, counted
        assert all(p["usage"]["prompt_tokens"] > 0 for p in chunks if p["usage"] is not None)
        assert last["usage"]["completion_tokens"] == 5
        options = {"include_usage": False, "continuous_usage_stats": True}
        plain = client.post(path, json={**body, "stream_options": options})
        assert all(p.get("usage") is None for p in sse_payloads(plain.text))


# ---------------------------------------------------------------- stop strings


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "stop, min_tokens, text, finish",
    [
        ("cat", 0, " the ", "stop"),  # "cat" spans the tokens " c" and "at"
        (["zzz", " sat"], 0, " the cat", "stop"),
        ("the", 3, " the cat sat on ", "stop"),  # the first "the" comes before min_tokens
        (["mat!"], 0, TEXT, "length"),  # a held-back "mat" is flushed at the end
    ],
)
def test_stop_strings(
    make_client: Callable[..., TestClient],
    tokenizer: Any,
    scripted: tuple[FakeBackend, str],
    stop: str | list[str],
    min_tokens: int,
    text: str,
    finish: str,
    stream: bool,
) -> None:
    backend, prompt = scripted
    max_tokens = len(tokenizer.encode(TEXT))
    body = {"prompt": prompt, "max_tokens": max_tokens, "stop": stop, "stream": stream}
    response = make_client(backend).post("/v1/completions", json={**body, "min_tokens": min_tokens})
    if stream:
        payloads = sse_payloads(response.text)
        assert streamed_text(payloads) == text
        assert payloads[-1]["choices"][0]["finish_reason"] == finish
    else:
        (choice,) = response.json()["choices"]
        assert (choice["text"], choice["finish_reason"]) == (text, finish)
    rid = backend.requests[0].request_id
    assert backend.aborted == ([rid] if finish == "stop" else [])


def test_stop_string_text_is_never_streamed(
    make_client: Callable[..., TestClient], tokenizer: Any, scripted: tuple[FakeBackend, str]
) -> None:
    backend, prompt = scripted
    body = {"prompt": prompt, "max_tokens": 20, "stop": "cat", "stream": True}
    payloads = sse_payloads(make_client(backend).post("/v1/completions", json=body).text)
    pieces = [p["choices"][0]["text"] for p in payloads]
    assert not any("c" in piece for piece in pieces), pieces


def _reference_stop(text: str, stops: list[str]) -> str:
    """text cut before the stop string that a generator completes first."""
    for end in range(len(text) + 1):
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            return text[: min(starts)]
    return text


def test_stop_matcher_equals_a_search_of_the_whole_text() -> None:
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice("abc ") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abc ") for _ in range(rng.randint(1, 4))) for _ in range(2)]
        matcher, out, hit = StopStringMatcher(tuple(stops)), "", False
        start = 0
        while start < len(text) and not hit:
            size = rng.randint(0, 4)
            piece, hit = matcher.push(text[start : start + size])
            out += piece
            start += size
        out += "" if hit else matcher.flush()
        assert out == _reference_stop(text, stops), (text, stops)
        assert hit == any(s in text for s in stops)


# ---------------------------------------------------------------- chat


def test_chat_completion_applies_the_chat_template(
    make_client: Callable[..., TestClient], tokenizer: Any
) -> None:
    backend = make_backend(tokenizer)
    client = make_client(backend)
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}],
        },
    ]
    body = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5}).json()
    joined = [messages[0], {"role": "user", "content": "Hello"}]
    expected = tokenizer.apply_chat_template(joined, add_generation_prompt=True)["input_ids"]
    (request,) = backend.requests
    assert list(request.prompt_token_ids) == list(expected)
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    text = tokenizer.decode(backend.expected_tokens(request), skip_special_tokens=True)
    assert choice["message"]["content"] == text
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None


def test_streamed_chat_sends_role_then_content_then_finish(
    make_client: Callable[..., TestClient], tokenizer: Any
) -> None:
    client = make_client(make_backend(tokenizer))
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4}
    whole = client.post("/v1/chat/completions", json={**body, "max_tokens": 99}).json()
    payloads = sse_payloads(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert streamed_text(payloads) == whole["choices"][0]["message"]["content"]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 4  # max_completion_tokens wins


# ---------------------------------------------------------------- logprobs


def test_completion_logprobs_format(make_client: Callable[..., TestClient], tokenizer: Any):
    client = make_client(make_backend(tokenizer, tokens_per_event=2))
    request = {"prompt": "Hello", "max_tokens": 5, "logprobs": 2}
    whole = client.post("/v1/completions", json=request).json()["choices"][0]["logprobs"]
    assert set(whole) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(whole["tokens"]) == 5 and whole["token_logprobs"] == [-0.25] * 5
    assert all(1 <= len(top) <= 2 for top in whole["top_logprobs"])
    offsets = [sum(len(t) for t in whole["tokens"][:i]) for i in range(5)]
    assert whole["text_offset"] == offsets
    payloads = sse_payloads(client.post("/v1/completions", json={**request, "stream": True}).text)
    streamed = [p["choices"][0]["logprobs"] for p in payloads]
    assert sum((s["tokens"] for s in streamed), []) == whole["tokens"]
    assert sum((s["text_offset"] for s in streamed), []) == whole["text_offset"]


def test_chat_logprobs_format_with_bytes_of_split_characters(
    make_client: Callable[..., TestClient], tokenizer: Any
) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    prompt = tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    answer = tokenizer.encode("你好 ok")
    backend = make_backend(tokenizer, outputs={prompt: answer})
    body = {"messages": messages, "logprobs": True, "top_logprobs": 2, "max_tokens": len(answer)}
    choice = make_client(backend).post("/v1/chat/completions", json=body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["message"]["content"] == "你好 ok"
    assert len(content) == len(answer)
    assert bytes(b for entry in content for b in entry["bytes"]) == "你好 ok".encode()
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["logprob"] == -0.25
        assert [set(t) for t in entry["top_logprobs"]] == [{"token", "logprob", "bytes"}] * 2
    no_top = {**body, "top_logprobs": None}
    choice = make_client(backend).post("/v1/chat/completions", json=no_top).json()["choices"][0]
    assert all(entry["top_logprobs"] == [] for entry in choice["logprobs"]["content"])


# ---------------------------------------------------------------- errors


COMPLETION = {"prompt": "Hello", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


@pytest.mark.parametrize(
    "path, body, fragment",
    [
        ("/v1/completions", {**COMPLETION, "max_tokens": "abc"}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "max_tokens": 2.5}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "temperature": -1}, "temperature"),
        ("/v1/completions", {**COMPLETION, "top_p": 0}, "top_p"),
        ("/v1/completions", {**COMPLETION, "top_p": 1.5}, "top_p"),
        ("/v1/completions", {**COMPLETION, "top_k": -2}, "top_k"),
        ("/v1/completions", {**COMPLETION, "min_p": 2}, "min_p"),
        ("/v1/completions", {**COMPLETION, "n": 0}, "n"),
        ("/v1/completions", {**COMPLETION, "n": 1000}, "n"),
        ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {**COMPLETION, "logprobs": True}, "logprobs"),
        ("/v1/completions", {**COMPLETION, "prompt": 5}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": ["a", ""]}, "prompt"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": [1, 100000]}, "vocabulary"),
        ("/v1/completions", {**COMPLETION, "stream": "yes"}, "stream"),
        ("/v1/completions", {**COMPLETION, "stop": 5}, "stop"),
        ("/v1/completions", {**COMPLETION, "stop_token_ids": [-1]}, "stop_token_ids"),
        ("/v1/completions", {**COMPLETION, "presence_penalty": 0.5}, "unsupported"),
        ("/v1/completions", {**COMPLETION, "frequency_penalty": -1}, "unsupported"),
        ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "needs echo or prompt_logprobs"),
        ("/v1/completions", {**COMPLETION, "min_tokens": 9}, "min_tokens"),
        ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, "stream"),
        ("/v1/completions", {**COMPLETION, "seed": "x"}, "seed"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
        ("/v1/chat/completions", {"max_tokens": 3}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"content": "x"}]}, "role"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -3}, "max_completion"),
        ("/v1/chat/completions", {**CHAT, "presence_penalty": 1}, "unsupported"),
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools.0.function"),
    ],
)
def test_bad_requests_get_400_with_the_envelope(
    make_client: Callable[..., TestClient], path: str, body: dict[str, Any], fragment: str
) -> None:
    backend = FakeBackend(512, 2)
    error = assert_error(make_client(backend).post(path, json=body), 400, fragment)
    assert error["type"] == "BadRequestError"
    assert error["param"] in (None, fragment, *body)  # a top-level field, if any
    assert backend.requests == []


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"'])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_malformed_json_gets_400(make_client: Callable[..., TestClient], path: str, raw: bytes):
    response = make_client().post(path, content=raw, headers={"content-type": "application/json"})
    assert_error(response, 400)


def test_unknown_model_and_route_get_404(make_client: Callable[..., TestClient]) -> None:
    client = make_client()
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        error = assert_error(client.post(path, json={**body, "model": "gpt-9"}), 404, "gpt-9")
        assert error["param"] == "model"
    assert_error(client.get("/v1/nothing"), 404)


def test_over_long_requests_get_400_naming_the_limit(
    make_client: Callable[..., TestClient], tokenizer: Any
) -> None:
    backend = make_backend(tokenizer, max_model_len=16)
    client = make_client(backend)
    long_prompt = " ".join(["cat"] * 20)
    prompt_len = len(tokenizer.encode(long_prompt))
    assert prompt_len > 16
    error = assert_error(
        client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 30}),
        400,
        "maximum context length is 16 tokens",
    )
    assert error["param"] == "max_tokens"
    assert_error(client.post("/v1/completions", json={"prompt": long_prompt}), 400, "16 tokens")
    chat = {"messages": [{"role": "user", "content": long_prompt}]}
    assert_error(client.post("/v1/chat/completions", json=chat), 400, "16 tokens")
    assert backend.requests == []


def test_backend_error_event(make_client: Callable[..., TestClient], tokenizer: Any) -> None:
    client = make_client(make_backend(tokenizer, error_after=3))
    whole = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 10})
    error = assert_error(whole, 500, "injected failure")
    assert error["type"] == "InternalServerError"
    response = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10, "stream": True})
    *chunks, error_line = sse_payloads(response.text)
    assert chunks[-1]["choices"][0]["finish_reason"] == "error"
    assert "injected failure" in error_line["error"]["message"]


class _RaisingBackend(FakeBackend):
    async def generate(self, request: GenerateRequest):  # type: ignore[override]
        self.requests.append(request)
        yield Tokens(request.request_id, (7,))
        raise ConnectionError("node went away")


def test_backend_exception_becomes_an_error_and_aborts(
    make_client: Callable[..., TestClient],
) -> None:
    backend = _RaisingBackend(512, 2)
    error = assert_error(make_client(backend).post("/v1/completions", json=COMPLETION), 500)
    assert "backend failure" in error["message"]
    assert "node went away" not in error["message"]  # the log has it, the client does not
    assert backend.aborted == [backend.requests[0].request_id]


def test_error_of_one_choice_aborts_the_others(
    make_client: Callable[..., TestClient], tokenizer: Any
) -> None:
    backend = make_backend(tokenizer, token_delay=0.01)
    original = backend.generate

    async def first_fails(request: GenerateRequest):  # type: ignore[no-untyped-def]
        if request.request_id.endswith("-0"):
            backend.requests.append(request)
            yield Error(request.request_id, "boom", Failure.INTERNAL)
            return
        async for event in original(request):
            yield event

    backend.generate = first_fails  # type: ignore[method-assign]
    body = {"prompt": "Hello", "max_tokens": 50, "n": 2}
    assert_error(make_client(backend).post("/v1/completions", json=body), 500, "boom")
    assert [r for r in backend.aborted if r.endswith("-1")]


# ---------------------------------------------------------------- api key


AUTH_ROUTES = [
    ("POST", "/v1/completions", COMPLETION),
    ("POST", "/v1/chat/completions", CHAT),
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [5, 6]}),
    ("GET", "/openapi.json", None),
]
WRONG_KEYS = ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"})
WRONG_KEYS += ({"Authorization": "Basic sesame"}, {"Authorization": "Bearer "})


@pytest.mark.parametrize("method, path, body", AUTH_ROUTES)
def test_api_key_guards_every_route_but_health(
    make_client: Callable[..., TestClient], method: str, path: str, body: Any
) -> None:
    client = make_client(api_key="sesame")
    for headers in WRONG_KEYS:
        response = client.request(method, path, json=body, headers=headers)
        assert_error(response, 401, "API key")
        assert response.headers["www-authenticate"] == "Bearer"
    ok = client.request(method, path, json=body, headers={"Authorization": "Bearer sesame"})
    assert ok.status_code == 200, ok.text
    for headers in WRONG_KEYS:
        assert client.get("/health", headers=headers).json() == {"status": "ok"}


@pytest.mark.parametrize(
    "method, path, status_with_key",
    [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405), ("DELETE", "/tokenize", 405)],
)
def test_api_key_is_checked_before_routing(
    make_client: Callable[..., TestClient], method: str, path: str, status_with_key: int
) -> None:
    # A client without the key learns nothing, not even which routes exist.
    client = make_client(api_key="sesame")
    assert_error(client.request(method, path), 401, "API key")
    with_key = client.request(method, path, headers={"Authorization": "Bearer sesame"})
    assert_error(with_key, status_with_key)


def test_api_key_is_checked_before_the_body_is_read(
    make_client: Callable[..., TestClient], tokenizer: Any
) -> None:
    backend = make_backend(tokenizer)
    client = make_client(backend, api_key="sesame")
    huge = b"x" * (32 * 1024**2)  # over the default body limit: 413 if it were read
    response = client.post("/v1/completions", content=huge)
    assert_error(response, 401, "API key")
    assert backend.requests == []


def test_openapi_schema_describes_the_request_bodies(make_client: Callable[..., TestClient]):
    schema = make_client(api_key="sesame").get(
        "/openapi.json", headers={"Authorization": "Bearer sesame"}
    )
    schema = schema.json()
    bodies = {
        path: op["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        for path, op in schema["paths"].items()
        if "post" in op
    }
    assert bodies == {
        "/v1/completions": "#/components/schemas/CompletionRequest",
        "/v1/chat/completions": "#/components/schemas/ChatCompletionRequest",
        "/tokenize": "#/components/schemas/TokenizeRequest",
        "/detokenize": "#/components/schemas/DetokenizeRequest",
    }
    completion = schema["components"]["schemas"]["CompletionRequest"]
    assert completion["additionalProperties"] is False and completion["required"] == ["prompt"]
    assert completion["properties"]["presence_penalty"]["enum"] == [0, None]
    assert schema["security"] == [{"bearer": []}]
    assert schema["paths"]["/health"]["get"]["security"] == []


# ---------------------------------------------------------------- client disconnect


def _scope(path: str, spec_version: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec_version},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }


async def _call_and_leave(app: FastAPI, body: dict[str, Any], spec: str, leave_after: int):
    """Calls app like a server would, with a client that leaves after leave_after body
    messages (0: right after sending the request). Returns the body messages received."""
    gone = asyncio.Event()
    received: list[bytes] = []
    request = {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
    messages = [request]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if gone.is_set() and spec == "2.4":
            raise OSError("connection closed")  # what a 2.4 server does on a dead socket
        if message["type"] == "http.response.body" and message.get("body"):
            received.append(message["body"])
        if len(received) >= leave_after:
            gone.set()

    if leave_after == 0:
        gone.set()
    path = "/v1/completions"
    await asyncio.wait_for(app(_scope(path, spec), receive, send), timeout=10)
    return received


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_client_leaving_a_stream_aborts_every_choice(tokenizer: Any, spec: str) -> None:
    backend = make_backend(tokenizer, token_delay=0.02)
    app = create_app(backend, tokenizer, MODEL)
    body = {"prompt": "Hello", "max_tokens": 200, "n": 2, "stream": True}
    received = asyncio.run(_call_and_leave(app, body, spec, leave_after=3))
    assert b"[DONE]" not in b"".join(received)
    rid = backend.requests[0].request_id.rsplit("-", 1)[0]
    assert sorted(backend.aborted) == [f"{rid}-0", f"{rid}-1"]
    assert backend.finished == []


def test_client_leaving_a_plain_request_aborts_it(tokenizer: Any) -> None:
    backend = make_backend(tokenizer, first_token_delay=5.0)
    app = create_app(backend, tokenizer, MODEL)
    body = {"prompt": "Hello", "max_tokens": 20}
    asyncio.run(_call_and_leave(app, body, "2.3", leave_after=0))
    assert backend.aborted == [backend.requests[0].request_id]


def test_no_request_state_outlives_its_request(tokenizer: Any) -> None:
    """Finished, failed, refused and abandoned requests alike leave no bookkeeping behind:
    admission counts, backend generators, Generation objects, tasks, the in-flight gauge."""
    backend = make_backend(tokenizer, token_delay=0.005)
    app = create_app(backend, tokenizer, MODEL, limits=RouterLimits(max_queued_requests=8))

    async def scenario() -> set[asyncio.Task]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            bodies = [COMPLETION, {**COMPLETION, "stream": True, "n": 3}] * 4
            answers = await asyncio.gather(
                *(client.post("/v1/completions", json=b) for b in bodies),
                client.post("/v1/chat/completions", json={**CHAT, "stream": True}),
            )
            assert {a.status_code for a in answers} == {200, 503}
            backend.error_after = 2
            failed = await client.post("/v1/completions", json=COMPLETION)
            assert failed.status_code == 500
            backend.error_after = None
        stream = {"prompt": "Hello", "max_tokens": 200, "n": 2, "stream": True}
        for spec in ("2.3", "2.4"):
            await _call_and_leave(app, stream, spec, leave_after=3)  # mid-stream
            await _call_and_leave(app, stream, spec, leave_after=0)  # before it starts
        await _call_and_leave(app, {"prompt": "Hello", "max_tokens": 200}, "2.3", leave_after=0)
        await asyncio.sleep(0.1)
        return asyncio.all_tasks() - {asyncio.current_task()}

    assert asyncio.run(scenario()) == set()
    gc.collect()
    assert (app.state.admission.requests, app.state.admission.tokens) == (0, 0)
    assert backend.live == 0
    assert not [o for o in gc.get_objects() if type(o) is Generation]
    gauge = "pdserve_router_requests_in_flight 0.0"
    with TestClient(app) as client:
        assert gauge in client.get("/metrics").text.splitlines()


SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize(
    "route, fields, want",
    [
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA},
                }
            },
            ("json", json.dumps(SCHEMA, separators=(",", ":"))),  # property order kept
        ),
        ("/v1/completions", {"response_format": {"type": "json_object"}}, ("json_object", True)),
        ("/v1/chat/completions", {"response_format": {"type": "text"}}, None),
        ("/v1/completions", {"structured_outputs": {"regex": "[ab]+"}}, ("regex", "[ab]+")),
        ("/v1/completions", {"structured_outputs": {"choice": ["x", "y"]}}, ("choice", ("x", "y"))),
        (
            "/v1/completions",
            {"structured_outputs": {"json": SCHEMA}},
            ("json", json.dumps(SCHEMA, separators=(",", ":"))),
        ),
        ("/v1/completions", {"guided_grammar": 'root ::= "a"'}, ("grammar", 'root ::= "a"')),
        ("/v1/completions", {"guided_json": json.dumps(SCHEMA)}, ("json", json.dumps(SCHEMA))),
        ("/v1/chat/completions", {"guided_choice": ["yes"]}, ("choice", ("yes",))),
        ("/v1/completions", {"guided_regex": "a{2}"}, ("regex", "a{2}")),
    ],
)
def test_output_constraints_reach_the_backend_as_one(
    make_client: Callable[..., TestClient], tokenizer: Any, route: str, fields: dict, want
) -> None:
    backend = make_backend(tokenizer)
    body = {"max_tokens": 2, **fields}
    if route == "/v1/completions":
        body["prompt"] = "Hi"
    else:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    response = make_client(backend).post(route, json=body)
    assert response.status_code == 200, response.text
    so = backend.requests[0].sampling.structured_outputs
    assert (so.key if so is not None else None) == want
