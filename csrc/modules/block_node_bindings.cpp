// One Evoformer block's update from C++: the node ops of the other files in this directory called in
// the order, and with the arguments, that evoformer_blocks/evoformer.py's _MSABlock._update calls
// them from Python when every module of the block runs its node (AF2's EvoformerBlock: the MSA
// column attention, the outer product mean after the MSA transition, no chunking), the updates'
// output-projection biases left to the add + layer norm after them as there. The autograd
// graph is the one the Python path records (the same nodes: each op below records its own; the pair
// transition's masked residual add is one node of the row kernel where the Python path calls
// torch.addcmul, whose values it gives), so results and gradients are equal bit for bit; what goes
// is the Python between the ops (about half of a small block's forward host time) and a slow pass.
// evoformer_blocks/evoformer.py decides when it may run: per input signature, after one call through
// Python in which all seventeen nodes ran.
//
// Op (namespace evoformer_blocks_cuda, declared in evoformer_blocks/ops/_fused.py), composite:
//   evoformer_block_module(Tensor m, Tensor z, Tensor msa_mask, Tensor pair_mask, Tensor row_mask_bias,
//                          Tensor column_mask_bias, Tensor start_mask_bias, Tensor end_mask_bias,
//                          Tensor?[] keeps, Tensor?[] params, float[] eps, int msa_heads, int pair_heads,
//                          bool end_transpose_head, str msa_family, str pair_family, str triangle_family)
//                          -> (Tensor, Tensor)
//     m [*, S, R, c_m], z [*, R, R, c_z]; the masks [*, S, R] and [*, R, R] (0/1 in m's and z's dtype);
//     the mask biases as each attention's module makes them, in the modules' orientation ([*, S, R],
//     [*, R, R]: the column attention and the ending node transpose theirs, as their modules do);
//     keeps: the five dropout keep-masks of EvoformerBlock.dropout_masks (None where off); params: the
//     block's parameters in the order of evoformer.py's _ONE_CALL_PARAMETERS (None for an absent bias);
//     eps: the ten layer norms' epsilons in BlockEps order and the outer product mean's; the families of
//     the MSA's and the pair's attentions and of the triangle multiplications' and the outer product
//     mean's tile kernels. Returns (m, z) after the block.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "common/bindings_common.h"
#include "gating/gating_ops.h"
#include "layer_norm/layer_norm_ops.h"
#include "modules/nodes.h"
#include "modules/triangle_parameters.h"

namespace evoformer {
namespace modules {
namespace {

using OptionalTensors = c10::List<std::optional<at::Tensor>>;

// The node ops' C++ signatures (their schemas: evoformer_blocks/ops/_fused.py).
using KeepingInputSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const OptionalTensor&,
                                                           const OptionalTensor&, double);
using AddNormSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const OptionalTensor&,
                                                      const OptionalTensor&, double, const OptionalTensor&,
                                                      const OptionalTensor&);
using GatedSig = at::Tensor(const at::Tensor&, const OptionalTensor&, const OptionalTensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptionalTensor&,
                            const OptionalTensor&, const at::Tensor&, const OptionalTensor&, const OptionalTensor&,
                            const OptionalTensor&, int64_t, bool, bool, double, const std::string&);
using TransitionSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const OptionalTensor&);
using OpmSig = at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const OptionalTensor&, double, const std::string&);
#define EVO_TRIANGLE_PARAMS                                                                                     \
  const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,              \
      const at::Tensor&, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&,                 \
      const OptionalTensor&, const at::Tensor&, const OptionalTensor&, const at::Tensor&, const at::Tensor&, \
      const at::Tensor&, const OptionalTensor&
using TriangleSig = at::Tensor(const at::Tensor&, const OptionalTensor&, EVO_TRIANGLE_PARAMS, double, bool,
                               const std::string&, bool, const OptionalTensor&);
using TriangleKeepingSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const OptionalTensor&,
                                                              EVO_TRIANGLE_PARAMS, double, bool, const std::string&);
#undef EVO_TRIANGLE_PARAMS

// (each node op typed by its signature, found once; called through the dispatcher, so that profiles
// and dispatch modes see the calls the Python path makes)
#define EVO_NODE_OP(handle, Sig, name)                                                                   \
  const c10::TypedOperatorHandle<Sig>& handle() {                                                        \
    static const auto op =                                                                               \
        c10::Dispatcher::singleton().findSchemaOrThrow("evoformer_blocks_cuda::" name, "").typed<Sig>(); \
    return op;                                                                                           \
  }
