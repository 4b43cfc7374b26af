// The decoder layers of a Llama-family decode step as one call (models/decode_chain.py): per layer RMSNorm,
// the fused q/k/v projection, rotary embedding, the cache write, paged decode attention, o_proj and the
// residual, RMSNorm, gate/up, silu * up, down_proj and the residual. The same kernels the eager layer calls
// (ops.h), in the same order on the same values, so the result is bit-identical to it; what goes is the
// Python between them: at batch 1 that was ~6 ms of a ~19 ms step for SmolLM2's 30 layers (~12 ops each).
//
// weights: WEIGHTS_PER_LAYER tensors per layer, in order
//   input norm, qkv weight, qkv consts, qkv bias, o weight, o consts, o bias,
//   post-attention norm, gate_up weight, gate_up consts, down weight, down consts.
// Activations are float32 or bfloat16 (x's dtype; the norms' weights too). A projection's weight is 4-bit
// codes (float32: int32 lane words with float32 consts, q4_linear; or uint8 nibbles with float32 consts, for
// activations rounded to int8, q4_linear_q8; bfloat16: torch's packed int4 layout, uint8, with bfloat16 scales
// and zeros, _weight_int4pack_mm_for_cpu, as QuantLinear calls it) or a dense (N, K) matrix of x's dtype
// (consts empty), plain or reordered once for oneDNN (an MKLDNN tensor, packed_linear.py); an empty bias means
// none. Caches: k_cache, v_cache (rows, blocks, block_size, Hkv, D); layer i writes and reads block
// row layer_rows[i]. slots (B,) int64 are the new tokens' slots in a row; tables, starts and ends are
// paged_decode's (one query row per sequence). A cache whose layers hold different slots (compressed: one KV
// group per layer) passes them per layer instead: slots (L, B), tables (L, B, W), starts and ends (L, B). With
// want_weights the second output holds each layer's attention probabilities as paged_decode returns them,
// (L, B, W * block_size) (else it is empty): what the cache's policy scores its slots by.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"

