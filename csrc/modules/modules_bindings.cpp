// Op kernels of the per-module autograd nodes: each module's computation after its layer norms,
// forward and backward, in C++ as ONE autograd node (torch::autograd::Function), so that a module
// call costs one op call from Python and its backward runs without Python. Each node computes, with
// the same ATen calls and extension entry points in the same order, what the module's composed path
// computes (evoformer_blocks.primitives' stacked projection, ops.gated_evoformer_attention and
// ops.linear on the cutlass backend): results and gradients are equal bit for bit
// (tests/test_module_nodes_cuda.py). evoformer_blocks/ops/module_nodes.py decides when a node may run
// (the cutlass backend selected for every op it stands for, no autocast, one dtype, not compiling, no
// recompute policy keeping the attention).
//
// Ops (namespace evoformer_blocks_cuda, declared in evoformer_blocks/ops/_fused.py), composite (each
// records its own node where autograd needs one):
//   gated_attention_module(Tensor x, Tensor? mask_bias, Tensor? pair_bias, Tensor w_q, Tensor w_k, Tensor w_v,
//                          Tensor w_g, Tensor? b_q, Tensor? b_g, Tensor w_o, Tensor? b_o, Tensor? w_head,
//                          int heads, bool transposed, bool transpose_head, float scale, str family) -> Tensor
//     the gated attention modules (MSA row and column attention, the triangle attentions, AF3's
//     attention with pair bias): x [*, A, A', c_in] (normalised); q, k, v, g = x W^T (+ b) side by side
//     in one GEMM ([B, A, A', 4 H D], B the batch dims flattened); the attention runs along A' (row
//     n = a) or, transposed, along A, with mask_bias [*, N, L] (in the attention's orientation, any
//     strides) and the pair bias pair_bias [B, 1, H, L, L], or, with w_head [H, c_in], the head-major
//     projection of x itself (triangle attention: [b, 0, h, i, j] = x[b, i, j] . w_head[h];
//     transpose_head: its transpose over (i, j), the ending node's); returns
//     linear_o(sigmoid(g) * attention) [*, A, A', c_out].
//   transition_module(Tensor x, Tensor w1, Tensor b1, Tensor w2, Tensor b2) -> Tensor
//     the AF2 transitions: relu(x W1^T + b1) W2^T + b2 for x [*, c] (normalised), w1 [n c, c], b1 [n c],
//     w2 [c_out, n c], b2 [c_out] -> [*, c_out]; the ReLU in cuBLASLt's epilogue (ops.linear with
//     activation="relu"), each backward linear_bwd (the ReLU's backward and the bias sums in one
//     column-sum pass).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "attention/attention_ops.h"
#include "common/bindings_common.h"
#include "gating/gating_ops.h"

