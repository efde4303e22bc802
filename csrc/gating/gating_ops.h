// The gating family's host entry points that other families' bindings call (the gated attention's
// gate, the triangle multiplication's bias sums); defined in gating_bindings.cpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
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

}  // namespace block
}  // namespace evoformer
