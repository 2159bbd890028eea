"""Weight-only int8/int5/int4 matmuls for a few float32 rows on x86 CPUs: y = x @ W.T with W
read at its stored bits, for the decode steps of a quantized model.

On a CPU without AMX, torch's packed kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`) fall back to slow code on float32 rows: 1.6 and 2.4 ms for a
1x576x1536 layer against 0.16 ms for float32 F.linear (docs/quantization.md, "AVX2 GEMV").
The GEMV reads each weight row once for MAX_ROWS input rows at a time; rows of W are split
across torch's threads. From 4 rows the VNNI path is a GEMM instead (kernels/cpu_quant_gemm.cpp):
tiles of 16 weight rows unpacked once into vpdpbusd's layout, 16 outputs a vector; an int4
weight a VNNI layer holds is kept in that tile order from load (`Int4Tiles`), and read so at
every row count, 1-3 too (docs/quantization.md, "Int4 weights in tile order"). It has
two paths, chosen per layer (`QuantizedLinear.vnni`, `uses_vnni`):
- **AVX2** (`-mavx2 -mfma`): widens the integers to float32 in registers and sums with FMA.
- **AVX512-VNNI**, where /proc/cpuinfo shows AVX512F/BW/VL/DQ and AVX512_VNNI: quantizes each
  activation row to int8 per 32 columns (llama.cpp's Q8 activations), multiplies the weight's
  unsigned bytes by them with `vpdpbusd` (u8 x s8 -> s32) and scales each block's integer sum
  once; a 4/5-bit weight's minimum is folded in through the activation's block sums. It
  changes the numerics by that activation rounding (docs/quantization.md, "AVX512-VNNI GEMV").
  The default for layers of a bf16 or fp16 engine (a perplexity cost inside issue 25's goals,
  docs/quantization.md); a float32 engine keeps AVX2's exact float32 sums (`uses_vnni`).
The C++ (kernels/cpu_quant.cpp) is built at first use with torch's cpp_extension, cached by
the source's hash, torch's version and folder under torch's extensions folder (an flock held
while building; a dead build's lock file is removed); without AVX2+FMA or a compiler,
`available()` is False (logged once) and callers keep torch's kernels.

int8 is torch's layout as QuantizedLinear holds it (values [N, K], one scale per row). int4
has a layout of its own, simpler to read than torch's: `Int4Pack`, nibbles [N, K/2] where
each 32-column block's byte j holds columns j (low nibble) and j + 16 (high), with a float32
scale and minimum per 32 columns, w = scale * v + minimum (GGUF's Q4_1 form). int5 is
`Int5Pack`, GGUF's Q5_0/Q5_1 blocks split into planes: the same nibbles, the fifth bits
[N, K/8] (a block's 4 bytes, bit i of them column i: Q5's qh), and an f16 scale and minimum per
32 columns, w = scale * v + minimum with v 0..31: 6 bits a weight, against Q5_0's 5.5 and
Q5_1's 6 in the file (int8 per row held them in 8; the f16 fields are the file's own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Input rows the AVX2 path and the VNNI GEMV carry through one pass over the weight (a call
# takes any number: the AVX2 path passes over each stretch of 64 weight rows 8 rows at a time,
# the VNNI path takes its GEMM from 4 rows, kernels/cpu_quant_gemm.cpp).
MAX_ROWS = 8
BLOCK = 32  # int4 columns per scale and minimum
# "auto" (default): AVX512-VNNI for a bf16/fp16 engine's layers where the CPU has it, AVX2 for
# a float32 engine's (docs/quantization.md, "VNNI by default in bf16"); "avx2" and "vnni" force
# either path; "off": torch's kernels.
QUANT_KERNEL_ENV = "PDSERVE_CPU_QUANT"
_KERNEL_MODES = ("auto", "avx2", "vnni", "off")
# Seconds to wait for another process's build of the kernel (a cold one takes minutes when loaded).
BUILD_WAIT_ENV = "PDSERVE_CPU_QUANT_BUILD_WAIT"
# Rows packed at once: packing a whole tensor made several byte-per-weight temporaries at
# once, the largest transient of a GGUF load (issue 36's load peak; docs/quantization.md).
_PACK_ROWS = 64


@dataclasses.dataclass(frozen=True, slots=True)
class Int4Pack:
    """An int4 weight [N, K] in this kernel's layout (see the module's docstring)."""

    nibbles: torch.Tensor  # uint8 [N, K/2]
    scales: torch.Tensor  # float32 [N, K/32]
    mins: torch.Tensor  # float32 [N, K/32]


def pack_int4(
    values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> Int4Pack:
    """QuantizedWeight's int4 form (values 0..15 [N, K], w = scale * (v - 8) + zero per group
    of `group_size` columns, a multiple of 32) in this kernel's layout."""
    out, cols = values.shape
    if group_size % BLOCK or cols % group_size:
        raise ValueError(f"int4 group size {group_size} for {cols} columns: need multiples of 32")
    nibbles = _planes(values, [(2, _nibble_plane)])[0]
    repeat = group_size // BLOCK
    per_block = scales.float().repeat_interleave(repeat, dim=1).contiguous()
    mins = (zeros.float() - 8 * scales.float()).repeat_interleave(repeat, dim=1).contiguous()
    return Int4Pack(nibbles, per_block, mins)


