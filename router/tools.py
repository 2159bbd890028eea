"""Tool calling: tools into the prompt, the model's reply out as tool calls.

- Rendering: the model's chat template renders `tools` when it knows them (transformers'
  apply_chat_template(tools=...)). A template that ignores them (SmolLM2's renders the same
  text with or without) gets a default: a system message that lists the functions as JSON and
  asks for calls in the Hermes format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
- Parsing: two formats in common use. `hermes`: `<tool_call>` blocks (Qwen2.5, Qwen3, Hermes,
  and the default above). `llama3_json`: the whole reply is one JSON object with `name` and
  `parameters` (Llama 3.1+). Output that does not parse is plain content, never an error.
- Streaming: `ToolStream` reads the reply as it comes. Content streams live (only a possible
  start of a call is held back); a Hermes call goes out as soon as its block closes; a forced
  function's arguments stream fragment by fragment; a Llama 3 JSON reply and a `required` call
  are read when the reply ends. A whole reply is parsed by the same machine, so streamed and
  non-streamed replies agree.
- Forcing: `tool_choice: "required"` or a named function constrains the output with
  structured outputs, so the arguments always parse and follow the function's schema:
  required -> one JSON object {"name": one of the functions, "arguments": its parameters};
  named -> the arguments object of that function alone.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.common.wire.payloads import StructuredOutputsParams

PARSERS = ("hermes", "llama3_json")
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the OpenAI API returns it


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any] | None

    def as_tool(self) -> dict[str, Any]:
        """The OpenAI tool entry, as chat templates take it."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters if self.parameters is not None else _ANY_OBJECT
        return {"type": "function", "function": fn}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ToolMode:
    """What one chat request does with its tools: which functions, which choice, which
    parser reads the reply."""

    functions: tuple[Function, ...]
    choice: str  # "auto", "required", or "function" (forced: `forced` names it)
    parser: str = "hermes"
    forced: str | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured-output constraint that forces a call, or None ("auto")."""
        if self.choice == "function":
            fn = next(f for f in self.functions if f.name == self.forced)
            return StructuredOutputsParams(json=fn.parameters or _ANY_OBJECT)
        if self.choice == "required":
            options = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": f.name},
                        "arguments": f.parameters or _ANY_OBJECT,
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for f in self.functions
            ]
            schema = options[0] if len(options) == 1 else {"anyOf": options}
            return StructuredOutputsParams(json=schema)
        return None

    def parse(self, text: str, finish: str = "stop") -> tuple[str | None, list[ToolCall]]:
        """A whole reply's content (None when empty) and its tool calls."""
        stream = ToolStream(self)
        pieces = [*stream.feed(text), *stream.finish(finish)]
        content = "".join(p for p in pieces if isinstance(p, str))
        calls: dict[int, list[CallPiece]] = {}
        for p in pieces:
            if isinstance(p, CallPiece):
                calls.setdefault(p.index, []).append(p)
        whole = [
            ToolCall(ps[0].id or "", ps[0].name or "", "".join(p.arguments for p in ps))
            for ps in calls.values()
        ]
        return content or None, whole


@dataclass(frozen=True, slots=True)
class CallPiece:
    """A piece of a streamed tool call: the first piece of a call carries its id and name,
    every piece a fragment of its arguments (OpenAI's tool-call delta)."""

    index: int
    id: str | None
    name: str | None
    arguments: str


_OPEN, _CLOSE, _PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"


