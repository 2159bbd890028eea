// pdserve's CPU decode attention over the paged cache, read in place (kernels/cpu_attention.py
// says what it takes and where it runs). Built by torch's cpp_extension at first use.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// One task's view of the call: the cache halves' strides (elements) and the query heads that
// share a KV head (G of them, `dim` wide each).
struct Layout {
  int64_t block_size, dim, heads_per_kv, num_blocks;
  int64_t k_block, k_token, k_head, v_block, v_token, v_head;
};

// The keys [lo, hi) a query at position hi - 1 sees: all before it, or its last `window`.
inline int64_t first_key(int64_t hi, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, hi - window) : 0;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// The plain loop: scores of one block's keys for the G heads, then the online-softmax update.
template <typename T>
struct Plain {
  static void scores(const float* q, const T* k, int64_t k_token, int64_t keys, int64_t G,
                     int64_t D, float* s, int64_t s_stride) {
    for (int64_t t = 0; t < keys; ++t) {
      const T* kt = k + t * k_token;
      for (int64_t g = 0; g < G; ++g) {
        float acc = 0.f;
        for (int64_t d = 0; d < D; ++d) acc += q[g * D + d] * to_float(kt[d]);
        s[g * s_stride + t] = acc;
      }
    }
  }
  static void accumulate(const float* p, const T* v, int64_t v_token, int64_t keys, int64_t G,
                         int64_t D, float* acc, int64_t p_stride) {
    for (int64_t t = 0; t < keys; ++t) {
      const T* vt = v + t * v_token;
      for (int64_t g = 0; g < G; ++g) {
        const float w = p[g * p_stride + t];
        for (int64_t d = 0; d < D; ++d) acc[g * D + d] += w * to_float(vt[d]);
      }
    }
  }
  static void exp_shift(float* x, int64_t n, float shift) {
    for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i] - shift);
  }
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

#include "cpu_simd.h"  // load16, exp16

