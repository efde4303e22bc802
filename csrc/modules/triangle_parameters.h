// What the triangle multiplication's node (triangle_node_bindings.cpp) and the Evoformer block's op
// (block_node_bindings.cpp) share: the module's parameters as the node ops take them.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "common/bindings_common.h"
#include "modules/nodes.h"

namespace evoformer {
namespace modules {

// A triangle multiplication's sixteen parameters in its node ops' argument order
// (triangle_node_bindings.cpp; the block's op passes its modules' the same way).
struct TriangleParameters {
  at::Tensor norm_in_w, norm_in_b, w_ap, w_ag, w_bp, w_bg;
  OptionalTensor b_ap, b_ag, b_bp, b_bg;
  at::Tensor w_g;
  OptionalTensor b_g;
  at::Tensor norm_out_w, norm_out_b, w_z;
  OptionalTensor b_z;

  // The op's ten weights (block::TriangleWeight order) as the Python path passes them: the input
  // projections stacked [4 c, c_z] (and their biases [4 c]; stacked_rows: views where the module
  // keeps them back to back), absent biases as zeros of their weight's dtype
  // (primitives.bias_or_zeros), each contiguous (_fused.kernel_parameter). `views`, where given,
  // says whether the weights' and the biases' stacks are views (no biases: false).
  std::vector<at::Tensor> kernel_weights(bool (*views)[2] = nullptr) const {
    bool stacked[2] = {false, false};
    const at::Tensor proj = stacked_rows({w_ap, w_ag, w_bp, w_bg}, &stacked[0]);  // [4 c, c_z]
    const at::Tensor proj_bias = given(b_ap) ? stacked_rows({*b_ap, *b_ag, *b_bp, *b_bg}, &stacked[1])  // [4 c]
                                             : cached_zeros(proj.size(0), proj.options());
    if (views != nullptr) (*views)[0] = stacked[0], (*views)[1] = stacked[1];
    const at::Tensor gate_bias = given(b_g) ? b_g->contiguous() : cached_zeros(w_g.size(0), w_g.options());
    const at::Tensor out_bias = given(b_z) ? b_z->contiguous() : cached_zeros(w_z.size(0), w_z.options());
    return {norm_in_w.contiguous(), norm_in_b.contiguous(), proj, proj_bias, w_g.contiguous(), gate_bias,
            norm_out_w.contiguous(), norm_out_b.contiguous(), w_z.contiguous(), out_bias};
  }

  // The input projections' weights, then their biases (absent ones undefined): what stacked_rows
  // stacks for kernel_weights' kProjW and kProjB.
  std::vector<at::Tensor> projections() const {
    return {w_ap, w_ag, w_bp, w_bg, value_or_undefined(b_ap), value_or_undefined(b_ag), value_or_undefined(b_bp),
            value_or_undefined(b_bg)};
  }

  bool any_requires_grad() const {
    for (const at::Tensor* t : {&norm_in_w, &norm_in_b, &w_ap, &w_ag, &w_bp, &w_bg, &w_g, &norm_out_w, &norm_out_b, &w_z})
      if (t->requires_grad()) return true;
    for (const OptionalTensor* t : {&b_ap, &b_ag, &b_bp, &b_bg, &b_g, &b_z})
      if (given(*t) && (*t)->requires_grad()) return true;
    return false;
  }
};

}  // namespace modules
}  // namespace evoformer
