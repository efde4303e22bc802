// The triangle multiplicative update's per-module node (what a node is: modules_bindings.cpp's header):
// the module's four input projections stacked, its absent biases as zeros, and the op's fused forward
// and backward (triangle_multiplication_fwd / _bwd) as ONE autograd node whose backward runs in C++,
// where the op's Python path (evoformer_blocks/ops/triangle.py) concatenates the weights with autograd
// recording the concatenation, validates, selects the backend and records a Python-level node. The
// same extension calls with the same arguments as that path on the cutlass backend: results and
// gradients are equal bit for bit (tests/test_module_nodes_cuda.py). evoformer_blocks/ops/module_nodes.py
// decides when the node may run (the cutlass backend selected, contiguous z, no autocast, not
// compiling, no recompute policy keeping the op's outputs).
//
// Ops (namespace evoformer_blocks_cuda, declared in evoformer_blocks/ops/_fused.py), composite (each
// records its node where autograd needs one):
//   triangle_multiplication_module(Tensor z, Tensor? mask, Tensor norm_in_weight, Tensor norm_in_bias,
//       Tensor w_a_p, Tensor w_a_g, Tensor w_b_p, Tensor w_b_g, Tensor? b_a_p, Tensor? b_a_g, Tensor? b_b_p,
//       Tensor? b_b_g, Tensor w_g, Tensor? b_g, Tensor norm_out_weight, Tensor norm_out_bias, Tensor w_z,
//       Tensor? b_z, float eps, bool outgoing, str family, bool add_input, Tensor? update_scale) -> Tensor
//     z [*, N, N, c_z] (contiguous), mask [*, N, N]; the weights as the module holds them (OpenFold's
//     linear_a_p, linear_a_g, linear_b_p, linear_b_g, linear_g, linear_z and the two layer norms; the
//     four input biases all given or none). Returns the update (ops.triangle_multiplication), or with
//     add_input z + update (* update_scale, [*, 1, N, c_z]: one row shared by every row i; the kernels
//     add z as they write; ops.triangle_multiplication_residual).
//   triangle_multiplication_keeping_input_module(Tensor(a) z, ... the same arguments up to family)
//       -> (Tensor(a), Tensor)
//     (z itself, the update) (ops.triangle_multiplication_keeping_input): the backward adds the
//     returned z's gradient to the op's input gradient in the kernels' last pass.
// Without gradients to record, the forward runs as the op's does then: without what only the backward
// reads (for_backward=false), and no node.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/bindings_common.h"
#include "modules/nodes.h"
#include "modules/triangle_parameters.h"
#include "triangle_multiplication/triangle_ops.h"

