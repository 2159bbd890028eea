// The AVX512-VNNI GEMM for many rows, and the torch entry points that pick a path. Built as one
// source after kernels/cpu_quant.cpp (kernels/cpu_quant.py joins them), whose helpers it uses.
//
// The GEMV there works one weight row at a time: a pair of blocks' dot product is 16 int32
// lanes, converted, scaled and summed in float32 for each activation row, then reduced across
// lanes for each output, so at 16 rows its float work, not the weight's bytes, is the step (two
// float ops and a reduction per 64 products). Here a tile of 16 weight rows is unpacked once
// into vpdpbusd's layout (lane j holds row j's bytes at 4 columns: a 16x16 transpose of dwords)
// and each activation row's 4 bytes are broadcast against it: a 32-column block is 8 vpdpbusd
// into one vector whose lanes are 16 outputs, scaled once, and no lane is ever reduced.
// Int4 and int8 weights of VNNI layers are held in that order from load (Int4Tiles: only the
// nibble unpack is left, 3 ops for two weight vectors; Int8Tiles: read as they lie) and served at
// every row count by `int4_tiled` and `int8_tiled`; the row-major fill below serves int5 and
// row-major int4 and int8 (AVX2 layers' weights, K off a multiple of 32, tests).

namespace {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

constexpr int64_t TILE = 16;  // weight rows a tile holds: the lanes of one output vector
// Activation rows one pass over a tile's blocks carries: 8 chains of vpdpbusd in flight, which
// cover its latency (4 cycles at one zmm a cycle here). 6 or 8 rows measured no faster (8 with
// two chains a row spills: 8 weights + 8 accumulators + 16 dot products > 32 registers);
// docs/quantization.md, "The GEMM's inner loop".
constexpr int PASS_ROWS = 4;
// From this many rows the GEMM serves the VNNI path (below it the GEMV): measured in
// docs/quantization.md, "The VNNI GEMM".
constexpr int64_t GEMM_ROWS = 4;

// One tile's weights as vpdpbusd reads them; each thread fills its own, tile after tile.
// Plain vectors of 16 lanes each (std::vector does not align __m512i here: unaligned loads).
// Both forms hold unsigned bytes (int8's shifted by 128), so that the activations, signed, are
// vpdpbusd's memory operand, broadcast by the instruction itself (`dot4`).
struct Tile {
  std::vector<int32_t> w;        // [K / 4][16]: lane j = weight row j's 4 bytes at 4 columns
  std::vector<float> scale;      // [B][16] int4/int5: lane j = row j's block scale
  std::vector<float> minimum;    // [B][16] int4/int5
  explicit Tile(int64_t K) : w(K / 4 * 16), scale(K / 32 * 16), minimum(K / 32 * 16) {}
  __m512i weights(int64_t g) const { return _mm512_loadu_si512(w.data() + g * 16); }
  void set_weights(int64_t g, __m512i v) { _mm512_storeu_si512(w.data() + g * 16, v); }
  void block(int64_t b, __m512i out[8]) const {  // block b's 8 vectors, as tile_pass reads them
    for (int g = 0; g < 8; ++g) out[g] = weights(b * 8 + g);
  }
};

// A tile of an int4 weight held tiled from load (Int4Tiles, kernels/cpu_quant.py): per block 4
// vectors whose lane j is row j's 4 nibble bytes at 4g..4g+3, i.e. columns 4g.. (low nibbles)
// and 16 + 4g.. (high): vpdpbusd's two weight vectors are an and and a shift with an and.
struct PackedTile {
  const int32_t* p;  // [B][4][16]
  void block(int64_t b, __m512i out[8]) const {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int g = 0; g < 4; ++g) {
      const __m512i v = _mm512_loadu_si512(p + (b * 4 + g) * 16);
      out[g] = _mm512_and_si512(v, low4);
      out[g + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
  }
};

// A tile of an int8 weight held tiled from load (Int8Tiles, kernels/cpu_quant.py): the [K / 4][16]
// dwords fill_int8 made on every call (lane j = row j's 4 bytes at 4 columns, w ^ 0x80), read
// where they lie.
struct Int8Tile {
  const int32_t* p;
  void block(int64_t b, __m512i out[8]) const {
    for (int g = 0; g < 8; ++g) out[g] = _mm512_loadu_si512(p + (b * 8 + g) * 16);
  }
};

// r[i] lane j <- r[j] lane i, for 16 vectors of 16 dwords.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4g + e]: per 128-bit lane L, rows 4g..4g+3 at column 4L + e
  __m512i u[16];
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // a 4x4 transpose of 128-bit lanes over u[e], u[4+e], ...
    const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    r[e] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + e] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// Each pair of blocks' 64 bytes of the tile's 16 rows (`bytes(row, b, pair)`) transposed into
// the tile: a short tile (the weight's last) repeats its last row, whose lanes are not stored.
// `at(row, b)` is where a row's pair starts: the next tile's is prefetched (16 rows read side by
// side streamed at a third of the GEMV's rate from memory: SmolLM2's 49152-row head).
template <typename Bytes, typename At>
void fill_weights(Tile& t, int64_t B, const int64_t row[TILE], Bytes bytes, At at) {
  for (int64_t b = 0; b < B; b += 2) {
    const bool pair = b + 1 < B;
    __m512i r[TILE];
    for (int j = 0; j < TILE; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(at(row[j] + TILE, b)), _MM_HINT_T0);
      r[j] = bytes(row[j], b, pair);
    }
    transpose16(r);
    for (int g = 0; g < (pair ? 16 : 8); ++g) t.set_weights(b * 8 + g, r[g]);
  }
}

