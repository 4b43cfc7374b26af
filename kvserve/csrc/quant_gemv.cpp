// Products with GGUF's 4-bit and 8-bit weights read as their codes, for decode-sized batches in float32
// (models/quant_linear.py; torch's int4 kernel is the bfloat16 path, and ~20x slower than a dense float32
// matmul on float32 activations). y (M, N) = x (M, K) W^T, w = q * scale + offset per group of 32 inputs.
//
// q4_linear: codes (N, ceil(K/64) * 8) int32 in kvserve's lane order (``Int4Weight.lane_words``): word l of
//   a pair of groups holds, in nibble j, the code of input 8j + l of the pair's 64 inputs (nibbles 4-7 are
//   the second group's; zero past K). consts (N, 2, K/32) float32: a row's scales, then its offsets.
// q8_linear: codes (N, K) int8, scales (N, K/32) float32 (no offset).
//
// The 4-bit decode has no shuffles: nibble j of each word is isolated with a mask (j % 4) after a 16-bit
// shift (j >= 4) and converted as it sits, i.e. as q * 16^(j % 4); the input rows are scaled by 16^-(j % 4)
// once per call instead. Both scalings are exact (powers of two), so each product q * x is rounded exactly
// as without them. Per group, sum_j q_j x_j runs in float32 on the codes (small integers, exact), then is
// scaled; the offsets meet the group sums of x, taken once per input row. Every output goes through the
// same instructions whatever M is and however the rows are split over threads, so a row's result never
// depends on its batch.
//
// q4_linear_q8 (int8 activations, opt-in: models/int8_activations.py): the 4-bit product with x rounded to int8
// per row and group of 32 first, q = round(x * 127 / max|x|) with the scale d = max|x| / 127 (llama.cpp's Q8_1).
// A group's sum_j code_j q_j is an exact integer (AVX2 maddubs: 32 byte products in one instruction against a
// float FMA's 8) that meets d_w * d_x in float32; the offsets meet d_x * sum_j q_j. The codes are ggml's own
// 4-bit bytes (nibbles (N, ceil(K/64) * 32) uint8: 16 bytes a group, byte j holding input j in its low nibble
// and input j + 16 in its high one; a zero group pads an odd count). Lossy against float32 activations
// (every input keeps 8 bits), batch invariant as above.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"
#include "ops.h"

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t ROW_TILE = 4;  // input rows that share one decode of the weights
constexpr int64_t OUT_GRAIN = 16;
constexpr int64_t ROW_BLOCK = 64;  // input rows a thread runs its outputs over at a time (int8 activations)

// The group sums of x: (M, K / 32), each in a fixed order.
std::vector<float> group_sums(const float* x, int64_t rows, int64_t k) {
  const int64_t groups = k / GROUP;
  std::vector<float> sums(rows * groups);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < groups; ++g)
      sums[m * groups + g] = kvserve_cpu::sequential_sum(x + m * k + g * GROUP, GROUP, false);
  return sums;
}

// sum_g offsets[g] * sums[g]: a row's offsets against its group sums, 8 lanes then the tail in order. Not
// inlined, so every tile size runs the same instructions (the result must not depend on the batch).
__attribute__((noinline, optimize("no-associative-math"))) float offset_dot(const float* offsets, const float* sums,
                                                                           int64_t groups) {
  int64_t g = 0;
  float total = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; g + 8 <= groups; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(offsets + g), _mm256_loadu_ps(sums + g), acc);
  total = kvserve_cpu::hsum8(acc);
#endif
  for (; g < groups; ++g) total += offsets[g] * sums[g];
  return total;
}

// Input j of a 4-bit pair sits in nibble (j / 8) of its word: the scale that undoes the nibble's place.
inline float nibble_unscale(int64_t input) { return 1.f / static_cast<float>(1 << (4 * ((input / 8) % 4))); }

#if defined(__AVX2__) && defined(__FMA__)
// One group's sum_j q_j x_j as 8 lanes, from its 4 code vectors and 32 (scaled) inputs.
inline __m256 group_dot(const __m256 w[4], const float* xg) {
  __m256 a = _mm256_mul_ps(w[0], _mm256_loadu_ps(xg));
  __m256 b = _mm256_mul_ps(w[1], _mm256_loadu_ps(xg + 8));
  a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), a);
  b = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), b);
  return _mm256_add_ps(a, b);
}

