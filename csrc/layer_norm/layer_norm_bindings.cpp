// Op kernels (TORCH_LIBRARY_IMPL) of the layer-norm family: the layer norm, also behind a residual add,
// forward and backward (norm_rows and norm_rows_backward, layer_norm_ops.h, also serve the triangle
// multiplication's bindings).
// The Python ops (evoformer_blocks.ops) validate the arguments; the checks here only guard the
// kernels' memory accesses for direct torch.ops calls.
//
// Ops (namespace evoformer_blocks_cuda, declared in evoformer_blocks/ops/_fused.py), CUDA only:
//   layer_norm_fwd(x [..., C], weight?, bias?, eps) -> (y [..., C], mean [M], rstd [M])
//   layer_norm_bwd(dy, x, weight?, mean, rstd, need_affine, affine_dtype)
//       -> (dx, [2, C] in affine_dtype (a float type): the gradients of weight and bias, or [0] without
//           need_affine)
//   (weight and bias: contiguous float16, bfloat16 or float32, read in their own dtype)
//   add_layer_norm_fwd(x, residual, weight?, bias?, eps, residual_scale? (broadcasts to x),
//                      residual_bias? ([C], x's dtype))
//       -> (sum = x + (residual + residual_bias) (* residual_scale), layer_norm(sum), mean, rstd)
//   add_layer_norm_bwd(dsum, dy, sum, weight?, mean, rstd, need_affine, affine_dtype, residual_scale?,
//                      residual_bias_dtype?)
//       -> (dsum + the layer norm's input gradient: the gradient of x (and of residual without a scale),
//           [2, C] as above, that gradient times residual_scale: the residual's (else empty), with
//           residual_bias_dtype the residual's gradient summed over rows [C] in that dtype: the
//           residual bias's (else empty))
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "common/block_bindings.h"
#include "layer_norm/layer_norm.h"
#include "layer_norm/layer_norm_ops.h"

namespace evoformer {
namespace block {
namespace {

// An optional [C] affine parameter as the kernels read it (absent: {nullptr}); the Python op passes
// contiguous float16/bfloat16/float32 tensors, checked here for direct calls.
ParamTensor optional_param(const std::optional<at::Tensor>& t, const at::Tensor& x, const char* name) {
  if (!t.has_value()) return kNoParam;
  EVO_CHECK(t->device() == x.device() && t->is_contiguous() && t->numel() == x.size(-1) && is_param_dtype(*t),
            "layer norm: `", name, "` must be a contiguous float16, bfloat16 or float32 [C] tensor on x's device, got ",
            t->sizes(), " ", t->scalar_type());
  return param_tensor(*t);
}

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

}  // namespace

// y = layer_norm(rows of x) and its statistics; x must have C % (16 bytes / element) == 0 (the op
// routes others to eager). With `residual` (x's shape and dtype), of the rows of x + residual instead
// (x + (residual + residual_bias) * residual_scale with a scale broadcasting to x and a bias [C]),
// whose sum is written to `sum` (a new [M, C] tensor).
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_rows(const at::Tensor& x, ParamTensor weight, ParamTensor bias,
                                                         double eps, const at::Tensor* residual, at::Tensor* sum,
                                                         const std::optional<at::Tensor>& residual_scale,
                                                         ParamTensor residual_bias) {
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
    p.residual_bias = residual_bias;
  }
  const int per_sm = scale.has_value() || p.residual_bias.ptr != nullptr ? kRowNormScaledCtasPerSm : kRowNormCtasPerSm;
  by_dtype(rows.scalar_type(), "layer norm", [&](auto element) {
    launch_layer_norm_rows<decltype(element)>(p, row_norm_ctas(M, p.row_threads, per_sm),
                                              c10::cuda::getCurrentCUDAStream());
  });
  return {y, mean, rstd};
}

// dx and, when affine_grad, the float32 sums over rows of dy * x_hat and of dy as one [2, C] tensor
// (else [0]) of norm_rows; with residual_scale (broadcasting to x_in), also dresidual = dx *
// residual_scale ([M, C]; else undefined); with residual_bias_dtype, the residual's gradient (dresidual,
// or dx without a scale) summed over rows into a [C] tensor of that dtype (else undefined).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_rows_backward(
    const at::Tensor& dy_in, const at::Tensor& x_in, ParamTensor weight, const at::Tensor& mean,
    const at::Tensor& rstd, bool affine_grad, at::ScalarType affine_dtype, const at::Tensor* dsum_in,
    const std::optional<at::Tensor>& residual_scale, std::optional<at::ScalarType> residual_bias_dtype) {
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
  at::Tensor dresidual_bias;
  if (residual_bias_dtype.has_value()) dresidual_bias = output({C}, x.options().dtype(*residual_bias_dtype));
  if (M == 0) {  // (no rows: zero sums)
    if (dresidual_bias.defined()) dresidual_bias.zero_();
    return {dx, affine_grad ? at::zeros({2, C}, affine_options) : at::empty({0}, f32), dresidual, dresidual_bias};
  }
  at::Tensor affine = affine_grad ? output({2, C}, affine_options) : at::empty({0}, f32);  // (dweight, dbias)
  // [ctas, (dweight, dbias[, dresidual_bias]), C], added by the last CTAs into affine and dresidual_bias
  const int64_t parts = norm_backward_parts(dresidual_bias.defined());
  std::optional<PartialSums> sums;
  if (affine_grad || dresidual_bias.defined()) {  // (the rows of affine by pointer: no select op per row)
    const ParamTensor dweight = affine_grad ? param_tensor(affine) : kNoParam;
    const ParamTensor dbias{affine_grad ? static_cast<char*>(affine.data_ptr()) + C * affine.element_size() : nullptr,
                            dweight.dtype};
    sums.emplace(ctas, parts * C, f32, dweight, dbias, stream,
                 dresidual_bias.defined() ? param_tensor(dresidual_bias) : kNoParam);
  }
  RowNormBackwardParams p{x.data_ptr(), dy.data_ptr(), dx.data_ptr(), weight, mean.data_ptr<float>(),
                          rstd.data_ptr<float>(), affine_grad ? sums->data() : nullptr, M,
                          M > 1 ? x.stride(0) : C, M > 1 ? dy.stride(0) : C, C, int(C), row_threads};
  if (sums.has_value()) p.totals = sums->totals;
  if (dresidual_bias.defined()) p.bias_part = sums->data() + kResidualBiasPart * C;
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
  return {dx, affine, dresidual, dresidual_bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(const at::Tensor& x,
                                                              const std::optional<at::Tensor>& weight,
                                                              const std::optional<at::Tensor>& bias, double eps) {
  check_cuda(x, "x", "layer norm");
  const c10::cuda::CUDAGuard guard(x.device());
  auto [y, mean, rstd] = norm_rows(x, optional_param(weight, x, "weight"), optional_param(bias, x, "bias"), eps);
  return {raw_reshape(y, x.sizes()), mean, rstd};
}

namespace {

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
  auto [dx, affine, unused, unused_bias] =
      norm_rows_backward(dy, x, optional_param(weight, x, "weight"), mean, rstd, need_affine, affine_dtype);
  return {raw_reshape(dx, x.sizes()), affine};
}

}  // namespace

// sum = x + residual (x + (residual + residual_bias) * residual_scale with a bias and a scale) and
// layer_norm(sum), in one pass over the rows (the residual add of a block, its update's projection
// bias, mask or dropout, and the layer norm of the module after it).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_fwd(
    const at::Tensor& x, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, const std::optional<at::Tensor>& residual_scale,
    const std::optional<at::Tensor>& residual_bias) {
  check_cuda(x, "x", "add layer norm");
  EVO_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                residual.device() == x.device(),
            "add layer norm: `residual` must match x, got ", residual.sizes(), " ", residual.scalar_type());
  EVO_CHECK(!residual_bias.has_value() || residual_bias->scalar_type() == x.scalar_type(),
            "add layer norm: `residual_bias` must have x's dtype, got ", residual_bias->scalar_type());
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor sum;
  auto [y, mean, rstd] =
      norm_rows(x, optional_param(weight, x, "weight"), optional_param(bias, x, "bias"), eps, &residual, &sum,
                residual_scale, optional_param(residual_bias, x, "residual_bias"));
  return {raw_reshape(sum, x.sizes()), raw_reshape(y, x.sizes()), mean, rstd};
}

