// The gating family: parameters and launchers of the sigmoid gate of an output and of the column
// sums of rows (a projection's bias gradient, with a ReLU's backward where asked), forward and
// backward (block_params.h has the legend).
#pragma once

#include "common/block_params.h"

namespace evoformer {
namespace block {

// CTAs per SM of the gate backward that also sums the attention's delta (its one-chunk
// instantiation is compiled for that many; the plain one fits four without a bound).
constexpr int kGateDeltaCtasPerSm = 4;

struct SigmoidGateParams {
  const void* g;  // [M, C]
  const void* y;  // [M, C], rows at y_rows
  void* out;      // [M, C]
  int64_t M, g_stride, out_stride;
  RowMap y_rows;
  int C;
  bool vector_ok;
};

struct SigmoidGateBackwardParams {
  const void* g;     // [M, C]
  const void* y;     // [M, C], rows at y_rows
  const void* dout;  // [M, C]
  void* dg;          // [M, C]
  void* dy;          // [M, C], rows at y_rows (y's layout)
  float* dg_part;    // [n_ctas, C]: partial column sums of dg, or nullptr
  float* dy_part;    // [n_ctas, C]: partial column sums of dy, or nullptr
  int64_t M, g_stride, dout_stride, dg_stride;  // every row 16-byte aligned
  RowMap y_rows;
  int C;
  int row_threads;   // lanes per row, as RowNormParams::row_threads
  ColumnTotals totals;  // out[0] the sum of dy_part, out[1] of dg_part
  // With delta (the gated attention's backward: y is the attention output [B, N, Lq, H, D] seen in
  // g's row order): delta [B, N, H, Lq] float32 = the sum over each head's D values of dy * y, dy
  // as stored (float: rounded to TF32, as the attention's products take it), for the attention's
  // backward. A head's values are the same chunk of 1 << delta_lanes_log2 consecutive lanes;
  // o_rows maps g's row m to y's row index (b N + n) Lq + i (m < 2^31).
  float* delta = nullptr;
  RowMap o_rows{};
  int delta_len = 0, delta_heads = 0, delta_lanes_log2 = 0;  // Lq, H
};

// Column sums of x [M, C] (rows x_stride elements apart, 16-byte aligned): part [n_ctas, C] float32,
// one row of partial sums per CTA, added over CTAs in order into totals.out[0].
struct ColumnSumParams {
  const void* x;
  float* part;
  int64_t M, x_stride;
  int C;
  int row_threads;  // lanes per row, as RowNormParams::row_threads
  ColumnTotals totals;
  // With relu_out ([M, C] row-major, the output of a ReLU whose gradient x is): x's values where
  // relu_out > 0, else 0, are summed and written to masked ([M, C] row-major), the ReLU's backward.
  const void* relu_out = nullptr;
  void* masked = nullptr;
  int64_t relu_stride = 0, masked_stride = 0;
};

// out = x * s, x / s or residual + x * s with one scale s per row: x, residual, out [M, C] (each
// its own row stride), s [M] contiguous, all of one element type. The values are ATen's for
// at::mul, at::div and at::addcmul on the same tensors (s broadcast over C): the product or IEEE
// quotient in float32, residual + x * s as one fused multiply-add (PyTorch's addcmul with value 1),
// rounded once to T.
struct RowScaleParams {
  const void* x;
  const void* s;
  const void* residual;  // nullptr: none
  void* out;
  int64_t M, x_stride, residual_stride, out_stride;
  int C;
  bool divide;     // x / s (no residual)
  bool vector_ok;  // every row 16-byte aligned and C whole 16-byte chunks
};

// Launchers, one instantiation per element type T (cutlass::half_t, cutlass::bfloat16_t, float);
// each checks its launch.
template <typename T>
void launch_sigmoid_gate(const SigmoidGateParams& p, cudaStream_t stream);
template <typename T>
void launch_sigmoid_gate_backward(const SigmoidGateBackwardParams& p, int n_ctas, cudaStream_t stream);
template <typename T>
void launch_column_sum(const ColumnSumParams& p, int n_ctas, cudaStream_t stream);
template <typename T>
void launch_row_scale(const RowScaleParams& p, cudaStream_t stream);

}  // namespace block
}  // namespace evoformer