inline void tile_rows(int64_t n0, int64_t rows, int64_t row[TILE]) {
  for (int j = 0; j < TILE; ++j) row[j] = n0 + std::min<int64_t>(j, rows - 1);
}

template <bool HIGH, typename S>
void fill_affine(Tile& t, const uint8_t* q, const uint8_t* high, const S* scales, const S* mins,
                 int64_t K, int64_t n0, int64_t rows) {
  const int64_t B = K / 32;
  int64_t row[TILE];
  tile_rows(n0, rows, row);
  const auto at = [&](int64_t n, int64_t b) { return q + n * (K / 2) + b * 16; };
  fill_weights(t, B, row, [&](int64_t n, int64_t b, bool pair) {
    return unsigned64<HIGH>(at(n, b), HIGH ? high + n * (K / 8) + b * 4 : nullptr, pair);
  }, at);
  alignas(64) float s[TILE], mn[TILE];
  for (int64_t b = 0; b < B; ++b) {
    for (int j = 0; j < TILE; ++j) {
      s[j] = float(scales[row[j] * B + b]);
      mn[j] = float(mins[row[j] * B + b]);
    }
    _mm512_storeu_ps(t.scale.data() + b * 16, _mm512_load_ps(s));
    _mm512_storeu_ps(t.minimum.data() + b * 16, _mm512_load_ps(mn));
  }
}

void fill_int8(Tile& t, const int8_t* q, int64_t K, int64_t n0, int64_t rows) {
  int64_t row[TILE];
  tile_rows(n0, rows, row);
  const auto at = [&](int64_t n, int64_t b) { return q + n * K + b * 32; };
  const __m512i shift = _mm512_set1_epi8(char(0x80));  // w + 128 as an unsigned byte
  fill_weights(t, K / 32, row, [&](int64_t n, int64_t b, bool pair) {
    return _mm512_xor_si512(_mm512_maskz_loadu_epi8(pair_mask(pair), at(n, b)), shift);
  }, at);
}

