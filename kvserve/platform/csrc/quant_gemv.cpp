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
// float FMA's 8) that meets d_w * d_x in float32; the offsets meet d_x * sum_j q_j. The codes are interleaved
// over blocks of 8 weight rows (ggml's repacked Q4 layout, ``Int4Weight.interleaved_nibbles``): nibbles
// (N, K / 2) uint8, N a multiple of 8, block b's bytes ordered [group][v = 0..3][row r][byte i], byte i holding
// the code of the group's input 8v + i in its low nibble and of input 8v + 4 + i in its high one; consts
// (N / 8, K / 32, 2, 8) float32: per block and group its rows' 8 scales, then their 8 offsets. So one vector
// of products covers 8 outputs and needs no horizontal sum. Lossy against float32 activations (every input keeps
// 8 bits), batch invariant as above.
//
// q8_linear_q8 (the Q8_0 head with int8 activations): the same rounding of x, against 8-bit codes interleaved the
// same way (``Int8Weight.interleaved_offset_codes``): codes (N, K) uint8 holding code + 128 (unsigned, as VNNI's
// byte products want them), block b's bytes ordered [group][v = 0..7][row r][byte i], byte i the code of the
// group's input 4v + i; scales (N / 8, K / 32, 8) float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"
#include "ops.h"

// VNNI (vpdpbusd: 4 byte products added into each 32-bit lane in one instruction, on 256-bit vectors) replaces
// AVX2's maddubs + 16-bit adds + madd. The integers are the same, so results are identical with and without it.
#if defined(__AVX2__) && defined(__FMA__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KVSERVE_VNNI 1
inline __m256i dot4_add(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_epi32(acc, u8, s8); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__AVXVNNI__)
#define KVSERVE_VNNI 1
inline __m256i dot4_add(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
#endif

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t ROW_TILE = 4;  // input rows that share one decode of the weights
constexpr int64_t OUT_GRAIN = 16;
constexpr int64_t ROW_BLOCK = 64;  // int8 activations: input rows a thread runs its outputs over at a time
static_assert(ROW_BLOCK % ROW_TILE == 0, "a row block holds whole tiles");
constexpr int64_t OUT_BLOCK = 8;   // int8 activations: weight rows interleaved in one block

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

// x rows rounded to int8 per group of 32 (see the top): q (M, K) int8 in input order, and per row and group two
// floats [d, s] with s = d * sum_j q_j (what the offsets meet).
struct Int8Rows {
  std::vector<int8_t> q;    // (M, K)
  std::vector<float> f;     // (M, 2 * K / 32)
  std::vector<int32_t> s;   // (M, K / 32): sum_j q_j per group
};

// One group of 32 inputs rounded to int8 (q: 32 bytes in input order); its scale d and sum_j q_j. The AVX2 path
// computes what the scalar one does (the same max, the same product, rounding to nearest even).
inline void quantize_group(const float* xg, int8_t* q, float& d, int32_t& sum) {
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
  __m256i r[4];
  for (int i = 0; i < 4; ++i)
    r[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
  sum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1))));
  // The packs interleave per 128-bit lane: 4-byte runs r0[0-3] r1[0-3] r2[0-3] r3[0-3] | r0[4-7] ...; put back in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
  float amax = 0.f;
  for (int64_t j = 0; j < GROUP; ++j) amax = std::max(amax, std::fabs(xg[j]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  d = amax / 127.f;
  sum = 0;
  for (int64_t j = 0; j < GROUP; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(xg[j] * inv));
    sum += q[j];
  }
#endif
}

Int8Rows quantize_rows(const float* x, int64_t rows, int64_t k) {
  const int64_t groups = k / GROUP;
  Int8Rows out;
  out.q.resize(rows * k);
  out.f.resize(rows * 2 * groups);
  out.s.resize(rows * groups);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        float* f = out.f.data() + (m * groups + g) * 2;
        int32_t& sum = out.s[m * groups + g];
        quantize_group(x + m * k + g * GROUP, out.q.data() + m * k + g * GROUP, f[0], sum);
        f[1] = f[0] * static_cast<float>(sum);
      }
  });
  return out;
}

