"""Speculative decoding under structured outputs (issue 38): drafts are cut at the first token
the grammar refuses, each verified position is sampled under the grammar's mask after the
drafts before it, and the matcher advances only on emitted tokens. In the engine, 50 JSON
answers with ngram drafts at k = 3 are valid and equal the answers without drafts."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.common.engine.llm import LLM
from pdserve.common.engine.sampler import Sampler, SamplingRow
from pdserve.common.engine.structured import Grammar, allowed_from_bitmask, fill_bitmask
from pdserve.common.wire.payloads import SamplingParams, StructuredOutputsParams
from pdserve.tiny_model import make_tiny_model
from tests.e2e.test_structured import SCHEMA  # the schema the e2e tests ask for too

JSON = StructuredOutputsParams(json=SCHEMA)
PROMPTS = [f"Describe person {i} as JSON:" for i in range(50)]
MIN_TOKENS = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("sps") / "m", max_position=2048))


@pytest.fixture(scope="module")
def llm(model: str):
    with LLM(model, block_size=16, dtype="float32") as llm:
        yield llm


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=False)


def _allowed(grammar: Grammar, vocab: int, drafts=()) -> torch.Tensor:
    return allowed_from_bitmask(fill_bitmask([grammar], vocab, [drafts]), vocab)


def test_drafts_are_cut_at_the_first_refusal_and_the_matcher_stays(llm: LLM) -> None:
    structured = llm.engine.structured
    grammar = structured.grammar(StructuredOutputsParams(regex="ab[0-9]c"))
    vocab = structured.vocab_size
    before = _allowed(grammar, vocab)
    good = _ids(llm, "ab1")
    assert grammar.allowed_drafts([*good, *_ids(llm, "x"), *_ids(llm, "c")]) == len(good)
    assert grammar.allowed_drafts(_ids(llm, "x")) == 0
    # A stop token ends the grammar: nothing follows it to mask, so the target samples it.
    whole = [*good, *_ids(llm, "c")]
    assert grammar.allowed_drafts([*whole, llm.tokenizer.eos_token_id]) == len(whole)
    assert torch.equal(_allowed(grammar, vocab), before)  # rolled back each time
    for token in good:
        assert grammar.accept(token)  # where it was: the first verified token still fits


def test_a_json_draft_with_a_control_byte_is_cut(llm: LLM) -> None:
    grammar = llm.engine.structured.grammar(JSON)
    opening = _ids(llm, '{"name": "x')
    newline = _ids(llm, "\n")
    assert grammar.allowed_drafts([*opening, *newline]) == len(opening)


def test_masks_after_each_draft_equal_the_matcher_advanced_by_them(llm: LLM) -> None:
    structured = llm.engine.structured
    drafts = _ids(llm, '{"name": "')
    rows = _allowed(structured.grammar(JSON), structured.vocab_size, drafts)
    assert rows.shape[0] == len(drafts) + 1
    stepped = structured.grammar(JSON)
    for i in range(len(drafts) + 1):
        assert torch.equal(rows[i], _allowed(stepped, structured.vocab_size)[0]), i
        if i < len(drafts):
            assert stepped.accept(drafts[i])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verify_never_emits_a_token_its_position_forbids(temperature: float) -> None:
    """The target's favourite token is forbidden at every position: neither a greedy nor a
    sampled verify step emits it (the draft, allowed, may be accepted)."""
    logits = torch.zeros(3, 6)
    logits[:, 5] = 9.0
    allowed = torch.ones(3, 6, dtype=torch.bool)
    allowed[:, 5] = False
    row = SamplingRow(SamplingParams(temperature=temperature), None)
    sampler = Sampler(seed=0)
    for _ in range(200):
        out = sampler.verify(logits, row, (1, 2), allowed).token_ids
        assert 5 not in out and 1 <= len(out) <= 3
    assert sampler.verify(logits, row, (1, 2)).token_ids[0] == 5 or temperature  # unmasked


def test_json_answers_with_drafts_are_valid_and_equal_without(model: str, llm: LLM) -> None:
    params = SamplingParams(max_tokens=96, temperature=0.0, structured_outputs=JSON)
    want = [o.token_ids for o in llm.generate(PROMPTS, params)]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with LLM(model, block_size=16, dtype="float32", speculative_config=spec) as drafted:
        outs = drafted.generate(PROMPTS, params)
        stats = drafted.engine.scheduler.drafter.stats
        drafted.engine.check_integrity()
        kv = drafted.engine.kv
        assert kv.num_free_blocks == kv.pool.num_blocks - 1, "leaked blocks"
    assert [o.token_ids for o in outs] == want
    for out in outs:
        assert out.finish_reason == "stop", out
        assert set(json.loads(out.text)) == {"name", "age", "tags"}
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens


def test_min_tokens_with_drafts_equals_without(model: str, llm: LLM) -> None:
    """Requests with min_tokens are drafted for (within the bans: the scheduler's cut is
    tested in test_spec_verify); greedy answers equal those without drafts, each request's
    stop token the one it picks at min_tokens without bans, so each ends there."""
    prompts = [[5, 6, 7, 8] * 10, [9, 10, 11] * 7 + [9], [300, 301, 302, 303, 304, 305] * 5]
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    firsts = [o.token_ids[MIN_TOKENS] for o in llm.generate(prompts, free)]
    params = [
        SamplingParams(max_tokens=40, min_tokens=MIN_TOKENS, temperature=0.0, stop_token_ids=(t,))
        for t in firsts
    ]
    want = [o.token_ids for o in llm.generate(prompts, params)]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with LLM(model, block_size=16, dtype="float32", speculative_config=spec) as drafted:
        got = [o.token_ids for o in drafted.generate(prompts, params)]
        assert drafted.engine.scheduler.drafter.stats.num_drafts > 0
    assert got == want
