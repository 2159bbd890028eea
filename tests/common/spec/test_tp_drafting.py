"""ngram and suffix draft at tensor parallelism 2 (issue 38): their proposers are pure Python on
rank 0 (the scheduler's side) and the verify step is the target's TP step, so nothing of the
drafter needs the other ranks. Greedy tokens equal TP 1's without speculation, and drafts are
made and accepted. (draft_model at TP > 1 is refused at start on a node that decodes: its
forwards would run on rank 0 alone; tests/common/spec/test_draft_model.py. mtp is refused at
TP > 1 at start.)"""

from __future__ import annotations

import pytest

from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.tiny_model import make_tiny_model

PROMPTS = [[5, 6, 7, 8] * 10, [9, 10, 11] * 7 + [9], [101, 57, 3, 98, 250, 7, 77]]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
OPTIONS = {"dtype": "float32", "skip_tokenizer_init": True, "block_size": 16}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("tp") / "m", max_position=2048))


@pytest.fixture(scope="module")
def baseline(model) -> list[list[int]]:
    with LLM(model, **OPTIONS) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_stateless_drafters_draft_at_tp2(model, baseline, method) -> None:
    spec = {"method": method, "num_speculative_tokens": 3}
    with LLM(model, tensor_parallel_size=2, speculative_config=spec, **OPTIONS) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        stats = llm.engine.scheduler.drafter.stats
    assert got == baseline
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats
