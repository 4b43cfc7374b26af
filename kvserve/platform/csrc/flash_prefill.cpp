// Causal prefill attention in bfloat16 on CPUs with AVX512-BF16 (vdpbf16ps): q (T, H, D) at cache positions
// ctx_len.. over k, v (ctx_len + T, Hkv, D) -> (T, H, D), optionally over a sliding window; or, with key_ends,
// query t over keys [0, key_ends[t]) of k, v (N, Hkv, D) (Prompt Cache's recompute: keys in position order), and
// with key_starts too over [key_starts[t], key_ends[t]) (its sliding-window layers: a window by position).
//
// Why: torch's CPU flash attention runs bfloat16 at its float32 speed on a CPU without AMX (2,048 causal
// queries x 9 heads x 64: 116 GFLOP/s on an AMD EPYC Zen 4, 2 threads), about half of a bfloat16 prefill.
// Here both products are bfloat16 dot products with float32 accumulation, as in a flash attention kernel:
// a tile of rows (query tokens x the query heads sharing a KV head, so each key is read once for the group)
// against blocks of KB keys, an online softmax in float32 between them, the probabilities rounded to
// bfloat16 for the product with V (as torch's kernel does). K and V are first repacked per KV head into the
// instruction's pair layout: K as [key block of 16][d pair][16 keys][2], V as [key pair][d][2].
//
// With a soft cap c > 0 (Gemma 2) each scaled logit x becomes c * tanh(x / c) before the online softmax.
//
// The op exists on every CPU; flash_prefill_available() says whether this build has the kernel: compiled where
// -march=native enables AVX512-BF16, except with AMX, where torch's kernel runs its products on the tiles
// (far above what vdpbf16ps reaches). Callers keep torch's kernel where it is absent.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
#define KVSERVE_FLASH_PREFILL 1
#include <immintrin.h>
#endif

namespace {

bool flash_prefill_available() {
#if defined(KVSERVE_FLASH_PREFILL)
  return true;
#else
  return false;
#endif
}

#if defined(KVSERVE_FLASH_PREFILL)

constexpr int64_t KB = 64;        // keys per block: 4 vectors of 16
constexpr int64_t TILE_ROWS = 32;  // rows (query token x grouped head) per work item, rounded to whole tokens
constexpr int64_t SUB = 4;         // rows per register sub-tile
constexpr float NONE = -1e30f;     // a row's running max before its first key (finite: built with -ffast-math)

// exp(x) for 16 floats (x <= 0 here): 2^n * p(r) with r = x - n ln 2 in [-ln2/2, ln2/2] and p its degree-6
// Taylor polynomial (relative error ~2e-7, far below the bfloat16 rounding the probabilities get next).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// c * tanh(x / c) for 16 floats: tanh(y) = sign(y) (1 - e) / (1 + e) with e = exp(-2|y|) <= 1 (no overflow).
inline __m512 softcap16(__m512 x, float c) {
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.f / c));
  const __m512 e = exp16(_mm512_mul_ps(_mm512_abs_ps(y), _mm512_set1_ps(-2.f)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign)), _mm512_set1_ps(c));
}

struct Problem {
  const uint16_t* q;  // (T, H, D) with strides
  int64_t q_tok, q_head;
  int64_t T, H, Hkv, G, D, N;  // N = ctx_len + T keys
  int64_t ctx, window;          // window <= 0: none
  const int64_t* ends;          // (T,) keys each query sees (a prefix), or null: ctx + t + 1 (causal)
  const int64_t* starts;        // (T,) with ends: the first key each query sees, or null: by window (or 0)
  float scale;
  float softcap;       // <= 0: none
  const uint16_t* kp;  // per KV head: [N16 / 16][D / 2][16][2]
  const uint16_t* vp;  // per KV head: [NP / 2][D][2]
  int64_t kp_head, vp_head;
  uint16_t* out;  // (T, H, D) contiguous
  // Votes (flash_prefill_votes): tokens vote_first.. weigh each key's probability by vote_w[t - vote_first] / G
  // into a per-thread (Hkv, NP) float32 sum; vote_w null: no votes.
  const float* vote_w = nullptr;
  int64_t vote_first = 0;
  int64_t sums_head = 0;
};

