// Paged decode attention on the CPU over a quantized KV cache (attention/kv_quant.py), its int8 or int4 rows read
// in place: the semantics of paged_decode.cpp (read its header first), with keys and values stored as codes.
//
// Layout: k_cache, v_cache (num_blocks, block_size, Hkv, row_bytes) uint8, last two dims contiguous; each
// (token, KV head) row is
// - int8: D signed codes, then the row's scale (float16): value = code * scale; row_bytes = D + 2.
// - int4: D / 2 bytes of 4-bit codes (element 2i in byte i's low nibble, 2i + 1 in its high nibble), then the
//   row's scale and minimum (float16 each): value = code * scale + minimum; row_bytes = D / 2 + 4.
// Rows sit at any byte offset (row_bytes is even or odd): the scales are read with memcpy, the codes with unaligned
// loads. q is float32 (B, H, D), already rotated as the cache was; the output (B, H, D) and log-sum-exp are float32.
//
// The codes are never widened to a float row in memory: a key's logit is its scale times q . codes (plus its
// minimum times sum(q) for int4, sum(q) once per query head), and a value adds (p * scale) * codes to the
// accumulators (and p * minimum to one sum per query head, added once at the end). Each row's bytes are read once
// per pass. Work is split as paged_decode's: (sequence, span of SPAN keys) items over at::parallel_for, a row's
// spans merged in order, so a row's result does not depend on the rest of the batch. A span's rows are looked up in
// its block table once, and prefetched some keys ahead of the key pass (a block table scatters them over the pool,
// where the hardware's prefetchers do not follow).
//
// Paths, for G = H / Hkv <= 4 and D in 64, 128, 256 (SmolLM2: 3 and 64; Gemma 3 270M: 4 and 256):
// - AVX-512: the value pass widens the codes to float32 in registers, FMAs against the weights p * scale with the
//   accumulators in registers (value_pass_512). The key pass, with AVX512-VNNI, takes integer dot products of the
//   codes with each query row written as three signed 8-bit digits (24 bits: float32's accuracy), 16 keys a
//   vector, so no widening and no horizontal sums (key_pass_vnni); without VNNI it widens the codes and FMAs
//   against float32 queries, four keys' sums reduced together (key_pass_512).
// - AVX2 + FMA (any D a multiple of 16): as AVX-512 without VNNI, on 8 lanes.
// Otherwise a generic loop widens one row at a time (vectorised where D allows). The float paths read int4 codes as
// a run's even elements (low nibbles) and odd ones (high nibbles) in separate vectors: the queries are permuted to
// that order once per call and the value accumulators put back in place at the end of a span. (An int8 VNNI value
// pass, with the weights as digits and four keys' codes interleaved per int32 lane, measured slower than the FMAs.)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "cpu_vec.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KVSERVE_VNNI 1
#endif

namespace {

constexpr int64_t SPAN = 256;  // keys per work item
constexpr int64_t AHEAD = 32;  // keys the prefetches run ahead of the key pass

using kvserve_cpu::ordered_sum;

struct Geometry {
  int64_t batch, heads, kv_heads, group, dim, block_size, width;
  int64_t block_stride, token_stride, row_bytes;  // in bytes, of k_cache (v_cache has the same)
  int bits;
  int64_t code_bytes() const { return bits == 8 ? dim : dim / 2; }  // where a row's scale starts
};

// A batch row's queries as the key passes read them.
struct Query {
  const float* q;            // (H, D): scaled by the softmax scale, in the passes' order
  const float* qsum;         // (H): each query row's sum (int4's minimum)
  const int32_t* digits;     // (H, 3, D / 4): q / unit rounded, as three signed base-256 digits, 4 to a word (VNNI)
  const float* unit;         // (H)
  const int32_t* digit_sum;  // (H, 3): each digit row's sum
};

// The float16 at p (any alignment) as float32.
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// rows[t] = the byte offset in a cache of key position first + t's row of KV head 0 (head h's is h * row_bytes
// further), through a block table; no division per key.
inline void span_rows(const Geometry& g, const int32_t* table, int64_t first, int64_t last, int64_t* rows) {
  int64_t block = first / g.block_size, offset = first % g.block_size;
  for (int64_t t = 0; t < last - first; ++t) {
    rows[t] = table[block] * g.block_stride + offset * g.token_stride;
    if (++offset == g.block_size) offset = 0, ++block;
  }
}

// Requests a span's key rows (every KV head of a token) to L1 and its value rows to L2, AHEAD keys in front of
// the key pass; the value pass then finds its rows in L2. The rows of a block's tokens are one run of bytes: each
// cache line is requested once.
struct Prefetcher {
  const uint8_t *k, *v;
  const int64_t* rows;
  int64_t n, bytes, pos = 0;
  uintptr_t k_next = 0, v_next = 0;  // the first line not requested after the last row's (0: none)
  Prefetcher(const Geometry& g, const uint8_t* k_cache, const uint8_t* v_cache, const int64_t* r, int64_t count)
      : k(k_cache), v(v_cache), rows(r), n(count), bytes(g.kv_heads * g.row_bytes) {
    advance(AHEAD);
  }
  // Every key before position `to` requested.
  void advance(int64_t to) {
    for (to = std::min(to, n); pos < to; ++pos) {
      k_next = lines<3>(k + rows[pos], k_next);
      v_next = lines<2>(v + rows[pos], v_next);
    }
  }
  // The lines of the row at p not yet requested (those before `next` were, when the row continues the last one's).
  template <int LOCALITY>
  uintptr_t lines(const uint8_t* p, uintptr_t next) const {
    const uintptr_t start = reinterpret_cast<uintptr_t>(p), end = start + bytes;
    uintptr_t a = start & ~uintptr_t{63};
    if (next > a && next <= start + 64) a = next;
    for (; a < end; a += 64) __builtin_prefetch(reinterpret_cast<const void*>(a), 0, LOCALITY);
    return a;
  }
};

// ----- generic path: any G, any D (even for int4) -----

// A row's codes (D of them, element order) as floats in out: unscaled, without the minimum.
inline void widen_codes(const uint8_t* row, int bits, int64_t d, float* out) {
  int64_t i = 0;
  if (bits == 8) {
#if defined(__AVX512F__)
    for (; i + 16 <= d; i += 16)
      _mm512_storeu_ps(out + i, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i)))));