namespace {

constexpr int64_t WEIGHTS_PER_LAYER = 12;
constexpr int64_t INT4_GROUP = 32;  // torch's packed int4 layout: group size of the scales and zeros

enum class Kind { Q4, Q4Q8, Int4Pack, Dense, OneDNN };

Kind kind_of(const at::Tensor& weight, const at::Tensor& consts) {
  if (weight.is_mkldnn()) return Kind::OneDNN;
  if (weight.scalar_type() == at::kInt) return Kind::Q4;
  if (weight.scalar_type() == at::kByte) return consts.scalar_type() == at::kFloat ? Kind::Q4Q8 : Kind::Int4Pack;
  return Kind::Dense;
}

// packed_linear's call for a weight reordered for oneDNN (rows at their own count: the chain takes no more rows
// than packed_linear runs unpadded).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}

// y = x W^T (+ b) as QuantLinear / Linear compute it: the bias after the product on codes, inside F.linear
// (or oneDNN's call) for a dense weight.
at::Tensor project(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& consts, const at::Tensor& bias) {
  const bool has_bias = bias.defined() && bias.numel();
  at::Tensor y;
  switch (kind_of(weight, consts)) {
    case Kind::OneDNN: return onednn_linear(x, weight, has_bias ? std::optional<at::Tensor>(bias) : std::nullopt);
    case Kind::Q4: y = kvserve_ops::q4_linear(x, weight, consts); break;
    case Kind::Q4Q8: y = kvserve_ops::q4_linear_q8(x, weight, consts); break;
    case Kind::Int4Pack: y = at::_weight_int4pack_mm_for_cpu(x, weight, INT4_GROUP, consts); break;
    case Kind::Dense: return has_bias ? at::linear(x, weight, bias) : at::linear(x, weight);
  }
  return has_bias ? y.add_(bias) : y;
}

void check_projection(const at::Tensor* w, int64_t in, at::ScalarType dtype, const char* name) {
  const at::Tensor& weight = w[0];
  TORCH_CHECK(weight.dim() == 2, "decode_layers: the ", name, " weight must be 2-D, got ", weight.sizes());
  const Kind kind = kind_of(weight, w[1]);
  const bool float32_codes = kind == Kind::Q4 || kind == Kind::Q4Q8;
  TORCH_CHECK(!float32_codes || dtype == at::kFloat, "decode_layers: the ", name, " weight's codes take float32 x");
  TORCH_CHECK(kind != Kind::Int4Pack || (dtype != at::kFloat && w[1].scalar_type() == dtype),
              "decode_layers: the ", name, " weight's packed int4 codes take x of their scales' dtype ",
              w[1].scalar_type());
  if (kind != Kind::Dense && kind != Kind::OneDNN) return;  // the kernels check codes
  TORCH_CHECK(weight.scalar_type() == dtype && weight.size(1) == in, "decode_layers: the dense ", name,
              " weight must be ", dtype, " (N, ", in, "), got ", weight.scalar_type(), " ", weight.sizes());
}

// Layer `layer`'s view of a per-step tensor given either once for every layer or per layer (a leading L dim).
at::Tensor of_layer(const at::Tensor& t, int64_t per_layer_dims, int64_t layer) {
  return t.dim() == per_layer_dims + 1 ? t.select(0, layer) : t;
}

std::tuple<at::Tensor, at::Tensor> decode_layers(const at::Tensor& x_in, at::TensorList weights,
                                                 at::IntArrayRef layer_rows, at::Tensor k_cache, at::Tensor v_cache,
                                                 const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                                                 const at::Tensor& tables, const at::Tensor& starts,
                                                 const at::Tensor& ends, int64_t num_heads, int64_t num_kv_heads,
                                                 double eps, bool want_weights) {
  const int64_t layers = static_cast<int64_t>(layer_rows.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * WEIGHTS_PER_LAYER, "decode_layers: ",
              weights.size(), " weights for ", layers, " layers; need ", WEIGHTS_PER_LAYER, " per layer");
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK(x_in.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16),
              "decode_layers: x must be (B, hidden) float32 or bfloat16");
  const auto kv_type = k_cache.scalar_type();  // float32, or a narrower cache (bfloat16, float16)
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && v_cache.scalar_type() == kv_type &&
                  (kv_type == at::kFloat || kv_type == at::kBFloat16 || kv_type == at::kHalf),
              "decode_layers: k_cache and v_cache must be contiguous float32, bfloat16 or float16 (rows, blocks, "
              "block_size, Hkv, D) of one dtype");
  TORCH_CHECK(k_cache.size(3) == num_kv_heads && num_heads % num_kv_heads == 0, "decode_layers: ", num_heads,
              " query heads over ", k_cache.size(3), " cached KV heads (", num_kv_heads, " given)");
  const int64_t n = x_in.size(0), hidden = x_in.size(1), dim = k_cache.size(4);
  const int64_t q_size = num_heads * dim, kv_size = num_kv_heads * dim;
  const bool per_layer = tables.dim() == 3;
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.is_contiguous() && (tables.dim() == 2 || per_layer),
              "decode_layers: tables must be contiguous int32 (B, W), or (L, B, W) per layer");
  const std::vector<int64_t> rows_shape = per_layer ? std::vector<int64_t>{layers, n} : std::vector<int64_t>{n};
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.sizes() == at::IntArrayRef(rows_shape) &&
                  starts.sizes() == slots.sizes() && ends.sizes() == slots.sizes() &&
                  (!per_layer || tables.size(0) == layers),
              "decode_layers: slots (int64), starts and ends must be (", per_layer ? "L, B" : "B", ") = ",
              at::IntArrayRef(rows_shape), " to match tables ", tables.sizes());
  for (int64_t layer = 0; layer < layers; ++layer) {
    TORCH_CHECK(0 <= layer_rows[layer] && layer_rows[layer] < k_cache.size(0), "decode_layers: layer ", layer,
                " names cache row ", layer_rows[layer], " of ", k_cache.size(0));
    const at::Tensor* w = weights.data() + layer * WEIGHTS_PER_LAYER;
    TORCH_CHECK(w[0].scalar_type() == dtype && w[7].scalar_type() == dtype, "decode_layers: layer ", layer,
                "'s norm weights must be ", dtype, " as x");
    check_projection(w + 1, hidden, dtype, "qkv");
    check_projection(w + 4, q_size, dtype, "o");
    check_projection(w + 8, hidden, dtype, "gate_up");
    TORCH_CHECK(w[1].size(0) == q_size + 2 * kv_size && w[4].size(0) == hidden && w[8].size(0) % 2 == 0,
                "decode_layers: layer ", layer, "'s projections have ", w[1].size(0), ", ", w[4].size(0), " and ",
                w[8].size(0), " outputs for ", num_heads, " heads, ", num_kv_heads, " KV heads of ", dim,
                " and hidden ", hidden);
    check_projection(w + 10, w[8].size(0) / 2, dtype, "down");
  }

  at::Tensor x = x_in;
  std::vector<at::Tensor> layer_weights;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor slots_l = of_layer(slots, 1, layer), tables_l = of_layer(tables, 2, layer);
    const at::Tensor* w = weights.data() + layer * WEIGHTS_PER_LAYER;
    const at::Tensor qkv = project(kvserve_ops::rms_norm(x, w[0], eps), w[1], w[2], w[3]);  // (B, q | k | v)
    kvserve_ops::rope_(qkv.narrow(1, 0, q_size + kv_size).view({n, num_heads + num_kv_heads, dim}), cos, sin);
    const at::Tensor k_rows = k_cache.select(0, layer_rows[layer]), v_rows = v_cache.select(0, layer_rows[layer]);
    const at::Tensor k_new = qkv.narrow(1, q_size, kv_size).view({n, num_kv_heads, dim}).to(kv_type);
    const at::Tensor v_new = qkv.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads, dim}).to(kv_type);
    k_rows.view({-1, num_kv_heads, dim}).index_copy_(0, slots_l, k_new);
    v_rows.view({-1, num_kv_heads, dim}).index_copy_(0, slots_l, v_new);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({n, num_heads, dim}).contiguous();
    auto [attn, lse, probs] =
        kvserve_ops::paged_decode(q, k_rows, v_rows, tables_l, of_layer(starts, 1, layer), of_layer(ends, 1, layer),
                                  1.0 / std::sqrt(static_cast<double>(dim)), want_weights);
    if (want_weights) layer_weights.push_back(probs);
    x = x + project(attn.view({n, q_size}), w[4], w[5], w[6]);
    const at::Tensor gate_up = project(kvserve_ops::rms_norm(x, w[7], eps), w[8], w[9], at::Tensor());
    x = x + project(kvserve_ops::silu_mul(gate_up, gate_up.size(1) / 2), w[10], w[11], at::Tensor());
  }
  return {x, want_weights ? at::stack(layer_weights) : at::empty({0}, x.options())};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def(
      "decode_layers(Tensor x, Tensor[] weights, int[] layer_rows, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor cos, Tensor sin, Tensor slots, Tensor tables, Tensor starts, Tensor ends, int num_heads, "
      "int num_kv_heads, float eps, bool want_weights=False) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("decode_layers", &decode_layers); }

// Weights reordered for oneDNN are MKLDNN tensors, whose dispatch key outranks CPU's.
TORCH_LIBRARY_IMPL(kvserve, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