EVO_NODE_OP(keeping_input_op, KeepingInputSig, "layer_norm_keeping_input_node")
EVO_NODE_OP(add_norm_op, AddNormSig, "add_layer_norm_node")
EVO_NODE_OP(gated_op, GatedSig, "gated_attention_module")
EVO_NODE_OP(transition_op, TransitionSig, "transition_module")
EVO_NODE_OP(opm_op, OpmSig, "outer_product_mean_module")
EVO_NODE_OP(triangle_op, TriangleSig, "triangle_multiplication_module")
EVO_NODE_OP(triangle_keeping_op, TriangleKeepingSig, "triangle_multiplication_keeping_input_module")
#undef EVO_NODE_OP
EVO_OP_HANDLE(layer_norm_forward_op, "layer_norm_fwd", block::layer_norm_fwd)

// Positions in `eps` (evoformer_blocks/evoformer.py's _ONE_CALL_EPS lists the same modules).
enum BlockEps : int {
  eRowM, eRowZ, eColumn, eMsaTransition, eOpmNorm, eTriangleOut, eTriangleIn, eStart, eEnd, ePairTransition,
  eOpm, kBlockEps
};
// Parameters per module, in the order evoformer.py's _ONE_CALL_PARAMETERS lists them.
constexpr int kRowParams = 13, kColumnParams = 10, kTransitionParams = 6, kOpmParams = 8, kTriangleParams = 16,
              kTriangleAttentionParams = 11;
constexpr int kBlockParams = kRowParams + kColumnParams + 2 * kTransitionParams + kOpmParams + 2 * kTriangleParams +
                             2 * kTriangleAttentionParams;

// Reads `params` in order.
class Params {
 public:
  explicit Params(const OptionalTensors& list) : list_(list) {}
  OptionalTensor optional() { return list_.get(next_++); }
  at::Tensor tensor() {
    const OptionalTensor t = optional();
    EVO_CHECK(given(t), "evoformer block module: parameter ", next_ - 1, " is missing");
    return *t;
  }
  // a layer norm's weight or bias as the row kernels read it (ops/_fused.py's kernel_parameter:
  // float16, bfloat16 or float32, contiguous)
  OptionalTensor layer_norm() {
    OptionalTensor t = optional();
    if (!given(t)) return t;
    at::Tensor p = *t;
    const at::ScalarType dtype = p.scalar_type();
    if (dtype != at::kHalf && dtype != at::kBFloat16 && dtype != at::kFloat) p = p.to(at::kFloat);
    return p.contiguous();
  }

 private:
  const OptionalTensors& list_;
  size_t next_ = 0;
};

// ops.layer_norm_keeping_input on the cutlass backend for a contiguous x: its node where gradients are
// recorded, else x and the layer norm's forward.
std::tuple<at::Tensor, at::Tensor> keeping_input(const at::Tensor& x, Params& p, double eps) {
  const OptionalTensor weight = p.layer_norm(), bias = p.layer_norm();
  if (at::GradMode::is_enabled()) return keeping_input_op().call(x, weight, bias, eps);
  return {x, std::get<0>(layer_norm_forward_op().call(x, weight, bias, eps))};
}

// An update before its output projection's bias, and that bias (None where the projection has none):
// the next add_and_norm adds it (as evoformer.py's _MSABlock._module_update passes a module's
// linear_o or linear_2 bias to its add_and_norm).
struct Update {
  at::Tensor value;
  OptionalTensor bias;
};

// evoformer.add_and_norm: (x + (update + its bias) (* scale), its layer norm) by the add + layer norm node.
std::tuple<at::Tensor, at::Tensor> add_and_norm(const at::Tensor& x, const Update& update, Params& p, double eps,
                                                const OptionalTensor& scale) {
  const OptionalTensor weight = p.layer_norm(), bias = p.layer_norm();
  return add_norm_op().call(x, update.value, weight, bias, eps, scale, update.bias);
}