#if defined(__AVX2__) && defined(__FMA__)
// 4 bytes (4 inputs of a row) in every 32-bit lane: one row's inputs against 8 weight rows' bytes.
inline __m256i broadcast4(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, 4);
  return _mm256_set1_epi32(word);
}
#endif

// A block of OUT_BLOCK weight rows (see the top: per group 4 vectors of 32 bytes, vector v holding 4 bytes of
// each row, byte i = input 8v + i in its low nibble and 8v + 4 + i in its high one; consts per group [8 scales |
// 8 offsets]) against TILE int8 rows: y[t * ldy + r] for the block's rows r. One maddubs multiplies 4 inputs of
// one row by the codes of 8 outputs; a group's 8 maddubs results add up in 16 bits (at most 8 * 2 * 15 * 127 =
// 30,480), so one madd and one conversion give the group's 8 dot products. Every output is one lane through the
// same instructions whatever TILE is: a row's result does not depend on its batch.
template <int TILE>
inline void q4q8_block(const uint8_t* codes, const float* consts, int64_t groups, const int8_t* xq, const float* xf,
                       int64_t k, float* y, int64_t ldy) {
#if defined(__AVX2__) && defined(__FMA__)
  const __m256i low = _mm256_set1_epi8(0x0F);
#if !defined(KVSERVE_VNNI)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[TILE];
  for (int t = 0; t < TILE; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i lo[4], hi[4];
    for (int v = 0; v < 4; ++v) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + g * 128 + v * 32));
      lo[v] = _mm256_and_si256(bytes, low);
      hi[v] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
    }
    const __m256 scale = _mm256_loadu_ps(consts + g * 16), offset = _mm256_loadu_ps(consts + g * 16 + 8);
    for (int t = 0; t < TILE; ++t) {
      const int8_t* xg = xq + t * k + g * GROUP;
      __m256i sums = _mm256_setzero_si256();
      for (int v = 0; v < 4; ++v) {
        // inputs 8v..8v+3 and 8v+4..8v+7, broadcast to every row's 4 bytes
        const __m256i first = broadcast4(xg + 8 * v), second = broadcast4(xg + 8 * v + 4);
#if defined(KVSERVE_VNNI)
        sums = dot4_add(dot4_add(sums, lo[v], first), hi[v], second);
      }
      const __m256 dots = _mm256_cvtepi32_ps(sums);  // the group's 8 dot products
#else
        sums = _mm256_add_epi16(sums, _mm256_maddubs_epi16(lo[v], first));
        sums = _mm256_add_epi16(sums, _mm256_maddubs_epi16(hi[v], second));
      }
      const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums, ones));  // the group's 8 dot products
#endif
      const float* f = xf + (t * groups + g) * 2;
      acc[t] = _mm256_fmadd_ps(offset, _mm256_set1_ps(f[1]),
                               _mm256_fmadd_ps(dots, _mm256_mul_ps(scale, _mm256_set1_ps(f[0])), acc[t]));
    }
  }
  for (int t = 0; t < TILE; ++t) _mm256_storeu_ps(y + t * ldy, acc[t]);
#else
  for (int t = 0; t < TILE; ++t)
    for (int64_t r = 0; r < OUT_BLOCK; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const int8_t* xg = xq + t * k + g * GROUP;
        const float* f = xf + (t * groups + g) * 2;
        int32_t dot = 0;
        for (int64_t v = 0; v < 4; ++v)
          for (int64_t i = 0; i < 4; ++i) {
            const uint8_t byte = codes[g * 128 + v * 32 + r * 4 + i];
            dot += (byte & 0xF) * xg[8 * v + i] + (byte >> 4) * xg[8 * v + 4 + i];
          }
        total += static_cast<float>(dot) * (consts[g * 16 + r] * f[0]) + consts[g * 16 + 8 + r] * f[1];
      }
      y[t * ldy + r] = total;
    }
#endif
}