namespace evoformer {
namespace modules {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Positions of the forward's arguments (after ctx) in needs_input_grad and in the gradients returned.
enum Input : int { kX, kMask, kPair, kWq, kWk, kWv, kWg, kBq, kBg, kWo, kBo, kWhead, kInputs = 17 };
// Positions of the saved tensors.
enum Saved : int { sX, sStacked, sWhead, sQkvg, sOut, sStats, sMaskPrepared, sPair, sPairPrepared, sY, sWo };

at::Tensor value_or_undefined(const std::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }
std::optional<at::Tensor> optional_of(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// The attention's ops, called through the dispatcher (a few microseconds more than calling the
// functions), so that profiles and dispatch modes see them by name, as when the composed path calls
// them (a recompute test counts them).
const auto& attention_forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("evoformer_blocks_cuda::gated_attention_fwd", "")
                             .typed<decltype(gated_attention_fwd)>();
  return op;
}
const auto& attention_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("evoformer_blocks_cuda::gated_attention_bwd", "")
                             .typed<decltype(gated_attention_bwd)>();
  return op;
}

// x [B, L, L, c] -> [B, 1, H, L, L]: [b, 0, h, i, j] = x[b, i, j] . weight[h], head-major as weight @ x^T
// (primitives._head_major's calls).
at::Tensor head_major(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t batch = x.size(0), length = x.size(2), c = x.size(3);
  at::Tensor out = batch == 1 ? at::mm(weight, x.reshape({length * length, c}).t())                      // [H, L L]
                              : at::matmul(weight, x.reshape({batch, length * length, c}).transpose(1, 2));  // [B, H, L L]
  return out.view({batch, 1, weight.size(0), length, length});
}

// The head-major projection's gradients (primitives._head_major_grads): dh^T . weight added into dx
// [B, L, L, c] in place; returns weight's gradient dh . x (summed over B), or undefined.
at::Tensor head_major_grads(at::Tensor& dx, const at::Tensor& dh, const at::Tensor& x, const at::Tensor& weight,
                            bool need_dx, bool need_dw) {
  const int64_t batch = x.size(0), heads = weight.size(0), c = x.size(3), positions = x.size(1) * x.size(2);
  const at::Tensor dh3 = dh.reshape({batch, heads, positions});  // [B, H, L L]
  if (need_dx) {
    at::Tensor dx3 = dx.view({batch, positions, c});  // [B, L L, c]
    if (batch == 1) {
      dx3.select(0, 0).addmm_(dh3.select(0, 0).t(), weight);
    } else {
      dx3.baddbmm_(dh3.transpose(1, 2), weight.expand({batch, heads, c}));
    }
  }
  if (!need_dw) return at::Tensor();
  const at::Tensor x3 = x.reshape({batch, positions, c});  // [B, L L, c]
  return batch == 1 ? at::mm(dh3.select(0, 0), x3.select(0, 0)) : at::bmm(dh3, x3).sum(0);  // [H, c]
}

struct GatedAttentionNode : public torch::autograd::Function<GatedAttentionNode> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x_in, const std::optional<at::Tensor>& mask_bias,
                            const std::optional<at::Tensor>& pair_bias, const at::Tensor& w_q, const at::Tensor& w_k,
                            const at::Tensor& w_v, const at::Tensor& w_g, const std::optional<at::Tensor>& b_q,
                            const std::optional<at::Tensor>& b_g, const at::Tensor& w_o,
                            const std::optional<at::Tensor>& b_o, const std::optional<at::Tensor>& w_head,
                            int64_t heads, bool transposed, bool transpose_head, double scale,
                            const std::string& family) {
    EVO_CHECK(x_in.dim() >= 3, "gated attention module: `x` must be [*, A, A', c_in], got ", x_in.sizes());
    EVO_CHECK(!(pair_bias.has_value() && w_head.has_value()),
              "gated attention module: pass `pair_bias` or `w_head`, not both");
    const int64_t a = x_in.size(-3), a2 = x_in.size(-2), c = x_in.size(-1);
    // x [B, A, A', c_in]: the batch dims flattened (a view where they allow one)
    const at::Tensor x = x_in.dim() == 4 ? x_in : x_in.reshape({-1, a, a2, c});
    const at::Tensor stacked = at::cat({w_q, w_k, w_v, w_g});  // [4 H D, c_in]
    std::optional<at::Tensor> stacked_bias;
    if (b_q.has_value() || b_g.has_value()) {
      // (primitives.stacked_projection's: each bias, or zeros of the first bias's dtype where none)
      const at::TensorOptions options = (b_q.has_value() ? *b_q : *b_g).options();
      const auto bias_or_zeros = [&](const std::optional<at::Tensor>& b, const at::Tensor& w) {
        return b.has_value() ? *b : at::zeros({w.size(0)}, options);
      };
      const std::optional<at::Tensor> none;
      stacked_bias = at::cat({bias_or_zeros(b_q, w_q), bias_or_zeros(none, w_k), bias_or_zeros(none, w_v),
                              bias_or_zeros(b_g, w_g)});  // [4 H D]
    }
    const at::Tensor qkvg = at::linear(x, stacked, stacked_bias);  // [B, A, A', 4 H D]
    at::Tensor pair = value_or_undefined(pair_bias);  // [B, 1, H, L, L]
    if (w_head.has_value()) {
      pair = head_major(x, *w_head);  // [B, 1, H, A, A']
      if (transpose_head) pair = pair.transpose(-1, -2).contiguous();  // [B, 1, H, A', A]
    }
    std::optional<at::Tensor> mask;
    if (mask_bias.has_value())
      mask = mask_bias->reshape({-1, mask_bias->size(-2), 1, 1, mask_bias->size(-1)});  // [B, N, 1, 1, L]
    auto [y, out, stats, mask_prepared, pair_prepared] =
        attention_forward_op().call(qkvg, mask, optional_of(pair), heads, transposed, scale,
                                    family);  // y [B, A, A', H D]
    const at::Tensor result = at::linear(y, w_o, b_o);  // [B, A, A', c_out]

    ctx->save_for_backward({x, stacked, value_or_undefined(w_head), qkvg, out, stats, mask_prepared, pair,
                            pair_prepared, y, w_o});
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["transposed"] = transposed;
    ctx->saved_data["transpose_head"] = transpose_head;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["family"] = family;
    ctx->saved_data["x_sizes"] = x_in.sizes().vec();
    if (mask_bias.has_value()) {
      ctx->saved_data["mask_sizes"] = mask_bias->sizes().vec();
      ctx->saved_data["mask_dtype"] = mask_bias->scalar_type();
    }
    // autograd numbers the node's inputs by the tensors passed (an absent optional is none): the
    // edge of each argument, -1 for an absent one
    const auto given = [](const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
    const bool present[kWhead + 1] = {true, given(mask_bias), given(pair_bias), true, true, true, true,
                                      given(b_q), given(b_g), true, given(b_o), given(w_head)};  // in Input order
    std::vector<int64_t> edges(kInputs, -1);
    for (int i = 0, edge = 0; i <= kWhead; ++i)
      if (present[i]) edges[i] = edge++;
    ctx->saved_data["edges"] = edges;
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
    const at::Tensor &x = saved[sX], &stacked = saved[sStacked], &w_head = saved[sWhead], &qkvg = saved[sQkvg];
    const at::Tensor &y = saved[sY], &w_o = saved[sWo], &pair = saved[sPair];
    const auto& data = ctx->saved_data;
    const std::vector<int64_t> edges = data.at("edges").toIntVector();
    const auto need = [&](int i) { return edges[i] >= 0 && ctx->needs_input_grad(edges[i]); };
    const bool transposed = data.at("transposed").toBool(), transpose_head = data.at("transpose_head").toBool();
    const int64_t heads = data.at("heads").toInt(), width = data.at("width_q").toInt();

    variable_list result(kInputs);
    const at::Tensor& grad = grads[0];  // [*, A, A', c_out]
    const at::Tensor dres = reshaped(grad, {x.size(0), x.size(1), x.size(2), grad.size(-1)});  // [B, A, A', c_out]
    const bool has_head = w_head.defined();
    const bool need_weights = need(kWq) || need(kWk) || need(kWv) || need(kWg);
    const bool need_biases = need(kBq) || need(kBg);
    const bool need_dmask = need(kMask);
    const bool need_dpair = pair.defined() && (has_head ? need(kX) || need(kWhead) : need(kPair));
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
    if (need_dmask) result[kMask] = dmask.reshape(data.at("mask_sizes").toIntVector());
    if (need_dpair && !has_head) result[kPair] = dpair;

    // the stacked projection: dx, the weights' gradient and the bias sums from the first bias wanted on
    const bool need_bq = need(kBq);
    const int64_t bias_from = need_bq ? 0 : 3 * width;
    auto [dx, dw, sums] = block::linear_bwd(dqkvg, x, stacked, std::nullopt, need(kX), need_weights, need_biases,
                                            data.at("bias_dtype").toScalarType(), bias_from);
    if (has_head && need_dpair) {
      const at::Tensor dh = transpose_head ? dpair.transpose(-1, -2) : dpair;  // [B, 1, H, A, A']
      at::Tensor dw_head = head_major_grads(dx, dh, x, w_head, need(kX), need(kWhead));
      if (need(kWhead)) result[kWhead] = dw_head;
    }
    if (need(kX)) result[kX] = raw_reshape(dx, data.at("x_sizes").toIntVector());
    if (need_weights) {  // dw [4 H D, c_in] contiguous: the four weights' gradients as row blocks
      const int64_t c = dw.size(1);
      for (int i = 0; i < 4; ++i)
        if (need(kWq + i)) result[kWq + i] = raw_view(dw, {width, c}, {c, 1}, dw.storage_offset() + i * width * c);
    }
    if (need_biases) {  // sums [4 H D - bias_from]
      if (need_bq) result[kBq] = raw_view(sums, {width}, {1}, sums.storage_offset());
      if (need(kBg)) result[kBg] = raw_view(sums, {width}, {1}, sums.storage_offset() + sums.size(0) - width);
    }
    return result;
  }
};

