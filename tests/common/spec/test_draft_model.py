"""`draft_model` speculation in the colocated engine (issue 38): greedy output with a draft
model equals greedy without it and HF float32 at k in {1, 3, 5}; the target as its own draft
accepts every draft, its first two layers as the draft accept some; the draft's pages are a page
group of the target's blocks (no block leaks, the layout counts them); bad drafts are refused
by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.common.engine.llm import LLM, SamplingParams, llm_configs
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.spec.config import SpeculativeConfig
from pdserve.common.spec.draft_model import scratch_blocks
from pdserve.common.spec.self_draft import write_self_draft
from pdserve.tiny_model import make_tiny_model
from tests.common.test_llm_equivalence import PROMPTS as HF_PROMPTS
from tests.common.test_llm_equivalence import hf_greedy

# Repetitive prompts beside random ones of mixed lengths, one batch of concurrent requests.
PROMPTS = [
    [5, 6, 7, 8] * 10,
    [9, 10, 11] * 7 + [9],
    [17],
    [101, 57, 3, 98, 250, 7, 77, 411, 23, 5, 6, 100, 42],
    list(range(40, 140)),
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """The target (3 layers), its first two layers, and an unrelated model of its vocabulary."""
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_model("llama", root / "target", num_hidden_layers=3)
    return {
        "target": str(target),
        "layers2": str(write_self_draft(target, 2, root / "layers2")),
        "other": str(make_tiny_model("llama", root / "other", seed=1, num_hidden_layers=1)),
    }


def draft(model: str, k: int) -> dict[str, object]:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


def generate(target: str, prompts, params, **options) -> tuple[LLM, list[list[int]]]:
    """Token ids with these options, after checking that every block went back to the pool.
    float32 unless asked: the oracles (HF float32, the target alone) compare token for token,
    and `auto` is bf16 on a CPU with native bf16."""
    options.setdefault("dtype", "float32")
    llm = LLM(target, skip_tokenizer_init=True, block_size=4, **options)
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    llm.engine.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks - 1, "leaked blocks"
    return llm, outs


@pytest.fixture(scope="module")
def baseline(models) -> list[list[int]]:
    return generate(models["target"], PROMPTS, GREEDY)[1]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_target_as_its_own_draft_accepts_every_draft(models, baseline, k) -> None:
    llm, outs = generate(
        models["target"], PROMPTS, GREEDY, speculative_config=draft(models["target"], k)
    )
    assert outs == baseline
    stats = llm.engine.scheduler.drafter.stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens, "a self-draft missed"


@pytest.mark.parametrize("name, k", [("layers2", 1), ("layers2", 3), ("layers2", 5), ("other", 3)])
def test_smaller_draft_gives_the_same_tokens(models, baseline, name, k) -> None:
    llm, outs = generate(
        models["target"], PROMPTS, GREEDY, speculative_config=draft(models[name], k)
    )
    assert outs == baseline
    stats = llm.engine.scheduler.drafter.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens, "every draft accepted"
    if name == "layers2":
        assert stats.num_accepted_tokens > 0, "the first layers' drafts never accepted"


@pytest.mark.parametrize("k", [1, 3, 5])
def test_matches_hf_float32(models, k) -> None:
    """test_llm_equivalence's prompts (lengths 1 to 300, a shared prefix, a repeat)."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    spec = draft(models["layers2"], k)
    _, outs = generate(models["target"], HF_PROMPTS, params, speculative_config=spec)
    want, _ = hf_greedy(models["target"])
    assert outs == want


def test_draft_pages_share_the_target_blocks(models) -> None:
    """The draft's layers follow the target's in every block (one block id, one pool), the
    layout counts and names them, and the scratch blocks lie past the pool."""
    plain = LLM(models["target"], skip_tokenizer_init=True, block_size=4, kv_cache_bytes=1 << 20)
    spec = draft(models["layers2"], 5)
    llm = LLM(
        models["target"],
        skip_tokenizer_init=True,
        block_size=4,
        kv_cache_bytes=1 << 20,
        speculative_config=spec,
    )
    runner = llm.engine.runner
    assert len(runner.kv_caches) == 3 + 2
    assert runner.kv_caches[3].shape == runner.kv_caches[0].shape
    assert runner.kv_caches[3].shape[1] == runner.num_blocks + scratch_blocks(4, 5)
    assert llm.engine.kv.pool.num_blocks == runner.num_blocks
    layout, plain_layout = llm.engine.kv_layout(), plain.engine.kv_layout()
    assert layout.num_layers == 5 and plain_layout.num_layers == 3
    # The budget pays for the draft's pages of each block too.
    assert runner.num_blocks == (1 << 20) // layout.block_bytes
    assert plain.engine.runner.num_blocks == (1 << 20) // plain_layout.block_bytes
    assert layout.model_id.startswith(plain_layout.model_id + "+draft:")
    # The KV handshake compares layouts field by field: a node without the draft is refused.
    mismatch = layout.describe_mismatch(plain_layout, ("decode", "prefill"))
    assert "model_id" in mismatch and "num_layers" in mismatch
    group = layout.model_id.partition("+")[2]
    assert f"speculative_config: decode has the page group {group!r}, prefill has no draft " in (
        mismatch
    )


def test_bad_draft_is_refused_by_name(models, tmp_path) -> None:
    wide = make_tiny_model("llama", tmp_path / "wide", vocab=640, num_hidden_layers=1)
    with pytest.raises(ValueError, match="speculative_config.model: the draft's vocabulary"):
        LLM(models["target"], skip_tokenizer_init=True, speculative_config=draft(str(wide), 3))
    heads = make_tiny_model("llama", tmp_path / "heads", num_hidden_layers=1, num_key_value_heads=4)
    with pytest.raises(ValueError, match="speculative_config.model: the draft's KV pages"):
        LLM(models["target"], skip_tokenizer_init=True, speculative_config=draft(str(heads), 3))
    with pytest.raises(ValueError, match="speculative_config.model: draft_model needs"):
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="speculative_config.model: only draft_model"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "model": "x"})


