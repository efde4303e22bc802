// Op kernels of the per-module autograd nodes: each module's computation after its layer norms,
// forward and backward, in C++ as ONE autograd node (torch::autograd::Function), so that a module
// call costs one op call from Python and its backward runs without Python. Each node computes, with
// the same ATen calls and extension entry points in the same order, what the module's composed path
// computes (evoformer_blocks.primitives' stacked projection, ops.gated_evoformer_attention and
// ops.linear on the cutlass backend): results and gradients are equal bit for bit
// (tests/test_module_nodes_cuda.py). evoformer_blocks/ops/module_nodes.py decides when a node may run
// (the cutlass backend selected for every op it stands for, no autocast, one dtype, not compiling, no
// recompute policy keeping the attention). The residual add + layer norm of the blocks is one such
// node too (ops.add_layer_norm and ops.layer_norm_keeping_input record it on the cutlass backend,
// except under torch.compile and inside module_nodes.composed()).
//
// Ops (namespace evoformer_blocks_cuda, declared in evoformer_blocks/ops/_fused.py), composite (each
// records its own node where autograd needs one):
//   gated_attention_module(Tensor x, Tensor? mask_bias, Tensor? pair_bias, Tensor w_q, Tensor w_k, Tensor w_v,
//                          Tensor w_g, Tensor? b_q, Tensor? b_g, Tensor w_o, Tensor? b_o, Tensor? w_head,
//                          Tensor? pair_source, int heads, bool transposed, bool transpose_head, float scale,
//                          str family) -> Tensor
//     the gated attention modules (MSA row and column attention, the triangle attentions, AF3's
//     attention with pair bias): x [*, A, A', c_in] (normalised); q, k, v, g = x W^T (+ b) side by side
//     in one GEMM ([B, A, A', 4 H D], B the batch dims flattened); the attention runs along A' (row
//     n = a) or, transposed, along A, with mask_bias [*, N, L] (in the attention's orientation, any
//     strides) and the pair bias pair_bias [B, 1, H, L, L], or, with w_head [H, c_in], the head-major
//     projection of x itself (triangle attention: [b, 0, h, i, j] = x[b, i, j] . w_head[h];
//     transpose_head: its transpose over (i, j), the ending node's), or with pair_source [*, L, L, c_z]
//     (one batch element) and w_head [H, c_z] that of pair_source (the MSA row attention's pair bias
//     from the normalised pair representation, as primitives._head_major computes it for one batch
//     element: one GEMM, its gradients as autograd's for it); returns
//     linear_o(sigmoid(g) * attention) [*, A, A', c_out].
//   transition_module(Tensor x, Tensor w1, Tensor b1, Tensor w2, Tensor? b2) -> Tensor
//     the AF2 transitions: relu(x W1^T + b1) W2^T + b2 for x [*, c] (normalised), w1 [n c, c], b1 [n c],
//     w2 [c_out, n c], b2 [c_out] or None (a block adding it in its next add_layer_norm) -> [*, c_out];
//     the ReLU in cuBLASLt's epilogue (ops.linear with
//     activation="relu"), each backward linear_bwd (the ReLU's backward and the bias sums in one
//     column-sum pass).
//   add_layer_norm_node(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps,
//                       Tensor? residual_scale=None, Tensor? residual_bias=None) -> (Tensor, Tensor)
//     (sum = x + (residual + residual_bias) (* residual_scale), layer_norm(sum)) by add_layer_norm_fwd,
//     backward by add_layer_norm_bwd (x's and the residual's gradients, and the residual bias's sum, in
//     one pass).
//   layer_norm_keeping_input_node(Tensor(a) x, Tensor? weight, Tensor? bias, float eps) -> (Tensor(a), Tensor)
//     (x itself, layer_norm(x)) by layer_norm_fwd; the backward adds the returned x's gradient to the
//     layer norm's input gradient in add_layer_norm_bwd's one pass.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "attention/attention_ops.h"
#include "common/bindings_common.h"
#include "gating/gating_ops.h"
#include "layer_norm/layer_norm_ops.h"
#include "modules/nodes.h"