#elif defined(KVSERVE_AVX2)
    for (; i + 8 <= d; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                    _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i)))));
#endif
    for (; i < d; ++i) out[i] = static_cast<float>(static_cast<int8_t>(row[i]));
    return;
  }
#if defined(__AVX512F__) || defined(KVSERVE_AVX2)
  const __m128i low4 = _mm_set1_epi8(15);
  for (; i + 16 <= d; i += 16) {  // 8 bytes: their nibbles interleaved back into element order
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i / 2));
    const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(raw, low4), _mm_and_si128(_mm_srli_epi16(raw, 4), low4));
#if defined(__AVX512F__)
    _mm512_storeu_ps(out + i, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes)));
#else
    _mm256_storeu_ps(out + i, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)));
    _mm256_storeu_ps(out + i + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8))));
#endif
  }
#endif
  for (; i < d; i += 2) {
    const uint8_t byte = row[i / 2];
    out[i] = static_cast<float>(byte & 15);
    out[i + 1] = static_cast<float>(byte >> 4);
  }
}

// scores[j * stride] = q_j . k for the G query rows q (G, D) and one widened row k (D,).
inline void dots(const float* __restrict q, const float* __restrict k, int64_t group, int64_t d, float* scores,
                 int64_t stride) {
#if defined(__AVX512F__)
  if (d % 16 == 0) {
    for (int64_t j = 0; j < group; ++j) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = 0; c < d; c += 16)
        sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * d + c), _mm512_loadu_ps(k + c), sum);
      scores[j * stride] = _mm512_reduce_add_ps(sum);
    }
    return;
  }
#elif defined(KVSERVE_AVX2)
  if (d % 8 == 0) {
    for (int64_t j = 0; j < group; ++j) {
      __m256 sum = _mm256_setzero_ps();
      for (int64_t c = 0; c < d; c += 8)
        sum = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + c), _mm256_loadu_ps(k + c), sum);
      scores[j * stride] = kvserve_cpu::hsum8(sum);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < group; ++j) {
    float s = 0.f;
    for (int64_t i = 0; i < d; ++i) s += q[j * d + i] * k[i];
    scores[j * stride] = s;
  }
}

// acc[j] += w[j] * v for the G accumulators acc (G, D) and one widened row v (D,).
inline void accumulate(float* __restrict acc, const float* __restrict v, const float* w, int64_t group, int64_t d) {
  int64_t c = 0;
#if defined(__AVX512F__)
  for (; c + 16 <= d; c += 16) {
    const __m512 vc = _mm512_loadu_ps(v + c);
    for (int64_t j = 0; j < group; ++j) {
      float* a = acc + j * d + c;
      _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(w[j]), vc, _mm512_loadu_ps(a)));
    }
  }
#elif defined(KVSERVE_AVX2)
  for (; c + 8 <= d; c += 8) {
    const __m256 vc = _mm256_loadu_ps(v + c);
    for (int64_t j = 0; j < group; ++j) {
      float* a = acc + j * d + c;
      _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(w[j]), vc, _mm256_loadu_ps(a)));
    }
  }
#endif
  for (int64_t j = 0; j < group; ++j)
    for (int64_t i = c; i < d; ++i) acc[j * d + i] += w[j] * v[i];
}

// The key pass: scores[(h * G + j) * n + t] = q_hj . key_h(t) for every KV head h and span key t < n (its row at
// rows[t]); q in element order. Keys in order, every KV head of a key before the next.
void key_pass_generic(const Geometry& g, const Query& query, const uint8_t* k_cache, const uint8_t* v_cache,
                      const int64_t* rows, int64_t n, float* scores) {
  const int64_t G = g.group, D = g.dim, cb = g.code_bytes();
  std::vector<float> row(D);
  Prefetcher ahead(g, k_cache, v_cache, rows, n);
  for (int64_t t = 0; t < n; ++t) {
    ahead.advance(t + 1 + AHEAD);
    for (int64_t h = 0; h < g.kv_heads; ++h) {
      const uint8_t* r = k_cache + rows[t] + h * g.row_bytes;
      widen_codes(r, g.bits, D, row.data());
      float* s = scores + h * G * n + t;
      dots(query.q + h * G * D, row.data(), G, D, s, n);
      const float scale = half_at(r + cb);
      if (g.bits == 8) {
        for (int64_t j = 0; j < G; ++j) s[j * n] *= scale;
      } else {
        const float low = half_at(r + cb + 2);
        for (int64_t j = 0; j < G; ++j) s[j * n] = s[j * n] * scale + low * query.qsum[h * G + j];
      }
    }
  }
}

// The value pass of KV head h: acc (G, D) = sum over t < n of probs[j * n + t] * value_h(t), element order.
void value_pass_generic(const Geometry& g, const uint8_t* v_cache, const int64_t* rows, int64_t n, int64_t h,
                        const float* probs, float* acc) {
  const int64_t G = g.group, D = g.dim, cb = g.code_bytes();
  std::vector<float> row(D), w(G), low_sum(G, 0.f);
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    const uint8_t* r = v_cache + rows[t] + h * g.row_bytes;
    widen_codes(r, g.bits, D, row.data());
    const float scale = half_at(r + cb);
    for (int64_t j = 0; j < G; ++j) w[j] = probs[j * n + t] * scale;
    accumulate(acc, row.data(), w.data(), G, D);
    if (g.bits == 4) {
      const float low = half_at(r + cb + 2);
      for (int64_t j = 0; j < G; ++j) low_sum[j] += probs[j * n + t] * low;
    }
  }
  if (g.bits == 4)
    for (int64_t j = 0; j < G; ++j)
      for (int64_t i = 0; i < D; ++i) acc[j * D + i] += low_sum[j];
}

// The float paths' int4 order: in each run of `run` elements, its even elements then its odd ones.
inline int64_t nibble_order(int64_t position, int64_t run) {
  const int64_t base = position - position % run, i = position % run;
  return base + (i < run / 2 ? 2 * i : 2 * (i - run / 2) + 1);
}

