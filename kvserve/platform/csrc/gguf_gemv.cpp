// Products with GGUF weights read in their own block format, straight from the file (models/gguf_linear.py): the
// types of the K-quant mixes people download (Q4_K_M, Q5_K_M, Q6_K), Q4_K, Q5_K, Q6_K, and the fallbacks llama.cpp
// writes for rows whose length is not a multiple of 256, Q5_0 and Q8_0. Nothing is repacked: a weight is its
// tensor's bytes, (N, bytes per row) uint8, so a model can run from the mapped file and costs its file's size.
//
// gguf_linear(x (M, K) float32, weights [(N_i, row bytes) uint8], types [ggml type ids], out_index (sum N_i,)
// int64 or empty) -> (M, sum N_i) float32: the parts' outputs side by side (a fused q/k/v or gate/up); with
// out_index, weight row o (counting through the parts) writes column out_index[o] (llama.cpp's Q/K row order
// undone without copying the rows).
//
// As llama.cpp does, x is rounded to int8 first and a block's product is an exact integer sum of byte products:
//   - for the K-quants, per row and block of 256 inputs, q = round(x * 127 / max|x|), d = max|x| / 127 (ggml's Q8_K,
//     with the sums of q per 16 inputs kept for the minimums). A 256-weight superblock has one float16 d (and dmin)
//     and small integer scales per 32 (Q4_K, Q5_K: 6 bits, and 6-bit minimums) or per 16 (Q6_K: int8); the codes
//     meet q in byte products (maddubs), the sub-block scales multiply in 16 bits (madd, or VNNI's dpwssd), the
//     superblock's sum stays an integer until it meets d * d_x once.
//   - for Q5_0 / Q8_0, per row and block of 32 inputs (ggml's Q8_0), each block's integer dot meets its d * d_x.
// Codes are unsigned for the byte products: Q4_K / Q5_K codes are (0..15 / 0..31) and w = d sc q - dmin m; Q6_K
// codes 0..63 with w = d sc (q - 32); Q5_0 0..31 with w = d (q - 16); the offsets meet the sums of q. Q8_0's
// codes are signed: their magnitude meets q with the code's sign moved onto q.
//
// Every output is one weight row against one input row through the same instructions whatever the batch is and
// however outputs are split over threads: a row's result never depends on what runs beside it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace {

// ggml's type ids (gguf.GGMLQuantizationType).
constexpr int64_t Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14;
constexpr int64_t SUPER = 256;   // a K-quant superblock
constexpr int64_t BLOCK = 32;    // a Q5_0 / Q8_0 block
constexpr int64_t ROW_TILE = 4;  // input rows that share one decode of a weight row's codes
constexpr int64_t ROW_BLOCK = 64;  // input rows a thread runs its outputs over at a time (prefill chunks)
constexpr int64_t OUT_GRAIN = 16;

struct Layout {
  int64_t block;  // weights per block
  int64_t bytes;  // bytes per block
};

Layout layout_of(int64_t type) {
  switch (type) {
    case Q5_0: return {BLOCK, 22};
    case Q8_0: return {BLOCK, 34};
    case Q4_K: return {SUPER, 144};
    case Q5_K: return {SUPER, 176};
    case Q6_K: return {SUPER, 210};
    default: TORCH_CHECK(false, "gguf_linear: ggml type ", type, " is not one of Q5_0, Q8_0, Q4_K, Q5_K, Q6_K");
  }
  return {0, 0};
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Q4_K / Q5_K's 6-bit scales and minimums of the 8 sub-blocks, from their 12 packed bytes (ggml's get_scale_min_k4).
inline void scale_min_k4(const uint8_t* q, uint8_t sc[8], uint8_t m[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = q[j] & 63;
    m[j] = q[j + 4] & 63;
    sc[j + 4] = (q[j + 8] & 0x0F) | ((q[j] >> 6) << 4);
    m[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
  }
}

// x rounded to int8 per row and block of `block` inputs: q (M, K), d (M, K / block), sums of q per 16 (M, K / 16).
struct Int8Rows {
  int64_t block;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> sums;
};

Int8Rows quantize_rows(const float* x, int64_t rows, int64_t k, int64_t block) {
  Int8Rows out{block, std::vector<int8_t>(rows * k), std::vector<float>(rows * k / block),
               std::vector<int16_t>(rows * k / 16)};
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < k / block; ++b) {
        const float* xb = x + m * k + b * block;
        int8_t* qb = out.q.data() + m * k + b * block;
        float amax = 0.f;
        for (int64_t j = 0; j < block; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        out.d[m * (k / block) + b] = amax / 127.f;
        for (int64_t j = 0; j < block; ++j) qb[j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
        for (int64_t s = 0; s < block / 16; ++s) {
          int sum = 0;
          for (int64_t j = 0; j < 16; ++j) sum += qb[s * 16 + j];
          out.sums[(m * k + b * block) / 16 + s] = static_cast<int16_t>(sum);
        }
      }
  });
  return out;
}

