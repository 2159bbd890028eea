// pdserve's fused elementwise kernels for a bf16 engine's eager CPU steps (kernels/cpu_fused.py
// says what each one equals and where it runs). Built by torch's cpp_extension at first use,
// with -ffp-contract=off: a product and a sum stay two float32 roundings, as the eager ops'.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cmath>
#include <tuple>

namespace {

using B = c10::BFloat16;

inline float f(B x) { return static_cast<float>(x); }
inline B b(float x) { return B(x); }  // round to nearest even, torch's own rounding

// A [rows, n] view of bf16 elements whose rows lie `stride` apart.
struct Rows {
  B* p;
  int64_t stride;
  B* row(int64_t i) const { return p + i * stride; }
};

Rows rows_of(const torch::Tensor& t) {
  return {reinterpret_cast<B*>(t.data_ptr<at::BFloat16>()), t.stride(0)};
}

// The plain loops (any width, any CPU); the AVX512 ones below do 16 lanes and end here.
float sum_squares(const B* x, const B* d, B* s, int64_t lo, int64_t n) {
  float acc = 0.f;
  for (int64_t i = lo; i < n; ++i) {
    float v = f(x[i]);
    if (d != nullptr) {
      s[i] = b(v + f(d[i]));
      v = f(s[i]);
    }
    acc += v * v;
  }
  return acc;
}

void scale_rows(const B* x, const B* w, float r, B* y, int64_t lo, int64_t n) {
  for (int64_t i = lo; i < n; ++i) y[i] = b(f(w[i]) * f(b(f(x[i]) * r)));
}

void silu_mul_row(const B* g, const B* u, B* y, int64_t lo, int64_t n) {
  for (int64_t i = lo; i < n; ++i) {
    const float x = f(g[i]);
    y[i] = b(f(b(x / (1.f + std::exp(-x)))) * f(u[i]));
  }
}

// One head: out[i] = bf16(bf16(x[i] c[i]) + bf16(rot(x)[i] s[i])), rot(x) = (-x[h:], x[:h]).
void rope_head(const B* x, const B* c, const B* s, B* y, int64_t lo, int64_t half) {
  for (int64_t i = lo; i < half; ++i) {
    const float a = f(x[i]), z = f(x[i + half]);
    y[i] = b(f(b(a * f(c[i]))) + f(b(-z * f(s[i]))));
    y[i + half] = b(f(b(z * f(c[i + half]))) + f(b(a * f(s[i + half]))));
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

#include "cpu_simd.h"  // load16, exp16

// Round 16 floats to bf16 as c10::BFloat16 does (nearest even, NaN to 0x7FC0), integer ops,
// kept in float32's high halves: bf() uses them as they are, a store packs them.
inline __m512i round16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC00000));
}

inline void store16(B* p, __m512 v) {
  const __m512i high = _mm512_srli_epi32(round16(v), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(high));
}

inline __m512 bf(__m512 v) {  // float32 -> bf16 -> float32: one bf16 rounding
  return _mm512_castsi512_ps(_mm512_and_si512(round16(v), _mm512_set1_epi32(0xFFFF0000)));
}


float sum_squares16(const B* x, const B* d, B* s, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 v = load16(x + i);
    if (d != nullptr) {
      v = bf(_mm512_add_ps(v, load16(d + i)));
      store16(s + i, v);
    }
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  return _mm512_reduce_add_ps(acc) + sum_squares(x, d, s, i, n);
}

void scale_rows16(const B* x, const B* w, float r, B* y, int64_t n) {
  const __m512 rv = _mm512_set1_ps(r);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    store16(y + i, _mm512_mul_ps(load16(w + i), bf(_mm512_mul_ps(load16(x + i), rv))));
  }
  scale_rows(x, w, r, y, i, n);
}

void silu_mul_row16(const B* g, const B* u, B* y, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = load16(g + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
    const __m512 silu = bf(_mm512_div_ps(x, _mm512_add_ps(one, e)));
    store16(y + i, _mm512_mul_ps(silu, load16(u + i)));
  }
  silu_mul_row(g, u, y, i, n);
}

void rope_head16(const B* x, const B* c, const B* s, B* y, int64_t half) {
  const __m512 zero = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= half; i += 16) {
    const __m512 a = load16(x + i), z = load16(x + i + half);
    const __m512 lo_sin = _mm512_mul_ps(_mm512_sub_ps(zero, z), load16(s + i));
    store16(y + i, _mm512_add_ps(bf(_mm512_mul_ps(a, load16(c + i))), bf(lo_sin)));
    const __m512 hi_cos = bf(_mm512_mul_ps(z, load16(c + i + half)));
    store16(y + i + half, _mm512_add_ps(hi_cos, bf(_mm512_mul_ps(a, load16(s + i + half)))));
  }
  rope_head(x, c, s, y, i, half);
}