// The largest integer the VNNI paths write as three signed base-256 digits (the top one at most 127).
constexpr int32_t DIGITS_BOUND = 127 * (65536 + 256 + 1);

// Query row x (D,) times scale as integers q_i = round(x_i * scale / unit), |q_i| <= DIGITS_BOUND with
// unit = max |x_i * scale| / DIGITS_BOUND, each written as three signed base-256 digits:
// q_i = 65536 * digits[2 D + i] + 256 * digits[D + i] + digits[i], element at(i) at position i. Products of
// such digits with 8-bit codes add up exactly in int32, and 24 bits of q leave the logits as accurate as float32
// products would. Returns unit; digit_sum[L] = sum_i digits[L D + i].
template <typename At>
float to_digits(const float* x, int64_t d, float scale, At at, int8_t* digits, int32_t* digit_sum) {
  double top = 0.0;
  for (int64_t i = 0; i < d; ++i) top = std::max(top, std::abs(static_cast<double>(x[i] * scale)));
  const double unit = top > 0.0 ? top / DIGITS_BOUND : 1.0;
  digit_sum[0] = digit_sum[1] = digit_sum[2] = 0;
  for (int64_t i = 0; i < d; ++i) {
    int32_t v = static_cast<int32_t>(std::lrint(static_cast<double>(x[at(i)] * scale) / unit));
    v = std::min(DIGITS_BOUND, std::max(-DIGITS_BOUND, v));
    for (int limb = 0; limb < 3; ++limb) {
      const int32_t digit = ((v + 128) & 255) - 128;
      digits[limb * d + i] = static_cast<int8_t>(digit);
      digit_sum[limb] += digit;
      v = (v - digit) / 256;
    }
  }
  return static_cast<float>(unit);
}

#if defined(__AVX512F__) || defined(KVSERVE_AVX2)
// The first `count` (1-4) of four keys' scores to out (a run's last chunk of four may hold fewer keys).
inline void store_scores(float* out, __m128 s4, int64_t count) {
  if (count == 4) {
    _mm_storeu_ps(out, s4);
    return;
  }
  float tmp[4];
  _mm_storeu_ps(tmp, s4);
  for (int64_t i = 0; i < count; ++i) out[i] = tmp[i];
}

// Four keys' rows from rows[pos ..]: a span's last chunk repeats its last key, so every key's score comes from the
// same instructions wherever it sits.
inline int64_t four_rows(const int64_t* rows, int64_t pos, int64_t n, int64_t out[4]) {
  const int64_t count = std::min<int64_t>(4, n - pos);
  for (int i = 0; i < 4; ++i) out[i] = rows[pos + std::min<int64_t>(i, count - 1)];
  return count;
}
#endif

// ----- AVX-512 -----

#if defined(__AVX512F__)
// 16 int8 codes as 16 float lanes.
inline __m512 widen8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// 16 bytes of int4 codes: their even elements (low nibbles) and odd ones (high nibbles) as 16 float lanes each.
inline void widen4(const uint8_t* p, __m512& even, __m512& odd) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  even = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
  odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
}

// Lane i = the sum of a_i's 16 lanes, by the same tree for every i (so a key's score does not depend on which
// of the four it was): the quarters pairwise, then the four lanes of what is left.
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
  __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
  w = _mm512_add_ps(w, _mm512_permute_ps(w, 0xB1));  // lanes (0+1, 1+0, 2+3, 3+2) in each quarter
  w = _mm512_add_ps(w, _mm512_permute_ps(w, 0x4E));  // lane 0 of quarter i: key i's sum
  return _mm512_castps512_ps128(
      _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), w));
}

// key_pass_generic for G and D fixed, float32 (int4: q in nibble_order runs of 32): keys four at a time, every KV
// head of a key before the next, G x 4 independent FMA chains, four keys' sums reduced together.
template <int G, int D, int BITS>
void key_pass_512(const Geometry& g, const Query& query, const uint8_t* k_cache, const uint8_t* v_cache,
                  const int64_t* rows, int64_t n, float* scores) {
  constexpr int CB = BITS == 8 ? D : D / 2;
  const int64_t rb = g.row_bytes;
  Prefetcher ahead(g, k_cache, v_cache, rows, n);
  for (int64_t pos = 0; pos < n; pos += 4) {
    ahead.advance(pos + 4 + AHEAD);
    int64_t four[4];
    const int64_t count = four_rows(rows, pos, n, four);
    for (int64_t h = 0; h < g.kv_heads; ++h) {
      const uint8_t* r[4];
      for (int i = 0; i < 4; ++i) r[i] = k_cache + four[i] + h * rb;
      const float* qh = query.q + h * G * D;
      __m512 sums[G][4];
      for (int j = 0; j < G; ++j)
        for (int i = 0; i < 4; ++i) sums[j][i] = _mm512_setzero_ps();
      if constexpr (BITS == 8) {
        for (int c = 0; c < D; c += 16) {
          for (int i = 0; i < 4; ++i) {
            const __m512 kc = widen8(r[i] + c);
            for (int j = 0; j < G; ++j) sums[j][i] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + j * D + c), kc, sums[j][i]);
          }
        }
      } else {
        for (int c = 0; c < D; c += 32) {
          for (int i = 0; i < 4; ++i) {
            __m512 even, odd;
            widen4(r[i] + c / 2, even, odd);
            for (int j = 0; j < G; ++j) {
              sums[j][i] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + j * D + c), even, sums[j][i]);
              sums[j][i] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + j * D + c + 16), odd, sums[j][i]);
            }
          }
        }
      }
      const __m128 scale = _mm_setr_ps(half_at(r[0] + CB), half_at(r[1] + CB), half_at(r[2] + CB), half_at(r[3] + CB));
      __m128 low = _mm_setzero_ps();
      if constexpr (BITS == 4)
        low = _mm_setr_ps(half_at(r[0] + CB + 2), half_at(r[1] + CB + 2), half_at(r[2] + CB + 2),
                          half_at(r[3] + CB + 2));
      for (int j = 0; j < G; ++j) {
        __m128 s4 = _mm_mul_ps(reduce4(sums[j][0], sums[j][1], sums[j][2], sums[j][3]), scale);
        if constexpr (BITS == 4) s4 = _mm_fmadd_ps(low, _mm_set1_ps(query.qsum[h * G + j]), s4);
        store_scores(scores + (h * G + j) * n + pos, s4, count);
      }
    }
  }
}

