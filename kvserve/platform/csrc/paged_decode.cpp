// Paged decode attention on the CPU: one query row per sequence over its cached keys, read in place
// through its block table (no gather of the context), all query heads of a KV group together.
//
// Layout (attention/paged.py): k_cache, v_cache (num_blocks, block_size, Hkv, D), last two dims
// contiguous; block_tables (B, W) int32; row b reads key positions starts[b] .. ends[b] - 1, position p
// at block block_tables[b][p / block_size], offset p % block_size.
//
// Work is split into (sequence, span of SPAN keys) items, so a single long sequence keeps every thread busy
// (flash-decoding); an item walks its span block by block, every KV head within a block (a block's rows are
// contiguous: read once, in order), keeps each query head's max, sum and weighted values in float32, and
// the spans of a row are merged in order. The split depends on a row's own length only, so
// a row's result does not depend on the rest of the batch.
//
// The cache may hold a narrower type than q (float32 queries over a bfloat16 or float16 cache): keys and values
// widen to float32 as they load. bfloat16 queries over a bfloat16 cache use the CPU's bfloat16 dot products where
// it has them (attend_span_bf16); elsewhere they widen as well.
//
// With a soft cap c > 0 (Gemma 2) each scaled logit x becomes c * tanh(x / c) before the softmax: one tanh per
// score, where the scores already sit in float32 (softmax_rows), so every path above gets it.
//
// Optional output: each key's softmax probability averaged over the H query heads, (B, W * block_size)
// float32, indexed by position (zero outside a row's range): what H2O and PyramidInfer fold into their
// scores, from the same pass instead of a second q.k product.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"
#include "ops.h"

namespace {

constexpr int64_t SPAN = 256;  // keys per work item

using kvserve_cpu::ordered_sum;
using kvserve_cpu::to_float;
#if defined(__AVX512F__)
using kvserve_cpu::load16;
#endif
#if defined(KVSERVE_AVX2)
using kvserve_cpu::hsum8x4;
using kvserve_cpu::load8;
#endif

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
#endif

// scores[j * stride] = q_j . k for the G query rows q (G, D) float32 and one key row k (D,).
template <typename T>
inline void dots(const float* __restrict q, const T* __restrict k, int64_t group, int64_t d, float* scores,
                 int64_t stride) {
#if defined(__AVX512F__)
  if (d % 16 == 0 && group <= 8) {
    __m512 sums[8];
    for (int64_t j = 0; j < group; ++j) sums[j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) {
      const __m512 kc = load16(k + c);
      for (int64_t j = 0; j < group; ++j) sums[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * d + c), kc, sums[j]);
    }
    for (int64_t j = 0; j < group; ++j) scores[j * stride] = _mm512_reduce_add_ps(sums[j]);
    return;
  }
#endif
  for (int64_t j = 0; j < group; ++j) {
    float s = 0.f;
    for (int64_t i = 0; i < d; ++i) s += q[j * d + i] * to_float(k[i]);
    scores[j * stride] = s;
  }
}

// acc[j] += p[j * stride] * v for the G accumulators acc (G, D) float32 and one value row v (D,).
template <typename T>
inline void accumulate(float* __restrict acc, const T* __restrict v, const float* p, int64_t stride, int64_t group,
                       int64_t d) {
#if defined(__AVX512F__)
  if (d % 16 == 0) {
    for (int64_t c = 0; c < d; c += 16) {
      const __m512 vc = load16(v + c);
      for (int64_t j = 0; j < group; ++j) {
        float* a = acc + j * d + c;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(p[j * stride]), vc, _mm512_loadu_ps(a)));
      }
    }
    return;
  }
#endif
  for (int64_t j = 0; j < group; ++j) {
    for (int64_t i = 0; i < d; ++i) acc[j * d + i] += p[j * stride] * to_float(v[i]);
  }
}

struct Geometry {
  int64_t batch, heads, kv_heads, group, dim, block_size, width;
  int64_t block_stride, token_stride;  // in elements, of k_cache (v_cache has the same)
};