// The 4 code vectors of a group whose nibbles are the low 16 bits of each word (as q * 16^(j % 4)).
inline void nibble_codes(__m256i words, __m256 w[4]) {
  w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(words, _mm256_set1_epi32(0x000F)));
  w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(words, _mm256_set1_epi32(0x00F0)));
  w[2] = _mm256_cvtepi32_ps(_mm256_and_si256(words, _mm256_set1_epi32(0x0F00)));
  w[3] = _mm256_cvtepi32_ps(_mm256_and_si256(words, _mm256_set1_epi32(0xF000)));
}
#endif

// One weight row of 4-bit codes against TILE input rows (scaled as the lane order needs): y[t * ldy]. TILE is
// a compile-time constant so the accumulators stay in registers; a row's operations are the same for every TILE.
template <int TILE>
inline void q4_row(const int32_t* codes, const float* consts, int64_t groups, const float* xs, int64_t k,
                   const float* sums, float* y, int64_t ldy) {
#if defined(__AVX2__) && defined(__FMA__)
  // Even and odd groups in two accumulators: two dependency chains instead of one.
  __m256 even[TILE], odd[TILE];
  for (int t = 0; t < TILE; ++t) even[t] = odd[t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g += 2) {
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + g / 2 * 8));
    __m256 w[4];
    nibble_codes(words, w);
    const __m256 scale = _mm256_set1_ps(consts[g]);
    for (int t = 0; t < TILE; ++t) even[t] = _mm256_fmadd_ps(group_dot(w, xs + t * k + g * GROUP), scale, even[t]);
    if (g + 1 == groups) break;
    nibble_codes(_mm256_srli_epi32(words, 16), w);
    const __m256 scale2 = _mm256_set1_ps(consts[g + 1]);
    for (int t = 0; t < TILE; ++t)
      odd[t] = _mm256_fmadd_ps(group_dot(w, xs + t * k + (g + 1) * GROUP), scale2, odd[t]);
  }
  for (int t = 0; t < TILE; ++t)
    y[t * ldy] = kvserve_cpu::hsum8(_mm256_add_ps(even[t], odd[t])) + offset_dot(consts + groups, sums + t * groups, groups);
#else
  for (int t = 0; t < TILE; ++t) {
    float acc = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const int32_t* words = codes + g / 2 * 8;
      const int shift = g % 2 ? 16 : 0;
      float dot = 0.f;
      for (int64_t j = 0; j < GROUP; ++j) {
        const uint32_t word = static_cast<uint32_t>(words[j % 8]) >> shift;
        dot += static_cast<float>(word & (0xFu << (4 * (j / 8)))) * xs[t * k + g * GROUP + j];
      }
      acc += dot * consts[g];
    }
    y[t * ldy] = acc + offset_dot(consts + groups, sums + t * groups, groups);
  }
#endif
}

// One weight row of 8-bit codes against TILE input rows: y[t * ldy].
template <int TILE>
inline void q8_row(const int8_t* codes, const float* scales, int64_t groups, const float* x, int64_t k, float* y,
                   int64_t ldy) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[TILE];
  for (int t = 0; t < TILE; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* group = codes + g * GROUP;
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(group));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 16));
    const __m256 w[4] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)),
                         _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))),
                         _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
                         _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
    const __m256 scale = _mm256_set1_ps(scales[g]);
    for (int t = 0; t < TILE; ++t) acc[t] = _mm256_fmadd_ps(group_dot(w, x + t * k + g * GROUP), scale, acc[t]);
  }
  for (int t = 0; t < TILE; ++t) y[t * ldy] = kvserve_cpu::hsum8(acc[t]);
#else
  for (int t = 0; t < TILE; ++t) {
    float acc = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      float dot = 0.f;
      for (int64_t j = 0; j < GROUP; ++j) dot += static_cast<float>(codes[g * GROUP + j]) * x[t * k + g * GROUP + j];
      acc += dot * scales[g];
    }
    y[t * ldy] = acc;
  }
#endif
}