// Columns per walk of the float value pass: G x W / 16 accumulators in registers (at most 16 of the 32).
template <int G, int D>
constexpr int value_window() {
  return std::min(D, G == 1 ? 256 : G == 2 ? 128 : 64);
}

// value_pass_generic for G and D fixed, float32: the weights p_jt * scale_t (and int4's sum of p_jt * minimum_t)
// first, for the whole span, then the columns [c0, c0 + W) at a time with their accumulators in registers, each
// weight broadcast from memory into its FMA. int4: the accumulators hold each run of 32 columns as its even then
// its odd columns, put back in place at the end.
template <int G, int D, int BITS>
void value_pass_512(const Geometry& g, const uint8_t* v_cache, const int64_t* rows, int64_t n, int64_t h,
                    const float* probs, float* acc) {
  constexpr int CB = BITS == 8 ? D : D / 2;
  constexpr int W = value_window<G, D>();
  constexpr int C = W / 16;
  const int64_t n16 = (n + 15) / 16 * 16;
  alignas(64) float w[G][SPAN];
  alignas(64) uint16_t raw_scale[SPAN], raw_low[SPAN];
  for (int64_t t = 0; t < n16; ++t) {
    const uint8_t* row = v_cache + rows[std::min(t, n - 1)] + h * g.row_bytes;
    std::memcpy(raw_scale + t, row + CB, 2);
    if constexpr (BITS == 4) std::memcpy(raw_low + t, row + CB + 2, 2);
  }
  __m512 lows[G];
  for (int j = 0; j < G; ++j) lows[j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n16; t += 16) {
    const __mmask16 live = t + 16 <= n ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 scale = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(raw_scale + t)));
    for (int j = 0; j < G; ++j) {
      const __m512 p = _mm512_maskz_loadu_ps(live, probs + j * n + t);
      _mm512_store_ps(w[j] + t, _mm512_mul_ps(p, scale));
      if constexpr (BITS == 4)
        lows[j] = _mm512_fmadd_ps(
            p, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(raw_low + t))), lows[j]);
    }
  }
  for (int c0 = 0; c0 < D; c0 += W) {
    __m512 av[G][C];
    for (int j = 0; j < G; ++j)
      for (int c = 0; c < C; ++c) av[j][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const uint8_t* row = v_cache + rows[t] + h * g.row_bytes;
      if constexpr (BITS == 8) {
        for (int c = 0; c < C; ++c) {
          const __m512 vc = widen8(row + c0 + c * 16);
          for (int j = 0; j < G; ++j) av[j][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[j][t]), vc, av[j][c]);
        }
      } else {
        for (int c = 0; c < C; c += 2) {
          __m512 even, odd;
          widen4(row + (c0 + c * 16) / 2, even, odd);
          for (int j = 0; j < G; ++j) {
            av[j][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[j][t]), even, av[j][c]);
            av[j][c + 1] = _mm512_fmadd_ps(_mm512_set1_ps(w[j][t]), odd, av[j][c + 1]);
          }
        }
      }
    }
    if constexpr (BITS == 8) {
      for (int j = 0; j < G; ++j)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + j * D + c0 + c * 16, av[j][c]);
    } else {
      const __m512i from_lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
      const __m512i from_hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
      for (int j = 0; j < G; ++j) {
        const __m512 low = _mm512_set1_ps(_mm512_reduce_add_ps(lows[j]));
        for (int c = 0; c < C; c += 2) {
          float* a = acc + j * D + c0 + c * 16;
          _mm512_storeu_ps(a, _mm512_add_ps(_mm512_permutex2var_ps(av[j][c], from_lo, av[j][c + 1]), low));
          _mm512_storeu_ps(a + 16, _mm512_add_ps(_mm512_permutex2var_ps(av[j][c], from_hi, av[j][c + 1]), low));
        }
      }
    }
  }
}
#endif

#if defined(KVSERVE_VNNI)
// ----- AVX512-VNNI: vpdpbusd adds four products of an unsigned byte and a signed byte to each int32 lane -----
//
// The codes are the unsigned operand (int8 codes biased by 128, the bias times the digits' sum taken back out;
// int4 codes as they are), the digits of the queries (to_digits) the signed one, one word of four digits broadcast
// from memory. Each digit's sums are exact in int32 (|.| < 2^24 for D <= 256); the three combine in float32 once
// per key and query head.

// sum[0] + 256 sum[1] + 65536 sum[2] as float32 (the first two exactly in int32).
inline __m512 combine_digits(const __m512i sum[3]) {
  const __m512i low_two = _mm512_add_epi32(_mm512_slli_epi32(sum[1], 8), sum[0]);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[2]), _mm512_set1_ps(65536.f), _mm512_cvtepi32_ps(low_two));
}

// acc += codes . the word at p broadcast (as the instruction's memory operand: g++ would load it to a register).
inline __m512i dot_word(__m512i acc, __m512i codes, const int32_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*p));
  return acc;
}

// r[l] (16 int32 columns each) -> out[k] lane l = r[l] column k.
inline void transpose16(const __m512i r[16], __m512i out[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // u[g + c], 128-bit block b: rows g .. g + 3, column 4 b + c
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v01 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), w01 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i v23 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i w23 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    out[c] = _mm512_shuffle_i32x4(v01, v23, 0x88);
    out[4 + c] = _mm512_shuffle_i32x4(w01, w23, 0x88);
    out[8 + c] = _mm512_shuffle_i32x4(v01, v23, 0xDD);
    out[12 + c] = _mm512_shuffle_i32x4(w01, w23, 0xDD);
  }
}

// r[i] = (row i's 8 columns, row i + 4's) for i < 4, (row 4 + i's, row 8 + i's) for i >= 4 -> out[k] lane l =
// row l's column k, k < 8.
inline void transpose8(const __m512i r[8], __m512i out[8]) {
  __m512i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 8; g += 4) {
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    out[c] = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
    out[4 + c] = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
  }
}