// One block's weights as floats (the scalar path, and gguf_dequantize): ggml's dequantize_row_* for one block, with
// its rounding (a product, then a difference: never contracted into one FMA, so the values equal ggml's), in loops
// over 16 or 32 inputs with per-sub-block constants that the compiler vectorises.
template <int64_t TYPE>
__attribute__((optimize("fp-contract=off"))) void dequantize_block(const uint8_t* b, float* w) {
  if constexpr (TYPE == Q8_0) {
    const float d = half_at(b);
    for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(static_cast<int8_t>(b[2 + j]));
  } else if constexpr (TYPE == Q5_0) {
    const float d = half_at(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    for (int j = 0; j < 16; ++j) {
      const int lo = (b[6 + j] & 0x0F) | (((qh >> j) & 1) << 4);
      const int hi = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      w[j] = d * static_cast<float>(lo - 16);
      w[j + 16] = d * static_cast<float>(hi - 16);
    }
  } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
    const float d = half_at(b), dmin = half_at(b + 2);
    uint8_t sc[8], m[8];
    scale_min_k4(b + 4, sc, m);
    const uint8_t* qh = b + 16;                        // Q5_K: bit g of byte i = the high bit of sub-block g's input i
    const uint8_t* qs = b + (TYPE == Q5_K ? 48 : 16);  // byte i of pair p: sub-block 2p (low nibble), 2p + 1 (high)
    for (int g = 0; g < 8; ++g) {
      const float scale = d * static_cast<float>(sc[g]), offset = dmin * static_cast<float>(m[g]);
      const uint8_t* q = qs + g / 2 * 32;
      const int shift = 4 * (g % 2);
      for (int i = 0; i < 32; ++i) {
        int code = (q[i] >> shift) & 0x0F;
        if constexpr (TYPE == Q5_K) code |= ((qh[i] >> g) & 1) << 4;
        w[g * 32 + i] = scale * static_cast<float>(code) - offset;
      }
    }
  } else {  // Q6_K
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int h = 0; h < 2; ++h)
      for (int gg = 0; gg < 4; ++gg)
        for (int half = 0; half < 2; ++half) {  // 16 inputs share a scale
          const int e0 = h * 128 + gg * 32 + half * 16;
          const float scale = d * static_cast<float>(sc[e0 / 16]);
          const uint8_t* low = ql + h * 64 + (gg % 2) * 32 + half * 16;
          const uint8_t* high = qh + h * 32 + half * 16;
          for (int i = 0; i < 16; ++i) {
            const int q = ((low[i] >> (4 * (gg / 2))) & 0x0F) | (((high[i] >> (2 * gg)) & 3) << 4);
            w[e0 + i] = scale * static_cast<float>(q - 32);
          }
        }
  }
}