// Calls f(t, offset) for key positions first + t < last, offset being the key's first element of head h in
// a cache; walks the table block by block (no division per key).
template <typename F>
inline void for_each_key(const Geometry& g, const int32_t* table, int64_t h, int64_t first, int64_t last, F&& f) {
  for (int64_t pos = first; pos < last;) {
    const int64_t block = pos / g.block_size, offset = pos % g.block_size;
    const int64_t count = std::min(g.block_size - offset, last - pos);
    const int64_t base = table[block] * g.block_stride + h * g.dim;
    for (int64_t i = 0; i < count; ++i) f(pos - first + i, base + (offset + i) * g.token_stride);
    pos += count;
  }
}

#if defined(__AVX512F__)
// The key and value passes for a fixed G and D (SmolLM2: 3 and 64): the G x D/16 query rows, sums and
// accumulators stay in registers across the keys instead of going through memory per key.
template <int G, int D, typename T>
void key_pass_fixed(const Geometry& g, const float* q, const T* k_cache, const int32_t* table, int64_t h,
                    int64_t first, int64_t last, float* scores, int64_t stride) {
  constexpr int C = D / 16;
  __m512 qv[G][C];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < C; ++c) qv[j][c] = _mm512_loadu_ps(q + j * D + c * 16);
  for_each_key(g, table, h, first, last, [&](int64_t t, int64_t slot) {
    __m512 sums[G];
    for (int j = 0; j < G; ++j) sums[j] = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c) {
      const __m512 kc = load16(k_cache + slot + c * 16);
      for (int j = 0; j < G; ++j) sums[j] = _mm512_fmadd_ps(qv[j][c], kc, sums[j]);
    }
    for (int j = 0; j < G; ++j) scores[j * stride + t] = _mm512_reduce_add_ps(sums[j]);
  });
}

template <int G, int D, typename T>
void value_pass_fixed(const Geometry& g, const T* v_cache, const int32_t* table, int64_t h, int64_t first,
                      int64_t last, const float* probs, int64_t stride, float* acc) {
  constexpr int C = D / 16;
  __m512 av[G][C];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < C; ++c) av[j][c] = _mm512_loadu_ps(acc + j * D + c * 16);
  for_each_key(g, table, h, first, last, [&](int64_t t, int64_t slot) {
    __m512 p[G];
    for (int j = 0; j < G; ++j) p[j] = _mm512_set1_ps(probs[j * stride + t]);
    for (int c = 0; c < C; ++c) {
      const __m512 vc = load16(v_cache + slot + c * 16);
      for (int j = 0; j < G; ++j) av[j][c] = _mm512_fmadd_ps(p[j], vc, av[j][c]);
    }
  });
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + j * D + c * 16, av[j][c]);
}
#endif

#if defined(KVSERVE_AVX2)
// AVX2 (16 vector registers): keys 4 at a time against the G query rows, G x 4 independent FMA chains (one
// chain per key waited on the FMA latency: several times slower), each key's sum by hsum8x4. A run's last
// chunk repeats its last key, so every key's score comes from the same instructions wherever it sits.
// The value pass runs over 32 of D's columns at a time so its G x 4 accumulators stay in registers.
// DIM: D as a compile-time constant (64, 128: the accumulators then stay in registers), or 0 for g.dim.
template <int G, int DIM, typename T>
void key_pass8(const Geometry& g, const float* q, const T* k_cache, const int32_t* table, int64_t h, int64_t first,
               int64_t last, float* scores, int64_t stride) {
  const int64_t D = DIM ? DIM : g.dim;
  int64_t block = first / g.block_size, offset = first % g.block_size;  // of the next key
  for (int64_t pos = first; pos < last; pos += 4) {
    const int64_t count = std::min<int64_t>(4, last - pos);
    const T* keys[4];
    for (int i = 0; i < 4; ++i) {
      if (i >= count) {
        keys[i] = keys[count - 1];
        continue;
      }
      keys[i] = k_cache + table[block] * g.block_stride + offset * g.token_stride + h * D;
      if (++offset == g.block_size) offset = 0, ++block;
    }
    __m256 sums[G][4];
    for (int j = 0; j < G; ++j)
      for (int i = 0; i < 4; ++i) sums[j][i] = _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int64_t c = 0; c < D; c += 8) {
      for (int i = 0; i < 4; ++i) {
        const __m256 kc = load8(keys[i] + c);  // the queries are memory operands: 16 registers hold the rest
        for (int j = 0; j < G; ++j) sums[j][i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * D + c), kc, sums[j][i]);
      }
    }
    for (int j = 0; j < G; ++j) {
      store_scores(scores + j * stride + (pos - first), hsum8x4(sums[j][0], sums[j][1], sums[j][2], sums[j][3]),
                   count);
    }
  }
}