// sums[j][L] += the 16 keys' column (one key a lane) . word `at` of query head j's digit row L.
template <int G, int D>
inline void dot_column(__m512i (&sums)[G][3], __m512i codes, const int32_t* digits, int at) {
  for (int j = 0; j < G; ++j)
    for (int limb = 0; limb < 3; ++limb)
      sums[j][limb] = dot_word(sums[j][limb], codes, digits + (j * 3 + limb) * D / 4 + at);
}

// The key pass: 16 keys at a time, their rows transposed so that a vector holds one 4-byte column of the 16 keys
// (a key a lane) against each query row's digits. int4 columns split into their low nibbles (even elements:
// the digits' first D / 2) and high ones (odd elements: the rest).
template <int G, int D, int BITS>
void key_pass_vnni(const Geometry& g, const Query& query, const uint8_t* k_cache, const uint8_t* v_cache,
                   const int64_t* rows, int64_t n, float* scores) {
  constexpr int CB = BITS == 8 ? D : D / 2;  // code bytes of a row
  const int64_t rb = g.row_bytes;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80)), low4 = _mm512_set1_epi8(15);
  Prefetcher ahead(g, k_cache, v_cache, rows, n);
  for (int64_t pos = 0; pos < n; pos += 16) {
    ahead.advance(pos + 16 + AHEAD);
    const int64_t count = std::min<int64_t>(16, n - pos);
    const uint8_t* token[16];  // a span's last chunk repeats its last key
    for (int i = 0; i < 16; ++i) token[i] = k_cache + rows[pos + std::min<int64_t>(i, count - 1)];
    for (int64_t h = 0; h < g.kv_heads; ++h) {
      const uint8_t* r[16];
      for (int i = 0; i < 16; ++i) r[i] = token[i] + h * rb;
      const int32_t* qd = query.digits + h * G * 3 * D / 4;
      __m512i sums[G][3];
      for (int j = 0; j < G; ++j)
        for (int limb = 0; limb < 3; ++limb) sums[j][limb] = _mm512_setzero_si512();
      if constexpr (CB == 32) {  // int4, D = 64: 8 columns, two rows a vector
        __m512i in[8], col[8];
        for (int i = 0; i < 8; ++i) {
          const int a = i < 4 ? i : 4 + i;
          in[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[a]))),
                                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[a + 4])), 1);
        }
        transpose8(in, col);
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          dot_column<G, D>(sums, _mm512_and_si512(col[k], low4), qd, k);
          dot_column<G, D>(sums, _mm512_and_si512(_mm512_srli_epi32(col[k], 4), low4), qd + D / 8, k);
        }
      } else {
        static_assert(CB % 64 == 0, "rows of whole 64-byte pieces");
        for (int piece = 0; piece < CB; piece += 64) {
          __m512i in[16], col[16];
          for (int i = 0; i < 16; ++i) in[i] = _mm512_loadu_si512(r[i] + piece);
          transpose16(in, col);
#pragma GCC unroll 16
          for (int k = 0; k < 16; ++k) {
            if constexpr (BITS == 8) {
              dot_column<G, D>(sums, _mm512_xor_si512(col[k], bias), qd, piece / 4 + k);
            } else {
              dot_column<G, D>(sums, _mm512_and_si512(col[k], low4), qd, piece / 4 + k);
              dot_column<G, D>(sums, _mm512_and_si512(_mm512_srli_epi32(col[k], 4), low4), qd + D / 8, piece / 4 + k);
            }
          }
        }
      }
      alignas(32) uint16_t raw_scale[16], raw_low[16];
      for (int i = 0; i < 16; ++i) std::memcpy(raw_scale + i, r[i] + CB, 2);
      const __m512 scale = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(raw_scale)));
      __m512 low = _mm512_setzero_ps();
      if constexpr (BITS == 4) {
        for (int i = 0; i < 16; ++i) std::memcpy(raw_low + i, r[i] + CB + 2, 2);
        low = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(raw_low)));
      }
      const __mmask16 keep = static_cast<__mmask16>((1u << count) - 1);
      for (int j = 0; j < G; ++j) {
        const int64_t head = h * G + j;
        if constexpr (BITS == 8)
          for (int limb = 0; limb < 3; ++limb)
            sums[j][limb] = _mm512_sub_epi32(sums[j][limb], _mm512_set1_epi32(128 * query.digit_sum[head * 3 + limb]));
        __m512 logit = _mm512_mul_ps(_mm512_mul_ps(combine_digits(sums[j]), _mm512_set1_ps(query.unit[head])), scale);
        if constexpr (BITS == 4) logit = _mm512_fmadd_ps(low, _mm512_set1_ps(query.qsum[head]), logit);
        _mm512_mask_storeu_ps(scores + head * n + pos, keep, logit);
      }
    }
  }
}
#endif

// ----- AVX2 + FMA -----

#if defined(KVSERVE_AVX2)
// 8 int8 codes as 8 float lanes.
inline __m256 widen8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// 8 bytes of int4 codes: their even elements and odd ones as 8 float lanes each.
inline void widen4(const uint8_t* p, __m256& even, __m256& odd) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  even = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
  odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
}