at::Tensor gated_attention_module(const at::Tensor& x, const std::optional<at::Tensor>& mask_bias,
                                  const std::optional<at::Tensor>& pair_bias, const at::Tensor& w_q,
                                  const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& w_g,
                                  const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_g,
                                  const at::Tensor& w_o, const std::optional<at::Tensor>& b_o,
                                  const std::optional<at::Tensor>& w_head, int64_t heads, bool transposed,
                                  bool transpose_head, double scale, const std::string& family) {
  return GatedAttentionNode::apply(x, mask_bias, pair_bias, w_q, w_k, w_v, w_g, b_q, b_g, w_o, b_o, w_head, heads,
                                   transposed, transpose_head, scale, family);
}

// ---- the transition ----
enum TransitionInput : int { kTx, kW1, kB1, kW2, kB2, kTransitionInputs };

struct TransitionNode : public torch::autograd::Function<TransitionNode> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1,
                            const at::Tensor& w2, const at::Tensor& b2) {
    EVO_CHECK(x.dim() >= 1 && w1.dim() == 2 && w1.size(1) == x.size(-1) && w2.dim() == 2 && w2.size(1) == w1.size(0),
              "transition module: `x` [*, c], `w1` [n c, c] and `w2` [c_out, n c] do not fit: ", x.sizes(), ", ",
              w1.sizes(), ", ", w2.sizes());
    std::vector<int64_t> hidden_sizes(x.sizes().begin(), x.sizes().end());
    hidden_sizes.back() = w1.size(0);
    // relu(x W1^T + b1) in the GEMM's epilogue [rows, n c], seen as [*, n c]
    const at::Tensor rows = flat_rows(x, x.size(-1));  // [rows, c]
    const at::Tensor w1_t = raw_view(w1, {w1.size(1), w1.size(0)}, {w1.stride(1), w1.stride(0)}, w1.storage_offset());
    const at::Tensor h = raw_reshape(at::_addmm_activation(b1, rows, w1_t), hidden_sizes);
    const at::Tensor out = at::linear(h, w2, b2);  // [*, c_out]
    ctx->save_for_backward({x, w1, h, w2});
    ctx->saved_data["b1_dtype"] = b1.scalar_type();
    ctx->saved_data["b2_dtype"] = b2.scalar_type();
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w1 = saved[1], &h = saved[2], &w2 = saved[3];
    const auto need = [&](int i) { return ctx->needs_input_grad(i); };
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
                             const at::Tensor& b2) {
  return TransitionNode::apply(x, w1, b1, w2, b2);
}

}  // namespace
}  // namespace modules
}  // namespace evoformer

// (schemas: evoformer_blocks/ops/_fused.py) One kernel for every dispatch key: each node records itself
// where autograd needs it (torch::autograd::Function), so the ops have no separate autograd kernel.
TORCH_LIBRARY_IMPL(evoformer_blocks_cuda, CompositeImplicitAutograd, m) {
  m.impl("gated_attention_module", &evoformer::modules::gated_attention_module);
  m.impl("transition_module", &evoformer::modules::transition_module);
}
