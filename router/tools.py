"""Tool calling: tools into the prompt, the model's reply out as tool calls.

- Rendering: the model's chat template renders `tools` when it knows them (transformers'
  apply_chat_template(tools=...)). A template that ignores them (SmolLM2's renders the same
  text with or without) gets a default: a system message that lists the functions as JSON and
  asks for calls in the Hermes format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
- Parsing: two formats in common use. `hermes`: `<tool_call>` blocks (Qwen2.5, Qwen3, Hermes,
  and the default above). `llama3_json`: the whole reply is one JSON object with `name` and
  `parameters` (Llama 3.1+). Output that does not parse is plain content, never an error.
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

from pdserve.common.engine.sampling_params import StructuredOutputsParams

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

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The reply's content (None when nothing but calls) and its tool calls."""
        if self.choice == "function":  # the whole output is the forced function's arguments
            return None, [ToolCall(new_call_id(), self.forced or "", _compact(text))]
        if self.choice == "required":
            calls = _object_call(text, "arguments")
            return (None, calls) if calls else (text, [])
        if self.parser == "llama3_json":
            return parse_llama3_json(text)
        return parse_hermes(text)


def _compact(text: str) -> str:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text


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
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; if any block is
    malformed the whole reply stays plain content."""
    blocks = _HERMES_CALL.findall(text)
    if not blocks:
        return text, []
    calls = []
    for block in blocks:
        found = _object_call(block, "arguments", "parameters")
        if not found:
            return text, []
        calls += found
    content = _HERMES_CALL.sub("", text).strip()
    return content or None, calls


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
