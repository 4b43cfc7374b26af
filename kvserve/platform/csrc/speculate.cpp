// InfiniGen's speculation for a decode batch in one pass (policies/infinigen.py: ``speculate_paged`` is the
// torch reference and the tests' oracle): which cached rows each sequence's KV heads fetch at the next layer.
//
// partial_q (B, Hkv, G, r): each decode row's skewed partial queries; partial_keys (Hkv, blocks, r, bs):
// the layer's partial key cache, each block's keys transposed so a dot product runs across the block's
// keys, read in place through block_tables (B, W) int32 (no gather); row b's
// candidates are positions starts[b] .. ends[b] - 1 of its table (position p at slot
// table[p / block_size] * block_size + p % block_size).
//
// Per row: each query head's logits q.k / sqrt(head_dim) (rounded to the queries' dtype first, as a matmul
// in that dtype does), its count of candidates within ``alpha`` of its best, the row's count = the mean
// of its heads' counts (floored, at least 1, at most its candidates); each KV head then takes that many
// candidates with the largest logit over its query heads. Returns the positions (B, Hkv, K) in ascending
// order (zero past a row's count; K the largest count), the counts (B,) and the tier slots of the positions.
// Ties at the top-k cut go to the earlier positions, so the result is deterministic.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "cpu_vec.h"

namespace {

using kvserve_cpu::round_to;
using kvserve_cpu::to_float;

struct Shape {
  int64_t batch, kv_heads, group, dims, block_size, width, head_stride;
};

inline int64_t slot_of(const int32_t* table, int64_t block_size, int64_t pos) {
  return static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
}

// logits[g * n + j] = q_g . key(j) * scale for the `count` keys of one block from `offset`, `block` being
// the block's (r, bs) transposed partial keys: the dot products run across keys (vectorised), each
// rounded to T first, as a matmul in T would.
template <typename T>
inline void block_logits(const float* qf, int64_t G, int64_t r, int64_t bs, const T* block, int64_t offset,
                         int64_t count, float scale, float* logits, int64_t n) {
  for (int64_t g = 0; g < G; ++g) {
    float* out = logits + g * n;
    std::fill(out, out + count, 0.f);
    for (int64_t d = 0; d < r; ++d) {
      const float qd = qf[g * r + d];
      const T* row = block + d * bs + offset;
      for (int64_t j = 0; j < count; ++j) out[j] += qd * to_float(row[j]);
    }
    for (int64_t j = 0; j < count; ++j) out[j] = round_to<T>(out[j]) * scale;
  }
}

// The same for a whole block of 16 keys and G query heads known at compile time: the G x 16 sums stay in
// registers (two 8-float vectors per head, GCC vector extensions: AVX2 and AVX-512 alike) while the
// block's rows stream past once.
typedef float v8f __attribute__((vector_size(32)));

template <typename T>
inline void load_row16(const T* src, v8f& lo, v8f& hi) {
  float row[16];
  for (int j = 0; j < 16; ++j) row[j] = to_float(src[j]);
  std::memcpy(&lo, row, sizeof(lo));
  std::memcpy(&hi, row + 8, sizeof(hi));
}

// bfloat16 is the top half of a float32: widen 16 of them with vector shifts instead of one at a time.
typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));

template <>
inline void load_row16<at::BFloat16>(const at::BFloat16* src, v8f& lo, v8f& hi) {
  v8u16 a, b;
  std::memcpy(&a, src, sizeof(a));
  std::memcpy(&b, src + 8, sizeof(b));
  const v8u32 wa = __builtin_convertvector(a, v8u32) << 16, wb = __builtin_convertvector(b, v8u32) << 16;
  std::memcpy(&lo, &wa, sizeof(lo));
  std::memcpy(&hi, &wb, sizeof(hi));
}

template <typename T, int G>
inline void block_logits16(const float* qf, int64_t r, const T* block, float scale, float* logits, int64_t n) {
  v8f lo[G], hi[G];
  for (int g = 0; g < G; ++g) lo[g] = hi[g] = v8f{};
  for (int64_t d = 0; d < r; ++d) {
    v8f a, b;
    load_row16(block + d * 16, a, b);
    for (int g = 0; g < G; ++g) {
      const float qd = qf[g * r + d];
      lo[g] += qd * a;
      hi[g] += qd * b;
    }
  }
  for (int g = 0; g < G; ++g) {
    float sums[16];
    std::memcpy(sums, &lo[g], sizeof(lo[g]));
    std::memcpy(sums + 8, &hi[g], sizeof(hi[g]));
    for (int j = 0; j < 16; ++j) logits[g * n + j] = round_to<T>(sums[j]) * scale;
  }
}

template <typename T>
inline bool whole_block16(const float* qf, int64_t G, int64_t r, const T* block, float scale, float* logits,
                          int64_t n) {
  switch (G) {
    case 1: block_logits16<T, 1>(qf, r, block, scale, logits, n); return true;
    case 2: block_logits16<T, 2>(qf, r, block, scale, logits, n); return true;
    case 3: block_logits16<T, 3>(qf, r, block, scale, logits, n); return true;
    case 4: block_logits16<T, 4>(qf, r, block, scale, logits, n); return true;
    default: return false;
  }
}