// The key after the last one query token t sees, and its first.
inline int64_t key_hi(const Problem& p, int64_t t) { return p.ends ? p.ends[t] : p.ctx + t + 1; }
inline int64_t key_lo(const Problem& p, int64_t t) {
  if (p.starts) return p.starts[t];
  return p.window > 0 ? std::max<int64_t>(0, key_hi(p, t) - p.window) : 0;
}

// S[r][0..KB) = scale * q_r . k_j for the R rows at `rows` and the KB keys of the block at kblk (16-key units).
template <int R>
inline void scores(const Problem& p, const uint32_t* const* qrows, const uint16_t* kblock, float* S, int64_t lds) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t pairs = p.D / 2;
  const int64_t block_stride = pairs * 32;  // bf16 per 16-key block
  for (int64_t d = 0; d < pairs; ++d) {
    __m512bh k[4];
    for (int j = 0; j < 4; ++j)
      k[j] = (__m512bh)_mm512_loadu_si512(kblock + j * block_stride + d * 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh q = (__m512bh)_mm512_set1_epi32(static_cast<int>(qrows[r][d]));
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], q, k[j]);
    }
  }
  const __m512 s = _mm512_set1_ps(p.scale);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(S + r * lds + j * 16, _mm512_mul_ps(acc[r][j], s));
}

// O[r][d0..d0+64) += P_r . V[block keys][d0..d0+64) for R rows; P as bfloat16 pairs (KB / 2 per row).
template <int R>
inline void accumulate(const uint32_t* P, int64_t ldp, const uint16_t* vblock, int64_t D, float* O, int64_t ldo,
                       int64_t pairs) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_loadu_ps(O + r * ldo + d0 + j * 16);
    for (int64_t kp = 0; kp < pairs; ++kp) {
      __m512bh v[4];
      const uint16_t* row = vblock + kp * D * 2 + d0 * 2;
      for (int j = 0; j < 4; ++j) v[j] = (__m512bh)_mm512_loadu_si512(row + j * 32);
      for (int r = 0; r < R; ++r) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(P[r * ldp + kp]));
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w, v[j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(O + r * ldo + d0 + j * 16, acc[r][j]);
  }
}