def _nibble_plane(values: torch.Tensor) -> torch.Tensor:
    """Values [rows, K] (their low 4 bits) as the packs' nibbles [rows, K/2]."""
    rows, cols = values.shape
    v = values.view(rows, cols // BLOCK, 2, BLOCK // 2).to(torch.uint8) & 15
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(rows, cols // 2)


def _high_plane(values: torch.Tensor) -> torch.Tensor:
    """Values [rows, K] (their fifth bits) as Int5Pack's bit plane [rows, K/8]."""
    rows, cols = values.shape
    bits = (values.view(rows, cols // 8, 8).to(torch.uint8) >> 4) & 1
    return (bits << torch.arange(8, dtype=torch.uint8)).sum(2, dtype=torch.uint8)


def _planes(values: torch.Tensor, planes: list[tuple[int, Callable]]) -> list[torch.Tensor]:
    """Each (columns per byte, plane function) of `values`, _PACK_ROWS rows at a time into
    one preallocated tensor each: the temporaries never span the whole weight."""
    out, cols = values.shape
    results = [torch.empty(out, cols // per_byte, dtype=torch.uint8) for per_byte, _ in planes]
    for start in range(0, out, _PACK_ROWS):
        chunk = values[start : start + _PACK_ROWS]
        for result, (_, plane) in zip(results, planes, strict=True):
            result[start : start + len(chunk)] = plane(chunk)
    return results


@dataclasses.dataclass(frozen=True, slots=True)
class Int5Pack:
    """A 5-bit weight [N, K] in this kernel's layout (see the module's docstring)."""

    nibbles: torch.Tensor  # uint8 [N, K/2], as Int4Pack's
    high: torch.Tensor  # uint8 [N, K/8]: bit i of a block's 4 bytes is column i's fifth bit
    scales: torch.Tensor  # float16 [N, K/32]
    mins: torch.Tensor  # float16 [N, K/32]


Rows = slice | torch.Tensor  # a range of weight rows, or the rows an index tensor names
TILE = 16  # weight rows in one of the VNNI GEMM's tiles: the lanes of an output vector


@dataclasses.dataclass(frozen=True, slots=True)
class Int4Tiles:
    """An int4 weight held in the VNNI GEMM's tile order (`tile_int4`), so that no call
    transposes it: Int4Pack's bytes and fields, rows grouped by tiles of 16, within a tile
    [block][4][16] dwords (dword (b, g, j) = row j's nibble bytes 4g..4g+3 of block b) and the
    scales and minimums [block][16]. Whole tiles: a short last tile repeats the last row."""

    nibbles: torch.Tensor  # uint8 [T * 16, K/2], the tiles' bytes in their order
    scales: torch.Tensor  # float32 [T * 16, K/32], [T][B][16]
    mins: torch.Tensor  # float32 [T * 16, K/32]
    out_features: int  # N: the rows past it (in the last tile) are padding


def tile_int4(pack: Int4Pack) -> Int4Tiles:
    """An Int4Pack in the GEMM's tile order: the same bytes, permuted (one copy of them)."""
    out, half = pack.nibbles.shape
    blocks = pack.scales.shape[1]
    padded = -(-out // TILE) * TILE

    def tiled(t: torch.Tensor, per_row: int) -> torch.Tensor:
        if padded != out:
            t = torch.cat([t, t[-1:].expand(padded - out, -1)])
        tiles = t.reshape(padded // TILE, TILE, per_row).transpose(1, 2).contiguous()
        return tiles.view(padded, -1)

    nibbles = tiled(pack.nibbles.view(torch.int32), half // 4).view(torch.uint8)
    scales, mins = (tiled(t, blocks) for t in (pack.scales, pack.mins))
    return Int4Tiles(nibbles, scales, mins, out)


def untile_int4(tiles: Int4Tiles) -> Int4Pack:
    """The row-major Int4Pack an Int4Tiles holds (the dense path's and tests' reading)."""
    padded, half = tiles.nibbles.shape
    blocks = tiles.scales.shape[1]

    def rows(t: torch.Tensor, per_row: int) -> torch.Tensor:
        t = t.view(padded // TILE, per_row, TILE).transpose(1, 2).reshape(padded, per_row)
        return t[: tiles.out_features].contiguous()

    nibbles = rows(tiles.nibbles.view(torch.int32), half // 4).view(torch.uint8)
    return Int4Pack(nibbles, rows(tiles.scales, blocks), rows(tiles.mins, blocks))


@dataclasses.dataclass(frozen=True, slots=True)
class Int8Tiles:
    """An int8 weight (one scale per row, kept beside it) held in the VNNI GEMM's tile order
    (`tile_int8`), so that no call transposes it: rows by tiles of 16, a tile [K/4][16] dwords
    (dword (g, j) = row j's bytes 4g..4g+3), each byte w ^ 0x80 (unsigned, as vpdpbusd reads it).
    Whole tiles: a short last tile repeats the last row."""

    values: torch.Tensor  # uint8 [T * 16, K], the tiles' bytes in their order
    out_features: int  # N: the rows past it (in the last tile) are padding


def tile_int8(values: torch.Tensor) -> torch.Tensor:
    """int8 values [N, K] (K a multiple of 4) as Int8Tiles' bytes, _PACK_ROWS tiles at a time
    into one tensor: the transient beside the result is a chunk, not a second weight."""
    out, cols = values.shape
    padded = -(-out // TILE) * TILE
    tiles = torch.empty(padded, cols, dtype=torch.uint8)
    step = _PACK_ROWS * TILE
    for start in range(0, padded, step):
        rows = torch.arange(start, min(start + step, padded)).clamp_(max=out - 1)
        part = values[rows].view(torch.uint8) ^ 0x80
        dwords = part.view(torch.int32).view(-1, TILE, cols // 4).transpose(1, 2)
        tiles[start : start + len(rows)].view(torch.int32).view(-1, cols // 4, TILE).copy_(dwords)
    return tiles


def untile_int8(tiles: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of the int8 weight Int8Tiles' bytes hold (`start` a multiple of 16;
    `end` at most the weight's rows): the dense path's chunks."""
    assert start % TILE == 0, f"rows from {start}: tiles start every {TILE}"
    cols = tiles.shape[1]
    last = -(-end // TILE) * TILE
    dwords = tiles[start:last].view(torch.int32).view(-1, cols // 4, TILE).transpose(1, 2)
    rows = dwords.contiguous().view(last - start, cols // 4).view(torch.uint8) ^ 0x80
    return rows[: end - start].view(torch.int8)


def int8_tile_rows(tiles: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The int8 rows `index` names, read from Int8Tiles' bytes (row n: tile n // 16, lane
    n % 16, the shift undone): a tied embedding's lookup from its head's weight."""
    cols = tiles.shape[1]
    dwords = tiles.view(torch.int32).view(-1, cols // 4, TILE)[index // TILE, :, index % TILE]
    return (dwords.contiguous().view(torch.uint8) ^ 0x80).view(torch.int8)


def pack_int5(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> Int5Pack:
    """A 5-bit weight (values 0..31 [N, K], w = scale * (v - 16) + zero per 32 columns) in
    this kernel's layout. The scale and minimum are stored f16: a GGUF Q5 block's own."""
    if values.shape[1] % BLOCK:
        raise ValueError(f"int5 needs columns a multiple of 32, not {values.shape[1]}")
    nibbles, high = _planes(values, [(2, _nibble_plane), (8, _high_plane)])
    mins = (zeros.float() - 16 * scales.float()).half()
    return Int5Pack(nibbles, high, scales.half().contiguous(), mins.contiguous())


AnyPack = Int4Pack | Int4Tiles | Int5Pack


def unpack_int4(pack: AnyPack, start: int = 0, end: int | None = None) -> torch.Tensor:
    """Rows [start, end) of the float32 weight a pack stands for (the dense path's input)."""
    return unpack_rows(pack, slice(start, end))


def unpack_rows(pack: AnyPack, rows: Rows) -> torch.Tensor:
    """The float32 rows of the weight a pack stands for: a range (the dense path's chunks) or
    an index tensor (an embedding's lookup). Tiles are read back through `untile_int4`."""
    if isinstance(pack, Int4Tiles):
        pack = untile_int4(pack)
    nib = pack.nibbles[rows]
    count, blocks = nib.shape[0], pack.scales.shape[1]
    b = nib.view(count, blocks, BLOCK // 2)
    v = torch.cat([b & 15, b >> 4], dim=2)
    if isinstance(pack, Int5Pack):
        bits = pack.high[rows].view(count, blocks, 4, 1) >> torch.arange(8, dtype=torch.uint8)
        v |= (bits & 1).view(count, blocks, BLOCK) << 4
    w = v.float() * pack.scales[rows, :, None].float() + pack.mins[rows, :, None].float()
    return w.view(count, blocks * BLOCK)


def int8_mm(
    x: torch.Tensor,
    values: torch.Tensor | Int8Tiles,
    scales: torch.Tensor,
    vnni: bool | None = None,
) -> torch.Tensor:
    """x [M, K] @ (values [N, K] int8 * scales [N] float32).T in x's dtype: float32, or bf16 on
    the VNNI path; `vnni` picks the path (default `uses_vnni()`; K off a multiple of 32 takes
    AVX2's, float32 only). Tiles take the VNNI path only, as int4's do."""
    if isinstance(values, Int8Tiles):
        if not _path(vnni):
            raise ValueError("an int8 weight in tile order runs on the VNNI path only")
        tiled = (x, values.values, scales, values.out_features)
        if torch.compiler.is_compiling():
            return torch.ops.pdserve.cpu_int8_tiled_mm(*tiled)
        return _module().int8_tiled_mm(*tiled)
    if torch.compiler.is_compiling():
        return torch.ops.pdserve.cpu_int8_mm(x, values, scales, _path(vnni))
    return _module().int8_mm(x, values, scales, _path(vnni))


def int4_mm(x: torch.Tensor, pack: Int4Pack | Int4Tiles, vnni: bool | None = None) -> torch.Tensor:
    """x [M, K] @ the packed weight.T in x's dtype (float32, or bf16 on the VNNI path). Tiles
    take the VNNI path only (ValueError where `vnni` says AVX2: a layer tiles its weight only
    where it runs VNNI)."""
    if isinstance(pack, Int4Tiles):
        if not _path(vnni):
            raise ValueError("an int4 weight in tile order runs on the VNNI path only")
        tiled = (x, pack.nibbles, pack.scales, pack.mins, pack.out_features)
        if torch.compiler.is_compiling():
            return torch.ops.pdserve.cpu_int4_tiled_mm(*tiled)
        return _module().int4_tiled_mm(*tiled)
    args = (x, pack.nibbles, pack.scales, pack.mins, _path(vnni))
    if torch.compiler.is_compiling():
        return torch.ops.pdserve.cpu_int4_mm(*args)
    return _module().int4_mm(*args)


def int5_mm(x: torch.Tensor, pack: Int5Pack, vnni: bool | None = None) -> torch.Tensor:
    """x [M, K] @ the 5-bit packed weight.T in x's dtype (float32, or bf16 on the VNNI path)."""
    args = (x, pack.nibbles, pack.high, pack.scales, pack.mins, _path(vnni))
    if torch.compiler.is_compiling():
        return torch.ops.pdserve.cpu_int5_mm(*args)
    return _module().int5_mm(*args)


# The three as ops a traced graph holds (torch.compile, export): defined through
# torch.library.Library as pdserve::packed_linear is (a cheaper dispatch than the custom_op
# decorator's), each with a fake giving the output's shape. Eager calls skip the dispatcher.
# A compiled caller passes `vnni` itself (QuantizedLinear.vnni): `uses_vnni` reads the CPU.
_LIB = torch.library.Library("pdserve", "FRAGMENT")
_LIB.define("cpu_int8_mm(Tensor x, Tensor values, Tensor scales, bool vnni) -> Tensor")
_LIB.define(
    "cpu_int4_mm(Tensor x, Tensor nibbles, Tensor scales, Tensor mins, bool vnni) -> Tensor"
)
_LIB.define(
    "cpu_int5_mm(Tensor x, Tensor nibbles, Tensor high, Tensor scales, Tensor mins, bool vnni)"
    " -> Tensor"
)
_LIB.define(
    "cpu_int4_tiled_mm(Tensor x, Tensor nibbles, Tensor scales, Tensor mins, int n) -> Tensor"
)
_LIB.define("cpu_int8_tiled_mm(Tensor x, Tensor tiles, Tensor scales, int n) -> Tensor")
for _name in ("int8_mm", "int4_mm", "int5_mm", "int4_tiled_mm", "int8_tiled_mm"):
    _LIB.impl(
        f"cpu_{_name}",
        lambda *args, _name=_name: getattr(_module(), _name)(*args),
        "CompositeExplicitAutograd",
    )


@torch.library.register_fake("pdserve::cpu_int8_mm")
@torch.library.register_fake("pdserve::cpu_int4_mm")
@torch.library.register_fake("pdserve::cpu_int5_mm")
def _gemv_fake(x: torch.Tensor, weight: torch.Tensor, *_: object) -> torch.Tensor:
    """[M, N] in x's dtype: x's rows by the weight's (int8 values, or nibbles) rows."""
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.register_fake("pdserve::cpu_int4_tiled_mm")
@torch.library.register_fake("pdserve::cpu_int8_tiled_mm")
def _tiled_fake(x: torch.Tensor, *args: object) -> torch.Tensor:
    """[M, n] in x's dtype: x's rows by the weight's rows less the last tile's padding (n, the
    last argument)."""
    return x.new_empty(x.shape[0], args[-1])


def _path(vnni: bool | None) -> bool:
    return uses_vnni() if vnni is None else vnni


@cache
def cpu_flags() -> frozenset[str]:
    """This CPU's flags (Linux's /proc/cpuinfo; empty where it is absent)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_avx2_fma() -> bool:
    """Whether this CPU has AVX2 and FMA."""
    return {"avx2", "fma"} <= cpu_flags()


def cpu_has_avx512_vnni() -> bool:
    """Whether this CPU has what the VNNI path's instructions need."""
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= cpu_flags()


def _kernel_mode() -> str:
    return env_mode(QUANT_KERNEL_ENV, _KERNEL_MODES)


def env_mode(name: str, modes: tuple[str, ...]) -> str:
    """A CPU kernel's switch: $name, one of `modes` (the first when unset), else ValueError.
    Shared by the kernels (cpu_quant, cpu_attention, cpu_fused)."""
    mode = os.environ.get(name, modes[0])
    if mode not in modes:
        raise ValueError(f"{name}={mode!r}: expected one of {', '.join(modes)}")
    return mode


def builds(module: Callable[[], object], what: str, instead: str) -> bool:
    """Whether `module()` (a kernel's cached build) loads; where it does not (no compiler, or
    the build failed) logs that `instead` serves, and returns False."""
    try:
        module()
    except Exception as exc:
        log.warning("%s: build failed (%s): %s", what, exc, instead)
        return False
    return True


def kernel_source(name: str) -> str:
    """The C++ source kernels/`name` with kernels/cpu_simd.h pasted in at its `#include
    "cpu_simd.h"` line (each extension is built from one text, and that text's hash names
    its build, so a change to the shared code rebuilds every kernel that has it)."""
    folder = Path(__file__).parent
    shared = folder.joinpath("cpu_simd.h").read_text(encoding="utf-8")
    source = folder.joinpath(name).read_text(encoding="utf-8")
    return source.replace('#include "cpu_simd.h"', shared)


@cache
def uses_vnni(dtype: torch.dtype = torch.float32) -> bool:
    """Whether a layer of an engine in `dtype` takes the AVX512-VNNI path: where the CPU has it,
    by $PDSERVE_CPU_QUANT when it names a path, else for any dtype but float32. Its int8
    activations cost SmolLM2 Q4_1 +1.3% perplexity over the AVX2 path in bf16 (bf16's own
    rounding +0.5% over float32), for a 0.83x eager step; a float32 engine (the HF-oracle
    tests) keeps the exact sums."""
    mode = _kernel_mode()
    if mode in ("avx2", "off") or not cpu_has_avx512_vnni():
        return False
    return mode == "vnni" or dtype != torch.float32


@cache
def available() -> bool:
    """Whether the kernel runs here: $PDSERVE_CPU_QUANT is not off, the CPU has AVX2+FMA and
    the C++ source compiled (once per process; the build is cached across processes). Logs
    why not, once."""
    if _kernel_mode() == "off":
        log.info("cpu quant kernel: off (%s=off): torch's weight-only kernels", QUANT_KERNEL_ENV)
        return False
    if not cpu_has_avx2_fma():
        log.info("cpu quant kernel: no AVX2+FMA on this CPU: torch's weight-only kernels")
        return False
    if not builds(_module, "cpu quant kernel", "torch's weight-only kernels"):
        return False
    name = {False: "AVX2", True: "AVX512-VNNI"}
    log.info("cpu quant kernel: the %s path for float32 engines, %s for bf16/fp16",
             name[uses_vnni()], name[uses_vnni(torch.bfloat16)])  # fmt: skip
    return True


# The C++ source, shipped beside this file (pyproject's package-data), cpu_simd.h pasted in; its
# hash names the build: the GEMV and its helpers, then the GEMM and the entry points, one
# translation unit.
_SOURCE = "\n".join(kernel_source(name) for name in ("cpu_quant.cpp", "cpu_quant_gemm.cpp"))


def extension_name(
    version: str | None = None,
    torch_dir: str | None = None,
    source: str = _SOURCE,
    stem: str = "cpu_quant",
) -> str:
    """The build's name: the source's hash with torch's version and install folder, so that two
    venvs with different torch never share (and load the other's) build folder."""
    version = torch.__version__ if version is None else version
    torch_dir = os.path.dirname(torch.__file__) if torch_dir is None else torch_dir
    key = f"{source}\0{version}\0{torch_dir}"
    return f"pdserve_{stem}_{hashlib.sha256(key.encode()).hexdigest()[:16]}"


@contextlib.contextmanager
def build_lock(build_dir: str, wait_s: float) -> Iterator[None]:
    """Hold the build folder for one process, waiting at most `wait_s` for another (TimeoutError).

    torch's own lock is a file that exists while a build runs, so a build killed midway leaves it
    behind and every later load waits on it forever. Ours is an flock, which the kernel drops with
    the process that held it: once we hold it no pdserve build is running, and a `lock` file
    there is a dead build's, removed before torch looks."""
    os.makedirs(build_dir, exist_ok=True)
    deadline = time.monotonic() + wait_s
    with open(os.path.join(build_dir, "pdserve.flock"), "w") as held:
        while True:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"cpu quant kernel: another process has been building in {build_dir} "
                        f"for over {wait_s:.0f} s"
                    ) from None
                time.sleep(0.2)
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            log.warning("cpu quant kernel: removing %s, left by a build that was killed", stale)
            os.remove(stale)
        yield  # the flock goes with the file's close


_FUNCTIONS = ("int8_mm", "int4_mm", "int5_mm", "int4_tiled_mm", "int8_tiled_mm")


@cache
def _module():  # noqa: ANN202 (a compiled extension module)
    return load_extension("cpu_quant", _SOURCE, [*_FUNCTIONS], ["-mavx2", "-mfma"])


def load_extension(stem: str, source: str, functions: list[str], cflags: list[str]):  # noqa: ANN201
    """Build (or load the cached build of) a C++ source with torch's cpp_extension, at -O3 with
    OpenMP (torch's threads) and `cflags`, under `build_lock`; named by `extension_name`.
    Shared by the CPU kernels (cpu_quant, cpu_attention)."""
    from torch.utils import cpp_extension

    name = extension_name(source=source, stem=stem)
    # torch's own folder for `name` (private, but the layout every torch extension uses)
    build_dir = cpp_extension._get_build_directory(name, verbose=False)
    log.info("%s kernel: loading %s (built once, then cached)", stem, name)
    with build_lock(build_dir, float(os.environ.get(BUILD_WAIT_ENV, "900"))):
        return cpp_extension.load_inline(
            name=name,
            cpp_sources=[source],
            functions=functions,
            extra_cflags=["-O3", *cflags, "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=build_dir,
            verbose=False,
        )