template <int G, typename T>
void value_pass8(const Geometry& g, const T* v_cache, const int32_t* table, int64_t h, int64_t first, int64_t last,
                 const float* probs, int64_t stride, float* acc) {
  const int64_t D = g.dim, n = last - first;
  for (int64_t c0 = 0; c0 < D; c0 += 32) {
    __m256 av[G][4];
    for (int j = 0; j < G; ++j)
      for (int c = 0; c < 4; ++c) av[j][c] = _mm256_loadu_ps(acc + j * D + c0 + c * 8);
    // A plain loop, not for_each_key: through the lambda the accumulators went to the stack every key.
    int64_t block = first / g.block_size, offset = first % g.block_size;
    const T* row = v_cache + table[block] * g.block_stride + offset * g.token_stride + h * D + c0;
    for (int64_t t = 0; t < n; ++t) {
      __m256 p[G];
      for (int j = 0; j < G; ++j) p[j] = _mm256_set1_ps(probs[j * stride + t]);
      for (int c = 0; c < 4; ++c) {
        const __m256 vc = load8(row + c * 8);
        for (int j = 0; j < G; ++j) av[j][c] = _mm256_fmadd_ps(p[j], vc, av[j][c]);
      }
      if (++offset < g.block_size) {
        row += g.token_stride;
      } else if (t + 1 < n) {
        offset = 0;
        row = v_cache + table[++block] * g.block_stride + h * D + c0;
      }
    }
    for (int j = 0; j < G; ++j)
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + j * D + c0 + c * 8, av[j][c]);
  }
}
#endif

#if defined(KVSERVE_AVX2)
// key_pass8 with the common head dims as compile-time constants.
template <int G, typename T>
void key_pass_dim(const Geometry& g, const float* q, const T* k_cache, const int32_t* table, int64_t h, int64_t first,
                  int64_t last, float* scores, int64_t stride) {
  if (g.dim == 64) return key_pass8<G, 64>(g, q, k_cache, table, h, first, last, scores, stride);
  if (g.dim == 128) return key_pass8<G, 128>(g, q, k_cache, table, h, first, last, scores, stride);
  key_pass8<G, 0>(g, q, k_cache, table, h, first, last, scores, stride);
}
#endif

// scores[j * stride + t] = q_j . key(first + t) for the G query rows of KV head h.
template <typename T>
void key_pass(const Geometry& g, const float* q, const T* k_cache, const int32_t* table, int64_t h, int64_t first,
              int64_t last, float* scores, int64_t stride) {
#if defined(__AVX512F__)
  if (g.group == 3 && g.dim == 64) return key_pass_fixed<3, 64>(g, q, k_cache, table, h, first, last, scores, stride);
  if (g.group == 4 && g.dim == 64) return key_pass_fixed<4, 64>(g, q, k_cache, table, h, first, last, scores, stride);
#elif defined(KVSERVE_AVX2)
  if (g.dim % 32 == 0) {
    switch (g.group) {
      case 1: return key_pass_dim<1>(g, q, k_cache, table, h, first, last, scores, stride);
      case 2: return key_pass_dim<2>(g, q, k_cache, table, h, first, last, scores, stride);
      case 3: return key_pass_dim<3>(g, q, k_cache, table, h, first, last, scores, stride);
      case 4: return key_pass_dim<4>(g, q, k_cache, table, h, first, last, scores, stride);
      default: break;
    }
  }
#endif
  for_each_key(g, table, h, first, last,
               [&](int64_t t, int64_t slot) { dots(q, k_cache + slot, g.group, g.dim, scores + t, stride); });
}