// key_pass_512 on AVX2 (16 vector registers): 8 lanes, D a multiple of 16 (int4: q in nibble_order runs of 16),
// each key's sum by hsum8x4 (the queries are memory operands: the registers hold the sums).
template <int G, int BITS>
void key_pass_avx2(const Geometry& g, const Query& query, const uint8_t* k_cache, const uint8_t* v_cache,
                   const int64_t* rows, int64_t n, float* scores) {
  const int64_t rb = g.row_bytes, D = g.dim, cb = g.code_bytes();
  Prefetcher ahead(g, k_cache, v_cache, rows, n);
  for (int64_t pos = 0; pos < n; pos += 4) {
    ahead.advance(pos + 4 + AHEAD);
    int64_t four[4];
    const int64_t count = four_rows(rows, pos, n, four);
    for (int64_t h = 0; h < g.kv_heads; ++h) {
      const uint8_t* r[4];
      for (int i = 0; i < 4; ++i) r[i] = k_cache + four[i] + h * rb;
      const float* qh = query.q + h * G * D;
      __m256 sums[G][4];
      for (int j = 0; j < G; ++j)
        for (int i = 0; i < 4; ++i) sums[j][i] = _mm256_setzero_ps();
      for (int64_t c = 0; c < D; c += 16) {
        for (int i = 0; i < 4; ++i) {
          __m256 a, b;
          if constexpr (BITS == 8) {
            a = widen8(r[i] + c);
            b = widen8(r[i] + c + 8);
          } else {
            widen4(r[i] + c / 2, a, b);
          }
          for (int j = 0; j < G; ++j) {
            sums[j][i] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + j * D + c), a, sums[j][i]);
            sums[j][i] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + j * D + c + 8), b, sums[j][i]);
          }
        }
      }
      const __m128 scale = _mm_setr_ps(half_at(r[0] + cb), half_at(r[1] + cb), half_at(r[2] + cb), half_at(r[3] + cb));
      __m128 low = _mm_setzero_ps();
      if constexpr (BITS == 4)
        low = _mm_setr_ps(half_at(r[0] + cb + 2), half_at(r[1] + cb + 2), half_at(r[2] + cb + 2),
                          half_at(r[3] + cb + 2));
      for (int j = 0; j < G; ++j) {
        __m128 s4 = _mm_mul_ps(kvserve_cpu::hsum8x4(sums[j][0], sums[j][1], sums[j][2], sums[j][3]), scale);
        if constexpr (BITS == 4) s4 = _mm_fmadd_ps(low, _mm_set1_ps(query.qsum[h * G + j]), s4);
        store_scores(scores + (h * G + j) * n + pos, s4, count);
      }
    }
  }
}

// value_pass_512 on AVX2: columns 16 at a time (two vectors per query head), D a multiple of 16.
template <int G, int BITS>
void value_pass_avx2(const Geometry& g, const uint8_t* v_cache, const int64_t* rows, int64_t n, int64_t h,
                     const float* probs, float* acc) {
  const int64_t D = g.dim, cb = g.code_bytes();
  float low_sum[G] = {};
  for (int64_t c0 = 0; c0 < D; c0 += 16) {
    __m256 av[G][2];
    for (int j = 0; j < G; ++j) av[j][0] = av[j][1] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const uint8_t* row = v_cache + rows[t] + h * g.row_bytes;
      const float scale = half_at(row + cb);
      __m256 a, b;
      if constexpr (BITS == 8) {
        a = widen8(row + c0);
        b = widen8(row + c0 + 8);
      } else {
        widen4(row + c0 / 2, a, b);
        if (c0 == 0) {
          const float low = half_at(row + cb + 2);
          for (int j = 0; j < G; ++j) low_sum[j] += probs[j * n + t] * low;
        }
      }
      for (int j = 0; j < G; ++j) {
        const __m256 w = _mm256_set1_ps(probs[j * n + t] * scale);
        av[j][0] = _mm256_fmadd_ps(w, a, av[j][0]);
        av[j][1] = _mm256_fmadd_ps(w, b, av[j][1]);
      }
    }
    for (int j = 0; j < G; ++j) {
      float* out = acc + j * D + c0;
      if constexpr (BITS == 8) {
        _mm256_storeu_ps(out, av[j][0]);
        _mm256_storeu_ps(out + 8, av[j][1]);
      } else {  // even columns in av[j][0], odd ones in av[j][1]: interleaved back
        const __m256 low = _mm256_set1_ps(low_sum[j]);
        const __m256 lo = _mm256_unpacklo_ps(av[j][0], av[j][1]), hi = _mm256_unpackhi_ps(av[j][0], av[j][1]);
        _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), low));
        _mm256_storeu_ps(out + 8, _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x31), low));
      }
    }
  }
}
#endif

// ----- a span: keys, softmax, values -----

// The largest of x[0 .. n-1] (n >= 1); any order gives the same value.
inline float max_of(const float* x, int64_t n) {
  float mx = x[0];
  for (int64_t t = 1; t < n; ++t) mx = std::max(mx, x[t]);
  return mx;
}

// Each of the H rows of scores (H, n) -> exp(score - the row's max) in place, each score first soft-capped when
// softcap > 0; m, l: the max and the sum, and with probs (not null) row j's result also copied to probs + j * stride.
// (paged_decode.cpp's softmax_rows.)
inline void softmax_rows(float* scores, int64_t H, int64_t n, float softcap, float* m, float* l, float* probs,
                         int64_t stride) {
  for (int64_t j = 0; j < H; ++j) {
    float* s = scores + j * n;
    if (softcap > 0.f) {
      const float inv = 1.f / softcap;
#pragma omp simd
      for (int64_t t = 0; t < n; ++t) s[t] = softcap * std::tanh(s[t] * inv);
    }
    const float mx = max_of(s, n);
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) s[t] = std::exp(s[t] - mx);
    m[j] = mx;
    l[j] = ordered_sum(s, n);
    if (probs != nullptr) std::memcpy(probs + j * stride, s, sizeof(float) * n);
  }
}

// A geometry's key pass (scores (H, n) of a span's n keys) and value pass (one KV head's accumulators (G, D) from
// its probabilities (G, n)); `run`: the float queries' int4 order (nibble_order; 0: element order); `digits`: the key
// pass reads Query::digits.
using KeyFn = void (*)(const Geometry&, const Query&, const uint8_t*, const uint8_t*, const int64_t*, int64_t,
                       float*);
using ValueFn = void (*)(const Geometry&, const uint8_t*, const int64_t*, int64_t, int64_t, const float*, float*);
struct Passes {
  KeyFn key = &key_pass_generic;
  ValueFn value = &value_pass_generic;
  int64_t run = 0;
  bool digits = false;
};

