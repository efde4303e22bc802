// Op kernels (TORCH_LIBRARY_IMPL) of the gating family: the sigmoid gate of an output, the column sums
// of bias gradients and the backward of a linear layer (whose bias gradient, and ReLU backward, are
// a column-sum pass), forward and backward (gating_ops.h: the entry points other families call).
// The Python ops (evoformer_blocks.ops) validate the arguments; the checks here only guard the
// kernels' memory accesses for direct torch.ops calls.
//
// Ops (namespace evoformer_blocks_cuda, declared in evoformer_blocks/ops/_fused.py), CUDA only:
//   sigmoid_gate_fwd(g [..., C], y [..., C]) -> sigmoid(g) * y (contiguous; y may be a permuted view)
//   sigmoid_gate_bwd(dout, g, y) -> (dg contiguous, dy in y's layout)
//   sigmoid_gate_bwd_into(dout, g, y, dg, delta_heads=0, delta_len=0) -> (dy in y's layout, delta);
//       dg written into the given rows; with delta_heads (y the attention output [B, N, Lq, H, D]
//       seen in g's order), delta [B * N * H * Lq] = rowsum(dy * y) per head, or empty where the
//       kernel cannot sum it
//   column_sum(x [..., C], dtype) -> [C] in dtype: the float32 sum over rows (a projection's bias gradient)
//   linear_bwd(dy [..., out], x [..., in], weight [out, in], relu_out?, need_dx, need_dw, need_db, bias_dtype,
//              bias_from=0)
//       -> (dx, dweight, dbias) of x . weight^T + bias (then ReLU, relu_out its output), each [0] unless wanted;
//       bias [out - bias_from] adds to the columns from bias_from on (a stacked projection's biased part)
//   row_scale(x [..., C], s [...], residual [..., C]?, divide) -> x * s, x / s or residual + x * s with s
//       broadcast over C (at::mul, at::div, at::addcmul's values, bit for bit), contiguous; x and residual
//       any layout
//   rows_product(a [m, K], b [K, n]) -> a . b [m, n] in a's dtype: a sum over K positions that leaves
//       none out (bindings_common.h's rows_product; a weight's gradient where the Python side forms it);
//       batched, a [B, m, K] and b [B, K, n] -> [B, m, n] (rows_bmm: the outer product mean's GEMMs)
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>

#include "common/block_bindings.h"
#include "gating/gating.h"
#include "gating/gating_ops.h"

namespace evoformer {
namespace block {
namespace {

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
  at::Tensor dy_out = y_in.is_contiguous() ? new_empty(y_in.sizes(), y_in.options()) : at::empty_like(y_in);
  at::Tensor dy = dy_out.strides() == y.strides() ? dy_out : at::empty_like(y);
  maybe_poison(dy);
  const int64_t M = g.size(0);
  const int row_threads = row_threads_for(C, g.element_size());
  const int ctas = row_norm_ctas(M, row_threads);
  SigmoidGateBackwardParams p{g.data_ptr(), y.data_ptr(), dout.data_ptr(), dg_rows.data_ptr(), dy.data_ptr(),
                              nullptr, nullptr, M, M > 1 ? g.stride(0) : C, M > 1 ? dout.stride(0) : C,
                              M > 1 ? dg_rows.stride(0) : C, y_rows, int(C), row_threads};
  at::Tensor delta = new_empty({0}, g.options().dtype(at::kFloat));
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

}  // namespace

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
    // [rows, out - bias_from]
    const at::Tensor biased = bias_from > 0 ? raw_narrow(dy, 1, bias_from, C - bias_from) : dy;
    db = sum_kernel ? column_sum_rows(biased, bias_dtype) : at::sum(biased, {0}, false, at::kFloat).to(bias_dtype);
  }
  at::Tensor dx, dw;
  if (need_dx) dx = as_dtype(raw_reshape(at::mm(dy, as_dtype(weight, dy.scalar_type())), x.sizes()), x.scalar_type());  // [..., in]
  if (need_dw) {
    const at::Tensor dy_t = raw_transpose(dy);  // dy^T [out, rows]
    const at::Tensor rows = as_dtype(flat_rows(x, x.size(-1)), dy.scalar_type());  // [rows, in]
    dw = as_dtype(rows_product(dy_t, rows), weight.scalar_type());  // [out, in]
  }
  // an op returns tensors: a new [0] one for each gradient not wanted (outputs must not alias)
  const auto wanted = [&](bool need, const at::Tensor& t) { return need ? t : new_empty({0}, dy_in.options()); };
  return {wanted(need_dx, dx), wanted(need_dw, dw), wanted(need_db, db)};
}