// Rows [r0, r0 + n) in sub-tiles of SUB, the last one narrower.
template <typename Fn>
inline void for_subtiles(int64_t n, Fn&& fn) {
  int64_t r = 0;
  for (; r + SUB <= n; r += SUB) fn(r, std::integral_constant<int, SUB>{});
  switch (n - r) {
    case 3: fn(r, std::integral_constant<int, 3>{}); break;
    case 2: fn(r, std::integral_constant<int, 2>{}); break;
    case 1: fn(r, std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

// The votes of tokens [v0, t1) of a tile starting at t0 (rows r of the tile: token t0 + r / G, query head
// h * G + r % G), once their softmax is known (m, l: each row's max and sum): a second pass over the keys they
// see forms each probability exp(s - m) / l in float32 from the same logits and adds it, weighted by the token's
// vote / G, to sums[h] (a float32 per key). Only the products with K run again; V is not read.
void vote_tile(const Problem& p, int64_t h, int64_t v0, int64_t t0, int64_t t1, const uint32_t* const* qrows, float* S,
               const float* m, const float* l, float* sums) {
  const int64_t r0 = (v0 - t0) * p.G, rows = (t1 - t0) * p.G, D = p.D;
  std::vector<float> coef(rows, 0.f);
  for (int64_t r = r0; r < rows; ++r) {
    const int64_t t = t0 + r / p.G;
    coef[r] = l[r] > 0.f ? p.vote_w[t - p.vote_first] / (static_cast<float>(p.G) * l[r]) : 0.f;
  }
  const uint16_t* kp = p.kp + h * p.kp_head;
  float* sum = sums + h * p.sums_head;
  int64_t first = key_lo(p, v0), last = key_hi(p, v0);
  for (int64_t t = v0 + 1; t < t1; ++t) first = std::min(first, key_lo(p, t)), last = std::max(last, key_hi(p, t));
  first = first / KB * KB;
  for (int64_t k0 = first; k0 < last; k0 += KB) {
    const uint16_t* kblock = kp + (k0 / 16) * (D / 2) * 32;
    for_subtiles(rows - r0, [&](int64_t r, auto R) {
      scores<decltype(R)::value>(p, qrows + r0 + r, kblock, S + (r0 + r) * KB, KB);
    });
    __m512 acc[4];
    for (int j = 0; j < 4; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t r = r0; r < rows; ++r) {
      const int64_t t = t0 + r / p.G;
      const int64_t a = std::max<int64_t>(key_lo(p, t) - k0, 0), b = std::min<int64_t>(key_hi(p, t) - k0, KB);
      if (a >= b) continue;
      const float* s = S + r * KB;
      const __m512 shift = _mm512_set1_ps(m[r]), c = _mm512_set1_ps(coef[r]);
      for (int j = 0; j < 4; ++j) {
        const int64_t lo = std::clamp<int64_t>(a - 16 * j, 0, 16), hi = std::clamp<int64_t>(b - 16 * j, 0, 16);
        const __mmask16 valid = static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
        __m512 x = _mm512_loadu_ps(s + 16 * j);
        if (p.softcap > 0.f) x = softcap16(x, p.softcap);
        acc[j] = _mm512_mask3_fmadd_ps(exp16(_mm512_sub_ps(x, shift)), c, acc[j], valid);
      }
    }
    for (int j = 0; j < 4; ++j)
      _mm512_storeu_ps(sum + k0 + 16 * j, _mm512_add_ps(_mm512_loadu_ps(sum + k0 + 16 * j), acc[j]));
  }
}

// One work item: tokens [t0, t1) of KV head h's query group.
void attend_tile(const Problem& p, int64_t h, int64_t t0, int64_t t1, float* S, float* O, uint32_t* P, float* m,
                 float* l, float* sums) {
  const int64_t rows = (t1 - t0) * p.G, D = p.D;
  std::vector<const uint32_t*> qrows(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / p.G, head = h * p.G + r % p.G;
    qrows[r] = reinterpret_cast<const uint32_t*>(p.q + t * p.q_tok + head * p.q_head);
    m[r] = NONE;
    l[r] = 0.f;
  }
  std::fill(O, O + rows * D, 0.f);
  const uint16_t* kp = p.kp + h * p.kp_head;
  const uint16_t* vp = p.vp + h * p.vp_head;
  int64_t first = key_lo(p, t0), last = key_hi(p, t0);
  for (int64_t t = t0 + 1; t < t1; ++t) first = std::min(first, key_lo(p, t)), last = std::max(last, key_hi(p, t));
  first = first / KB * KB;
  for (int64_t k0 = first; k0 < last; k0 += KB) {
    const uint16_t* kblock = kp + (k0 / 16) * (D / 2) * 32;
    for_subtiles(rows, [&](int64_t r, auto R) {
      scores<decltype(R)::value>(p, qrows.data() + r, kblock, S + r * KB, KB);
    });
    // Online softmax per row over the keys it may see in this block; the others get probability 0.
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = t0 + r / p.G;
      const int64_t a = std::max<int64_t>(key_lo(p, t) - k0, 0), b = std::min<int64_t>(key_hi(p, t) - k0, KB);
      uint32_t* pr = P + r * (KB / 2);
      if (a >= b) {
        std::memset(pr, 0, sizeof(uint32_t) * (KB / 2));
        continue;
      }
      float* s = S + r * KB;
      if (p.softcap > 0.f)
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(s + 16 * j, softcap16(_mm512_loadu_ps(s + 16 * j), p.softcap));
      __mmask16 valid[4];
      __m512 mx = _mm512_set1_ps(m[r]);
      for (int j = 0; j < 4; ++j) {
        const int64_t lo = std::clamp<int64_t>(a - 16 * j, 0, 16), hi = std::clamp<int64_t>(b - 16 * j, 0, 16);
        valid[j] = static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
        mx = _mm512_mask_max_ps(mx, valid[j], mx, _mm512_loadu_ps(s + 16 * j));
      }
      const float row_max = _mm512_reduce_max_ps(mx);
      const float correction = std::exp(m[r] - row_max);  // 0 on the row's first block (m = NONE)
      const __m512 shift = _mm512_set1_ps(row_max);
      __m512 sum = _mm512_setzero_ps();
      __m512 e[4];
      for (int j = 0; j < 4; ++j) {
        e[j] = _mm512_maskz_mov_ps(valid[j], exp16(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * j), shift)));
        sum = _mm512_add_ps(sum, e[j]);
      }
      l[r] = l[r] * correction + _mm512_reduce_add_ps(sum);
      m[r] = row_max;
      if (correction != 1.f) {
        float* o = O + r * D;
        const __m512 c = _mm512_set1_ps(correction);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), c));
      }
      for (int j = 0; j < 4; j += 2)  // 32 floats -> 32 bfloat16 in key order: a lane holds a key pair
        _mm512_storeu_si512(pr + 8 * j, (__m512i)_mm512_cvtne2ps_pbh(e[j + 1], e[j]));
    }
    const uint16_t* vblock = vp + (k0 / 2) * D * 2;
    for_subtiles(rows, [&](int64_t r, auto R) {
      accumulate<decltype(R)::value>(P + r * (KB / 2), KB / 2, vblock, D, O + r * D, D, KB / 2);
    });
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / p.G, head = h * p.G + r % p.G;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;  // a query that sees no key gets zeros
    uint16_t* dst = p.out + (t * p.H + head) * D;
    for (int64_t d = 0; d < D; d += 16) {
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(O + r * D + d), _mm512_set1_ps(inv)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)v);
    }
  }
  if (p.vote_w && t1 > p.vote_first) vote_tile(p, h, std::max(t0, p.vote_first), t0, t1, qrows.data(), S, m, l, sums);
}