// A block of OUT_BLOCK rows of 8-bit codes against TILE int8 rows: y[t * ldy + r]. The codes are stored as
// code + 128 (unsigned, see the top), per group 8 vectors of 32 bytes, vector v holding 4 bytes of each row
// (inputs 4v..4v+3). With VNNI one instruction adds 4 products (code + 128) * q into each row's lane, and
// 128 * sum_j q_j comes off once per group; without it, the code's sign moves onto q (|code| unsigned, at
// most 128, against +-q) for maddubs, whose pairs (at most 2 * 128 * 127) then add in 32 bits. The same exact
// integers either way; every output one lane through the same instructions whatever TILE is.
template <int TILE>
inline void q8q8_block(const uint8_t* codes, const float* scales, int64_t groups, const int8_t* xq, const float* xf,
                       const int32_t* xs, int64_t k, float* y, int64_t ldy) {
#if defined(__AVX2__) && defined(__FMA__)
#if !defined(KVSERVE_VNNI)
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[TILE];
  for (int t = 0; t < TILE; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i dots[TILE];
    for (int t = 0; t < TILE; ++t) dots[t] = _mm256_setzero_si256();
    for (int v = 0; v < 8; ++v) {
      const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + g * 256 + v * 32));
#if defined(KVSERVE_VNNI)
      for (int t = 0; t < TILE; ++t) dots[t] = dot4_add(dots[t], u, broadcast4(xq + t * k + g * GROUP + 4 * v));
#else
      const __m256i w = _mm256_xor_si256(u, bias), magnitude = _mm256_abs_epi8(w);
      for (int t = 0; t < TILE; ++t) {
        const __m256i signed_x = _mm256_sign_epi8(broadcast4(xq + t * k + g * GROUP + 4 * v), w);
        dots[t] = _mm256_add_epi32(dots[t], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones));
      }
#endif
    }
    const __m256 scale = _mm256_loadu_ps(scales + g * 8);
    for (int t = 0; t < TILE; ++t) {
#if defined(KVSERVE_VNNI)
      dots[t] = _mm256_sub_epi32(dots[t], _mm256_set1_epi32(128 * xs[t * groups + g]));
#endif
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[t]),
                               _mm256_mul_ps(scale, _mm256_set1_ps(xf[(t * groups + g) * 2])), acc[t]);
    }
  }
  for (int t = 0; t < TILE; ++t) _mm256_storeu_ps(y + t * ldy, acc[t]);
#else
  for (int t = 0; t < TILE; ++t)
    for (int64_t r = 0; r < OUT_BLOCK; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const int8_t* xg = xq + t * k + g * GROUP;
        int32_t dot = 0;
        for (int64_t v = 0; v < 8; ++v)
          for (int64_t i = 0; i < 4; ++i) dot += (codes[g * 256 + v * 32 + r * 4 + i] - 128) * xg[4 * v + i];
        total += static_cast<float>(dot) * (scales[g * 8 + r] * xf[(t * groups + g) * 2]);
      }
      y[t * ldy + r] = total;
    }
#endif
}

// fn(tile) for a tile of min(ROW_TILE, remaining) input rows, its size a compile-time constant
// (std::integral_constant) so the kernels keep their accumulators in registers.
template <typename Fn>
void with_row_tile(int64_t remaining, const Fn& fn) {
  switch (std::min(ROW_TILE, remaining)) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    default: fn(std::integral_constant<int, ROW_TILE>{}); break;
  }
}

// y[m, o] for every output o and row m: weight rows split over threads, input rows in tiles of up to
// ROW_TILE; row(o, m, tile) gets the tile's size as a compile-time constant.
template <typename RowFn>
void for_rows(int64_t rows, int64_t n, const RowFn& row) {
  at::parallel_for(0, n, OUT_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t m = 0; m < rows; m += ROW_TILE) with_row_tile(rows - m, [&](auto tile) { row(o, m, tile); });
  });
}