at::Tensor sigmoid_gate_forward(const at::Tensor& g, const at::Tensor& y) { return sigmoid_gate_fwd(g, y); }

at::Tensor rows_product_op(const at::Tensor& a, const at::Tensor& b) {
  const char* op = "rows_product";
  check_cuda(a, "a", op);
  const bool batched = a.dim() == 3;
  EVO_CHECK((a.dim() == 2 || batched) && b.dim() == a.dim() && a.size(-1) == b.size(-2) &&
                (!batched || a.size(0) == b.size(0)) && a.scalar_type() == b.scalar_type() && a.device() == b.device(),
            op, ": `a` [m, K] and `b` [K, n] (or [B, m, K] and [B, K, n]) must match in B, K, dtype and device, got ",
            a.sizes(), " ", a.scalar_type(), " and ", b.sizes(), " ", b.scalar_type());
  const c10::cuda::CUDAGuard guard(a.device());
  return batched ? rows_bmm(a, b) : rows_product(a, b);
}

std::tuple<at::Tensor, at::Tensor> sigmoid_gate_backward_into(const at::Tensor& dout, const at::Tensor& g,
                                                              const at::Tensor& y, at::Tensor& dg,
                                                              int64_t delta_heads, int64_t delta_len) {
  return sigmoid_gate_bwd_into(dout, g, y, dg, delta_heads, delta_len);
}

namespace {

// The row stride of t [..., C] seen as [M, C] rows, its leading dims merged without a copy into one
// (row_map_of with a single level), or -1 where they do not merge or C is not contiguous.
int64_t merged_row_stride(const at::Tensor& t) {
  RowMap map;
  if ((t.size(-1) > 1 && t.stride(-1) != 1) || !row_map_of(t, map) || map.mid != 1) return -1;
  return map.s0;
}

// The row kernel's parameters for out = x * s, x / s or residual + x * s (row_scale_into), or false
// where it does not take the tensors: one dtype of its three, one CUDA device, s contiguous, rows
// that merge into [M, C] without a copy, no empty x.
bool row_scale_params(RowScaleParams& p, const at::Tensor& out, const at::Tensor& x, const at::Tensor& s,
                      const at::Tensor* residual, bool divide) {
  const at::ScalarType dtype = x.scalar_type();
  const auto fits = [&](const at::Tensor& t) { return t.scalar_type() == dtype && t.device() == x.device(); };
  if (!x.is_cuda() || !is_param_dtype(dtype) || !fits(s) || !fits(out) || (residual != nullptr && !fits(*residual)) ||
      !s.is_contiguous() || x.numel() == 0)
    return false;
  const int64_t x_stride = merged_row_stride(x), out_stride = merged_row_stride(out);
  const int64_t residual_stride = residual != nullptr ? merged_row_stride(*residual) : 0;
  if (x_stride < 0 || out_stride < 0 || residual_stride < 0) return false;
  const int64_t C = x.size(-1), M = x.numel() / C, vec = 16 / x.element_size();
  const auto rows_ok = [&](const at::Tensor& t, int64_t stride) { return aligned16(t) && (M <= 1 || stride % vec == 0); };
  const bool vector_ok = C % vec == 0 && rows_ok(x, x_stride) && rows_ok(out, out_stride) &&
                         (residual == nullptr || rows_ok(*residual, residual_stride));
  p = RowScaleParams{x.data_ptr(),  s.data_ptr(), residual != nullptr ? residual->data_ptr() : nullptr,
                     out.data_ptr(), M,           x_stride,
                     residual_stride, out_stride, int(C),
                     divide,         vector_ok};
  return true;
}

void check_row_scale(const at::Tensor& x, const at::Tensor& s, const at::Tensor* residual, bool divide) {
  EVO_CHECK(x.dim() >= 1 && s.sizes() == x.sizes().slice(0, x.dim() - 1) &&
                (residual == nullptr || (residual->sizes() == x.sizes() && !divide)),
            "row scale: `x` [..., C], `s` [...] and `residual` [..., C] (none with divide) do not fit: ", x.sizes(),
            ", ", s.sizes(), residual != nullptr ? ", residual " : "", residual != nullptr ? residual->sizes() : x.sizes());
}

void launch_row_scale_on(const RowScaleParams& p, const at::Tensor& x) {
  const c10::cuda::CUDAGuard guard(x.device());
  by_dtype(x.scalar_type(), "row scale",
           [&](auto e) { launch_row_scale<decltype(e)>(p, c10::cuda::getCurrentCUDAStream()); });
}

}  // namespace

