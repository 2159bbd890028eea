"""Tensor-parallel shards of the model: which slice each rank holds, and the ranks' logits
together against HF transformers (ranks as threads of this process, each with its own gloo
group member: the same collectives as separate processes, without their start-up)."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pdserve.common.model.config import ModelArchConfig
from pdserve.common.model.parallel import TPGroup, TPShard, join_group
from pdserve.common.model.weights import load_model
from tests.common.test_model import PROMPT_LEN, PagedSequence, _assert_close, _hf_logits, _step

TIMEOUT = datetime.timedelta(seconds=60)


def _arch(heads: int = 8, kv_heads: int = 4, vocab: int = 10, intermediate: int = 24):
    arch = ModelArchConfig.__new__(ModelArchConfig)
    for name, value in dict(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=2,
        vocab_size=vocab,
        intermediate_size=intermediate,
    ).items():
        object.__setattr__(arch, name, value)
    return arch


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "message"),
    [
        (9, 3, 2, "9 attention heads do not split across 2 ranks"),
        (12, 3, 2, "3 KV heads do not split across 2 ranks"),
        (12, 4, 6, "4 KV heads do not split across 6 ranks"),
    ],
)
def test_impossible_split_names_both_numbers(heads, kv_heads, size, message) -> None:
    with pytest.raises(ValueError, match=message):
        TPShard(0, size).check(_arch(heads, kv_heads, intermediate=size * 4))


def test_intermediate_size_must_split() -> None:
    with pytest.raises(ValueError, match="intermediate size 10 does not split across 4"):
        TPShard(0, 4).check(_arch(intermediate=10))


def test_rank_out_of_range() -> None:
    with pytest.raises(ValueError, match="rank 2 is not in"):
        TPShard(2, 2)


@pytest.mark.parametrize(
    ("kv_heads", "size", "expected"),
    [
        (4, 2, [range(0, 2), range(2, 4)]),
        (4, 4, [range(r, r + 1) for r in range(4)]),
        (2, 4, [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]),
        (1, 4, [range(0, 1)] * 4),
    ],
)
def test_kv_heads_split_or_replicate(kv_heads, size, expected) -> None:
    arch = _arch(heads=8, kv_heads=kv_heads)
    got = [TPShard(r, size).kv_heads(arch) for r in range(size)]
    assert got == expected
    # Every rank's query heads read the KV head it holds (grouped-query attention).
    group = arch.num_heads // kv_heads
    for r, held in enumerate(got):
        per = arch.num_heads // size
        assert {q // group for q in range(r * per, (r + 1) * per)} == set(held)


def test_shard_slices_each_kind() -> None:
    arch = _arch(heads=4, kv_heads=2, vocab=10, intermediate=8)
    hidden = 3
    q = torch.arange(8 * hidden, dtype=torch.float32).view(8, hidden)  # 4 heads x dim 2
    kv = torch.arange(4 * hidden, dtype=torch.float32).view(4, hidden)  # 2 KV heads
    o = torch.arange(hidden * 8, dtype=torch.float32).view(hidden, 8)
    emb = torch.arange(10 * hidden, dtype=torch.float32).view(10, hidden)
    norm = torch.arange(hidden, dtype=torch.float32)
    s1 = TPShard(1, 4)
    assert torch.equal(s1.shard("model.layers.0.self_attn.q_proj.weight", q, arch), q[2:4])
    # 4 ranks, 2 KV heads: ranks 0-1 hold head 0, ranks 2-3 head 1.
    assert torch.equal(s1.shard("model.layers.0.self_attn.k_proj.weight", kv, arch), kv[0:2])
    s2 = TPShard(2, 4)
    assert torch.equal(s2.shard("model.layers.0.self_attn.v_proj.bias", kv[:, 0], arch), kv[2:4, 0])
    assert torch.equal(s1.shard("model.layers.0.self_attn.o_proj.weight", o, arch), o[:, 2:4])
    assert torch.equal(s1.shard("model.layers.0.mlp.down_proj.bias", norm, arch), 0 * norm)
    assert torch.equal(TPShard(0, 4).shard("model.layers.0.mlp.down_proj.bias", norm, arch), norm)
    assert torch.equal(s1.shard("model.layers.0.mlp.up_proj.weight", o.T, arch), o.T[2:4])
    assert torch.equal(s1.shard("model.norm.weight", norm, arch), norm)
    # 10 rows over 4 ranks: 3 per rank, the last holds row 9 and two zero rows.
    last = TPShard(3, 4).shard("lm_head.weight", emb, arch)
    assert torch.equal(last[0], emb[9]) and not last[1:].any() and last.shape == (3, hidden)
    assert torch.equal(s1.shard("model.embed_tokens.weight", emb, arch), emb[3:6])


def run_ranks(size: int, body: Callable[[TPGroup], object]) -> list[object]:
    """body(group) on `size` threads, one per rank; their results in rank order."""
    store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=TIMEOUT, wait_for_workers=False)
    results: list[object] = [None] * size
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            st = store if r == 0 else dist.TCPStore("127.0.0.1", store.port, size, False)
            group = join_group(TPShard(r, size), st, 60.0, "cpu", f"test-{store.port}-{r}")
            try:
                results[r] = body(group)
            finally:
                group.close()
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def _sharded_logits(model_dir: Path, group: TPGroup) -> torch.Tensor:
    model, config = load_model(model_dir, torch.float32, "cpu", tp=group)
    seq = PagedSequence(config, PROMPT_LEN, seed=1)
    heads = group.shard.num_kv_heads(config)
    shape = (2, *seq.kv_caches[0].shape[1:3], heads, config.head_dim)
    seq.kv_caches = [torch.zeros(shape) for _ in range(config.num_layers)]
    prefill = 23  # a prefill chunk, then one token per step over the paged cache
    rows = [_step(model, [seq], [(0, prefill)])]
    rows += [_step(model, [seq], [(t, t + 1)]) for t in range(prefill, PROMPT_LEN)]
    return torch.cat(rows)


@pytest.mark.parametrize(
    ("arch", "overrides", "size"),
    [
        ("llama", {"kv_heads": 4}, 2),
        ("qwen3", {"kv_heads": 4}, 4),
        # 4 ranks, 2 KV heads: each KV head replicated on two ranks.
        ("qwen2", {"kv_heads": 2, "tie_word_embeddings": True, "vocab": 510}, 4),
        ("llama", {"kv_heads": 2, "attention_bias": True, "mlp_bias": True}, 2),
    ],
)
def test_ranks_together_match_hf(tiny_model_dir, arch, overrides, size) -> None:
    model_dir = tiny_model_dir(arch, **overrides)
    expected = _hf_logits(model_dir, PagedSequence(_load_arch(model_dir), PROMPT_LEN, 1).token_ids)
    for logits in run_ranks(size, lambda group: _sharded_logits(model_dir, group)):
        _assert_close(logits, expected)


def _load_arch(model_dir: Path) -> ModelArchConfig:
    return ModelArchConfig.from_dir(model_dir)


def test_loader_refuses_a_model_that_does_not_split(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("llama", kv_heads=2)  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="4 attention heads do not split across 3 ranks"):
        load_model(model_dir, torch.float32, "cpu", tp=TPGroup(TPShard(0, 3), None, "unused"))