#pragma GCC pop_options

bool has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kBFloat16 && t.stride(1) == 1,
              name, " must be a bf16 [T, n] with contiguous rows");
}

// The norm of rows x (+ delta, rounded to bf16 into s): y = bf16(w bf16(x rsqrt(mean + eps))).
void norm_rows(const torch::Tensor& x, const B* d, int64_t d_stride, B* s, const torch::Tensor& w,
               double eps, bool avx512, torch::Tensor& out) {
  const int64_t n = x.size(1);
  const Rows xr = rows_of(x), yr = rows_of(out);
  const B* wp = reinterpret_cast<const B*>(w.data_ptr<at::BFloat16>());
  at::parallel_for(0, x.size(0), 16, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const B* dt = d == nullptr ? nullptr : d + t * d_stride;
      B* st = s == nullptr ? nullptr : s + t * n;
      const B* src = st == nullptr ? xr.row(t) : st;
      const float sq = avx512 ? sum_squares16(xr.row(t), dt, st, n) : sum_squares(xr.row(t), dt, st, 0, n);
      const float r = 1.f / std::sqrt(sq / static_cast<float>(n) + static_cast<float>(eps));
      if (avx512) scale_rows16(src, wp, r, yr.row(t), n);
      else scale_rows(src, wp, r, yr.row(t), 0, n);
    }
  });
}

}  // namespace

// RMSNorm of x [T, H] bf16 (rows contiguous) by weight [H] bf16 -> [T, H] bf16.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, bool avx512) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
              weight.scalar_type() == torch::kBFloat16, "weight must be a contiguous bf16 [H]");
  TORCH_CHECK(!avx512 || has_avx512(), "the AVX512 path needs AVX512F/BW/VL/DQ");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  norm_rows(x, nullptr, 0, nullptr, weight, eps, avx512, out);
  return out;
}

// (bf16(x + delta), its RMSNorm): the residual add and the norm it feeds, one pass.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta,
                                                      torch::Tensor weight, double eps, bool avx512) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  TORCH_CHECK(delta.sizes() == x.sizes(), "delta must be x's shape");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
              weight.scalar_type() == torch::kBFloat16, "weight must be a contiguous bf16 [H]");
  TORCH_CHECK(!avx512 || has_avx512(), "the AVX512 path needs AVX512F/BW/VL/DQ");
  auto sum = torch::empty({x.size(0), x.size(1)}, x.options());
  auto out = torch::empty_like(sum);
  const B* d = reinterpret_cast<const B*>(delta.data_ptr<at::BFloat16>());
  B* s = reinterpret_cast<B*>(sum.data_ptr<at::BFloat16>());
  norm_rows(x, d, delta.stride(0), s, weight, eps, avx512, out);
  return {sum, out};
}

// bf16(bf16(silu(gate)) * up) for gate, up [T, I] bf16 (rows contiguous, e.g. a fused
// gate_up's two halves) -> [T, I].
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up, bool avx512) {
  check_rows(gate, "gate");
  check_rows(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up must have one shape");
  TORCH_CHECK(!avx512 || has_avx512(), "the AVX512 path needs AVX512F/BW/VL/DQ");
  auto out = torch::empty({gate.size(0), gate.size(1)}, gate.options());
  const Rows g = rows_of(gate), u = rows_of(up), y = rows_of(out);
  const int64_t n = gate.size(1);
  at::parallel_for(0, gate.size(0), 4, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      if (avx512) silu_mul_row16(g.row(t), u.row(t), y.row(t), n);
      else silu_mul_row(g.row(t), u.row(t), y.row(t), 0, n);
    }
  });
  return out;
}

// Rope (rotate-half) of x [T, H, D] bf16 (heads contiguous, tokens strided) by cos, sin
// [T, D] bf16 contiguous -> a contiguous [T, H, D].
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, bool avx512) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kBFloat16 && x.stride(2) == 1 &&
              x.stride(1) == x.size(2), "x must be a bf16 [T, H, D] with contiguous heads");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 2 == 0, "the head dim must be even");
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == torch::kBFloat16 && t->dim() == 2 &&
                t->size(0) == T && t->size(1) == D, "cos and sin must be contiguous bf16 [T, D]");
  }
  TORCH_CHECK(!avx512 || has_avx512(), "the AVX512 path needs AVX512F/BW/VL/DQ");
  auto out = torch::empty({T, H, D}, x.options());
  const Rows xr = rows_of(x), yr = rows_of(out), c = rows_of(cos), s = rows_of(sin);
  at::parallel_for(0, T, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        const B* xh = xr.row(t) + h * D;
        B* yh = yr.row(t) + h * D;
        if (avx512) rope_head16(xh, c.row(t), s.row(t), yh, D / 2);
        else rope_head(xh, c.row(t), s.row(t), yh, 0, D / 2);
      }
    }
  });
  return out;
}