// y (M, N) = x W^T on int8 rows: x rounded (quantize_rows), then block(xq, b, m, tile, y + m * N + b * 8) for
// every block b of OUT_BLOCK interleaved weight rows and tile of input rows from m. Blocks split over threads, a
// thread taking its blocks ROW_BLOCK input rows at a time (so a prefill chunk's rows stay in the cache while the
// weights stream past), in tiles of up to ROW_TILE whose size is a compile-time constant (as in for_rows).
template <typename BlockFn>
at::Tensor on_int8_rows(const at::Tensor& x, int64_t n, const BlockFn& block) {
  const int64_t rows = x.size(0), k = x.size(1);
  const at::Tensor xc = x.contiguous();
  const Int8Rows xq = quantize_rows(xc.data_ptr<float>(), rows, k);
  auto y = at::empty({rows, n}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n / OUT_BLOCK, OUT_GRAIN / OUT_BLOCK, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < rows; first += ROW_BLOCK)
      for (int64_t b = begin; b < end; ++b)
        for (int64_t m = first; m < std::min(rows, first + ROW_BLOCK); m += ROW_TILE)  // ROW_BLOCK: whole tiles
          with_row_tile(rows - m, [&](auto tile) { block(xq, b, m, tile, yp + m * n + b * OUT_BLOCK); });
  });
  return y;
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
  const int64_t k = x.size(1), n = nibbles.size(0), groups = k / GROUP;
  TORCH_CHECK(nibbles.dim() == 2 && nibbles.scalar_type() == at::kByte && nibbles.size(1) == k / 2 &&
                  n % OUT_BLOCK == 0 && nibbles.is_contiguous(),
              "q4_linear_q8: nibbles must be contiguous uint8 (N, ", k / 2, ") with N a multiple of ", OUT_BLOCK,
              ", got ", nibbles.sizes(), " ", nibbles.scalar_type());
  TORCH_CHECK(consts.scalar_type() == at::kFloat && consts.is_contiguous() && consts.numel() == n * groups * 2,
              "q4_linear_q8: consts must be contiguous float32 (N / 8, ", groups, ", 2, 8) with N = ", n);
  const uint8_t* np = nibbles.data_ptr<uint8_t>();
  const float* kp = consts.data_ptr<float>();
  return on_int8_rows(x, n, [&](const Int8Rows& xq, int64_t b, int64_t m, auto tile, float* y) {
    q4q8_block<decltype(tile)::value>(np + b * OUT_BLOCK * k / 2, kp + b * OUT_BLOCK * groups * 2, groups,
                                      xq.q.data() + m * k, xq.f.data() + m * groups * 2, k, y, n);
  });
}

at::Tensor q8_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  check_input("q8_linear_q8", x);
  const int64_t k = x.size(1), n = codes.size(0), groups = k / GROUP;
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.size(1) == k && n % OUT_BLOCK == 0 &&
                  codes.is_contiguous(),
              "q8_linear_q8: codes must be contiguous uint8 (N, ", k, ") with N a multiple of ", OUT_BLOCK, ", got ",
              codes.sizes(), " ", codes.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n * groups,
              "q8_linear_q8: scales must be contiguous float32 (N / 8, ", groups, ", 8) with N = ", n);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  return on_int8_rows(x, n, [&](const Int8Rows& xq, int64_t b, int64_t m, auto tile, float* y) {
    q8q8_block<decltype(tile)::value>(cp + b * OUT_BLOCK * k, sp + b * OUT_BLOCK * groups, groups,
                                      xq.q.data() + m * k, xq.f.data() + m * groups * 2, xq.s.data() + m * groups, k,
                                      y, n);
  });
}

}  // namespace kvserve_ops

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("q4_linear(Tensor x, Tensor codes, Tensor consts) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("q4_linear_q8(Tensor x, Tensor nibbles, Tensor consts) -> Tensor");
  m.def("q8_linear_q8(Tensor x, Tensor codes, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("q4_linear", &kvserve_ops::q4_linear);
  m.impl("q8_linear", &kvserve_ops::q8_linear);
  m.impl("q4_linear_q8", &kvserve_ops::q4_linear_q8);
  m.impl("q8_linear_q8", &kvserve_ops::q8_linear_q8);
}
