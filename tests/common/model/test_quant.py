"""Quantized linears against dequantize-then-matmul: GGUF tensors of every type users download,
written by the `gguf` library (blocks it cannot quantize built from the format or at random:
gguf_blocks.py, checked with its own dequantization), int8/int4 from float weights,
tensor-parallel slices, and q/k rows unpermuted while quantized.

Tolerances are bounds, not guesses: where a layer holds a GGUF type exactly (Q4_0, Q4_1, Q4_K
as int4) the only error is float32 rounding; where it requantizes (every other type, and float
weights) each weight moves by at most half a step, so the output moves by at most
sum_k |x_k| * step_nk / 2; bf16 inputs add bf16's 2^-8 on the scales and on the output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="gguf is a pdserve dependency: install pdserve")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from pdserve.common.model import quant  # noqa: E402
from pdserve.common.model.gguf import (  # noqa: E402
    RawTensor,
    dequantize_raw,
    permute_rotary,
    read_raw_tensors,
    read_tensors,
)
from pdserve.common.model.quant import (  # noqa: E402
    QuantizedLinear,
    QuantizedWeight,
    from_gguf_blocks,
    quantize_int4,
    quantize_int8,
    stack_rows,
)
from pdserve.kernels import cpu_quant  # noqa: E402
from tests.common.model.gguf_blocks import RANDOM_BLOCKS, encode  # noqa: E402

EXACT = [Q.Q4_0, Q.Q4_1, Q.Q4_K]  # held as int4 exactly
INT5 = [Q.Q5_0, Q.Q5_1]  # held as int5 exactly where the AVX2 kernel runs, else int8 per row
# Held as int8 per row (docs/quantization.md): every other type users download.
REQUANTIZED = [Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS]
BF16 = 2.0**-8  # bf16's relative rounding


@pytest.fixture
def exact_gemv(monkeypatch: pytest.MonkeyPatch):
    """Layers made here take the GEMV's AVX2 path, exact in float32: the tests that use it check
    slicing, stacking and row chunks against the dequantized product, not the AVX512-VNNI
    path's int8 activations (tests/kernels/test_cpu_quant.py checks those)."""
    monkeypatch.setenv(cpu_quant.QUANT_KERNEL_ENV, "avx2")
    cpu_quant.uses_vnni.cache_clear()
    yield
    monkeypatch.undo()
    cpu_quant.uses_vnni.cache_clear()


def _weights(rows: int = 64, cols: int = 512, seed: int = 0) -> np.ndarray:
    """Gaussian with a few large columns, as trained weights have."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[:, rng.choice(cols, 4, replace=False)] *= 8
    return w


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, Q]]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, encode(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _raw(tmp_path: Path, w: np.ndarray, qtype: Q) -> RawTensor:
    """w written to a file as blk.0.ffn_up.weight, read back raw as its HF name."""
    path = _write(tmp_path / "t.gguf", {"blk.0.ffn_up.weight": (w, qtype)})
    (raw,) = read_raw_tensors(path, ["model.layers.0.mlp.up_proj.weight"], 1, 1, 1)
    assert raw.name == "model.layers.0.mlp.up_proj.weight" and raw.shape == w.shape
    return raw


def _half_step_bound(x: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The largest output move when every weight [out, in] moves by up to half its step."""
    return x.abs().double() @ (step.double() / 2).T


def _requant_step(weight: QuantizedWeight) -> torch.Tensor:
    """Each weight's quantization step, [out, in]."""
    if weight.group_size is None:
        return weight.scales.expand(-1, weight.in_features)
    return weight.scales.repeat_interleave(weight.group_size, dim=1)


