"""Prompt logprobs: computed chunk by chunk while the prompt is prefilled, equal to HF
transformers' log-softmax of the same prompt (float32), whatever the chunk boundaries; with
max_tokens 0 the prompt is scored and nothing is generated."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.common.engine.llm import LLM, RequestOutput
from pdserve.common.wire.payloads import SamplingParams

TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(prompt: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([prompt])).logits[0].float()
        return logits.log_softmax(-1)  # [len, V]: row p scores token p + 1

    return run


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, 500) for _ in range(n)] for n in (2, 17, 64, 150)]


@pytest.mark.parametrize("chunk", [16, 40, 512])  # chunk boundaries inside and outside
def test_prompt_logprobs_equal_hf_across_chunk_boundaries(model_dir, hf_logprobs, chunk):
    llm = LLM(model_dir, block_size=16, max_num_batched_tokens=chunk, dtype="float32")
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    for prompt, out in zip(prompts(), llm.generate(prompts(), params), strict=True):
        want = hf_logprobs(prompt)
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(prompt)
        for p, lp in enumerate(out.prompt_logprobs[1:], start=1):
            row = want[p - 1]
            assert lp.token_id == prompt[p]
            assert abs(lp.logprob - row[prompt[p]].item()) < TOL, (p, lp.logprob)
            assert lp.rank == int((row > row[prompt[p]]).sum()) + 1
            top_lp, top_ids = row.topk(3)
            assert [t for t, _ in lp.top] == top_ids.tolist()
            assert max(abs(a - b) for (_, a), b in zip(lp.top, top_lp.tolist())) < TOL


def test_a_cached_prefix_is_scored_again(model_dir, hf_logprobs):
    """The prefix cache holds the first prompt's blocks; the second request asks for prompt
    logprobs, so it computes every position instead of reusing them."""
    llm = LLM(model_dir, block_size=16, dtype="float32")
    prompt = prompts()[3]
    llm.generate([prompt], SamplingParams(max_tokens=1))
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert out.num_cached_tokens == 0
    want = hf_logprobs(prompt)
    got = [lp.logprob for lp in out.prompt_logprobs[1:]]
    ref = [want[p - 1, prompt[p]].item() for p in range(1, len(prompt))]
    assert max(abs(a - b) for a, b in zip(got, ref)) < TOL


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(model_dir):
    llm = LLM(model_dir, block_size=16, dtype="float32")
    (out,) = llm.generate([prompts()[2]], SamplingParams(max_tokens=0, prompt_logprobs=1))
    assert out.token_ids == [] and out.finish_reason == "length"
    assert len(out.prompt_logprobs) == len(prompts()[2])
    assert not llm.engine.scheduler.requests
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_a_prompt_preempted_mid_prefill_keeps_its_logprobs_whole(model_dir: str) -> None:
    """A pool too small for both requests: the older one decodes on, so the prompt asking for
    logprobs is preempted while it is prefilled (max_tokens 1: it never gets further) and
    recomputed from scratch. Its prompt logprobs still come once per position, in order,
    equal to those of a run without preemption."""
    long, short = prompts()[2], prompts()[1][:4]
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2),
    ]

    def run(num_blocks: int | None) -> RequestOutput:
        llm = LLM(
            model_dir,
            block_size=4,
            num_blocks=num_blocks,
            max_num_batched_tokens=16,
            dtype="float32",
        )
        return llm.generate([short, long], params)[1]

    want, got = run(None), run(17)  # 17 blocks of 4: the long prompt alone just fits
    assert want.num_preemptions == 0 and got.num_preemptions > 0
    assert len(got.prompt_logprobs) == len(long) and got.prompt_logprobs[0] is None
    assert [lp.token_id for lp in got.prompt_logprobs[1:]] == long[1:]
    for p, (a, b) in enumerate(zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]), start=1):
        assert abs(a.logprob - b.logprob) < TOL and a.rank == b.rank, p
        assert [t for t, _ in a.top] == [t for t, _ in b.top], p
