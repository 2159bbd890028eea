// pdserve's weight-only int8/int5/int4 GEMV for a few float32 rows (kernels/cpu_quant.py says
// what each layout is and which path runs where). Built by torch's cpp_extension at first use,
// as one source with kernels/cpu_quant_gemm.cpp (the many-row GEMM and the entry points).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>
#include <vector>

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

// x [M, K]: float32 on either path, or bfloat16 where `bf16` (the VNNI path's: its activations
// are quantized to int8 anyway, and bf16 -> float32 is exact).
void check(const torch::Tensor& x, const torch::Tensor& q, int64_t K, bool bf16 = false) {
  const auto type = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
              (type == torch::kFloat || (bf16 && type == torch::kBFloat16)),
              "x must be contiguous float32 [M, K]", bf16 ? " or bfloat16" : "",
              " (bfloat16 on the VNNI path only)");
  TORCH_CHECK(x.size(0) >= 1, "x must have at least one row");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
  TORCH_CHECK(q.is_contiguous(), "the weight must be contiguous");
}


// ---- AVX512-VNNI: activations quantized to int8 per 32 columns, integer dot products ----
// Compiled for AVX512 whatever the build's flags; called only where the CPU has it (checked
// at run time below and by the Python side, kernels/cpu_quant.py's `vnni()`).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

// x's rows as int8 per 32-column block (llama.cpp's Q8 activations): q [M, K], and per pair
// of blocks a 16-lane vector of their scales (lanes 0-7 the first block's, 8-15 the second's,
// as vpdpbusd's lanes fall over 64 bytes), and each block's float sum (for the minimums).
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> scales;  // [M, pairs, 16]
  std::vector<float> sums;    // [M, K / 32]
  int64_t K, B, P;
};

#include "cpu_simd.h"  // load16 (exp16 unused here)

// 16 float32 lanes to bf16 at p (the lanes `keep` names), rounded to nearest even as
// c10::BFloat16 rounds (a NaN as 0x7FC0): integer ops, no AVX512-BF16 needed at run time.
inline void store_bf16(at::BFloat16* p, __m512 v, __mmask16 keep) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm512_mask_cvtepi32_storeu_epi16(p, keep, r);
}

// n float32 values rounded to bf16 (store_bf16), 16 at a time.
inline void round_bf16(const float* from, at::BFloat16* to, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    store_bf16(to + i, _mm512_maskz_loadu_ps(k, from + i), k);
  }
}

template <typename T>
Q8Rows quantize_rows(const T* x, int64_t M, int64_t K) {
  Q8Rows r{std::vector<int8_t>(M * K), std::vector<float>(M * ((K / 32 + 1) / 2) * 16, 0.f),
           std::vector<float>(M * (K / 32)), K, K / 32, (K / 32 + 1) / 2};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < r.B; ++b) {
      const T* xb = x + m * K + b * 32;
      const __m512 lo = load16(xb), hi = load16(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      int8_t* q = r.q.data() + m * K + b * 32;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, inv))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, inv))));
      float* s = r.scales.data() + (m * r.P + b / 2) * 16 + (b % 2) * 8;
      for (int i = 0; i < 8; ++i) s[i] = amax / 127.f;
      r.sums[m * r.B + b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
  }
  return r;
}

// Byte masks of a pair of 32-column blocks, or of the last block alone when their count is odd.
inline __mmask64 pair_mask(bool pair) { return pair ? ~__mmask64(0) : __mmask64(0xFFFFFFFFu); }

// Two blocks' 32 nibble bytes (byte j of a block: column j low, j + 16 high) as 64 unsigned
// bytes in column order: 128-bit lanes [b, b, b+1, b+1], the second copy of each shifted down
// to its high nibbles.
inline __m512i nibbles64(const uint8_t* p, bool pair) {
  const __m256i v = _mm256_maskz_loadu_epi8(pair ? 0xFFFFFFFFu : 0xFFFFu, p);
  const __m512i idx = _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3);
  __m512i z = _mm512_permutexvar_epi64(idx, _mm512_castsi256_si512(v));
  z = _mm512_mask_srli_epi16(z, 0xFF00FF00u, z, 4);
  return _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
}

// A pair of blocks' 64 unsigned weights in column order: int4's nibbles, and for int5 (HIGH)
// the fifth bits (`high`: bit i of the pair's 8 bytes is column i's) added as 16.
template <bool HIGH>
inline __m512i unsigned64(const uint8_t* nibbles, const uint8_t* high, bool pair) {
  __m512i w = nibbles64(nibbles, pair);
  if constexpr (HIGH) {
    uint64_t bits = 0;
    std::memcpy(&bits, high, pair ? 8 : 4);
    w = _mm512_or_si512(w, _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(16)));
  }
  return w;
}

