// Op kernels (TORCH_LIBRARY_IMPL) of the block ops: the layer norm (also behind a residual add), the triangle
// multiplicative update, the sigmoid gate of an output and the column sums of bias gradients,
// forward and backward. The Python
// ops (evoformer_blocks.ops) validate the arguments; the checks here only guard the kernels' memory
// accesses for direct torch.ops calls.
//
// Ops (namespace evoformer_blocks_cuda, declared in evoformer_blocks/ops/_fused.py), CUDA only:
//   layer_norm_fwd(x [..., C], weight?, bias?, eps) -> (y [..., C], mean [M], rstd [M])
//   layer_norm_bwd(dy, x, weight?, mean, rstd, need_affine, affine_dtype)
//       -> (dx, [2, C] in affine_dtype (a float type): the gradients of weight and bias, or [0] without
//           need_affine)
//   (weight and bias: contiguous float16, bfloat16 or float32, read in their own dtype)
//   add_layer_norm_fwd(x, residual, weight?, bias?, eps, residual_scale? (broadcasts to x))
//       -> (sum = x + residual (* residual_scale), layer_norm(sum), mean, rstd)
//   add_layer_norm_bwd(dsum, dy, sum, weight?, mean, rstd, need_affine, affine_dtype, residual_scale?)
//       -> (dsum + the layer norm's input gradient: the gradient of x (and of residual without a scale),
//           [2, C] as above, that gradient times residual_scale: the residual's (else empty))
//   triangle_multiplication_fwd(z [B, N, N, c_z], mask? [B, N, N], weights[10], eps, outgoing, family,
//                               for_backward=True, add_input=False, update_scale?)
//       -> (out [B, N, N, c_z], mean_in, rstd_in [M], a, b [c, M], n_hat [M, c], rstd_out [M], g [M, c_z],
//           the folded w_ab [4 c, c_z], b_ab [4 c] fp32, w_g [c_z, c_z], w_z [c_z, c], b_z [c_z]);
//       for_backward=False (a forward no backward follows): n_hat, which only the backward reads, is
//       an empty tensor [0] (the fused output kernel does not write it); add_input=True: out is
//       z + the update (times update_scale [B, 1, N, c_z] where given), added as the output kernel
//       writes it where that kernel runs
//   triangle_multiplication_bwd(dout, z, mask?, weights[10], saved[12] (the forward's outputs after out),
//       eps, outgoing, dz_add?) -> [dz, one gradient per weight, in that weight's dtype]; dz_add (z's
//       shape and dtype: another gradient of z, e.g. of the residual stream it also feeds) is added
//       to dz in the input layer norm's backward pass, before its one rounding
//   sigmoid_gate_fwd(g [..., C], y [..., C]) -> sigmoid(g) * y (contiguous; y may be a permuted view)
//   sigmoid_gate_bwd(dout, g, y) -> (dg contiguous, dy in y's layout)
//   sigmoid_gate_bwd_into(dout, g, y, dg, delta_heads=0, delta_len=0) -> (dy in y's layout, delta);
//       dg written into the given rows; with delta_heads (y the attention output [B, N, Lq, H, D]
//       seen in g's order), delta [B * N * H * Lq] = rowsum(dy * y) per head, or empty where the
//       kernel cannot sum it
//   column_sum(x [..., C], dtype) -> [C] in dtype: the float32 sum over rows (a projection's bias gradient)
//   opm_project(outer [B, I, C, J, C], weight [Z, C C], bias? [Z], denom? [B, I, J], residual? [B, I, J, Z])
//       -> [B, I, J, Z]: the outer product mean's linear_out on its [i, c, j, e] intermediate (no
//       [i, j, c, e] copy), divided by denom and added to residual where given (both in outer's dtype);
//       C = 32, Z a multiple of 128, float16 or bfloat16, weight and bias rounded to outer's dtype
//   opm_project_input_grad(dout [B, I, J, Z], weight [Z, C C]) -> [B, I, C, J, C]: its input gradient
//   opm_project_weight_grad(dout [B, I, J, Z], outer [B, I, C, J, C], weight_dtype) -> [Z, C C]: its
//       weight gradient (Z at most 128), float32 partial sums added in a fixed order
//   linear_bwd(dy [..., out], x [..., in], weight [out, in], relu_out?, need_dx, need_dw, need_db, bias_dtype,
//              bias_from=0)
//       -> (dx, dweight, dbias) of x . weight^T + bias (then ReLU, relu_out its output), each [0] unless wanted;
//       bias [out - bias_from] adds to the columns from bias_from on (a stacked projection's biased part)
// M = B * N * N positions; c = the hidden width of the a / b edges; weights as TriangleWeight lists
// them; family "sm90" runs the Hopper input kernel (triangle_input_sm90.cuh), "sm80" the portable one. The layer norms' affine parameters are folded into the projections that follow them
// (fold(), one launch), so the kernels normalise without parameters; the backward reuses the
// forward's folded weights.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <cutlass/numeric_types.h>

#include "bindings_common.h"
#include "block_ops.h"

namespace evoformer {
namespace block {
namespace {

// Calls fn(T{}) with T the kernel element type of `dtype`.
template <typename Fn>
void by_dtype(at::ScalarType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case at::kHalf: fn(cutlass::half_t{}); break;
    case at::kBFloat16: fn(cutlass::bfloat16_t{}); break;
    case at::kFloat: fn(float{}); break;
    default: EVO_CHECK(false, op, ": tensors must be float16, bfloat16 or float32, got ", dtype);
  }
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// A new output tensor; filled with NaN first when EVOFORMER_BLOCKS_POISON is set, so that a test sees
// any element a kernel fails to write.
at::Tensor output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  maybe_poison(t);
  return t;
}

// Per-CTA partial sums [ctas, parts] float32 (parts floats per CTA), then the group partials and the
// tickets (zeroed on `stream`) of a kernel whose last CTAs add the partials into `out` (ColumnTotals).
struct PartialSums {
  at::Tensor part;
  ColumnTotals totals;