// acc[j] += probs[j * stride + t] * value(first + t) for the G query rows of KV head h.
template <typename T>
void value_pass(const Geometry& g, const T* v_cache, const int32_t* table, int64_t h, int64_t first, int64_t last,
                const float* probs, int64_t stride, float* acc) {
#if defined(__AVX512F__)
  if (g.group == 3 && g.dim == 64)
    return value_pass_fixed<3, 64>(g, v_cache, table, h, first, last, probs, stride, acc);
  if (g.group == 4 && g.dim == 64)
    return value_pass_fixed<4, 64>(g, v_cache, table, h, first, last, probs, stride, acc);
#elif defined(KVSERVE_AVX2)
  if (g.dim % 32 == 0) {
    switch (g.group) {
      case 1: return value_pass8<1>(g, v_cache, table, h, first, last, probs, stride, acc);
      case 2: return value_pass8<2>(g, v_cache, table, h, first, last, probs, stride, acc);
      case 3: return value_pass8<3>(g, v_cache, table, h, first, last, probs, stride, acc);
      case 4: return value_pass8<4>(g, v_cache, table, h, first, last, probs, stride, acc);
      default: break;
    }
  }
#endif
  for_each_key(g, table, h, first, last, [&](int64_t t, int64_t slot) {
    accumulate(acc, v_cache + slot, probs + t, stride, g.group, g.dim);
  });
}

// The largest of x[0 .. n-1] (n >= 1); any order gives the same value, so 8 lanes where there are.
inline float max_of(const float* x, int64_t n) {
  int64_t t = 0;
  float mx = x[0];
#if defined(KVSERVE_AVX2)
  if (n >= 8) {
    __m256 m8 = _mm256_loadu_ps(x);
    for (t = 8; t + 8 <= n; t += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(x + t));
    float lanes[8];
    _mm256_storeu_ps(lanes, m8);
    for (float lane : lanes) mx = std::max(mx, lane);
  }
#endif
  for (; t < n; ++t) mx = std::max(mx, x[t]);
  return mx;
}

// Calls f(block_first, block_last) for the runs of [first, last) that lie in one block.
template <typename F>
inline void for_each_block(int64_t block_size, int64_t first, int64_t last, F&& f) {
  for (int64_t pos = first; pos < last;) {
    const int64_t end = std::min(last, (pos / block_size + 1) * block_size);
    f(pos, end);
    pos = end;
  }
}

// Each of the H rows of scores (H, n) -> exp(score - the row's max) in place, each score first soft-capped when
// softcap > 0; m, l: the max and the sum, and with probs (not null) row j's result also copied to probs + j * stride.
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
#if defined(__AVX512BF16__)
// bfloat16 queries over a bfloat16 cache, on the CPU's bfloat16 dot products (vdpbf16ps: pairs of products
// exact in float32, summed into float32 lanes). Per key and query head the float32 kernel above spent a
// 16-lane horizontal sum besides its FMAs, and it widened every key to float32 first; here the keys are used
// as stored and four keys' sums are reduced together (reduce4). Both passes walk a row's whole span, not block
// by block: the key pass every KV head of a key at once, the value pass one KV head at a time with its
// accumulators in registers (the key pass prefetched the span's values, <= 256 x Hkv x D, to L2).

// Positions first, first + 1, ... of KV head h through a block table, without a division per key.
struct KeyCursor {
  const Geometry& g;
  const int32_t* table;
  int64_t h, block, offset;
  KeyCursor(const Geometry& geo, const int32_t* t, int64_t head, int64_t first)
      : g(geo), table(t), h(head), block(first / geo.block_size), offset(first % geo.block_size) {}
  // The next key's first element in a cache, then one position on.
  int64_t next() {
    const int64_t slot = table[block] * g.block_stride + offset * g.token_stride + h * g.dim;
    if (++offset == g.block_size) offset = 0, ++block;
    return slot;
  }
};

// Lane i = the sum of a_i's 16 lanes, by the same tree for every i (so a key's score does not depend on which
// of the four it was): the quarters pairwise, then the four lanes of what is left.
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
  __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
  w = _mm512_add_ps(w, _mm512_permute_ps(w, 0xB1));  // lanes (0+1, 1+0, 2+3, 3+2) in each quarter
  w = _mm512_add_ps(w, _mm512_permute_ps(w, 0x4E));  // lane 0 of quarter i: key i's sum
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                          0, 0), w));
}

