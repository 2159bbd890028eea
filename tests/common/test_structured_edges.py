"""Structured-output edges that mutation testing showed no test pinned (scripts/mutation.sh):
a vocabulary padded past the tokenizer, the stop ids a grammar ends with, what json_object
allows, which kinds ban control bytes, and the error of a missing xgrammar."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from pdserve.common.engine.structured import (
    Grammar,
    StructuredOutputs,
    allowed_from_bitmask,
    fill_bitmask,
)
from pdserve.common.wire.payloads import StructuredOutputsParams
from pdserve.tiny_model import train_tokenizer

PAD = 40  # a model's vocabulary padded past its tokenizer's, as real checkpoints often are
STOP = 5  # not the tokenizer's EOS: the grammar must end with the ids it is given


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return train_tokenizer(vocab_size=512, max_length=512)


@pytest.fixture(scope="module")
def outputs(tokenizer: Any) -> StructuredOutputs:
    assert tokenizer.eos_token_id != STOP
    return StructuredOutputs(tokenizer, len(tokenizer) + PAD, [STOP])


def allowed_after(outputs: StructuredOutputs, grammar: Grammar, tokens: list[int]) -> set[int]:
    for token in tokens:
        assert grammar.accept(token), token
    size = outputs.vocab_size
    flags = allowed_from_bitmask(fill_bitmask([grammar], size), size)[0]
    return set(flags.nonzero().view(-1).tolist())


def text_tokens(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def byte_tokens(outputs: StructuredOutputs, test: Any) -> set[int]:
    return {t for t, b in enumerate(outputs._info.decoded_vocab) if b and test(bytes(b))}


@pytest.mark.parametrize(
    "so", [StructuredOutputsParams(json_object=True), StructuredOutputsParams(regex="[a-z]+")]
)
def test_ids_past_the_tokenizer_are_never_allowed(
    outputs: StructuredOutputs, tokenizer: Any, so: StructuredOutputsParams
) -> None:
    allowed = allowed_after(outputs, outputs.grammar(so), [])
    assert allowed and max(allowed) < len(tokenizer)


def test_a_complete_grammar_allows_only_the_stop_ids_it_was_given(
    outputs: StructuredOutputs, tokenizer: Any
) -> None:
    grammar = outputs.grammar(StructuredOutputsParams(choice=("ab",)))
    assert allowed_after(outputs, grammar, text_tokens(tokenizer, "ab")) == {STOP}


def test_json_object_takes_any_object_on_one_line(
    outputs: StructuredOutputs, tokenizer: Any
) -> None:
    whitespace = byte_tokens(outputs, lambda b: not b.strip())
    assert whitespace
    grammar = outputs.grammar(StructuredOutputsParams(json_object=True))
    after_brace = allowed_after(outputs, grammar, text_tokens(tokenizer, "{"))
    assert not after_brace & whitespace
    assert set(text_tokens(tokenizer, '"')) <= after_brace  # a property, not only `{}`
    allowed_after(outputs, grammar, text_tokens(tokenizer, '"a": 1}'))
    assert grammar.terminated or STOP in allowed_after(outputs, grammar, [])


def test_json_object_strings_take_no_raw_control_byte(
    outputs: StructuredOutputs, tokenizer: Any
) -> None:
    control = byte_tokens(outputs, lambda b: any(c < 0x20 for c in b))
    assert control
    grammar = outputs.grammar(StructuredOutputsParams(json_object=True))
    inside_a_string = allowed_after(outputs, grammar, text_tokens(tokenizer, '{"'))
    assert inside_a_string and not inside_a_string & control


def test_a_regex_may_ask_for_a_newline(outputs: StructuredOutputs, tokenizer: Any) -> None:
    newline = byte_tokens(outputs, lambda b: b == b"\n")
    grammar = outputs.grammar(StructuredOutputsParams(regex="a\nb"))
    assert newline <= allowed_after(outputs, grammar, text_tokens(tokenizer, "a"))


def test_a_missing_xgrammar_is_named(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(ValueError, match="^structured outputs need xgrammar: "):
        StructuredOutputs(tokenizer, len(tokenizer), [STOP])