// A gated attention module's node on x [*, A, A', c] (normalised), its output projection's bias left
// to the next add_and_norm; the module's parameters from p: q, k, v, g, b_q, b_g, o, b_o; head_weight
// and pair_source as the module passes them.
Update gated(const at::Tensor& x, const at::Tensor& mask_bias, Params& p, const OptionalTensor& head_weight,
             const OptionalTensor& pair_source, int64_t heads, bool transposed, bool transpose_head,
             const std::string& family) {
  const at::Tensor w_q = p.tensor(), w_k = p.tensor(), w_v = p.tensor(), w_g = p.tensor();
  const OptionalTensor b_q = p.optional(), b_g = p.optional();
  const at::Tensor w_o = p.tensor();
  const OptionalTensor b_o = p.optional();
  const double scale = 1.0 / std::sqrt(static_cast<double>(w_q.size(0) / heads));  // 1 / sqrt(D)
  return {gated_op().call(x, mask_bias, std::nullopt, w_q, w_k, w_v, w_g, b_q, b_g, w_o, std::nullopt, head_weight,
                          pair_source, heads, transposed, transpose_head, scale, family),
          b_o};
}

// A transition's node on x (normalised): linear_1 (weight, bias), linear_2 (weight, bias) from p;
// with `defer`, linear_2's bias is left to the next add_and_norm.
Update transition(const at::Tensor& x, Params& p, bool defer) {
  const at::Tensor w1 = p.tensor(), b1 = p.tensor(), w2 = p.tensor(), b2 = p.tensor();
  if (defer) return {transition_op().call(x, w1, b1, w2, std::nullopt), b2};
  return {transition_op().call(x, w1, b1, w2, b2), std::nullopt};
}

// z + update * mask with one mask value per row (at::addcmul's values on the mask broadcast over c_z, bit for
// bit, in one pass of the row kernel), as an autograd node: z's gradient is dz itself and update's dz *
// mask (the row kernel again: AddcmulBackward's values); the mask gets none (callers pass one that needs none).
struct MaskedAddNode : public torch::autograd::Function<MaskedAddNode> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& z, const at::Tensor& update,
                            const at::Tensor& mask) {
    ctx->save_for_backward({mask});
    return block::row_scaled(update, mask, &z, false);  // [*, R, R, c_z]
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor mask = ctx->get_saved_variables()[0];
    at::Tensor dupdate;
    if (ctx->needs_input_grad(1)) dupdate = block::row_scaled(grads[0], mask, nullptr, false);
    return {ctx->needs_input_grad(0) ? grads[0] : at::Tensor(), dupdate, at::Tensor()};
  }
};

// The pair transition's residual add, z + update * pair_mask (mask [*, R, R]): MaskedAddNode, or
// at::addcmul itself where the mask wants a gradient.
at::Tensor masked_add(const at::Tensor& z, const at::Tensor& update, const at::Tensor& mask) {
  if (mask.requires_grad()) return at::addcmul(z, update, mask.unsqueeze(-1));
  return MaskedAddNode::apply(z, update, mask);
}

// A triangle multiplication's parameters from p, in its node's order (a braced list reads them in order).
TriangleParameters triangle_parameters(Params& p) {
  return {p.tensor(),   p.tensor(),   p.tensor(),   p.tensor(),  p.tensor(),  p.tensor(),  // norm_in, a_p .. b_g
          p.optional(), p.optional(), p.optional(), p.optional(),                            // their biases
          p.tensor(),   p.optional(),                                                        // linear_g
          p.tensor(),   p.tensor(),   p.tensor(),   p.optional()};                           // norm_out, linear_z
}