#if defined(__AVX512F__)
template <int D, int BITS>
Passes passes_512(int64_t group) {
#if defined(KVSERVE_VNNI)
  switch (group) {
    case 1: return {&key_pass_vnni<1, D, BITS>, &value_pass_512<1, D, BITS>, 0, true};
    case 2: return {&key_pass_vnni<2, D, BITS>, &value_pass_512<2, D, BITS>, 0, true};
    case 3: return {&key_pass_vnni<3, D, BITS>, &value_pass_512<3, D, BITS>, 0, true};
    case 4: return {&key_pass_vnni<4, D, BITS>, &value_pass_512<4, D, BITS>, 0, true};
    default: return {};
  }
#else
  constexpr int64_t run = BITS == 4 ? 32 : 0;
  switch (group) {
    case 1: return {&key_pass_512<1, D, BITS>, &value_pass_512<1, D, BITS>, run};
    case 2: return {&key_pass_512<2, D, BITS>, &value_pass_512<2, D, BITS>, run};
    case 3: return {&key_pass_512<3, D, BITS>, &value_pass_512<3, D, BITS>, run};
    case 4: return {&key_pass_512<4, D, BITS>, &value_pass_512<4, D, BITS>, run};
    default: return {};
  }
#endif
}
template <int BITS>
Passes passes_for_bits(int64_t group, int64_t dim) {
  switch (dim) {
    case 64: return passes_512<64, BITS>(group);
    case 128: return passes_512<128, BITS>(group);
    case 256: return passes_512<256, BITS>(group);
    default: return {};
  }
}
#elif defined(KVSERVE_AVX2)
template <int BITS>
Passes passes_for_bits(int64_t group, int64_t dim) {
  if (dim % 16 != 0) return {};
  constexpr int64_t run = BITS == 4 ? 16 : 0;
  switch (group) {
    case 1: return {&key_pass_avx2<1, BITS>, &value_pass_avx2<1, BITS>, run};
    case 2: return {&key_pass_avx2<2, BITS>, &value_pass_avx2<2, BITS>, run};
    case 3: return {&key_pass_avx2<3, BITS>, &value_pass_avx2<3, BITS>, run};
    case 4: return {&key_pass_avx2<4, BITS>, &value_pass_avx2<4, BITS>, run};
    default: return {};
  }
}
#endif

// The passes for this geometry: a fast path's, or the generic ones.
inline Passes passes_for(const Geometry& g) {
#if defined(__AVX512F__) || defined(KVSERVE_AVX2)
  return g.bits == 8 ? passes_for_bits<8>(g.group, g.dim) : passes_for_bits<4>(g.group, g.dim);
#else
  (void)g;
  return {};
#endif
}

// One work item: every query head of a row over key positions [first, last) of its block table. Writes m (H), l (H),
// acc (H, D) float32; if `probs` is not null, head j's exp(logit - m[j]) to probs + j * stride.
void attend_span(const Geometry& g, const Passes& passes, const Query& query, float softcap, const uint8_t* k_cache,
                 const uint8_t* v_cache, const int32_t* table, int64_t first, int64_t last, float* m, float* l,
                 float* acc, float* probs, int64_t stride) {
  const int64_t n = last - first, G = g.group, D = g.dim, H = g.heads;
  int64_t rows[SPAN];
  span_rows(g, table, first, last, rows);
  std::vector<float> scores(H * n);
  passes.key(g, query, k_cache, v_cache, rows, n, scores.data());
  softmax_rows(scores.data(), H, n, softcap, m, l, probs, stride);
  for (int64_t h = 0; h < g.kv_heads; ++h)
    passes.value(g, v_cache, rows, n, h, scores.data() + h * G * n, acc + h * G * D);
}

void decode(const Geometry& g, const at::Tensor& q, const uint8_t* kp, const uint8_t* vp, const int32_t* tp,
            const int32_t* starts, const int32_t* ends, double scale, double softcap, at::Tensor& out,
            at::Tensor& lse, float* weights) {
  const int64_t B = g.batch, D = g.dim, H = g.heads;
  // Items: each row's spans, in order.
  std::vector<int64_t> item_row, item_first, item_last, row_item(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    row_item[b] = static_cast<int64_t>(item_row.size());
    for (int64_t first = starts[b]; first < ends[b]; first += SPAN) {
      item_row.push_back(b);
      item_first.push_back(first);
      item_last.push_back(std::min<int64_t>(first + SPAN, ends[b]));
    }
  }
  const int64_t num_items = static_cast<int64_t>(item_row.size());
  row_item[B] = num_items;
  const int64_t length = g.width * g.block_size;
  const Passes passes = passes_for(g);
  // The queries scaled (in the passes' order), for int4's minimum each query row's sum, and for the VNNI passes
  // each row as digits: int8 rows in element order, int4 rows as their even elements, then their odd ones (a
  // byte's low nibbles, then its high ones).
  std::vector<float> qf(B * H * D), qsum(B * H, 0.f), unit(B * H, 1.f), m(num_items * H), l(num_items * H),
      acc(num_items * H * D);
  std::vector<int32_t> digits(passes.digits ? B * H * 3 * D / 4 : 0), digit_sum(passes.digits ? B * H * 3 : 0);
  const float* qp = q.data_ptr<float>();
  const auto digit_order = [&](int64_t i) { return g.bits == 8 ? i : i < D / 2 ? 2 * i : 2 * (i - D / 2) + 1; };
  for (int64_t row = 0; row < B * H; ++row) {
    const float* src = qp + row * D;
    float* dst = qf.data() + row * D;
    for (int64_t i = 0; i < D; ++i)
      dst[i] = src[passes.run ? nibble_order(i, passes.run) : i] * static_cast<float>(scale);
    if (g.bits == 4) qsum[row] = ordered_sum(dst, D);
    if (passes.digits) {
      int8_t* row_digits = reinterpret_cast<int8_t*>(digits.data() + row * 3 * D / 4);
      unit[row] = to_digits(src, D, static_cast<float>(scale), digit_order, row_digits, digit_sum.data() + row * 3);
    }
  }
  // With weights: each span's exp(logit - its max), rescaled once the row's log-sum-exp is known (uninitialised:
  // only a row's own range is read).
  std::unique_ptr<float[]> probs(weights != nullptr ? new float[B * H * length] : nullptr);
  // Grain: a short context runs on one thread (the fork costs more than it saves).
  const int64_t grain = std::max<int64_t>(1, 1024 / (SPAN * g.kv_heads));
  at::parallel_for(0, num_items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = item_row[i];
      float* pr = weights != nullptr ? probs.get() + b * H * length + item_first[i] : nullptr;  // row b, head 0
      const Query query{qf.data() + b * H * D, qsum.data() + b * H, digits.data() + b * H * 3 * D / 4,
                        unit.data() + b * H, digit_sum.data() + b * H * 3};
      attend_span(g, passes, query, static_cast<float>(softcap), kp, vp, tp + b * g.width, item_first[i],
                  item_last[i], m.data() + i * H, l.data() + i * H, acc.data() + i * H * D, pr, length);
    }
  });
  // Merge each row's spans in order, per query head.
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, B, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> total(D);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t head = 0; head < H; ++head) {
        float mx = -std::numeric_limits<float>::max();
        for (int64_t i = row_item[b]; i < row_item[b + 1]; ++i) mx = std::max(mx, m[i * H + head]);
        float sum = 0.f;
        std::fill(total.begin(), total.end(), 0.f);
        for (int64_t i = row_item[b]; i < row_item[b + 1]; ++i) {
          const float w = std::exp(m[i * H + head] - mx);
          sum += w * l[i * H + head];
          const float* a = acc.data() + (i * H + head) * D;
          for (int64_t d = 0; d < D; ++d) total[d] += w * a[d];
        }
        float* o = op + (b * H + head) * D;
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int64_t d = 0; d < D; ++d) o[d] = total[d] * inv;
        lp[b * H + head] = sum > 0.f ? mx + std::log(sum) : -std::numeric_limits<float>::infinity();
      }
    }
  });
  if (weights == nullptr) return;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      float* w = weights + b * length;
      std::fill(w, w + length, 0.f);
      for (int64_t i = row_item[b]; i < row_item[b + 1]; ++i) {
        for (int64_t head = 0; head < H; ++head) {
          const float* p = probs.get() + (b * H + head) * length;
          // exp(logit - lse) = exp(logit - m) * exp(m - lse), averaged over the heads
          const float f = std::exp(m[i * H + head] - lp[b * H + head]) / static_cast<float>(H);
#pragma omp simd
          for (int64_t t = item_first[i]; t < item_last[i]; ++t) w[t] += f * p[t];
        }
      }
    }
  });
}

}  // namespace