at::Tensor& row_scale_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& s, const at::Tensor* residual,
                           bool divide) {
  check_row_scale(x, s, residual, divide);
  EVO_CHECK(out.sizes() == x.sizes(), "row scale: `out` must be x's shape ", x.sizes(), ", got ", out.sizes());
  RowScaleParams p;
  if (!row_scale_params(p, out, x, s, residual, divide)) {
    const at::Tensor s_c = s.unsqueeze(-1);  // [..., 1]: ATen's broadcast
    if (residual != nullptr) return at::addcmul_out(out, *residual, x, s_c);
    return divide ? at::div_out(out, x, s_c) : at::mul_out(out, x, s_c);
  }
  launch_row_scale_on(p, x);
  return out;
}

at::Tensor row_scaled(const at::Tensor& x, const at::Tensor& s, const at::Tensor* residual, bool divide) {
  check_row_scale(x, s, residual, divide);
  at::Tensor out = output(x.sizes(), x.options());
  RowScaleParams p;
  if (!row_scale_params(p, out, x, s, residual, divide)) {  // ATen's calls, with their type promotion
    const at::Tensor s_c = s.unsqueeze(-1);  // [..., 1]
    if (residual != nullptr) return at::addcmul(*residual, x, s_c).contiguous();
    return (divide ? at::div(x, s_c) : at::mul(x, s_c)).contiguous();
  }
  launch_row_scale_on(p, x);
  return out;
}

namespace {

at::Tensor row_scale_op(const at::Tensor& x, const at::Tensor& s, const std::optional<at::Tensor>& residual,
                        bool divide) {
  return row_scaled(x, s, residual.has_value() ? &*residual : nullptr, divide);
}

}  // namespace

}  // namespace block
}  // namespace evoformer

// (schemas: evoformer_blocks/ops/_fused.py)
TORCH_LIBRARY_IMPL(evoformer_blocks_cuda, CUDA, m) {
  m.impl("sigmoid_gate_fwd", &evoformer::block::sigmoid_gate_fwd);
  m.impl("sigmoid_gate_bwd", &evoformer::block::sigmoid_gate_bwd);
  m.impl("sigmoid_gate_bwd_into", &evoformer::block::sigmoid_gate_bwd_into);
  m.impl("column_sum", &evoformer::block::column_sum);
  m.impl("linear_bwd", &evoformer::block::linear_bwd);
  m.impl("rows_product", &evoformer::block::rows_product_op);
  m.impl("row_scale", &evoformer::block::row_scale_op);
}