// scores[(h * G + j) * n + t] = scale * q_hj . key_h(first + t) for every KV head h, q (H, D) bfloat16
// unscaled, n = last - first. Keys four at a time, every KV head of a key before the next (a key's heads are one
// contiguous row: the cache streams in order); a run's last chunk repeats its last key, so every key goes
// through the same instructions. The same rows of the value cache are prefetched for the value pass.
template <int G, int D>
void key_pass_bf16(const Geometry& g, const uint16_t* q, float scale, const uint16_t* k_cache,
                   const uint16_t* v_cache, const int32_t* table, int64_t first, int64_t last, float* scores) {
  constexpr int C = D / 32;
  const int64_t n = last - first, row_bytes = g.kv_heads * D * 2;
  KeyCursor cursor(g, table, 0, first);
  const __m128 s = _mm_set1_ps(scale);
  for (int64_t pos = first; pos < last; pos += 4) {
    const int64_t count = std::min<int64_t>(4, last - pos);
    int64_t rows[4];
    for (int i = 0; i < 4; ++i) rows[i] = i < count ? cursor.next() : rows[count - 1];
    for (int i = 0; i < count; ++i) {
      const char* v = reinterpret_cast<const char*>(v_cache + rows[i]);
      for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(v + b, _MM_HINT_T1);
    }
    for (int64_t h = 0; h < g.kv_heads; ++h) {
      __m512 sums[G][4];
      for (int j = 0; j < G; ++j)
        for (int i = 0; i < 4; ++i) sums[j][i] = _mm512_setzero_ps();
      const uint16_t* qh = q + h * G * D;
      for (int c = 0; c < C; ++c) {
        for (int i = 0; i < 4; ++i) {
          const __m512bh kc = (__m512bh)_mm512_loadu_si512(k_cache + rows[i] + h * D + c * 32);
          for (int j = 0; j < G; ++j)
            sums[j][i] = _mm512_dpbf16_ps(sums[j][i], (__m512bh)_mm512_loadu_si512(qh + j * D + c * 32), kc);
        }
      }
      for (int j = 0; j < G; ++j) {
        const __m128 s4 = _mm_mul_ps(reduce4(sums[j][0], sums[j][1], sums[j][2], sums[j][3]), s);
        store_scores(scores + (h * G + j) * n + (pos - first), s4, count);
      }
    }
  }
}

// acc[j] += probs[j * stride + t] * value(first + t) in float32, columns [c0, c0 + W) at a time. 32 stored
// bfloat16 widen in two instructions as their even and odd columns (a shift, a mask), so the accumulators
// hold the columns in that order and are put back in place at the end.
template <int G, int D>
void value_pass_bf16(const Geometry& g, const uint16_t* v_cache, const int32_t* table, int64_t h, int64_t first,
                     int64_t last, const float* probs, int64_t stride, float* acc) {
  constexpr int W = 64;  // columns per walk: 4 G accumulators in registers
  constexpr int C = W / 32;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512i to_even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i to_odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512i from_lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i from_hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t c0 = 0; c0 < D; c0 += W) {
    __m512 even[G][C], odd[G][C];
    for (int j = 0; j < G; ++j)
      for (int c = 0; c < C; ++c) {
        const float* a = acc + j * D + c0 + c * 32;
        const __m512 lo = _mm512_loadu_ps(a), hi = _mm512_loadu_ps(a + 16);
        even[j][c] = _mm512_permutex2var_ps(lo, to_even, hi);
        odd[j][c] = _mm512_permutex2var_ps(lo, to_odd, hi);
      }
    KeyCursor cursor(g, table, h, first);
    for (int64_t t = 0; t < last - first; ++t) {
      const uint16_t* row = v_cache + cursor.next() + c0;
      __m512 p[G];
      for (int j = 0; j < G; ++j) p[j] = _mm512_set1_ps(probs[j * stride + t]);
      for (int c = 0; c < C; ++c) {
        const __m512i raw = _mm512_loadu_si512(row + c * 32);
        const __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        const __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
        for (int j = 0; j < G; ++j) {
          even[j][c] = _mm512_fmadd_ps(p[j], ve, even[j][c]);
          odd[j][c] = _mm512_fmadd_ps(p[j], vo, odd[j][c]);
        }
      }
    }
    for (int j = 0; j < G; ++j)
      for (int c = 0; c < C; ++c) {
        _mm512_storeu_ps(acc + j * D + c0 + c * 32, _mm512_permutex2var_ps(even[j][c], from_lo, odd[j][c]));
        _mm512_storeu_ps(acc + j * D + c0 + c * 32 + 16, _mm512_permutex2var_ps(even[j][c], from_hi, odd[j][c]));
      }
  }
}