  PartialSums(int64_t ctas, int64_t parts, const at::TensorOptions& f32, ParamTensor out0, ParamTensor out1,
              cudaStream_t stream) {
    const int64_t groups = (ctas + kCtasPerSumGroup - 1) / kCtasPerSumGroup;
    part = output({(ctas + groups) * parts + groups + 1}, f32);  // [ctas + groups, parts], tickets [groups + 1]
    totals.group_part = part.data_ptr<float>() + ctas * parts;
    totals.tickets = reinterpret_cast<unsigned*>(totals.group_part + groups * parts);
    totals.out[0] = out0;
    totals.out[1] = out1;
    C10_CUDA_CHECK(cudaMemsetAsync(totals.tickets, 0, (groups + 1) * sizeof(unsigned), stream));
  }
  float* data() { return part.data_ptr<float>(); }
};

// Whether a [M, C] matrix has the row kernels' layout: C contiguous, every row 16-byte aligned.
bool aligned_rows(const at::Tensor& rows) {
  const int64_t vec = 16 / rows.element_size();
  return rows.stride(1) == 1 && (rows.size(0) <= 1 || rows.stride(0) % vec == 0) && aligned16(rows) &&
         rows.size(1) % vec == 0;
}

// x as [M, C] rows with C contiguous and 16-byte aligned rows (a copy only when the layout is not).
at::Tensor as_rows(const at::Tensor& x, int64_t C) {
  at::Tensor rows = x.reshape({-1, C});
  if (!aligned_rows(rows)) rows = rows.contiguous();
  return rows;
}

// Lanes per row of the row layer norm: a power of two covering the row's 16-byte chunks, at most 32.
int row_threads_for(int64_t C, int64_t element_size) {
  const int64_t chunks = C * element_size / 16;
  int t = 1;
  while (t < 32 && t < chunks) t *= 2;
  return t;
}

// Whether a row of C values fits the row kernels: whole chunks, at most kMaxRowChunks per lane
// (normalization.py's row_reasons states the same rule from kernel_table.json).
bool row_fits(int64_t C, int64_t element_size) {
  const int64_t bytes = C * element_size;
  return bytes % limits::kRowChunkBytes == 0 &&
         bytes <= int64_t(limits::kRowMaxLanes) * kMaxRowChunks * limits::kRowChunkBytes;
}

// CTAs of a row-kernel launch: one per group of rows, at most per_sm per SM (the backward's affine
// partials have one row per CTA).
int row_norm_ctas(int64_t M, int row_threads, int per_sm = kRowNormCtasPerSm) {
  const int64_t groups = (M + kBlockOpThreads / row_threads - 1) / (kBlockOpThreads / row_threads);
  return int(std::max<int64_t>(1, std::min<int64_t>(groups, int64_t(per_sm) * current_sm_count())));
}

void check_cuda(const at::Tensor& t, const char* name, const char* op) {
  EVO_CHECK(t.is_cuda(), op, ": `", name, "` must be a CUDA tensor, got ", t.device());
}

// ---- layer norm -------------------------------------------------------------------------------

constexpr ParamTensor kNoParam{nullptr, kParamFloat};

// The dtypes the block-op kernels read parameters in (ParamDtype).
bool is_param_dtype(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat; }
bool is_param_dtype(const at::Tensor& t) {
  return is_param_dtype(t.scalar_type());
}

ParamTensor param_tensor(const at::Tensor& t) {
  const int dtype = t.scalar_type() == at::kHalf       ? kParamHalf
                    : t.scalar_type() == at::kBFloat16 ? kParamBFloat16
                                                       : kParamFloat;
  return ParamTensor{t.data_ptr(), dtype};
}

// An optional [C] affine parameter as the kernels read it (absent: {nullptr}); the Python op passes
// contiguous float16/bfloat16/float32 tensors, checked here for direct calls.
ParamTensor optional_param(const std::optional<at::Tensor>& t, const at::Tensor& x, const char* name) {
  if (!t.has_value()) return kNoParam;
  EVO_CHECK(t->device() == x.device() && t->is_contiguous() && t->numel() == x.size(-1) && is_param_dtype(*t),
            "layer norm: `", name, "` must be a contiguous float16, bfloat16 or float32 [C] tensor on x's device, got ",
            t->sizes(), " ", t->scalar_type());
  return param_tensor(*t);
}

bool row_map_of(const at::Tensor& y, RowMap& map);  // (below)

// A residual's scale (any shape that broadcasts to x's; x's dtype and device) as the row kernels read
// it (RowNormParams::residual_scale): the caller's tensor expanded to x's shape where its rows fit a
// RowMap (a dropout mask shared along a dimension, a row mask), else a contiguous copy.
struct ScaleRows {
  at::Tensor values;  // what the kernel reads, kept alive through the launch
  RowMap rows;
  bool per_row;
};
ScaleRows scale_rows(const at::Tensor& scale, const at::Tensor& x, const char* op) {
  EVO_CHECK(scale.scalar_type() == x.scalar_type() && scale.device() == x.device() &&
                at::is_expandable_to(scale.sizes(), x.sizes()),
            op, ": `residual_scale` must broadcast to x's shape ", x.sizes(), " in x's dtype and device, got ",
            scale.sizes(), " ", scale.scalar_type());
  const at::Tensor e = scale.expand(x.sizes());
  const int64_t C = x.size(-1), vec = 16 / x.element_size();
  ScaleRows out{e, RowMap{}, C == 1 || e.stride(-1) == 0};
  bool mapped = row_map_of(e, out.rows);
  if (mapped && out.rows.mid == 1 && out.rows.s1 == 0 && out.rows.s2 == 0)
    out.rows = RowMap::strided(out.rows.s0);  // one level: no division
  mapped = mapped && (out.rows.inner == 0 || e.numel() / C <= INT32_MAX);  // the kernels' RowMap::small
  if (!out.per_row)  // whole rows of C values, read 16 bytes at a time
    mapped = mapped && e.stride(-1) == 1 && aligned16(e) && out.rows.s0 % vec == 0 && out.rows.s1 % vec == 0 &&
             out.rows.s2 % vec == 0;
  if (!mapped) {  // a copy: one value per row, or whole rows
    out.values = out.per_row ? e.select(-1, 0).contiguous() : e.contiguous();
    out.rows = RowMap::strided(out.per_row ? 1 : C);
  }
  return out;
}

// y = layer_norm(rows of x) and its statistics; x must have C % (16 bytes / element) == 0 (the op
// routes others to eager). With `residual` (x's shape and dtype), of the rows of x + residual instead
// (x + residual * residual_scale with a scale broadcasting to x), whose sum is written to `sum` (a new
// [M, C] tensor).
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_rows(const at::Tensor& x, ParamTensor weight, ParamTensor bias,
                                                         double eps, const at::Tensor* residual = nullptr,
                                                         at::Tensor* sum = nullptr,
                                                         const std::optional<at::Tensor>& residual_scale = {}) {
  const int64_t C = x.size(-1);
  at::Tensor rows = as_rows(x, C);  // [M, C]
  const int64_t M = rows.size(0);
  at::Tensor y = output({M, C}, rows.options());
  const auto f32 = rows.options().dtype(at::kFloat);
  at::Tensor mean = output({M}, f32), rstd = output({M}, f32);
  RowNormParams p{rows.data_ptr(), y.data_ptr(), weight, bias, mean.data_ptr<float>(), rstd.data_ptr<float>(),
                  M, M > 1 ? rows.stride(0) : C, C, int(C), row_threads_for(C, rows.element_size()), float(eps)};
  at::Tensor residual_rows;  // kept alive through the launch
  std::optional<ScaleRows> scale;
  if (residual != nullptr) {
    residual_rows = as_rows(*residual, C);  // [M, C]
    *sum = output({M, C}, rows.options());
    p.residual = residual_rows.data_ptr(), p.residual_stride = M > 1 ? residual_rows.stride(0) : C;
    p.sum = sum->data_ptr(), p.sum_stride = C;
    if (residual_scale.has_value()) {
      scale = scale_rows(*residual_scale, x, "add layer norm");
      p.residual_scale = scale->values.data_ptr(), p.scale_rows = scale->rows, p.scale_per_row = scale->per_row;
    }
  }
  const int per_sm = scale.has_value() ? kRowNormScaledCtasPerSm : kRowNormCtasPerSm;
  by_dtype(rows.scalar_type(), "layer norm", [&](auto element) {
    launch_layer_norm_rows<decltype(element)>(p, row_norm_ctas(M, p.row_threads, per_sm),
                                              c10::cuda::getCurrentCUDAStream());
  });
  return {y, mean, rstd};
}

// dx and, when affine_grad, the float32 sums over rows of dy * x_hat and of dy as one [2, C] tensor
// (else [0]) of norm_rows; with residual_scale (broadcasting to x_in), also dresidual = dx *
// residual_scale ([M, C]; else undefined).
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_rows_backward(
    const at::Tensor& dy_in, const at::Tensor& x_in, ParamTensor weight, const at::Tensor& mean,
    const at::Tensor& rstd, bool affine_grad, at::ScalarType affine_dtype = at::kFloat,
    const at::Tensor* dsum_in = nullptr, const std::optional<at::Tensor>& residual_scale = {}) {
  const int64_t C = x_in.size(-1);
  at::Tensor x = as_rows(x_in, C), dy = as_rows(dy_in, C);
  const int64_t M = x.size(0);
  at::Tensor dx = output({M, C}, x.options());
  const auto f32 = x.options().dtype(at::kFloat);
  const int row_threads = row_threads_for(C, x.element_size());
  const int ctas = row_norm_ctas(M, row_threads, kRowNormBackwardCtasPerSm);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto affine_options = x.options().dtype(affine_dtype);
  at::Tensor dresidual;
  std::optional<ScaleRows> scale;
  if (residual_scale.has_value()) {
    scale = scale_rows(*residual_scale, x_in, "add layer norm backward");
    dresidual = output({M, C}, x.options());
  }
  if (affine_grad && M == 0) return {dx, at::zeros({2, C}, affine_options), dresidual};
  at::Tensor affine = affine_grad ? output({2, C}, affine_options) : at::empty({0}, f32);  // (dweight, dbias)
  std::optional<PartialSums> sums;  // [ctas, (dweight, dbias), C], added by the last CTA into affine
  if (affine_grad) sums.emplace(ctas, 2 * C, f32, param_tensor(affine[0]), param_tensor(affine[1]), stream);
  RowNormBackwardParams p{x.data_ptr(), dy.data_ptr(), dx.data_ptr(), weight, mean.data_ptr<float>(),
                          rstd.data_ptr<float>(), affine_grad ? sums->data() : nullptr, M,
                          M > 1 ? x.stride(0) : C, M > 1 ? dy.stride(0) : C, C, int(C), row_threads};
  if (affine_grad) p.totals = sums->totals;
  at::Tensor dsum;  // another gradient of x, added to dx
  if (dsum_in != nullptr) {
    dsum = as_rows(*dsum_in, C);
    p.dsum = dsum.data_ptr(), p.dsum_stride = M > 1 ? dsum.stride(0) : C;
  }
  if (scale.has_value()) {
    p.residual_scale = scale->values.data_ptr(), p.scale_rows = scale->rows, p.scale_per_row = scale->per_row;
    p.dresidual = dresidual.data_ptr(), p.dresidual_stride = C;
  }
  by_dtype(x.scalar_type(), "layer norm backward",
           [&](auto element) { launch_layer_norm_rows_backward<decltype(element)>(p, ctas, stream); });
  return {dx, affine, dresidual};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(const at::Tensor& x,
                                                              const std::optional<at::Tensor>& weight,
                                                              const std::optional<at::Tensor>& bias, double eps) {
  check_cuda(x, "x", "layer norm");
  const c10::cuda::CUDAGuard guard(x.device());
  auto [y, mean, rstd] = norm_rows(x, optional_param(weight, x, "weight"), optional_param(bias, x, "bias"), eps);
  return {y.view(x.sizes()), mean, rstd};
}

std::tuple<at::Tensor, at::Tensor> layer_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                  const std::optional<at::Tensor>& weight, const at::Tensor& mean,
                                                  const at::Tensor& rstd, bool need_affine,
                                                  at::ScalarType affine_dtype) {
  check_cuda(x, "x", "layer norm backward");
  EVO_CHECK(is_param_dtype(affine_dtype),
            "layer norm backward: `affine_dtype` must be float16, bfloat16 or float32, got ", affine_dtype);
  EVO_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(),
            "layer norm backward: `dy` must match `x`, got ", dy.sizes(), " and ", x.sizes());
  EVO_CHECK(mean.numel() * x.size(-1) == x.numel() && rstd.numel() == mean.numel(),
            "layer norm backward: `mean` and `rstd` must hold one value per row of x");
  const c10::cuda::CUDAGuard guard(x.device());
  auto [dx, affine, unused] =
      norm_rows_backward(dy, x, optional_param(weight, x, "weight"), mean, rstd, need_affine, affine_dtype);
  return {dx.view(x.sizes()), affine};
}

// sum = x + residual (residual * residual_scale with a scale) and layer_norm(sum), in one pass over
// the rows (the residual add of a block, its update's mask or dropout, and the layer norm of the
// module after it).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_fwd(
    const at::Tensor& x, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, const std::optional<at::Tensor>& residual_scale) {
  check_cuda(x, "x", "add layer norm");
  EVO_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                residual.device() == x.device(),
            "add layer norm: `residual` must match x, got ", residual.sizes(), " ", residual.scalar_type());
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor sum;
  auto [y, mean, rstd] =
      norm_rows(x, optional_param(weight, x, "weight"), optional_param(bias, x, "bias"), eps, &residual, &sum,
                residual_scale);
  return {sum.view(x.sizes()), y.view(x.sizes()), mean, rstd};
}