// acc += w's unsigned bytes . the 4 signed bytes at p in each lane: vpdpbusd with its memory
// operand broadcast ({1to16}), which GCC does not fold from _mm512_set1_epi32 (a separate
// vpbroadcastd a product: 8 more instructions a block and row).
inline __m512i dot4(__m512i acc, __m512i w, const uint8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// Activation rows m0..m0+R against a filled tile, into y's 16 columns from n0 (`keep` of them).
// int4/int5 (INT8 false): scaled per block, plus the minimums through the activations' block
// sums. int8: the weights' +128 shift taken off by -128 times the activation's integer block sum
// (`shift`, [M, B]), and each output scaled by its row's scale (`row_scale`) at the end: the
// same integers as signed weights by unsigned activations gave.
template <int R, bool INT8, typename W>
void tile_pass(const Q8Rows& xq, const int32_t* shift, const W& t, const float* scales,
               const float* minimums, int64_t m0, float* y, int64_t N, int64_t n0,
               __mmask16 keep, __m512 row_scale) {
  const int64_t K = xq.K, B = xq.B;
  const uint8_t* x = reinterpret_cast<const uint8_t*>(xq.q.data()) + m0 * K;
  const float* xscale = xq.scales.data() + m0 * xq.P * 16;  // block b's at 8b (pair_scales)
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    __m512i w[8];
    t.block(b, w);
    const __m512 scale = _mm512_loadu_ps(scales + b * 16);
    const __m512 minimum = _mm512_loadu_ps(minimums + b * 16);
#pragma GCC unroll 8  // else GCC loops over the rows with acc[] on the stack
    for (int r = 0; r < R; ++r) {
      const uint8_t* xb = x + r * K + b * 32;
      // two chains of 4, so that R rows make 2R independent ones
      __m512i lo = INT8 ? _mm512_set1_epi32(shift[(m0 + r) * B + b]) : _mm512_setzero_si512();
      __m512i hi = _mm512_setzero_si512();
      for (int g = 0; g < 4; ++g) {
        lo = dot4(lo, w[g], xb + 4 * g);
        hi = dot4(hi, w[g + 4], xb + 16 + 4 * g);
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi));
      const __m512 xs = _mm512_set1_ps(xscale[r * xq.P * 16 + b * 8]);
      if constexpr (INT8) {
        acc[r] = _mm512_fmadd_ps(dot, xs, acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, xs), acc[r]);
        const __m512 xsum = _mm512_set1_ps(xq.sums[(m0 + r) * B + b]);
        acc[r] = _mm512_fmadd_ps(minimum, xsum, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 out = INT8 ? _mm512_mul_ps(acc[r], row_scale) : acc[r];
    _mm512_mask_storeu_ps(y + (m0 + r) * N + n0, keep, out);
  }
}

// Where a tile's passes store (tile_pass writes float32 rows of 16 lanes at y + m * N + n0):
// a float32 y itself; for a bf16 y a [M][16] float32 scratch of the thread's, whose rows are
// rounded into y (store_bf16) once the tile's passes end, so no float32 [M, N] is ever made.
template <typename O>
struct TileOut;

template <>
struct TileOut<float> {
  float* y;
  int64_t N;
  TileOut(float* y, int64_t, int64_t N) : y(y), N(N) {}
  float* at() { return y; }
  int64_t stride() const { return N; }
  int64_t col(int64_t n0) const { return n0; }
  void flush(int64_t, int64_t, __mmask16) {}
};

template <>
struct TileOut<at::BFloat16> {
  at::BFloat16* y;
  int64_t N;
  std::vector<float> scratch;  // [M][16]
  TileOut(at::BFloat16* y, int64_t M, int64_t N) : y(y), N(N), scratch(M * TILE) {}
  float* at() { return scratch.data(); }
  int64_t stride() const { return TILE; }
  int64_t col(int64_t) const { return 0; }
  void flush(int64_t M, int64_t n0, __mmask16 keep) {
    for (int64_t m = 0; m < M; ++m) {
      store_bf16(y + m * N + n0, _mm512_loadu_ps(scratch.data() + m * TILE), keep);
    }
  }
};

// int8's shift: -128 times each row's integer sum over each 32-column block, [M, B].
std::vector<int32_t> int8_shift(const Q8Rows& xq, int64_t M) {
  std::vector<int32_t> shift(M * xq.B);
  for (int64_t i = 0; i < M * xq.B; ++i) {
    int32_t sum = 0;
    for (int k = 0; k < 32; ++k) sum += xq.q[i * 32 + k];
    shift[i] = -128 * sum;
  }
  return shift;
}

// y [M, N] = x @ W.T over tiles of 16 weight rows, split across torch's threads; `fill(t, n0,
// rows)` unpacks a tile, `row_scales` (int8's, else null) scale each output column.
template <bool INT8, typename O, typename Fill>
void gemm(const Q8Rows& xq, int64_t M, int64_t N, O* y, const float* row_scales, Fill fill) {
  const std::vector<int32_t> shift = INT8 ? int8_shift(xq, M) : std::vector<int32_t>();
  const int64_t tiles = (N + TILE - 1) / TILE;
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    Tile t(xq.K);
    TileOut<O> out(y, M, N);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = i * TILE, rows = std::min(TILE, N - n0);
      fill(t, n0, rows);
      const __mmask16 keep = rows == TILE ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
      const __m512 rs = INT8 ? _mm512_maskz_loadu_ps(keep, row_scales + n0) : _mm512_set1_ps(1.f);
      for (int64_t m0 = 0; m0 < M; m0 += PASS_ROWS) {
        switch (std::min<int64_t>(PASS_ROWS, M - m0)) {
#define PASS(R) \
  case R: \
    tile_pass<R, INT8>(xq, shift.data(), t, t.scale.data(), t.minimum.data(), m0, out.at(), \
                       out.stride(), out.col(n0), keep, rs); \
    break;
          PASS(1) PASS(2) PASS(3) PASS(4)
#undef PASS
        }
      }
      out.flush(M, n0, keep);
    }
  });
}

