"""The CPU LM-head kernels (kernels/ops.py) against F.linear over the row counts an
engine runs, and how a model takes them (`use_cpu_head`): an untied head packed with no plain
copy left, a tied one chunked with its embedding untouched, PDSERVE_CPU_LINEAR=off leaving it
as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.common.engine.llm import LLM
from pdserve.common.model import llama
from pdserve.common.model.weights import load_model
from pdserve.kernels.ops import (
    CPU_LINEAR_ENV,
    HEAD_CHUNK,
    PackedLinear,
    chunked_linear,
    cpu_linear_enabled,
    packed_numel,
    packs,
)
from tests.common.test_model import BLOCK_SIZE, NUM_BLOCKS, PagedSequence
from tests.common.test_model import _step as step

# Decode batches 1..64 and prefill chunks: the rows the head and the decoder see.
ROWS = (0, 1, 2, 3, 4, 16, 64, 256, 512)
# A vocabulary that is not a multiple of HEAD_CHUNK: a short last chunk.
VOCAB = 2 * HEAD_CHUNK + 300


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float32 summation order over K = 96 terms of unit scale."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    return torch.randn(VOCAB, 96, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(weight: torch.Tensor, rows: int, bias: bool) -> None:
    b = torch.randn(VOCAB) if bias else None
    x = torch.randn(rows, weight.shape[1])
    close(PackedLinear(weight, b)(x), F.linear(x, weight, b))


def test_packed_linear_keeps_leading_dims_and_refuses_other_dtypes(weight: torch.Tensor) -> None:
    layer = PackedLinear(weight)
    x = torch.randn(3, 2, weight.shape[1])
    close(layer(x), F.linear(x, weight))
    with pytest.raises(ValueError, match="float32 input"):
        layer(x.bfloat16())
    with pytest.raises(ValueError, match="float32 or bf16 CPU weight"):
        PackedLinear(weight.half())


needs_bf16 = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 here"
)


def close_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to bf16 rounding of the output (both sides sum bf16 products in float32)."""
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=2e-2)


@needs_bf16
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_packed_linear_equals_f_linear(weight: torch.Tensor, rows: int, bias: bool) -> None:
    w = weight.bfloat16()
    b = torch.randn(VOCAB).bfloat16() if bias else None
    x = torch.randn(rows, weight.shape[1]).bfloat16()
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    close_bf16(PackedLinear(w, b)(x), want)
    with pytest.raises(ValueError, match="bfloat16 input"):
        PackedLinear(w)(x.float())


@pytest.mark.parametrize("rows", ROWS)
def test_chunked_linear_equals_f_linear(weight: torch.Tensor, rows: int) -> None:
    x = torch.randn(rows, weight.shape[1])
    close(chunked_linear(x, weight), F.linear(x, weight))


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CPU_LINEAR_ENV, raising=False)
    assert cpu_linear_enabled()
    monkeypatch.setenv(CPU_LINEAR_ENV, "off")
    assert not cpu_linear_enabled()
    monkeypatch.setenv(CPU_LINEAR_ENV, "fast")
    with pytest.raises(ValueError, match="auto or off"):
        cpu_linear_enabled()