namespace evoformer {
namespace modules {
namespace {

// Positions of the forward's arguments (after ctx) in needs_input_grad and in the gradients returned.
enum Input : int { kX, kMask, kPair, kWq, kWk, kWv, kWg, kBq, kBg, kWo, kBo, kWhead, kSource, kInputs = 18 };
// Positions of the saved tensors.
// sStacked: the stacked projection's weight where it is a copy; else (a view of the four weights,
// stacked_rows) the four weights at sWq .. sWq + 3.
enum Saved : int {
  sX, sStacked, sWhead, sQkvg, sOut, sStats, sMaskPrepared, sPair, sPairPrepared, sY, sWo, sSource, sWq
};

// (the ops the nodes run: nodes.h's EVO_OP_HANDLE)
EVO_OP_HANDLE(attention_forward_op, "gated_attention_fwd", gated_attention_fwd)
EVO_OP_HANDLE(attention_backward_op, "gated_attention_bwd", gated_attention_bwd)
EVO_OP_HANDLE(layer_norm_forward_op, "layer_norm_fwd", block::layer_norm_fwd)
EVO_OP_HANDLE(add_layer_norm_forward_op, "add_layer_norm_fwd", block::add_layer_norm_fwd)
EVO_OP_HANDLE(add_layer_norm_backward_op, "add_layer_norm_bwd", block::add_layer_norm_bwd)

// x [*, A, A', c] as [B, A, A', c], its batch dims flattened (a view where they allow one).
at::Tensor batch_flat(const at::Tensor& x) {
  if (x.dim() == 4) return x;
  const int64_t a = x.size(-3), a2 = x.size(-2), c = x.size(-1);
  return reshaped(x, {x.numel() / (a * a2 * c), a, a2, c});
}

// x [B, L, L, c] -> [B, 1, H, L, L]: [b, 0, h, i, j] = x[b, i, j] . weight[h], head-major as weight @ x^T
// (primitives._head_major's calls).
at::Tensor head_major(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t batch = x.size(0), length = x.size(2), c = x.size(3);
  at::Tensor out = batch == 1 ? at::mm(weight, raw_transpose(reshaped(x, {length * length, c})))  // [H, L L]
                              : at::matmul(weight, raw_transpose(reshaped(x, {batch, length * length, c})));  // [B, H, L L]
  return reshaped(out, {batch, 1, weight.size(0), length, length});
}

// The head-major projection's gradients (primitives._head_major_grads): dh^T . weight added into dx
// [B, L, L, c] in place; returns weight's gradient dh . x (summed over B), or undefined.
at::Tensor head_major_grads(at::Tensor& dx, const at::Tensor& dh, const at::Tensor& x, const at::Tensor& weight,
                            bool need_dx, bool need_dw) {
  const int64_t batch = x.size(0), heads = weight.size(0), c = x.size(3), positions = x.size(1) * x.size(2);
  // (batch 1: the same GEMMs on [H, L L] and [L L, c] matrices)
  const at::Tensor dh3 = batch == 1 ? reshaped(dh, {heads, positions}) : reshaped(dh, {batch, heads, positions});
  if (need_dx) {  // (dx: linear_bwd's new contiguous [B, A, A', c])
    if (batch == 1) {
      raw_reshape(dx, {positions, c}).addmm_(raw_transpose(dh3), weight);
    } else {
      raw_reshape(dx, {batch, positions, c}).baddbmm_(raw_transpose(dh3), weight.expand({batch, heads, c}));
    }
  }
  if (!need_dw) return at::Tensor();
  return batch == 1 ? rows_product(dh3, reshaped(x, {positions, c}))
                    : at::bmm(dh3, reshaped(x, {batch, positions, c})).sum(0);  // [H, c]
}

struct GatedAttentionNode : public torch::autograd::Function<GatedAttentionNode> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x_in, const std::optional<at::Tensor>& mask_bias,
                            const std::optional<at::Tensor>& pair_bias, const at::Tensor& w_q, const at::Tensor& w_k,
                            const at::Tensor& w_v, const at::Tensor& w_g, const std::optional<at::Tensor>& b_q,
                            const std::optional<at::Tensor>& b_g, const at::Tensor& w_o,
                            const std::optional<at::Tensor>& b_o, const std::optional<at::Tensor>& w_head,
                            const std::optional<at::Tensor>& pair_source, int64_t heads, bool transposed,
                            bool transpose_head, double scale, const std::string& family) {
    EVO_CHECK(x_in.dim() >= 3, "gated attention module: `x` must be [*, A, A', c_in], got ", x_in.sizes());
    EVO_CHECK(!(pair_bias.has_value() && w_head.has_value()),
              "gated attention module: pass `pair_bias` or `w_head`, not both");
    EVO_CHECK(!pair_source.has_value() || (w_head.has_value() && !transpose_head),
              "gated attention module: `pair_source` needs `w_head` and no `transpose_head`");
    // x [B, A, A', c_in] (x_in is what the node saves, so that autograd sees in-place changes to it)
    const at::Tensor x = batch_flat(x_in);
    bool stacked_view = false;
    const at::Tensor stacked = stacked_rows({w_q, w_k, w_v, w_g}, &stacked_view);  // [4 H D, c_in]
    std::optional<at::Tensor> stacked_bias;
    if (b_q.has_value() || b_g.has_value()) {
      // (primitives.stacked_projection's: each bias, zeros of the first bias's dtype where none; the
      // zeros of consecutive projections as one cached block)
      const at::TensorOptions options = (b_q.has_value() ? *b_q : *b_g).options();
      const int64_t width = w_q.size(0);
      std::vector<at::Tensor> parts;
      if (b_q.has_value()) parts.push_back(*b_q);
      parts.push_back(cached_zeros((b_q.has_value() ? 2 : 3) * width, options));  // k, v (and q)
      parts.push_back(b_g.has_value() ? *b_g : cached_zeros(width, options));
      stacked_bias = at::cat(parts);  // [4 H D]
    }
    const at::Tensor qkvg = linear_rows(x, stacked, stacked_bias);  // [B, A, A', 4 H D]
    at::Tensor pair = value_or_undefined(pair_bias);  // [B, 1, H, L, L]
    if (pair_source.has_value()) {
      const at::Tensor source = batch_flat(*pair_source);  // [1, L, L, c_z]
      EVO_CHECK(source.size(0) == 1 && source.size(1) == source.size(2) && source.size(3) == w_head->size(1),
                "gated attention module: `pair_source` must be one [L, L, c_z] batch element for `w_head` [H, c_z], "
                "got ", pair_source->sizes(), " and ", w_head->sizes());
      pair = head_major(source, *w_head);  // [1, 1, H, L, L]
    } else if (w_head.has_value()) {
      pair = head_major(x, *w_head);  // [B, 1, H, A, A']
      if (transpose_head) pair = raw_transpose(pair).contiguous();  // [B, 1, H, A', A]
    }
    std::optional<at::Tensor> mask;
    if (mask_bias.has_value()) {
      const int64_t n = mask_bias->size(-2), l = mask_bias->size(-1);
      mask = reshaped(*mask_bias, {mask_bias->numel() / (n * l), n, 1, 1, l});  // [B, N, 1, 1, L]
    }
    auto [y, out, stats, mask_prepared, pair_prepared] =
        attention_forward_op().call(qkvg, mask, optional_of(pair), heads, transposed, scale,
                                    family);  // y [B, A, A', H D]
    const at::Tensor result = linear_rows(y, w_o, b_o);  // [B, A, A', c_out]

    ctx->save_for_backward({x_in, stacked_view ? at::Tensor() : stacked, value_or_undefined(w_head), qkvg, out, stats,
                            mask_prepared, pair, pair_prepared, y, w_o, value_or_undefined(pair_source),
                            stacked_view ? w_q : at::Tensor(), stacked_view ? w_k : at::Tensor(),
                            stacked_view ? w_v : at::Tensor(), stacked_view ? w_g : at::Tensor()});  // Saved order
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["transposed"] = transposed;
    ctx->saved_data["transpose_head"] = transpose_head;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["family"] = family;
    if (mask_bias.has_value()) {
      ctx->saved_data["mask_sizes"] = mask_bias->sizes().vec();
      ctx->saved_data["mask_dtype"] = mask_bias->scalar_type();
    }
    save_edges(ctx,
               {true, given(mask_bias), given(pair_bias), true, true, true, true, given(b_q), given(b_g), true,
                given(b_o), given(w_head), given(pair_source)},
               kInputs);  // Input order
    ctx->saved_data["width_q"] = w_q.size(0);
    ctx->saved_data["bias_dtype"] = b_q.has_value() ? b_q->scalar_type() : b_g.has_value() ? b_g->scalar_type()
                                                                                           : x.scalar_type();
    ctx->saved_data["b_o_dtype"] = b_o.has_value() ? b_o->scalar_type() : x.scalar_type();
    if (x_in.dim() == 4) return result;
    std::vector<int64_t> sizes(x_in.sizes().begin(), x_in.sizes().end() - 1);
    sizes.push_back(result.size(-1));
    return raw_reshape(result, sizes);  // [*, A, A', c_out]
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x_in = saved[sX], &w_head = saved[sWhead], &qkvg = saved[sQkvg];
    const at::Tensor stacked = saved[sStacked].defined()
                                   ? saved[sStacked]
                                   : stacked_rows({saved[sWq], saved[sWq + 1], saved[sWq + 2], saved[sWq + 3]});
    const at::Tensor &y = saved[sY], &w_o = saved[sWo], &pair = saved[sPair], &source = saved[sSource];
    const auto& data = ctx->saved_data;
    const Needs need(ctx);
    const bool transposed = data.at("transposed").toBool(), transpose_head = data.at("transpose_head").toBool();
    const int64_t heads = data.at("heads").toInt(), width = data.at("width_q").toInt();

    variable_list result(kInputs);
    const at::Tensor x = batch_flat(x_in);  // [B, A, A', c_in]
    const at::Tensor& grad = grads[0];  // [*, A, A', c_out]
    const at::Tensor dres = reshaped(grad, {x.size(0), x.size(1), x.size(2), grad.size(-1)});  // [B, A, A', c_out]
    const bool has_head = w_head.defined(), from_source = source.defined();
    const bool need_weights = need(kWq) || need(kWk) || need(kWv) || need(kWg);
    const bool need_biases = need(kBq) || need(kBg);
    const bool need_dmask = need(kMask);
    const bool need_dpair =
        pair.defined() && (has_head ? need(from_source ? kSource : kX) || need(kWhead) : need(kPair));
    const bool need_dy = need(kX) || need_weights || need_biases || need_dmask || need_dpair;

    // the output projection (ops.linear: linear_bwd; without a bias, the same two GEMMs)
    auto [dy, dw_o, db_o] = block::linear_bwd(dres, y, w_o, std::nullopt, need_dy, need(kWo), need(kBo),
                                              data.at("b_o_dtype").toScalarType(), 0);
    if (need(kWo)) result[kWo] = dw_o;
    if (need(kBo)) result[kBo] = db_o;
    if (!need_dy) return result;

    // the gated attention (its gate's and attention's backward write the gradient of qkvg)
    std::optional<at::ScalarType> dmask_dtype;
    if (need_dmask) dmask_dtype = data.at("mask_dtype").toScalarType();
    auto [dqkvg, dmask, dpair] = attention_backward_op().call(
        dy, qkvg, saved[sOut], saved[sStats], saved[sMaskPrepared], optional_of(pair), saved[sPairPrepared], heads,
        transposed, data.at("scale").toDouble(), data.at("family").toStringRef(), dmask_dtype, need_dpair);
    if (need_dmask) result[kMask] = reshaped(dmask, data.at("mask_sizes").toIntVector());
    if (need_dpair && !has_head) result[kPair] = dpair;

    // the stacked projection: dx, the weights' gradient and the bias sums from the first bias wanted on
    const bool need_bq = need(kBq);
    const int64_t bias_from = need_bq ? 0 : 3 * width;
    auto [dx, dw, sums] = block::linear_bwd(dqkvg, x, stacked, std::nullopt, need(kX), need_weights, need_biases,
                                            data.at("bias_dtype").toScalarType(), bias_from);
    if (from_source && need_dpair) {
      // (autograd's for primitives._head_major's mm(w_head, source^T) of one batch element: the source
      // column-major, so its gradient is (dh^T w_head)^T^T)
      const int64_t positions = source.numel() / source.size(-1);
      const at::Tensor dh = reshaped(dpair, {w_head.size(0), positions});  // [H, L L]
      if (need(kSource)) result[kSource] = raw_reshape(at::mm(raw_transpose(dh), w_head), source.sizes());
      if (need(kWhead)) result[kWhead] = rows_product(dh, reshaped(source, {positions, source.size(-1)}));  // [H, c_z]
    } else if (has_head && need_dpair) {
      const at::Tensor dh = transpose_head ? raw_transpose(dpair) : dpair;  // [B, 1, H, A, A']
      at::Tensor dw_head = head_major_grads(dx, dh, x, w_head, need(kX), need(kWhead));
      if (need(kWhead)) result[kWhead] = dw_head;
    }
    if (need(kX)) result[kX] = raw_reshape(dx, x_in.sizes());
    if (need_weights) {  // dw [4 H D, c_in] contiguous: the four weights' gradients as row blocks
      for (int i = 0; i < 4; ++i)
        if (need(kWq + i)) result[kWq + i] = raw_narrow(dw, 0, i * width, width);
    }
    if (need_biases) {  // sums [4 H D - bias_from]
      if (need_bq) result[kBq] = raw_narrow(sums, 0, 0, width);
      if (need(kBg)) result[kBg] = raw_narrow(sums, 0, sums.size(0) - width, width);
    }
    return result;
  }
};

at::Tensor gated_attention_module(const at::Tensor& x, const std::optional<at::Tensor>& mask_bias,
                                  const std::optional<at::Tensor>& pair_bias, const at::Tensor& w_q,
                                  const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& w_g,
                                  const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_g,
                                  const at::Tensor& w_o, const std::optional<at::Tensor>& b_o,
                                  const std::optional<at::Tensor>& w_head, const std::optional<at::Tensor>& pair_source,
                                  int64_t heads, bool transposed, bool transpose_head, double scale,
                                  const std::string& family) {
  return GatedAttentionNode::apply(x, mask_bias, pair_bias, w_q, w_k, w_v, w_g, b_q, b_g, w_o, b_o, w_head,
                                   pair_source, heads, transposed, transpose_head, scale, family);
}

// ---- the transition ----
enum TransitionInput : int { kTx, kW1, kB1, kW2, kB2, kTransitionInputs };

struct TransitionNode : public torch::autograd::Function<TransitionNode> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1,
                            const at::Tensor& w2, const std::optional<at::Tensor>& b2) {
    EVO_CHECK(x.dim() >= 1 && w1.dim() == 2 && w1.size(1) == x.size(-1) && w2.dim() == 2 && w2.size(1) == w1.size(0),
              "transition module: `x` [*, c], `w1` [n c, c] and `w2` [c_out, n c] do not fit: ", x.sizes(), ", ",
              w1.sizes(), ", ", w2.sizes());
    std::vector<int64_t> hidden_sizes(x.sizes().begin(), x.sizes().end());
    hidden_sizes.back() = w1.size(0);
    // relu(x W1^T + b1) in the GEMM's epilogue [rows, n c], seen as [*, n c]
    const at::Tensor rows = flat_rows(x, x.size(-1));  // [rows, c]
    const at::Tensor h = raw_reshape(at::_addmm_activation(b1, rows, raw_transpose(w1)), hidden_sizes);
    const at::Tensor out = linear_rows(h, w2, b2);  // [*, c_out]
    ctx->save_for_backward({x, w1, h, w2});
    save_edges(ctx, {true, true, true, true, b2.has_value()}, kTransitionInputs);  // TransitionInput order
    ctx->saved_data["b1_dtype"] = b1.scalar_type();
    ctx->saved_data["b2_dtype"] = b2.has_value() ? b2->scalar_type() : x.scalar_type();
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w1 = saved[1], &h = saved[2], &w2 = saved[3];
    const Needs need(ctx);  // (b2 may be absent)
    variable_list result(kTransitionInputs);
    const bool need_dh = need(kTx) || need(kW1) || need(kB1);
    auto [dh, dw2, db2] = block::linear_bwd(grads[0], h, w2, std::nullopt, need_dh, need(kW2), need(kB2),
                                            ctx->saved_data.at("b2_dtype").toScalarType(), 0);
    if (need(kW2)) result[kW2] = dw2;
    if (need(kB2)) result[kB2] = db2;
    if (!need_dh) return result;
    // the ReLU's backward (its mask from h) with b1's sum in one pass, then the two GEMMs
    auto [dx, dw1, db1] = block::linear_bwd(dh, x, w1, h, need(kTx), need(kW1), need(kB1),
                                            ctx->saved_data.at("b1_dtype").toScalarType(), 0);
    if (need(kTx)) result[kTx] = dx;
    if (need(kW1)) result[kW1] = dw1;
    if (need(kB1)) result[kB1] = db1;
    return result;
  }
};

