// The triangle multiplication's op entry points, which the per-module node (modules/triangle_node_bindings.cpp)
// calls as the op does; defined in triangle_bindings.cpp, whose header comment gives their shapes.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace evoformer {
namespace block {

// The parameters of the triangle op, in the schema's order: layer norm in (weight, bias), the
// stacked a/b projections and gates (weight [4 c, c_z], bias), the output gate (weight, bias), layer
// norm out (weight, bias), the output projection (weight [c_z, c], bias).
enum TriangleWeight { kNormInW, kNormInB, kProjW, kProjB, kGateW, kGateB, kNormOutW, kNormOutB, kOutW, kOutB, kWeights };

// (out, then the 12 tensors the backward reads: mean_in, rstd_in, a, b, n_hat, rstd_out, g, w_ab, b_ab,
// w_g, w_z, b_z)
using TriangleForward = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                   at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The op triangle_multiplication_fwd.
TriangleForward triangle_multiplication_fwd(const at::Tensor& z, const std::optional<at::Tensor>& mask,
                                            at::TensorList weights, double eps, bool outgoing,
                                            const std::string& family, bool for_backward, bool add_input,
                                            const std::optional<at::Tensor>& update_scale);

// The op triangle_multiplication_bwd: [dz, one gradient per weight].
std::vector<at::Tensor> triangle_multiplication_bwd(const at::Tensor& dout, const at::Tensor& z,
                                                    const std::optional<at::Tensor>& mask, at::TensorList weights,
                                                    at::TensorList saved, double eps, bool outgoing,
                                                    const std::optional<at::Tensor>& dz_add,
                                                    const std::string& family);

}  // namespace block
}  // namespace evoformer