// The backward of add_layer_norm_fwd: dx = dsum + the layer norm's input gradient (the gradient of
// x, and of residual without a scale), the weight and bias gradients as layer_norm_bwd returns them,
// and with residual_scale the residual's gradient dx * residual_scale (else an empty tensor).
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_layer_norm_bwd(
    const at::Tensor& dsum, const at::Tensor& dy, const at::Tensor& sum, const std::optional<at::Tensor>& weight,
    const at::Tensor& mean, const at::Tensor& rstd, bool need_affine, at::ScalarType affine_dtype,
    const std::optional<at::Tensor>& residual_scale) {
  check_cuda(sum, "sum", "add layer norm backward");
  EVO_CHECK(dsum.sizes() == sum.sizes() && dsum.scalar_type() == sum.scalar_type() && dy.sizes() == sum.sizes() &&
                dy.scalar_type() == sum.scalar_type(),
            "add layer norm backward: `dsum` and `dy` must match `sum`, got ", dsum.sizes(), " and ", dy.sizes());
  EVO_CHECK(mean.numel() * sum.size(-1) == sum.numel() && rstd.numel() == mean.numel(),
            "add layer norm backward: `mean` and `rstd` must hold one value per row of sum");
  EVO_CHECK(is_param_dtype(affine_dtype),
            "add layer norm backward: `affine_dtype` must be float16, bfloat16 or float32, got ", affine_dtype);
  const c10::cuda::CUDAGuard guard(sum.device());
  auto [dx, affine, dresidual] = norm_rows_backward(dy, sum, optional_param(weight, sum, "weight"), mean, rstd,
                                                    need_affine, affine_dtype, &dsum, residual_scale);
  return {dx.view(sum.sizes()), affine,
          dresidual.defined() ? dresidual.view(sum.sizes()) : at::empty({0}, sum.options())};
}

// ---- triangle multiplicative update ------------------------------------------------------------

at::Tensor column_sum(const at::Tensor& x_in, at::ScalarType dtype);  // (below)

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
// within 64 MiB (one step: fewest launches at small N), else half of them (a multiple of 8). A step
// holds da, db [group, M] and d(ab) [4 group, M]; at c = 128 half takes 3 M * 128 * 2 bytes more than
// a quarter did, which the y no longer kept between forward and backward ([M, c_z]) pays for at
// c_z = 128 to within M * 128 bytes. Fewer steps mean fewer read-add-writes of dx_hat (one per step)
// and larger batches for the products' gradients.
int64_t channel_group(const TriangleShape& s, int64_t element_size) {
  const int64_t half = std::min<int64_t>(s.c, std::max<int64_t>(8, s.c / 2 / 8 * 8));
  const int64_t budget = (int64_t(64) << 20) / std::max<int64_t>(1, 4 * s.M * element_size);
  return std::max(half, std::min(s.c, budget / 8 * 8));
}

bool vector_ok(const at::Tensor& t, int64_t row_stride) {
  return aligned16(t) && row_stride * t.element_size() % 16 == 0;
}

// mask [B, N, N] as a flat [M] tensor of z's dtype, or an undefined tensor.
at::Tensor flat_mask(const std::optional<at::Tensor>& mask, const at::Tensor& z, int64_t M) {
  if (!mask.has_value()) return at::Tensor();
  EVO_CHECK(mask->numel() == M && mask->device() == z.device(),
            "triangle multiplication: `mask` must be [B, N, N] on z's device, got ", mask->sizes());
  return mask->to(z.scalar_type()).contiguous().view({M});
}

// The per-channel triangle products of [c * B, N, N] edge stacks (channel-major a and b):
// outgoing p[i, j] = sum_k a[i, k] b[j, k]; incoming p[i, j] = sum_k a[k, i] b[k, j].
at::Tensor triangle_product(const at::Tensor& a, const at::Tensor& b, bool outgoing) {
  return outgoing ? at::bmm(a, b.transpose(1, 2)) : at::bmm(a.transpose(1, 2), b);
}

// Whether the fused input kernel takes z: half or bfloat16, c_z <= kTriangleInputMaxK (c_z and c are
// multiples of 8 already), z rows 16-byte aligned after as_rows.
bool triangle_input_fits(const at::Tensor& z, const TriangleShape& s) {
  return (z.scalar_type() == at::kHalf || z.scalar_type() == at::kBFloat16) && s.cz <= kTriangleInputMaxK;
}

