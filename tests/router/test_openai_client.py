"""The official openai client against the router served by a real uvicorn on loopback."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from pdserve.common.wire.messages import Error, Tokens
from pdserve.router.app import create_app
from pdserve.router.backend import GenerateRequest
from tests.router.fake_backend import FakeBackend, tiny_tokenizer

MODEL = "tiny-llama"
API_KEY = "test-key"
TIMEOUT_S = 10.0
HOLD_S = 30.0  # the longest a test holds the backend's later tokens back (real seconds)


class _ServerThread:
    """uvicorn serving app on a socket bound beforehand, so no port can be taken meanwhile."""

    def __init__(self, app: Any) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, args=([self._sock],), daemon=True)

    def __enter__(self) -> _ServerThread:
        self._thread.start()
        deadline = time.monotonic() + TIMEOUT_S
        while not self._server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            assert self._thread.is_alive(), "uvicorn exited"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        self._thread.join(TIMEOUT_S)
        self._sock.close()
        assert not self._thread.is_alive(), "uvicorn did not stop"


@pytest.fixture(scope="module")
def backend() -> FakeBackend:
    tokenizer = tiny_tokenizer()
    return FakeBackend(len(tokenizer), tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def server(backend: FakeBackend) -> Iterator[_ServerThread]:
    app = create_app(backend, tiny_tokenizer(), MODEL, api_key=API_KEY)
    with _ServerThread(app) as running:
        yield running


@pytest.fixture()
def client(server: _ServerThread, backend: FakeBackend) -> Iterator[openai.OpenAI]:
    backend.token_delay = backend.first_token_delay = 0.0
    base_url = f"http://127.0.0.1:{server.port}/v1"
    with openai.OpenAI(
        base_url=base_url, api_key=API_KEY, timeout=TIMEOUT_S, max_retries=0
    ) as client:
        yield client


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_plain_and_streamed(client: openai.OpenAI) -> None:
    ask = dict(model=MODEL, prompt="Hello", max_tokens=6, seed=5)
    whole = client.completions.create(**ask)
    assert whole.id.startswith("cmpl-")
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 6
    stream = client.completions.create(stream=True, stream_options={"include_usage": True}, **ask)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    )


def test_chat_plain_and_streamed(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "Hi there"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=5, logprobs=True, top_logprobs=2
    )
    assert whole.id.startswith("chatcmpl-")
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == 5
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=5, stream=True, n=2
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts[0] == choice.message.content  # no seed: the fake is deterministic anyway


def test_errors_arrive_as_openai_exceptions(client: openai.OpenAI, server: _ServerThread):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=100_000)
    assert "maximum context length is 256 tokens" in str(info.value)
    with pytest.raises(openai.BadRequestError, match="unsupported"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, presence_penalty=1)
    base_url = f"http://127.0.0.1:{server.port}/v1"
    with openai.OpenAI(base_url=base_url, api_key="wrong", timeout=TIMEOUT_S, max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_first_token_is_sent_before_the_rest_exists(
    client: openai.OpenAI, backend: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend makes the second token only once the client has the first (or after
    HOLD_S, so that a router that waits for the rest fails here rather than hanging)."""
    release = threading.Event()  # the client has the first token: the backend may go on
    rest_made = threading.Event()  # the backend went on past its first token
    generate = backend.generate

    async def first_then_held(request: GenerateRequest) -> AsyncIterator[Tokens | Error]:
        events = generate(request)
        try:
            yield await anext(events)
            await asyncio.to_thread(release.wait, HOLD_S)
            rest_made.set()
            async for event in events:
                yield event
        finally:
            await events.aclose()

    monkeypatch.setattr(backend, "generate", first_then_held)
    try:
        stream = client.with_options(timeout=2 * HOLD_S).completions.create(
            model=MODEL, prompt="Hello", max_tokens=2, stream=True
        )
        first = next(c for c in stream if c.choices and c.choices[0].text)
        assert not rest_made.is_set(), "the first token waited for the second"
        assert first.choices[0].finish_reason is None
        release.set()
        stream.close()
    finally:
        release.set()  # a failed test leaves no backend request waiting


def test_closing_a_stream_aborts_the_request(client: openai.OpenAI, backend: FakeBackend):
    backend.token_delay = 0.05
    stream = client.completions.create(model=MODEL, prompt="Bye", max_tokens=200, stream=True)
    next(iter(stream))
    stream.close()
    rid = backend.requests[-1].request_id
    wait_for(lambda: rid in backend.aborted, "the abort of a closed stream")
    assert rid not in backend.finished


def test_health_needs_no_key(server: _ServerThread) -> None:
    response = httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=TIMEOUT_S)
    assert response.json() == {"status": "ok"}