// K of KV head h as [N16 / 16][D / 2][16][2] and V as [NP / 2][D][2], zero past the N keys.
void pack(const at::Tensor& k, const at::Tensor& v, int64_t NP, at::Tensor& kp, at::Tensor& vp) {
  const int64_t N = k.size(0), Hkv = k.size(1), D = k.size(2);
  const uint16_t* kd = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const uint16_t* vd = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  uint16_t* kpd = reinterpret_cast<uint16_t*>(kp.data_ptr<at::BFloat16>());
  uint16_t* vpd = reinterpret_cast<uint16_t*>(vp.data_ptr<at::BFloat16>());
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const int64_t blocks = NP / 16;
  at::parallel_for(0, Hkv * blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, b = item % blocks;
      uint32_t* kdst = reinterpret_cast<uint32_t*>(kpd + h * NP * D + b * 16 * D);  // [D / 2][16]
      uint16_t* vdst = vpd + h * NP * D + b * 16 * D;                               // [8 pairs][D][2]
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t n = b * 16 + i;
        if (n < N) {
          const uint32_t* ksrc = reinterpret_cast<const uint32_t*>(kd + n * ks0 + h * ks1);
          for (int64_t d = 0; d < D / 2; ++d) kdst[d * 16 + i] = ksrc[d];
          const uint16_t* vsrc = vd + n * vs0 + h * vs1;
          uint16_t* vrow = vdst + (i / 2) * D * 2 + (i % 2);
          for (int64_t d = 0; d < D; ++d) vrow[d * 2] = vsrc[d];
        } else {
          for (int64_t d = 0; d < D / 2; ++d) kdst[d * 16 + i] = 0;
          uint16_t* vrow = vdst + (i / 2) * D * 2 + (i % 2);
          for (int64_t d = 0; d < D; ++d) vrow[d * 2] = 0;
        }
      }
    }
  });
}