// Whether the output half runs as one kernel each way (triangle_output.cuh).
bool triangle_output_fits(const at::Tensor& z, const TriangleShape& s) {
  return triangle_input_fits(z, s) && s.c <= kTriangleOutputMaxC && s.cz <= kTriangleOutputMaxG;
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
  const at::Tensor bias = b_ab.to(at::kFloat).contiguous();
  if (triangle_input_fits(z, s)) {
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
    if (z.scalar_type() == at::kHalf) launch_triangle_input<cutlass::half_t>(tp, stream);
    else launch_triangle_input<cutlass::bfloat16_t>(tp, stream);
  } else {
    // x_hat = normalised z rows [M, c_z] (the affine parameters are folded into the weights)
    at::Tensor x_hat;
    std::tie(x_hat, mean_in, rstd_in) = norm_rows(z, kNoParam, kNoParam, eps);
    // projections and gates of both edges, channel-major: [4 c, M] = w_ab [4 c, c_z] . x_hat^T
    at::Tensor ab = at::mm(w_ab, x_hat.t());
    const GatePackParams gp{ab.data_ptr(), bias.data_ptr<float>(),
                            mask_flat.defined() ? mask_flat.data_ptr() : nullptr, a.data_ptr(), b.data_ptr(), s.M,
                            s.M, s.M, int(s.c), vector_ok(ab, s.M)};
    by_dtype(z.scalar_type(), op, [&](auto e) { launch_gate_pack<decltype(e)>(gp, stream); });
    ab.reset();
    g = at::addmm(b_g, x_hat, w_g.t());  // [M, c_z]
  }

  // p [c * B, N, N] = the triangle products of every (channel, batch); then normalised over channels
  const at::Tensor p = triangle_product(a.view({s.c * s.B, s.N, s.N}), b.view({s.c * s.B, s.N, s.N}), outgoing);
  const bool fused_output = triangle_output_fits(z, s);
  // n_hat [M, c]: the backward's (and the unfused output half's own intermediate)
  at::Tensor n_hat = for_backward || !fused_output ? output({s.M, s.c}, z.options()) : at::empty({0}, z.options());
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
    const at::Tensor y = at::addmm(b_z, n_hat, w_z.t());
    const SigmoidGateParams sp{g.data_ptr(), y.data_ptr(), out.data_ptr(), s.M, s.cz, s.cz, RowMap::strided(s.cz),
                               int(s.cz), vector_ok(g, s.cz) && vector_ok(y, s.cz) && vector_ok(out, s.cz)};
    by_dtype(z.scalar_type(), op, [&](auto e) { launch_sigmoid_gate<decltype(e)>(sp, stream); });
  }
  if (add_input && !add_in_kernel) {
    const at::Tensor update = out.view(z.sizes());
    out = update_scale.has_value() ? at::addcmul(z, update, *update_scale) : at::add(z, update);
  }
  return {out.view(z.sizes()), mean_in, rstd_in, a, b, n_hat, rstd_out, g};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
triangle_backward_folded(const at::Tensor& dout_in, const at::Tensor& z, const std::optional<at::Tensor>& mask,
                            const at::Tensor& w_ab, const at::Tensor& b_ab, const at::Tensor& w_g,
                            const at::Tensor& w_z, const at::Tensor& b_z, const at::Tensor& mean_in,
                            const at::Tensor& rstd_in, const at::Tensor& a, const at::Tensor& b,
                            const at::Tensor& n_hat, const at::Tensor& rstd_out, const at::Tensor& g, double eps,
                            bool outgoing, const std::optional<at::Tensor>& dz_add) {
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
  const at::Tensor dout = dout_in.contiguous().view({s.M, s.cz});
  const at::Tensor mask_flat = flat_mask(mask, z, s.M);
  const auto f32 = z.options().dtype(at::kFloat);

  // The output half: out = sigmoid(g) * y, y = n_hat . w_z^T + b_z (recomputed: the forward does not
  // keep it), n_hat = the channel layer norm of p. dg, dy [M, c_z], their column sums (the biases'
  // gradients, added in a fixed order by the kernels' last CTAs), dw_z, and dp [c, M] channel-major.
  at::Tensor dg = output({s.M, s.cz}, z.options()), dy = output({s.M, s.cz}, z.options());
  at::Tensor dp = output({s.c, s.M}, z.options());
  at::Tensor db_z = output({s.cz}, f32), db_g = output({s.cz}, f32);
  if (s.M == 0) db_z.zero_(), db_g.zero_();
  at::Tensor dw_z;
  if (triangle_output_fits(z, s)) {
    // one kernel: y, the gate's backward, dn_hat = dy . w_z and the channel layer norm's backward
    const int64_t ctas = (s.M + kTriangleOutputBackwardRows - 1) / kTriangleOutputBackwardRows;
    PartialSums sums(ctas, 2 * s.cz, f32, param_tensor(db_z), param_tensor(db_g), stream);
    const at::Tensor w_zt = w_z.t().contiguous();  // [c, c_z]
    TriangleOutputBackwardParams ob{n_hat.data_ptr(), w_z.data_ptr(), w_zt.data_ptr(), b_z.data_ptr(),
                                    g.data_ptr(), dout.data_ptr(), rstd_out.data_ptr<float>(), dg.data_ptr(),
                                    dy.data_ptr(), dp.data_ptr(), sums.data(), sums.data() + ctas * s.cz,
                                    sums.totals, s.M, int(s.c), int(s.cz), vector_ok(dp, s.M)};
    if (z.scalar_type() == at::kHalf) launch_triangle_output_backward<cutlass::half_t>(ob, stream);
    else launch_triangle_output_backward<cutlass::bfloat16_t>(ob, stream);
    dw_z = at::mm(dy.t(), n_hat);  // [c_z, c]
    dy.reset();
  } else {
    at::Tensor y = at::addmm(b_z, n_hat, w_z.t());
    const int gate_threads = row_threads_for(s.cz, z.element_size());
    const int gate_ctas = row_norm_ctas(s.M, gate_threads);
    PartialSums sums(gate_ctas, 2 * s.cz, f32, param_tensor(db_z), param_tensor(db_g), stream);
    float* const dy_part = sums.data();  // [gate_ctas, c_z] each
    float* const dg_part = dy_part + int64_t(gate_ctas) * s.cz;
    SigmoidGateBackwardParams sp{g.data_ptr(), y.data_ptr(), dout.data_ptr(), dg.data_ptr(), dy.data_ptr(),
                                 dg_part, dy_part, s.M, s.cz, s.cz, s.cz, RowMap::strided(s.cz), int(s.cz),
                                 gate_threads};
    sp.totals = sums.totals;
    by_dtype(z.scalar_type(), op, [&](auto e) { launch_sigmoid_gate_backward<decltype(e)>(sp, gate_ctas, stream); });
    y.reset();
    dw_z = at::mm(dy.t(), n_hat);  // [c_z, c]
    at::Tensor dn = at::mm(dy, w_z);  // [M, c]
    dy.reset();
    const ChannelNormBackwardParams cp{dn.data_ptr(), n_hat.data_ptr(), rstd_out.data_ptr<float>(), dp.data_ptr(),
                                       s.M, s.c, s.c, s.M, int(s.c), vector_ok(dp, s.M)};
    by_dtype(z.scalar_type(), op, [&](auto e) { launch_layer_norm_channels_backward<decltype(e)>(cp, stream); });
  }

  // x_hat again (its statistics are recomputed too: the same kernel as the forward)
  at::Tensor x_hat = std::get<0>(norm_rows(z, kNoParam, kNoParam, eps));  // [M, c_z]
  // g = x_hat . w_g^T + b_g
  at::Tensor dx = at::mm(dg, w_g);                           // [M, c_z]
  at::Tensor dw_g = at::mm(dg.t(), x_hat);  // [c_z, c_z]
  dg.reset();

  // The edges, a group of channels at a time so that the [4 * group, M] temporaries stay small:
  // da, db from the triangle products' gradients, then the gates' backward on the recomputed
  // projections, then the projection weights' and x_hat's gradients.
  const at::Tensor bias = b_ab.to(at::kFloat).contiguous().view({4, s.c});
  const at::Tensor w4 = w_ab.view({4, s.c, s.cz});
  at::Tensor dw_ab = output({4, s.c, s.cz}, w_ab.options());
  at::Tensor db_ab = s.M > 0 ? output({4, s.c}, f32) : at::zeros({4, s.c}, f32);  // the gate kernels' row sums
  const int64_t group = channel_group(s, z.element_size());
  for (int64_t c0 = 0; c0 < s.c; c0 += group) {
    const int64_t k = std::min(group, s.c - c0);
    const auto stack = [&](const at::Tensor& t) { return t.narrow(0, c0, k).view({k * s.B, s.N, s.N}); };
    at::Tensor dpk = stack(dp), ak = stack(a), bk = stack(b);
    // outgoing p = a b^T: da = dp b, db = dp^T a;  incoming p = a^T b: da = b dp^T, db = a dp
    at::Tensor da = outgoing ? at::bmm(dpk, bk) : at::bmm(bk, dpk.transpose(1, 2));
    at::Tensor db = outgoing ? at::bmm(dpk.transpose(1, 2), ak) : at::bmm(ak, dpk);
    at::Tensor wk = w4.narrow(1, c0, k).reshape({4 * k, s.cz});          // rows (ap, ag, bp, bg) of the group
    at::Tensor dab = output({4 * k, s.M}, z.options());
    if (triangle_input_fits(z, s)) {
      // the projections and gates recomputed from x_hat, their gradients and bias sums in one kernel
      const int64_t ctas = (s.M + kTriangleGateBackwardRows - 1) / kTriangleGateBackwardRows;
      at::Tensor bias_part = output({ctas, 4 * k}, f32);
      const TriangleGateBackwardParams tp{x_hat.data_ptr(), w4.narrow(1, c0, k).data_ptr(),
                                          bias.data_ptr<float>() + c0, mask_flat.defined() ? mask_flat.data_ptr() : nullptr,
                                          da.data_ptr(), db.data_ptr(), dab.data_ptr(), bias_part.data_ptr<float>(),
                                          s.M, s.M > 1 ? x_hat.stride(0) : s.cz, int(s.cz), int(k), int(s.c),
                                          s.M % 8 == 0 && aligned16(da) && aligned16(db) && aligned16(dab)};
      if (z.scalar_type() == at::kHalf) launch_triangle_gate_backward<cutlass::half_t>(tp, stream);
      else launch_triangle_gate_backward<cutlass::bfloat16_t>(tp, stream);
      // [4 k] in a fixed order (the column-sum kernel, or torch's sum where a row is too wide for it)
      const at::Tensor sums = row_fits(4 * k, 4) ? column_sum(bias_part, at::kFloat) : bias_part.sum(0);
      db_ab.narrow(1, c0, k).copy_(sums.view({4, k}));
    } else {
      at::Tensor bk4 = bias.narrow(1, c0, k).contiguous();                 // [4, k]
      at::Tensor abk = at::mm(wk, x_hat.t());                              // [4 k, M]
      const int64_t spans = (s.M + 16 / z.element_size() - 1) / (16 / z.element_size());
      const int chunks = int(std::max<int64_t>(
          1, std::min<int64_t>((spans + kBlockOpThreads - 1) / kBlockOpThreads, 4 * current_sm_count() / (2 * k) + 1)));
      // [4 k, chunks] partial sums, then 2 k tickets: a row's last CTA adds its partials into db_ab
      at::Tensor bias_part = output({4 * k * chunks + 2 * k}, f32);
      float* const partials = bias_part.data_ptr<float>();
      GatePackBackwardParams bp{abk.data_ptr(), bk4.data_ptr<float>(),
                                mask_flat.defined() ? mask_flat.data_ptr() : nullptr, da.data_ptr(), db.data_ptr(),
                                dab.data_ptr(), partials, s.M, s.M, s.M, s.M, int(k),
                                vector_ok(abk, s.M) && vector_ok(da, s.M) && vector_ok(db, s.M) && vector_ok(dab, s.M)};
      bp.tickets = reinterpret_cast<unsigned*>(partials + 4 * k * chunks);
      bp.bias_total = db_ab.data_ptr<float>() + c0;  // [4, c] rows, this group's k columns
      bp.total_stride = s.c;
      C10_CUDA_CHECK(cudaMemsetAsync(bp.tickets, 0, 2 * k * sizeof(unsigned), stream));
      by_dtype(z.scalar_type(), op, [&](auto e) { launch_gate_pack_backward<decltype(e)>(bp, chunks, stream); });
    }
    if (k == s.c) {
      at::Tensor dw_ab_rows = dw_ab.view({4 * s.c, s.cz});  // one group: straight into dw_ab
      at::mm_out(dw_ab_rows, dab, x_hat);
    } else {
      dw_ab.narrow(1, c0, k).copy_(at::mm(dab, x_hat).view({4, k, s.cz}));
    }
    dx.addmm_(dab.t(), wk);
  }
  dp.reset();

  // x_hat = normalised z
  at::Tensor dz = std::get<0>(norm_rows_backward(dx, z, kNoParam, mean_in, rstd_in, false, at::kFloat,
                                                 dz_add.has_value() ? &*dz_add : nullptr));
  return {dz.view(z.sizes()), dw_ab.view({4 * s.c, s.cz}), db_ab.view({4 * s.c}), dw_g, db_g, dw_z, db_z};
}