// Rows ids[i] of a weight of TYPE (`blocks` blocks a row, `stride` bytes apart) as float32 or bfloat16 rows of out.
template <int64_t TYPE, typename T>
void dequantize_rows(const uint8_t* w, int64_t stride, int64_t blocks, const int64_t* ids, int64_t count, T* out) {
  const Layout layout = layout_of(TYPE);
  const int64_t k = blocks * layout.block;
  at::parallel_for(0, count, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(k);
    for (int64_t i = begin; i < end; ++i) {
      float* dst = std::is_same_v<T, float> ? reinterpret_cast<float*>(out + i * k) : row.data();
      for (int64_t b = 0; b < blocks; ++b)
        dequantize_block<TYPE>(w + ids[i] * stride + b * layout.bytes, dst + b * layout.block);
      if constexpr (!std::is_same_v<T, float>)  // rounded to nearest even, as torch's conversion
        for (int64_t j = 0; j < k; ++j) out[i * k + j] = static_cast<T>(row[j]);
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__)
// acc + the 16-bit pair products p * s, added in pairs into 32-bit lanes (VNNI: one instruction).
inline __m256i madd_add(__m256i acc, __m256i p, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, p, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
#endif
}

// The sum of 4 byte products in each 32-bit lane, u unsigned and s signed (VNNI: one instruction).
inline __m256i dot4(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Bits (from, from + width) of every byte moved to bit 4: a 16-bit shift keeps each byte's bits in their byte at
// the positions that the mask keeps.
template <int FROM>
inline __m256i bits_to_4(__m256i v) {
  if constexpr (FROM < 4) return _mm256_slli_epi16(v, 4 - FROM);
  else if constexpr (FROM > 4) return _mm256_srli_epi16(v, FROM - 4);
  else return v;
}

// A K-quant superblock (Q4_K, Q5_K, Q6_K) against TILE int8 rows: acc[t] += the superblock's sum. The codes of each
// 32-input sub-block are decoded once as 32 unsigned bytes and meet every row of the tile.
template <int64_t TYPE, int TILE>
inline void superblock(const uint8_t* b, const int8_t* const xq[TILE], const float dx[TILE],
                       const int16_t* const xs[TILE], __m256 acc[TILE]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256i isum[TILE];
  for (int t = 0; t < TILE; ++t) isum[t] = _mm256_setzero_si256();
  __m256i offsets;  // per 16 inputs, what each meets the sums of q with (int16)
  float d, dmin;
  if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
    d = half_at(b), dmin = -half_at(b + 2);
    // The 12 bytes of 6-bit scales and minimums as 8 + 8 bytes (ggml's kmask trick), widened to 16 bits.
    uint32_t w[4];
    std::memcpy(w, b + 4, 12);
    w[3] = ((w[2] >> 4) & 0x0F0F0F0F) | (((w[1] >> 6) & 0x03030303) << 4);
    const uint32_t m_low = w[1] & 0x3F3F3F3F;
    w[1] = (w[2] & 0x0F0F0F0F) | (((w[0] >> 6) & 0x03030303) << 4);
    w[2] = m_low;
    w[0] &= 0x3F3F3F3F;
    const __m256i both = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    const __m256i scales = _mm256_permute2x128_si256(both, both, 0x00);  // sc0..7 in each half
    const __m128i mins = _mm256_extracti128_si256(both, 1);                  // m0..7
    const uint8_t* qs = b + (TYPE == Q5_K ? 48 : 16);
    __m256i u[8];  // sub-block g's 32 codes as bytes: pair g / 2's low (even g) or high (odd g) nibbles
    for (int p = 0; p < 4; ++p) {
      const __m256i v = load32(qs + p * 32);
      u[2 * p] = _mm256_and_si256(v, nibble);
      u[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    }
    if constexpr (TYPE == Q5_K) {  // bit g of byte i: sub-block g's fifth bit of input i
      const __m256i qh = load32(b + 16), bit4 = _mm256_set1_epi8(0x10);
      u[0] = _mm256_or_si256(u[0], _mm256_and_si256(bits_to_4<0>(qh), bit4));
      u[1] = _mm256_or_si256(u[1], _mm256_and_si256(bits_to_4<1>(qh), bit4));
      u[2] = _mm256_or_si256(u[2], _mm256_and_si256(bits_to_4<2>(qh), bit4));
      u[3] = _mm256_or_si256(u[3], _mm256_and_si256(bits_to_4<3>(qh), bit4));
      u[4] = _mm256_or_si256(u[4], _mm256_and_si256(bits_to_4<4>(qh), bit4));
      u[5] = _mm256_or_si256(u[5], _mm256_and_si256(bits_to_4<5>(qh), bit4));
      u[6] = _mm256_or_si256(u[6], _mm256_and_si256(bits_to_4<6>(qh), bit4));
      u[7] = _mm256_or_si256(u[7], _mm256_and_si256(bits_to_4<7>(qh), bit4));
    }
    for (int g = 0; g < 8; ++g) {
      const __m256i s = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * g)));
      for (int t = 0; t < TILE; ++t)
        isum[t] = madd_add(isum[t], _mm256_maddubs_epi16(u[g], load32(xq[t] + g * 32)), s);
    }
    offsets = _mm256_set_m128i(_mm_unpackhi_epi16(mins, mins), _mm_unpacklo_epi16(mins, mins));  // per 16 inputs
  } else {  // Q6_K: ql (128), qh (64), 16 int8 scales, d
    const uint8_t *ql = b, *qh = b + 128;
    d = half_at(b + 208), dmin = -32.f * d;
    offsets = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));  // sc0..15
    const __m256i bits45 = _mm256_set1_epi8(0x30);
    // sub-blocks 4h..4h+3 take scales 8h..8h+7: in each half of a vector
    const __m256i halves[2] = {_mm256_permute2x128_si256(offsets, offsets, 0x00),
                               _mm256_permute2x128_si256(offsets, offsets, 0x11)};
    for (int h = 0; h < 2; ++h) {
      const __m256i scales = halves[h];
      const __m256i low0 = load32(ql + h * 64), low1 = load32(ql + h * 64 + 32), high = load32(qh + h * 32);
      const __m256i u[4] = {
          _mm256_or_si256(_mm256_and_si256(low0, nibble), _mm256_and_si256(bits_to_4<0>(high), bits45)),
          _mm256_or_si256(_mm256_and_si256(low1, nibble), _mm256_and_si256(bits_to_4<2>(high), bits45)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low0, 4), nibble),
                          _mm256_and_si256(bits_to_4<4>(high), bits45)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low1, 4), nibble),
                          _mm256_and_si256(bits_to_4<6>(high), bits45))};
      for (int gg = 0; gg < 4; ++gg) {
        const int g = h * 4 + gg;
        // inputs 0-15 of the sub-block are the low 8 pair lanes (scale 2gg of the half), 16-31 the high 8 (2gg + 1)
        const int16_t first = static_cast<int16_t>(0x0100 + 0x0202 * (2 * gg));
        const __m256i s = _mm256_shuffle_epi8(scales, _mm256_set_m128i(_mm_set1_epi16(first + 0x0202),
                                                                        _mm_set1_epi16(first)));
        for (int t = 0; t < TILE; ++t)
          isum[t] = madd_add(isum[t], _mm256_maddubs_epi16(u[gg], load32(xq[t] + g * 32)), s);
      }
    }
  }
  for (int t = 0; t < TILE; ++t) {
    const __m256i mins = _mm256_madd_epi16(load32(xs[t]), offsets);  // per 32 inputs: offset * sum of q
    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(d * dx[t]), acc[t]);
    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_set1_ps(dmin * dx[t]), acc[t]);
  }
}

