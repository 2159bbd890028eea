"""Dialect edges that mutation testing showed no test pinned (scripts/mutation.sh): the bytes
logprobs report for a token that is part of a character, under each tokenizer's way of
writing raw bytes, and the finish reason of a reply that called tools."""

from __future__ import annotations

import pytest

from pdserve.router.dialects import TokenStrings, _tool_finish


class FakeTokenizer:
    """Decodes ids from a table; special tokens only when not skipped, as HF tokenizers do."""

    def __init__(self, texts: dict[int, str], raws: dict[int, str], special: set[int]) -> None:
        self.texts, self.raws, self.special = texts, raws, special

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(
            self.texts[i] for i in ids if not (skip_special_tokens and i in self.special)
        )

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.raws[token_id]


PART = "\ufffd"  # what decoding a lone piece of a multi-byte character gives
TOKENIZER = FakeTokenizer(
    texts={1: "hé", 2: PART, 3: PART, 4: PART, 5: "<|end|>", 6: PART},
    raws={1: "hé", 2: "<0xE2>", 3: "<0xe2>", 4: "âĢ", 5: "<|end|>", 6: "▁x"},
    special={5},
)


@pytest.mark.parametrize(
    ("token_id", "text", "raw_bytes"),
    [
        (1, "hé", list("hé".encode())),
        (2, PART, [0xE2]),  # SentencePiece byte fallback
        (3, PART, [0xE2]),  # its hex digits in either case
        (4, PART, [0xE2, 0x80]),  # byte-level BPE's printable alphabet
        (5, "<|end|>", list(b"<|end|>")),  # special tokens are shown, not skipped
        (6, PART, list(PART.encode())),  # neither: the replacement character's own bytes
    ],
)
def test_a_tokens_text_and_bytes(token_id: int, text: str, raw_bytes: list[int]) -> None:
    strings = TokenStrings(TOKENIZER)  # type: ignore[arg-type]
    assert strings.get(token_id) == (text, raw_bytes)
    assert strings.text(token_id) == text


@pytest.mark.parametrize(
    ("finish", "called", "want"),
    [
        ("stop", True, "tool_calls"),
        ("stop", False, "stop"),
        ("length", True, "length"),
        (None, True, None),
        (None, False, None),
    ],
)
def test_a_reply_that_stopped_after_calling_finishes_with_tool_calls(
    finish: str | None, called: bool, want: str | None
) -> None:
    assert _tool_finish(finish, called) == want
