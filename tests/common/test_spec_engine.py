"""Speculative decoding in the colocated engine (issue 38): greedy output with drafts equals
greedy without them and HF float32; stops inside an accepted run; the blocks of rejected
drafts go back; the counters; bad --speculative-config values."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.common.node.cli import add_engine_args, engine_configs
from pdserve.common.node.health import NODE_COUNTERS, NODE_METRICS
from pdserve.common.node.reports import engine_gauges
from tests.common.test_llm_equivalence import (  # noqa: F401 - model_dirs is a fixture
    assert_matches_hf,
    model_dirs,
    run_engine,
)

MAX_TOKENS = 32
# Repetitive prompts (random weights loop on them, so drafts get accepted) beside random ones
# of mixed lengths: one batch of concurrent requests.
PROMPTS = [
    [5, 6, 7, 8] * 10,
    [9, 10, 11] * 7 + [9],
    [300, 301, 302, 303, 304, 305] * 5,
    [17],
    [101, 57, 3, 98, 250, 7, 77, 411, 23, 5, 6, 100, 42],
    list(range(40, 140)),
]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)


def ngram(k: int, **extra: object) -> dict[str, object]:
    return {"method": "ngram", "num_speculative_tokens": k, **extra}


@pytest.fixture(scope="module")
def model(model_dirs) -> str:  # noqa: F811 - the fixture imported above
    return model_dirs["llama"]


@pytest.fixture(scope="module")
def baseline(model: str) -> list:
    # float32: the oracle is HF float32 (test_baseline_is_hf); `auto` is bf16 with native bf16
    with LLM(model, skip_tokenizer_init=True, block_size=4, dtype="float32") as llm:
        return llm.generate(PROMPTS, GREEDY)


def generate(model: str, params: SamplingParams, prompts=PROMPTS, **options) -> tuple[LLM, list]:
    """Outputs with speculation, after checking that every block went back to the pool."""
    options.setdefault("dtype", "float32")  # as the baseline
    llm = LLM(model, skip_tokenizer_init=True, block_size=4, **options)
    outs = llm.generate(prompts, params)
    llm.engine.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks - 1, "leaked blocks"
    return llm, outs


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_with_drafts_equals_greedy_without(model, baseline, k) -> None:
    llm, outs = generate(model, GREEDY, speculative_config=ngram(k))
    for out, want in zip(outs, baseline, strict=True):
        assert out.token_ids == want.token_ids
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        got_lps = [lp.logprob for lp in out.logprobs]
        assert got_lps == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
    stats = llm.engine.scheduler.drafter.stats
    assert stats.num_accepted_tokens > 0, "no draft accepted: the verify path did not run"
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # and some were rejected
    assert max(len(lp) for lp in [stats.accepted_per_position]) <= k


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_with_drafts_matches_hf(model_dirs, k) -> None:  # noqa: F811
    """test_llm_equivalence's prompts: random, few drafts, all rejected (the verify and
    give-back path without acceptance)."""
    llm, outs = run_engine(model_dirs["llama"], speculative_config=ngram(k))
    assert_matches_hf(model_dirs["llama"], outs)
    assert llm.engine.scheduler.drafter.stats.num_drafts > 0


def test_baseline_is_hf(model, baseline) -> None:
    """The repetitive prompts' greedy output (which the drafts must reproduce) is HF's."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, baseline, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            seq = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        assert seq[0, len(prompt) :].tolist() == out.token_ids


def test_suffix_drafts_equal_greedy(model, baseline) -> None:
    llm, outs = generate(
        model, GREEDY, speculative_config={"method": "suffix", "num_speculative_tokens": 4}
    )
    assert [o.token_ids for o in outs] == [o.token_ids for o in baseline]
    assert llm.engine.scheduler.drafter.stats.num_accepted_tokens > 0


