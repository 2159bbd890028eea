"""Dialect edges that mutation testing showed no test pinned (scripts/mutation.sh): each
dialect's chunks and responses, field by field, built straight from choice deltas over a
token table (no app, no backend): completion logprobs with and without echo and their text
offsets across chunks, prompt logprobs with their ranks, chat logprobs and bytes, tool calls,
and the ids and timestamps every chunk carries."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from pydantic import BaseModel

from pdserve.common.wire.payloads import TokenLogprobs
from pdserve.router.dialects import ChatDialect, Collected, CompletionDialect, TokenStrings
from pdserve.router.generation import ChoiceDelta, PromptPart
from pdserve.router.openai_protocol import PromptTokensDetails, UsageInfo
from pdserve.router.tools import Function, ToolMode
from tests.router.fake_backend import tiny_tokenizer

TEXTS = {1: "Hi", 2: " there", 3: "a", 4: "bc", 5: " d", 6: "é"}
USAGE = UsageInfo(
    prompt_tokens=2,
    completion_tokens=3,
    total_tokens=5,
    prompt_tokens_details=PromptTokensDetails(cached_tokens=1),
)
USAGE_JSON = {
    "prompt_tokens": 2,
    "completion_tokens": 3,
    "total_tokens": 5,
    "prompt_tokens_details": {"cached_tokens": 1},
}


class TableTokenizer:
    """Decodes ids from TEXTS and counts how often each id is decoded."""

    def __init__(self) -> None:
        self.decoded: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += ids
        return "".join(TEXTS[i] for i in ids)

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return TEXTS[token_id]


def strings() -> TokenStrings:
    return TokenStrings(TableTokenizer())  # type: ignore[arg-type]


def dump(model: BaseModel | None) -> Any:
    """What the client reads: the JSON the router sends."""
    assert model is not None
    return json.loads(model.model_dump_json())


def lp(token_id: int, logprob: float, *top: tuple[int, float], rank: int = 0) -> TokenLogprobs:
    return TokenLogprobs(token_id, logprob, tuple(top), rank)


# The prompt "Hi there": token 2's logprob, with the top 2 at its position (2 is second).
PROMPT = PromptPart("Hi there", (1, 2), (lp(2, -1.5, (3, -0.5), (2, -1.5), rank=2),))


def test_token_strings_decode_each_id_once() -> None:
    tokenizer = TableTokenizer()
    tokens = TokenStrings(tokenizer)  # type: ignore[arg-type]
    assert [tokens.text(4), tokens.text(4), tokens.get(6)] == ["bc", "bc", ("é", [0xC3, 0xA9])]
    assert tokenizer.decoded == [4, 6]


def test_collected_joins_deltas_and_keeps_the_prompt_and_finish() -> None:
    c = Collected(index=1)
    c.add(ChoiceDelta(1, "a", (lp(3, -0.1),), token_ids=(3,), prompt=PROMPT))
    c.add(ChoiceDelta(1, "bc", (lp(4, -0.2),), "length", token_ids=(4,)))
    c.add(ChoiceDelta(1, ""))
    assert (c.index, c.text, c.token_ids) == (1, ["a", "bc", ""], [3, 4])
    assert c.logprobs == [lp(3, -0.1), lp(4, -0.2)]
    assert (c.prompt, c.finish_reason) == (PROMPT, "length")


def test_ids_and_timestamps_are_the_dialects_own() -> None:
    before = int(time.time())
    cmpl = CompletionDialect("m", strings(), None)
    chat = ChatDialect("m2", strings(), False)
    after = int(time.time())
    assert cmpl.id.startswith("cmpl-") and len(cmpl.id) == len("cmpl-") + 32
    assert chat.id.startswith("chatcmpl-") and len(chat.id) == len("chatcmpl-") + 32
    assert cmpl.id != CompletionDialect("m", strings(), None).id
    assert before <= cmpl.created <= after and before <= chat.created <= after
    chunk = dump(cmpl.chunk(ChoiceDelta(0, "a")))
    assert (chunk["id"], chunk["created"], chunk["model"]) == (cmpl.id, cmpl.created, "m")
    chunk = dump(chat.chunk(ChoiceDelta(0, "a")))
    assert (chunk["id"], chunk["created"], chunk["model"]) == (chat.id, chat.created, "m2")


# ---------------------------------------------------------------- completions


def test_a_completion_chunk_without_logprobs() -> None:
    d = CompletionDialect("m", strings(), None)
    assert d.opening(2) == []
    assert not d.wants(ChoiceDelta(0, "", token_ids=(3,)))
    assert dump(d.chunk(ChoiceDelta(1, "a", (lp(3, -0.1),), "stop", token_ids=(3,)))) == {
        "id": d.id,
        "object": "text_completion",
        "created": d.created,
        "model": "m",
        "choices": [{"index": 1, "text": "a", "logprobs": None, "finish_reason": "stop"}],
        "usage": None,
    }


def test_a_completion_asking_for_ids_and_prompt_logprobs_wants_their_deltas() -> None:
    d = CompletionDialect("m", strings(), None, want_ids=True)
    assert d.wants(ChoiceDelta(0, "", token_ids=(3,)))
    assert not d.wants(ChoiceDelta(0, ""))
    assert d.wants(ChoiceDelta(0, "", prompt=PROMPT))
    choice = dump(d.chunk(ChoiceDelta(0, "", token_ids=(3, 4))))["choices"][0]
    assert choice["token_ids"] == [3, 4] and "prompt_logprobs" not in choice
    plain = CompletionDialect("m", strings(), 2)
    assert plain.wants(ChoiceDelta(0, "", prompt=PROMPT))


def test_completion_logprobs_offsets_go_on_across_chunks_per_choice() -> None:
    d = CompletionDialect("m", strings(), 1)
    first = dump(d.chunk(ChoiceDelta(0, "abc", (lp(3, -0.1, (3, -0.1)), lp(4, -20000.0)))))
    assert first["choices"][0]["logprobs"] == {
        "tokens": ["a", "bc"],
        "token_logprobs": [-0.1, -9999.0],
        "top_logprobs": [{"a": -0.1}, {}],
        "text_offset": [0, 1],
    }
    other = dump(d.chunk(ChoiceDelta(1, " d", (lp(5, -0.3),))))
    assert other["choices"][0]["logprobs"]["text_offset"] == [0]
    second = dump(d.chunk(ChoiceDelta(0, " d", (lp(5, -0.3, (5, -0.3), (6, -30000.0)),))))
    assert second["choices"][0]["logprobs"] == {
        "tokens": [" d"],
        "token_logprobs": [-0.3],
        "top_logprobs": [{" d": -0.3, "é": -9999.0}],
        "text_offset": [3],
    }


def test_an_echoed_completion_starts_with_the_prompt_and_its_logprobs() -> None:
    d = CompletionDialect("m", strings(), 1)
    delta = ChoiceDelta(0, "a", (lp(3, -0.1, (3, -0.1)),), prompt=PROMPT)
    choice = dump(d.chunk(delta))["choices"][0]
    assert choice["text"] == "Hi therea"
    assert choice["logprobs"] == {
        "tokens": ["Hi", " there", "a"],
        "token_logprobs": [None, -1.5, -0.1],
        "top_logprobs": [None, {"a": -0.5}, {"a": -0.1}],  # the prompt's top cut to 1
        "text_offset": [0, 2, 8],
    }
    assert "prompt_logprobs" not in choice  # not asked for


def test_an_echoed_prompt_without_logprobs_or_tokens() -> None:
    d = CompletionDialect("m", strings(), 0)
    bare = PromptPart("Hi", (1,), None)
    choice = dump(d.chunk(ChoiceDelta(0, "a", (lp(3, -0.1),), prompt=bare)))["choices"][0]
    assert choice["logprobs"] == {
        "tokens": ["Hi", "a"],
        "token_logprobs": [None, -0.1],
        "top_logprobs": [None, {}],
        "text_offset": [0, 2],
    }
    empty = PromptPart("", (), None)
    again = CompletionDialect("m", strings(), 0)
    choice = dump(again.chunk(ChoiceDelta(0, "a", (lp(3, -0.1),), prompt=empty)))["choices"][0]
    assert choice["logprobs"]["tokens"] == ["a"] and choice["logprobs"]["text_offset"] == [0]


def test_a_prompt_not_echoed_is_neither_text_nor_logprobs() -> None:
    d = CompletionDialect("m", strings(), 1, want_prompt_logprobs=True)
    quiet = PromptPart(None, (1, 2), PROMPT.logprobs)
    choice = dump(d.chunk(ChoiceDelta(0, "a", (lp(3, -0.1),), prompt=quiet)))["choices"][0]
    assert choice["text"] == "a" and choice["logprobs"]["tokens"] == ["a"]
    assert choice["prompt_logprobs"] == [
        None,
        {
            "3": {"logprob": -0.5, "rank": 1, "decoded_token": "a"},
            "2": {"logprob": -1.5, "rank": 2, "decoded_token": " there"},
        },
    ]


def test_prompt_logprobs_rank_the_prompts_token_and_floor_minus_infinity() -> None:
    d = CompletionDialect("m", strings(), None, want_prompt_logprobs=True)
    outside = lp(4, float("-inf"), (3, -0.25), (5, -40000.0), rank=0)
    first = lp(6, -0.75, (6, -0.75), (3, -2.0), rank=1)
    prompt = PromptPart(None, (1, 4, 6), (outside, first))
    choice = dump(d.chunk(ChoiceDelta(0, "", prompt=prompt)))["choices"][0]
    assert choice["prompt_logprobs"] == [
        None,
        {
            "3": {"logprob": -0.25, "rank": 1, "decoded_token": "a"},
            "5": {"logprob": -9999.0, "rank": 2, "decoded_token": " d"},
            "4": {"logprob": -9999.0, "rank": None, "decoded_token": "bc"},  # rank unknown
        },
        {
            "6": {"logprob": -0.75, "rank": 1, "decoded_token": "é"},
            "3": {"logprob": -2.0, "rank": 2, "decoded_token": "a"},
        },
    ]
    assert choice["logprobs"] is None


def test_prompt_logprobs_are_left_out_without_them() -> None:
    d = CompletionDialect("m", strings(), None, want_prompt_logprobs=True)
    choice = dump(d.chunk(ChoiceDelta(0, "a", prompt=PromptPart("Hi", (1,), None))))
    assert "prompt_logprobs" not in choice["choices"][0]
    assert "prompt_logprobs" not in dump(d.chunk(ChoiceDelta(0, "b")))["choices"][0]


def test_a_whole_completion_joins_each_choice() -> None:
    d = CompletionDialect("m", strings(), 0, want_ids=True, want_prompt_logprobs=True)
    one = Collected(0, ["a", "bc"], [lp(3, -0.1), lp(4, -0.2)], "stop", [3, 4], PROMPT)
    two = Collected(1, [" d"], [lp(5, -0.3)], "length", [5])
    body = dump(d.response([one, two], USAGE))
    assert body["usage"] == USAGE_JSON
    assert (body["id"], body["created"], body["model"]) == (d.id, d.created, "m")
    first, second = body["choices"]
    assert (first["index"], first["text"], first["finish_reason"]) == (0, "Hi thereabc", "stop")
    assert first["token_ids"] == [3, 4] and second["token_ids"] == [5]
    assert first["logprobs"] == {
        "tokens": ["Hi", " there", "a", "bc"],
        "token_logprobs": [None, -1.5, -0.1, -0.2],
        "top_logprobs": [None, {}, {}, {}],
        "text_offset": [0, 2, 8, 9],
    }
    assert first["prompt_logprobs"][1]["2"]["rank"] == 2
    assert (second["index"], second["text"], second["finish_reason"]) == (1, " d", "length")
    assert second["logprobs"]["text_offset"] == [0] and "prompt_logprobs" not in second


def test_a_completions_usage_chunk_has_no_choices() -> None:
    d = CompletionDialect("m", strings(), None)
    body = dump(d.usage_chunk(USAGE))
    assert (body["id"], body["choices"], body["usage"]) == (d.id, [], USAGE_JSON)


# ---------------------------------------------------------------- chat


def test_chat_opens_each_choice_with_its_role() -> None:
    d = ChatDialect("m", strings(), False)
    assert [dump(c) for c in d.opening(2)] == [
        {
            "id": d.id,
            "object": "chat.completion.chunk",
            "created": d.created,
            "model": "m",
            "choices": [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            "usage": None,
        }
        for i in range(2)
    ]
    assert not d.wants(ChoiceDelta(0, "", token_ids=(3,), prompt=PROMPT))


def test_a_chat_chunk_with_logprobs_and_bytes() -> None:
    d = ChatDialect("m", strings(), True)
    delta = ChoiceDelta(1, "aé", (lp(3, -0.1), lp(6, -20000.0, (6, -20000.0), (3, -0.5))))
    assert dump(d.chunk(delta))["choices"] == [
        {
            "index": 1,
            "delta": {"content": "aé"},
            "logprobs": {
                "content": [
                    {"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": []},
                    {
                        "token": "é",
                        "logprob": -9999.0,
                        "bytes": [0xC3, 0xA9],
                        "top_logprobs": [
                            {"token": "é", "logprob": -9999.0, "bytes": [0xC3, 0xA9]},
                            {"token": "a", "logprob": -0.5, "bytes": [97]},
                        ],
                    },
                ]
            },
            "finish_reason": None,
        }
    ]
    last = dump(d.chunk(ChoiceDelta(1, "", finish_reason="stop")))["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "stop"
    assert last["logprobs"] == {"content": []}


def test_a_whole_chat_reply_with_its_prompt_logprobs() -> None:
    d = ChatDialect("m", strings(), True, want_prompt_logprobs=True)
    one = Collected(0, ["a", "bc"], [lp(3, -0.1), lp(4, -0.2)], "length", [3, 4], PROMPT)
    two = Collected(1, [""], [], "stop", [])
    body = dump(d.response([one, two], USAGE))
    assert (body["id"], body["object"], body["created"]) == (d.id, "chat.completion", d.created)
    assert (body["model"], body["usage"]) == ("m", USAGE_JSON)
    assert body["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": "abc", "tool_calls": []},
        "logprobs": {
            "content": [
                {"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": []},
                {"token": "bc", "logprob": -0.2, "bytes": [98, 99], "top_logprobs": []},
            ]
        },
        "finish_reason": "length",
    }
    assert body["choices"][1]["message"]["content"] == ""
    assert body["choices"][1]["finish_reason"] == "stop"
    assert body["prompt_logprobs"] == [
        None,
        {
            "3": {"logprob": -0.5, "rank": 1, "decoded_token": "a"},
            "2": {"logprob": -1.5, "rank": 2, "decoded_token": " there"},
        },
    ]


def test_a_chat_reply_without_prompt_logprobs_leaves_them_out() -> None:
    unasked = ChatDialect("m", strings(), False)
    one = Collected(0, ["a"], [lp(3, -0.1)], "stop", [3], PROMPT)
    body = dump(unasked.response([one], USAGE))
    assert "prompt_logprobs" not in body and body["choices"][0]["logprobs"] is None
    asked = ChatDialect("m", strings(), False, want_prompt_logprobs=True)
    assert "prompt_logprobs" not in dump(asked.response([], USAGE))
    body = dump(asked.response([Collected(0, ["a"], [], "stop", [3], None)], USAGE))
    assert "prompt_logprobs" not in body


def test_a_chats_usage_chunk_has_no_choices() -> None:
    d = ChatDialect("m", strings(), False)
    body = dump(d.usage_chunk(USAGE))
    assert (body["id"], body["object"], body["choices"]) == (d.id, "chat.completion.chunk", [])
    assert body["usage"] == USAGE_JSON


# ---------------------------------------------------------------- chat with tools

WEATHER = Function("get_weather", None, {"type": "object"})
AUTO = ToolMode((WEATHER,), "auto")
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_a_whole_reply_that_called_a_tool() -> None:
    d = ChatDialect("m", strings(), False, tools=AUTO)
    called = Collected(0, ["Look.\n", CALL], [], "stop", [])
    plain = Collected(1, ["Sunny."], [], "stop", [])
    cut = Collected(2, ["Sun"], [], "length", [])
    unknown = Collected(3, [CALL], [], None, [])
    body = dump(d.response([called, plain, cut, unknown], USAGE))
    first = body["choices"][0]
    assert first["finish_reason"] == "tool_calls"
    assert first["message"]["content"] == "Look."
    [call] = first["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert body["choices"][1]["message"] == {
        "role": "assistant",
        "content": "Sunny.",
        "tool_calls": [],
    }
    assert body["choices"][1]["finish_reason"] == "stop"
    assert body["choices"][2]["finish_reason"] == "length"
    # No finish reason yet reads as "stop" to the parser, and stays None.
    assert body["choices"][3]["finish_reason"] is None
    assert len(body["choices"][3]["message"]["tool_calls"]) == 1


def test_a_reply_read_whole_parses_only_when_it_stopped() -> None:
    required = ToolMode((WEATHER,), "required")
    d = ChatDialect("m", strings(), False, tools=required)
    text = '{"name": "get_weather", "arguments": {}}'
    none = dump(d.response([Collected(0, [text], [], None, [])], USAGE))["choices"][0]
    assert none["finish_reason"] is None and len(none["message"]["tool_calls"]) == 1


def test_streamed_tool_calls_go_out_as_deltas_with_their_finish() -> None:
    d = ChatDialect("m", strings(), True, tools=AUTO)
    assert d.chunk(ChoiceDelta(0, "<tool_")) is None  # maybe a tag: held
    assert d.chunk(ChoiceDelta(0, 'call>{"name": "get_weather", "arguments": {}}')) is None
    call = dump(d.chunk(ChoiceDelta(0, "</tool_call>")))["choices"][0]
    [piece] = call["delta"]["tool_calls"]
    assert piece["index"] == 0 and piece["type"] == "function" and piece["id"].startswith("call_")
    assert piece["function"] == {"name": "get_weather", "arguments": "{}"}
    assert "content" not in call["delta"] and call["finish_reason"] is None
    assert call["logprobs"] is None  # chat logprobs do not ride with tool deltas
    end = dump(d.chunk(ChoiceDelta(0, "", finish_reason="stop")))["choices"][0]
    assert end["delta"] == {} and end["finish_reason"] == "tool_calls"
    # The choice's parser is gone with its finish: the same index starts afresh.
    again = dump(d.chunk(ChoiceDelta(0, "hi", finish_reason="stop")))["choices"][0]
    assert again["delta"] == {"content": "hi"} and again["finish_reason"] == "tool_calls"


def test_streamed_tool_content_and_finish_per_choice() -> None:
    d = ChatDialect("m", strings(), False, tools=AUTO)
    text = dump(d.chunk(ChoiceDelta(1, "Sunny")))["choices"][0]
    assert text["index"] == 1 and text["delta"] == {"content": "Sunny"}
    assert "tool_calls" not in text["delta"]
    end = dump(d.chunk(ChoiceDelta(1, " day", finish_reason="length")))["choices"][0]
    assert end["delta"] == {"content": " day"} and end["finish_reason"] == "length"
    stop = dump(d.chunk(ChoiceDelta(2, "ok", finish_reason="stop")))["choices"][0]
    assert stop["finish_reason"] == "stop"


def test_a_forced_call_streams_its_arguments() -> None:
    forced = ToolMode((WEATHER,), "function", forced="get_weather")
    d = ChatDialect("m", strings(), False, tools=forced)
    first = dump(d.chunk(ChoiceDelta(0, '{"city"')))["choices"][0]["delta"]["tool_calls"][0]
    assert first["id"].startswith("call_") and first["function"]["name"] == "get_weather"
    rest = dump(d.chunk(ChoiceDelta(0, ': "Oslo"}')))["choices"][0]["delta"]["tool_calls"][0]
    assert rest == {"index": 0, "function": {"arguments": ': "Oslo"}'}}
    end = dump(d.chunk(ChoiceDelta(0, "", finish_reason="stop")))["choices"][0]
    assert end["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("want", [True, False])
def test_chat_logprobs_only_when_asked(want: bool) -> None:
    d = ChatDialect("m", strings(), want)
    choice = dump(d.chunk(ChoiceDelta(0, "a", (lp(3, -0.1),))))["choices"][0]
    assert (choice["logprobs"] is not None) == want


def test_a_required_call_cut_short_stays_content() -> None:
    required = ToolMode((WEATHER,), "required")
    d = ChatDialect("m", strings(), False, tools=required)
    text = '{"name": "get_weather", "arguments": {}}'
    cut = dump(d.response([Collected(0, [text], [], "length", [])], USAGE))["choices"][0]
    assert cut["message"] == {"role": "assistant", "content": text, "tool_calls": []}
    assert cut["finish_reason"] == "length"


def test_a_streamed_required_call_is_read_at_its_end_by_its_finish() -> None:
    required = ToolMode((WEATHER,), "required")
    d = ChatDialect("m", strings(), False, tools=required)
    text = '{"name": "get_weather", "arguments": {}}'
    assert d.chunk(ChoiceDelta(0, text)) is None
    end = dump(d.chunk(ChoiceDelta(0, "", finish_reason="stop")))["choices"][0]
    assert end["delta"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "{}"}
    assert end["finish_reason"] == "tool_calls"
    cut = dump(d.chunk(ChoiceDelta(1, text, finish_reason="length")))["choices"][0]
    assert cut["delta"] == {"content": text} and cut["finish_reason"] == "length"


def test_content_on_both_sides_of_a_call_in_one_chunk_is_joined() -> None:
    d = ChatDialect("m", strings(), False, tools=AUTO)
    chunk = dump(d.chunk(ChoiceDelta(0, f"Look.{CALL} Done.", finish_reason="stop")))
    choice = chunk["choices"][0]
    assert choice["delta"]["content"] == "Look. Done."
    assert len(choice["delta"]["tool_calls"]) == 1


def test_every_chunk_and_response_carries_the_dialects_own_time() -> None:
    cmpl, chat = CompletionDialect("m", strings(), None), ChatDialect("m", strings(), False)
    cmpl.created = chat.created = 12345  # not now: a default timestamp would differ
    assert dump(cmpl.chunk(ChoiceDelta(0, "a")))["created"] == 12345
    assert dump(cmpl.usage_chunk(USAGE))["created"] == 12345
    assert dump(cmpl.response([], USAGE))["created"] == 12345
    assert dump(chat.chunk(ChoiceDelta(0, "a")))["created"] == 12345
    assert dump(chat.opening(1)[0])["created"] == 12345
    assert dump(chat.response([], USAGE))["created"] == 12345


def test_special_tokens_are_shown_by_a_real_tokenizer() -> None:
    tokenizer = tiny_tokenizer()
    tokens = TokenStrings(tokenizer)
    special = tokenizer.all_special_ids[0]
    text = tokenizer.convert_ids_to_tokens(special)
    assert tokens.get(special) == (text, list(text.encode()))
