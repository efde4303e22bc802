// AF2's outer product mean as a per-module node (what a node is: modules_bindings.cpp's header): after
// the module's layer norm, the two projections as one GEMM, the mask, the outer product's batched GEMM
// and linear_out as the fused projection with the mean's division and the residual add in its
// epilogue, as ONE autograd node whose backward runs in C++. The module's Python path
// (evoformer_blocks/outer_product_mean.py: OuterProductMean._normalized) records six nodes for these
// steps (the stacked projection, the unbind, two mask multiplies, the outer product, the projection)
// and its backward runs two of them in Python. The same ATen calls and extension entry points with
// the same arguments as that path on the cutlass backend, but for the masks' multiplies and the mean's
// division, which the row kernel (gating_ops.h's row_scaled) runs with at::mul's and at::div's values,
// 16 bytes per access where ATen's broadcast kernels take two: results and gradients are equal bit for bit
// (tests/test_module_nodes_cuda.py). evoformer_blocks/ops/module_nodes.py decides when the node may run
// (the fused projection and the column-sum kernels selected, one dtype, no autocast, not compiling).
//
// Op (namespace evoformer_blocks_cuda, declared in evoformer_blocks/ops/_fused.py), composite (it
// records its node where autograd needs one):
//   outer_product_mean_module(Tensor m, Tensor mask, Tensor? residual, Tensor w_1, Tensor b_1, Tensor w_2,
//       Tensor b_2, Tensor w_out, Tensor? b_out, float eps, str family) -> Tensor
//     m [*, S, R, c_m] (normalised), mask [*, S, R] (0/1, m's dtype), residual [*, R, R, c_z]
//     (contiguous) or None; OpenFold's linear_1, linear_2 ([c, c_m], c the kernels' c_hidden) and
//     linear_out ([c_z, c c]). a, b = (m W_1^T + b_1) * mask, (m W_2^T + b_2) * mask; returns
//     residual + linear_out(sum_s a[s, i] (x) b[s, j]) / (eps + sum_s mask[s, i] mask[s, j]) (without
//     the residual where None). family ("sm80" or "sm90"): the tile GEMMs' kernels (opm_project's), forward
//     and backward.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/bindings_common.h"
#include "gating/gating_ops.h"
#include "modules/nodes.h"
#include "outer_product_mean/opm_ops.h"