namespace kvserve_ops {

std::tuple<at::Tensor, at::Tensor, at::Tensor> paged_decode_quant(const at::Tensor& q, const at::Tensor& k_cache,
                                                                  const at::Tensor& v_cache,
                                                                  const at::Tensor& block_tables,
                                                                  const at::Tensor& starts, const at::Tensor& ends,
                                                                  double scale, int64_t bits, bool want_weights,
                                                                  double softcap) {
  TORCH_CHECK(bits == 8 || bits == 4, "paged_decode_quant reads int8 or int4 rows (bits 8 or 4), got ", bits);
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kFloat,
              "q must be a contiguous (B, H, D) float32 tensor");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k_cache/v_cache must be (blocks, bs, Hkv, row_bytes)");
  TORCH_CHECK(k_cache.scalar_type() == at::kByte && v_cache.scalar_type() == at::kByte,
              "a quantized cache holds uint8 rows; got k_cache ", k_cache.scalar_type(), ", v_cache ",
              v_cache.scalar_type());
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) && v_cache.strides() == k_cache.strides(),
              "a cache block must hold (bs, Hkv, row_bytes) with its last two dims contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables must be contiguous (B, W) int32");
  TORCH_CHECK(starts.scalar_type() == at::kInt && ends.scalar_type() == at::kInt, "starts/ends must be int32");
  Geometry g{q.size(0),
             q.size(1),
             k_cache.size(2),
             0,
             q.size(2),
             k_cache.size(1),
             block_tables.size(1),
             k_cache.stride(0),
             k_cache.stride(1),
             k_cache.size(3),
             static_cast<int>(bits)};
  TORCH_CHECK(bits == 8 || g.dim % 2 == 0, "int4 rows pack two values a byte: head_dim ", g.dim, " is odd");
  const int64_t row_bytes = bits == 8 ? g.dim + 2 : g.dim / 2 + 4;
  TORCH_CHECK(g.row_bytes == row_bytes, "int", bits, " rows of head_dim ", g.dim, " are ", row_bytes,
              " bytes, the cache's are ", g.row_bytes);
  TORCH_CHECK(g.kv_heads > 0 && g.heads % g.kv_heads == 0, "query heads ", g.heads, " not a multiple of KV heads ",
              g.kv_heads);
  TORCH_CHECK(block_tables.size(0) == g.batch && starts.numel() == g.batch && ends.numel() == g.batch,
              "block_tables, starts and ends need one entry per query row");
  g.group = g.heads / g.kv_heads;
  const at::Tensor st = starts.contiguous(), en = ends.contiguous();
  const int32_t* sp = st.data_ptr<int32_t>();
  const int32_t* ep = en.data_ptr<int32_t>();
  for (int64_t b = 0; b < g.batch; ++b) {
    TORCH_CHECK(0 <= sp[b] && sp[b] <= ep[b] && ep[b] <= g.width * g.block_size, "row ", b, " reads keys ", sp[b],
                "..", ep[b], " outside its table of ", g.width * g.block_size, " slots");
  }
  auto out = at::empty_like(q);
  auto lse = at::empty({g.batch, g.heads}, q.options());
  auto weights = want_weights ? at::empty({g.batch, g.width * g.block_size}, q.options()) : at::empty({0}, q.options());
  decode(g, q, k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<uint8_t>(), block_tables.data_ptr<int32_t>(), sp, ep,
         scale, softcap, out, lse, want_weights ? weights.data_ptr<float>() : nullptr);
  return {out, lse, weights};
}

}  // namespace kvserve_ops

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def(
      "paged_decode_quant(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor starts, "
      "Tensor ends, float scale, int bits, bool want_weights, float softcap=0.0) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("paged_decode_quant", &kvserve_ops::paged_decode_quant); }