// The parameters of the triangle op, in the schema's order: layer norm in (weight, bias), the
// stacked a/b projections and gates (weight [4 c, c_z], bias), the output gate (weight, bias), layer
// norm out (weight, bias), the output projection (weight [c_z, c], bias).
enum TriangleWeight { kNormInW, kNormInB, kProjW, kProjB, kGateW, kGateB, kNormOutW, kNormOutB, kOutW, kOutB, kWeights };

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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor, at::Tensor, at::Tensor, at::Tensor>
triangle_multiplication_fwd(const at::Tensor& z, const std::optional<at::Tensor>& mask,
                            at::TensorList weights, double eps, bool outgoing, const std::string& family,
                            bool for_backward, bool add_input, const std::optional<at::Tensor>& update_scale) {
  const char* op = "triangle multiplication";
  check_cuda(z, "z", op);
  EVO_CHECK(z.dim() == 4, op, ": `z` must be [B, N, N, c_z], got ", z.sizes());
  EVO_CHECK(!update_scale.has_value() ||
                (add_input && update_scale->device() == z.device() && update_scale->scalar_type() == z.scalar_type() &&
                 update_scale->sizes() == at::IntArrayRef({z.size(0), 1, z.size(2), z.size(3)})),
            op, ": `update_scale` goes with add_input and must be [B, 1, N, c_z] of z's dtype and device, got ",
            update_scale.has_value() ? update_scale->sizes() : at::IntArrayRef{});
  check_weights(weights, z, op);
  const bool hopper = family == "sm90";
  EVO_CHECK(family == "sm80" || (hopper && hopper_kernels_available(z.get_device())), op,
            ": `family` must be \"sm80\", or \"sm90\" with a build holding sm_90a code on a 9.0 device, got \"",
            family, "\"");
  const c10::cuda::CUDAGuard guard(z.device());
  const FoldedWeights f = fold(weights, z);
  auto [out, mean_in, rstd_in, a, b, n_hat, rstd_out, g] =
      triangle_forward_folded(z, mask, f.w_ab, f.b_ab, f.w_g, f.b_g, f.w_z, f.b_z, eps, outgoing, hopper, for_backward,
                              add_input, update_scale);
  // n_hat only for the backward (without it, [0] whether or not the output half used one)
  if (!for_backward) n_hat = at::empty({0}, z.options());
  return {out, mean_in, rstd_in, a, b, n_hat, rstd_out, g, f.w_ab, f.b_ab, f.w_g, f.w_z, f.b_z};
}

// Gradients of every parameter from those of the folded projections (launch_unfold_affine_grads):
// dW = dW' diag(w) + db' b^T, dw = colsum(dW' * W), db = W^T db', dc = db'; each in its weight's dtype.
// `saved` is the forward's outputs after `out`: mean_in, rstd_in, a, b, n_hat, rstd_out, g and the
// folded w_ab, b_ab, w_g, w_z, b_z.
std::vector<at::Tensor> triangle_multiplication_bwd(const at::Tensor& dout, const at::Tensor& z,
                                                    const std::optional<at::Tensor>& mask, at::TensorList weights,
                                                    at::TensorList saved, double eps, bool outgoing,
                                                    const std::optional<at::Tensor>& dz_add) {
  const char* op = "triangle multiplication backward";
  check_cuda(z, "z", op);
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
      dout, z, mask, w_ab, b_ab, w_g, w_z, b_z, mean_in, rstd_in, a, b, n_hat, rstd_out, g, eps, outgoing, dz_add);
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

// ---- sigmoid gate of an output, column sums -----------------------------------------------------

// The rows of y [..., C] as a RowMap: its leading dims with size-1 dims dropped and nesting dims
// merged, if that leaves at most three. False when it does not.
bool row_map_of(const at::Tensor& y, RowMap& map) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (size, stride), outer to inner
  for (int64_t d = 0; d + 1 < y.dim(); ++d) {
    if (y.size(d) == 1) continue;
    if (!dims.empty() && dims.back().second == y.size(d) * y.stride(d)) {
      dims.back() = {dims.back().first * y.size(d), y.stride(d)};
    } else {
      dims.emplace_back(y.size(d), y.stride(d));
    }
  }
  if (dims.size() > 3) return false;
  while (dims.size() < 3) dims.insert(dims.begin(), {1, 0});
  map = RowMap{dims[2].first, dims[1].first, dims[2].second, dims[1].second, dims[0].second};
  return true;
}

// y itself when its rows fit a RowMap with 16-byte aligned rows and it is dense (so that empty_like
// gives its gradient the same layout), else a contiguous copy; `map` locates the rows.
at::Tensor rows_in_map(const at::Tensor& y, RowMap& map) {
  const int64_t vec = 16 / y.element_size();
  if (y.stride(-1) == 1 && aligned16(y) && y.is_non_overlapping_and_dense() && row_map_of(y, map) &&
      map.s0 % vec == 0 && map.s1 % vec == 0 && map.s2 % vec == 0)
    return y;
  map = RowMap::strided(y.size(-1));
  return y.contiguous();
}

