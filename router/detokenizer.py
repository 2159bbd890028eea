"""Streams generated token ids as text, one finalized delta at a time."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded ahead of the first output token, so that it is decoded in context
# (decoders that strip a leading space or join pieces look at their neighbours).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns output token ids into text deltas without re-decoding the whole output.

    Keeps two offsets into the token list: text of tokens[prefix_offset:read_offset] has
    already been emitted, so each push decodes only tokens[prefix_offset:] and emits what lies
    beyond the prefix text. Text ending in U+FFFD is held back: with byte-level tokens a
    multi-byte character may be split across tokens, and its first bytes alone decode to
    U+FFFD. flush() emits whatever is still held back at the end.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        self._token_ids: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return self._text

    def push(self, new_token_ids: list[int]) -> str:
        """Adds newly generated tokens and returns the text they finalize (maybe "")."""
        self._token_ids.extend(new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Returns the held-back text, even if it ends in an incomplete character."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""
        if new_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""
        delta = new_text[len(prefix_text) :]
        # Drop tokens no window will need again, so the list stays as short as the window.
        del self._token_ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._text += delta
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
