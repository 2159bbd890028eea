"""Stop strings that overlap, and the usage of a response with several choices per prompt:
edge cases the broader API tests (test_api.py) do not single out."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pdserve.common.wire.messages import Error, Tokens
from pdserve.router.app import create_app
from pdserve.router.backend import GenerateRequest
from pdserve.router.generation import StopStringMatcher
from tests.router.fake_backend import FakeBackend, tiny_tokenizer

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny_tokenizer()


# ---------------------------------------------------------------- overlapping stop strings


def run_matcher(stops: tuple[str, ...], pieces: list[str]) -> tuple[str, bool]:
    """What a client gets from pieces of text under these stop strings, and whether one hit."""
    matcher, out = StopStringMatcher(stops), ""
    for piece in pieces:
        text, hit = matcher.push(piece)
        out += text
        if hit:
            return out, True
    return out + matcher.flush(), False


@pytest.mark.parametrize("stops", [("abcd", "bc"), ("bc", "abcd")])
@pytest.mark.parametrize("pieces", [["ab", "cd"], ["abcd"], ["a", "b", "c", "d"]])
def test_a_stop_ending_inside_a_longer_one_cuts_first(
    stops: tuple[str, ...], pieces: list[str]
) -> None:
    """The stop "abcd" starts first but "bc" is complete one character earlier: a generator
    emitting one character at a time stops at "bc", so the text is "a" whatever the order of
    the stop list and however the text is split (upstream vLLM takes the first stop of the
    list found in the new text: with "ab" + "cd" and "abcd" listed first it answers "")."""
    assert run_matcher(stops, pieces) == ("a", True)


# ---------------------------------------------------------------- cached_tokens with n > 1

# Cached prompt tokens each choice's backend request reports, by choice index (prompt p's
# choices are p * n .. p * n + n - 1): each prompt counts once, with its best cache hit.
CACHED = {0: 1, 1: 3, 2: 2, 3: 0}
WANT_CACHED = max(CACHED[0], CACHED[1]) + max(CACHED[2], CACHED[3])  # 5, not a sum of 6


class PerChoiceCache(FakeBackend):
    """A FakeBackend whose first event of each request reports CACHED[its choice index]
    (a response with several choices names its requests <id>-<index>)."""

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Tokens | Error]:
        cached = CACHED[int(request.request_id.rsplit("-", 1)[1])]
        events = super().generate(request)
        try:
            first = True
            async for event in events:
                yield dataclasses.replace(event, cached_tokens=cached) if first else event
                first = False
        finally:
            await events.aclose()


@pytest.fixture()
def client(tokenizer: Any) -> Iterator[TestClient]:
    backend = PerChoiceCache(len(tokenizer), tokenizer.eos_token_id)
    with TestClient(create_app(backend, tokenizer, MODEL)) as client:
        yield client


@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_count_once_per_prompt_whatever_n(
    client: TestClient, tokenizer: Any, stream: bool
) -> None:
    prompts = ["Hello world, how are you", "Once upon a time there"]
    body: dict[str, Any] = {"prompt": prompts, "n": 2, "max_tokens": 2}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        *_, usage_line, done = [line for line in response.text.split("\n\n") if line]
        assert done == "data: [DONE]"
        usage = json.loads(usage_line.removeprefix("data: "))["usage"]
    else:
        usage = response.json()["usage"]
    prompt_tokens = sum(len(tokenizer.encode(p)) for p in prompts)  # once each, not n times
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["completion_tokens"] == 2 * 2 * 2
    assert usage["prompt_tokens_details"] == {"cached_tokens": WANT_CACHED}
