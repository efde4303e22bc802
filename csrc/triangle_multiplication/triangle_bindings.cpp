// Op kernels (TORCH_LIBRARY_IMPL) of the triangle multiplicative update, forward and backward: the
// fused input and output halves (triangle.h) where they run, else the layer norms (layer_norm_ops.h),
// the edges' gates (gate_pack) and the sigmoid gate, with PyTorch's products between them.
// The Python ops (evoformer_blocks.ops) validate the arguments; the checks here only guard the
// kernels' memory accesses for direct torch.ops calls.
//
// Ops (namespace evoformer_blocks_cuda, declared in evoformer_blocks/ops/_fused.py), CUDA only:
//   triangle_multiplication_fwd(z [B, N, N, c_z], mask? [B, N, N], weights[10], eps, outgoing, family,
//                               for_backward=True, add_input=False, update_scale?)
//       -> (out [B, N, N, c_z], mean_in, rstd_in [M], a, b [c, M], n_hat [M, c], rstd_out [M], g [M, c_z],
//           the folded w_ab [4 c, c_z], b_ab [4 c] fp32, w_g [c_z, c_z], w_z [c_z, c], b_z [c_z]);
//       for_backward=False (a forward no backward follows): n_hat, which only the backward reads, is
//       an empty tensor [0] (the fused output kernel does not write it); add_input=True: out is
//       z + the update (times update_scale [B, 1, N, c_z] where given), added as the output kernel
//       writes it where that kernel runs
//   triangle_multiplication_bwd(dout, z, mask?, weights[10], saved[12] (the forward's outputs after out),
//       eps, outgoing, dz_add?, family) -> [dz, one gradient per weight, in that weight's dtype]; dz_add
//       (z's shape and dtype: another gradient of z, e.g. of the residual stream it also feeds) is added
//       to dz in the input layer norm's backward pass, before its one rounding
// M = B * N * N positions; c = the hidden width of the a / b edges; weights as TriangleWeight lists
// them; family "sm90" runs the Hopper input kernel (triangle_input_sm90.cuh) and, where it fits, the
// Hopper gate backward (triangle_gate_backward_sm90.cuh), "sm80" the portable ones. The layer norms' affine parameters are folded into the projections that follow them
// (fold(), one launch), so the kernels normalise without parameters; the backward reuses the
// forward's folded weights.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/block_bindings.h"
#include "gating/gating.h"
#include "gating/gating_ops.h"
#include "layer_norm/layer_norm.h"
#include "layer_norm/layer_norm_ops.h"
#include "triangle_multiplication/triangle.h"
#include "triangle_multiplication/triangle_ops.h"