inline __m512 pair_scales(float first, float second) {
  return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(first), _mm512_set1_ps(second));
}

inline __m512 load16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load16(const at::Half* p, __mmask16 k) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
}

// sum over blocks of minimum[b] * (the sum of x over block b): what the minimums add.
template <typename S>
float min_offset(const S* mins, const float* sums, int64_t B) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; b += 16) {
    const __mmask16 k = B - b >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (B - b)) - 1);
    acc = _mm512_fmadd_ps(load16(mins + b, k), _mm512_maskz_loadu_ps(k, sums + b), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// int4/int5 rows: unsigned weights v (0..15 or 0..31) times int8 activations by vpdpbusd,
// each block's int32 sums scaled by the weight's and the activation's scales; the minimums
// come from the activation's block sums (w = scale * v + minimum).
template <int M, bool HIGH, typename S>
void affine_rows_vnni(const Q8Rows& xq, const uint8_t* q, const uint8_t* high, const S* scales,
                      const S* mins, float* y, int64_t N, int64_t begin, int64_t end) {
  const int64_t K = xq.K, B = xq.B;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = q + n * (K / 2);
    const S* s = scales + n * B;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t p = 0; p < xq.P; ++p) {
      const int64_t b = 2 * p;
      const bool pair = b + 1 < B;
      const __m512i w =
          unsigned64<HIGH>(row + b * 16, HIGH ? high + n * (K / 8) + b * 4 : nullptr, pair);
      const __m512 ws = pair_scales(float(s[b]), pair ? float(s[b + 1]) : 0.f);
      for (int m = 0; m < M; ++m) {
        const __m512i x = _mm512_maskz_loadu_epi8(pair_mask(pair), xq.q.data() + m * K + b * 32);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
        const __m512 xs = _mm512_loadu_ps(xq.scales.data() + (m * xq.P + p) * 16);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, xs), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      const float offset = min_offset(mins + n * B, xq.sums.data() + m * B, B);
      y[m * N + n] = _mm512_reduce_add_ps(acc[m]) + offset;
    }
  }
}

// int8 rows (one scale per row): vpdpbusd multiplies unsigned by signed bytes, so the
// activation goes in as q + 128 and 128 times the weights' sums (one more vpdpbusd per pair,
// shared by the M rows) comes off.
template <int M>
void int8_rows_vnni(const Q8Rows& xq, const int8_t* q, const float* scales, float* y,
                    int64_t N, int64_t begin, int64_t end) {
  const int64_t K = xq.K, B = xq.B;
  const __m512i ones = _mm512_set1_epi8(1), bias = _mm512_set1_epi8(char(0x80));
  for (int64_t n = begin; n < end; ++n) {
    const int8_t* row = q + n * K;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t p = 0; p < xq.P; ++p) {
      const int64_t b = 2 * p;
      const __mmask64 k = pair_mask(b + 1 < B);
      const __m512i w = _mm512_maskz_loadu_epi8(k, row + b * 32);
      const __m512i wsum = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, w), 7);
      for (int m = 0; m < M; ++m) {
        const __m512i x = _mm512_xor_si512(
            _mm512_maskz_loadu_epi8(k, xq.q.data() + m * K + b * 32), bias);
        const __m512i dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), x, w), wsum);
        const __m512 xs = _mm512_loadu_ps(xq.scales.data() + (m * xq.P + p) * 16);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), xs, acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = _mm512_reduce_add_ps(acc[m]) * scales[n];
  }
}

// The VNNI path's int8 activations from x, float32 or bf16.
Q8Rows quantize_input(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  if (x.scalar_type() == torch::kBFloat16) return quantize_rows(x.data_ptr<at::BFloat16>(), M, K);
  return quantize_rows(x.data_ptr<float>(), M, K);
}

// `f(float* y)` fills y [M, N] in float32 (the GEMV stores its sums one by one): straight into
// y, or for a bf16 y into a float32 copy rounded into it after.
template <typename F>
void gemv_out(torch::Tensor& y, F f) {
  if (y.scalar_type() == torch::kFloat) return f(y.data_ptr<float>());
  std::vector<float> y32(y.numel());
  f(y32.data());
  round_bf16(y32.data(), y.data_ptr<at::BFloat16>(), y.numel());
}

#pragma GCC pop_options

bool cpu_has_vnni() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vnni");
  return has;
}

void check_vnni(bool vnni) {
  TORCH_CHECK(!vnni || cpu_has_vnni(), "the AVX512-VNNI path needs a CPU with AVX512-VNNI");
}

}  // namespace