// The 32 high bits of Q5_0's codes as bytes holding 0x10 or 0 (byte j from bit j).
inline __m256i q5_0_high(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                             _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                                                0x0303030303030303LL));
  const __m256i mask = _mm256_set1_epi64x(0x8040201008040201LL);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask), _mm256_set1_epi8(0x10));
}

// A Q5_0 or Q8_0 block against TILE int8 rows (blocks of 32): acc[t] += d * d_x * dot, off[t] the offsets.
template <int64_t TYPE, int TILE>
inline void block32(const uint8_t* b, const int8_t* const xq[TILE], const float dx[TILE],
                    const int16_t* const xs[TILE], __m256 acc[TILE], float off[TILE]) {
  const float d = half_at(b);
  if constexpr (TYPE == Q8_0) {
    const __m256i w = load32(b + 2), magnitude = _mm256_sign_epi8(w, w);
    for (int t = 0; t < TILE; ++t) {
      const __m256i p = dot4(magnitude, _mm256_sign_epi8(load32(xq[t]), w));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * dx[t]), acc[t]);
    }
  } else {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6));
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m256i u = _mm256_or_si256(
        _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low), _mm_and_si128(qs, low)), q5_0_high(b + 2));
    for (int t = 0; t < TILE; ++t) {
      const __m256i p = dot4(u, load32(xq[t]));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * dx[t]), acc[t]);
      off[t] += -16.f * d * dx[t] * static_cast<float>(xs[t][0] + xs[t][1]);
    }
  }
}
#endif

