"""`mtp` speculation in the colocated engine (issue 38) on the tiny DeepSeek-V3 (float32): greedy
output with the MTP layer drafting equals greedy without it at k in {1, 3, 5} (HF has no MTP:
the oracle is speculation on = off; the plain engine equals HF in tests/common/model/test_mla.py);
the MTP layer's KV and the target's hidden states are a page group of the target's blocks (no
block leaks, the layout counts them); acceptance depends on that page group (the negative
control of the P/D parity test, tests/e2e/test_spec_mtp.py); bad setups are refused by name.

HF's checkpoint holds no MTP layer, so the tests write one (`with_mtp`). Random weights accept
next to nothing; the "copy" MTP gets real acceptance by construction, not by a shortcut in the
code under test: its eh_proj passes the normed target hidden state through (plus `mix` times a
random map of the embedding), its attention and experts add only `mix` times their random
outputs, and its head is the target's LM head, so its first draft is mostly the target's own
prediction at the last computed position, the token just emitted. It is accepted where the
target repeats a token, which the tiny target does (runs of 339, 306, 360 below)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.common.engine.llm import LLM
from pdserve.common.model.attention import KVCacheSpec
from pdserve.common.spec.mtp import MtpDraft, hidden_layers
from tests.common.spec.test_draft_model import GREEDY, PROMPTS  # the same mixed batch

COPY_MIX = 0.3  # how much the copy MTP's attention, experts and embedding add


def with_mtp(src: Path, dst: Path, mix: float | None = None, seed: int = 0) -> Path:
    """The DeepSeek checkpoint at `src` with an MTP layer `model.layers.{n}.*` (and the
    shared embedding's copy, as Hub checkpoints hold it): its decoder layer is a copy of the
    target's last, the rest random (`mix` None) or the copy MTP (see the module docstring)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    weights = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    n, h = config["num_hidden_layers"], config["hidden_size"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.1

    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    layer = {
        mtp + k.removeprefix(last): t.clone() for k, t in weights.items() if k.startswith(last)
    }
    head = weights["lm_head.weight"]
    layer[mtp + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    if mix is None:
        for name in ("enorm", "hnorm", "shared_head.norm"):
            layer[f"{mtp}{name}.weight"] = 1 + rand(h)
        layer[mtp + "eh_proj.weight"] = rand(h, 2 * h)
        layer[mtp + "shared_head.head.weight"] = rand(*head.shape)
    else:
        for name in ("enorm", "hnorm", "shared_head.norm"):
            layer[f"{mtp}{name}.weight"] = torch.ones(h)
        layer[mtp + "eh_proj.weight"] = torch.cat((rand(h, h) * mix, torch.eye(h)), dim=1)
        layer[mtp + "shared_head.head.weight"] = head.clone()
        for name in layer:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                layer[name] = layer[name] * mix
    save_file({**weights, **layer}, dst / "model.safetensors", metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def mtp(k: int) -> dict[str, object]:
    return {"method": "mtp", "num_speculative_tokens": k}


def engine(model: str, **options) -> LLM:
    return LLM(model, skip_tokenizer_init=True, block_size=4, dtype="float32", **options)


def generate(model: str, prompts, **options) -> tuple[LLM, list[list[int]]]:
    """Greedy token ids with these options, after checking every block went back."""
    llm = engine(model, **{"num_blocks": 600, **options})
    outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    llm.engine.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks - 1, "leaked blocks"
    return llm, outs


@pytest.fixture(scope="module")
def models(deepseek_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mtp")
    return {
        "plain": deepseek_dir,
        "copy": str(with_mtp(Path(deepseek_dir), root / "copy", COPY_MIX)),
        "random": str(with_mtp(Path(deepseek_dir), root / "random")),
    }


@pytest.fixture(scope="module")
def baseline(models) -> list[list[int]]:
    return generate(models["plain"], PROMPTS)[1]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_with_mtp_equals_greedy_without(models, baseline, k) -> None:
    llm, outs = generate(models["copy"], PROMPTS, speculative_config=mtp(k))
    assert outs == baseline
    stats = llm.engine.scheduler.drafter.stats
    assert stats.num_accepted_tokens > 0, "the copy MTP's drafts never accepted"
    assert stats.num_draft_tokens > stats.num_accepted_tokens


def test_random_mtp_gives_the_same_tokens(models, baseline) -> None:
    llm, outs = generate(models["random"], PROMPTS, speculative_config=mtp(3))
    assert outs == baseline
    assert llm.engine.scheduler.drafter.stats.num_draft_tokens > 0


def test_page_group_shares_the_target_blocks(models) -> None:
    """The hidden layers and the MTP layer's cache follow the target's 3 layers in every
    block; the layout counts and names them; the budget pays for them."""
    budget = {"kv_cache_bytes": 1 << 20}
    plain = engine(models["copy"], **budget)
    llm = engine(models["copy"], speculative_config=mtp(3), **budget)
    runner, draft = llm.engine.runner, llm.engine.runner.draft
    assert isinstance(draft, MtpDraft)
    assert draft.num_hidden == 2  # a 64-wide hidden state in rows of 32 + 8 latent values
    assert len(runner.kv_caches) == 3 + 2 + 1
    assert all(c.shape == runner.kv_caches[0].shape for c in runner.kv_caches)
    layout, plain_layout = llm.engine.kv_layout(), plain.engine.kv_layout()
    assert layout.num_layers == 6 and plain_layout.num_layers == 3
    assert runner.num_blocks == (1 << 20) // layout.block_bytes
    assert layout.model_id == plain_layout.model_id + "+mtp"
    mismatch = layout.describe_mismatch(plain_layout)
    assert "model_id" in mismatch and "num_layers" in mismatch


@pytest.mark.parametrize("planes, heads, dim", [(1, 1, 40), (2, 2, 3)])
def test_hidden_pages_round_trip(planes, heads, dim) -> None:
    """A hidden state cut into page rows (padded past the last) reads back whole at its slot,
    and writes no other slot."""
    spec = KVCacheSpec(planes=planes, heads=heads, dim=dim)
    draft = MtpDraft.__new__(MtpDraft)
    draft.hidden_size, draft.num_hidden = 64, hidden_layers(64, spec)
    draft.caches = [torch.zeros(spec.shape(5, 4)) for _ in range(draft.num_hidden + 1)]
    hidden, slots = torch.randn(3, 64), torch.tensor([17, 2, 9])
    draft._store_hidden(hidden, slots)
    assert torch.equal(draft.read_hidden(slots), hidden)
    assert not draft.read_hidden(torch.tensor([0, 3, 19])).any()


def test_acceptance_depends_on_the_page_group(models) -> None:
    """The negative control of the P/D parity test: a decode side whose MTP pages (the
    target's hidden states, or the MTP layer's KV) are zeros after the prompt, as a fresh pool
    holds them when a prefill node does not ship them, accepts another number of drafts than
    one that holds them. Tokens stay the target's either way."""

    def run(drop: slice | None) -> tuple[list[int], int]:
        # every step drafts k: adaptive k would sit out after the zeroed pages' first misses
        spec = {**mtp(3), "adaptive": False}
        llm = engine(models["copy"], num_blocks=200, speculative_config=spec)
        request = llm.engine.add_request("r", PROMPTS[1], GREEDY)
        llm.engine.step()  # the whole prompt and its first token, no drafts yet
        assert request.num_output_tokens == 1
        if drop is not None:
            for cache in llm.engine.runner.draft.caches[drop]:
                cache.zero_()
        while llm.engine.has_unfinished:
            llm.engine.step()
        llm.engine.check_integrity()
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks - 1, "leaked"
        accepted = llm.engine.scheduler.drafter.stats.num_accepted_tokens
        return list(request.output_token_ids), accepted

    kept, no_hidden, no_kv = run(None), run(slice(0, 2)), run(slice(2, 3))
    assert kept[0] == no_hidden[0] == no_kv[0]
    assert kept[1] != no_hidden[1]
    assert kept[1] != no_kv[1]


def test_preempted_requests_recompute_the_page_group(models, baseline) -> None:
    """A pool too small for the batch: preempted requests give their blocks back with the
    page group and recompute it; tokens equal those without speculation."""
    llm = engine(models["copy"], num_blocks=40, speculative_config=mtp(3))
    outs = llm.generate(PROMPTS, GREEDY)
    assert sum(o.num_preemptions for o in outs) > 0, "the pool was meant to force preemption"
    assert [o.token_ids for o in outs] == baseline
    llm.engine.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks - 1, "leaked blocks"
    assert llm.engine.scheduler.drafter.stats.num_accepted_tokens > 0


def test_bad_setups_are_refused_by_name(models, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"missing weights \(\d+\): eh_proj.weight"):
        engine(models["plain"], speculative_config=mtp(3))
    none = tmp_path / "none"
    shutil.copytree(models["plain"], none)
    config = json.loads((none / "config.json").read_text())
    (none / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="mtp needs a checkpoint with an MTP layer"):
        engine(str(none), speculative_config=mtp(3))
    with pytest.raises(ValueError, match="mtp runs at tensor parallel size 1 only"):
        engine(models["copy"], tensor_parallel_size=2, speculative_config=mtp(3))


def test_dummy_weights_make_the_mtp_layer_too(models) -> None:
    """--load-format dummy: random MTP weights from the seed, whatever the checkpoint holds
    (the plain one has no MTP layer); tokens equal those without speculation."""
    options = {"num_blocks": 300, "load_format": "dummy"}
    _, want = generate(models["plain"], PROMPTS[:2], **options)
    llm, outs = generate(models["plain"], PROMPTS[:2], speculative_config=mtp(3), **options)
    assert outs == want
    assert llm.engine.scheduler.drafter.stats.num_draft_tokens > 0
