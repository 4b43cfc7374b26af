// A decode step's attention folded into the running scores of the compressed cache's slots (H2O, SnapKV,
// PyramidInfer), for every row (layer x sequence) of the step at once. The torch code it replaces
// (CompressedKVCache._fold_scores) forms every row's slot ids, gathers the old scores, updates them and
// scatters them back: six passes and four temporaries over L x B x T elements, 1-4 ms of a 35 ms step at 4
// sequences of 1.5k kept tokens (benchmarks/policies/). Here each row walks its block table once.
//
// Exactly the torch code's arithmetic: a * s and b * w rounded to float32 separately, then added (no fused
// multiply-add), the new scores computed from the old ones for every row first, then written back in row
// order, so a slot two rows share (blocks shared between sequences) ends as the last row's, as index_copy_.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

// Without -ffast-math's contraction: a * s + b * w rounds twice, as torch's two ops do.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")

inline float fold(float a, float s, float b, float w) {
  const float kept = a * s;
  const float added = b * w;
  return kept + added;
}

// scores (S,) float32, updated in place; tables (R, W) int32 block ids; ends (R,) int32: row r's slots are
// positions 0 .. ends[r] - 1 of its table; weights (R, T >= W * block_size) float32; coefficients (R, 2) float32,
// row r's (a, b). Returns (R, T) float32: each row's new scores (0 past its end).
at::Tensor fold_slot_scores(at::Tensor& scores, const at::Tensor& tables, const at::Tensor& ends,
                            const at::Tensor& weights, const at::Tensor& coefficients, int64_t block_size) {
  TORCH_CHECK(scores.dim() == 1 && scores.scalar_type() == at::kFloat && scores.is_contiguous(),
              "fold_slot_scores: scores must be a contiguous 1-D float32 tensor");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kInt, "fold_slot_scores: tables must be (R, W) int32");
  const int64_t rows = tables.size(0), width = tables.size(1);
  TORCH_CHECK(ends.dim() == 1 && ends.size(0) == rows && ends.scalar_type() == at::kInt,
              "fold_slot_scores: ends must be (R,) int32");
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == rows && weights.scalar_type() == at::kFloat,
              "fold_slot_scores: weights must be (R, T) float32");
  TORCH_CHECK(coefficients.dim() == 2 && coefficients.size(0) == rows && coefficients.size(1) == 2 &&
                  coefficients.scalar_type() == at::kFloat,
              "fold_slot_scores: coefficients must be (R, 2) float32");
  TORCH_CHECK(block_size > 0, "fold_slot_scores: block_size must be positive, got ", block_size);
  const int64_t length = weights.size(1);
  const at::Tensor table = tables.contiguous(), end = ends.contiguous(), w = weights.contiguous();
  const at::Tensor coeff = coefficients.contiguous();
  const int32_t* tp = table.data_ptr<int32_t>();
  const int32_t* ep = end.data_ptr<int32_t>();
  const float* wp = w.data_ptr<float>();
  const float* cp = coeff.data_ptr<float>();
  float* sp = scores.data_ptr<float>();
  const int64_t num_slots = scores.size(0);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(ep[r] >= 0 && ep[r] <= std::min(length, width * block_size), "fold_slot_scores: row ", r,
                " ends at ", ep[r], ", past its ", std::min(length, width * block_size), " slots");
    for (int64_t j = 0; j * block_size < ep[r]; ++j) {
      TORCH_CHECK(tp[r * width + j] >= 0 && (tp[r * width + j] + 1) * block_size <= num_slots,
                  "fold_slot_scores: row ", r, " reads block ", tp[r * width + j], " of ", num_slots / block_size);
    }
  }
  at::Tensor out = at::zeros({rows, length}, weights.options());
  float* op = out.data_ptr<float>();
  // A block's slots are contiguous in ``scores``: each loop below runs over one block's slots.
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t stop) {
    for (int64_t r = begin; r < stop; ++r) {
      const float a = cp[2 * r], b = cp[2 * r + 1];
      for (int64_t first = 0; first < ep[r]; first += block_size) {
        const float* old = sp + static_cast<int64_t>(tp[r * width + first / block_size]) * block_size;
        const float* weight = wp + r * length + first;
        float* folded = op + r * length + first;
        const int64_t n = std::min<int64_t>(block_size, ep[r] - first);
        for (int64_t i = 0; i < n; ++i) folded[i] = fold(a, old[i], b, weight[i]);
      }
    }
  });
  for (int64_t r = 0; r < rows; ++r) {  // in row order: the last row sharing a slot writes it
    for (int64_t first = 0; first < ep[r]; first += block_size) {
      float* slot = sp + static_cast<int64_t>(tp[r * width + first / block_size]) * block_size;
      std::memcpy(slot, op + r * length + first, sizeof(float) * std::min<int64_t>(block_size, ep[r] - first));
    }
  }
  return out;
}

#pragma GCC pop_options

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def(
      "fold_slot_scores(Tensor(a!) scores, Tensor tables, Tensor ends, Tensor weights, Tensor coefficients, "
      "int block_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("fold_slot_scores", &fold_slot_scores); }
