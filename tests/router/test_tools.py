"""Tool calling in the router: the two parsers on good and malformed output, forced calls'
constraints, the default tool prompt, and whole chat requests against the fake backend,
streamed and not (malformed model output becomes plain content, never a 500)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from pdserve.router.app import create_app
from pdserve.router.tools import (
    CallPiece,
    Function,
    ToolMode,
    ToolStream,
    messages_for_default,
    parse_hermes,
    parse_llama3_json,
)
from tests.router.fake_backend import FakeBackend, tiny_tokenizer

WEATHER = Function(
    "get_weather",
    "The weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
TIME = Function("get_time", None, None)


def test_hermes_calls_and_the_content_around_them():
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = f"Let me look.\n<tool_call>\n{call}\n</tool_call>"
    content, calls = parse_hermes(text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    two = text + '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert [c.name for c in parse_hermes(two)[1]] == ["get_weather", "get_time"]
    assert len({c.id for c in parse_hermes(two)[1]}) == 2


@pytest.mark.parametrize(
    "text",
    [
        "no call at all",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": {}}',  # never closed
        "<tool_",  # the start of a tag, then the end
    ],
)
def test_malformed_hermes_output_is_plain_content(text):
    assert parse_hermes(text) == (text, [])


def test_a_malformed_block_stays_content_beside_good_calls():
    good = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    content, calls = parse_hermes(f"{good}\n<tool_call>[1]</tool_call>")
    assert content == "<tool_call>[1]</tool_call>" and [c.name for c in calls] == ["f"]


def _streamed(mode: ToolMode, text: str, sizes: list[int], finish: str = "stop"):
    """The reply fed in pieces of the given sizes (cycled): joined content, whole calls."""
    stream, pieces, i, k = ToolStream(mode), [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        pieces += stream.feed(text[i : i + n])
        i, k = i + n, k + 1
    pieces += stream.finish(finish)
    content = "".join(p for p in pieces if isinstance(p, str))
    calls: dict[int, list[CallPiece]] = {}
    for p in pieces:
        if isinstance(p, CallPiece):
            calls.setdefault(p.index, []).append(p)
    for ps in calls.values():  # id and name come once, in a call's first piece
        assert ps[0].id and ps[0].name is not None
        assert all(q.id is None and q.name is None for q in ps[1:])
    whole = [(ps[0].name, "".join(q.arguments for q in ps)) for ps in calls.values()]
    return content or None, whole


REPLIES = [
    "Plain answer, no call.  \n",
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n',
    'a < b and <tool b> <tool_call>{"name": "x", "arguments": {"q": "<tool_call>"}}</tool_call>',
    "<tool_call>{broken}</tool_call> then text <tool_call>",
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
    "  <|python_tag|> Prose after the tag.",
    "<|pyt",
]
MODES = [
    ToolMode((WEATHER, TIME), "auto", "hermes"),
    ToolMode((WEATHER, TIME), "auto", "llama3_json"),
    ToolMode((WEATHER, TIME), "required"),
    ToolMode((WEATHER, TIME), "function", forced="get_weather"),
]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"{m.choice}-{m.parser}")
@pytest.mark.parametrize("finish", ["stop", "length"])
def test_streamed_replies_read_as_the_whole_reply_does(mode, finish):
    """However the text is cut into deltas, the stream's content and calls are the whole
    reply's (the non-streaming response is the same machine fed once)."""
    for text in [*REPLIES, '{"name": "get_time", "arguments": {}}', '{"city": "Rome"}']:
        content, calls = mode.parse(text, finish)
        whole = (content, [(c.name, c.arguments) for c in calls])
        for sizes in ([1], [2, 5], [3, 1, 7], [len(text)]):
            assert _streamed(mode, text, sizes, finish) == whole, (text, sizes)