// Up to this many rows each pass over a tiled int4 weight unpacks its nibbles in registers (an
// and, a shift and an and per weight vector); past it a tile is unpacked once into a Tile for
// all the passes. Measured: in place 1.0-1.6x at 6-16 rows, unpacked once 1.01-1.09x at 64
// (docs/quantization.md, "Int4 weights in tile order").
constexpr int64_t IN_PLACE_ROWS = 16;

// y [M, N] = x @ W.T for an int4 weight held tiled (`tiles` [T][B][4][16] dwords, scales and
// minimums [T][B][16]): no call gathers a row or transposes a tile, at any row count (the
// 1-3-row GEMV's horizontal sums are not needed either: a tile's 16 outputs are one vector).
template <typename O>
void int4_tiled(const Q8Rows& xq, int64_t M, int64_t N, O* y, const uint8_t* tiles,
                const float* scales, const float* mins) {
  const int64_t K = xq.K, B = xq.B, T = (N + TILE - 1) / TILE;
  // one pass: about 64 KiB of weights a task, as the GEMV's; more: 4 tiles, as the GEMM's
  const int64_t grain = M > PASS_ROWS ? 4 : std::max<int64_t>(1, (int64_t(1) << 16) / (K * 8));
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    Tile t(M > IN_PLACE_ROWS ? K : 0);
    TileOut<O> out(y, M, N);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = i * TILE, rows = std::min(TILE, N - n0);
      const __mmask16 keep = rows == TILE ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
      const PackedTile packed{reinterpret_cast<const int32_t*>(tiles + i * TILE * K / 2)};
      const float* s = scales + i * B * TILE;
      const float* mn = mins + i * B * TILE;
      const __m512 one = _mm512_set1_ps(1.f);
      if (M > IN_PLACE_ROWS) {
        for (int64_t b = 0; b < B; ++b) {
          __m512i w[8];
          packed.block(b, w);
          for (int g = 0; g < 8; ++g) t.set_weights(b * 8 + g, w[g]);
        }
      }
      for (int64_t m0 = 0; m0 < M; m0 += PASS_ROWS) {
        switch (std::min<int64_t>(PASS_ROWS, M - m0)) {
#define PASS(R) \
  case R: \
    if (M > IN_PLACE_ROWS) \
      tile_pass<R, false>(xq, nullptr, t, s, mn, m0, out.at(), out.stride(), out.col(n0), keep, one); \
    else \
      tile_pass<R, false>(xq, nullptr, packed, s, mn, m0, out.at(), out.stride(), out.col(n0), keep, one); \
    break;
          PASS(1) PASS(2) PASS(3) PASS(4)
#undef PASS
        }
      }
      out.flush(M, n0, keep);
    }
  });
}

