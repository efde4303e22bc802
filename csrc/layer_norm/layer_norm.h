// The layer-norm family: parameters and launchers of the row layer norms (also behind a residual
// add), the channel layer norms and the folding of layer-norm affine parameters into the projections
// that follow them (block_params.h has the legend).
#pragma once

#include "common/block_params.h"

namespace evoformer {
namespace block {

// CTAs per SM of the row layer norms other than the plain forward (kRowNormCtasPerSm): the forward
// with a residual scale (layer_norm_rows_kernel) and the backward (their one-chunk instantiations
// are compiled for that many).
constexpr int kRowNormScaledCtasPerSm = 3;
constexpr int kRowNormBackwardCtasPerSm = 3;

struct RowNormParams {
  const void* x;        // [M, C] row-major
  void* y;              // [M, C] row-major, x's type
  ParamTensor weight;   // [C] or absent (no affine)
  ParamTensor bias;     // [C] or absent
  float* mean;          // [M]
  float* rstd;          // [M]
  int64_t M, x_stride, y_stride;
  int C;
  int row_threads;      // lanes per row (power of two <= 32)
  float eps;
  const void* residual = nullptr;  // [M, C] row-major or nullptr: normalise x + residual
  void* sum = nullptr;             // [M, C] row-major: x + residual, written when residual is given
  int64_t residual_stride = 0, sum_stride = 0;
  // x's type or nullptr: the residual is scaled first (x + residual * scale, each product rounded to
  // the type as a PyTorch multiply would): one value per row at scale_rows(m) with scale_per_row (a
  // 0/1 row mask), else a row of C values there (16-byte aligned; e.g. a dropout mask shared along a
  // dimension, whose rows repeat)
  const void* residual_scale = nullptr;
  RowMap scale_rows{0, 1, 0, 0, 0};
  bool scale_per_row = true;
  // [C] or absent: the residual's bias, added to it before the scale (x + (residual + bias) * scale,
  // the sum rounded to the type first as a PyTorch add would): an update whose projection left its
  // bias to this pass
  ParamTensor residual_bias{nullptr, kParamFloat};
};

struct RowNormBackwardParams {
  const void* x;         // [M, C] row-major: the forward's input
  const void* dy;        // [M, C] row-major
  void* dx;              // [M, C] row-major
  ParamTensor weight;    // [C] or absent
  const float* mean;     // [M]
  const float* rstd;     // [M]
  // [n_ctas, 2, C] partial sums of dy * x_hat and of dy ([n_ctas, 3, C] with bias_part; NormPart
  // orders them), or nullptr (not wanted)
  float* affine_part;
  int64_t M, x_stride, dy_stride, dx_stride;
  int C;
  int row_threads;
  ColumnTotals totals;   // the partials' sums: out[0] dweight, out[1] dbias, out[2] dresidual_bias
  const void* dsum = nullptr;  // [M, C] row-major or nullptr: a gradient of x to add to dx
  int64_t dsum_stride = 0;
  // With residual_scale (the forward's, located as there), dresidual ([M, C] row-major) gets
  // dx * scale (dx rounded first, as autograd's multiply would take it).
  const void* residual_scale = nullptr;
  RowMap scale_rows{0, 1, 0, 0, 0};
  bool scale_per_row = true;
  void* dresidual = nullptr;
  int64_t dresidual_stride = 0;
  // Row kResidualBiasPart of [n_ctas, 3, C] partials or nullptr: the column sums of the residual's
  // gradient (dresidual with a scale, else dx): the gradient of the forward's residual_bias.
  float* bias_part = nullptr;
};

// The rows of the layer-norm backward's per-CTA partial sums ([n_ctas, parts, C]) and of their totals:
// the weight's gradient, the bias's, then (add_layer_norm with a residual bias) the residual bias's.
enum NormPart : int { kWeightPart = 0, kBiasPart = 1, kResidualBiasPart = 2 };
// How many of those rows a backward writes: all three with a residual bias, else the affine two.
constexpr int norm_backward_parts(bool residual_bias) { return residual_bias ? kResidualBiasPart + 1 : kBiasPart + 1; }

struct ChannelNormParams {
  const void* x;  // [C, M] channel-major
  void* y;        // [M, C] row-major: (x - mean) * rstd
  float* mean;    // [M]
  float* rstd;    // [M]
  int64_t M, x_stride, y_stride;
  int C;
  bool vector_ok;  // x rows can be read with 16-byte loads (x_stride and base aligned)
  float eps;
};

struct ChannelNormBackwardParams {
  const void* dy;     // [M, C] row-major
  const void* x_hat;  // [M, C] row-major: the forward's output
  const float* rstd;  // [M]
  void* dx;           // [C, M] channel-major
  int64_t M, dy_stride, x_hat_stride, dx_stride;
  int C;
  bool vector_ok;  // dx rows can be written with 16-byte stores
};

// Folding a layer norm's affine parameters into the projection that follows it:
//   LN(x) W^T + c = x_hat W'^T + c'  with  W' = W diag(w), c' = W b + c   (W [R, K], c [R], w, b [K])
// and mapping the folded projection's gradients back onto every parameter:
//   dW = dW' diag(w) + dc' b^T,  dc = dc',  dw = colsum(dW' * W),  db = W^T dc'.
// Parameters come in any float dtype (each tensor its own, read and written through ParamTensor);
// every sum is float32 in a fixed order (bitwise reproducible).
constexpr int kMaxFoldGroups = limits::kMaxFoldProjections;  // projections per launch
constexpr int kMaxFoldNorms = limits::kMaxFoldNorms;         // layer norms per launch

struct FoldGroup {
  ParamTensor W, c;          // [R, K], [R]: the projection
  ParamTensor W_out, c_out;  // [R, K], [R]: the folded projection (fold)
  int R, K;
  int norm;                 // index of the layer norm (FoldParams::w/b) in front of the projection
};

struct FoldParams {
  FoldGroup group[kMaxFoldGroups];
  ParamTensor w[kMaxFoldNorms], b[kMaxFoldNorms];  // [K] the layer norms' weight and bias
  int n_groups;
};

struct UnfoldGroup {
  ParamTensor dW_folded, dc_folded;  // [R, K], [R]: gradients of W' and c'
  ParamTensor W;                     // [R, K]: the projection's own weight
  ParamTensor dW, dc;                // [R, K], [R]: gradients of W and c (outputs)
  int R, K;
  int norm;
};

struct UnfoldParams {
  UnfoldGroup group[kMaxFoldGroups];
  ParamTensor w[kMaxFoldNorms], b[kMaxFoldNorms];    // [K] the layer norms' weight and bias
  ParamTensor dw[kMaxFoldNorms], db[kMaxFoldNorms];  // [K] their gradients (outputs)
  int K[kMaxFoldNorms];
  int n_groups, n_norms;
};

// One launch each; rows of every group are spread over warps, the layer norms' column sums over
// CTAs of a few columns whose threads split the rows (weight_fold.cuh).
void launch_fold_affine(const FoldParams& p, cudaStream_t stream);
void launch_unfold_affine_grads(const UnfoldParams& p, cudaStream_t stream);

// Launchers, one instantiation per element type T (cutlass::half_t, cutlass::bfloat16_t, float).
// Each checks its launch. Row-norm grids are sized by the caller (n_ctas; the backward's partials
// have that many rows); channel-norm kernels need C * (64 + 16 / sizeof(T)) * sizeof(T) + 512 bytes
// of shared memory (channel_norm_smem_bytes).
template <typename T>
void launch_layer_norm_rows(const RowNormParams& p, int n_ctas, cudaStream_t stream);
template <typename T>
void launch_layer_norm_rows_backward(const RowNormBackwardParams& p, int n_ctas, cudaStream_t stream);
template <typename T>
void launch_layer_norm_channels(const ChannelNormParams& p, cudaStream_t stream);
template <typename T>
void launch_layer_norm_channels_backward(const ChannelNormBackwardParams& p, cudaStream_t stream);

// Dynamic shared memory of the channel-norm kernels for C channels of T.
template <typename T>
constexpr int channel_norm_smem_bytes(int C) {
  return C * (64 + 16 / int(sizeof(T))) * int(sizeof(T)) + 2 * 64 * 4;
}

}  // namespace block
}  // namespace evoformer
