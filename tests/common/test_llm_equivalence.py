"""The offline engine against HF transformers `generate` (float32, CPU): token for token.

The engine runs on PDSERVE_TEST_DEVICE (CPU by default; on CUDA its Triton kernels, compiled
decode steps and CUDA graphs), HF on the CPU in float32 either way."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.tiny_model import make_tiny_model
from tests.devices import engine_kwargs, require_device

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
MAX_TOKENS = 10
VOCAB = 512


def make_prompts(seed: int = 0) -> list[list[int]]:
    """Mixed lengths 1..300, two prompts sharing a 100-token prefix, one repeated prompt."""
    rng = random.Random(seed)
    rand = lambda n: [rng.randrange(VOCAB) for _ in range(n)]
    prompts = [rand(n) for n in (1, 3, 16, 17, 40, 99, 160, 300)]
    prefix = rand(100)
    prompts += [prefix + rand(21), prefix + rand(5), list(prompts[6])]
    return prompts


PROMPTS = make_prompts()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("equiv")
    return {a: str(make_tiny_model(a, root / a, vocab=VOCAB)) for a in ARCHS}


_hf_cache: dict[str, tuple[list[list[int]], list[list[float]]]] = {}


def hf_greedy(model_dir: str) -> tuple[list[list[int]], list[list[float]]]:
    """HF generate's greedy tokens and the logprob of each, per prompt (no padding)."""
    if model_dir in _hf_cache:
        return _hf_cache[model_dir]
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: run every prompt to max tokens
    config = GenerationConfig(
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens, logprobs = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            # An explicit mask: otherwise generate masks every token equal to pad_token_id.
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            new = out.sequences[0, len(prompt) :].tolist()
            lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, new)]
            tokens.append(new)
            logprobs.append(lps)
    _hf_cache[model_dir] = (tokens, logprobs)
    return tokens, logprobs


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)


def make_llm(model_dir: str, **kwargs) -> LLM:
    """An engine on the test device (see `tests.devices.engine_kwargs`)."""
    require_device()
    return LLM(model_dir, **{**engine_kwargs(), **kwargs})


def run_engine(model_dir: str, **kwargs) -> tuple[LLM, list]:
    llm = make_llm(model_dir, **kwargs)
    outs = llm.generate(PROMPTS, GREEDY)
    llm.engine.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks - 1, "leaked blocks"
    return llm, outs


def assert_matches_hf(model_dir: str, outs) -> None:
    want, _ = hf_greedy(model_dir)
    got = [o.token_ids for o in outs]
    assert all(len(w) == MAX_TOKENS for w in want), "HF reference stopped early"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"prompt {i} (len {len(PROMPTS[i])}): {g} != HF {w}"


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("arch", ARCHS)
def test_unchunked_greedy_matches_hf(model_dirs, arch, block_size):
    llm, outs = run_engine(model_dirs[arch], block_size=block_size, max_num_batched_tokens=4096)
    assert_matches_hf(model_dirs[arch], outs)
    assert all(o.finish_reason == "length" for o in outs)
    assert outs[-1].num_cached_tokens > 0  # the repeated prompt hit the prefix cache
    assert outs[9].num_cached_tokens >= 96 - 96 % block_size  # shared 100-token prefix


@pytest.mark.parametrize(
    "arch,block_size,chunk,budget",
    [
        ("llama", 16, 1, 4096),  # one prompt token per request per step
        ("qwen3", 32, 7, 4096),
        ("qwen2", 16, 0, 33),  # budget-limited: chunks mixed with decodes
        ("mistral", 32, 64, 100),
    ],
)
def test_chunked_prefill_matches_hf(model_dirs, arch, block_size, chunk, budget):
    _, outs = run_engine(
        model_dirs[arch],
        block_size=block_size,
        long_prefill_token_threshold=chunk,
        max_num_batched_tokens=budget,
    )
    assert_matches_hf(model_dirs[arch], outs)


@pytest.mark.parametrize("arch,block_size", [("llama", 16), ("qwen3", 32), ("mistral", 16)])
def test_forced_preemption_matches_hf(model_dirs, arch, block_size):
    longest = max(len(p) for p in PROMPTS) + MAX_TOKENS
    num_blocks = -(-longest // block_size) + 4  # room for the longest, not for the batch
    _, outs = run_engine(
        model_dirs[arch],
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=128,
    )
    assert sum(o.num_preemptions for o in outs) > 0, "pool was meant to force preemption"
    assert_matches_hf(model_dirs[arch], outs)


def test_prefix_cache_across_calls_and_without_caching(model_dirs):
    d = model_dirs["qwen2"]
    llm, first = run_engine(d, block_size=16)
    second = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in second] == [o.token_ids for o in first]
    assert all(o.num_cached_tokens == (len(p) - 1) // 16 * 16 for o, p in zip(second, PROMPTS))
    _, uncached = run_engine(d, block_size=16, enable_prefix_caching=False)
    assert all(o.num_cached_tokens == 0 for o in uncached)
    assert_matches_hf(d, uncached)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logprobs_match_hf(model_dirs, arch):
    _, outs = run_engine(model_dirs[arch], block_size=16, long_prefill_token_threshold=50)
    _, want = hf_greedy(model_dirs[arch])
    for out, lps in zip(outs, want):
        got = [lp.logprob for lp in out.logprobs]
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-4


def test_top_logprobs_are_sorted_and_include_greedy_choice(model_dirs):
    llm = make_llm(model_dirs["llama"])
    (out,) = llm.generate([PROMPTS[4]], SamplingParams(max_tokens=4, temperature=0, logprobs=3))
    for lp in out.logprobs:
        assert len(lp.top) == 3
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.top[0][0] == lp.token_id and lp.top[0][1] == pytest.approx(lp.logprob)


def test_seeded_sampling_is_reproducible_whatever_the_batch(model_dirs):
    llm = make_llm(model_dirs["mistral"], block_size=16, max_num_batched_tokens=64)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    (alone,) = llm.generate([PROMPTS[5]], seeded)
    noise = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    batch = llm.generate(
        [PROMPTS[7], PROMPTS[5], PROMPTS[2], PROMPTS[5]], [noise, seeded, noise, noise]
    )
    assert batch[1].token_ids == alone.token_ids
    other = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=99, ignore_eos=True)
    (diff,) = llm.generate([PROMPTS[5]], other)
    assert diff.token_ids != alone.token_ids  # the seed matters
    llm.engine.check_integrity()


def test_text_prompts_and_detokenized_output(model_dirs):
    llm = make_llm(model_dirs["llama"])
    (out,) = llm.generate("the quick brown fox", SamplingParams(max_tokens=5, temperature=0))
    tok = llm.tokenizer
    assert out.prompt_token_ids == tok.encode("the quick brown fox")
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert out.finish_reason in ("stop", "length")


def test_bad_input_is_rejected_without_breaking_the_engine(model_dirs):
    llm = make_llm(model_dirs["llama"], max_model_len=64)
    with pytest.raises(ValueError, match="at most 64"):
        llm.generate([list(range(65))], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[VOCAB + 5]], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    (out,) = llm.generate([PROMPTS[3]], GREEDY)  # still serves
    assert len(out.token_ids) == MAX_TOKENS
    llm.engine.check_integrity()