// One weight row (`blocks` blocks of TYPE) against TILE input rows from m: y[t * ldy].
template <int64_t TYPE, int TILE>
void weight_row(const uint8_t* w, int64_t blocks, const Int8Rows& x, int64_t m, int64_t k, float* y, int64_t ldy) {
  constexpr int64_t block = (TYPE == Q5_0 || TYPE == Q8_0) ? BLOCK : SUPER;
  const int64_t bytes = layout_of(TYPE).bytes;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[TILE];
  float off[TILE];
  for (int t = 0; t < TILE; ++t) acc[t] = _mm256_setzero_ps(), off[t] = 0.f;
  for (int64_t i = 0; i < blocks; ++i) {
    const int8_t* xq[TILE];
    const int16_t* xs[TILE];
    float dx[TILE];
    for (int t = 0; t < TILE; ++t) {
      xq[t] = x.q.data() + (m + t) * k + i * block;
      xs[t] = x.sums.data() + ((m + t) * k + i * block) / 16;
      dx[t] = x.d[(m + t) * blocks + i];
    }
    if constexpr (block == SUPER) superblock<TYPE, TILE>(w + i * bytes, xq, dx, xs, acc);
    else block32<TYPE, TILE>(w + i * bytes, xq, dx, xs, acc, off);
  }
  for (int t = 0; t < TILE; ++t) y[t * ldy] = kvserve_cpu::hsum8(acc[t]) + off[t];
#else
  float wf[SUPER];
  for (int t = 0; t < TILE; ++t) y[t * ldy] = 0.f;
  for (int64_t i = 0; i < blocks; ++i) {
    dequantize_block<TYPE>(w + i * bytes, wf);
    for (int t = 0; t < TILE; ++t) {
      const int8_t* xq = x.q.data() + (m + t) * k + i * block;
      float dot = 0.f;
      for (int64_t j = 0; j < block; ++j) dot += wf[j] * xq[j];
      y[t * ldy] += dot * x.d[(m + t) * blocks + i];
    }
  }
#endif
}

template <int64_t TYPE>
void rows_of_type(const uint8_t* w, int64_t blocks, const Int8Rows& x, int64_t m, int64_t remaining, int64_t k,
                  float* y, int64_t ldy) {
  switch (std::min(ROW_TILE, remaining)) {
    case 1: weight_row<TYPE, 1>(w, blocks, x, m, k, y, ldy); break;
    case 2: weight_row<TYPE, 2>(w, blocks, x, m, k, y, ldy); break;
    case 3: weight_row<TYPE, 3>(w, blocks, x, m, k, y, ldy); break;
    default: weight_row<TYPE, ROW_TILE>(w, blocks, x, m, k, y, ldy); break;
  }
}

struct Part {
  const uint8_t* data;
  int64_t type, rows, row_bytes, first;  // first: its first row among all parts' rows
};

}  // namespace

