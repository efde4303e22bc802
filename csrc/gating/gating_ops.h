// The gating family's host entry points that other families' bindings call (the gated attention's
// gate, the triangle multiplication's bias sums, the per-module nodes' projections); defined in
// gating_bindings.cpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace evoformer {
namespace block {

// The op column_sum: the float32 sum over the rows of x [..., C] (whole 16-byte chunks per row),
// added in a fixed order and rounded to dtype (a float type).
at::Tensor column_sum(const at::Tensor& x_in, at::ScalarType dtype);

// The gate kernels' entry points that the gated attention (attention_bindings.cpp) composes with the
// attention kernels: the ops sigmoid_gate_fwd and sigmoid_gate_bwd_into.
at::Tensor sigmoid_gate_forward(const at::Tensor& g, const at::Tensor& y);
std::tuple<at::Tensor, at::Tensor> sigmoid_gate_backward_into(const at::Tensor& dout, const at::Tensor& g,
                                                              const at::Tensor& y, at::Tensor& dg,
                                                              int64_t delta_heads, int64_t delta_len);

// out = x * s, x / s (divide) or *residual + x * s, one scale per row: x, out, *residual [..., C], s
// [...]; at::mul, at::div and at::addcmul's values on s broadcast over C, bit for bit (those ATen calls
// where the row kernel does not take the layouts or dtypes). row_scaled: into a new contiguous tensor
// (the op row_scale).
at::Tensor& row_scale_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& s, const at::Tensor* residual,
                           bool divide);
at::Tensor row_scaled(const at::Tensor& x, const at::Tensor& s, const at::Tensor* residual, bool divide);

// The op linear_bwd: (dx, dweight, dbias) of x . weight^T + bias (then ReLU, relu_out its output) from
// dy, each a new [0] tensor unless wanted; the bias over the columns from bias_from on.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_bwd(const at::Tensor& dy_in, const at::Tensor& x,
                                                          const at::Tensor& weight,
                                                          const std::optional<at::Tensor>& relu_out, bool need_dx,
                                                          bool need_dw, bool need_db, at::ScalarType bias_dtype,
                                                          int64_t bias_from);

}  // namespace block
}  // namespace evoformer