std::tuple<at::Tensor, at::Tensor> evoformer_block_module(
    const at::Tensor& m_in, const at::Tensor& z_in, const at::Tensor& msa_mask, const at::Tensor& pair_mask,
    const at::Tensor& row_mask_bias, const at::Tensor& column_mask_bias, const at::Tensor& start_mask_bias,
    const at::Tensor& end_mask_bias, const OptionalTensors& keeps, const OptionalTensors& params,
    at::ArrayRef<double> eps, int64_t msa_heads, int64_t pair_heads, bool end_transpose_head,
    const std::string& msa_family, const std::string& pair_family, const std::string& triangle_family) {
  EVO_CHECK(params.size() == kBlockParams && keeps.size() == 5 && eps.size() == kBlockEps,
            "evoformer block module: expected ", kBlockParams, " parameters, 5 keep-masks and ", static_cast<int64_t>(kBlockEps),
            " epsilons, got ", static_cast<int64_t>(params.size()), ", ", static_cast<int64_t>(keeps.size()), " and ",
            static_cast<int64_t>(eps.size()));
  EVO_CHECK(m_in.dim() >= 3 && m_in.is_contiguous() && z_in.is_contiguous(),
            "evoformer block module: `m` and `z` must be contiguous, got m ", m_in.sizes(), " and z ", z_in.sizes());
  Params p(params);
  at::Tensor m, m_ln, z, z_ln;
  Update update;

  // m += MSARowAttentionWithPairBias(m, z) (its two layer norms keep their inputs: the residual streams)
  std::tie(m, m_ln) = keeping_input(m_in, p, eps[eRowM]);
  std::tie(z, z_ln) = keeping_input(z_in, p, eps[eRowZ]);
  const OptionalTensor row_head = p.tensor();  // linear_z: the pair bias from the normalised z
  update = gated(m_ln, row_mask_bias, p, row_head, z_ln, msa_heads, false, false, msa_family);
  // m += MSAColumnAttention(m), the row attention's update scaled by its dropout mask in the add
  std::tie(m, m_ln) = add_and_norm(m, update, p, eps[eColumn], keeps.get(0));
  update = gated(m_ln, column_mask_bias.transpose(-1, -2), p, std::nullopt, std::nullopt, msa_heads, true, false,
                 msa_family);  // (the bias [*, R, S]: column r attends over the sequences)
  // m += MSATransition(m), masked in the next add
  std::tie(m, m_ln) = add_and_norm(m, update, p, eps[eMsaTransition], std::nullopt);
  update = transition(m_ln, p, true);
  // z += OuterProductMean(m)
  std::tie(m, m_ln) = add_and_norm(m, update, p, eps[eOpmNorm], msa_mask.unsqueeze(-1));
  {
    const at::Tensor w1 = p.tensor(), b1 = p.tensor(), w2 = p.tensor(), b2 = p.tensor(), w_out = p.tensor();
    const OptionalTensor b_out = p.optional();
    z = opm_op().call(m_ln, msa_mask, z, w1, b1, w2, b2, w_out, b_out, eps[eOpm], triangle_family);
  }
  // z += TriangleMultiplicationOutgoing(z) (scaled by its dropout mask, added in its op)
  {
    const TriangleParameters t = triangle_parameters(p);
    z = triangle_op().call(z, pair_mask, t.norm_in_w, t.norm_in_b, t.w_ap, t.w_ag, t.w_bp, t.w_bg, t.b_ap, t.b_ag,
                           t.b_bp, t.b_bg, t.w_g, t.b_g, t.norm_out_w, t.norm_out_b, t.w_z, t.b_z, eps[eTriangleOut],
                           true, triangle_family, true, keeps.get(1));
  }
  // z += TriangleMultiplicationIncoming(z) (kept input; added in the next layer norm's add)
  {
    const TriangleParameters t = triangle_parameters(p);
    at::Tensor value;  // (its bias added in the op)
    std::tie(z, value) = triangle_keeping_op().call(z, pair_mask, t.norm_in_w, t.norm_in_b, t.w_ap, t.w_ag, t.w_bp,
                                                    t.w_bg, t.b_ap, t.b_ag, t.b_bp, t.b_bg, t.w_g, t.b_g, t.norm_out_w,
                                                    t.norm_out_b, t.w_z, t.b_z, eps[eTriangleIn], false,
                                                    triangle_family);
    update = {value, std::nullopt};
  }
  // z += TriangleAttentionStartingNode(z): the pair bias from its own normalised input
  std::tie(z, z_ln) = add_and_norm(z, update, p, eps[eStart], keeps.get(2));
  const OptionalTensor start_head = p.tensor();
  update = gated(z_ln, start_mask_bias, p, start_head, std::nullopt, pair_heads, false, false, pair_family);
  // z += TriangleAttentionEndingNode(z): along dim -3, its bias transposed (row j attends over i)
  std::tie(z, z_ln) = add_and_norm(z, update, p, eps[eEnd], keeps.get(3));
  const OptionalTensor end_head = p.tensor();
  update = gated(z_ln, end_mask_bias.transpose(-1, -2), p, end_head, std::nullopt, pair_heads, true,
                 end_transpose_head, pair_family);
  // z += PairTransition(z), masked in its residual add
  std::tie(z, z_ln) = add_and_norm(z, update, p, eps[ePairTransition], keeps.get(4));
  update = transition(z_ln, p, false);
  return {m, masked_add(z, update.value, pair_mask)};
}

}  // namespace
}  // namespace modules
}  // namespace evoformer

// (schema: evoformer_blocks/ops/_fused.py) One kernel for every dispatch key: the ops it calls record
// their nodes.
TORCH_LIBRARY_IMPL(evoformer_blocks_cuda, CompositeImplicitAutograd, m) {
  m.impl("evoformer_block_module", &evoformer::modules::evoformer_block_module);
}
