"""The int8/int5/int4 GEMV (kernels/cpu_quant.py) against dequantize-then-matmul in float32, on
the AVX2 path and, where the CPU has it, the AVX512-VNNI one (its activation rounded to int8 per
32 columns in the reference as the kernel rounds it)."""

from __future__ import annotations

import fcntl
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from pdserve.common.model.quant import (
    QuantizedEmbedding,
    QuantizedLinear,
    quantize_int4,
    quantize_int8,
    quantized_head,
)
from pdserve.kernels import cpu_quant

pytestmark = [
    pytest.mark.skipif(
        shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler"
    ),
    pytest.mark.skipif(not cpu_quant.cpu_has_avx2_fma(), reason="no AVX2+FMA on this CPU"),
]

# Shapes (N, K): SmolLM2's, small ones, and for int8 K off any multiple of 8 or 32.
INT8_SHAPES = [(48, 77), (17, 32), (576, 576), (192, 1536), (100, 45), (33, 1)]
# (N, K, group): int4 takes K a multiple of its group, itself a multiple of 32.
INT4_CASES = [(48, 64, 32), (48, 64, 64), (17, 32, 32), (576, 576, 32), (576, 576, 64)]
INT4_CASES += [(192, 1536, 128), (40, 96, 32)]


# Input rows: the GEMV's (1-3; VNNI's GEMM from 4, cpu_quant_gemm.cpp's GEMM_ROWS), passes of
# 4 with each remainder (5-7, 10, 11, 13, 15, 17), whole passes (4, 8, 12, 16, 64); the AVX2 path
# takes them 8 a call, also with each remainder.
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 15, 16, 17, 64]

# The kernel's paths this CPU runs: AVX2 (False) everywhere, AVX512-VNNI (True) where it has it.
PATHS = [False] + ([True] if cpu_quant.cpu_has_avx512_vnni() else [])
path = pytest.mark.parametrize("vnni", PATHS, ids=lambda v: "vnni" if v else "avx2")


def _q8(x: torch.Tensor) -> torch.Tensor:
    """x's rows as the VNNI path reads them: int8 per 32 columns (scale amax / 127, rounded to
    nearest even), back in float32."""
    rows, cols = x.shape
    blocks = x.view(rows, cols // 32, 32)
    amax = blocks.abs().amax(2, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127)).view(rows, cols)