// y [M, N] = x @ W.T for an int8 weight held tiled (`tiles` [T][K / 4][16] dwords, unsigned) and
// its rows' scales [N]: every row count reads the tiles in place (the 1-3-row GEMV's horizontal
// sums are not needed: a tile's 16 outputs are one vector), and no call transposes a tile.
template <typename O>
void int8_tiled(const Q8Rows& xq, int64_t M, int64_t N, O* y, const uint8_t* tiles,
                const float* row_scales) {
  const int64_t K = xq.K, T = (N + TILE - 1) / TILE;
  const std::vector<int32_t> shift = int8_shift(xq, M);
  const std::vector<float> unused(xq.B * TILE);  // tile_pass's int4 scales, not read for int8
  // one pass: about 64 KiB of weights a task, as the GEMV's; more: 4 tiles, as the GEMM's
  const int64_t grain = M > PASS_ROWS ? 4 : std::max<int64_t>(1, (int64_t(1) << 16) / (K * TILE));
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    TileOut<O> out(y, M, N);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = i * TILE, rows = std::min(TILE, N - n0);
      const __mmask16 keep = rows == TILE ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
      const Int8Tile t{reinterpret_cast<const int32_t*>(tiles + i * TILE * K)};
      const __m512 rs = _mm512_maskz_loadu_ps(keep, row_scales + n0);
      const float* none = unused.data();
      for (int64_t m0 = 0; m0 < M; m0 += PASS_ROWS) {
        switch (std::min<int64_t>(PASS_ROWS, M - m0)) {
#define PASS(R) \
  case R: \
    tile_pass<R, true>(xq, shift.data(), t, none, none, m0, out.at(), out.stride(), out.col(n0), \
                       keep, rs); \
    break;
          PASS(1) PASS(2) PASS(3) PASS(4)
#undef PASS
        }
      }
      out.flush(M, n0, keep);
    }
  });
}

#pragma GCC pop_options

// The AVX2 GEMV over any number of rows: 8 at a time over 64 weight rows at a time, so that
// each stretch of weights comes from memory once for all of them. f(m0, rows, begin, end).
template <typename F>
void avx2_rows(int64_t M, int64_t N, int64_t K, F f) {
  over_rows(N, K, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n += 64) {
      for (int64_t m = 0; m < M; m += 8) f(m, std::min<int64_t>(8, M - m), n, std::min(end, n + 64));
    }
  });
}

// f(y's data) as float32 or bf16 (the VNNI path's outputs, in x's dtype).
template <typename F>
void with_out(torch::Tensor& y, F f) {
  if (y.scalar_type() == torch::kBFloat16) return f(y.data_ptr<at::BFloat16>());
  f(y.data_ptr<float>());
}

}  // namespace

