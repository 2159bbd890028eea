"""Weight-only int8/int5/int4 matmuls for a few float32 rows on AVX2 CPUs: y = x @ W.T with W read
at its stored bits, for the decode steps of a quantized model.

On an AVX2 machine without AVX512, torch's packed kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`) fall back to slow code on float32 rows: 1.6 and 2.4 ms for a
1x576x1536 layer against 0.16 ms for float32 F.linear (docs/quantization.md, "AVX2 GEMV").
This kernel reads each weight row once for all (up to MAX_ROWS) input rows, widens its
integers to float32 in registers and sums with FMA; rows of W are split across torch's
threads. It is C++ built at first use with torch's cpp_extension (g++ -O3 -mavx2 -mfma),
cached by the source's hash, torch's version and folder under torch's extensions folder (an flock
held while building; a dead build's lock file is removed); without AVX2+FMA or a compiler,
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

import torch

log = logging.getLogger(__name__)

MAX_ROWS = 8  # input rows one call takes (the C++ side is instantiated for 1..8)
BLOCK = 32  # int4 columns per scale and minimum
QUANT_KERNEL_ENV = "PDSERVE_CPU_QUANT"  # "auto" (default) or "off"
# Seconds to wait for another process's build of the kernel (a cold one takes minutes when loaded).
BUILD_WAIT_ENV = "PDSERVE_CPU_QUANT_BUILD_WAIT"
# Rows packed at once: packing a whole tensor made several byte-per-weight temporaries at
# once, the largest transient of a GGUF load (issue 36's load peak; docs/quantization.md).
_PACK_ROWS = 64

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 widen(__m128i bytes8) {  // 8 unsigned bytes (low half) to float32
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8));
}

inline __m256 widen_signed(const int8_t* p) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

// Sum of x[m, 32 columns] * w[4 vectors], for each of the M rows, into acc[m].
template <int M>
inline void dot32(const float* x, int64_t K, const __m256 w[4], __m256 acc[M]) {
  for (int m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    __m256 p = _mm256_mul_ps(_mm256_loadu_ps(xm), w[0]);
    p = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 8), w[1], p);
    p = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 16), w[2], p);
    p = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 24), w[3], p);
    acc[m] = _mm256_add_ps(acc[m], p);
  }
}

template <int M>
void int8_rows(const float* x, const int8_t* q, const float* scales, float* y,
               int64_t K, int64_t N, int64_t begin, int64_t end) {
  const int64_t K32 = K - K % 32;
  for (int64_t n = begin; n < end; ++n) {
    const int8_t* row = q + n * K;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K32; k += 32) {
      __m256 w[4] = {widen_signed(row + k), widen_signed(row + k + 8),
                     widen_signed(row + k + 16), widen_signed(row + k + 24)};
      dot32<M>(x + k, K, w, acc);
    }
    for (int m = 0; m < M; ++m) {
      float s = hsum(acc[m]);
      for (int64_t k = K32; k < K; ++k) s += x[m * K + k] * float(row[k]);
      y[m * N + n] = s * scales[n];
    }
  }
}

// 8 values of a 5-bit weight: 8 low nibbles (the low half of `nib`) and their fifth bits
// (bit i of `bits` for value i), as float32.
inline __m256 widen5(__m128i nib, uint32_t bits) {
  const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits), lanes), lanes);
  __m256i v = _mm256_or_si256(_mm256_cvtepu8_epi32(nib),
                              _mm256_and_si256(set, _mm256_set1_epi32(16)));
  return _mm256_cvtepi32_ps(v);
}

// int4 and int5 rows (w = scale * v + minimum per 32 columns): the nibbles, and for int5
// (HIGH) the fifth bits' plane; S is the scales' type (int4's float32, int5's f16).
template <int M, bool HIGH, typename S>
void affine_rows(const float* x, const float* xsum, const uint8_t* q, const uint8_t* high,
                 const S* scales, const S* mins, float* y, int64_t K, int64_t N,
                 int64_t begin, int64_t end) {
  const int64_t B = K / 32;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = q + n * (K / 2);
    const S* s = scales + n * B;
    const S* mn = mins + n * B;
    __m256 acc[M];
    float offset[M];
    for (int m = 0; m < M; ++m) { acc[m] = _mm256_setzero_ps(); offset[m] = 0.f; }
    for (int64_t b = 0; b < B; ++b) {
      __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
      __m128i lo = _mm_and_si128(bytes, low4);
      __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
      __m256 w[4];
      if constexpr (HIGH) {
        const uint8_t* h = high + n * (K / 8) + b * 4;
        w[0] = widen5(lo, h[0]); w[1] = widen5(_mm_srli_si128(lo, 8), h[1]);
        w[2] = widen5(hi, h[2]); w[3] = widen5(_mm_srli_si128(hi, 8), h[3]);
      } else {
        w[0] = widen(lo); w[1] = widen(_mm_srli_si128(lo, 8));
        w[2] = widen(hi); w[3] = widen(_mm_srli_si128(hi, 8));
      }
      __m256 part[M];
      for (int m = 0; m < M; ++m) part[m] = _mm256_setzero_ps();
      dot32<M>(x + b * 32, K, w, part);
      const __m256 scale = _mm256_set1_ps(float(s[b]));
      const float minimum = float(mn[b]);
      for (int m = 0; m < M; ++m) {
        acc[m] = _mm256_fmadd_ps(scale, part[m], acc[m]);
        offset[m] += minimum * xsum[m * B + b];
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = hsum(acc[m]) + offset[m];
  }
}

template <typename F>
void over_rows(int64_t N, int64_t K, F f) {
  // About 64 KiB of weights per task, so small layers stay on one thread.
  const int64_t grain = std::max<int64_t>(16, (int64_t(1) << 16) / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, f);
}

void check(const torch::Tensor& x, const torch::Tensor& q, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be contiguous float32 [M, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, "x must have 1 to 8 rows, not ", x.size(0));
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
  TORCH_CHECK(q.is_contiguous(), "the weight must be contiguous");
}

}  // namespace

torch::Tensor int8_mm(torch::Tensor x, torch::Tensor q, torch::Tensor scales) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar, "q must be int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1), M = x.size(0);
  check(x, q, K);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() &&
              scales.numel() == N, "scales must be float32 [N]");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  over_rows(N, K, [&](int64_t b, int64_t e) {
    switch (M) {
#define ROWS(R) case R: int8_rows<R>(xp, qp, sp, yp, K, N, b, e); break;
      ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
    }
  });
  return y;
}

torch::Tensor int4_mm(torch::Tensor x, torch::Tensor q, torch::Tensor scales,
                      torch::Tensor mins) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kByte, "q must be uint8 [N, K/2]");
  const int64_t N = q.size(0), K = q.size(1) * 2, M = x.size(0), B = K / 32;
  check(x, q, K);
  TORCH_CHECK(K % 32 == 0, "int4 K must be a multiple of 32, not ", K);
  for (const auto& t : {scales, mins}) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.dim() == 2 &&
                t.size(0) == N && t.size(1) == B, "scales and mins must be float32 [N, K/32]");
  }
  auto xsum = x.view({M, B, 32}).sum(2).contiguous();  // each block's sum of x, for mins
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* xs = xsum.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  over_rows(N, K, [&](int64_t b, int64_t e) {
    switch (M) {
#define ROWS(R) case R: affine_rows<R, false>(xp, xs, qp, nullptr, sp, mp, yp, K, N, b, e); break;
      ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
    }
  });
  return y;
}

torch::Tensor int5_mm(torch::Tensor x, torch::Tensor q, torch::Tensor high,
                      torch::Tensor scales, torch::Tensor mins) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kByte, "q must be uint8 [N, K/2]");
  const int64_t N = q.size(0), K = q.size(1) * 2, M = x.size(0), B = K / 32;
  check(x, q, K);
  TORCH_CHECK(K % 32 == 0, "int5 K must be a multiple of 32, not ", K);
  TORCH_CHECK(high.scalar_type() == torch::kByte && high.is_contiguous() && high.dim() == 2 &&
              high.size(0) == N && high.size(1) == K / 8, "high bits must be uint8 [N, K/8]");
  for (const auto& t : {scales, mins}) {
    TORCH_CHECK(t.scalar_type() == torch::kHalf && t.is_contiguous() && t.dim() == 2 &&
                t.size(0) == N && t.size(1) == B, "scales and mins must be float16 [N, K/32]");
  }
  auto xsum = x.view({M, B, 32}).sum(2).contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* xs = xsum.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint8_t* hp = high.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* mp = mins.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  over_rows(N, K, [&](int64_t b, int64_t e) {
    switch (M) {
#define ROWS(R) case R: affine_rows<R, true>(xp, xs, qp, hp, sp, mp, yp, K, N, b, e); break;
      ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
    }
  });
  return y;
}
"""


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