#endif  // KVSERVE_FLASH_PREFILL

// The op's checks and its run; with vote_w ((T - vote_first,) float32) also the votes' sums (Hkv, N) float32.
std::tuple<at::Tensor, at::Tensor> attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          int64_t ctx_len, int64_t window, double scale,
                                          const std::optional<at::Tensor>& key_ends,
                                          const std::optional<at::Tensor>& key_starts, double softcap,
                                          bool voting, const float* vote_w, int64_t vote_first) {
  TORCH_CHECK(flash_prefill_available(), "flash_prefill: this build has no AVX512-BF16 kernel");
  TORCH_CHECK(softcap >= 0.0, "flash_prefill: softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "flash_prefill: q, k, v must be (tokens, heads, dim)");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16,
              "flash_prefill: bfloat16 only");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), N = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(D % 64 == 0, "flash_prefill: head dim ", D, " is not a multiple of 64");
  TORCH_CHECK(k.size(2) == D && v.sizes() == k.sizes(), "flash_prefill: k and v must be (", N, ", Hkv, ", D, ")");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "flash_prefill: ", H, " query heads do not group over ", Hkv, " KV heads");
  const int64_t* ends = nullptr;
  const int64_t* starts = nullptr;
  if (key_ends.has_value()) {  // query t sees keys [0, key_ends[t]) (a window's last ones): any order of positions
    const at::Tensor& e = *key_ends;
    TORCH_CHECK(e.scalar_type() == at::kLong && e.dim() == 1 && e.size(0) == T && e.is_contiguous(),
                "flash_prefill: key_ends must be ", T, " contiguous int64 values");
    TORCH_CHECK(T == 0 || (e.min().item<int64_t>() >= 0 && e.max().item<int64_t>() <= N),
                "flash_prefill: key_ends must lie in [0, ", N, "]");
    ends = e.data_ptr<int64_t>();
    if (key_starts.has_value()) {  // query t sees keys [key_starts[t], key_ends[t])
      const at::Tensor& b = *key_starts;
      TORCH_CHECK(b.scalar_type() == at::kLong && b.dim() == 1 && b.size(0) == T && b.is_contiguous(),
                  "flash_prefill: key_starts must be ", T, " contiguous int64 values");
      TORCH_CHECK(T == 0 || (b.min().item<int64_t>() >= 0 && (e - b).min().item<int64_t>() >= 1),
                  "flash_prefill: each query must see a key: 0 <= key_starts < key_ends");
      starts = b.data_ptr<int64_t>();
    }
  } else {
    TORCH_CHECK(!key_starts.has_value(), "flash_prefill: key_starts need key_ends");
    TORCH_CHECK(N == ctx_len + T, "flash_prefill: ", N, " keys for ", ctx_len, " cached + ", T, " new tokens");
  }
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "flash_prefill: the head dim must be dense");
  at::Tensor out = at::empty({T, H, D}, q.options());
  at::Tensor sums = at::zeros({voting ? Hkv : 0, N}, q.options().dtype(at::kFloat));