// Each entry point takes `vnni`: the AVX512-VNNI path (activations quantized to int8 per 32
// columns; the GEMV below GEMM_ROWS rows, the GEMM from there) where true, the AVX2 float path
// otherwise. On the VNNI path x may be bf16 as well as float32 and y is in x's dtype (rounded
// to bf16 as each vector of 16 outputs is stored); the AVX2 path takes float32 only.

torch::Tensor int8_mm(torch::Tensor x, torch::Tensor q, torch::Tensor scales, bool vnni) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar, "q must be int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1), M = x.size(0);
  const bool on_vnni = vnni && K % 32 == 0;  // other widths (no model's) take the float path
  check(x, q, K, on_vnni);
  check_vnni(vnni);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() &&
              scales.numel() == N, "scales must be float32 [N]");
  auto y = torch::empty({M, N}, x.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  if (on_vnni) {
    const Q8Rows xq = quantize_input(x);
    if (M >= GEMM_ROWS) {
      with_out(y, [&](auto* yp) {
        gemm<true>(xq, M, N, yp, sp, [&](Tile& t, int64_t n0, int64_t rows) {
          fill_int8(t, qp, K, n0, rows);
        });
      });
      return y;
    }
    gemv_out(y, [&](float* yp) {
      over_rows(N, K, [&](int64_t b, int64_t e) {
        switch (M) {
#define ROWS(R) case R: int8_rows_vnni<R>(xq, qp, sp, yp, N, b, e); break;
          ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
        }
      });
    });
    return y;
  }
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  avx2_rows(M, N, K, [&](int64_t m, int64_t rows, int64_t b, int64_t e) {
    switch (rows) {
#define ROWS(R) case R: int8_rows<R>(xp + m * K, qp, sp, yp + m * N, K, N, b, e); break;
      ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
    }
  });
  return y;
}

namespace {

// int4 (HIGH false, float32 scales) and int5 (HIGH true, f16 scales) on either path.
template <bool HIGH, typename S>
torch::Tensor affine_mm(const torch::Tensor& x, const uint8_t* qp, const uint8_t* hp,
                        const S* sp, const S* mp, int64_t N, bool vnni) {
  const int64_t M = x.size(0), K = x.size(1), B = K / 32;
  auto y = torch::empty({M, N}, x.options());
  if (vnni) {
    const Q8Rows xq = quantize_input(x);
    if (M >= GEMM_ROWS) {
      with_out(y, [&](auto* yp) {
        gemm<false>(xq, M, N, yp, nullptr, [&](Tile& t, int64_t n0, int64_t rows) {
          fill_affine<HIGH>(t, qp, hp, sp, mp, K, n0, rows);
        });
      });
      return y;
    }
    gemv_out(y, [&](float* yp) {
      over_rows(N, K, [&](int64_t b, int64_t e) {
        switch (M) {
#define ROWS(R) case R: affine_rows_vnni<R, HIGH>(xq, qp, hp, sp, mp, yp, N, b, e); break;
          ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
        }
      });
    });
    return y;
  }
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto xsum = x.view({M, B, 32}).sum(2).contiguous();  // each block's sum of x, for mins
  const float* xs = xsum.data_ptr<float>();
  avx2_rows(M, N, K, [&](int64_t m, int64_t rows, int64_t b, int64_t e) {
    switch (rows) {
#define ROWS(R) \
  case R: affine_rows<R, HIGH>(xp + m * K, xs + m * B, qp, hp, sp, mp, yp + m * N, K, N, b, e); break;
      ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
    }
  });
  return y;
}

void check_affine(const torch::Tensor& x, const torch::Tensor& q, const char* kind, bool vnni) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kByte, "q must be uint8 [N, K/2]");
  const int64_t K = q.size(1) * 2;
  check(x, q, K, vnni);
  check_vnni(vnni);
  TORCH_CHECK(K % 32 == 0, kind, " K must be a multiple of 32, not ", K);
}