int64_t gate_shape(const at::Tensor& g, const at::Tensor& y, const char* op) {
  check_cuda(g, "g", op);
  EVO_CHECK(g.dim() >= 1 && y.sizes() == g.sizes() && y.scalar_type() == g.scalar_type() && y.device() == g.device(),
            op, ": `g` and `y` must be [..., C] tensors of one shape, dtype and device, got ", g.sizes(), " and ",
            y.sizes());
  const int64_t C = g.size(-1);
  EVO_CHECK(row_fits(C, g.element_size()), op,
            ": C must be a whole number of 16-byte chunks, at most ", kMaxRowChunks, " per lane, got ", C);
  return C;
}

at::Tensor sigmoid_gate_fwd(const at::Tensor& g_in, const at::Tensor& y_in) {
  const int64_t C = gate_shape(g_in, y_in, "sigmoid gate");
  const c10::cuda::CUDAGuard guard(g_in.device());
  const at::Tensor g = as_rows(g_in, C);
  RowMap y_rows;
  const at::Tensor y = rows_in_map(y_in, y_rows);
  at::Tensor out = output(g_in.sizes(), g_in.options());
  const int64_t M = g.size(0);
  const SigmoidGateParams p{g.data_ptr(), y.data_ptr(), out.data_ptr(), M, M > 1 ? g.stride(0) : C, C, y_rows,
                            int(C), true};
  by_dtype(g.scalar_type(), "sigmoid gate",
           [&](auto e) { launch_sigmoid_gate<decltype(e)>(p, c10::cuda::getCurrentCUDAStream()); });
  return out;
}

// The gate's backward into dg_rows ([M, C] rows of g's order, any 16-byte aligned row stride);
// returns dy in y_in's layout (empty_like: its strides when it is dense, else contiguous; the kernel
// writes it through y's row map, so through a copy when y had to be made contiguous). With
// delta_heads > 0, y_in is taken to be the attention output [B, N, Lq, H, D] (contiguous, H =
// delta_heads, Lq = delta_len) seen in g's row order, and the second result is the attention
// backward's delta [B * N * H * Lq] = the sum over each head of dy * y (SigmoidGateBackwardParams),
// where the kernel can sum it (a head a power-of-two number of lanes' chunks, y read in place);
// else it is an empty tensor.
std::tuple<at::Tensor, at::Tensor> gate_backward(const at::Tensor& dout_in, const at::Tensor& g_in,
                                                 const at::Tensor& y_in, const at::Tensor& dg_rows, int64_t C,
                                                 const char* op, int64_t delta_heads = 0, int64_t delta_len = 0) {
  EVO_CHECK(dout_in.sizes() == g_in.sizes() && dout_in.scalar_type() == g_in.scalar_type(), op,
            ": `dout` must match g, got ", dout_in.sizes());
  const c10::cuda::CUDAGuard guard(g_in.device());
  const at::Tensor g = as_rows(g_in, C), dout = as_rows(dout_in, C);
  RowMap y_rows;
  const at::Tensor y = rows_in_map(y_in, y_rows);
  at::Tensor dy_out = at::empty_like(y_in);
  at::Tensor dy = dy_out.strides() == y.strides() ? dy_out : at::empty_like(y);
  maybe_poison(dy);
  const int64_t M = g.size(0);
  const int row_threads = row_threads_for(C, g.element_size());
  const int ctas = row_norm_ctas(M, row_threads);
  SigmoidGateBackwardParams p{g.data_ptr(), y.data_ptr(), dout.data_ptr(), dg_rows.data_ptr(), dy.data_ptr(),
                              nullptr, nullptr, M, M > 1 ? g.stride(0) : C, M > 1 ? dout.stride(0) : C,
                              M > 1 ? dg_rows.stride(0) : C, y_rows, int(C), row_threads};
  at::Tensor delta = at::empty({0}, g.options().dtype(at::kFloat));
  if (delta_heads > 0 && delta_len > 0 && C % delta_heads == 0 && M % delta_len == 0 && M < (int64_t(1) << 31) &&
      y.is_same(y_in)) {
    const int64_t head_bytes = C / delta_heads * g.element_size(), lanes = head_bytes / 16;
    const RowMap& m = y_rows;
    if (head_bytes % 16 == 0 && (lanes & (lanes - 1)) == 0 && lanes <= row_threads && m.s0 % C == 0 &&
        m.s1 % C == 0 && m.s2 % C == 0) {
      delta = output({M * delta_heads}, g.options().dtype(at::kFloat));
      p.delta = delta.data_ptr<float>();
      p.o_rows = RowMap{m.inner, m.mid, m.s0 / C, m.s1 / C, m.s2 / C};
      p.delta_len = int(delta_len), p.delta_heads = int(delta_heads);
      while ((int64_t(1) << p.delta_lanes_log2) < lanes) ++p.delta_lanes_log2;
    }
  }
  by_dtype(g.scalar_type(), op, [&](auto e) {
    launch_sigmoid_gate_backward<decltype(e)>(p, ctas, c10::cuda::getCurrentCUDAStream());
  });
  if (!dy.is_same(dy_out)) dy_out.copy_(dy);
  return {dy_out, delta};
}

// (dg in g's shape, contiguous; dy in y's layout when y is dense, else contiguous: empty_like(y))
std::tuple<at::Tensor, at::Tensor> sigmoid_gate_bwd(const at::Tensor& dout_in, const at::Tensor& g_in,
                                                    const at::Tensor& y_in) {
  const char* op = "sigmoid gate backward";
  const int64_t C = gate_shape(g_in, y_in, op);
  at::Tensor dg = output(g_in.sizes(), g_in.options());
  at::Tensor dy = std::get<0>(gate_backward(dout_in, g_in, y_in, dg.view({-1, C}), C, op));
  return {dg, dy};
}

// (dy as sigmoid_gate_bwd's, delta as gate_backward's); dg written into `dg` (g's shape, rows of one
// 16-byte aligned stride, C contiguous: a column block of a wider matrix, e.g. the gate's slice of a
// stacked projection's gradient).
std::tuple<at::Tensor, at::Tensor> sigmoid_gate_bwd_into(const at::Tensor& dout_in, const at::Tensor& g_in,
                                                         const at::Tensor& y_in, at::Tensor& dg, int64_t delta_heads,
                                                         int64_t delta_len) {
  const char* op = "sigmoid gate backward";
  const int64_t C = gate_shape(g_in, y_in, op);
  EVO_CHECK(dg.sizes() == g_in.sizes() && dg.scalar_type() == g_in.scalar_type() && dg.device() == g_in.device(),
            op, ": `dg` must match g, got ", dg.sizes(), " ", dg.scalar_type());
  const at::Tensor rows = dg.view({-1, C});  // (raises where the rows share no one stride)
  EVO_CHECK(aligned_rows(rows), op, ": `dg` must have contiguous rows of one 16-byte aligned stride, got strides ",
            dg.strides());
  maybe_poison(dg);
  return gate_backward(dout_in, g_in, y_in, rows, C, op, delta_heads, delta_len);
}

// The sums over rows of x [..., C] (a projection's bias gradient) in float32, in a fixed order, then
// rounded to dtype (a float type).
// The float32 sum over the rows of x [M, C] (whole 16-byte chunks per row, checked by the callers),
// added in a fixed order and rounded to dtype; with relu_out ([M, C], x's dtype), of x where relu_out > 0
// instead, which is written to *masked (a new [M, C] tensor): a ReLU's backward and its bias gradient
// in one read.
at::Tensor column_sum_rows(const at::Tensor& x, at::ScalarType dtype, const at::Tensor* relu_out = nullptr,
                           at::Tensor* masked = nullptr) {
  const char* op = "column sum";
  const int64_t C = x.size(-1), M = x.size(0);
  const auto f32 = x.options().dtype(at::kFloat);
  EVO_CHECK(is_param_dtype(dtype), op, ": `dtype` must be float16, bfloat16 or float32, got ", dtype);
  if (relu_out != nullptr) *masked = output({M, C}, x.options());
  if (M == 0) return at::zeros({C}, x.options().dtype(dtype));
  const int row_threads = row_threads_for(C, x.element_size());
  const int ctas = row_norm_ctas(M, row_threads);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor total = output({C}, x.options().dtype(dtype));
  PartialSums sums(ctas, C, f32, param_tensor(total), kNoParam, stream);  // added by the last CTA in a fixed order
  ColumnSumParams p{x.data_ptr(), sums.data(), M, M > 1 ? x.stride(0) : C, int(C), row_threads};
  p.totals = sums.totals;
  if (relu_out != nullptr) {
    p.relu_out = relu_out->data_ptr(), p.relu_stride = M > 1 ? relu_out->stride(0) : C;
    p.masked = masked->data_ptr(), p.masked_stride = C;
  }
  by_dtype(x.scalar_type(), op, [&](auto e) { launch_column_sum<decltype(e)>(p, ctas, stream); });
  return total;
}