def test_acceptance_depends_on_the_draft_pages(models) -> None:
    """The negative control of the P/D parity test (tests/e2e/test_spec_disaggregated.py):
    a decode side whose draft pages are zeros after the prompt, as a fresh pool holds them when
    a prefill node does not ship them, accepts another number of drafts than one that holds
    the draft's KV of the prompt. Tokens stay the target's either way. (The target as its own
    draft, as in the P/D test: with the prompt's pages it accepts every draft.)"""
    spec = draft(models["target"], 3)

    def run(drop_draft_pages: bool) -> tuple[list[int], int]:
        llm = LLM(
            models["target"],
            skip_tokenizer_init=True,
            block_size=4,
            dtype="float32",
            speculative_config=spec,
        )
        request = llm.engine.add_request("r", PROMPTS[0], GREEDY)
        llm.engine.step()  # the whole prompt and its first token, no drafts yet
        assert request.num_output_tokens == 1
        if drop_draft_pages:
            for cache in llm.engine.runner.draft.caches:
                cache.zero_()
        while llm.engine.has_unfinished:
            llm.engine.step()
        return list(
            request.output_token_ids
        ), llm.engine.scheduler.drafter.stats.num_accepted_tokens

    kept, dropped = run(False), run(True)
    assert kept[0] == dropped[0]
    assert kept[1] != dropped[1]


def test_preempted_requests_recompute_the_draft_pages(models, baseline) -> None:
    """A pool too small for the batch: a preempted request's blocks go back with both page
    groups, and its recompute rewrites the draft's pages with the target's, so the target as
    its own draft still accepts every draft."""
    llm = LLM(
        models["target"],
        skip_tokenizer_init=True,
        block_size=4,
        dtype="float32",
        num_blocks=40,
        speculative_config=draft(models["target"], 3),
    )
    outs = llm.generate(PROMPTS, GREEDY)
    assert sum(o.num_preemptions for o in outs) > 0, "the pool was meant to force preemption"
    assert [o.token_ids for o in outs] == baseline
    llm.engine.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks - 1, "leaked blocks"
    stats = llm.engine.scheduler.drafter.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_tensor_parallel_ranks_compute_the_draft_pages_but_draft_nothing(models) -> None:
    """At TP 2 on a prefill node (its part in P TP 2 -> D TP 1: an engine that does not decode)
    each rank holds its KV heads of the draft's pages, computed with the target's steps: rank
    0's equal the first half of a TP 1 engine's. Proposing would run on rank 0 alone, so such
    a node drafts nothing; its tokens are the target's. An engine that decodes is refused
    draft_model at TP 2 at start, by name, before any rank starts."""
    spec, prompt = draft(models["target"], 3), PROMPTS[3]
    options = {"skip_tokenizer_init": True, "block_size": 4, "num_blocks": 40, "dtype": "float32"}
    with LLM(models["target"], speculative_config=spec, **options) as one:
        want = one.generate([prompt], GREEDY)[0].token_ids
        whole = [cache.clone() for cache in one.engine.runner.draft.caches]
    tp = {"tensor_parallel_size": 2, "threads_per_rank": 1}
    with pytest.raises(ValueError, match="draft_model drafts at tensor parallel size 1 only"):
        LLM(models["target"], speculative_config=spec, **tp, **options)
    engine_options = {k: v for k, v in options.items() if k != "skip_tokenizer_init"}
    configs = llm_configs(models["target"], {"speculative_config": spec, **tp, **engine_options})
    two = LLMEngine(*configs, decodes=False)
    try:
        two.add_request("r", prompt, GREEDY)
        got: list[int] = []
        while two.has_unfinished:
            got.extend(t for update in two.step() for t in update.new_token_ids)
        assert got == want
        assert two.scheduler.drafter.stats.num_draft_tokens == 0
        halves = two.runner.draft.caches
        assert len(halves) == len(whole) == 3
        for half, full in zip(halves, whole, strict=True):
            heads = half.shape[3]
            assert heads * 2 == full.shape[3]
            assert half.abs().sum() > 0, "rank 0 computed no draft pages"
            torch.testing.assert_close(half[:, :40], full[:, :40, :, :heads], atol=1e-4, rtol=0)
    finally:
        two.close()


def test_a_self_draft_of_a_gguf_is_the_cut_of_its_weights(models, tmp_path) -> None:
    """A GGUF target's self-draft (dequantized through the loader) holds the first layers'
    weights, the embedding, the final norm and the head as the file does (F32: exactly), and
    a layer count outside the target's is refused by name."""
    from safetensors.torch import load_file

    from tests.common.model.test_gguf import write_llama_gguf

    gguf = write_llama_gguf(Path(models["target"]), tmp_path / "t.gguf")
    cut = write_self_draft(gguf, 2, tmp_path / "cut")
    every = load_file(Path(models["target"]) / "model.safetensors")
    want = {name: w for name, w in every.items() if not name.startswith("model.layers.2.")}
    assert len(want) < len(every)  # the target's third layer is what the cut drops
    got = load_file(cut / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[name], want[name]) for name in want)
    assert json.loads((cut / "config.json").read_text())["num_hidden_layers"] == 2
    with pytest.raises(ValueError, match="1 to 3 layers"):
        write_self_draft(gguf, 4, tmp_path / "too_many")