def test_content_streams_before_the_reply_ends():
    stream = ToolStream(MODES[0])
    assert stream.feed("The weather ") == ["The weather"]  # trailing space held
    assert stream.feed("is <tool") == [" is"]  # "<tool" may open a call: held
    assert stream.feed("bar> fine.") == [" <toolbar> fine."]
    out = stream.feed('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert [p.name for p in out] == ["get_time"]
    forced = ToolStream(MODES[3])
    first, second = forced.feed('{"ci'), forced.feed('ty": "Rome"}')
    assert first[0].name == "get_weather" and first[0].arguments == '{"ci'
    assert second == [CallPiece(0, None, None, 'ty": "Rome"}')]
    llama = ToolStream(MODES[1])
    assert llama.feed(" ") == [] and llama.feed("Four.") == [" Four."]


def test_llama3_json_calls():
    content, calls = parse_llama3_json('{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert content is None and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    both = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}'
    assert [c.name for c in parse_llama3_json(both)[1]] == ["a", "b"]
    for text in ("The answer is 4.", '{"name": "a"}', '{"name": "a", "parameters": {}}; oops'):
        assert parse_llama3_json(text) == (text, [])


def test_forced_calls_are_constrained_and_read_whole():
    named = ToolMode((WEATHER, TIME), "function", forced="get_weather")
    assert json.loads(named.constraint().json) == WEATHER.parameters
    content, calls = named.parse('{"city": "Rome"}')
    assert content is None and calls[0].name == "get_weather"
    required = ToolMode((WEATHER, TIME), "required")
    schema = json.loads(required.constraint().json)
    assert [o["properties"]["name"] for o in schema["anyOf"]] == [
        {"const": "get_weather"},
        {"const": "get_time"},
    ]
    content, calls = required.parse('{"name": "get_time", "arguments": {}}')
    assert content is None and calls[0].name == "get_time"
    assert ToolMode((WEATHER,), "auto").constraint() is None


def test_the_default_prompt_lists_the_functions_and_writes_history_back():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "18 C, sunny", "tool_call_id": "c1"},
    ]
    out = messages_for_default(messages, (WEATHER,))
    assert out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"]
    assert "<tool_call>" in out[0]["content"]
    assert '"arguments": {"city": "Paris"}' in out[2]["content"]
    assert out[3]["content"] == "<tool_response>\n18 C, sunny\n</tool_response>"
    assert all(isinstance(m["content"], str) for m in out)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER.parameters}}
]


def client_answering(text: str) -> tuple[TestClient, FakeBackend]:
    tok = tiny_tokenizer()
    backend = FakeBackend(
        len(tok), tok.eos_token_id, max_model_len=4096, scripted_all=tok.encode(text)
    )
    return TestClient(create_app(backend, tok, "m")), backend


def chat(client: TestClient, stream: bool, **extra: Any) -> tuple[dict, str | None]:
    """The reply's message (whole, or gathered from the stream) and finish reason."""
    body = {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 64, **extra}
    resp = client.post("/v1/chat/completions", json={**body, "stream": stream})
    assert resp.status_code == 200, resp.text
    if not stream:
        choice = resp.json()["choices"][0]
        return choice["message"], choice["finish_reason"]
    # Gathered as the openai SDK gathers a stream (tool-call pieces joined by index).
    state = ChatCompletionStreamState()
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                for call in c["delta"].get("tool_calls") or []:
                    assert None not in call.values() and None not in call["function"].values()
            state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    choice = state.get_final_completion().choices[0]
    message = choice.message.model_dump()
    message["tool_calls"] = message["tool_calls"] or []
    message["content"] = message["content"] or None  # the opening delta's "" is no content
    return message, choice.finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_with_a_call_becomes_tool_calls(stream):
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    client, _ = client_answering(text)
    message, finish = chat(client, stream, tools=TOOLS)
    assert finish == "tool_calls" and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_calls_and_tool_choice_none_stay_content(stream):
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    client, _ = client_answering(text)
    message, finish = chat(client, stream, tools=TOOLS)
    assert finish == "stop" and message["content"] == text and not message["tool_calls"]
    client, _ = client_answering('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')
    message, finish = chat(client, stream, tools=TOOLS, tool_choice="none")
    assert finish == "stop" and "<tool_call>" in message["content"]


def test_required_and_named_choices_reach_the_backend_as_constraints():
    client, backend = client_answering('{"city": "Paris"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    message, finish = chat(client, False, tools=TOOLS, tool_choice=named)
    so = backend.requests[-1].sampling.structured_outputs
    assert json.loads(so.json) == WEATHER.parameters
    assert finish == "tool_calls" and message["tool_calls"][0]["function"]["name"] == "get_weather"
    streamed, finish = chat(client, True, tools=TOOLS, tool_choice=named)  # arguments in pieces
    assert finish == "tool_calls" and streamed["content"] is None
    assert json.loads(streamed["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    chat(client, False, tools=TOOLS, tool_choice="required")
    assert "anyOf" not in json.loads(backend.requests[-1].sampling.structured_outputs.json)
    resp = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "tools": TOOLS,
            "tool_choice": "required",
            "guided_regex": "a",
        },
    )
    assert resp.status_code == 400 and "forced tool_choice" in resp.json()["error"]["message"]


def test_tool_messages_round_trip_into_the_prompt():
    client, backend = client_answering("It is sunny.")
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    resp = client.post(
        "/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "max_tokens": 8}
    )
    assert resp.status_code == 200, resp.text
    prompt = tiny_tokenizer().decode(list(backend.requests[-1].prompt_token_ids))
    assert '"arguments": {"city": "Paris"}' in prompt and "<tool_response>\n18 C" in prompt