namespace evoformer {
namespace modules {
namespace {

EVO_OP_HANDLE(opm_project_op, "opm_project", block::opm_project)
EVO_OP_HANDLE(opm_input_grad_op, "opm_project_input_grad", block::opm_project_input_grad)
EVO_OP_HANDLE(opm_weight_grad_op, "opm_project_weight_grad", block::opm_project_weight_grad)

// Positions of the forward's arguments (after ctx): autograd wants one gradient per argument.
enum Input : int { kM, kMask, kResidual, kW1, kB1, kW2, kB2, kWout, kBout, kEps, kFamily, kInputs };
// Positions of the saved tensors.
// (sStacked: the stacked projection's weight where it is a copy; else, a view of w_1 and w_2
// (stacked_rows), those two at sW1 and sW1 + 1)
enum Saved : int { sM, sMask, sStacked, sA, sB, sOuter, sDenom, sWout, sW1 };

struct OuterProductMeanNode : public torch::autograd::Function<OuterProductMeanNode> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& m, const at::Tensor& mask,
                            const OptionalTensor& residual, const at::Tensor& w_1, const at::Tensor& b_1,
                            const at::Tensor& w_2, const at::Tensor& b_2, const at::Tensor& w_out,
                            const OptionalTensor& b_out, double eps, const std::string& family) {
    EVO_CHECK(m.dim() >= 3 && mask.dim() == m.dim() - 1 && w_1.dim() == 2 && w_1.sizes() == w_2.sizes() &&
                  w_1.size(1) == m.size(-1) && w_out.dim() == 2 && w_out.size(1) == w_1.size(0) * w_1.size(0),
              "outer product mean module: `m` [*, S, R, c_m], `mask` [*, S, R], `w_1`, `w_2` [c, c_m] and `w_out` "
              "[c_z, c c] do not fit: ",
              m.sizes(), ", ", mask.sizes(), ", ", w_1.sizes(), ", ", w_2.sizes(), ", ", w_out.sizes());
    EVO_CHECK(m.numel() > 0 && mask.sizes() == m.sizes().slice(0, m.dim() - 1),
              "outer product mean module: `m` must be non-empty and `mask` its shape without c_m, got ", m.sizes(),
              ", ", mask.sizes());
    const int64_t c = w_1.size(0), seqs = m.size(-3), res = m.size(-2), c_z = w_out.size(0);
    const int64_t batch = m.numel() / (seqs * res * m.size(-1));
    // the two projections side by side (primitives.stacked_projection), each half masked into a
    // contiguous tensor
    bool stacked_view = false;
    const at::Tensor stacked = stacked_rows({w_1, w_2}, &stacked_view);  // [2 c, c_m]
    const at::Tensor ab = linear_rows(m, stacked, stacked_rows({b_1, b_2}));  // [*, S, R, 2 c]
    // (each half a view of its columns of ab, masked by the row kernel: at::mul's values)
    const int64_t last = ab.dim() - 1;
    const at::Tensor a = block::row_scaled(raw_narrow(ab, last, 0, c), mask, nullptr, false);  // [*, S, R, c]
    const at::Tensor b = block::row_scaled(raw_narrow(ab, last, c, c), mask, nullptr, false);  // [*, S, R, c]
    // the mean's denominator eps + (pairs of residues both unmasked in a sequence: a GEMM over the
    // sequences, rows_bmm as the composed path's _pair_counts)
    const at::Tensor mask3 = reshaped(mask, {batch, seqs, res});  // [B, S, R]
    const at::Tensor denom = at::add(rows_bmm(raw_transpose(mask3), mask3), eps);  // [B, R, R]
    EVO_CHECK(denom.is_contiguous(), "outer product mean module: the mask's pair counts are not contiguous");
    // the outer products summed over the sequences: one batched GEMM, [i, c, j, e] in memory
    const at::Tensor a3 = reshaped(a, {batch, seqs, res * c}), b3 = reshaped(b, {batch, seqs, res * c});
    const at::Tensor outer = raw_reshape(rows_bmm(raw_transpose(a3), b3), {batch, res, c, res, c});
    const at::Tensor d = raw_reshape(denom, {batch, res, res});  // [B, R, R]
    OptionalTensor r;
    if (residual.has_value()) r = reshaped(*residual, {batch, res, res, c_z});  // [B, R, R, c_z]
    const at::Tensor out = opm_project_op().call(outer, w_out, b_out, d, r, family);  // [B, R, R, c_z]

    ctx->save_for_backward({m, mask, stacked_view ? at::Tensor() : stacked, a3, b3, outer, d, w_out,
                            stacked_view ? w_1 : at::Tensor(), stacked_view ? w_2 : at::Tensor()});  // Saved order
    save_edges(ctx, {true, true, given(residual), true, true, true, true, true, given(b_out)}, kInputs);  // Input order
    ctx->saved_data["bias_dtype"] = b_1.scalar_type();
    ctx->saved_data["family"] = family;
    ctx->saved_data["b_out_dtype"] = b_out.has_value() ? b_out->scalar_type() : w_out.scalar_type();
    if (residual.has_value()) ctx->saved_data["residual_sizes"] = residual->sizes().vec();
    std::vector<int64_t> sizes(m.sizes().begin(), m.sizes().end() - 3);
    sizes.insert(sizes.end(), {res, res, c_z});
    return raw_reshape(out, sizes);  // [*, R, R, c_z]
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &m = saved[sM], &mask = saved[sMask], &a3 = saved[sA];
    const at::Tensor stacked =
        saved[sStacked].defined() ? saved[sStacked] : stacked_rows({saved[sW1], saved[sW1 + 1]});  // [2 c, c_m]
    const at::Tensor &b3 = saved[sB], &outer = saved[sOuter], &d = saved[sDenom], &w_out = saved[sWout];
    const auto& data = ctx->saved_data;
    const Needs need(ctx);
    variable_list result(kInputs);

    // linear_out's backward (_OuterProjection's): the residual's gradient is the output's; the
    // projection's is dout / denom
    const int64_t batch = outer.size(0), res = outer.size(1), c = outer.size(2);
    const at::Tensor dout = reshaped(grads[0], {batch, res, res, w_out.size(0)});  // [B, R, R, c_z]
    if (need(kResidual)) result[kResidual] = reshaped(dout, data.at("residual_sizes").toIntVector());
    const at::Tensor dout_div = block::row_scaled(dout, d, nullptr, true);  // [B, R, R, c_z] (at::div's values)
    if (need(kWout)) result[kWout] = opm_weight_grad_op().call(dout_div, outer, w_out.scalar_type());
    if (need(kBout)) result[kBout] = block::column_sum(dout_div, data.at("b_out_dtype").toScalarType());
    const bool need_weights = need(kW1) || need(kW2), need_biases = need(kB1) || need(kB2);
    if (!(need(kM) || need_weights || need_biases)) return result;

    // the outer product's (_OuterProduct's), then the masks' and the unbind's: each masked half written
    // into its columns of one [*, S, R, 2 c] gradient (the values unbind's backward stacks)
    const at::Tensor d_outer = raw_reshape(opm_input_grad_op().call(dout_div, w_out, data.at("family").toStringRef()), {batch, res * c, res * c});
    std::vector<int64_t> half_sizes(m.sizes().begin(), m.sizes().end());
    half_sizes.back() = c;  // [*, S, R, c]
    std::vector<int64_t> ab_sizes = half_sizes;
    ab_sizes.back() = 2 * c;  // [*, S, R, 2 c]
    const at::Tensor d_ab = new_empty(ab_sizes, m.options());
    for (int64_t i = 0; i < 2; ++i) {  // da = b (d o)^T, then db = a (d o): [B, S, R c]
      const at::Tensor product = i == 0 ? rows_bmm(b3, raw_transpose(d_outer)) : rows_bmm(a3, d_outer);
      at::Tensor half = raw_narrow(d_ab, d_ab.dim() - 1, i * c, c);  // [*, S, R, c]
      block::row_scale_into(half, raw_reshape(product, half_sizes), mask, nullptr, false);  // (at::mul_out's values)
    }

    // the stacked projection's (linear_bwd: the bias sums from the first bias wanted on, then the GEMMs)
    const int64_t bias_from = need(kB1) || !need_biases ? 0 : c;  // (the first column whose sum is wanted)
    auto [dm, dw, sums] = block::linear_bwd(d_ab, m, stacked, std::nullopt, need(kM), need_weights, need_biases,
                                            data.at("bias_dtype").toScalarType(), bias_from);
    if (need(kM)) result[kM] = dm;
    if (need(kW1)) result[kW1] = raw_narrow(dw, 0, 0, c);  // [c, c_m] row blocks of [2 c, c_m]
    if (need(kW2)) result[kW2] = raw_narrow(dw, 0, c, c);
    if (need(kB1)) result[kB1] = raw_narrow(sums, 0, 0, c);
    if (need(kB2)) result[kB2] = raw_narrow(sums, 0, sums.size(0) - c, c);
    return result;
  }
};

at::Tensor outer_product_mean_module(const at::Tensor& m, const at::Tensor& mask, const OptionalTensor& residual,
                                     const at::Tensor& w_1, const at::Tensor& b_1, const at::Tensor& w_2,
                                     const at::Tensor& b_2, const at::Tensor& w_out, const OptionalTensor& b_out,
                                     double eps, const std::string& family) {
  return OuterProductMeanNode::apply(m, mask, residual, w_1, b_1, w_2, b_2, w_out, b_out, eps, family);
}

}  // namespace
}  // namespace modules
}  // namespace evoformer

// (schema: evoformer_blocks/ops/_fused.py) One kernel for every dispatch key: the node records itself
// where autograd needs it.
TORCH_LIBRARY_IMPL(evoformer_blocks_cuda, CompositeImplicitAutograd, m) {
  m.impl("outer_product_mean_module", &evoformer::modules::outer_product_mean_module);
}