namespace kvserve_ops {

at::Tensor gguf_linear(const at::Tensor& x, at::TensorList weights, at::IntArrayRef types,
                       const at::Tensor& out_index) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "gguf_linear: x must be (M, K) float32, got ", x.sizes(),
              " ", x.scalar_type());
  TORCH_CHECK(!weights.empty() && weights.size() == types.size(), "gguf_linear: ", weights.size(), " weights and ",
              types.size(), " types");
  const int64_t rows = x.size(0), k = x.size(1);
  std::vector<Part> parts;
  int64_t n = 0;
  bool super = false, small = false;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    const Layout layout = layout_of(types[i]);
    TORCH_CHECK(k % layout.block == 0, "gguf_linear: the input size ", k, " is not a multiple of ", layout.block,
                " (ggml type ", types[i], ")");
    const int64_t row_bytes = k / layout.block * layout.bytes;
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.size(1) == row_bytes && w.stride(1) == 1 &&
                    w.stride(0) == row_bytes,
                "gguf_linear: weight ", i, " must be contiguous uint8 (N, ", row_bytes, ") for ggml type ", types[i],
                " and K = ", k, ", got ", w.sizes(), " ", w.scalar_type());
    parts.push_back({w.data_ptr<uint8_t>(), types[i], w.size(0), row_bytes, n});
    n += w.size(0);
    (layout.block == SUPER ? super : small) = true;
  }
  const bool remap = out_index.defined() && out_index.numel() > 0;
  TORCH_CHECK(!remap || (out_index.scalar_type() == at::kLong && out_index.numel() == n && out_index.is_contiguous()),
              "gguf_linear: out_index must be contiguous int64 with ", n, " entries");
  const int64_t* index = remap ? out_index.data_ptr<int64_t>() : nullptr;
  for (int64_t o = 0; remap && o < n; ++o)
    TORCH_CHECK(index[o] >= 0 && index[o] < n, "gguf_linear: out_index[", o, "] = ", index[o],
                " is not a column of ", n);
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const Int8Rows x256 = super ? quantize_rows(xp, rows, k, SUPER) : Int8Rows{};
  const Int8Rows x32 = small ? quantize_rows(xp, rows, k, BLOCK) : Int8Rows{};
  auto y = at::empty({rows, n}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, OUT_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < rows; first += ROW_BLOCK)
      for (int64_t o = begin; o < end; ++o) {
        const Part& p = *std::prev(std::upper_bound(parts.begin(), parts.end(), o,
                                                    [](int64_t r, const Part& q) { return r < q.first; }));
        const uint8_t* w = p.data + (o - p.first) * p.row_bytes;
        const int64_t col = index ? index[o] : o;
        for (int64_t m = first; m < std::min(rows, first + ROW_BLOCK); m += ROW_TILE) {
          float* out = yp + m * n + col;
          const int64_t left = rows - m;
          switch (p.type) {
            case Q4_K: rows_of_type<Q4_K>(w, k / SUPER, x256, m, left, k, out, n); break;
            case Q5_K: rows_of_type<Q5_K>(w, k / SUPER, x256, m, left, k, out, n); break;
            case Q6_K: rows_of_type<Q6_K>(w, k / SUPER, x256, m, left, k, out, n); break;
            case Q5_0: rows_of_type<Q5_0>(w, k / BLOCK, x32, m, left, k, out, n); break;
            default: rows_of_type<Q8_0>(w, k / BLOCK, x32, m, left, k, out, n); break;
          }
        }
      }
  });
  return y;
}

at::Tensor gguf_dequantize(const at::Tensor& weight, int64_t type, const at::Tensor& rows, bool bfloat16) {
  const Layout layout = layout_of(type);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.stride(1) == 1 &&
                  weight.size(1) % layout.bytes == 0,
              "gguf_dequantize: weight must be uint8 (N, whole blocks) with unit column stride, got ", weight.sizes());
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "gguf_dequantize: rows must be a 1-D int64 tensor");
  const at::Tensor ids = rows.contiguous();
  const int64_t count = ids.numel(), blocks = weight.size(1) / layout.bytes, n = weight.size(0);
  const int64_t k = blocks * layout.block;
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(idp[i] >= 0 && idp[i] < n, "gguf_dequantize: row ", idp[i], " is out of range for ", n, " rows");
  auto out = at::empty({count, k}, weight.options().dtype(bfloat16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const int64_t stride = weight.stride(0);
  auto run = [&](auto* dst) {
    using T = std::remove_pointer_t<decltype(dst)>;
    switch (type) {
      case Q4_K: dequantize_rows<Q4_K, T>(wp, stride, blocks, idp, count, dst); break;
      case Q5_K: dequantize_rows<Q5_K, T>(wp, stride, blocks, idp, count, dst); break;
      case Q6_K: dequantize_rows<Q6_K, T>(wp, stride, blocks, idp, count, dst); break;
      case Q5_0: dequantize_rows<Q5_0, T>(wp, stride, blocks, idp, count, dst); break;
      default: dequantize_rows<Q8_0, T>(wp, stride, blocks, idp, count, dst); break;
    }
  };
  if (bfloat16) run(out.data_ptr<at::BFloat16>());
  else run(out.data_ptr<float>());
  return out;
}

}  // namespace kvserve_ops

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("gguf_linear(Tensor x, Tensor[] weights, int[] types, Tensor out_index) -> Tensor");
  m.def("gguf_dequantize(Tensor weight, int type, Tensor rows, bool bfloat16=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("gguf_linear", &kvserve_ops::gguf_linear);
  m.impl("gguf_dequantize", &kvserve_ops::gguf_dequantize);
}