#if defined(KVSERVE_FLASH_PREFILL)
  if (T == 0) return {out, sums};
  const int64_t NP = (N + KB - 1) / KB * KB;
  at::Tensor kp = at::empty({Hkv, NP, D}, k.options()), vp = at::empty({Hkv, NP, D}, v.options());
  pack(k, v, NP, kp, vp);
  Problem p{reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
            q.stride(0),
            q.stride(1),
            T,
            H,
            Hkv,
            H / Hkv,
            D,
            N,
            ctx_len,
            window,
            ends,
            starts,
            static_cast<float>(scale),
            static_cast<float>(softcap),
            reinterpret_cast<const uint16_t*>(kp.data_ptr<at::BFloat16>()),
            reinterpret_cast<const uint16_t*>(vp.data_ptr<at::BFloat16>()),
            NP * D,
            NP * D,
            reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
            vote_first < T ? vote_w : nullptr,
            vote_first,
            NP};
  const int64_t tile_tokens = std::max<int64_t>(1, TILE_ROWS / p.G);
  const int64_t tiles = (T + tile_tokens - 1) / tile_tokens, items = tiles * Hkv;
  // Later tiles see more keys: hand them out first, one at a time, so the threads finish together.
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  // Each thread adds its tiles' votes into its own (Hkv, NP) sums; they are added up after.
  std::vector<float> thread_sums(p.vote_w ? threads * Hkv * NP : 0, 0.f);
  at::parallel_for(0, threads, 1, [&](int64_t thread, int64_t) {
    const int64_t rows = tile_tokens * p.G;
    std::vector<float> S(rows * KB), O(rows * D), m(rows), l(rows);
    std::vector<uint32_t> P(rows * KB / 2);
    float* own = p.vote_w ? thread_sums.data() + thread * Hkv * NP : nullptr;
    for (int64_t item = next++; item < items; item = next++) {
      const int64_t tile = tiles - 1 - item / Hkv, h = item % Hkv;
      const int64_t t0 = tile * tile_tokens, t1 = std::min(T, t0 + tile_tokens);
      attend_tile(p, h, t0, t1, S.data(), O.data(), P.data(), m.data(), l.data(), own);
    }
  });
  if (p.vote_w) {
    float* dst = sums.data_ptr<float>();
    for (int64_t t = 0; t < threads; ++t)
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t n = 0; n < N; ++n) dst[h * N + n] += thread_sums[(t * Hkv + h) * NP + n];
  }
#endif
  return {out, sums};
}

at::Tensor flash_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t ctx_len,
                         int64_t window, double scale, const std::optional<at::Tensor>& key_ends,
                         const std::optional<at::Tensor>& key_starts, double softcap) {
  return std::get<0>(attend(q, k, v, ctx_len, window, scale, key_ends, key_starts, softcap, false, nullptr, 0));
}

// Causal attention of q (T, H, D) over k, v (ctx_len + T, Hkv, D) as flash_prefill, and the votes of its tokens
// vote_first..: each key's probability under those queries, weighted by row_weights ((T - vote_first,) float32)
// and averaged over the G query heads of its KV head, summed -> (out (T, H, D), sums (Hkv, ctx_len + T) float32).
// A compressing cache's scores (policies/scoring.py's head_column_sums) without a float32 pass over every row.
std::tuple<at::Tensor, at::Tensor> flash_prefill_votes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       int64_t ctx_len, double scale, int64_t vote_first,
                                                       const at::Tensor& row_weights, double softcap) {
  const int64_t T = q.dim() == 3 ? q.size(0) : 0;
  TORCH_CHECK(vote_first >= 0 && vote_first <= T, "flash_prefill_votes: vote_first must lie in [0, ", T, "]");
  TORCH_CHECK(row_weights.scalar_type() == at::kFloat && row_weights.dim() == 1 &&
                  row_weights.size(0) == T - vote_first && row_weights.is_contiguous(),
              "flash_prefill_votes: row_weights must be ", T - vote_first, " contiguous float32 values");
  return attend(q, k, v, ctx_len, 0, scale, std::nullopt, std::nullopt, softcap, true,
                row_weights.data_ptr<float>(), vote_first);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def(
      "flash_prefill(Tensor q, Tensor k, Tensor v, int ctx_len, int window, float scale, Tensor? key_ends=None, "
      "Tensor? key_starts=None, float softcap=0.0) -> Tensor");
  m.def(
      "flash_prefill_votes(Tensor q, Tensor k, Tensor v, int ctx_len, float scale, int vote_first, "
      "Tensor row_weights, float softcap=0.0) -> (Tensor, Tensor)");
  m.def("flash_prefill_available() -> bool", &flash_prefill_available);  // no tensors: one kernel for all
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("flash_prefill", &flash_prefill);
  m.impl("flash_prefill_votes", &flash_prefill_votes);
}