// One work item as attend_span, for bfloat16 queries and cache: G and D fixed, D a multiple of 32.
template <int G, int D>
void attend_span_bf16(const Geometry& g, const uint16_t* q, float scale, float softcap, const uint16_t* k_cache,
                      const uint16_t* v_cache, const int32_t* table, int64_t first, int64_t last, float* m, float* l,
                      float* acc, float* probs, int64_t stride) {
  const int64_t n = last - first, H = g.heads;
  std::vector<float> scores(H * n);
  key_pass_bf16<G, D>(g, q, scale, k_cache, v_cache, table, first, last, scores.data());
  softmax_rows(scores.data(), H, n, softcap, m, l, probs, stride);
  std::fill(acc, acc + H * D, 0.f);
  for (int64_t h = 0; h < g.kv_heads; ++h)
    value_pass_bf16<G, D>(g, v_cache, table, h, first, last, scores.data() + h * G * n, n, acc + h * G * D);
}

// The fixed-shape span function for G query heads per KV head and head dim D, or null where there is none.
using SpanFn = void (*)(const Geometry&, const uint16_t*, float, float, const uint16_t*, const uint16_t*,
                        const int32_t*, int64_t, int64_t, float*, float*, float*, float*, int64_t);
template <int D>
SpanFn span_bf16_for_group(int64_t group) {
  switch (group) {
    case 1: return &attend_span_bf16<1, D>;
    case 2: return &attend_span_bf16<2, D>;
    case 3: return &attend_span_bf16<3, D>;
    case 4: return &attend_span_bf16<4, D>;
    default: return nullptr;
  }
}
inline SpanFn span_bf16(int64_t group, int64_t dim) {
  switch (dim) {
    case 64: return span_bf16_for_group<64>(group);
    case 128: return span_bf16_for_group<128>(group);
    case 256: return span_bf16_for_group<256>(group);
    default: return nullptr;
  }
}
#endif

// One work item: every query head of a row over key positions [first, last) of its block table `table`,
// block by block and every KV head within a block, so a block's rows are read while they are in cache.
// Writes m (H), l (H), acc (H, D) float32; if `probs` is not null, head j's exp(logit - m[j]) to probs + j * stride.
template <typename T>
void attend_span(const Geometry& g, const float* q, float softcap, const T* k_cache, const T* v_cache,
                 const int32_t* table, int64_t first, int64_t last, float* m, float* l, float* acc, float* probs,
                 int64_t stride) {
  const int64_t n = last - first, G = g.group, D = g.dim, H = g.heads;
  std::vector<float> scores(H * n);
  for_each_block(g.block_size, first, last, [&](int64_t a, int64_t b) {
    for (int64_t h = 0; h < g.kv_heads; ++h)
      key_pass(g, q + h * G * D, k_cache, table, h, a, b, scores.data() + h * G * n + (a - first), n);
  });
  softmax_rows(scores.data(), H, n, softcap, m, l, probs, stride);
  std::fill(acc, acc + H * D, 0.f);
  for_each_block(g.block_size, first, last, [&](int64_t a, int64_t b) {
    for (int64_t h = 0; h < g.kv_heads; ++h)
      value_pass(g, v_cache, table, h, a, b, scores.data() + h * G * n + (a - first), n, acc + h * G * D);
  });
}