at::Tensor column_sum(const at::Tensor& x_in, at::ScalarType dtype) {
  const char* op = "column sum";
  check_cuda(x_in, "x", op);
  const int64_t C = x_in.dim() >= 1 ? x_in.size(-1) : 0;
  EVO_CHECK(x_in.dim() >= 1 && row_fits(C, x_in.element_size()), op,
            ": `x` must be [..., C] with C a whole number of 16-byte chunks, at most ", kMaxRowChunks,
            " per lane, got ", x_in.sizes());
  const c10::cuda::CUDAGuard guard(x_in.device());
  return column_sum_rows(as_rows(x_in, C), dtype);
}

// The backward of y = x . weight^T + bias (then relu where relu_out, the saved y, is given) from dy
// [..., out]: (dx in x's dtype, dweight in weight's, dbias in bias_dtype), each an undefined tensor
// unless wanted. Products in dy's dtype (autocast: x and weight may be float32 under a half dy), as
// PyTorch computes them; the ReLU's backward and the bias gradient are one column-sum pass where
// the rows fit its kernel (else PyTorch's threshold_backward and float32 sum). With bias_from > 0
// (no ReLU) the bias covers the columns from bias_from on, and only those are summed.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_bwd(const at::Tensor& dy_in, const at::Tensor& x,
                                                          const at::Tensor& weight,
                                                          const std::optional<at::Tensor>& relu_out, bool need_dx,
                                                          bool need_dw, bool need_db, at::ScalarType bias_dtype,
                                                          int64_t bias_from) {
  const char* op = "linear backward";
  check_cuda(dy_in, "dy", op);
  const int64_t C = dy_in.dim() >= 1 ? dy_in.size(-1) : 0;
  EVO_CHECK(dy_in.dim() >= 1 && weight.dim() == 2 && weight.size(0) == C && x.size(-1) == weight.size(1) &&
                x.numel() / std::max<int64_t>(1, x.size(-1)) == dy_in.numel() / std::max<int64_t>(1, C),
            op, ": `dy` [..., out], `x` [..., in] and `weight` [out, in] do not match: ", dy_in.sizes(), ", ",
            x.sizes(), ", ", weight.sizes());
  EVO_CHECK(bias_from >= 0 && bias_from < std::max<int64_t>(C, 1) && (bias_from == 0 || !relu_out.has_value()), op,
            ": `bias_from` must be a column of dy [..., ", C, "] (0 with relu_out), got ", bias_from);
  const c10::cuda::CUDAGuard guard(dy_in.device());
  const int64_t es = dy_in.element_size();
  const bool dtypes_fit = is_param_dtype(dy_in.scalar_type()) && is_param_dtype(bias_dtype);
  const bool kernel = dtypes_fit && row_fits(C, es);  // the ReLU's backward with the bias sum
  // the bias sum alone, over the columns from bias_from on (16-byte aligned where the rows are)
  const bool sum_kernel = dtypes_fit && row_fits(C - bias_from, es) && (bias_from * es) % 16 == 0;
  at::Tensor dy = kernel || sum_kernel ? as_rows(dy_in, C) : dy_in.reshape({-1, C});  // [rows, out]
  at::Tensor db;
  if (relu_out.has_value()) {
    EVO_CHECK(relu_out->sizes() == dy_in.sizes() && relu_out->scalar_type() == dy_in.scalar_type() &&
                  relu_out->device() == dy_in.device(),
              op, ": `relu_out` must match dy, got ", relu_out->sizes(), " ", relu_out->scalar_type());
    if (kernel) {
      const at::Tensor y = as_rows(*relu_out, C);
      at::Tensor masked;
      db = column_sum_rows(dy, bias_dtype, &y, &masked);
      dy = masked;
    } else {
      dy = at::threshold_backward(dy, relu_out->reshape({-1, C}), 0);
    }
  }
  if (need_db && !db.defined()) {
    const at::Tensor biased = bias_from > 0 ? dy.narrow(1, bias_from, C - bias_from) : dy;  // [rows, out - bias_from]
    db = sum_kernel ? column_sum_rows(biased, bias_dtype) : at::sum(biased, {0}, false, at::kFloat).to(bias_dtype);
  }
  at::Tensor dx, dw;
  if (need_dx) dx = at::mm(dy, weight.to(dy.scalar_type())).view(x.sizes()).to(x.scalar_type());  // [..., in]
  if (need_dw) dw = at::mm(dy.t(), x.reshape({-1, x.size(-1)}).to(dy.scalar_type())).to(weight.scalar_type());  // [out, in]
  // an op returns tensors: a new [0] one for each gradient not wanted (outputs must not alias)
  const auto wanted = [&](bool need, const at::Tensor& t) { return need ? t : at::empty({0}, dy_in.options()); };
  return {wanted(need_dx, dx), wanted(need_dw, dw), wanted(need_db, db)};
}

// ---- the outer product mean's products around its [i, c, j, e] intermediate (opm_gemm.cuh) --------

constexpr int64_t kOpmC = 32;  // c_hidden the kernel takes

void check_opm_operand(const at::Tensor& t, const char* name, const char* op) {
  check_cuda(t, name, op);
  EVO_CHECK(t.is_contiguous() && (t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16) && aligned16(t),
            op, ": `", name, "` must be a contiguous, 16-byte aligned float16 or bfloat16 tensor, got ", t.sizes(),
            " ", t.scalar_type());
}

// weight [Z, C C] in `like`'s dtype and device, contiguous
at::Tensor opm_weight(const at::Tensor& weight, const at::Tensor& like, int64_t c, const char* op) {
  EVO_CHECK(weight.dim() == 2 && weight.size(1) == c * c && weight.device() == like.device(), op,
            ": `weight` must be [Z, ", c * c, "] on the input's device, got ", weight.sizes());
  return weight.to(like.scalar_type()).contiguous();
}

// The tile GEMM's grid x (row tiles times column tiles) must stay below 2^31.
void check_tile_grid(int64_t rows, int64_t column_tiles, const char* op) {
  EVO_CHECK((rows + kOpmTile - 1) / kOpmTile * column_tiles < (int64_t(1) << 31), op, ": too many tiles (",
            rows, " rows, ", column_tiles, " column tiles of ", kOpmTile, ")");
}

template <typename Fn>
void by_half_dtype(at::ScalarType dtype, Fn&& fn) {
  if (dtype == at::kHalf) fn(cutlass::half_t{});
  else fn(cutlass::bfloat16_t{});
}