def _assert_close(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    err = (got.double() - want.double()).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("qtype", EXACT + REQUANTIZED, ids=lambda q: q.name)
def test_hand_built_and_library_blocks_decode_as_gguf_does(tmp_path: Path, qtype: Q) -> None:
    w = _weights()
    raw = _raw(tmp_path, w, qtype)
    want = gguf.quants.dequantize(raw.blocks, qtype).reshape(w.shape)
    np.testing.assert_allclose(dequantize_raw(raw), want, rtol=1e-6, atol=1e-7)
    if qtype in RANDOM_BLOCKS:
        return  # random blocks at w's scale: the reading is what is tested
    # The blocks hold w: within each 32 values, the error stays under the share of their
    # largest magnitude that the type's levels allow (a wrong layout would move whole values).
    share = {Q.Q8_0: 0.005, Q.Q6_K: 0.03}.get(qtype, 0.13)
    peak = np.abs(w).reshape(len(w), -1, 32).max(axis=-1, keepdims=True)
    assert (np.abs(want - w).reshape(len(w), -1, 32) <= share * peak).all()


@pytest.mark.parametrize("qtype", EXACT + REQUANTIZED, ids=lambda q: q.name)
def test_a_gguf_tensor_multiplies_as_its_dequantized_float(tmp_path: Path, qtype: Q) -> None:
    w = _weights()
    raw = _raw(tmp_path, w, qtype)
    dequantized = torch.from_numpy(gguf.quants.dequantize(raw.blocks, qtype).reshape(w.shape))
    weight = from_gguf_blocks(raw)
    int5 = 5 if cpu_quant.available() else 8
    assert weight.bits == (4 if qtype in EXACT else int5 if qtype in INT5 else 8)
    x = torch.randn(5, w.shape[1])
    want = x @ dequantized.T
    rounding = 1e-5 * (x.abs() @ dequantized.abs().T)  # float32 sums of 512 products
    exact = weight.bits in (4, 5)  # the type's own values and scales
    requant = 0 if exact else _half_step_bound(x, _requant_step(weight))
    exact = QuantizedLinear(weight, scale_dtype=torch.float32)
    _assert_close(exact(x), want, rounding + requant + _q8_bound(exact, x, dequantized))
    # bf16: the activations rounded first; bf16 scales (and zeros) and output cost 2^-8 each.
    xb = x.bfloat16()
    layer = QuantizedLinear(weight)
    got = layer(xb)
    assert got.dtype == torch.bfloat16
    want_b = xb.float() @ dequantized.T
    scaled = 3 * BF16 * (xb.float().abs() @ dequantized.abs().T)
    _assert_close(got, want_b, scaled + requant * (1 + BF16) + _q8_bound(layer, xb, dequantized))


def _q8_bound(layer: QuantizedLinear, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the GEMV's AVX512-VNNI path adds (kernels/cpu_quant.py): each activation rounded
    to int8 per 32 columns moves by up to half a step, its block's amax / 254; 0 elsewhere."""
    if not layer.vnni:
        return torch.zeros(())
    blocks = x.float().abs().view(x.shape[0], -1, 32)
    half_step = (blocks.amax(2, keepdim=True) / 254).expand_as(blocks).reshape(x.shape)
    return (half_step.double() @ weight.abs().double().T) * (1 + BF16)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
def test_the_other_width_also_converts(tmp_path: Path, qtype: Q) -> None:
    raw = _raw(tmp_path, _weights(), qtype)
    bits = 8 if qtype == Q.Q4_K else 4
    weight = from_gguf_blocks(raw, bits)
    assert weight.bits == bits
    x = torch.randn(3, raw.shape[1])
    bound = _half_step_bound(x, _requant_step(weight)) + 1e-4
    _assert_close(
        QuantizedLinear(weight, scale_dtype=torch.float32)(x),
        x @ torch.from_numpy(dequantize_raw(raw)).T,
        bound,
    )


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_from_float_is_within_half_a_step_of_the_float_matmul(mode: str) -> None:
    w = torch.from_numpy(_weights(48, 256))
    bias = torch.randn(48)
    layer = QuantizedLinear.from_float(w, bias, mode)  # type: ignore[arg-type]
    weight = quantize_int8(w) if mode == "int8" else quantize_int4(w)
    assert (weight.dequantize() - w).abs().max() <= _requant_step(weight).max() / 2 * 1.001
    x = torch.randn(2, 3, 256)  # leading dims as nn.Linear takes them
    want = torch.nn.functional.linear(x, w, bias)
    bound = _half_step_bound(x.view(-1, 256), _requant_step(weight)).view(2, 3, 48)
    exact = QuantizedLinear(weight, bias, scale_dtype=torch.float32)
    got = exact(x)
    assert got.shape == (2, 3, 48) and got.dtype == torch.float32
    _assert_close(got, want, bound + 1e-4)
    # The bf16-scaled layer from from_float, in float32 and in bf16.
    _assert_close(layer(x), want, bound * (1 + BF16) + 2 * BF16 * (x.abs() @ w.abs().T))
    got_b = layer(x.bfloat16())
    assert got_b.dtype == torch.bfloat16
    scale = x.abs() @ w.abs().T + bias.abs()
    _assert_close(got_b, want, bound * (1 + BF16) + 4 * BF16 * scale)
    with pytest.raises(ValueError, match="int8 or int4"):
        QuantizedLinear.from_float(w, None, "int2")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_dense_path_equals_the_weight_only_kernel(mode: str) -> None:
    w = torch.from_numpy(_weights(320, 256))  # not a whole number of dense chunks
    weight = quantize_int8(w) if mode == "int8" else quantize_int4(w)
    dense = QuantizedLinear(weight, dense_rows=1)
    kernel = QuantizedLinear(weight, dense=False)
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        assert dense.dense_rows == 1  # the int4 layout check passed: this build is read
    x = torch.randn(7, 256).bfloat16()
    bound = 4 * BF16 * (x.float().abs() @ weight.dequantize().abs().T)
    _assert_close(dense(x), kernel(x), bound)
    _assert_close(dense(x), x.float() @ weight.dequantize().T, bound)
    # float32 inputs always take the kernel (float32 matmul never beat it).
    torch.testing.assert_close(dense(x.float()), kernel(x.float()))


def test_int4_packs_in_row_chunks_as_it_packs_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    values = torch.randint(0, 16, (320, 128), dtype=torch.int8)
    whole = quant._pack_int4(values)
    monkeypatch.setattr(quant, "_CONVERT_CHUNK", 128)
    assert torch.equal(quant._pack_int4(values), whole)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_shard_is_the_slice_of_the_dequantized_weight(mode: str, exact_gemv: None) -> None:
    w = torch.from_numpy(_weights(64, 256))
    weight = quantize_int8(w) if mode == "int8" else quantize_int4(w)
    full = weight.dequantize()
    x = torch.randn(3, 256)
    for rank in range(2):
        rows = weight.shard(0, rank, 2)
        torch.testing.assert_close(rows.dequantize(), full[32 * rank : 32 * (rank + 1)])
        cols = weight.shard(1, rank, 4)
        piece = slice(64 * rank, 64 * (rank + 1))
        torch.testing.assert_close(cols.dequantize(), full[:, piece])
        got = QuantizedLinear(cols, scale_dtype=torch.float32)(x[:, piece])
        torch.testing.assert_close(got, x[:, piece] @ full[:, piece].T, rtol=1e-4, atol=1e-4)
    # Row-parallel pieces add up to the whole product (what the all-reduce does).
    parts = [QuantizedLinear(weight.shard(1, r, 2), scale_dtype=torch.float32) for r in range(2)]
    total = sum(p(x[:, 128 * r : 128 * (r + 1)]) for r, p in enumerate(parts))
    torch.testing.assert_close(total, x @ full.T, rtol=1e-4, atol=1e-4)


def test_shards_that_split_a_group_or_do_not_divide_are_refused() -> None:
    weight = quantize_int4(torch.from_numpy(_weights(64, 256)))
    with pytest.raises(ValueError, match="not aligned to the group size 32"):
        weight.shard(1, 0, 16)  # 16 columns each
    with pytest.raises(ValueError, match="cannot split 64 along dim 0 into 3"):
        weight.shard(0, 0, 3)
    with pytest.raises(ValueError, match="rank 2"):
        weight.shard(0, 2, 2)
    with pytest.raises(ValueError, match=r"no \[48, 80\) along dim 0 of 64"):
        weight.narrow(0, 48, 32)
    with pytest.raises(ValueError, match="along dim 2"):
        weight.narrow(2, 0, 1)
    # A head range (k/v heads replicated across ranks) is a narrow of whole rows.
    torch.testing.assert_close(weight.narrow(0, 16, 32).dequantize(), weight.dequantize()[16:48])
    # int8 has one scale per row: any even column split keeps it.
    per_row = quantize_int8(torch.from_numpy(_weights(64, 256)))
    assert per_row.shard(1, 3, 16).dequantize().shape == (64, 16)


def test_q_and_k_rows_unpermute_while_quantized(tmp_path: Path) -> None:
    heads, kv_heads, head_dim, hidden = 4, 2, 16, 256
    q = _weights(heads * head_dim, hidden, seed=1)
    k = _weights(kv_heads * head_dim, hidden, seed=2)
    path = _write(
        tmp_path / "qk.gguf",
        {
            "blk.0.attn_q.weight": (permute_rotary(q, heads), Q.Q4_K),
            "blk.0.attn_k.weight": (permute_rotary(k, kv_heads), Q.Q6_K),
        },
    )
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"]
    floats = dict(read_tensors(path, names, 1, heads, kv_heads))
    raws = {r.name: r for r in read_raw_tensors(path, names, 1, heads, kv_heads)}
    assert raws.keys() == floats.keys() == set(names)
    for name in names:
        # Moving whole rows of blocks commutes with decoding them.
        np.testing.assert_array_equal(dequantize_raw(raws[name]), floats[name])
    # And the float path's result is the original order, up to the quantization.
    assert np.abs(floats[names[0]] - q).max() < np.abs(q).max() / 15


def test_unsupported_gguf_types_and_shapes_are_named() -> None:
    raw = RawTensor("w", "IQ2_XS", np.zeros((16, 64), np.uint8), (16, 256))
    with pytest.raises(ValueError, match=r"tensor w: GGUF type IQ2_XS .*supported: Q4_0"):
        from_gguf_blocks(raw)
    vector = RawTensor("norm", "Q8_0", np.zeros((1, 34), np.uint8), (32,))
    with pytest.raises(ValueError, match="2-D"):
        from_gguf_blocks(vector)
    short = RawTensor("w", "Q4_K", np.zeros((16, 143), np.uint8), (16, 256))
    with pytest.raises(ValueError, match=r"\(16, 143\) bytes are not Q4_K blocks of \(16, 256\)"):
        from_gguf_blocks(short)


def test_int4_kernel_limits_are_named() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        QuantizedLinear(quantize_int4(torch.randn(24, 64)))
    with pytest.raises(ValueError, match="group size 16"):
        QuantizedLinear(quantize_int4(torch.randn(32, 64), group_size=16))
    with pytest.raises(ValueError, match="not a multiple of the group size"):
        quantize_int4(torch.randn(32, 48))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_batch_size_rule_picks_the_path(
    mode: str, monkeypatch: pytest.MonkeyPatch, exact_gemv: None
) -> None:
    """The dense thresholds of the AVX2 path and torch's kernels (VNNI's GEMM takes every row
    count: tests/kernels/test_cpu_quant.py)."""
    w = torch.from_numpy(_weights(64, 256))
    layer = QuantizedLinear(quantize_int8(w) if mode == "int8" else quantize_int4(w))
    threshold = quant.DENSE_ROWS[8 if mode == "int8" else 4]
    if layer.dense_rows is None and mode == "int4":  # AVX2 builds pack int4 another way
        pytest.skip("this torch build's int4 packing is not read: the layer keeps the kernel")
    assert layer.dense_rows == threshold
    dense_rows: list[int] = []
    real = layer._dense
    monkeypatch.setattr(layer, "_dense", lambda x: dense_rows.append(len(x)) or real(x))
    # int4 in the AVX2 kernel's layout: the kernel up to GEMV_ROWS (MAX_ROWS a call),
    # dequantized past them.
    start = quant.GEMV_ROWS + 1 if layer.mins is not None else threshold
    for rows in (1, start - 1, start, start + 5):
        layer(torch.randn(rows, 256).bfloat16())
    assert dense_rows == [start, start + 5]
    dense_rows.clear()
    floor = quant.DENSE_ROWS_FLOAT32[8 if mode == "int8" else 4]  # float32: torch's are slow
    if layer.gemv:  # the AVX2 kernel serves float32 rows up to its limit
        floor = (quant.GEMV_ROWS if layer.mins is not None else cpu_quant.MAX_ROWS) + 1
    for rows in (1, floor, threshold - 1):
        layer(torch.randn(rows, 256))
    assert dense_rows == [rows for rows in (1, floor, threshold - 1) if rows >= floor]
    assert QuantizedLinear(quantize_int8(w), dense=False).dense_rows is None
    assert QuantizedLinear(quantize_int8(w), dense_rows=7).dense_rows == 7


def test_a_bf16_int8_layer_takes_the_kernel_below_its_dense_rows(
    monkeypatch: pytest.MonkeyPatch, exact_gemv: None
) -> None:
    """A bf16 engine's int8 layers (SmolLM2's tied head) run the GEMV below their dense rows,
    where torch's `_weight_int8pack_mm` ran before at twice the time; the sums are the
    weight's, in float32."""
    layer = QuantizedLinear(quantize_int8(torch.from_numpy(_weights(64, 256))))
    if not layer.gemv:
        pytest.skip("no cpu_quant kernel on this machine")
    calls: list[int] = []
    real = layer._gemv
    monkeypatch.setattr(layer, "_gemv", lambda x: calls.append(len(x)) or real(x))
    weight = layer.qweight.float() * layer.scales.float()[:, None]
    for rows in (1, 3):
        x = torch.randn(rows, 256).bfloat16()
        torch.testing.assert_close(layer(x), (x.float() @ weight.T).bfloat16())
    assert calls == [1, 3]
    layer(torch.randn(layer.dense_rows, 256).bfloat16())  # dense from there on, as before
    assert calls == [1, 3]


def test_rows_past_one_kernel_call_are_sliced_and_equal_the_dense_path(exact_gemv: None) -> None:
    w = torch.from_numpy(_weights(64, 256))
    layer = QuantizedLinear(quantize_int4(w))
    if layer.mins is None:
        pytest.skip("no AVX2 kernel here: int4 stays in torch's packing")
    for rows in (cpu_quant.MAX_ROWS + 1, 2 * cpu_quant.MAX_ROWS + 3, quant.GEMV_ROWS):
        x = torch.randn(rows, 256)
        assert not layer._takes_dense(x)
        torch.testing.assert_close(layer(x), layer._dense(x), rtol=1e-4, atol=1e-4)


def test_stacked_rows_are_the_weights_one_after_another(exact_gemv: None) -> None:
    parts = [quantize_int4(torch.from_numpy(_weights(rows, 128, rows))) for rows in (32, 16, 16)]
    stacked = stack_rows(parts)
    want = torch.cat([p.dequantize() for p in parts])
    torch.testing.assert_close(stacked.dequantize(), want)
    x = torch.randn(2, 128)
    got = QuantizedLinear(stacked, scale_dtype=torch.float32)(x)
    torch.testing.assert_close(got, x @ want.T, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="one width"):
        stack_rows([parts[0], quantize_int8(torch.randn(16, 128))])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 200])  # weight-only kernel, and the dense path