// The same three steps on 16 lanes (dim a multiple of 16).
template <typename T>
struct Avx512 {
  // A block of up to 16 keys, one head at a time: each key's 16 lanes of products as below,
  // then the 16 vectors summed together in _mm512_reduce_add_ps's own pairing (lanes 8 apart,
  // then 4 within the half, then 2 and 1): the same bits as a reduce per key.
  static void scores16(const float* q, const T* k, int64_t k_token, int64_t keys, int64_t G,
                       int64_t D, float* s, int64_t s_stride) {
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __mmask16 live = static_cast<__mmask16>((1u << keys) - 1);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      __m512 x[16];
      for (int64_t t = 0; t < 16; ++t) {
        if (t >= keys) {
          x[t] = _mm512_setzero_ps();
          continue;
        }
        const T* kt = k + t * k_token;
        __m512 acc = _mm512_mul_ps(load16(qg), load16(kt));
        for (int64_t d = 16; d < D; d += 16) acc = _mm512_fmadd_ps(load16(qg + d), load16(kt + d), acc);
        x[t] = acc;
      }
      __m512 c[8], v[4], w[2];
      for (int j = 0; j < 8; ++j)
        c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * j], x[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(x[2 * j], x[2 * j + 1], 0xEE));
      for (int j = 0; j < 4; ++j)
        v[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0xDD));
      for (int j = 0; j < 2; ++j)
        w[j] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * j], v[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(v[2 * j], v[2 * j + 1], 0xEE));
      const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88),
                                     _mm512_shuffle_ps(w[0], w[1], 0xDD));
      _mm512_mask_storeu_ps(s + g * s_stride, live, _mm512_permutexvar_ps(order, r));
    }
  }
  static void scores(const float* q, const T* k, int64_t k_token, int64_t keys, int64_t G,
                     int64_t D, float* s, int64_t s_stride) {
    if (keys <= 16) return scores16(q, k, k_token, keys, G, D, s, s_stride);
    for (int64_t t = 0; t < keys; ++t) {
      const T* kt = k + t * k_token;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        __m512 acc = _mm512_mul_ps(load16(qg), load16(kt));
        for (int64_t d = 16; d < D; d += 16) acc = _mm512_fmadd_ps(load16(qg + d), load16(kt + d), acc);
        s[g * s_stride + t] = _mm512_reduce_add_ps(acc);
      }
    }
  }
  // Head dim 64, up to 4 heads a KV head: the G x 4 accumulators stay in registers over the
  // block's keys (the same FMAs in the same order as the loop below: the same bits).
  template <int GG>
  static void accumulate64(const float* p, const T* v, int64_t v_token, int64_t keys,
                           float* acc, int64_t p_stride) {
    __m512 a[GG][4];
    for (int g = 0; g < GG; ++g)
      for (int c = 0; c < 4; ++c) a[g][c] = load16(acc + g * 64 + 16 * c);
    for (int64_t t = 0; t < keys; ++t) {
      const T* vt = v + t * v_token;
      const __m512 v0 = load16(vt), v1 = load16(vt + 16);
      const __m512 v2 = load16(vt + 32), v3 = load16(vt + 48);
      for (int g = 0; g < GG; ++g) {
        const __m512 w = _mm512_set1_ps(p[g * p_stride + t]);
        a[g][0] = _mm512_fmadd_ps(w, v0, a[g][0]);
        a[g][1] = _mm512_fmadd_ps(w, v1, a[g][1]);
        a[g][2] = _mm512_fmadd_ps(w, v2, a[g][2]);
        a[g][3] = _mm512_fmadd_ps(w, v3, a[g][3]);
      }
    }
    for (int g = 0; g < GG; ++g)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + g * 64 + 16 * c, a[g][c]);
  }
  static void accumulate(const float* p, const T* v, int64_t v_token, int64_t keys, int64_t G,
                         int64_t D, float* acc, int64_t p_stride) {
    if (D == 64) {  // 4 heads at a time (a row of several queries has G of each), the rest after
      int64_t g = 0;
      for (; g + 4 <= G; g += 4)
        accumulate64<4>(p + g * p_stride, v, v_token, keys, acc + g * 64, p_stride);
      p += g * p_stride, acc += g * 64;
      if (G - g == 1) return accumulate64<1>(p, v, v_token, keys, acc, p_stride);
      if (G - g == 2) return accumulate64<2>(p, v, v_token, keys, acc, p_stride);
      if (G - g == 3) return accumulate64<3>(p, v, v_token, keys, acc, p_stride);
      return;
    }
    for (int64_t t = 0; t < keys; ++t) {
      const T* vt = v + t * v_token;
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 vv = load16(vt + d);
        for (int64_t g = 0; g < G; ++g) {
          float* a = acc + g * D + d;
          _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(p[g * p_stride + t]), vv, load16(a)));
        }
      }
    }
  }
  static void exp_shift(float* x, int64_t n, float shift) {
    const __m512 m = _mm512_set1_ps(shift);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, exp16(_mm512_sub_ps(load16(x + i), m)));
    if (i < n) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
      const __m512 xs = _mm512_maskz_loadu_ps(tail, x + i);
      _mm512_mask_storeu_ps(x + i, tail, exp16(_mm512_sub_ps(xs, m)));
    }
  }
};

#pragma GCC pop_options