namespace evoformer {
namespace block {
namespace {

struct TriangleShape {
  int64_t B, N, M, cz, c;
};

TriangleShape triangle_shape(const at::Tensor& z, const at::Tensor& w_ab, const char* op) {
  check_cuda(z, "z", op);
  EVO_CHECK(z.dim() == 4 && z.size(1) == z.size(2), op, ": `z` must be [B, N, N, c_z], got ", z.sizes());
  EVO_CHECK(w_ab.dim() == 2 && w_ab.size(0) % 4 == 0 && w_ab.size(1) == z.size(3) &&
                w_ab.scalar_type() == z.scalar_type(),
            op, ": `w_ab` must be [4 c, c_z] in z's dtype, got ", w_ab.sizes(), " ", w_ab.scalar_type());
  const int64_t B = z.size(0), N = z.size(1);
  return {B, N, B * N * N, z.size(3), w_ab.size(0) / 4};
}

// Channels per step of the backward's edge loop: all of them while a [4 * group, M] temporary stays
// within 64 MiB (one step: fewest launches at small N), else half of them (a multiple of 8; two
// steps either way, and at c = 128 the group of 64 the Hopper gate backward takes). A step
// holds da, db [group, M] and d(ab) [4 group, M]; at c = 128 half takes 3 M * 128 * 2 bytes more than
// a quarter did, which the y no longer kept between forward and backward ([M, c_z]) pays for at
// c_z = 128 to within M * 128 bytes. Fewer steps mean fewer read-add-writes of dx_hat (one per step)
// and larger batches for the products' gradients.
int64_t channel_group(const TriangleShape& s, int64_t element_size) {
  const int64_t half = std::min<int64_t>(s.c, std::max<int64_t>(8, s.c / 2 / 8 * 8));
  const int64_t budget = (int64_t(64) << 20) / std::max<int64_t>(1, 4 * s.M * element_size);
  return budget / 8 * 8 >= s.c ? s.c : half;
}

bool vector_ok(const at::Tensor& t, int64_t row_stride) {
  return aligned16(t) && row_stride * t.element_size() % 16 == 0;
}

// mask [B, N, N] as a flat [M] tensor of z's dtype, or an undefined tensor.
at::Tensor flat_mask(const std::optional<at::Tensor>& mask, const at::Tensor& z, int64_t M) {
  if (!mask.has_value()) return at::Tensor();
  EVO_CHECK(mask->numel() == M && mask->device() == z.device(),
            "triangle multiplication: `mask` must be [B, N, N] on z's device, got ", mask->sizes());
  return raw_reshape(as_dtype(*mask, z.scalar_type()).contiguous(), {M});
}

// The per-channel triangle products of [c * B, N, N] edge stacks (channel-major a and b):
// outgoing p[i, j] = sum_k a[i, k] b[j, k]; incoming p[i, j] = sum_k a[k, i] b[k, j].
at::Tensor triangle_product(const at::Tensor& a, const at::Tensor& b, bool outgoing) {
  return outgoing ? at::bmm(a, raw_transpose(b)) : at::bmm(raw_transpose(a), b);
}

// Which halves run as fused kernels, decided once per op call (forward and backward decide alike).
// The input half (triangle_input.cuh, both ways): z half or bfloat16, c_z <= limits::kTriangleInputMaxK
// (c_z and c are multiples of 8 already; z rows 16-byte aligned after as_rows). The output half
// (triangle_output.cuh, both ways): the input half's conditions, c <= limits::kTriangleOutputMaxC and
// c_z <= limits::kTriangleOutputMaxG. Each also needs its kernels' shared memory within what a CTA may
// have on z's device (the caller's device guard makes it the current one).
struct FusedHalves {
  bool input, output;
};
FusedHalves fused_halves(const at::Tensor& z, const TriangleShape& s) {
  const bool shapes =
      (z.scalar_type() == at::kHalf || z.scalar_type() == at::kBFloat16) && s.cz <= limits::kTriangleInputMaxK;
  if (!shapes) return {false, false};
  const int limit = max_dynamic_smem("triangle multiplication");
  const bool input = triangle_input_half_smem_bytes(int(s.cz)) <= limit;
  return {input, input && s.c <= limits::kTriangleOutputMaxC && s.cz <= limits::kTriangleOutputMaxG &&
                     triangle_output_half_smem_bytes(int(s.c)) <= limit};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
triangle_forward_folded(const at::Tensor& z, const std::optional<at::Tensor>& mask, const at::Tensor& w_ab,
                            const at::Tensor& b_ab, const at::Tensor& w_g, const at::Tensor& b_g,
                            const at::Tensor& w_z, const at::Tensor& b_z, double eps, bool outgoing, bool hopper,
                            bool for_backward, bool add_input, const std::optional<at::Tensor>& update_scale) {
  const char* op = "triangle multiplication";
  const TriangleShape s = triangle_shape(z, w_ab, op);
  const c10::cuda::CUDAGuard guard(z.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t vec = 16 / z.element_size();
  EVO_CHECK(s.cz % vec == 0 && s.c % vec == 0, op, ": c_z and c must be multiples of ", vec);
  const at::Tensor mask_flat = flat_mask(mask, z, s.M);

  at::Tensor mean_in, rstd_in, g;
  at::Tensor a = output({s.c, s.M}, z.options()), b = output({s.c, s.M}, z.options());
  const auto f32 = z.options().dtype(at::kFloat);
  const at::Tensor bias = as_dtype(b_ab, at::kFloat).contiguous();
  const FusedHalves fused = fused_halves(z, s);
  if (fused.input) {
    // one kernel: layer norm, both edges' projections and gates, g's projection (triangle_input.cuh)
    const at::Tensor rows = as_rows(z, s.cz);  // [M, c_z]
    mean_in = output({s.M}, f32), rstd_in = output({s.M}, f32);
    g = output({s.M, s.cz}, z.options());
    TriangleInputParams tp{rows.data_ptr(), w_ab.data_ptr(), bias.data_ptr<float>(), w_g.data_ptr(),
                                 b_g.data_ptr(), mask_flat.defined() ? mask_flat.data_ptr() : nullptr,
                                 a.data_ptr(), b.data_ptr(), g.data_ptr(), mean_in.data_ptr<float>(),
                                 rstd_in.data_ptr<float>(), s.M, s.M > 1 ? rows.stride(0) : s.cz, int(s.cz), int(s.c),
                                 int(s.cz), float(eps), s.M % 8 == 0 && aligned16(a) && aligned16(b)};
    tp.c_rows = int(s.c);
    tp.hopper = hopper && aligned16(bias) && aligned16(b_g);  // (the Hopper kernel copies the biases 16 bytes at a time)
    tp.sm_count = current_sm_count();
    if (z.scalar_type() == at::kHalf) launch_triangle_input<cutlass::half_t>(tp, stream);
    else launch_triangle_input<cutlass::bfloat16_t>(tp, stream);
  } else {
    // x_hat = normalised z rows [M, c_z] (the affine parameters are folded into the weights)
    at::Tensor x_hat;
    std::tie(x_hat, mean_in, rstd_in) = norm_rows(z, kNoParam, kNoParam, eps);
    // projections and gates of both edges, channel-major: [4 c, M] = w_ab [4 c, c_z] . x_hat^T
    at::Tensor ab = at::mm(w_ab, raw_transpose(x_hat));
    const GatePackParams gp{ab.data_ptr(), bias.data_ptr<float>(),
                            mask_flat.defined() ? mask_flat.data_ptr() : nullptr, a.data_ptr(), b.data_ptr(), s.M,
                            s.M, s.M, int(s.c), vector_ok(ab, s.M)};
    by_dtype(z.scalar_type(), op, [&](auto e) { launch_gate_pack<decltype(e)>(gp, stream); });
    ab.reset();
    g = at::addmm(b_g, x_hat, raw_transpose(w_g));  // [M, c_z]
  }

  // p [c * B, N, N] = the triangle products of every (channel, batch); then normalised over channels
  const at::Tensor p =
      triangle_product(raw_reshape(a, {s.c * s.B, s.N, s.N}), raw_reshape(b, {s.c * s.B, s.N, s.N}), outgoing);
  const bool fused_output = fused.output;
  // n_hat [M, c]: the backward's (and the unfused output half's own intermediate)
  at::Tensor n_hat = for_backward || !fused_output ? output({s.M, s.c}, z.options()) : new_empty({0}, z.options());
  at::Tensor rstd_out = output({s.M}, f32);
  at::Tensor out = output({s.M, s.cz}, z.options());
  // With add_input, out = z + update (* update_scale [B, 1, N, c_z]): in the output kernel's stores where z
  // and the scale lie as it reads them, else by one more pass below.
  // (the caller checked the scale's shape, dtype and device)
  const bool scale_fits = !update_scale.has_value() || (update_scale->is_contiguous() && aligned16(*update_scale));
  const bool add_in_kernel = add_input && fused_output && z.is_contiguous() && aligned16(z) && scale_fits;
  if (fused_output) {
    // one kernel: the channel layer norm, y = n_hat . w_z^T + b_z and out = sigmoid(g) * y (y is
    // not kept: the backward recomputes it from n_hat)
    TriangleOutputParams op_params{p.data_ptr(), g.data_ptr(), w_z.data_ptr(), b_z.data_ptr(), out.data_ptr(),
                                   for_backward ? n_hat.data_ptr() : nullptr, rstd_out.data_ptr<float>(), s.M, int(s.c),
                                   int(s.cz), float(eps), vector_ok(p, s.M)};
    op_params.sm_count = current_sm_count();
    if (add_in_kernel) {
      op_params.residual = z.data_ptr();
      op_params.scale = update_scale.has_value() ? update_scale->data_ptr() : nullptr;
      op_params.n_res = s.N;
    }
    if (z.scalar_type() == at::kHalf) launch_triangle_output<cutlass::half_t>(op_params, stream);
    else launch_triangle_output<cutlass::bfloat16_t>(op_params, stream);
  } else {
    at::Tensor mean_out = output({s.M}, f32);
    const ChannelNormParams cp{p.data_ptr(), n_hat.data_ptr(), mean_out.data_ptr<float>(),
                               rstd_out.data_ptr<float>(), s.M, s.M, s.c, int(s.c), vector_ok(p, s.M), float(eps)};
    by_dtype(z.scalar_type(), op, [&](auto e) { launch_layer_norm_channels<decltype(e)>(cp, stream); });
    // y = n_hat . w_z^T + b_z, out = sigmoid(g) * y   [M, c_z]
    const at::Tensor y = at::addmm(b_z, n_hat, raw_transpose(w_z));
    const SigmoidGateParams sp{g.data_ptr(), y.data_ptr(), out.data_ptr(), s.M, s.cz, s.cz, RowMap::strided(s.cz),
                               int(s.cz), vector_ok(g, s.cz) && vector_ok(y, s.cz) && vector_ok(out, s.cz)};
    by_dtype(z.scalar_type(), op, [&](auto e) { launch_sigmoid_gate<decltype(e)>(sp, stream); });
  }
  if (add_input && !add_in_kernel) {
    const at::Tensor update = raw_reshape(out, z.sizes());
    out = update_scale.has_value() ? at::addcmul(z, update, *update_scale) : at::add(z, update);
  }
  return {raw_reshape(out, z.sizes()), mean_in, rstd_in, a, b, n_hat, rstd_out, g};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
triangle_backward_folded(const at::Tensor& dout_in, const at::Tensor& z, const std::optional<at::Tensor>& mask,
                            const at::Tensor& w_ab, const at::Tensor& b_ab, const at::Tensor& w_g,
                            const at::Tensor& w_z, const at::Tensor& b_z, const at::Tensor& mean_in,
                            const at::Tensor& rstd_in, const at::Tensor& a, const at::Tensor& b,
                            const at::Tensor& n_hat, const at::Tensor& rstd_out, const at::Tensor& g, double eps,
                            bool outgoing, const std::optional<at::Tensor>& dz_add, bool hopper) {
  const char* op = "triangle multiplication backward";
  const TriangleShape s = triangle_shape(z, w_ab, op);
  EVO_CHECK(dout_in.sizes() == z.sizes() && dout_in.scalar_type() == z.scalar_type(), op,
            ": `dout` must match z, got ", dout_in.sizes());
  EVO_CHECK(a.sizes() == at::IntArrayRef({s.c, s.M}) && b.sizes() == a.sizes() &&
                n_hat.sizes() == at::IntArrayRef({s.M, s.c}) && g.sizes() == at::IntArrayRef({s.M, s.cz}) &&
                b_z.numel() == s.cz && rstd_out.numel() == s.M && rstd_in.numel() == s.M &&
                mean_in.numel() == s.M,
            op, ": saved tensors do not match z");
  const c10::cuda::CUDAGuard guard(z.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor dout = flat_rows(dout_in.contiguous(), s.cz);
  const at::Tensor mask_flat = flat_mask(mask, z, s.M);
  const auto f32 = z.options().dtype(at::kFloat);

  // The output half: out = sigmoid(g) * y, y = n_hat . w_z^T + b_z (recomputed: the forward does not
  // keep it), n_hat = the channel layer norm of p. dg, dy [M, c_z], their column sums (the biases'
  // gradients, added in a fixed order by the kernels' last CTAs), dw_z, and dp [c, M] channel-major.
  // dg is the first c_z columns of dg_ab [M, c_z + 4 group], whose others take the first channel
  // group's dab (the edges, below), so that dx_hat's terms dg w_g + dab w_k and the gradients of w_g
  // and of the group's rows of w_ab each come from one GEMM (rows padded to a multiple of 8).
  const int64_t group = channel_group(s, z.element_size()), first = std::min(group, s.c);
  const auto padded = [](int64_t n) { return (n + 7) / 8 * 8; };
  at::Tensor dg_ab =
      raw_narrow(output({s.M, padded(s.cz + 4 * first)}, z.options()), 1, 0, s.cz + 4 * first);  // [M, c_z + 4 group]
  at::Tensor dg = raw_narrow(dg_ab, 1, 0, s.cz), dy = output({s.M, s.cz}, z.options());           // [M, c_z] each
  at::Tensor dp = output({s.c, s.M}, z.options());
  at::Tensor db_z = output({s.cz}, f32), db_g = output({s.cz}, f32);
  if (s.M == 0) db_z.zero_(), db_g.zero_();
  at::Tensor dw_z;
  const FusedHalves fused = fused_halves(z, s);
  if (fused.output) {
    // one kernel: y, the gate's backward, dn_hat = dy . w_z and the channel layer norm's backward
    const int64_t ctas = (s.M + limits::kTriangleTileRows - 1) / limits::kTriangleTileRows;
    PartialSums sums(ctas, 2 * s.cz, f32, param_tensor(db_z), param_tensor(db_g), stream);
    TriangleOutputBackwardParams ob{n_hat.data_ptr(), w_z.data_ptr(), b_z.data_ptr(), g.data_ptr(),
                                    dout.data_ptr(), rstd_out.data_ptr<float>(), dg.data_ptr(), dy.data_ptr(),
                                    dp.data_ptr(), sums.data(), sums.data() + ctas * s.cz, sums.totals, s.M,
                                    int(s.c), int(s.cz), vector_ok(dp, s.M), dg.stride(0)};
    if (z.scalar_type() == at::kHalf) launch_triangle_output_backward<cutlass::half_t>(ob, stream);
    else launch_triangle_output_backward<cutlass::bfloat16_t>(ob, stream);
    dw_z = rows_product(raw_transpose(dy), n_hat);  // [c_z, c]
    dy.reset();
  } else {
    at::Tensor y = at::addmm(b_z, n_hat, raw_transpose(w_z));
    const int gate_threads = row_threads_for(s.cz, z.element_size());
    const int gate_ctas = row_norm_ctas(s.M, gate_threads);
    PartialSums sums(gate_ctas, 2 * s.cz, f32, param_tensor(db_z), param_tensor(db_g), stream);
    float* const dy_part = sums.data();  // [gate_ctas, c_z] each
    float* const dg_part = dy_part + int64_t(gate_ctas) * s.cz;
    at::Tensor dg_rows = output({s.M, s.cz}, z.options());  // (copied into dg's columns of dg_ab)
    SigmoidGateBackwardParams sp{g.data_ptr(), y.data_ptr(), dout.data_ptr(), dg_rows.data_ptr(), dy.data_ptr(),
                                 dg_part, dy_part, s.M, s.cz, s.cz, s.cz, RowMap::strided(s.cz), int(s.cz),
                                 gate_threads};
    sp.totals = sums.totals;
    by_dtype(z.scalar_type(), op, [&](auto e) { launch_sigmoid_gate_backward<decltype(e)>(sp, gate_ctas, stream); });
    y.reset();
    dg.copy_(dg_rows);
    dg_rows.reset();
    dw_z = rows_product(raw_transpose(dy), n_hat);  // [c_z, c]
    at::Tensor dn = at::mm(dy, w_z);  // [M, c]
    dy.reset();
    const ChannelNormBackwardParams cp{dn.data_ptr(), n_hat.data_ptr(), rstd_out.data_ptr<float>(), dp.data_ptr(),
                                       s.M, s.c, s.c, s.M, int(s.c), vector_ok(dp, s.M)};
    by_dtype(z.scalar_type(), op, [&](auto e) { launch_layer_norm_channels_backward<decltype(e)>(cp, stream); });
  }

  // x_hat again (its statistics are recomputed too: the same kernel as the forward)
  at::Tensor x_hat = std::get<0>(norm_rows(z, kNoParam, kNoParam, eps));  // [M, c_z]

  // The edges, a group of channels at a time so that the [M, 4 * group] temporaries stay small:
  // da, db from the triangle products' gradients, then the gates' backward on the recomputed
  // projections, then the projection weights' and x_hat's gradients (the first group's together
  // with g's: g = x_hat . w_g^T + b_g).
  const at::Tensor bias = raw_reshape(as_dtype(b_ab, at::kFloat).contiguous(), {4, s.c});
  const at::Tensor w4 = reshaped(w_ab, {4, s.c, s.cz});
  at::Tensor dw_ab = first < s.c ? output({4, s.c, s.cz}, w_ab.options()) : at::Tensor();  // (one group: below)
  // the gate kernels' row sums [4, c] (one group through the fused gate kernel: its sums themselves, below)
  const bool fused_gates = fused.input;
  at::Tensor db_ab = s.M == 0                        ? at::zeros({4, s.c}, f32)
                     : first < s.c || !fused_gates ? output({4, s.c}, f32)
                                                   : at::Tensor();
  at::Tensor dx, dw_g;  // [M, c_z], [c_z, c_z]
  for (int64_t c0 = 0; c0 < s.c; c0 += group) {
    const int64_t k = std::min(group, s.c - c0);
    // channels [c0, c0 + k) of a contiguous [c, M] tensor as [k B, N, N]
    const auto stack = [&](const at::Tensor& t) {
      return t.is_contiguous() ? raw_view(t, {k * s.B, s.N, s.N}, {s.N * s.N, s.N, 1}, t.storage_offset() + c0 * s.M)
                               : raw_narrow(t, 0, c0, k).reshape({k * s.B, s.N, s.N});
    };
    at::Tensor dpk = stack(dp), ak = stack(a), bk = stack(b);
    // outgoing p = a b^T: da = dp b, db = dp^T a;  incoming p = a^T b: da = b dp^T, db = a dp
    at::Tensor da = outgoing ? at::bmm(dpk, bk) : at::bmm(bk, raw_transpose(dpk));
    at::Tensor db = outgoing ? at::bmm(raw_transpose(dpk), ak) : at::bmm(ak, dpk);
    // rows (ap, ag, bp, bg) of the group [4 k, c_z] (w_ab itself for one group)
    at::Tensor wk = k == s.c ? reshaped(w_ab, {4 * k, s.cz}) : raw_narrow(w4, 1, c0, k).reshape({4 * k, s.cz});
    // [M, 4 k] per position (columns a_proj, a_gate, b_proj, b_gate x k): dg_ab's for the first group
    const at::Tensor dab = c0 == 0 ? raw_narrow(dg_ab, 1, s.cz, 4 * k)
                                   : raw_narrow(output({s.M, padded(4 * k)}, z.options()), 1, 0, 4 * k);
    if (fused_gates) {
      // the projections and gates recomputed from x_hat, their gradients and bias sums in one kernel
      // (bias_part: one row per CTA of its launch)
      const void* const w_group = static_cast<const char*>(w4.data_ptr()) + c0 * w4.stride(1) * w4.element_size();
      TriangleGateBackwardParams tp{x_hat.data_ptr(), w_group,
                                    bias.data_ptr<float>() + c0, mask_flat.defined() ? mask_flat.data_ptr() : nullptr,
                                    da.data_ptr(), db.data_ptr(), dab.data_ptr(), nullptr,
                                    s.M, s.M > 1 ? x_hat.stride(0) : s.cz, int(s.cz), int(k), int(s.c),
                                    s.M % 8 == 0 && aligned16(da) && aligned16(db)};
      tp.dab_ld = dab.stride(0);
      tp.dab_vector_ok = aligned16(dab) && dab.stride(0) % 8 == 0 && k % 8 == 0;
      tp.hopper = hopper;
      tp.sm_count = current_sm_count();
      at::Tensor bias_part = output({triangle_gate_backward_parts(tp), 4 * k}, f32);
      tp.bias_part = bias_part.data_ptr<float>();
      if (z.scalar_type() == at::kHalf) launch_triangle_gate_backward<cutlass::half_t>(tp, stream);
      else launch_triangle_gate_backward<cutlass::bfloat16_t>(tp, stream);
      // [4 k] in a fixed order (the column-sum kernel, or torch's sum where a row is too wide for it)
      const at::Tensor sums = row_fits(4 * k, 4) ? column_sum(bias_part, at::kFloat) : bias_part.sum(0);
      if (k == s.c) {
        db_ab = raw_reshape(sums.contiguous(), {4, k});  // (one group: all of db_ab)
      } else {
        raw_narrow(db_ab, 1, c0, k).copy_(raw_reshape(sums.contiguous(), {4, k}));  // this group's columns
      }
    } else {
      at::Tensor bk4 = raw_narrow(bias, 1, c0, k).contiguous();            // [4, k]
      at::Tensor abk = at::mm(wk, raw_transpose(x_hat));                   // [4 k, M]
      const int64_t spans = (s.M + 16 / z.element_size() - 1) / (16 / z.element_size());
      const int chunks = int(std::max<int64_t>(
          1, std::min<int64_t>((spans + kBlockOpThreads - 1) / kBlockOpThreads, 4 * current_sm_count() / (2 * k) + 1)));
      // [4 k, chunks] partial sums; a row's last CTA (of 2 k tickets) adds its partials into db_ab
      at::Tensor bias_part = output({4 * k * chunks}, f32);
      float* const partials = bias_part.data_ptr<float>();
      at::Tensor dab_rows = output({4 * k, s.M}, z.options());  // [4 k, M] (copied into dab per position)
      GatePackBackwardParams bp{abk.data_ptr(), bk4.data_ptr<float>(),
                                mask_flat.defined() ? mask_flat.data_ptr() : nullptr, da.data_ptr(), db.data_ptr(),
                                dab_rows.data_ptr(), partials, s.M, s.M, s.M, s.M, int(k),
                                vector_ok(abk, s.M) && vector_ok(da, s.M) && vector_ok(db, s.M) &&
                                    vector_ok(dab_rows, s.M)};
      at::Tensor fresh_tickets;
      bp.tickets = zeroed_tickets(2 * k, z.device(), stream, &fresh_tickets);
      bp.bias_total = db_ab.data_ptr<float>() + c0;  // [4, c] rows, this group's k columns
      bp.total_stride = s.c;
      by_dtype(z.scalar_type(), op, [&](auto e) { launch_gate_pack_backward<decltype(e)>(bp, chunks, stream); });
      dab.copy_(raw_transpose(dab_rows));
    }
    da.reset(), db.reset();
    // the group's rows of dw_ab (dw_g's before them for the first group), and x_hat's terms
    const at::Tensor dw_rows = rows_product(raw_transpose(c0 == 0 ? dg_ab : dab), x_hat);  // [(c_z +) 4 k, c_z]
    const at::Tensor dw_k = c0 == 0 ? raw_narrow(dw_rows, 0, s.cz, 4 * k) : dw_rows;       // [4 k, c_z]
    if (c0 == 0) dw_g = raw_narrow(dw_rows, 0, 0, s.cz);
    if (k == s.c) {
      dw_ab = raw_reshape(dw_k, {4, s.c, s.cz});  // one group: dw_ab itself
    } else {
      raw_view(dw_ab, {4, k, s.cz}, {s.c * s.cz, s.cz, 1}, dw_ab.storage_offset() + c0 * s.cz)
          .copy_(raw_reshape(dw_k, {4, k, s.cz}));
    }
    if (c0 == 0) {
      dx = at::mm(dg_ab, at::cat({w_g, wk}));  // dg w_g + dab w_k: [M, c_z]
      dg_ab.reset(), dg.reset();                 // (the loop's dab view goes with this iteration)
    } else {
      dx.addmm_(dab, wk);
    }
  }
  dp.reset();

  // x_hat = normalised z
  at::Tensor dz = std::get<0>(norm_rows_backward(dx, z, kNoParam, mean_in, rstd_in, false, at::kFloat,
                                                 dz_add.has_value() ? &*dz_add : nullptr));
  return {reshaped(dz, z.sizes()), raw_reshape(dw_ab, {4 * s.c, s.cz}), raw_reshape(db_ab, {4 * s.c}), dw_g, db_g, dw_z,
          db_z};
}

// The projections with the layer norms' affine parameters folded in (launch_fold_affine):
// LN(x) W^T + c = x_hat (W diag(w))^T + (W b + c), products in float32, rounded to z's dtype (the
// gates' bias b_ab stays float32: the gate kernel reads it so).
struct FoldedWeights {
  at::Tensor w_ab, b_ab, w_g, b_g, w_z, b_z;
};

void check_weights(at::TensorList weights, const at::Tensor& z, const char* op) {
  EVO_CHECK(weights.size() == kWeights, op, ": `weights` must hold ", int(kWeights), " tensors, got ",
            weights.size());
  for (const at::Tensor& t : weights) {
    EVO_CHECK(t.device() == z.device() && t.is_contiguous() && is_param_dtype(t),
              op, ": every weight must be a contiguous float16, bfloat16 or float32 tensor on z's device, got ",
              t.sizes(), " ", t.scalar_type());
  }
  const int64_t cz = z.size(-1), c4 = weights[kProjW].size(0);
  EVO_CHECK(weights[kProjW].dim() == 2 && c4 % 4 == 0 && weights[kProjW].size(1) == cz &&
                weights[kProjB].numel() == c4 && weights[kNormInW].numel() == cz && weights[kNormInB].numel() == cz &&
                weights[kGateW].numel() == cz * cz && weights[kGateB].numel() == cz &&
                weights[kNormOutW].numel() == c4 / 4 && weights[kNormOutB].numel() == c4 / 4 &&
                weights[kOutW].numel() == cz * c4 / 4 && weights[kOutB].numel() == cz,
            op, ": weight shapes do not match z's c_z = ", cz);
}

// The three projections behind a layer norm: (weight, bias, layer norm index 0 = in, 1 = out).
constexpr int kFoldedProjections[3][3] = {{kProjW, kProjB, 0}, {kGateW, kGateB, 0}, {kOutW, kOutB, 1}};
constexpr int kNormWeights[2][2] = {{kNormInW, kNormInB}, {kNormOutW, kNormOutB}};

FoldedWeights fold(at::TensorList w, const at::Tensor& z) {
  const auto dtype = z.options();
  const int64_t cz = z.size(-1), c = w[kProjW].size(0) / 4;
  FoldedWeights f;
  f.w_ab = output({4 * c, cz}, dtype), f.b_ab = output({4 * c}, dtype.dtype(at::kFloat));
  f.w_g = output({cz, cz}, dtype), f.b_g = output({cz}, dtype);
  f.w_z = output({cz, c}, dtype), f.b_z = output({cz}, dtype);
  const at::Tensor* outs[3][2] = {{&f.w_ab, &f.b_ab}, {&f.w_g, &f.b_g}, {&f.w_z, &f.b_z}};
  FoldParams p{};
  p.n_groups = 3;
  for (int g = 0; g < 3; ++g) {
    const at::Tensor& W = w[kFoldedProjections[g][0]];
    p.group[g] = FoldGroup{param_tensor(W), param_tensor(w[kFoldedProjections[g][1]]), param_tensor(*outs[g][0]),
                           param_tensor(*outs[g][1]), int(W.size(0)), int(W.size(1)), kFoldedProjections[g][2]};
  }
  for (int n = 0; n < 2; ++n) p.w[n] = param_tensor(w[kNormWeights[n][0]]), p.b[n] = param_tensor(w[kNormWeights[n][1]]);
  launch_fold_affine(p, c10::cuda::getCurrentCUDAStream());
  return f;
}


}  // namespace

TriangleForward triangle_multiplication_fwd(const at::Tensor& z, const std::optional<at::Tensor>& mask,
                                            at::TensorList weights, double eps, bool outgoing,
                                            const std::string& family, bool for_backward, bool add_input,
                                            const std::optional<at::Tensor>& update_scale) {
  const char* op = "triangle multiplication";
  check_cuda(z, "z", op);
  EVO_CHECK(z.dim() == 4, op, ": `z` must be [B, N, N, c_z], got ", z.sizes());
  EVO_CHECK(!update_scale.has_value() ||
                (add_input && update_scale->device() == z.device() && update_scale->scalar_type() == z.scalar_type() &&
                 update_scale->sizes() == at::IntArrayRef({z.size(0), 1, z.size(2), z.size(3)})),
            op, ": `update_scale` goes with add_input and must be [B, 1, N, c_z] of z's dtype and device, got ",
            update_scale.has_value() ? update_scale->sizes() : at::IntArrayRef{});
  check_weights(weights, z, op);
  const bool hopper = hopper_family(family, z, op);
  const c10::cuda::CUDAGuard guard(z.device());
  const FoldedWeights f = fold(weights, z);
  auto [out, mean_in, rstd_in, a, b, n_hat, rstd_out, g] =
      triangle_forward_folded(z, mask, f.w_ab, f.b_ab, f.w_g, f.b_g, f.w_z, f.b_z, eps, outgoing, hopper, for_backward,
                              add_input, update_scale);
  // n_hat only for the backward (without it, [0] whether or not the output half used one)
  if (!for_backward) n_hat = new_empty({0}, z.options());
  return {out, mean_in, rstd_in, a, b, n_hat, rstd_out, g, f.w_ab, f.b_ab, f.w_g, f.w_z, f.b_z};
}

// Gradients of every parameter from those of the folded projections (launch_unfold_affine_grads):
// dW = dW' diag(w) + db' b^T, dw = colsum(dW' * W), db = W^T db', dc = db'; each in its weight's dtype.
// `saved` is the forward's outputs after `out`: mean_in, rstd_in, a, b, n_hat, rstd_out, g and the
// folded w_ab, b_ab, w_g, w_z, b_z.
std::vector<at::Tensor> triangle_multiplication_bwd(const at::Tensor& dout, const at::Tensor& z,
                                                    const std::optional<at::Tensor>& mask, at::TensorList weights,
                                                    at::TensorList saved, double eps, bool outgoing,
                                                    const std::optional<at::Tensor>& dz_add,
                                                    const std::string& family) {
  const char* op = "triangle multiplication backward";
  check_cuda(z, "z", op);
  const bool hopper = hopper_family(family, z, op);
  EVO_CHECK(!dz_add.has_value() || (dz_add->sizes() == z.sizes() && dz_add->scalar_type() == z.scalar_type() &&
                                    dz_add->device() == z.device()),
            op, ": `dz_add` must match z (", z.sizes(), ", ", z.scalar_type(), ")");
  EVO_CHECK(z.dim() == 4, op, ": `z` must be [B, N, N, c_z], got ", z.sizes());
  check_weights(weights, z, op);
  EVO_CHECK(saved.size() == 12, op, ": `saved` must hold the forward's 12 saved tensors, got ", saved.size());
  const at::Tensor &mean_in = saved[0], &rstd_in = saved[1], &a = saved[2], &b = saved[3], &n_hat = saved[4],
                   &rstd_out = saved[5], &g = saved[6], &w_ab = saved[7], &b_ab = saved[8], &w_g = saved[9],
                   &w_z = saved[10], &b_z = saved[11];
  EVO_CHECK(w_ab.sizes() == weights[kProjW].sizes() && b_ab.numel() == w_ab.size(0) && b_ab.scalar_type() == at::kFloat &&
                w_g.sizes() == weights[kGateW].sizes() && w_z.sizes() == weights[kOutW].sizes() &&
                w_g.scalar_type() == z.scalar_type() && w_z.scalar_type() == z.scalar_type() &&
                b_z.numel() == w_z.size(0) && b_z.scalar_type() == z.scalar_type(),
            op, ": the folded weights in `saved` do not match `weights`");
  const c10::cuda::CUDAGuard guard(z.device());
  auto [dz, dw_ab, db_ab, dw_g, db_g, dw_z, db_z] = triangle_backward_folded(
      dout, z, mask, w_ab, b_ab, w_g, w_z, b_z, mean_in, rstd_in, a, b, n_hat, rstd_out, g, eps, outgoing, dz_add,
      hopper);
  std::vector<at::Tensor> grads(kWeights);
  for (int i = 0; i < kWeights; ++i) grads[i] = output(weights[i].sizes(), weights[i].options());
  const at::Tensor* folded[3][2] = {{&dw_ab, &db_ab}, {&dw_g, &db_g}, {&dw_z, &db_z}};
  UnfoldParams p{};
  p.n_groups = 3, p.n_norms = 2;
  for (int k = 0; k < 3; ++k) {
    const int iw = kFoldedProjections[k][0], ib = kFoldedProjections[k][1];
    const at::Tensor& W = weights[iw];
    p.group[k] = UnfoldGroup{param_tensor(*folded[k][0]), param_tensor(*folded[k][1]), param_tensor(W),
                             param_tensor(grads[iw]), param_tensor(grads[ib]), int(W.size(0)), int(W.size(1)),
                             kFoldedProjections[k][2]};
  }
  for (int n = 0; n < 2; ++n) {
    const int iw = kNormWeights[n][0], ib = kNormWeights[n][1];
    p.w[n] = param_tensor(weights[iw]), p.b[n] = param_tensor(weights[ib]);
    p.dw[n] = param_tensor(grads[iw]), p.db[n] = param_tensor(grads[ib]);
    p.K[n] = int(weights[iw].numel());
  }
  launch_unfold_affine_grads(p, c10::cuda::getCurrentCUDAStream());
  std::vector<at::Tensor> out{dz};
  out.insert(out.end(), grads.begin(), grads.end());
  return out;
}

}  // namespace block
}  // namespace evoformer

// (schemas: evoformer_blocks/ops/_fused.py)
TORCH_LIBRARY_IMPL(evoformer_blocks_cuda, CUDA, m) {
  m.impl("triangle_multiplication_fwd", &evoformer::block::triangle_multiplication_fwd);
  m.impl("triangle_multiplication_bwd", &evoformer::block::triangle_multiplication_bwd);
}