// Logits of one (row, KV head) item over its candidates into ``logits`` (G, n); each query head's count
// within alpha of its best into ``counts`` (G) and the KV head's logit (max over G) into ``kv`` (n).
template <typename T>
void score_item(const Shape& s, const T* q, const T* keys, const int32_t* table, int64_t first, int64_t n,
                double scale, double alpha, float* logits, int64_t* counts, float* kv) {
  const int64_t G = s.group, r = s.dims, bs = s.block_size;
  std::vector<float> qf(G * r);
  for (int64_t i = 0; i < G * r; ++i) qf[i] = to_float(q[i]);
  const float sc = static_cast<float>(scale);
  for (int64_t pos = first; pos < first + n;) {
    const int64_t offset = pos % bs, count = std::min(bs - offset, first + n - pos);
    const T* block = keys + static_cast<int64_t>(table[pos / bs]) * r * bs;
    if (pos + count < first + n) {  // the next block is anywhere: fetch its lines while this one is scored
      const char* next = reinterpret_cast<const char*>(keys + static_cast<int64_t>(table[pos / bs + 1]) * r * bs);
      for (int64_t line = 0; line < r * bs * static_cast<int64_t>(sizeof(T)); line += 64) __builtin_prefetch(next + line);
    }
    float* out = logits + (pos - first);
    if (bs != 16 || count != 16 || !whole_block16<T>(qf.data(), G, r, block, sc, out, n))
      block_logits<T>(qf.data(), G, r, bs, block, offset, count, sc, out, n);
    pos += count;
  }
  std::fill(kv, kv + n, -std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < G; ++g) {
    const float* lg = logits + g * n;
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) peak = std::max(peak, lg[j]);
    const float bar = peak - static_cast<float>(alpha);
    int64_t c = 0;
    for (int64_t j = 0; j < n; ++j) {
      c += lg[j] >= bar;
      kv[j] = std::max(kv[j], lg[j]);
    }
    counts[g] = c;
  }
}