// One row's KV heads [h0, h1): walk the row's blocks from its first seen key, each block's
// heads in turn (the block's K and V read front to back, once for all the row's queries), an
// online softmax per query head (running max m, sum l, output acc), a block's scores computed
// at once. A row holds Q queries, the i-th at position len - Q + i (a verify step's drafts, or
// one decode query): it sees the keys [first_key(hi), hi), hi = len - Q + i + 1, the others
// masked out of a block's scores. Per KV head the task's G * Q query heads lie query-major
// (j = i * G + g); q, acc: [n * D] (n = (h1 - h0) G Q); s: [n * block_size].
template <typename T, typename Ops>
void attend_row(const float* q, const T* k_cache, const T* v_cache, const int32_t* table,
                int64_t len, int64_t Q, int64_t window, const Layout& L, int64_t h0, int64_t h1,
                float* acc, float* s) {
  const int64_t GQ = L.heads_per_kv * Q, D = L.dim, bs = L.block_size, n = (h1 - h0) * GQ;
  std::vector<float> m(n, -std::numeric_limits<float>::infinity()), l(n, 0.f);
  std::fill(acc, acc + n * D, 0.f);
  const int64_t lo = first_key(len - Q + 1, window);  // the first query's first key: the least
  const float none = -std::numeric_limits<float>::infinity();
  for (int64_t start = lo - lo % bs; start < len; start += bs) {
    const int64_t block = table[start / bs];
    TORCH_CHECK(block >= 0 && block < L.num_blocks, "block table names block ", block,
                " of a cache of ", L.num_blocks);
    const int64_t from = std::max(start, lo), keys = std::min(start + bs, len) - from;
    const T* k0 = k_cache + block * L.k_block + (from - start) * L.k_token;
    const T* v0 = v_cache + block * L.v_block + (from - start) * L.v_token;
    // The queries [i0, i1) that see any of the block's keys: a prefill chunk's earlier queries
    // come before it, a window's later ones past it. The others' scores are not computed and
    // their state is left as it was (what weight 0 gave them: the same bits, half the work of
    // a chunk's causal square).
    const int64_t i0 = std::max<int64_t>(0, from - (len - Q));
    int64_t i1 = Q;
    while (i1 > i0 && first_key(len - Q + i1, window) >= from + keys) --i1;
    if (i0 >= i1) continue;
    const int64_t seen = (i1 - i0) * L.heads_per_kv;  // their query heads, consecutive
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t first = (h - h0) * GQ + i0 * L.heads_per_kv;  // its first query head seen
      float* sh = s + first * bs;
      Ops::scores(q + first * D, k0 + h * L.k_head, L.k_token, keys, seen, D, sh, bs);
      for (int64_t i = i0; i < i1; ++i) {
        // The block's keys [a, b) that query i sees (the rest are past it, or before its window).
        const int64_t hi = len - Q + i + 1;
        const int64_t a = std::clamp<int64_t>(first_key(hi, window) - from, 0, keys);
        const int64_t b = std::clamp<int64_t>(hi - from, a, keys);
        const int64_t gi = first + (i - i0) * L.heads_per_kv;  // query i's first head
        for (int64_t g = gi; g < gi + L.heads_per_kv; ++g) {
          float* sg = s + g * bs;
          std::fill(sg, sg + a, none);
          std::fill(sg + b, sg + keys, none);
          if (a == b) {  // sees none of them: weight 0, its running state as it was
            std::fill(sg, sg + keys, 0.f);
            continue;
          }
          const float top = std::max(m[g], *std::max_element(sg + a, sg + b));
          Ops::exp_shift(sg, keys, top);  // exp(-inf) = 0 for the masked keys
          const float keep = std::exp(m[g] - top);  // 0 at the first block (m = -inf)
          if (keep != 1.f) {
            for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= keep;
          }
          float sum = 0.f;
          for (int64_t t = 0; t < keys; ++t) sum += sg[t];
          l[g] = l[g] * keep + sum;
          m[g] = top;
        }
      }
      Ops::accumulate(sh, v0 + h * L.v_head, L.v_token, keys, seen, D, acc + first * D, bs);
    }
  }
  for (int64_t g = 0; g < n; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= inv;
  }
}

