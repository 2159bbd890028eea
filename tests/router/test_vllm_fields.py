"""Every request field vLLM's OpenAI server accepts on /v1/completions and
/v1/chat/completions (its protocol's CompletionRequest and ChatCompletionRequest), one by one:
each is served (200, and the request reaches the backend) or refused with a 400 whose
`param` names it; and a body carrying every field at vLLM's own default is accepted, since
clients built for vLLM send the defaults. docs/api.md lists the same split."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pdserve.router.app import create_app
from tests.router.fake_backend import FakeBackend, assert_error, tiny_tokenizer

C, CC = "/v1/completions", "/v1/chat/completions"
COMPLETION = {"prompt": "Hello", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
SERVED, REFUSED = "served", "refused"

# field: (vLLM's default, a value that asks for something, what pdserve does with that value)
SHARED: dict[str, tuple[Any, Any, str]] = {
    "model": (None, "m", SERVED),
    "frequency_penalty": (0.0, 0.5, REFUSED),
    "logit_bias": (None, {"5": 1.0}, REFUSED),
    "max_tokens": (None, 3, SERVED),
    "n": (1, 2, SERVED),
    "presence_penalty": (0.0, 0.5, REFUSED),
    "response_format": (None, {"type": "json_object"}, SERVED),
    "seed": (None, 7, SERVED),
    "stop": ([], ["zz"], SERVED),
    "stream": (False, True, SERVED),
    "temperature": (None, 0.5, SERVED),
    "top_p": (None, 0.9, SERVED),
    "user": (None, "user-1", SERVED),
    "best_of": (None, 1, SERVED),  # equal to n
    "use_beam_search": (False, True, REFUSED),
    "top_k": (None, 5, SERVED),
    "min_p": (None, 0.1, SERVED),
    "repetition_penalty": (None, 1.2, REFUSED),
    "length_penalty": (1.0, 0.5, REFUSED),
    "stop_token_ids": ([], [5], SERVED),
    "include_stop_str_in_output": (False, True, REFUSED),
    "ignore_eos": (False, True, SERVED),
    "min_tokens": (0, 2, SERVED),
    "skip_special_tokens": (True, False, SERVED),
    "spaces_between_special_tokens": (True, False, REFUSED),
    "truncate_prompt_tokens": (None, 8, REFUSED),
    "allowed_token_ids": (None, [1, 2], REFUSED),
    "prompt_logprobs": (None, 1, SERVED),
    "structured_outputs": (None, {"regex": "a+"}, SERVED),
    "guided_json": (None, {"type": "object"}, SERVED),
    "guided_regex": (None, "a+", SERVED),
    "guided_choice": (None, ["a", "b"], SERVED),
    "guided_grammar": (None, 'root ::= "a"', SERVED),
    "guided_decoding_backend": (None, "outlines", REFUSED),
    "guided_whitespace_pattern": (None, " ", REFUSED),
    "structural_tag": (None, "{}", REFUSED),
    "priority": (0, 1, REFUSED),
    "request_id": (None, "my-req-1", SERVED),
    "logits_processors": (None, ["pkg.Processor"], REFUSED),
    "return_tokens_as_token_ids": (None, True, REFUSED),
    "return_token_ids": (False, True, SERVED),
    "cache_salt": (None, "salt", REFUSED),
    "kv_transfer_params": (None, {"do_remote_decode": True}, REFUSED),
    "vllm_xargs": (None, {"k": 1}, REFUSED),
    "mm_processor_kwargs": (None, {"k": 1}, REFUSED),
}
COMPLETION_ONLY: dict[str, tuple[Any, Any, str]] = {
    "prompt_embeds": (None, "AAAA", REFUSED),
    "echo": (False, True, SERVED),
    "logprobs": (None, 2, SERVED),
    "suffix": (None, " end", REFUSED),
    "add_special_tokens": (True, False, SERVED),
}
CHAT_ONLY: dict[str, tuple[Any, Any, str]] = {
    "logprobs": (False, True, SERVED),
    "top_logprobs": (0, 0, SERVED),  # with logprobs (below)
    "max_completion_tokens": (None, 3, SERVED),
    "tools": (None, [TOOL], SERVED),
    "tool_choice": ("none", "auto", SERVED),
    "parallel_tool_calls": (False, True, SERVED),
    "reasoning_effort": (None, "low", REFUSED),
    "include_reasoning": (True, False, SERVED),
    "bad_words": ([], ["x"], REFUSED),
    "echo": (False, True, REFUSED),
    "add_generation_prompt": (True, False, SERVED),
    "continue_final_message": (False, True, SERVED),  # with add_generation_prompt false
    "add_special_tokens": (False, True, REFUSED),
    "documents": (None, [{"title": "t", "text": "x"}], SERVED),
    "chat_template": (None, "{{ messages }}", REFUSED),
    "chat_template_kwargs": (None, {"enable_thinking": False}, SERVED),
}
# Fields a value needs company for (vLLM's rules too).
COMPANY = {
    "top_logprobs": {"logprobs": True},
    "continue_final_message": {"add_generation_prompt": False},
    "stream": {"stream_options": {"include_usage": True}},
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny_tokenizer()


@pytest.fixture()
def backend(tokenizer: Any) -> FakeBackend:
    return FakeBackend(len(tokenizer), tokenizer.eos_token_id, max_model_len=1024)


@pytest.fixture()
def client(backend: FakeBackend, tokenizer: Any) -> Iterator[TestClient]:
    with TestClient(create_app(backend, tokenizer, "m")) as client:
        yield client


def _rows(fields: dict[str, tuple[Any, Any, str]], path: str) -> list[Any]:
    return [pytest.param(path, name, *row, id=f"{path}:{name}") for name, row in fields.items()]


ROWS = _rows({**SHARED, **COMPLETION_ONLY}, C) + _rows({**SHARED, **CHAT_ONLY}, CC)


@pytest.mark.parametrize("path, field, default, value, outcome", ROWS)
def test_each_vllm_field_is_served_or_refused_by_name(
    client: TestClient, backend: FakeBackend, path, field, default, value, outcome
) -> None:
    body = {**(COMPLETION if path == C else CHAT), field: value, **COMPANY.get(field, {})}
    response = client.post(path, json=body)
    if outcome == SERVED:
        assert response.status_code == 200, response.text
        assert backend.requests, "a served request reaches the backend"
    else:
        error = assert_error(response, 400, field)
        assert error["param"] == field, error
        assert backend.requests == []


@pytest.mark.parametrize("path", [C, CC])
def test_every_field_at_vllms_default_is_accepted(client, backend, path) -> None:
    fields = {**SHARED, **(COMPLETION_ONLY if path == C else CHAT_ONLY)}
    body = {name: default for name, (default, _, _) in fields.items()}
    body.update(COMPLETION if path == C else CHAT)
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert len(backend.requests) == 1


def test_served_extensions_do_what_vllm_does(client, backend, tokenizer) -> None:
    """request_id names the response; chat_template_kwargs and documents reach the template;
    continue_final_message leaves the last message open."""
    out = client.post(C, json={**COMPLETION, "request_id": "abc-1"}).json()
    assert out["id"] == "cmpl-abc-1"
    client.post(C, json={**COMPLETION, "request_id": "abc-1"})  # the same id twice is fine
    assert len({r.request_id for r in backend.requests}) == 2
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    client.post(
        CC,
        json={
            **CHAT,
            "messages": messages,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    )
    text = tokenizer.decode(backend.requests[-1].prompt_token_ids)
    assert text.endswith("Hel"), text  # no end-of-turn after the open message
    bad = client.post(CC, json={**CHAT, "chat_template_kwargs": {"tokenize": False}})
    assert assert_error(bad, 400, "tokenize")["param"] == "chat_template_kwargs"
    both = client.post(CC, json={**CHAT, "continue_final_message": True})
    assert_error(both, 400, "add_generation_prompt")