// Float bits as an unsigned key in the floats' order (negative floats reversed below the positive ones).
inline uint32_t order_key(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The ``count``-th largest of scores[0..n), 1 <= count < n: a histogram of the keys' top 11 bits finds the bucket
// that holds it, and a selection among that bucket's scores only (a full nth_element over a row's thousands of
// scores was two thirds of the op: ~60 us of ~90 per (row, KV head) at 8,000 candidates).
inline float kth_largest(const float* scores, int64_t n, int64_t count, std::vector<float>& scratch) {
  constexpr int kShift = 21;
  uint32_t histogram[1u << (32 - kShift)] = {};
  for (int64_t j = 0; j < n; ++j) ++histogram[order_key(scores[j]) >> kShift];
  uint32_t bucket = (1u << (32 - kShift)) - 1;
  int64_t above = 0;  // scores in higher buckets
  while (above + histogram[bucket] < static_cast<uint32_t>(count)) above += histogram[bucket--];
  scratch.clear();
  for (int64_t j = 0; j < n; ++j) {
    if ((order_key(scores[j]) >> kShift) == bucket) scratch.push_back(scores[j]);
  }
  const int64_t rank = count - above - 1;  // within the bucket, 0-based from the largest
  std::nth_element(scratch.begin(), scratch.begin() + rank, scratch.end(), std::greater<float>());
  return scratch[rank];
}

// The ``count`` largest of scores[0..n) in ascending position order into out; ties at the cut go to the
// earlier positions. O(n): the cut value (``kth_largest``), then one scan.
inline void top_positions(const float* scores, int64_t n, int64_t count, int64_t* out, std::vector<float>& scratch) {
  if (count >= n) {
    for (int64_t j = 0; j < n; ++j) out[j] = j;
    return;
  }
  const float cut = kth_largest(scores, n, count, scratch);
  int64_t above = 0;
  for (int64_t j = 0; j < n; ++j) above += scores[j] > cut;
  int64_t ties = count - above, k = 0;
  for (int64_t j = 0; j < n && k < count; ++j) {
    if (scores[j] > cut || (scores[j] == cut && ties-- > 0)) out[k++] = j;
  }
}

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> run(const Shape& s, const at::Tensor& partial_q,
                                                   const at::Tensor& partial_keys, const at::Tensor& block_tables,
                                                   const int32_t* sp, const int32_t* ep, double scale, double alpha) {
  const int64_t B = s.batch, Hkv = s.kv_heads, G = s.group;
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max<int64_t>(longest, ep[b] - sp[b]);
  std::vector<float> kv(B * Hkv * longest);
  std::vector<int64_t> head_counts(B * Hkv * G);
  const T* qp = partial_q.data_ptr<T>();
  const T* kp = partial_keys.data_ptr<T>();
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> logits;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv, n = ep[b] - sp[b];
      logits.resize(G * n);
      score_item<T>(s, qp + item * G * s.dims, kp + h * s.head_stride, tp + b * s.width, sp[b], n, scale, alpha,
                    logits.data(), head_counts.data() + item * G, kv.data() + item * longest);
    }
  });
  auto counts = at::empty({B}, at::kLong);
  int64_t* cp = counts.data_ptr<int64_t>();
  int64_t top = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* hc = head_counts.data() + b * Hkv * G;
    const int64_t mean = std::accumulate(hc, hc + Hkv * G, int64_t{0}) / (Hkv * G);
    cp[b] = std::min<int64_t>(std::max<int64_t>(mean, 1), ep[b] - sp[b]);
    top = std::max(top, cp[b]);
  }
  auto index = at::empty({B, Hkv, top}, at::kLong);  // every entry written below
  auto slots = at::empty({B, Hkv, top}, at::kLong);
  int64_t* ip = index.data_ptr<int64_t>();
  int64_t* op = slots.data_ptr<int64_t>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, n = ep[b] - sp[b], count = cp[b];
      int64_t* out = ip + item * top;
      int64_t* slot = op + item * top;
      top_positions(kv.data() + item * longest, n, count, out, scratch);
      const int32_t* table = tp + b * s.width;
      for (int64_t j = 0; j < top; ++j) {
        out[j] = j < count ? sp[b] + out[j] : 0;
        slot[j] = slot_of(table, s.block_size, out[j]);
      }
    }
  });
  return {index, counts, slots};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> speculate_rows(const at::Tensor& partial_q,
                                                              const at::Tensor& partial_keys,
                                                              const at::Tensor& block_tables, int64_t block_size,
                                                              const at::Tensor& starts, const at::Tensor& ends,
                                                              double scale, double alpha) {
  TORCH_CHECK(partial_q.dim() == 4 && partial_q.is_contiguous(), "partial_q must be a contiguous (B, Hkv, G, r) tensor");
  TORCH_CHECK(partial_keys.dim() == 4 && partial_keys.is_contiguous(),
              "partial_keys must be a contiguous (Hkv, blocks, r, block_size) tensor");
  TORCH_CHECK(partial_keys.scalar_type() == partial_q.scalar_type(), "partial queries and keys must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables must be contiguous (B, W) int32");
  TORCH_CHECK(starts.scalar_type() == at::kInt && ends.scalar_type() == at::kInt, "starts/ends must be int32");
  Shape s{partial_q.size(0), partial_q.size(1), partial_q.size(2), partial_q.size(3), block_size,
          block_tables.size(1), partial_keys.stride(0)};
  TORCH_CHECK(partial_keys.size(0) == s.kv_heads && partial_keys.size(2) == s.dims, "partial_keys (",
              partial_keys.sizes(), ") do not match partial_q (", partial_q.sizes(), ")");
  TORCH_CHECK(partial_keys.size(3) == block_size, "partial_keys' blocks hold ", partial_keys.size(3),
              " keys, block_size is ", block_size);
  TORCH_CHECK(block_tables.size(0) == s.batch && starts.numel() == s.batch && ends.numel() == s.batch,
              "block_tables, starts and ends need one entry per row");
  const at::Tensor st = starts.contiguous(), en = ends.contiguous();
  const int32_t* sp = st.data_ptr<int32_t>();
  const int32_t* ep = en.data_ptr<int32_t>();
  const int64_t num_blocks = partial_keys.size(1);
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < s.batch; ++b) {
    TORCH_CHECK(0 <= sp[b] && sp[b] < ep[b] && ep[b] <= s.width * block_size, "row ", b, " speculates over ", sp[b],
                "..", ep[b], ", not a non-empty range of its table of ", s.width * block_size, " slots");
    for (int64_t w = sp[b] / block_size; w <= (ep[b] - 1) / block_size; ++w) {
      TORCH_CHECK(0 <= tp[b * s.width + w] && tp[b * s.width + w] < num_blocks, "row ", b, " reads block ",
                  tp[b * s.width + w], " of ", num_blocks);
    }
  }
  switch (partial_q.scalar_type()) {
    case at::kFloat:
      return run<float>(s, partial_q, partial_keys, block_tables, sp, ep, scale, alpha);
    case at::kBFloat16:
      return run<at::BFloat16>(s, partial_q, partial_keys, block_tables, sp, ep, scale, alpha);
    case at::kHalf:
      return run<at::Half>(s, partial_q, partial_keys, block_tables, sp, ep, scale, alpha);
    default:
      TORCH_CHECK(false, "speculate_rows supports float32, bfloat16 and float16, got ", partial_q.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def(
      "speculate_rows(Tensor partial_q, Tensor partial_keys, Tensor block_tables, int block_size, Tensor starts, "
      "Tensor ends, float scale, float alpha) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("speculate_rows", &speculate_rows); }