namespace evoformer {
namespace modules {
namespace {

EVO_OP_HANDLE(triangle_forward_op, "triangle_multiplication_fwd", block::triangle_multiplication_fwd)
EVO_OP_HANDLE(triangle_backward_op, "triangle_multiplication_bwd", block::triangle_multiplication_bwd)

// Positions of the node's arguments (after ctx): autograd wants one gradient per argument.
enum Input : int {
  kZ, kMask, kNormInW, kNormInB, kWap, kWag, kWbp, kWbg, kBap, kBag, kBbp, kBbg, kWg, kBg, kNormOutW, kNormOutB, kWz,
  kBz, kEps, kOutgoing, kFamily, kMode, kScale, kInputs
};
// What the node returns: the update; (z, the update); z + the update (* scale).
enum Mode : int64_t { kPlain = 0, kKeep = 1, kAdd = 2 };
// Saved tensors: z, the flat mask, the op's ten weights (block::TriangleWeight order; the stacked
// projections undefined where they are views of the parameters), the forward's twelve tensors for
// the backward, the flat scale, then at kSavedParts the parameters of the stacks that are views
// (the four weights, then the four biases; undefined otherwise).
constexpr int kSavedWeights = 2, kSavedForward = kSavedWeights + block::kWeights, kSavedScale = kSavedForward + 12,
              kSavedParts = kSavedScale + 1;

// z [*, N, N, c_z] as [B, N, N, c_z] (z is contiguous: a view).
at::Tensor flat_z(const at::Tensor& z) {
  const int64_t n = z.size(-2), c_z = z.size(-1);
  return z.dim() == 4 ? z : raw_reshape(z, {z.numel() / (n * n * c_z), n, n, c_z});
}

// The mask [*, N, N] as [B, N, N] (a view where its strides allow one).
OptionalTensor flat_mask(const OptionalTensor& mask) {
  if (!given(mask)) return std::nullopt;
  const int64_t n = mask->size(-1);
  return reshaped(*mask, {mask->numel() / (n * n), n, n});
}

// update_scale [*, 1, N, c_z] (at most z's dims) as the kernels take it: [B, 1, N, c_z], contiguous
// (ops.triangle's _row_scale: the same calls).
OptionalTensor row_scale(const OptionalTensor& update_scale, const at::Tensor& z) {
  if (!given(update_scale)) return std::nullopt;
  EVO_CHECK(update_scale->dim() <= z.dim(), "triangle multiplication module: `update_scale` must have at most z's ",
            z.dim(), " dims, got ", update_scale->sizes());
  const int64_t n = z.size(-2), c_z = z.size(-1);
  std::vector<int64_t> shape(z.dim() - update_scale->dim(), 1);
  shape.insert(shape.end(), update_scale->sizes().begin(), update_scale->sizes().end());
  std::vector<int64_t> expanded(z.sizes().begin(), z.sizes().end() - 3);
  expanded.insert(expanded.end(), {1, n, c_z});
  return update_scale->reshape(shape).expand(expanded).reshape({-1, 1, n, c_z}).contiguous();
}

struct TriangleNode : public torch::autograd::Function<TriangleNode> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& z_in, const OptionalTensor& mask,
                               const at::Tensor& norm_in_w, const at::Tensor& norm_in_b, const at::Tensor& w_ap,
                               const at::Tensor& w_ag, const at::Tensor& w_bp, const at::Tensor& w_bg,
                               const OptionalTensor& b_ap, const OptionalTensor& b_ag, const OptionalTensor& b_bp,
                               const OptionalTensor& b_bg, const at::Tensor& w_g, const OptionalTensor& b_g,
                               const at::Tensor& norm_out_w, const at::Tensor& norm_out_b, const at::Tensor& w_z,
                               const OptionalTensor& b_z, double eps, bool outgoing, const std::string& family,
                               int64_t mode, const OptionalTensor& update_scale) {
    const TriangleParameters params{norm_in_w, norm_in_b, w_ap, w_ag, w_bp, w_bg, b_ap, b_ag, b_bp, b_bg,
                                    w_g,       b_g,       norm_out_w, norm_out_b, w_z, b_z};
    const at::Tensor z = flat_z(z_in);  // [B, N, N, c_z]
    const OptionalTensor mask_flat = flat_mask(mask);  // [B, N, N]
    const OptionalTensor scale = mode == kAdd ? row_scale(update_scale, z_in) : std::nullopt;  // [B, 1, N, c_z]
    bool views[2];  // whether the stacks of the input projections' weights and biases are views
    const std::vector<at::Tensor> weights = params.kernel_weights(&views);
    auto forward = triangle_forward_op().call(z, mask_flat, weights, eps, outgoing, family, true, mode == kAdd, scale);
    const at::Tensor out = raw_reshape(std::get<0>(forward), z_in.sizes());  // [*, N, N, c_z]

    // (a stack that is a view of the parameters is saved as those parameters: stacked_rows)
    const std::vector<at::Tensor> parts = params.projections();
    variable_list saved{z_in, value_or_undefined(mask_flat)};
    saved.insert(saved.end(), weights.begin(), weights.end());
    if (views[0]) saved[kSavedWeights + block::kProjW] = at::Tensor();
    if (views[1]) saved[kSavedWeights + block::kProjB] = at::Tensor();
    std::apply([&](const at::Tensor&, const auto&... rest) { (saved.push_back(rest), ...); }, forward);
    saved.push_back(value_or_undefined(scale));
    for (int i = 0; i < 8; ++i) saved.push_back(views[i / 4] ? parts[i] : at::Tensor());
    ctx->save_for_backward(saved);
    save_edges(ctx,
               {true, given(mask), true, true, true, true, true, true, given(b_ap), given(b_ag), given(b_bp),
                given(b_bg), true, given(b_g), true, true, true, given(b_z), false, false, false, false,
                given(update_scale)},
               kInputs);  // Input order
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["outgoing"] = outgoing;
    ctx->saved_data["family"] = family;  // (the backward runs the forward's kernel family)
    ctx->saved_data["mode"] = mode;
    if (mode == kKeep) return {z_in, out};  // (autograd returns the input as a view of itself)
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const auto& data = ctx->saved_data;
    const Needs need(ctx);
    const at::Tensor& z_in = saved[0];
    const at::Tensor z = flat_z(z_in);
    const at::Tensor& scale = saved[kSavedScale];
    const auto flat = [&](const at::Tensor& g) { return reshaped(g.contiguous(), z.sizes()); };  // [B, N, N, c_z]
    // (grads are materialised: zeros for an output not used)
    at::Tensor dout, dz_kept;
    switch (data.at("mode").toInt()) {
      case kKeep: dz_kept = flat(grads[0]), dout = flat(grads[1]); break;
      case kAdd:  // d(z + out * scale): z's gradient passes through, out's is scaled
        dz_kept = flat(grads[0]), dout = scale.defined() ? dz_kept * scale : dz_kept;
        break;
      default: dout = flat(grads[0]);
    }
    std::vector<at::Tensor> weights(saved.begin() + kSavedWeights, saved.begin() + kSavedForward);
    for (const int w : {block::kProjW, block::kProjB}) {  // (stacked again where the forward's were views)
      const int first = kSavedParts + (w == block::kProjW ? 0 : 4);
      if (!weights[w].defined())
        weights[w] = stacked_rows({saved[first], saved[first + 1], saved[first + 2], saved[first + 3]});
    }
    const std::vector<at::Tensor> forward(saved.begin() + kSavedForward, saved.begin() + kSavedScale);
    const std::vector<at::Tensor> g =
        triangle_backward_op().call(dout.contiguous(), z, optional_of(saved[1]), weights, forward,
                                    data.at("eps").toDouble(), data.at("outgoing").toBool(), optional_of(dz_kept),
                                    data.at("family").toStringRef());
    const auto grad = [&](block::TriangleWeight w) -> const at::Tensor& { return g[1 + w]; };

    variable_list result(kInputs);
    if (need(kZ)) result[kZ] = raw_reshape(g[0], z_in.sizes());
    if (need(kNormInW)) result[kNormInW] = grad(block::kNormInW);
    if (need(kNormInB)) result[kNormInB] = grad(block::kNormInB);
    // the stacked projections' gradients [4 c, c_z] and [4 c] as four row blocks each (a_p, a_g, b_p, b_g)
    const at::Tensor &dproj = grad(block::kProjW), &dproj_bias = grad(block::kProjB);
    const int64_t c = dproj.size(0) / 4;
    for (int i = 0; i < 4; ++i) {
      if (need(kWap + i)) result[kWap + i] = raw_narrow(dproj, 0, i * c, c);
      if (need(kBap + i)) result[kBap + i] = raw_narrow(dproj_bias, 0, i * c, c);
    }
    if (need(kWg)) result[kWg] = grad(block::kGateW);
    if (need(kBg)) result[kBg] = grad(block::kGateB);
    if (need(kNormOutW)) result[kNormOutW] = grad(block::kNormOutW);
    if (need(kNormOutB)) result[kNormOutB] = grad(block::kNormOutB);
    if (need(kWz)) result[kWz] = grad(block::kOutW);
    if (need(kBz)) result[kBz] = grad(block::kOutB);
    return result;
  }
};

// The node where gradients are recorded, else the forward as the op runs it without a backward.
variable_list run(const at::Tensor& z, const OptionalTensor& mask, const TriangleParameters& p, double eps,
                  bool outgoing, const std::string& family, int64_t mode, const OptionalTensor& update_scale) {
  if (at::GradMode::is_enabled() && (z.requires_grad() || p.any_requires_grad())) {
    return TriangleNode::apply(z, mask, p.norm_in_w, p.norm_in_b, p.w_ap, p.w_ag, p.w_bp, p.w_bg, p.b_ap, p.b_ag,
                               p.b_bp, p.b_bg, p.w_g, p.b_g, p.norm_out_w, p.norm_out_b, p.w_z, p.b_z, eps, outgoing,
                               family, mode, update_scale);
  }
  const OptionalTensor scale = mode == kAdd ? row_scale(update_scale, z) : std::nullopt;  // [B, 1, N, c_z]
  const at::Tensor out = std::get<0>(triangle_forward_op().call(flat_z(z), flat_mask(mask), p.kernel_weights(), eps,
                                                                outgoing, family, false, mode == kAdd, scale));
  const at::Tensor result = raw_reshape(out, z.sizes());  // [*, N, N, c_z]
  if (mode == kKeep) return {z, result};
  return {result};
}

at::Tensor triangle_multiplication_module(const at::Tensor& z, const OptionalTensor& mask, const at::Tensor& norm_in_w,
                                          const at::Tensor& norm_in_b, const at::Tensor& w_ap, const at::Tensor& w_ag,
                                          const at::Tensor& w_bp, const at::Tensor& w_bg, const OptionalTensor& b_ap,
                                          const OptionalTensor& b_ag, const OptionalTensor& b_bp,
                                          const OptionalTensor& b_bg, const at::Tensor& w_g, const OptionalTensor& b_g,
                                          const at::Tensor& norm_out_w, const at::Tensor& norm_out_b,
                                          const at::Tensor& w_z, const OptionalTensor& b_z, double eps, bool outgoing,
                                          const std::string& family, bool add_input,
                                          const OptionalTensor& update_scale) {
  EVO_CHECK(z.dim() >= 3 && z.is_contiguous() && (add_input || !given(update_scale)),
            "triangle multiplication module: `z` must be a contiguous [*, N, N, c_z], and `update_scale` goes with "
            "add_input; got ", z.sizes());
  const TriangleParameters p{norm_in_w, norm_in_b, w_ap, w_ag, w_bp, w_bg, b_ap, b_ag, b_bp, b_bg,
                             w_g,       b_g,       norm_out_w, norm_out_b, w_z, b_z};
  return run(z, mask, p, eps, outgoing, family, add_input ? kAdd : kPlain, update_scale)[0];
}

std::tuple<at::Tensor, at::Tensor> triangle_multiplication_keeping_input_module(
    const at::Tensor& z, const OptionalTensor& mask, const at::Tensor& norm_in_w, const at::Tensor& norm_in_b,
    const at::Tensor& w_ap, const at::Tensor& w_ag, const at::Tensor& w_bp, const at::Tensor& w_bg,
    const OptionalTensor& b_ap, const OptionalTensor& b_ag, const OptionalTensor& b_bp, const OptionalTensor& b_bg,
    const at::Tensor& w_g, const OptionalTensor& b_g, const at::Tensor& norm_out_w, const at::Tensor& norm_out_b,
    const at::Tensor& w_z, const OptionalTensor& b_z, double eps, bool outgoing, const std::string& family) {
  EVO_CHECK(z.dim() >= 3 && z.is_contiguous(), "triangle multiplication module: `z` must be a contiguous "
            "[*, N, N, c_z], got ", z.sizes());
  const TriangleParameters p{norm_in_w, norm_in_b, w_ap, w_ag, w_bp, w_bg, b_ap, b_ag, b_bp, b_bg,
                             w_g,       b_g,       norm_out_w, norm_out_b, w_z, b_z};
  const variable_list out = run(z, mask, p, eps, outgoing, family, kKeep, std::nullopt);
  return {out[0], out[1]};
}

}  // namespace
}  // namespace modules
}  // namespace evoformer

// (schemas: evoformer_blocks/ops/_fused.py) One kernel for every dispatch key, as modules_bindings.cpp's.
TORCH_LIBRARY_IMPL(evoformer_blocks_cuda, CompositeImplicitAutograd, m) {
  m.impl("triangle_multiplication_module", &evoformer::modules::triangle_multiplication_module);
  m.impl("triangle_multiplication_keeping_input_module", &evoformer::modules::triangle_multiplication_keeping_input_module);
}