def test_stacked_layers_give_their_parts_outputs_exactly(bits: int, rows: int) -> None:
    """Fused q/k/v and gate/up (`QuantizedLinear.stacked`): packed rows joined as they are,
    so each output is bit for bit what its own layer gives, biases included."""
    quantize = quantize_int4 if bits == 4 else quantize_int8
    parts = [
        QuantizedLinear(quantize(torch.randn(out, 256)), torch.randn(out)) for out in (192, 64, 320)
    ]
    fused = QuantizedLinear.stacked(parts)
    assert fused is not None and fused.out_features == 576
    x = torch.randn(rows, 256).bfloat16()
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=1))
    int4 = [QuantizedLinear(quantize_int4(torch.randn(out, 256))) for out in (64, 48)]
    if int4[0].mins is None:  # torch's packing
        assert QuantizedLinear.stacked(int4) is None  # 48 rows: not whole blocks of 64
    else:  # the AVX2 kernel's layout joins any rows
        x4 = torch.randn(rows, 256)
        assert torch.equal(QuantizedLinear.stacked(int4)(x4), torch.cat([p(x4) for p in int4], 1))
    other = quantize_int8 if bits == 4 else quantize_int4
    mixed = [parts[0], QuantizedLinear(other(torch.randn(64, 256)), torch.randn(64))]
    assert QuantizedLinear.stacked(mixed) is None  # two widths