at::Tensor transition_module(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                             const std::optional<at::Tensor>& b2) {
  return TransitionNode::apply(x, w1, b1, w2, b2);
}

// ---- the layer norms behind a residual add ----
// The cutlass backend's add_layer_norm and layer_norm_keeping_input (evoformer_blocks/ops/normalization.py's
// _FusedAddLayerNormFunction and _LayerNormKeepingInputFunction, whose forward and backward these run
// with the same extension entry points and ATen calls).
// Positions of the forward's arguments (after ctx): autograd wants one gradient per argument, an
// undefined one for eps and for an absent optional.
enum AddNormInput : int { kNx, kNres, kNw, kNb, kNeps, kNscale, kNresBias, kAddNormInputs };
enum AddNormSaved : int { nSum, nW, nMean, nRstd, nScale, nResidual };

struct AddLayerNormNode : public torch::autograd::Function<AddLayerNormNode> {
  // (sum, y): sum = x + (residual + residual_bias) (* residual_scale), y = layer_norm(sum); without a
  // residual (keeping x: layer_norm_keeping_input) sum is x itself and y its layer norm.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const std::optional<at::Tensor>& residual,
                               const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                               double eps, const std::optional<at::Tensor>& residual_scale,
                               const std::optional<at::Tensor>& residual_bias) {
    at::Tensor sum, y, mean, rstd;
    if (residual.has_value()) {
      std::tie(sum, y, mean, rstd) =
          add_layer_norm_forward_op().call(x, *residual, weight, bias, eps, residual_scale, residual_bias);
    } else {
      std::tie(y, mean, rstd) = layer_norm_forward_op().call(x, weight, bias, eps);
      sum = x;  // (autograd returns the input as a view of itself)
    }
    // the residual is kept only for the gradient of a residual_scale that requires one (as the product
    // took it: with its bias)
    const bool scale_grad = given(residual_scale) && residual_scale->requires_grad();
    at::Tensor scaled;
    if (scale_grad) scaled = given(residual_bias) ? at::add(*residual, *residual_bias) : *residual;
    ctx->save_for_backward({sum, value_or_undefined(weight), mean, rstd, value_or_undefined(residual_scale), scaled});
    save_edges(ctx,
               {true, given(residual), given(weight), given(bias), false, given(residual_scale), given(residual_bias)},
               kAddNormInputs);  // AddNormInput order
    if (given(bias)) ctx->saved_data["bias_dtype"] = bias->scalar_type();
    if (given(residual_bias)) ctx->saved_data["residual_bias_dtype"] = residual_bias->scalar_type();
    return {sum, y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &sum = saved[nSum], &weight = saved[nW], &scale = saved[nScale];
    const Needs need(ctx);
    const at::Tensor ds = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(sum);
    const at::Tensor dy = grads[1].defined() ? grads[1].contiguous() : at::zeros_like(sum);
    // the affine gradients wanted and the dtype the kernel rounds both to: the parameters' where they
    // share it or one is wanted, else float32
    const bool want_w = weight.defined() && need(kNw), want_b = need(kNb);
    const at::ScalarType bias_dtype =
        ctx->saved_data.count("bias_dtype") ? ctx->saved_data.at("bias_dtype").toScalarType() : at::kFloat;
    at::ScalarType affine_dtype = at::kFloat;
    if (want_w && want_b) affine_dtype = weight.scalar_type() == bias_dtype ? bias_dtype : at::kFloat;
    else if (want_w) affine_dtype = weight.scalar_type();
    else if (want_b) affine_dtype = bias_dtype;
    std::optional<at::ScalarType> residual_bias_dtype;
    if (need(kNresBias)) residual_bias_dtype = ctx->saved_data.at("residual_bias_dtype").toScalarType();
    auto [dx, affine, dresidual, dresidual_bias] = add_layer_norm_backward_op().call(
        ds, dy, sum, optional_of(weight), saved[nMean], saved[nRstd], want_w || want_b, affine_dtype,
        optional_of(scale), residual_bias_dtype);
    variable_list result(kAddNormInputs);
    result[kNx] = dx;
    if (need.given(kNres)) result[kNres] = scale.defined() ? dresidual : dx;  // (the add passes dx on)
    const int64_t C = sum.size(-1);
    if (want_w) result[kNw] = as_dtype(raw_view(affine, {C}, {1}, affine.storage_offset()), weight.scalar_type());
    if (want_b) result[kNb] = as_dtype(raw_view(affine, {C}, {1}, affine.storage_offset() + C), bias_dtype);
    if (scale.defined() && saved[nResidual].defined() && need(kNscale)) {
      // d(residual * scale) / d scale in float32, summed over the dims the scale broadcasts along
      result[kNscale] =
          (dx.to(at::kFloat) * saved[nResidual].to(at::kFloat)).sum_to_size(scale.sizes()).to(scale.scalar_type());
    }
    if (need(kNresBias)) result[kNresBias] = dresidual_bias;
    return result;
  }
};