template <typename T, typename Ops>
void attend_all(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                const torch::Tensor& tables, const torch::Tensor& lens,
                const std::vector<int64_t>& starts, double scale, int64_t window,
                torch::Tensor& out) {
  const int64_t R = tables.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  const Layout L{k_cache.size(1), D, H / Hkv, k_cache.size(0),
                 k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                 v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t width = tables.size(1), G = L.heads_per_kv;
  int64_t most = 1;  // the most queries a row holds
  for (int64_t r = 0; r < R; ++r) most = std::max(most, starts[r + 1] - starts[r]);
  // A task is a row with all its KV heads (each block read front to back), or one KV head of
  // a row where rows are fewer than threads.
  const int64_t per_task = R >= at::get_num_threads() ? Hkv : 1, tasks = R * (Hkv / per_task);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    const int64_t most_n = per_task * G * most;
    std::vector<float> qf(most_n * D), acc(most_n * D), s(most_n * L.block_size);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / (Hkv / per_task), h0 = task % (Hkv / per_task) * per_task;
      const int64_t len = lp[r], Q = starts[r + 1] - starts[r];
      TORCH_CHECK(len >= Q && len <= width * L.block_size, "row ", r, ": length ", len,
                  " outside its block table's ", width * L.block_size, " slots or under its ",
                  Q, " queries");
      // The task's heads [h][i][g] (KV head, query, head of the group), G * D values each
      // (h, i) from q's query i, heads h * G onwards.
      const float sc = static_cast<float>(scale);
      float* qj = qf.data();
      for (int64_t h = h0; h < h0 + per_task; ++h)
        for (int64_t i = 0; i < Q; ++i, qj += G * D) {
          const T* src = qp + ((starts[r] + i) * H + h * G) * D;
          for (int64_t e = 0; e < G * D; ++e) qj[e] = to_float(src[e]) * sc;
        }
      attend_row<T, Ops>(qf.data(), kp, vp, tp + r * width, len, Q, window, L, h0, h0 + per_task,
                         acc.data(), s.data());
      const float* aj = acc.data();
      for (int64_t h = h0; h < h0 + per_task; ++h)
        for (int64_t i = 0; i < Q; ++i, aj += G * D) {
          T* dst = op + ((starts[r] + i) * H + h * G) * D;
          for (int64_t e = 0; e < G * D; ++e) dst[e] = static_cast<T>(aj[e]);
        }
    }
  });
}

}  // namespace

// Decode attention: q [T, H, D] over each row's blocks of k_cache and v_cache [N, block_size,
// Hkv, D] (v_cache may be k_cache itself); block_tables [R, W] int32, lens [R] int32. A row
// holds queries[r] consecutive queries of q (int32 [R]; none: one each), the last at position
// lens[r] - 1, each seeing the keys up to its own position (causal); window > 0 keeps a query's
// last `window` keys. bf16 or float32, q's dtype the cache's; out [T, H, D] in it. avx512: the
// 16-lane path.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor lens, double scale,
                           int64_t window, bool avx512, c10::optional<torch::Tensor> queries) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [T, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be [N, block_size, Hkv, D] alike");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "cache rows must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q, k_cache and v_cache must have one dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "q's heads must be a multiple of the cache's, dims equal");
  const int64_t R = block_tables.size(0);
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt && block_tables.dim() == 2 &&
              block_tables.is_contiguous(), "block_tables must be a contiguous int32 [R, W]");
  TORCH_CHECK(lens.scalar_type() == torch::kInt && lens.is_contiguous() && lens.dim() == 1 &&
              lens.size(0) == R, "lens must be a contiguous int32 [R]");
  std::vector<int64_t> starts(R + 1, 0);  // each row's first query in q
  if (queries.has_value()) {
    const torch::Tensor& n = *queries;
    TORCH_CHECK(n.scalar_type() == torch::kInt && n.is_contiguous() && n.dim() == 1 &&
                n.size(0) == R, "queries must be a contiguous int32 [R]");
    const int32_t* np = n.data_ptr<int32_t>();
    for (int64_t r = 0; r < R; ++r) {
      TORCH_CHECK(np[r] >= 1, "row ", r, " holds ", np[r], " queries");
      starts[r + 1] = starts[r] + np[r];
    }
  } else {
    for (int64_t r = 0; r < R; ++r) starts[r + 1] = r + 1;
  }
  TORCH_CHECK(starts[R] == q.size(0), "the rows hold ", starts[R], " queries, q ", q.size(0));
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  TORCH_CHECK(!avx512 || (has && q.size(2) % 16 == 0),
              "the AVX512 path needs AVX512F/BW/VL/DQ and a head dim a multiple of 16");
  auto out = torch::empty_like(q);
  const auto type = q.scalar_type();
  if (type == torch::kFloat) {
    if (avx512) attend_all<float, Avx512<float>>(q, k_cache, v_cache, block_tables, lens, starts, scale, window, out);
    else attend_all<float, Plain<float>>(q, k_cache, v_cache, block_tables, lens, starts, scale, window, out);
  } else if (type == torch::kBFloat16) {
    using B = c10::BFloat16;
    if (avx512) attend_all<B, Avx512<B>>(q, k_cache, v_cache, block_tables, lens, starts, scale, window, out);
    else attend_all<B, Plain<B>>(q, k_cache, v_cache, block_tables, lens, starts, scale, window, out);
  } else {
    TORCH_CHECK(false, "paged_decode takes float32 or bfloat16, not ", type);
  }
  return out;
}