class ToolStream:
    """One choice's reply read as it streams: `feed` each new text, `finish` at the end;
    each returns what can go out now, content text (str) and CallPieces, in order."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.calls = 0  # calls sent so far
        self._pending = ""  # text read but not yet sent
        self._in_call = False  # hermes: inside a <tool_call> block
        self._space = ""  # hermes: whitespace held (dropped if a call follows it)
        self._whole = mode.choice == "required"  # read only at the end
        self._json: bool | None = None  # llama3_json: the reply is a JSON call (None: unsure)

    def feed(self, text: str) -> list[str | CallPiece]:
        if self.mode.choice == "function":
            return self._arguments(text)
        self._pending += text
        if self._whole:
            return []
        if self.mode.parser == "llama3_json":
            return self._llama3()
        return self._hermes()

    def finish(self, finish: str | None) -> list[str | CallPiece]:
        """What the reply's end releases: held text as content; a Llama 3 or `required`
        reply read whole when it stopped (a cut-off one stays content)."""
        text, self._pending = self._pending, ""
        if self.mode.choice == "function":
            return []
        if self._whole or self._json:
            calls = []
            if finish == "stop":
                if self._whole:
                    calls = _object_call(text, "arguments")
                else:
                    calls = parse_llama3_json(text)[1]
            if calls:
                return [self._piece(c.name, c.arguments) for c in calls]
            return [text] if text else []
        if self._in_call:
            text = _OPEN + text  # an unclosed block is content
        held = "" if self.calls else self._space
        self._space = ""
        return [held + text] if held + text else []

    def _piece(self, name: str, arguments: str) -> CallPiece:
        self.calls += 1
        return CallPiece(self.calls - 1, new_call_id(), name, arguments)

    def _arguments(self, text: str) -> list[str | CallPiece]:
        """A forced function: the whole reply is its arguments, streamed as they come."""
        if self.calls == 0:
            return [self._piece(self.mode.forced or "", text)]
        return [CallPiece(0, None, None, text)] if text else []

    def _llama3(self) -> list[str | CallPiece]:
        """Content streams once the reply is known not to be a JSON call."""
        if self._json is None:
            head = self._pending.lstrip()
            if head.startswith(_PYTHON_TAG):
                head = head.removeprefix(_PYTHON_TAG).lstrip()
            elif _PYTHON_TAG.startswith(head):
                return []  # nothing yet, or maybe the tag's start
            if not head:
                return []
            self._json = head.startswith("{")
        if self._json:
            return []
        text, self._pending = self._pending, ""
        return [text]

    def _hermes(self) -> list[str | CallPiece]:
        out: list[str | CallPiece] = []
        while True:
            if self._in_call:
                end = self._pending.find(_CLOSE)
                if end < 0:
                    return [p for p in out if p]
                block, self._pending = self._pending[:end], self._pending[end + len(_CLOSE) :]
                self._in_call = False
                calls = _object_call(block.strip(), "arguments", "parameters")
                if calls:
                    out += [self._piece(c.name, c.arguments) for c in calls]
                else:  # malformed: the block stays content, as written
                    out.append(self._content(_OPEN + block + _CLOSE))
                continue
            start = self._pending.find(_OPEN)
            if start >= 0:
                out.append(self._content(self._pending[:start], before_call=True))
                self._pending = self._pending[start + len(_OPEN) :]
                self._in_call = True
                continue
            keep = _partial_suffix(self._pending, _OPEN)
            cut = len(self._pending) - keep
            out.append(self._content(self._pending[:cut]))
            self._pending = self._pending[cut:]
            return [p for p in out if p]

    def _content(self, text: str, before_call: bool = False) -> str:
        """Text that is content, less its trailing whitespace: that is held, to go out with
        the next text, or be dropped when a call follows (the newline before a call)."""
        text = self._space + text
        body = text.rstrip()
        self._space = "" if before_call else text[len(body) :]
        return body


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held: a call may start)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _object_call(text: str, *arg_keys: str) -> list[ToolCall]:
    """One call from a JSON object {"name": str, <arg key>: object}, or none."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return []
    for key in arg_keys:
        if isinstance(value.get(key), dict):
            args = json.dumps(value[key], ensure_ascii=False)
            return [ToolCall(new_call_id(), value["name"], args)]
    return []


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; a malformed or
    unclosed block stays in the content as written."""
    return ToolMode((), "auto", "hermes").parse(text)


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """Llama 3's JSON tool calls: the reply is `{"name": ..., "parameters": {...}}` (maybe
    after `<|python_tag|>`, maybe several joined by `;`)."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    for part in body.split(";"):
        found = _object_call(part.strip(), "parameters", "arguments")
        if not found:
            return text, []
        calls += found
    return None, calls


def default_tool_prompt(functions: tuple[Function, ...]) -> str:
    """The system text given to a template that ignores tools: the functions, then how to
    call them (the Hermes format, which the hermes parser reads)."""
    listed = "\n".join(json.dumps(f.as_tool(), ensure_ascii=False) for f in functions)
    return (
        "You can call functions to answer the user. Their signatures, one JSON object per "
        f"line:\n<tools>\n{listed}\n</tools>\n"
        "To call a function, reply with a JSON object holding its name and its arguments, "
        "inside <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": "function name", "arguments": {"argument": "value"}}\n'
        "</tool_call>\n"
        "Use only the functions listed and only the arguments they declare."
    )


def messages_for_default(messages: list[dict[str, Any]], functions: tuple[Function, ...]):
    """Messages for a template that ignores tools: the tool prompt in the system message,
    earlier calls written back in the Hermes format, tool results as <tool_response>."""
    prompt = default_tool_prompt(functions)
    out: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls:
            written = [
                "<tool_call>\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    ensure_ascii=False,
                )
                + "\n</tool_call>"
                for c in calls
            ]
            message["content"] = "\n".join(filter(None, [message.get("content"), *written]))
        if message["role"] == "tool":
            message.pop("tool_call_id", None)
            result = message.get("content") or ""
            message["content"] = f"<tool_response>\n{result}\n</tool_response>"
        message["content"] = message.get("content") or ""
        out.append(message)
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{prompt}"
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out