std::tuple<at::Tensor, at::Tensor> add_layer_norm_node(const at::Tensor& x, const at::Tensor& residual,
                                                       const std::optional<at::Tensor>& weight,
                                                       const std::optional<at::Tensor>& bias, double eps,
                                                       const std::optional<at::Tensor>& residual_scale,
                                                       const std::optional<at::Tensor>& residual_bias) {
  const variable_list out = AddLayerNormNode::apply(x, std::optional<at::Tensor>(residual), weight, bias, eps,
                                                    residual_scale, residual_bias);
  return {out[0], out[1]};
}

std::tuple<at::Tensor, at::Tensor> layer_norm_keeping_input_node(const at::Tensor& x,
                                                                 const std::optional<at::Tensor>& weight,
                                                                 const std::optional<at::Tensor>& bias, double eps) {
  const variable_list out = AddLayerNormNode::apply(x, std::nullopt, weight, bias, eps, std::nullopt, std::nullopt);
  return {out[0], out[1]};
}

}  // namespace
}  // namespace modules
}  // namespace evoformer

// (schemas: evoformer_blocks/ops/_fused.py) One kernel for every dispatch key: each node records itself
// where autograd needs it (torch::autograd::Function), so the ops have no separate autograd kernel.
TORCH_LIBRARY_IMPL(evoformer_blocks_cuda, CompositeImplicitAutograd, m) {
  m.impl("gated_attention_module", &evoformer::modules::gated_attention_module);
  m.impl("transition_module", &evoformer::modules::transition_module);
  m.impl("add_layer_norm_node", &evoformer::modules::add_layer_norm_node);
  m.impl("layer_norm_keeping_input_node", &evoformer::modules::layer_norm_keeping_input_node);
}
