// A decoder layer's elementwise steps as one op each, for the CPU: RMSNorm, rotary embedding (in place) and
// SwiGLU's silu(gate) * up. In eager PyTorch each is 3-8 dispatched ops with a temporary per op; at batch 1 a
// step is ~1,200 such ops, which costs more than the int4 matmuls (benchmarks/decode-kernel/).
//
// Each op computes in float32 and rounds where the torch code it replaces (kvserve/models/layers.py) rounds
// to the activation dtype, so bfloat16 results match that code up to the last bit of exp (silu) and the order
// of one row's sum of squares (RMSNorm): a rare one-ulp difference.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vec.h"
#include "ops.h"

namespace {

using kvserve_cpu::ordered_sum;
using kvserve_cpu::round_to;
using kvserve_cpu::to_float;

// Rows per task: enough work that a fork pays (a decode step's few rows stay on one thread).
constexpr int64_t ROW_GRAIN = 8;

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), hidden = x.size(1), stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * stride;
      const float sum = ordered_sum(row, hidden, /*squares=*/true);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + static_cast<float>(eps));
      T* o = op + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) o[i] = static_cast<T>(to_float(wp[i]) * round_to<T>(to_float(row[i]) * inv));
    }
  });
}

template <typename T>
void rope_rows(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t row_stride = x.stride(0), head_stride = x.stride(1);
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cp + r * dim;
      const T* s = sp + r * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = xp + r * row_stride + h * head_stride;
        for (int64_t i = 0; i < dim; ++i) row[i] = to_float(v[i]);
        // torch: addcmul(x * cos, roll(x, D/2), sin), with x * cos held in the activation dtype.
        for (int64_t i = 0; i < dim; ++i) {
          const float rolled = row[i < half ? i + half : i - half];
          v[i] = static_cast<T>(round_to<T>(row[i] * to_float(c[i])) + rolled * to_float(s[i]));
        }
      }
    }
  });
}

template <typename T>
void silu_mul_rows(const at::Tensor& gate_up, int64_t n, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), stride = gate_up.stride(0);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(n);
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * stride;
      const T* u = g + n;
      T* o = op + r * n;
      float* a = gate.data();
      // Three plain loops the compiler vectorises (exp through libmvec); one fused loop with the
      // conversions did not vectorise and ran 10x slower.
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) a[i] = to_float(g[i]);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) a[i] = a[i] / (1.f + std::exp(-a[i]));
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(round_to<T>(a[i]) * to_float(u[i]));
    }
  });
}

}  // namespace

namespace kvserve_ops {

// weight * rms_norm(x): x (N, hidden) with unit stride along hidden, weight (hidden,) in x's dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be (N, hidden) with unit stride along hidden");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "rms_norm: weight must be contiguous (hidden,)");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight and x must share a dtype");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat: rms_norm_rows<float>(x, weight, eps, out); break;
    case at::kBFloat16: rms_norm_rows<at::BFloat16>(x, weight, eps, out); break;
    case at::kHalf: rms_norm_rows<at::Half>(x, weight, eps, out); break;
    default: TORCH_CHECK(false, "rms_norm: unsupported dtype ", x.scalar_type());
  }
  return out;
}

// Rotates x (N, heads, D) in place by its rows of the rotary tables cos and sin (N, 1, D) (sin's first half
// negated, as RotaryEmbedding stores it); x may be a strided view (heads of a fused qkv projection).
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rope_: x must be (N, heads, D) with unit stride along an even D");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) &&
                  sin.numel() == cos.numel(),
              "rope_: cos and sin must be contiguous (N, 1, D)");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rope_: the tables and x must share a dtype");
  switch (x.scalar_type()) {
    case at::kFloat: rope_rows<float>(x, cos, sin); break;
    case at::kBFloat16: rope_rows<at::BFloat16>(x, cos, sin); break;
    case at::kHalf: rope_rows<at::Half>(x, cos, sin); break;
    default: TORCH_CHECK(false, "rope_: unsupported dtype ", x.scalar_type());
  }
}

// silu(gate) * up for gate_up (N, 2n) = [gate | up] (one fused projection) -> (N, n).
at::Tensor silu_mul(const at::Tensor& gate_up, int64_t n) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) == 2 * n && gate_up.stride(1) == 1,
              "silu_mul: gate_up must be (N, 2n) with unit stride along its columns");
  auto out = at::empty({gate_up.size(0), n}, gate_up.options());
  switch (gate_up.scalar_type()) {
    case at::kFloat: silu_mul_rows<float>(gate_up, n, out); break;
    case at::kBFloat16: silu_mul_rows<at::BFloat16>(gate_up, n, out); break;
    case at::kHalf: silu_mul_rows<at::Half>(gate_up, n, out); break;
    default: TORCH_CHECK(false, "silu_mul: unsupported dtype ", gate_up.scalar_type());
  }
  return out;
}

}  // namespace kvserve_ops

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("rms_norm", &kvserve_ops::rms_norm);
  m.impl("rope_", &kvserve_ops::rope_);
  m.impl("silu_mul", &kvserve_ops::silu_mul);
}