template <typename TQ, typename T>
void decode(const Geometry& g, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& tables, const int32_t* starts, const int32_t* ends, double scale, double softcap,
            at::Tensor& out, at::Tensor& lse, float* weights) {
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
  std::vector<float> qf(B * H * D), m(num_items * H), l(num_items * H), acc(num_items * H * D);
  // With weights: each span's exp(logit - its max), rescaled once the row's log-sum-exp is known (uninitialised:
  // only a row's own range is read).
  std::unique_ptr<float[]> probs(weights != nullptr ? new float[B * H * length] : nullptr);
  const TQ* qp = q.data_ptr<TQ>();
  for (int64_t i = 0; i < B * H * D; ++i) qf[i] = to_float(qp[i]) * static_cast<float>(scale);
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tp = tables.data_ptr<int32_t>();
#if defined(__AVX512BF16__)
  const SpanFn fast = std::is_same_v<TQ, at::BFloat16> && std::is_same_v<T, at::BFloat16> ? span_bf16(g.group, D)
                                                                                           : nullptr;
#endif
  // Grain: a short context runs on one thread (the fork costs more than it saves).
  const int64_t grain = std::max<int64_t>(1, 1024 / (SPAN * g.kv_heads));
  at::parallel_for(0, num_items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = item_row[i];
      float* pr = weights != nullptr ? probs.get() + b * H * length + item_first[i] : nullptr;  // row b, head 0
      float *mi = m.data() + i * H, *li = l.data() + i * H, *ai = acc.data() + i * H * D;
#if defined(__AVX512BF16__)
      if (fast != nullptr) {
        const auto raw = [](const auto* p) { return reinterpret_cast<const uint16_t*>(p); };
        fast(g, raw(qp) + b * H * D, static_cast<float>(scale), static_cast<float>(softcap), raw(kp), raw(vp),
             tp + b * g.width, item_first[i], item_last[i], mi, li, ai, pr, length);
        continue;
      }
#endif
      attend_span<T>(g, qf.data() + b * H * D, static_cast<float>(softcap), kp, vp, tp + b * g.width, item_first[i],
                     item_last[i], mi, li, ai, pr, length);
    }
  });
  // Merge each row's spans in order, per query head.
  TQ* op = out.data_ptr<TQ>();
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
        TQ* o = op + (b * H + head) * D;
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<TQ>(total[d] * inv);
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                            const at::Tensor& starts, const at::Tensor& ends,
                                                            double scale, bool want_weights, double softcap) {
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous (B, H, D) tensor");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "k_cache/v_cache must be (blocks, bs, Hkv, D)");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) && v_cache.strides() == k_cache.strides(),
              "a cache block must hold (bs, Hkv, D) with its last two dims contiguous");
  const auto q_type = q.scalar_type(), kv_type = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == kv_type && (q_type == kv_type || q_type == at::kFloat),
              "the caches must share a dtype, q's or narrower under float32 q; got q ", q_type, ", k_cache ", kv_type,
              ", v_cache ", v_cache.scalar_type());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables must be contiguous (B, W) int32");
  TORCH_CHECK(starts.scalar_type() == at::kInt && ends.scalar_type() == at::kInt, "starts/ends must be int32");
  Geometry g{q.size(0), q.size(1), k_cache.size(2), 0, q.size(2), k_cache.size(1), block_tables.size(1),
             k_cache.stride(0), k_cache.stride(1)};
  TORCH_CHECK(g.dim == k_cache.size(3), "q head_dim ", g.dim, " != cache head_dim ", k_cache.size(3));
  TORCH_CHECK(g.heads % g.kv_heads == 0, "query heads ", g.heads, " not a multiple of KV heads ", g.kv_heads);
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
  auto lse = at::empty({g.batch, g.heads}, q.options().dtype(at::kFloat));
  auto weights = want_weights ? at::empty({g.batch, g.width * g.block_size}, q.options().dtype(at::kFloat))
                              : at::empty({0}, q.options().dtype(at::kFloat));
  float* wp = want_weights ? weights.data_ptr<float>() : nullptr;
  const bool wide_q = q_type == at::kFloat;  // float32 queries over any cache type
  switch (kv_type) {
    case at::kFloat:
      decode<float, float>(g, q, k_cache, v_cache, block_tables, sp, ep, scale, softcap, out, lse, wp);
      break;
    case at::kBFloat16:
      if (wide_q)
        decode<float, at::BFloat16>(g, q, k_cache, v_cache, block_tables, sp, ep, scale, softcap, out, lse, wp);
      else
        decode<at::BFloat16, at::BFloat16>(g, q, k_cache, v_cache, block_tables, sp, ep, scale, softcap, out, lse, wp);
      break;
    case at::kHalf:
      if (wide_q) decode<float, at::Half>(g, q, k_cache, v_cache, block_tables, sp, ep, scale, softcap, out, lse, wp);
      else decode<at::Half, at::Half>(g, q, k_cache, v_cache, block_tables, sp, ep, scale, softcap, out, lse, wp);
      break;
    default:
      TORCH_CHECK(false, "paged_decode supports float32, bfloat16 and float16, got ", kv_type);
  }
  return {out, lse, weights};
}

}  // namespace kvserve_ops

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor starts, Tensor ends, "
      "float scale, bool want_weights, float softcap=0.0) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("paged_decode", &kvserve_ops::paged_decode); }