def head_logits(model: nn.Module, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """compute_logits of `rows` random hidden states, and F.linear's over the plain weight."""
    hidden = torch.randn(rows, model.config.hidden_size)
    plain = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return hidden, F.linear(hidden, plain)


@pytest.mark.parametrize("tied", [False, True])
def test_a_model_takes_its_head_kernel(tiny_model_dir, tied: bool) -> None:
    model, _ = load_model(
        tiny_model_dir("llama", vocab=VOCAB, tie_word_embeddings=tied), torch.float32, "cpu"
    )
    hidden, wants = zip(*[head_logits(model, rows) for rows in (1, 5, 64)], strict=True)
    held = sum(p.numel() for p in model.parameters())
    assert model.use_cpu_head() == ("chunked" if tied else "packed")
    assert sum(p.numel() for p in model.parameters()) + packed_numel(model) == held
    for h, want in zip(hidden, wants, strict=True):
        close(model.compute_logits(h), want)
    names = {name for name, _ in model.named_parameters()}
    assert "lm_head.weight" not in names, "the plain head is dropped once packed"
    assert "model.embed_tokens.weight" in names, "the embedding keeps its rows"


def test_off_and_emulated_bf16_leave_the_head_as_it_was(tiny_model_dir, monkeypatch) -> None:
    model_dir = tiny_model_dir("llama", vocab=VOCAB, tie_word_embeddings=False)
    monkeypatch.setenv(CPU_LINEAR_ENV, "off")
    model, _ = load_model(model_dir, torch.float32, "cpu")
    assert model.use_cpu_head() == ""
    assert type(model.lm_head) is nn.Linear
    monkeypatch.delenv(CPU_LINEAR_ENV)
    monkeypatch.setattr(llama, "cpu_bf16_flag", lambda: None)  # an AVX2 CPU
    model, _ = load_model(model_dir, torch.bfloat16, "cpu")
    assert model.use_cpu_head() == "" and type(model.lm_head) is nn.Linear
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear


def step_logits(model: nn.Module, config) -> torch.Tensor:
    """Logits of a 9-token prefill, then of 4 decode steps, on a fresh bf16 paged cache."""
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    caches = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(config.num_layers)]
    seq = PagedSequence(config, 13, seed=1, caches=caches)
    rows = [step(model, [seq], [(0, 9)])] + [step(model, [seq], [(t, t + 1)]) for t in range(9, 13)]
    return torch.cat(rows)


@needs_bf16
@pytest.mark.parametrize("tied", [False, True])
def test_a_bf16_model_on_native_bf16_packs_its_linears(tiny_model_dir, monkeypatch, tied) -> None:
    monkeypatch.setattr(llama, "cpu_bf16_flag", lambda: "amx_bf16")  # what AMX reports
    model_dir = tiny_model_dir("llama", vocab=VOCAB, tie_word_embeddings=tied)
    model, config = load_model(model_dir, torch.bfloat16, "cpu")
    want = step_logits(model, config)
    assert model.use_cpu_head() == "bf16 packed"
    kinds = {type(m) for layer in model.model.layers for m in (*layer.self_attn.children(),)}
    kinds |= {type(m) for layer in model.model.layers for m in layer.mlp.children()}
    assert nn.Linear not in kinds and PackedLinear in kinds
    assert isinstance(model.lm_head, PackedLinear)
    names = {name for name, _ in model.named_parameters()}
    assert "model.embed_tokens.weight" in names, "the embedding keeps its rows"
    got = step_logits(model, config)
    # bf16 products summed in another order, over a few layers: a few bf16 ulps of the logits
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_bf16_model_with_a_quantized_embedding_packs_its_decoder(
    tiny_model_dir, monkeypatch
) -> None:
    """A GGUF's bf16 model under `auto` holds its embedding quantized (no `.weight`): the
    packing decision reads the model's dtype elsewhere (it raised AttributeError at load)."""
    from pdserve.common.model.quant import QuantizedEmbedding, quantize_int8

    monkeypatch.setattr(llama, "cpu_bf16_flag", lambda: "amx_bf16")
    model, _ = load_model(tiny_model_dir("llama", vocab=VOCAB), torch.bfloat16, "cpu")
    weight = model.model.embed_tokens.weight.detach().float()
    model.model.embed_tokens = QuantizedEmbedding(quantize_int8(weight), torch.bfloat16)
    model.lm_head = None  # tied: the quantized embedding is the head
    native = packs(torch.zeros(64, 64, dtype=torch.bfloat16), native_bf16=True)
    assert model.use_cpu_head() == ("bf16 packed" if native else "")
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding) and model.lm_head is None


def test_an_eager_cpu_engine_packs_its_head(tiny_model_dir) -> None:
    model_dir = str(tiny_model_dir("llama", vocab=VOCAB, tie_word_embeddings=False))
    llm = LLM(
        model_dir,
        dtype="float32",
        skip_tokenizer_init=True,
        enforce_eager=True,
        kv_cache_bytes=1 << 20,
    )
    assert isinstance(llm.engine.runner.model.lm_head, PackedLinear)