// x rows rounded to int8 per group of 32 (see the top), laid out for q4q8_rows: per row and pair of groups, 64
// code bytes [g0 x0-15 | g1 x0-15 | g0 x16-31 | g1 x16-31] (what the 4-bit bytes' low and high nibbles decode
// to), and 16 floats [d0 x4 | d1 x4 | s0 x4 | s1 x4] with s = d * sum_j q_j / 4 (a quarter, exact: the loop
// adds it in 4 lanes).
struct Int8Rows {
  std::vector<int8_t> q;  // (M, row_bytes)
  std::vector<float> f;   // (M, row_floats)
  int64_t row_bytes = 0, row_floats = 0;
};

// One group of 32 inputs rounded to int8: inputs 0-15 to lo, 16-31 to hi; its scale d and sum_j q_j. The AVX2
// path computes what the scalar one does (the same max, the same product, rounding to nearest even).
inline void quantize_group(const float* xg, int8_t* lo, int8_t* hi, float& d, int32_t& sum) {
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xg + 8 * i);
  const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  d = amax / 127.f;
  __m256i q[4];
  for (int i = 0; i < 4; ++i)
    q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
  sum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1))));
  // The packs interleave per 128-bit lane: 4-byte runs q0[0-3] q1[0-3] q2[0-3] q3[0-3] | q0[4-7] ...; put back in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm256_castsi256_si128(ordered));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm256_extracti128_si256(ordered, 1));
#else
  float amax = 0.f;
  for (int64_t j = 0; j < GROUP; ++j) amax = std::max(amax, std::fabs(xg[j]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  d = amax / 127.f;
  sum = 0;
  for (int64_t j = 0; j < GROUP; ++j) {
    const int32_t q = static_cast<int32_t>(std::nearbyint(xg[j] * inv));
    (j < 16 ? lo : hi)[j % 16] = static_cast<int8_t>(q);
    sum += q;
  }
#endif
}

Int8Rows quantize_rows(const float* x, int64_t rows, int64_t k) {
  const int64_t groups = k / GROUP, pairs = (groups + 1) / 2;
  Int8Rows out;
  out.row_bytes = pairs * 2 * GROUP;
  out.row_floats = pairs * 16;
  out.q.assign(rows * out.row_bytes, 0);
  out.f.assign(rows * out.row_floats, 0.f);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        int8_t* qp = out.q.data() + m * out.row_bytes + g / 2 * 64 + g % 2 * 16;
        float* fp = out.f.data() + m * out.row_floats + g / 2 * 16 + g % 2 * 4;
        float d;
        int32_t sum;
        quantize_group(x + m * k + g * GROUP, qp, qp + 32, d, sum);
        for (int64_t lane = 0; lane < 4; ++lane) {
          fp[lane] = d;
          fp[8 + lane] = d * static_cast<float>(sum) * 0.25f;
        }
      }
  });
  return out;
}

#if defined(__AVX2__) && defined(__FMA__)
// [a x4 | b x4]: a pair of groups' constants in the lanes their dot products land in.
inline __m256 pair_lanes(float a, float b) { return _mm256_set_m128(_mm_set1_ps(b), _mm_set1_ps(a)); }
#endif

// OUTS weight rows of 4-bit codes as ggml stores them (see the top; row j at nibbles + j * row_nibbles, its
// constants at consts + j * 2 * groups) against TILE int8 rows (Int8Rows): y[t * ldy + j]. Two weight rows
// share each load of the inputs, and TILE input rows each decode of the weights. A weight row's output runs
// the same instructions whatever OUTS and TILE are (one accumulator, the same order), so it never depends on
// its neighbours or its batch.
template <int OUTS, int TILE>
inline void q4q8_rows(const uint8_t* nibbles, int64_t row_nibbles, const float* consts, int64_t groups,
                      const int8_t* xq, const float* xf, int64_t row_bytes, int64_t row_floats, float* y, int64_t ldy) {
  const int64_t pairs = (groups + 1) / 2;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[OUTS][TILE];
  for (int j = 0; j < OUTS; ++j)
    for (int t = 0; t < TILE; ++t) acc[j][t] = _mm256_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const bool both = 2 * p + 1 < groups;  // an odd count's last group has no partner (its lanes: zero)
    __m256i lo[OUTS], hi[OUTS];
    __m256 scale[OUTS], offset[OUTS];
    for (int j = 0; j < OUTS; ++j) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles + j * row_nibbles + p * 32));
      lo[j] = _mm256_and_si256(bytes, low);
      hi[j] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
      const float* c = consts + j * 2 * groups;
      scale[j] = pair_lanes(c[2 * p], both ? c[2 * p + 1] : 0.f);
      offset[j] = pair_lanes(c[groups + 2 * p], both ? c[groups + 2 * p + 1] : 0.f);
    }
    for (int t = 0; t < TILE; ++t) {
      const int8_t* xp = xq + t * row_bytes + p * 64;
      const float* fp = xf + t * row_floats + p * 16;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 32));
      const __m256 d = _mm256_loadu_ps(fp), s = _mm256_loadu_ps(fp + 8);
      for (int j = 0; j < OUTS; ++j) {
        const __m256i sums = _mm256_add_epi16(_mm256_maddubs_epi16(lo[j], x0), _mm256_maddubs_epi16(hi[j], x1));
        const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums, ones));  // [g0 x4 | g1 x4]
        acc[j][t] = _mm256_fmadd_ps(offset[j], s, _mm256_fmadd_ps(dots, _mm256_mul_ps(scale[j], d), acc[j][t]));
      }
    }
  }
  for (int j = 0; j < OUTS; ++j)
    for (int t = 0; t < TILE; ++t) y[t * ldy + j] = kvserve_cpu::hsum8(acc[j][t]);