// The backward of add_layer_norm_fwd: dx = dsum + the layer norm's input gradient (the gradient of
// x, and of residual without a scale), the weight and bias gradients as layer_norm_bwd returns them,
// with residual_scale the residual's gradient dx * residual_scale (else an empty tensor), and with
// residual_bias_dtype the residual bias's gradient, the residual's summed over rows (else empty).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_bwd(
    const at::Tensor& dsum, const at::Tensor& dy, const at::Tensor& sum, const std::optional<at::Tensor>& weight,
    const at::Tensor& mean, const at::Tensor& rstd, bool need_affine, at::ScalarType affine_dtype,
    const std::optional<at::Tensor>& residual_scale, std::optional<at::ScalarType> residual_bias_dtype) {
  check_cuda(sum, "sum", "add layer norm backward");
  EVO_CHECK(dsum.sizes() == sum.sizes() && dsum.scalar_type() == sum.scalar_type() && dy.sizes() == sum.sizes() &&
                dy.scalar_type() == sum.scalar_type(),
            "add layer norm backward: `dsum` and `dy` must match `sum`, got ", dsum.sizes(), " and ", dy.sizes());
  EVO_CHECK(mean.numel() * sum.size(-1) == sum.numel() && rstd.numel() == mean.numel(),
            "add layer norm backward: `mean` and `rstd` must hold one value per row of sum");
  EVO_CHECK(is_param_dtype(affine_dtype),
            "add layer norm backward: `affine_dtype` must be float16, bfloat16 or float32, got ", affine_dtype);
  const c10::cuda::CUDAGuard guard(sum.device());
  EVO_CHECK(!residual_bias_dtype.has_value() || is_param_dtype(*residual_bias_dtype),
            "add layer norm backward: `residual_bias_dtype` must be float16, bfloat16 or float32, got ",
            *residual_bias_dtype);
  auto [dx, affine, dresidual, dresidual_bias] =
      norm_rows_backward(dy, sum, optional_param(weight, sum, "weight"), mean, rstd, need_affine, affine_dtype,
                         &dsum, residual_scale, residual_bias_dtype);
  return {raw_reshape(dx, sum.sizes()), affine,
          dresidual.defined() ? raw_reshape(dresidual, sum.sizes()) : new_empty({0}, sum.options()),
          dresidual_bias.defined() ? dresidual_bias : new_empty({0}, sum.options())};
}

}  // namespace block
}  // namespace evoformer

// (schemas: evoformer_blocks/ops/_fused.py)
TORCH_LIBRARY_IMPL(evoformer_blocks_cuda, CUDA, m) {
  m.impl("layer_norm_fwd", &evoformer::block::layer_norm_fwd);
  m.impl("layer_norm_bwd", &evoformer::block::layer_norm_bwd);
  m.impl("add_layer_norm_fwd", &evoformer::block::add_layer_norm_fwd);
  m.impl("add_layer_norm_bwd", &evoformer::block::add_layer_norm_bwd);
}
