// Helpers the CPU kernels share: dtype conversion to float32 and reductions whose order depends only on the
// data's length, never on its address (a vectoriser peeling a loop for alignment would make a row's sum,
// and so its bits, depend on where the row sits in the batch).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace kvserve_cpu {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(at::Half x) { return static_cast<float>(x); }

// Rounds to T and back: where torch code holds an intermediate in the activation dtype.
template <typename T>
inline float round_to(float x) {
  return to_float(static_cast<T>(x));
}

#if defined(__AVX512F__)
// 16 values from memory as 16 float lanes.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define KVSERVE_AVX2 1
// 8 values from memory as 8 float lanes (AVX2 machines without AVX-512: the AMD EPYCs).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const at::Half* p) {
#if defined(__F16C__)  // every AVX2 CPU has it: one conversion instruction (exact, as the scalar one)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return _mm256_loadu_ps(f);
#endif
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The 8 lanes' sum in a fixed order.
inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}

// Lane i = the sum of v[i]'s 8 lanes, as ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)) for every i.
inline __m128 hsum8x4(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
  const __m256 all = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));  // per v: low half, high half
  return _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1));
}
#endif

// Sequential sums for the tails and for CPUs without AVX-512 (no reassociation, so no vectoriser reorders them).
template <typename T>
__attribute__((optimize("no-associative-math"))) inline float sequential_sum(const T* x, int64_t n, bool squares) {
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) total += squares ? to_float(x[i]) * to_float(x[i]) : to_float(x[i]);
  return total;
}

// sum_i x[i] (or x[i]^2) in a fixed order: 16 lanes (AVX-512) or 8 (AVX2) over whole chunks, the lanes added
// in a fixed tree, then the tail in order.
template <typename T>
inline float ordered_sum(const T* x, int64_t n, bool squares = false) {
  int64_t i = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(x + i);
    acc = squares ? _mm512_fmadd_ps(v, v, acc) : _mm512_add_ps(acc, v);
  }
  total = _mm512_reduce_add_ps(acc);
#elif defined(KVSERVE_AVX2)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    acc = squares ? _mm256_fmadd_ps(v, v, acc) : _mm256_add_ps(acc, v);
  }
  total = hsum8(acc);
#endif
  return total + sequential_sum(x + i, n - i, squares);
}

}  // namespace kvserve_cpu