void check_block_fields(const torch::Tensor& q, std::initializer_list<torch::Tensor> fields,
                        torch::ScalarType type, const char* message) {
  for (const auto& t : fields) {
    TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.dim() == 2 &&
                t.size(0) == q.size(0) && t.size(1) == q.size(1) / 16, message);
  }
}

}  // namespace

torch::Tensor int4_mm(torch::Tensor x, torch::Tensor q, torch::Tensor scales,
                      torch::Tensor mins, bool vnni) {
  check_affine(x, q, "int4", vnni);
  check_block_fields(q, {scales, mins}, torch::kFloat, "scales and mins must be float32 [N, K/32]");
  return affine_mm<false, float>(x, q.data_ptr<uint8_t>(), nullptr, scales.data_ptr<float>(),
                                 mins.data_ptr<float>(), q.size(0), vnni);
}

torch::Tensor int5_mm(torch::Tensor x, torch::Tensor q, torch::Tensor high,
                      torch::Tensor scales, torch::Tensor mins, bool vnni) {
  check_affine(x, q, "int5", vnni);
  const int64_t N = q.size(0), K = q.size(1) * 2;
  TORCH_CHECK(high.scalar_type() == torch::kByte && high.is_contiguous() && high.dim() == 2 &&
              high.size(0) == N && high.size(1) == K / 8, "high bits must be uint8 [N, K/8]");
  check_block_fields(q, {scales, mins}, torch::kHalf, "scales and mins must be float16 [N, K/32]");
  return affine_mm<true, at::Half>(x, q.data_ptr<uint8_t>(), high.data_ptr<uint8_t>(),
                                   scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(), N, vnni);
}


torch::Tensor int4_tiled_mm(torch::Tensor x, torch::Tensor tiles, torch::Tensor scales,
                            torch::Tensor mins, int64_t N) {
  TORCH_CHECK(tiles.dim() == 2 && tiles.scalar_type() == torch::kByte,
              "tiles must be uint8 [T * 16, K/2]");
  const int64_t padded = tiles.size(0), K = tiles.size(1) * 2;
  check(x, tiles, K, true);
  check_vnni(true);
  TORCH_CHECK(K % 32 == 0, "int4 K must be a multiple of 32, not ", K);
  TORCH_CHECK(padded % TILE == 0 && N <= padded && N > padded - TILE,
              "tiles hold ", padded, " rows: not whole tiles of ", N);
  check_block_fields(tiles, {scales, mins}, torch::kFloat, "scales and mins must be float32 [T * 16, K/32]");
  auto y = torch::empty({x.size(0), N}, x.options());
  const Q8Rows xq = quantize_input(x);
  with_out(y, [&](auto* yp) {
    int4_tiled(xq, x.size(0), N, yp, tiles.data_ptr<uint8_t>(), scales.data_ptr<float>(),
               mins.data_ptr<float>());
  });
  return y;
}

torch::Tensor int8_tiled_mm(torch::Tensor x, torch::Tensor tiles, torch::Tensor scales, int64_t N) {
  TORCH_CHECK(tiles.dim() == 2 && tiles.scalar_type() == torch::kByte,
              "int8 tiles must be uint8 [T * 16, K]");
  const int64_t padded = tiles.size(0), K = tiles.size(1);
  check(x, tiles, K, true);
  check_vnni(true);
  TORCH_CHECK(K % 32 == 0, "int8 tiles need K a multiple of 32, not ", K);
  TORCH_CHECK(padded % TILE == 0 && N <= padded && N > padded - TILE,
              "tiles hold ", padded, " rows: not whole tiles of ", N);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() &&
              scales.numel() == N, "scales must be float32 [N]");
  auto y = torch::empty({x.size(0), N}, x.options());
  const Q8Rows xq = quantize_input(x);
  with_out(y, [&](auto* yp) {
    int8_tiled(xq, x.size(0), N, yp, tiles.data_ptr<uint8_t>(), scales.data_ptr<float>());
  });
  return y;
}
