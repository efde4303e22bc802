// The layer-norm family's host entry points that other families' bindings call (the triangle
// multiplication normalises its input, and takes that norm's backward, through them); defined in
// layer_norm_bindings.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "common/block_params.h"

namespace evoformer {
namespace block {

// y = layer_norm(rows of x) [M, C] and its statistics (mean, rstd [M]); weight and bias as the
// kernels read them (kNoParam: none). x must have C % (16 bytes / element) == 0 (the op routes others
// to eager). With `residual` (x's shape and dtype), of the rows of x + residual instead (x + (residual
// + residual_bias) * residual_scale with a scale broadcasting to x and a bias [C] of x's dtype), whose
// sum is written to `sum` (a new [M, C] tensor).
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_rows(const at::Tensor& x, ParamTensor weight, ParamTensor bias,
                                                         double eps, const at::Tensor* residual = nullptr,
                                                         at::Tensor* sum = nullptr,
                                                         const std::optional<at::Tensor>& residual_scale = {},
                                                         ParamTensor residual_bias = {nullptr, kParamFloat});

// norm_rows' backward: dx [M, C] (plus *dsum_in where given: another gradient of x) and, when
// affine_grad, the float32 sums over rows of dy * x_hat and of dy as one [2, C] tensor in
// affine_dtype (else [0]); with residual_scale (broadcasting to x_in), also dresidual = dx *
// residual_scale ([M, C]; else undefined); with residual_bias_dtype, the residual's gradient summed over
// rows, [C] in that dtype (else undefined).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_rows_backward(
    const at::Tensor& dy_in, const at::Tensor& x_in, ParamTensor weight, const at::Tensor& mean,
    const at::Tensor& rstd, bool affine_grad, at::ScalarType affine_dtype = at::kFloat,
    const at::Tensor* dsum_in = nullptr, const std::optional<at::Tensor>& residual_scale = {},
    std::optional<at::ScalarType> residual_bias_dtype = std::nullopt);

// The ops layer_norm_fwd, add_layer_norm_fwd and add_layer_norm_bwd (schemas: evoformer_blocks/ops/_fused.py;
// the layer-norm nodes of csrc/modules call them through the dispatcher, typed by these declarations).
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                                              const std::optional<at::Tensor>& bias, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_fwd(
    const at::Tensor& x, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, const std::optional<at::Tensor>& residual_scale,
    const std::optional<at::Tensor>& residual_bias);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_bwd(
    const at::Tensor& dsum, const at::Tensor& dy, const at::Tensor& sum, const std::optional<at::Tensor>& weight,
    const at::Tensor& mean, const at::Tensor& rstd, bool need_affine, at::ScalarType affine_dtype,
    const std::optional<at::Tensor>& residual_scale, std::optional<at::ScalarType> residual_bias_dtype);

}  // namespace block
}  // namespace evoformer