def _want(
    x: torch.Tensor, weight: torch.Tensor, vnni: bool, mins: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T as a path computes it: on VNNI's, x rounded by `_q8`, except in the term of
    the minimums (w = scale * v + minimum per 32 columns), which take x's exact block sums."""
    if not vnni:
        return x @ weight.T
    if mins is None:
        return _q8(x) @ weight.T
    spread = mins.float().repeat_interleave(32, dim=1)
    return _q8(x) @ (weight - spread).T + x @ spread.T


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # float32 sums in another order: relative to the size of the terms summed.
    tol = 1e-5 * want.abs().max().item() + 1e-5
    torch.testing.assert_close(got, want, rtol=1e-4, atol=tol)


@path
@pytest.mark.parametrize("shape", INT8_SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_int8_equals_the_dequantized_matmul(shape: tuple[int, int], rows: int, vnni: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + shape[1])
    n, k = shape
    weight = quantize_int8(torch.randn(n, k, generator=gen))
    x = torch.randn(rows, k, generator=gen)
    got = cpu_quant.int8_mm(x, weight.values, weight.scales[:, 0].contiguous(), vnni)
    # K off a multiple of 32 (no model's) takes the AVX2 path on either
    _close(got, _want(x, weight.dequantize(), vnni and k % 32 == 0))


@path
@pytest.mark.parametrize(("n", "k", "group"), INT4_CASES)
@pytest.mark.parametrize("rows", ROWS)
def test_int4_equals_the_dequantized_matmul(
    n: int, k: int, group: int, rows: int, vnni: bool
) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + k + group)
    weight = quantize_int4(torch.randn(n, k, generator=gen) + 0.3, group)
    x = torch.randn(rows, k, generator=gen)
    pack = cpu_quant.pack_int4(weight.values, weight.scales, weight.zeros, group)
    _close(cpu_quant.int4_mm(x, pack, vnni), _want(x, weight.dequantize(), vnni, pack.mins))
    torch.testing.assert_close(cpu_quant.unpack_int4(pack), weight.dequantize())
    torch.testing.assert_close(cpu_quant.unpack_int4(pack, 5, 9), weight.dequantize()[5:9])


VNNI = pytest.mark.skipif(not cpu_quant.cpu_has_avx512_vnni(), reason="no AVX512-VNNI on this CPU")


@VNNI
@pytest.mark.parametrize(("n", "k", "group"), INT4_CASES)
@pytest.mark.parametrize("rows", [*ROWS, 18, 33])
def test_int4_tiles_equal_the_dequantized_matmul(n: int, k: int, group: int, rows: int) -> None:
    """An int4 weight in tile order (the VNNI layers' form) against the reference at every
    pass remainder, in place (to 16 rows) and unpacked once (past them), with a short last tile
    where N is off a multiple of 16; against the row-major kernel only by float order."""
    gen = torch.Generator().manual_seed(rows * 1000 + k + group)
    weight = quantize_int4(torch.randn(n, k, generator=gen) + 0.3, group)
    x = torch.randn(rows, k, generator=gen)
    pack = cpu_quant.pack_int4(weight.values, weight.scales, weight.zeros, group)
    tiles = cpu_quant.tile_int4(pack)
    assert tiles.nibbles.shape == (-(-n // 16) * 16, k // 2) and tiles.out_features == n
    got = cpu_quant.int4_mm(x, tiles, True)
    _close(got, _want(x, weight.dequantize(), True, pack.mins))
    rows_major = cpu_quant.int4_mm(x, pack, True)
    assert (got - rows_major).abs().max() <= 1e-5 * rows_major.abs().max()
    back = cpu_quant.untile_int4(tiles)
    for field in ("nibbles", "scales", "mins"):
        assert torch.equal(getattr(back, field), getattr(pack, field)), field
    torch.testing.assert_close(cpu_quant.unpack_int4(tiles, 5, 9), weight.dequantize()[5:9])


@VNNI
@pytest.mark.parametrize(("n", "k"), [(48, 64), (17, 32), (40, 96), (100, 64), (192, 1536)])
@pytest.mark.parametrize("rows", [*range(1, 18), 33, 64])
def test_int8_tiles_equal_the_row_major_kernel_to_the_bit(n: int, k: int, rows: int) -> None:
    """An int8 weight in tile order (the VNNI layers' form, N off 16: a short last tile) gives
    the row-major GEMM's outputs bit for bit: the same integers and float order. Below the
    GEMM's 4 rows the row-major kernel is a GEMV (another order), so those rows are compared
    with the same rows of a 4-row row-major call (each row's sums are its own)."""
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    weight = quantize_int8(torch.randn(n, k, generator=gen))
    scales = weight.scales[:, 0].contiguous()
    x = torch.randn(rows, k, generator=gen)
    tiles = cpu_quant.Int8Tiles(cpu_quant.tile_int8(weight.values), n)
    assert tiles.values.shape == (-(-n // 16) * 16, k)
    got = cpu_quant.int8_mm(x, tiles, scales, True)
    four = torch.cat([x, x[:1].expand(max(0, 4 - rows), k)])
    assert torch.equal(got, cpu_quant.int8_mm(four, weight.values, scales, True)[:rows])
    _close(got, _want(x, weight.dequantize(), True))
    for start, end in ((0, n), (16, n), (0, min(n, 16))):
        back = cpu_quant.untile_int8(tiles.values, start, end)
        assert torch.equal(back, weight.values[start:end]), (start, end)
    index = torch.tensor([n - 1, 0, 5, 5, n // 2, 16 % n])
    assert torch.equal(cpu_quant.int8_tile_rows(tiles.values, index), weight.values[index])


def test_int4_tiles_refuse_the_avx2_path() -> None:
    weight = quantize_int4(torch.randn(32, 64))
    tiles = cpu_quant.tile_int4(QuantizedLinear.pack_for_gemv(weight))
    with pytest.raises(ValueError, match="VNNI path only"):
        cpu_quant.int4_mm(torch.randn(2, 64), tiles, False)
    weight8 = quantize_int8(torch.randn(32, 64))
    tiles8 = cpu_quant.Int8Tiles(cpu_quant.tile_int8(weight8.values), 32)
    with pytest.raises(ValueError, match="VNNI path only"):
        cpu_quant.int8_mm(torch.randn(2, 64), tiles8, weight8.scales[:, 0].contiguous(), False)


@VNNI
def test_a_tied_embedding_looks_its_rows_up_from_the_heads_tiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bf16 engine's quantized embedding keeps one int8 weight, its head's, in tile order
    (N off 16 here), and its lookup equals the row-major one bit for bit."""
    monkeypatch.setenv(cpu_quant.QUANT_KERNEL_ENV, "vnni")
    cpu_quant.uses_vnni.cache_clear()
    try:
        weight = quantize_int8(torch.randn(100, 64, generator=torch.Generator().manual_seed(5)))
        embed = QuantizedEmbedding(weight, torch.bfloat16)
        assert embed.head.tiled and embed.head.qweight.dtype == torch.uint8
        assert [name for name, _ in embed.named_buffers()] == ["head.qweight", "head.scales"]
        ids = torch.tensor([[99, 0, 17], [16, 15, 99]])
        want = weight.values[ids].bfloat16() * weight.scales[ids, 0].bfloat16()[..., None]
        assert torch.equal(embed(ids), want)
    finally:
        cpu_quant.uses_vnni.cache_clear()


def _int5(n: int, k: int, seed: int) -> tuple[torch.Tensor, cpu_quant.Int5Pack]:
    """A random 5-bit weight (Q5_1's form: f16 scale and minimum per 32 columns) and its pack;
    the float32 weight it stands for is computed here from the values, not unpacked."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 32, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.1).half().float()
    mins = (torch.randn(n, k // 32, generator=gen) * 0.2).half().float()
    pack = cpu_quant.pack_int5(values, scales, mins + 16 * scales)
    torch.testing.assert_close(pack.mins.float(), mins)  # held exactly, as the file's f16
    groups = values.float().view(n, -1, 32) * scales[..., None] + mins[..., None]
    return groups.view(n, k), pack


@path
@pytest.mark.parametrize(("n", "k"), [(48, 64), (17, 32), (576, 576), (192, 896)])
@pytest.mark.parametrize("rows", ROWS)
def test_int5_equals_the_dequantized_matmul(n: int, k: int, rows: int, vnni: bool) -> None:
    weight, pack = _int5(n, k, rows * 1000 + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    _close(cpu_quant.int5_mm(x, pack, vnni), _want(x, weight, vnni, pack.mins))
    torch.testing.assert_close(cpu_quant.unpack_rows(pack, slice(None)), weight)
    index = torch.tensor([5, 0, 5, n - 1])
    torch.testing.assert_close(cpu_quant.unpack_rows(pack, index), weight[index])


@path
def test_int5_reads_each_column_with_its_fifth_bit(vnni: bool) -> None:
    """One-hot inputs read single columns (int8 holds them exactly): a fifth bit on the wrong
    column moves a value by 16 steps."""
    weight, pack = _int5(64, 96, 7)  # three blocks: a pair and the odd one VNNI takes alone
    for first in (0, 8, 16, 24, 32, 56, 64, 88):
        eye = torch.eye(96)[first : first + 8].contiguous()
        got = cpu_quant.int5_mm(eye, pack, vnni)
        torch.testing.assert_close(got, weight[:, first : first + 8].T)


def test_int5_refuses_misshapen_planes() -> None:
    _, pack = _int5(16, 64, 1)
    with pytest.raises(RuntimeError, match="high bits"):
        cpu_quant._module().int5_mm(
            torch.randn(1, 64), pack.nibbles, pack.high[:, :4], pack.scales, pack.mins, False
        )
    with pytest.raises(RuntimeError, match="float16"):
        cpu_quant._module().int5_mm(
            torch.randn(1, 64), pack.nibbles, pack.high, pack.scales.float(), pack.mins, False
        )
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_quant.pack_int5(
            torch.zeros(4, 48, dtype=torch.int8), torch.ones(4, 1), torch.ones(4, 1)
        )


@path
def test_each_output_row_is_its_own_weight_row(vnni: bool) -> None:
    """One-hot inputs read single columns: catches a swapped nibble or row offset that a
    random comparison at loose tolerance could blur."""
    weight = quantize_int4(torch.randn(64, 96, generator=torch.Generator().manual_seed(3)))
    pack = cpu_quant.pack_int4(weight.values, weight.scales, weight.zeros, 32)
    for first in (0, 16, 40, 64, 88):
        eye = torch.eye(96)[first : first + 8].contiguous()
        want = weight.dequantize()[:, first : first + 8].T
        torch.testing.assert_close(cpu_quant.int4_mm(eye, pack, vnni), want)


def _kinds(n: int, k: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each VNNI kernel on an [n, k] weight (n off a multiple of 16: a short last tile)."""
    gen = torch.Generator().manual_seed(n + k)
    w8 = quantize_int8(torch.randn(n, k, generator=gen))
    w4 = quantize_int4(torch.randn(n, k, generator=gen) + 0.3)
    pack4 = cpu_quant.pack_int4(w4.values, w4.scales, w4.zeros, w4.group_size)
    tiles4 = cpu_quant.tile_int4(pack4)
    _, pack5 = _int5(n, k, 9)
    scales8 = w8.scales[:, 0].contiguous()
    return {
        "int8": lambda x: cpu_quant.int8_mm(x, w8.values, scales8, True),
        "int4": lambda x: cpu_quant.int4_mm(x, pack4, True),
        "int4_tiled": lambda x: cpu_quant.int4_mm(x, tiles4, True),
        "int5": lambda x: cpu_quant.int5_mm(x, pack5, True),
    }


@VNNI
@pytest.mark.parametrize("rows", [*range(1, 18), 33, 64])
def test_bf16_rows_in_and_out_equal_the_float32_call_rounded(rows: int) -> None:
    """bf16 x in, bf16 y out on the VNNI path: bf16 -> float32 is exact, so the same int8
    activations, and each output rounded to nearest even as torch's .to(bfloat16) rounds it."""
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
    for kind, kernel in _kinds(40, 96).items():
        got = kernel(x)
        assert got.dtype == torch.bfloat16, kind
        assert torch.equal(got, kernel(x.float()).to(torch.bfloat16)), (kind, rows)


def test_the_avx2_path_refuses_bf16_rows() -> None:
    weight = quantize_int8(torch.randn(16, 64))
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="VNNI path only"):
        cpu_quant.int8_mm(x, weight.values, weight.scales[:, 0].contiguous(), False)


@pytest.mark.parametrize(
    ("x", "message"),
    [
        (torch.randn(0, 64), "at least one row"),
        (torch.randn(2, 64, dtype=torch.float64), "float32"),
        (torch.randn(2, 32), "columns"),
        (torch.randn(64, 2).T, "contiguous"),
    ],
)
@path
def test_bad_input_gets_a_clear_error(x: torch.Tensor, message: str, vnni: bool) -> None:
    weight = quantize_int8(torch.randn(16, 64))
    with pytest.raises(RuntimeError, match=message):
        cpu_quant.int8_mm(x, weight.values, weight.scales[:, 0].contiguous(), vnni)


def test_pack_refuses_groups_off_the_block() -> None:
    weight = quantize_int4(torch.randn(16, 48), 16)
    with pytest.raises(ValueError, match="multiples of 32"):
        cpu_quant.pack_int4(weight.values, weight.scales, weight.zeros, 16)


def test_off_or_without_avx2_it_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_quant.available.cache_clear()
    try:
        monkeypatch.setenv(cpu_quant.QUANT_KERNEL_ENV, "off")
        assert not cpu_quant.available()
        cpu_quant.available.cache_clear()
        monkeypatch.delenv(cpu_quant.QUANT_KERNEL_ENV)
        monkeypatch.setattr(cpu_quant, "cpu_has_avx2_fma", lambda: False)
        assert not cpu_quant.available()
        cpu_quant.available.cache_clear()
        monkeypatch.undo()
        assert cpu_quant.available()
    finally:
        cpu_quant.available.cache_clear()


def test_the_path_follows_the_dtype_the_cpu_and_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """By default VNNI for a bf16/fp16 engine's layers where the CPU has it, AVX2's exact sums
    for a float32 engine's; PDSERVE_CPU_QUANT=avx2 or vnni forces either for every dtype (both
    paths stay testable on an AVX512 box); a misspelt value is refused by name."""
    vnni = cpu_quant.cpu_has_avx512_vnni()
    low = (torch.bfloat16, torch.float16)
    cpu_quant.uses_vnni.cache_clear()
    try:
        monkeypatch.delenv(cpu_quant.QUANT_KERNEL_ENV, raising=False)
        assert not cpu_quant.uses_vnni(torch.float32)
        assert [cpu_quant.uses_vnni(d) for d in low] == [vnni, vnni]
        layers = [QuantizedLinear(quantize_int8(torch.randn(32, 32)), scale_dtype=d)
                  for d in (torch.float32, torch.bfloat16)]  # fmt: skip
        assert [layer.vnni for layer in layers] == [False, vnni]  # the engine's dtype decides
        cpu_quant.uses_vnni.cache_clear()
        monkeypatch.setenv(cpu_quant.QUANT_KERNEL_ENV, "avx2")
        assert not any(cpu_quant.uses_vnni(d) for d in (torch.float32, *low))
        cpu_quant.uses_vnni.cache_clear()
        monkeypatch.setenv(cpu_quant.QUANT_KERNEL_ENV, "vnni")
        assert [cpu_quant.uses_vnni(d) for d in (torch.float32, *low)] == [vnni] * 3
        cpu_quant.uses_vnni.cache_clear()
        monkeypatch.setenv(cpu_quant.QUANT_KERNEL_ENV, "avx512")
        with pytest.raises(ValueError, match="PDSERVE_CPU_QUANT='avx512'"):
            cpu_quant.uses_vnni()
        monkeypatch.setattr(cpu_quant, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
        monkeypatch.setenv(cpu_quant.QUANT_KERNEL_ENV, "vnni")
        assert not cpu_quant.uses_vnni()
    finally:
        cpu_quant.uses_vnni.cache_clear()


def test_the_build_name_follows_torch_version_and_folder() -> None:
    name = cpu_quant.extension_name("2.13.0+cpu", "/venv-a/torch")
    assert name == cpu_quant.extension_name("2.13.0+cpu", "/venv-a/torch")
    assert name != cpu_quant.extension_name("2.12.0+cpu", "/venv-a/torch")
    assert name != cpu_quant.extension_name("2.13.0+cpu", "/venv-b/torch")
    assert cpu_quant.extension_name() == cpu_quant.extension_name(
        torch.__version__, os.path.dirname(torch.__file__)
    )


def test_a_killed_builds_lock_is_removed(tmp_path: pathlib.Path) -> None:
    (tmp_path / "lock").touch()  # torch's lock file, as a killed build leaves it
    with cpu_quant.build_lock(str(tmp_path), wait_s=5):
        assert not (tmp_path / "lock").exists()


def test_a_live_build_is_waited_for_a_bounded_time(tmp_path: pathlib.Path) -> None:
    (tmp_path / "lock").touch()
    with open(tmp_path / "pdserve.flock", "w") as other:  # another process's build, running
        fcntl.flock(other, fcntl.LOCK_EX)
        with pytest.raises(TimeoutError, match="another process"):
            with cpu_quant.build_lock(str(tmp_path), wait_s=0.5):
                pass
        assert (tmp_path / "lock").exists()  # not a dead build's: left alone
    with cpu_quant.build_lock(str(tmp_path), wait_s=5):  # released: the next build goes on
        assert not (tmp_path / "lock").exists()


def test_the_kernel_loads_past_a_stale_lock_in_its_build_folder() -> None:
    from torch.utils import cpp_extension

    cpu_quant._module()  # built (or loaded) before the lock is left behind
    build_dir = cpp_extension._get_build_directory(cpu_quant.extension_name(), verbose=False)
    pathlib.Path(build_dir, "lock").touch()
    code = "from pdserve.kernels import cpu_quant; assert cpu_quant.available()"
    # before build_lock this waited on the lock file forever: the timeout makes that a failure
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert not pathlib.Path(build_dir, "lock").exists()


@path
def test_the_ops_trace_into_one_compiled_graph(vnni: bool) -> None:
    """A module of int8, int4 and int5 layers on the GEMV compiles with fullgraph=True (no
    graph break: a compiled step can hold the GGUF path's linears) and gives eager's output;
    opcheck holds each op's fake to its kernel."""
    gen = torch.Generator().manual_seed(11)
    weight8 = quantize_int8(torch.randn(96, 96, generator=gen))
    weight4 = quantize_int4(torch.randn(96, 96, generator=gen))
    _, pack5 = _int5(96, 96, 5)
    layers = [QuantizedLinear(w, scale_dtype=torch.float32) for w in (weight8, weight4, pack5)]
    for layer in layers:
        layer.vnni = vnni
    model = torch.nn.Sequential(*layers)
    x = torch.randn(3, 96, generator=gen)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), model(x))
    ops = [
        (torch.ops.pdserve.cpu_int8_mm, (x, weight8.values, weight8.scales[:, 0].contiguous())),
        (torch.ops.pdserve.cpu_int4_mm, (x, layers[1].qweight, layers[1].scales, layers[1].mins)),
        (torch.ops.pdserve.cpu_int5_mm, (x, pack5.nibbles, pack5.high, pack5.scales, pack5.mins)),
    ]
    for op, args in ops:
        torch.library.opcheck(op.default, (*args, vnni))
    if vnni:  # the int4 layers of a bf16 engine hold tiles: their op too (a short last tile)
        part = (weight4.values[:88], weight4.scales[:88], weight4.zeros[:88])
        tiles = cpu_quant.tile_int4(cpu_quant.pack_int4(*part, weight4.group_size))
        args = (x, tiles.nibbles, tiles.scales, tiles.mins, tiles.out_features)
        torch.library.opcheck(torch.ops.pdserve.cpu_int4_tiled_mm.default, args)
        compiled = torch.compile(
            lambda x: cpu_quant.int4_mm(x, tiles, True), backend="aot_eager", fullgraph=True
        )
        torch.testing.assert_close(compiled(x), cpu_quant.int4_mm(x, tiles, True))
        assert compiled(x).shape == (3, 88)
        tiles8 = cpu_quant.Int8Tiles(cpu_quant.tile_int8(weight8.values[:88]), 88)
        scales8 = weight8.scales[:88, 0].contiguous()
        for rows in (x, x.bfloat16()):  # the output in x's dtype, the fake's too
            args8 = (rows, tiles8.values, scales8, 88)
            torch.library.opcheck(torch.ops.pdserve.cpu_int8_tiled_mm.default, args8)
            torch.library.opcheck(torch.ops.pdserve.cpu_int4_tiled_mm.default, (rows, *args[1:]))
            compiled = torch.compile(
                lambda x: cpu_quant.int8_mm(x, tiles8, scales8, True),
                backend="aot_eager",
                fullgraph=True,
            )
            got = compiled(rows)
            assert got.dtype == rows.dtype and got.shape == (3, 88)
            assert torch.equal(got, cpu_quant.int8_mm(rows, tiles8, scales8, True))


@pytest.mark.skipif(not cpu_quant.cpu_has_avx512_vnni(), reason="no AVX512-VNNI on this CPU")
@pytest.mark.parametrize("bits", [8, 4])
def test_a_bf16_vnni_layer_takes_the_kernel_at_every_row_count(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 engine's int4 layer, or int8 head, on the VNNI path runs the kernel (its GEMM from
    4 rows) for decode batches and prefill chunks alike, never dequantize-then-matmul, and
    stays within bf16 and the int8 activations' rounding of the dequantized product."""
    monkeypatch.setenv(cpu_quant.QUANT_KERNEL_ENV, "vnni")
    cpu_quant.uses_vnni.cache_clear()
    try:
        gen = torch.Generator().manual_seed(bits)
        w = torch.randn(80, 256, generator=gen)
        quantized = quantize_int8(w) if bits == 8 else quantize_int4(w + 0.3)
        if bits == 8:
            layer = quantized_head(quantized, torch.bfloat16)
        else:
            layer = QuantizedLinear(quantized, scale_dtype=torch.bfloat16)
        assert layer.vnni and layer.tiled  # held in tile order: int4 and the int8 head
        dense: list[int] = []
        monkeypatch.setattr(layer, "_dense", lambda x: dense.append(len(x)))
        weight = quantized.dequantize()
        for rows in (1, 3, 4, 16, 17, 64, 200):
            x = torch.randn(rows, 256, generator=gen).bfloat16()
            got = layer(x).float()
            want = x.float() @ weight.T
            scale = want.abs().max().item()
            torch.testing.assert_close(got, want, rtol=0, atol=0.03 * scale)
        assert dense == []
    finally:
        cpu_quant.uses_vnni.cache_clear()


@pytest.mark.skipif(not cpu_quant.cpu_has_avx512_vnni(), reason="no AVX512-VNNI on this CPU")
def test_an_int8_decoder_layer_keeps_bf16_activations_from_its_exact_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An int8 layer requantized per row (`--quantization int8`) runs the GEMM below
    `exact_rows` and dequantize-then-matmul from there (a prefill chunk's activations stay
    bf16: the GEMM's int8 rounding flipped the demo's Paris), fused q/k/v alike; the output
    from there is the dense path's bit for bit."""
    monkeypatch.setenv(cpu_quant.QUANT_KERNEL_ENV, "vnni")
    cpu_quant.uses_vnni.cache_clear()
    try:
        gen = torch.Generator().manual_seed(3)
        parts = [quantize_int8(torch.randn(out, 256, generator=gen)) for out in (64, 32, 32)]
        single = QuantizedLinear(parts[0], scale_dtype=torch.bfloat16)
        fused = QuantizedLinear.stacked(
            [QuantizedLinear(p, scale_dtype=torch.bfloat16) for p in parts]
        )
        for layer in (single, fused):
            assert layer.vnni and layer.exact_rows == 16
            dense: list[int] = []
            real_dense = layer._dense

            def counted(x, dense=dense, real_dense=real_dense):
                dense.append(len(x))
                return real_dense(x)

            monkeypatch.setattr(layer, "_dense", counted)
            for rows in (1, 4, 15, 16, 37, 200):
                x = torch.randn(rows, 256, generator=gen).bfloat16()
                got = layer(x)
                if rows >= 16:
                    assert torch.equal(got, real_dense(x)), rows
            assert dense == [16, 37, 200]
    finally:
        cpu_quant.uses_vnni.cache_clear()