#else
  for (int j = 0; j < OUTS; ++j)
    for (int t = 0; t < TILE; ++t) {
      const uint8_t* nib = nibbles + j * row_nibbles;
      const float* c = consts + j * 2 * groups;
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const int8_t* xp = xq + t * row_bytes + g / 2 * 64 + g % 2 * 16;
        const float* fp = xf + t * row_floats + g / 2 * 16 + g % 2 * 4;
        int32_t dot = 0;
        for (int64_t i = 0; i < GROUP; ++i) dot += ((nib[g * 16 + i % 16] >> (4 * (i / 16))) & 0xF) * xp[i / 16 * 32 + i % 16];
        total += static_cast<float>(dot) * (c[g] * fp[0]) + 4.f * c[groups + g] * fp[8];
      }
      y[t * ldy + j] = total;
    }
#endif
}

// y[m, o] for every output o and row m: weight rows split over threads, input rows in tiles of up to
// ROW_TILE; row(o, m, tile) gets the tile's size as a compile-time constant (std::integral_constant).
template <typename RowFn>
void for_rows(int64_t rows, int64_t n, const RowFn& row) {
  at::parallel_for(0, n, OUT_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t m = 0; m < rows; m += ROW_TILE) {
        switch (std::min(ROW_TILE, rows - m)) {
          case 1: row(o, m, std::integral_constant<int, 1>{}); break;
          case 2: row(o, m, std::integral_constant<int, 2>{}); break;
          case 3: row(o, m, std::integral_constant<int, 3>{}); break;
          default: row(o, m, std::integral_constant<int, ROW_TILE>{}); break;
        }
      }
  });
}

// for_rows two weight rows at a time (the last of an odd share alone): row(o, m, outs, tile) covers outputs
// o..o + outs - 1, both counts compile-time constants. A thread takes its outputs ROW_BLOCK input rows at a
// time, so a prefill chunk's rows stay in the cache while its weights stream past.
template <typename RowFn>
void for_row_pairs(int64_t rows, int64_t n, const RowFn& row) {
  at::parallel_for(0, n, OUT_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t block = 0; block < rows; block += ROW_BLOCK)
    for (int64_t o = begin; o < end; o += 2)
      for (int64_t m = block; m < std::min(rows, block + ROW_BLOCK); m += ROW_TILE) {
        const bool pair = o + 1 < end;
        auto run = [&](auto tile) {
          if (pair)
            row(o, m, std::integral_constant<int, 2>{}, tile);
          else
            row(o, m, std::integral_constant<int, 1>{}, tile);
        };
        switch (std::min({ROW_TILE, rows - m, block + ROW_BLOCK - m})) {
          case 1: run(std::integral_constant<int, 1>{}); break;
          case 2: run(std::integral_constant<int, 2>{}); break;
          case 3: run(std::integral_constant<int, 3>{}); break;
          default: run(std::integral_constant<int, ROW_TILE>{}); break;
        }
      }
  });
}

void check_input(const char* name, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, name, ": x must be (M, K) float32, got ", x.sizes(),
              " ", x.scalar_type());
  TORCH_CHECK(x.size(1) % GROUP == 0, name, ": the input size ", x.size(1), " is not a multiple of ", GROUP);
}

}  // namespace