def pack_int5(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> Int5Pack:
    """A 5-bit weight (values 0..31 [N, K], w = scale * (v - 16) + zero per 32 columns) in
    this kernel's layout. The scale and minimum are stored f16: a GGUF Q5 block's own."""
    if values.shape[1] % BLOCK:
        raise ValueError(f"int5 needs columns a multiple of 32, not {values.shape[1]}")
    nibbles, high = _planes(values, [(2, _nibble_plane), (8, _high_plane)])
    mins = (zeros.float() - 16 * scales.float()).half()
    return Int5Pack(nibbles, high, scales.half().contiguous(), mins.contiguous())


def unpack_int4(pack: Int4Pack | Int5Pack, start: int = 0, end: int | None = None) -> torch.Tensor:
    """Rows [start, end) of the float32 weight a pack stands for (the dense path's input)."""
    return unpack_rows(pack, slice(start, end))


def unpack_rows(pack: Int4Pack | Int5Pack, rows: Rows) -> torch.Tensor:
    """The float32 rows of the weight a pack stands for: a range (the dense path's chunks) or
    an index tensor (an embedding's lookup)."""
    nib = pack.nibbles[rows]
    count, blocks = nib.shape[0], pack.scales.shape[1]
    b = nib.view(count, blocks, BLOCK // 2)
    v = torch.cat([b & 15, b >> 4], dim=2)
    if isinstance(pack, Int5Pack):
        bits = pack.high[rows].view(count, blocks, 4, 1) >> torch.arange(8, dtype=torch.uint8)
        v |= (bits & 1).view(count, blocks, BLOCK) << 4
    w = v.float() * pack.scales[rows, :, None].float() + pack.mins[rows, :, None].float()
    return w.view(count, blocks * BLOCK)


def int8_mm(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] float32 @ (values [N, K] int8 * scales [N] float32).T."""
    return _module().int8_mm(x, values, scales)


def int4_mm(x: torch.Tensor, pack: Int4Pack) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] float32 @ the packed weight.T."""
    return _module().int4_mm(x, pack.nibbles, pack.scales, pack.mins)


def int5_mm(x: torch.Tensor, pack: Int5Pack) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] float32 @ the 5-bit packed weight.T."""
    return _module().int5_mm(x, pack.nibbles, pack.high, pack.scales, pack.mins)


def cpu_has_avx2_fma() -> bool:
    """Whether this CPU has AVX2 and FMA (Linux's /proc/cpuinfo; False where it is absent)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"avx2", "fma"} <= flags
    except OSError:
        pass
    return False


@cache
def available() -> bool:
    """Whether the kernel runs here: $PDSERVE_CPU_QUANT is not off, the CPU has AVX2+FMA and
    the C++ source compiled (once per process; the build is cached across processes). Logs
    why not, once."""
    if os.environ.get(QUANT_KERNEL_ENV, "auto") == "off":
        log.info("cpu quant kernel: off (%s=off): torch's weight-only kernels", QUANT_KERNEL_ENV)
        return False
    if not cpu_has_avx2_fma():
        log.info("cpu quant kernel: no AVX2+FMA on this CPU: torch's weight-only kernels")
        return False
    try:
        _module()
    except Exception as exc:  # no compiler, or it failed: torch's kernels serve instead
        log.warning("cpu quant kernel: build failed (%s): torch's weight-only kernels", exc)
        return False
    return True


def extension_name(version: str | None = None, torch_dir: str | None = None) -> str:
    """The build's name: the source's hash with torch's version and install folder, so that two
    venvs with different torch never share (and load the other's) build folder."""
    version = torch.__version__ if version is None else version
    torch_dir = os.path.dirname(torch.__file__) if torch_dir is None else torch_dir
    key = f"{_SOURCE}\0{version}\0{torch_dir}"
    return f"pdserve_cpu_quant_{hashlib.sha256(key.encode()).hexdigest()[:16]}"


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


@cache
def _module():  # noqa: ANN202 (a compiled extension module)
    from torch.utils import cpp_extension

    name = extension_name()
    # torch's own folder for `name` (private, but the layout every torch extension uses)
    build_dir = cpp_extension._get_build_directory(name, verbose=False)
    log.info("cpu quant kernel: loading %s (built once, then cached)", name)
    with build_lock(build_dir, float(os.environ.get(BUILD_WAIT_ENV, "900"))):
        return cpp_extension.load_inline(
            name=name,
            cpp_sources=[_SOURCE],
            functions=["int8_mm", "int4_mm", "int5_mm"],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=build_dir,
            verbose=False,
        )