at::Tensor opm_project(const at::Tensor& outer, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in,
                       const std::optional<at::Tensor>& denom_in, const std::optional<at::Tensor>& residual_in) {
  const char* op = "outer product mean projection";
  check_opm_operand(outer, "outer", op);
  EVO_CHECK(outer.dim() == 5 && outer.size(2) == kOpmC && outer.size(4) == kOpmC, op,
            ": `outer` must be [B, I, 32, J, 32], got ", outer.sizes());
  const int64_t B = outer.size(0), I = outer.size(1), J = outer.size(3), C = kOpmC;
  const c10::cuda::CUDAGuard guard(outer.device());
  const at::Tensor weight = opm_weight(weight_in, outer, C, op);
  const int64_t Z = weight.size(0);
  EVO_CHECK(Z % kOpmTile == 0 && B * I <= 65535 && J < (int64_t(1) << 31), op, ": Z must be a multiple of ",
            kOpmTile, " and B * I at most 65535, got Z = ", Z, ", B * I = ", B * I);
  at::Tensor bias;
  if (bias_in.has_value()) {
    EVO_CHECK(bias_in->numel() == Z && bias_in->device() == outer.device(), op, ": `bias` must be [", Z, "]");
    bias = bias_in->to(outer.scalar_type()).contiguous();
  }
  at::Tensor denom, residual;
  if (denom_in.has_value()) {
    denom = *denom_in;
    check_cuda(denom, "denom", op);
    EVO_CHECK(denom.sizes() == at::IntArrayRef({B, I, J}) && denom.scalar_type() == outer.scalar_type() &&
                  denom.is_contiguous(),
              op, ": `denom` must be a contiguous [", B, ", ", I, ", ", J, "] tensor of outer's dtype, got ",
              denom.sizes(), " ", denom.scalar_type());
  }
  if (residual_in.has_value()) {
    residual = *residual_in;
    check_opm_operand(residual, "residual", op);
    EVO_CHECK(residual.sizes() == at::IntArrayRef({B, I, J, Z}) && residual.scalar_type() == outer.scalar_type(),
              op, ": `residual` must be [", B, ", ", I, ", ", J, ", ", Z, "] of outer's dtype, got ",
              residual.sizes(), " ", residual.scalar_type());
  }
  check_tile_grid(J, Z / kOpmTile, op);
  at::Tensor out = output({B, I, J, Z}, outer.options());
  OpmGemmParams p{};
  p.a = outer.data_ptr(), p.b = weight.data_ptr(), p.bias = bias.defined() ? bias.data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.denom = denom.defined() ? denom.data_ptr() : nullptr;
  p.residual = residual.defined() ? residual.data_ptr() : nullptr;
  p.a_batch = C * J * C, p.a_row = C, p.a_step = J * C;        // A row j, step c: outer[b, i, c, j, :]
  p.b_tile = kOpmTile * C * C, p.b_row = C * C, p.b_step = C;  // B row z, step c: weight[z, c C : c C + C]
  p.out_batch = J * Z, p.out_tile = kOpmTile, p.out_row = Z, p.out_block = 32;
  p.rows = int(J), p.steps = int(C);
  by_half_dtype(outer.scalar_type(), [&](auto e) {
    launch_opm_gemm<decltype(e)>(p, B * I, int(Z / kOpmTile), c10::cuda::getCurrentCUDAStream());
  });
  return out;
}

at::Tensor opm_project_input_grad(const at::Tensor& dout, const at::Tensor& weight_in) {
  const char* op = "outer product mean projection backward";
  check_opm_operand(dout, "dout", op);
  EVO_CHECK(dout.dim() == 4, op, ": `dout` must be [B, I, J, Z], got ", dout.sizes());
  const int64_t B = dout.size(0), I = dout.size(1), J = dout.size(2), Z = dout.size(3), C = kOpmC;
  const c10::cuda::CUDAGuard guard(dout.device());
  const at::Tensor weight = opm_weight(weight_in, dout, C, op);
  EVO_CHECK(weight.size(0) == Z && Z % kOpmStep == 0 && B * I <= 65535 && J < (int64_t(1) << 31), op,
            ": Z must match weight [Z, C C] and be a multiple of ", kOpmStep, ", and B * I at most 65535; got dout ",
            dout.sizes(), ", weight ", weight.sizes());
  const at::Tensor wt = weight.t().contiguous();  // [C C, Z]: B rows (c, e), k along z
  check_tile_grid(J, C * C / kOpmTile, op);
  at::Tensor d_outer = output({B, I, C, J, C}, dout.options());
  OpmGemmParams p{};
  p.a = dout.data_ptr(), p.b = wt.data_ptr(), p.bias = nullptr, p.out = d_outer.data_ptr();
  p.a_batch = J * Z, p.a_row = Z, p.a_step = kOpmStep;                  // A row j, step s: dout[b, i, j, 32 s :]
  p.b_tile = int64_t(kOpmTile) * Z, p.b_row = Z, p.b_step = kOpmStep;  // B row n of tile y: wt[128 y + n, 32 s :]
  p.out_batch = C * J * C, p.out_tile = (kOpmTile / C) * J * C, p.out_row = C, p.out_block = J * C;
  p.rows = int(J), p.steps = int(Z / kOpmStep);
  by_half_dtype(dout.scalar_type(), [&](auto e) {
    launch_opm_gemm<decltype(e)>(p, B * I, int(C * C / kOpmTile), c10::cuda::getCurrentCUDAStream());
  });
  return d_outer;
}

at::Tensor opm_project_weight_grad(const at::Tensor& dout, const at::Tensor& outer, at::ScalarType weight_dtype) {
  const char* op = "outer product mean projection weight gradient";
  check_opm_operand(dout, "dout", op);
  check_opm_operand(outer, "outer", op);
  EVO_CHECK(dout.dim() == 4 && outer.dim() == 5 && outer.size(0) == dout.size(0) && outer.size(1) == dout.size(1) &&
                outer.size(2) == kOpmC && outer.size(3) == dout.size(2) && outer.size(4) == kOpmC &&
                outer.scalar_type() == dout.scalar_type() && outer.device() == dout.device(),
            op, ": `dout` [B, I, J, Z] and `outer` [B, I, 32, J, 32] do not match: ", dout.sizes(), ", ",
            outer.sizes());
  EVO_CHECK(is_param_dtype(weight_dtype), op, ": `weight_dtype` must be a float type, got ", weight_dtype);
  const int64_t B = dout.size(0), I = dout.size(1), J = dout.size(2), Z = dout.size(3), C = kOpmC;
  EVO_CHECK(Z <= kOpmTile && Z % 8 == 0 && J < (int64_t(1) << 30), op, ": Z must be a multiple of 8 up to ",
            kOpmTile, ", got ", Z);
  const c10::cuda::CUDAGuard guard(dout.device());
  const int64_t BI = B * I, chunks = (J + kOpmStep - 1) / kOpmStep;
  const int64_t steps = BI * chunks;
  if (steps == 0) return at::zeros({Z, C * C}, dout.options().dtype(weight_dtype));
  EVO_CHECK(steps < (int64_t(1) << 31), op, ": too many k-steps (", steps, ")");
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(steps, 2 * current_sm_count() / (C * C / kOpmTile)));
  at::Tensor partial = output({splits, Z, C * C}, dout.options().dtype(at::kFloat));
  OpmWeightGradParams p{};
  p.dout = dout.data_ptr(), p.outer = outer.data_ptr(), p.partial = partial.data_ptr<float>();
  p.outer_batch = C * J * C;
  p.J = int(J), p.Z = int(Z), p.chunks = int(chunks), p.steps = int(steps);
  by_half_dtype(dout.scalar_type(), [&](auto e) {
    launch_opm_weight_grad<decltype(e)>(p, int(splits), c10::cuda::getCurrentCUDAStream());
  });
  return partial.sum(0).to(weight_dtype);  // [Z, C C], partials added in a fixed order
}

}  // namespace

at::Tensor sigmoid_gate_forward(const at::Tensor& g, const at::Tensor& y) { return sigmoid_gate_fwd(g, y); }

std::tuple<at::Tensor, at::Tensor> sigmoid_gate_backward_into(const at::Tensor& dout, const at::Tensor& g,
                                                              const at::Tensor& y, at::Tensor& dg,
                                                              int64_t delta_heads, int64_t delta_len) {
  return sigmoid_gate_bwd_into(dout, g, y, dg, delta_heads, delta_len);
}

}  // namespace block
}  // namespace evoformer

// (schemas: evoformer_blocks/ops/_fused.py)
TORCH_LIBRARY_IMPL(evoformer_blocks_cuda, CUDA, m) {
  m.impl("layer_norm_fwd", &evoformer::block::layer_norm_fwd);
  m.impl("layer_norm_bwd", &evoformer::block::layer_norm_bwd);
  m.impl("triangle_multiplication_fwd", &evoformer::block::triangle_multiplication_fwd);
  m.impl("triangle_multiplication_bwd", &evoformer::block::triangle_multiplication_bwd);
  m.impl("sigmoid_gate_fwd", &evoformer::block::sigmoid_gate_fwd);
  m.impl("sigmoid_gate_bwd", &evoformer::block::sigmoid_gate_bwd);
  m.impl("sigmoid_gate_bwd_into", &evoformer::block::sigmoid_gate_bwd_into);
  m.impl("column_sum", &evoformer::block::column_sum);
  m.impl("opm_project", &evoformer::block::opm_project);
  m.impl("opm_project_input_grad", &evoformer::block::opm_project_input_grad);
  m.impl("opm_project_weight_grad", &evoformer::block::opm_project_weight_grad);
  m.impl("linear_bwd", &evoformer::block::linear_bwd);
  m.impl("add_layer_norm_fwd", &evoformer::block::add_layer_norm_fwd);
  m.impl("add_layer_norm_bwd", &evoformer::block::add_layer_norm_bwd);
}