namespace kvserve_ops {

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& consts) {
  check_input("q4_linear", x);
  const int64_t rows = x.size(0), k = x.size(1), n = codes.size(0), groups = k / GROUP, words = (groups + 1) / 2 * 8;
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kInt && codes.size(1) == words && codes.is_contiguous(),
              "q4_linear: codes must be contiguous int32 (N, ", words, "), got ", codes.sizes(), " ",
              codes.scalar_type());
  TORCH_CHECK(consts.scalar_type() == at::kFloat && consts.is_contiguous() && consts.numel() == n * groups * 2,
              "q4_linear: consts must be contiguous float32 (N, 2, ", groups, ") with N = ", n);
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const std::vector<float> sums = group_sums(xp, rows, k);
  std::vector<float> scaled(rows * k);  // x in the codes' lane order: input j times 16^-(j / 8 % 4)
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t j = 0; j < k; ++j) scaled[m * k + j] = xp[m * k + j] * nibble_unscale(j);
  auto y = at::empty({rows, n}, x.options());
  float* yp = y.data_ptr<float>();
  const int32_t* cp = codes.data_ptr<int32_t>();
  const float* kp = consts.data_ptr<float>();
  for_rows(rows, n, [&](int64_t o, int64_t m, auto tile) {
    q4_row<decltype(tile)::value>(cp + o * words, kp + o * groups * 2, groups, scaled.data() + m * k, k,
                                  sums.data() + m * groups, yp + m * n + o, n);
  });
  return y;
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  check_input("q8_linear", x);
  const int64_t rows = x.size(0), k = x.size(1), n = codes.size(0), groups = k / GROUP;
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.size(1) == k && codes.is_contiguous(),
              "q8_linear: codes must be contiguous int8 (N, ", k, "), got ", codes.sizes(), " ", codes.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n * groups,
              "q8_linear: scales must be contiguous float32 (N, ", groups, ") with N = ", n);
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  auto y = at::empty({rows, n}, x.options());
  float* yp = y.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  for_rows(rows, n, [&](int64_t o, int64_t m, auto tile) {
    q8_row<decltype(tile)::value>(cp + o * k, sp + o * groups, groups, xp + m * k, k, yp + m * n + o, n);
  });
  return y;
}

at::Tensor q4_linear_q8(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& consts) {
  check_input("q4_linear_q8", x);
  const int64_t rows = x.size(0), k = x.size(1), n = nibbles.size(0), groups = k / GROUP, bytes = (groups + 1) / 2 * 32;
  TORCH_CHECK(nibbles.dim() == 2 && nibbles.scalar_type() == at::kByte && nibbles.size(1) == bytes &&
                  nibbles.is_contiguous(),
              "q4_linear_q8: nibbles must be contiguous uint8 (N, ", bytes, "), got ", nibbles.sizes(), " ",
              nibbles.scalar_type());
  TORCH_CHECK(consts.scalar_type() == at::kFloat && consts.is_contiguous() && consts.numel() == n * groups * 2,
              "q4_linear_q8: consts must be contiguous float32 (N, 2, ", groups, ") with N = ", n);
  const at::Tensor xc = x.contiguous();
  const Int8Rows xq = quantize_rows(xc.data_ptr<float>(), rows, k);
  auto y = at::empty({rows, n}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* np = nibbles.data_ptr<uint8_t>();
  const float* kp = consts.data_ptr<float>();
  for_row_pairs(rows, n, [&](int64_t o, int64_t m, auto outs, auto tile) {
    q4q8_rows<decltype(outs)::value, decltype(tile)::value>(np + o * bytes, bytes, kp + o * groups * 2, groups,
                                                            xq.q.data() + m * xq.row_bytes, xq.f.data() + m * xq.row_floats,
                                                            xq.row_bytes, xq.row_floats, yp + m * n + o, n);
  });
  return y;
}

}  // namespace kvserve_ops

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("q4_linear(Tensor x, Tensor codes, Tensor consts) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("q4_linear_q8(Tensor x, Tensor nibbles, Tensor consts) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("q4_linear", &kvserve_ops::q4_linear);
  m.impl("q8_linear", &kvserve_ops::q8_linear);
  m.impl("q4_linear_q8", &kvserve_ops::q4_linear_q8);
}
