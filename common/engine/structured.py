"""Structured outputs: a request's constraint compiled with xgrammar into a grammar, a matcher
per request that follows its tokens, and the token bitmask that keeps the sampler inside the
grammar.

A node builds one StructuredOutputs for its tokenizer, on the first constrained request (the
tokenizer scan takes about a second on a 50k vocabulary). Compiled grammars are cached by
xgrammar's compiler, keyed by the constraint, so a schema that many requests share is compiled
once per node. The mask of a step is filled on a worker thread while the model's forward runs
(see ModelRunner.execute).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from pdserve.common.wire.payloads import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar


class StructuredOutputs:
    """Compiles constraints and makes matchers for one model's tokenizer and vocabulary."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        try:
            import xgrammar as xgr
        except ImportError as exc:  # a required dependency: only a broken install lacks it
            raise ValueError(f"structured outputs need xgrammar: {exc}") from None
        self._xgr = xgr
        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1)
        self._ban: torch.Tensor | None = None

    def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar (cached); ValueError naming the constraint when it does not
        compile."""
        kind, value = params.key
        try:
            return self._compile(kind, value)  # xgrammar's compiler caches and locks itself
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"structured_outputs.{kind} does not compile: {exc}") from None

    def _compile(self, kind: str, value: Any) -> xgrammar.CompiledGrammar:
        c = self._compiler
        if kind == "json":
            # One line, fixed separators: a small model that may put any whitespace between
            # tokens can loop on newlines until max_tokens cuts the object off.
            return c.compile_json_schema(value, any_whitespace=False)
        if kind == "json_object":
            return c.compile_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return c.compile_regex(value)
        if kind == "choice":
            # Each choice is a literal of the EBNF grammar; JSON escapes are EBNF's too.
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(v) for v in value))
        return c.compile_grammar(value)

    def grammar(self, params: StructuredOutputsParams, accepted: Sequence[int] = ()) -> Grammar:
        """A request's grammar state past the tokens already generated (a request resumed on
        another node, or a decode node going on from the prefill node's first token);
        ValueError when they do not follow the grammar."""
        ban = self._control_bytes_ban() if params.kind in ("json", "json_object") else None
        grammar = Grammar(self._xgr.GrammarMatcher(self.compile(params)), ban)
        for i, token in enumerate(accepted):
            if not grammar.accept(int(token)):
                raise ValueError(
                    f"output token {i} ({token}) does not follow structured_outputs.{params.kind}"
                )
        return grammar

    def _control_bytes_ban(self) -> torch.Tensor:
        """A bitmask row that allows every token but those holding a byte below 0x20.

        xgrammar's JSON strings take any character but quote, backslash, CR and LF, and JSON
        (RFC 8259) allows no raw control character in a string: Python's json and pydantic
        refuse such output. Our JSON is one line (no whitespace tokens needed), so a token
        with a control byte can never be right."""
        if self._ban is None:
            words = [0xFFFFFFFF] * ((self.vocab_size + 31) // 32)
            for token, text in enumerate(self._info.decoded_vocab):
                if any(b < 0x20 for b in bytes(text)):
                    words[token // 32] &= ~(1 << (token % 32))
            signed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]  # as int32 holds them
            self._ban = torch.tensor(signed, dtype=torch.int32)
        return self._ban


class Grammar:
    """One request's place in its grammar: an xgrammar GrammarMatcher, and for JSON a row of
    tokens that stay banned whatever the matcher allows."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, ban: torch.Tensor | None) -> None:
        self._matcher = matcher
        self._ban = ban

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int] = ()) -> None:
        """The allowed next tokens into bitmask[row], and for a verify step's drafts (checked
        by `allowed_drafts`) into the rows after it: those allowed after each draft. The
        matcher is rolled back to where it was: it advances only on verified tokens."""
        for i, token in enumerate(drafts):
            self._fill_row(bitmask, row + i)
            assert self._matcher.accept_token(token), f"draft {i} ({token}) was not checked"
        self._fill_row(bitmask, row + len(drafts))
        self._matcher.rollback(len(drafts))

    def _fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._ban is not None:
            bitmask[row] &= self._ban

    def allowed_drafts(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the grammar allows, the matcher left where it was. A draft
        is cut at the first token the grammar refuses (or the JSON ban holds) and before a
        token that would end the grammar: nothing can follow it to fill a mask for, and the
        target samples that token itself."""
        n = 0
        for token in drafts:
            if self._banned(token) or not self._matcher.accept_token(token):
                break
            if self._matcher.is_terminated():
                self._matcher.rollback(1)
                break
            n += 1
        self._matcher.rollback(n)
        return n

    def _banned(self, token: int) -> bool:
        return self._ban is not None and not (int(self._ban[token // 32]) >> (token % 32)) & 1


def fill_bitmask(
    grammars: Sequence[Grammar], vocab_size: int, drafts: Sequence[Sequence[int]] = ()
) -> torch.Tensor:
    """The allowed next tokens of each grammar, one int32 bitmask row each (bit i of word w
    allows token 32 * w + i), and one more after each of its drafts where `drafts` gives them
    (a verify step's rows, in order). Runs on the runner's worker thread while the forward
    runs."""
    import xgrammar as xgr

    drafts = drafts or [()] * len(grammars)
    bitmask = xgr.allocate_token_bitmask(sum(1 + len(d) for d in drafts), vocab_size)
    row = 0
    for grammar, own in zip(grammars, drafts, strict=True):
        grammar.fill(bitmask, row, own)
        row += 1 + len(own)
    return bitmask


# A JSON object with any properties (strict mode would allow only `{}`).
_ANY_OBJECT = {"type": "object"}


def allowed_from_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, ceil(V/32)] int32 bitmask -> [B, V] bool, True where a token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: & 1 still reads the bit
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