// K/V store: each token's rows key[t], value[t] ([Hkv, D], any row strides, D contiguous) into
// slot slot_mapping[t] of k_cache and v_cache [N, block_size, Hkv, D] (each slot's [Hkv, D]
// contiguous); a negative slot is not stored. One call for what index_copy_ took a dozen
// dispatches for, 30 times a step (kernels/cpu.py's store_kv, its reference).
void store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key and value must be [T, Hkv, D] alike");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
              k_cache.size(2) == key.size(1) && k_cache.size(3) == key.size(2),
              "k_cache and v_cache must be [N, block_size, Hkv, D] of the keys' heads and dim");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type() &&
              v_cache.scalar_type() == k_cache.scalar_type(), "key, value and caches must have one dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key and value rows must be contiguous");
  for (const auto& c : {k_cache, v_cache}) {
    TORCH_CHECK(c.stride(3) == 1 && c.stride(2) == c.size(3) && c.stride(1) == c.size(2) * c.size(3),
                "each cache slot's [Hkv, D] must be contiguous");
  }
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.dim() == 1 &&
              slot_mapping.is_contiguous() && slot_mapping.size(0) == key.size(0),
              "slot_mapping must be a contiguous int64 [T], a slot for each token");
  const int64_t T = slot_mapping.size(0), Hkv = key.size(1), D = key.size(2);
  const int64_t slots = k_cache.size(0) * k_cache.size(1), bs = k_cache.size(1);
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] < slots, "slot ", sp[t], " of token ", t, " is past the cache's ", slots);
  }
  const int64_t row = Hkv * D * key.element_size();
  auto copy = [&](const torch::Tensor& src, const torch::Tensor& cache) {
    const char* from = static_cast<const char*>(src.data_ptr());
    char* to = static_cast<char*>(cache.data_ptr());
    const int64_t es = src.element_size();
    const bool packed = src.stride(1) == D;  // a token's heads side by side: one copy
    for (int64_t t = 0; t < T; ++t) {
      if (sp[t] < 0) continue;
      char* slot = to + ((sp[t] / bs) * cache.stride(0) + (sp[t] % bs) * cache.stride(1)) * es;
      const char* tok = from + t * src.stride(0) * es;
      if (packed) {
        std::memcpy(slot, tok, row);
      } else {
        for (int64_t h = 0; h < Hkv; ++h) std::memcpy(slot + h * D * es, tok + h * src.stride(1) * es, D * es);
      }
    }
  };
  copy(key, k_cache);
  copy(value, v_cache);
}