def test_rejected_drafts_give_their_blocks_back(model) -> None:
    """After every step a running request owns blocks for its known tokens at most."""
    llm = LLM(model, skip_tokenizer_init=True, block_size=2, speculative_config=ngram(5))
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    while engine.has_unfinished:
        engine.step()
        for request in engine.scheduler.running:
            owned = len(engine.kv.block_ids(request.request_id))
            assert owned <= -(-request.num_tokens // 2), request.request_id
        engine.check_integrity()
    assert engine.scheduler.drafter.stats.num_draft_tokens > 0
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks - 1


def test_stop_token_and_max_tokens_inside_accepted_runs(model, baseline) -> None:
    """A stop token the drafts run past ends the output there, as without drafts; so does
    max_tokens (each output length of the looping prompt)."""
    looping = baseline[0].token_ids
    stop = looping[5]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=(stop,))
    _, outs = generate(model, params, [PROMPTS[0]], speculative_config=ngram(5))
    assert outs[0].token_ids == looping[: looping.index(stop) + 1]
    assert outs[0].finish_reason == "stop"
    for n in (1, 2, 3, 7, 8):
        short = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        _, outs = generate(model, short, PROMPTS[:3], speculative_config=ngram(5))
        assert [o.token_ids for o in outs] == [o.token_ids[:n] for o in baseline[:3]]


def test_counters_add_up(model) -> None:
    llm, _ = generate(model, GREEDY, speculative_config=ngram(3, adaptive=False))
    stats = llm.engine.scheduler.drafter.stats
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert stats.accepted_per_position == sorted(stats.accepted_per_position, reverse=True)
    assert stats.num_drafts <= stats.num_draft_tokens <= 3 * stats.num_drafts
    gauges = engine_gauges(llm.engine, queued=0, draining=False)
    assert set(gauges) <= set(NODE_METRICS) | set(NODE_COUNTERS)  # every one exported
    assert gauges["pdserve_node_spec_decode_num_accepted_tokens"] == stats.num_accepted_tokens
    assert gauges["pdserve_node_spec_decode_num_drafts"] == stats.num_drafts


def _parse(flag: str):
    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(p)
    args = p.parse_args(["--speculative-config", flag])
    args.model = "m"
    return engine_configs(args)[2].speculative_config


def test_flag_parses_into_the_scheduler_config() -> None:
    spec = _parse(json.dumps(ngram(3, prompt_lookup_max=5)))
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 3, 5)


@pytest.mark.parametrize(
    "flag,error",
    [
        ('{"method": "nope", "num_speculative_tokens": 3}', "unknown method 'nope'"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 3', "not valid JSON"),
    ],
)
def test_bad_flag_is_a_usage_error_that_says_why(flag: str, error: str, capsys) -> None:
    p = argparse.ArgumentParser(prog="pdserve decode")
    add_engine_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--speculative-config", flag])
    assert error in capsys.readouterr().err
    with pytest.raises(ValueError, match=error.split("'")[0]):
        LLM("unused", skip_tokenizer_init=True, speculative_config=flag)


def test_sampled_requests_with_drafts(model) -> None:
    """Sampling (temperature 0.3, top-p 0.9: the random model's answers still loop, so
    ngram drafts) through verify steps: drafts are accepted by the rejection rule, every
    answer runs to max_tokens, every block goes back."""
    params = SamplingParams(max_tokens=12, temperature=0.3, top_p=0.9, ignore_eos=True)
    llm, outs = generate(model, params, [PROMPTS[0]] * 16, speculative_config=ngram(3))
    assert all(len(o.token_ids) == 12 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1  # sampled, not greedy
    assert llm.engine.scheduler.drafter.stats.num_accepted_tokens > 0


def test_preempted_requests_with_drafts_equal_greedy(model, baseline) -> None:
    """A pool too small for the batch: requests with drafts are preempted and recomputed."""
    llm, outs = generate(model, GREEDY, num_blocks=40, speculative_config=ngram(3))
    assert sum(o.num_preemptions for o in outs) > 0, "the pool was meant to force preemption"
    assert [o.token_ids for o in outs] == [o.token_ids for o in baseline]


def test_tensor_parallel_verify_steps_equal_greedy(model, baseline) -> None:
    """Every rank computes the verify step's logits rows (the head's gather needs them)."""
    llm, outs = generate(
        model, GREEDY, PROMPTS[:3], tensor_parallel_size=2, speculative_config=ngram(3)
    )
    llm.close()
    assert [o.token_ids for o in outs] == [o.token_ids for o in baseline[:3]]
    assert llm.engine.scheduler.drafter.stats.num_accepted_tokens > 0
