// The outer product mean's op entry points, which the per-module node (modules/opm_node_bindings.cpp)
// calls as the module's Python path does; defined in opm_bindings.cpp, whose header comment gives their
// shapes.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace evoformer {
namespace block {

// The op opm_project: linear_out on the [B, I, C, J, C] outer product as it lies (divided by denom and
// added to residual where given), on the tile GEMM of kernel family `family` ("sm80" or "sm90").
at::Tensor opm_project(const at::Tensor& outer, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in,
                       const std::optional<at::Tensor>& denom_in, const std::optional<at::Tensor>& residual_in,
                       const std::string& family);

// The op opm_project_input_grad: the gradient of the outer product from dout [B, I, J, Z] (family: as
// opm_project's).
at::Tensor opm_project_input_grad(const at::Tensor& dout, const at::Tensor& weight_in, const std::string& family);

// The op opm_project_weight_grad: the weight's gradient [Z, C C] in weight_dtype.
at::Tensor opm_project_weight_grad(const at::Tensor& dout, const at::Tensor& outer, at::ScalarType weight_dtype);

}  // namespace block
}  // namespace evoformer
