"""Verify steps through the compiled decode (issue 38): a step whose sequences bring drafts runs
the CPU package of the bucket that holds its rows, with eager's logits; greedy output with
speculation through it equals greedy without speculation and HF float32.

The engine here has test_compile.py's model, flags and thread count: it loads that module's
three packages from the suite's compile cache (one xdist group: one compile between them)."""

from __future__ import annotations

import pytest
import torch

from pdserve.common.engine.compiled_decode import decode_buckets
from pdserve.common.engine.drafting import step_cost
from pdserve.common.engine.llm import LLM
from pdserve.common.engine.model_runner import ForwardInputs, ModelRunner, step_buckets
from pdserve.common.engine.scheduler import ScheduledSeq
from pdserve.common.wire.payloads import SamplingParams
from tests.common.model.test_compile import (  # noqa: F401 - fixtures
    BLOCK_SIZE,
    MAX_SEQS,
    SHARES_QWEN2_PACKAGES,
    model_dir,
    one_thread,
    waits_for_a_compile,
)
from tests.common.test_spec_engine import GREEDY, PROMPTS, ngram
from tests.devices import ON_CUDA, engine_kwargs, require_device

pytestmark = [SHARES_QWEN2_PACKAGES, pytest.mark.skipif(ON_CUDA, reason="CPU packages")]
K = MAX_SEQS - 1  # one request's verify step fills the largest bucket: no bucket is added


@pytest.fixture(scope="module")
def speculating(model_dir: str) -> LLM:  # noqa: F811 - the fixture imported above
    require_device()
    kwargs = {**engine_kwargs(), "max_num_seqs": MAX_SEQS, "speculative_config": ngram(K)}
    return LLM(model_dir, enforce_eager=False, skip_tokenizer_init=True, **kwargs)


def test_buckets_hold_one_requests_verify_step() -> None:
    assert step_buckets(64) == step_buckets(64, 6) == decode_buckets(64)
    assert step_buckets(1, 6) == (1, 2, 4, 8)  # batch 1, k = 5: rows 6 pad to 8
    assert step_buckets(1, 4) == step_buckets(4, 4) == (1, 2, 4)
    assert step_buckets(6, 6) == (1, 2, 4, 6, 8)  # the plain steps' buckets stay


def verify_batch(runner: ModelRunner, contexts: list[int], rows: list[int]) -> ForwardInputs:
    """Prefill sequences of the given lengths (eager), and return the step that brings `rows`
    tokens to each: its last known token and rows - 1 drafts."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    prompts, steps, block = [], [], 1
    for i, (n, q) in enumerate(zip(contexts, rows, strict=True)):
        blocks = tuple(range(block, block + (n + q) // BLOCK_SIZE + 1))
        block += len(blocks)
        tokens = tuple((7 * i + 3 * j + 1) % 512 for j in range(n + q))
        prompts.append(ScheduledSeq(f"p{i}", tokens[:n], 0, blocks, False, params))
        steps.append(ScheduledSeq(f"d{i}", tokens[n:], n, blocks, True, params, num_drafts=q - 1))
    prefill = runner.prepare(tuple(prompts))
    runner.model(prefill.input_ids, prefill.positions, prefill.attn, runner.kv_caches)
    return runner.prepare(tuple(steps))


@waits_for_a_compile
@torch.inference_mode()
def test_compiled_verify_logits_equal_eager(speculating: LLM) -> None:
    runner = speculating.engine.runner
    assert runner.compiled.buckets == (1, 2, 4)
    # One request's drafts, two requests' of different counts, drafts beside a plain row;
    # contexts past the sliding window (8) and across blocks.
    for contexts, rows in (([5], [2]), ([40], [4]), ([33, 70], [2, 2]), ([17, 90], [1, 3])):
        inputs = verify_batch(runner, contexts, rows)
        args = (inputs.input_ids, inputs.positions, inputs.attn, runner.model_caches)
        eager = runner.model.compute_logits(runner.model(*args))
        got = runner.compiled.logits(*args)
        assert got.shape == eager.shape == (sum(rows), eager.shape[-1])
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    assert runner.compiled.num_compiles == 3, "a verify step made a bucket recompile"


@waits_for_a_compile
def test_greedy_with_compiled_verify_steps_equals_greedy_without_and_hf(
    speculating: LLM,
    model_dir: str,  # noqa: F811 - the fixture imported above
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers import AutoModelForCausalLM

    runner = speculating.engine.runner
    ran: list[tuple[int, int]] = []  # (rows, sequences) of each compiled step
    forward = runner._forward

    def counted(inputs: ForwardInputs, seqs: tuple, on_layer: object, compiled: bool):  # noqa: ANN202
        if compiled:
            ran.append((len(inputs.input_ids), len(seqs)))
        return forward(inputs, seqs, on_layer, compiled)

    monkeypatch.setattr(runner, "_forward", counted)
    prompts = PROMPTS[:4]  # three repetitive (drafts accepted) and a one-token one: one batch
    outs = speculating.generate(prompts, GREEDY)
    stats = speculating.engine.scheduler.drafter.stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert any(rows > seqs for rows, seqs in ran), f"no verify step ran compiled: {ran}"
    speculating.engine.check_integrity()
    with LLM(model_dir, skip_tokenizer_init=True, enforce_eager=True, **engine_kwargs()) as plain:
        want = plain.generate(prompts, GREEDY)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, out, base in zip(prompts, outs, want, strict=True):
        assert out.token_ids == base.token_ids
        ids = torch.tensor([prompt])
        with torch.no_grad():
            seq = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(out.token_ids),
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        assert seq[0, len(prompt) :].tolist() == out.token_ids


@waits_for_a_compile
def test_the_drafter_prices_the_steps_the_engine_runs(
    speculating: LLM,
    model_dir: str,  # noqa: F811 - the fixture imported above
) -> None:
    """Compiled verify steps: adaptive k weighs the compiled buckets' costs; an eager engine
    the eager ones (chosen by the configured mode, so two nodes so configured agree)."""
    assert speculating.engine.runner.verifies_compiled
    assert speculating.engine.scheduler.drafter.cost == step_cost(True)
    kwargs = {**engine_kwargs(), "speculative_config": ngram(K)}
    with LLM(model_dir, skip_tokenizer_init=True, enforce_eager=True, **kwargs) as eager:
        assert eager.engine.scheduler.drafter.cost == step_cost(False)
