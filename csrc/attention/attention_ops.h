// The attention family's host entry points that other families' bindings call (the per-module
// autograd nodes, csrc/modules/); defined in attention_bindings.cpp, where the ops
// gated_attention_fwd and gated_attention_bwd register them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

namespace evoformer {

// The op gated_attention_fwd: (y = sigmoid(g) * attention [B, A, A', H D], out, stats, mask_prepared,
// pair_prepared) of a stacked projection qkvg [B, A, A', 4 H D].
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_attention_fwd(
    const at::Tensor& qkvg, const std::optional<at::Tensor>& mask_bias, const std::optional<at::Tensor>& pair_bias,
    int64_t heads, bool transposed, double scale, const std::string& family);

// The op gated_attention_bwd: (d qkvg [B, A, A', 4 H D] contiguous, d mask_bias, d pair_bias).
std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_attention_bwd(
    const at::Tensor& dy, const at::Tensor& qkvg, const at::Tensor& out, const at::Tensor& stats,
    const at::Tensor& mask_prepared, const std::optional<at::Tensor>& pair_bias, const at::Tensor& pair_prepared,
    int64_t heads, bool transposed, double scale, const std::string& family,
    std::optional<at::ScalarType> dmask_dtype, bool need_dpair);

}  // namespace evoformer