def test_a_device_other_than_the_cpu_is_refused_by_name() -> None:
    layer = QuantizedLinear(quantize_int8(torch.randn(16, 64)))
    with pytest.raises(NotImplementedError, match="CPU only"):
        layer(torch.empty(2, 64, device="meta"))


def test_every_other_tensor_reads_raw_and_dequantizes_as_read_tensors_does(tmp_path: Path) -> None:
    norm = np.linspace(-1, 1, 64, dtype=np.float32)
    embed = _weights(32, 64)
    tensors = {
        "blk.0.attn_norm.weight": (norm, Q.F32),
        "token_embd.weight": (embed, Q.F16),
        "blk.0.ffn_up.weight": (embed, Q.Q4_1),
    }
    path = _write(tmp_path / "t.gguf", tensors)
    names = [
        "model.layers.0.input_layernorm.weight",
        "model.embed_tokens.weight",
        "model.layers.0.mlp.up_proj.weight",
    ]
    floats = dict(read_tensors(path, names, 1, 1, 1))
    raws = list(read_raw_tensors(path, names, 1, 1, 1))
    assert [(r.name, r.qtype_name, r.shape) for r in raws] == [
        (names[0], "F32", (64,)),
        (names[1], "F16", (32, 64)),
        (names[2], "Q4_1", (32, 64)),
    ]
    for raw in raws:
        np.testing.assert_allclose(dequantize_raw(raw), floats[raw.name], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(dequantize_raw(raws[0]), norm)
