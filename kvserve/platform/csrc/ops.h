// kvserve's CPU ops as C++ functions, for kernels that chain them without a trip through Python or the
// dispatcher (decode_layers.cpp). Each is registered as torch.ops.kvserve.<name> by the file defining it,
// which documents its layout.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

namespace kvserve_ops {

// fused_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gate_up, int64_t n);

// paged_decode.cpp: (out, log-sum-exp, weights)
std::tuple<at::Tensor, at::Tensor, at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                            const at::Tensor& starts, const at::Tensor& ends,
                                                            double scale, bool want_weights,
                                                            double softcap = 0.0);

// quant_gemv.cpp
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& consts);
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales);
at::Tensor q4_linear_q8(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& consts);
at::Tensor q8_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales);

}  // namespace kvserve_ops
