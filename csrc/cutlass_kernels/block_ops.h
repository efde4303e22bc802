// Block-op kernels (layer norms and gates of the Evoformer modules): parameters and launchers.
//
// Legend: M rows (positions: every leading dim flattened), C channels. "Row-major" tensors are
// [M, C] with C contiguous and rows `*_stride` elements apart; "channel-major" ones are [C, M] with
// M contiguous and channels `*_stride` elements apart. Element types: cutlass::half_t,
// cutlass::bfloat16_t or float; statistics and affine parameters are float32.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace evoformer {
namespace block {

constexpr int kBlockOpThreads = 256;  // threads per CTA of every block-op kernel
// Row layer norm: a row is spread over up to 32 lanes with up to kMaxRowChunks 16-byte chunks each.
constexpr int kMaxRowChunks = 4;

struct RowNormParams {
  const void* x;        // [M, C] row-major
  void* y;              // [M, C] row-major, x's type
  const float* weight;  // [C] or nullptr (no affine)
  const float* bias;    // [C] or nullptr
  float* mean;          // [M]
  float* rstd;          // [M]
  int64_t M, x_stride, y_stride;
  int C;
  int row_threads;      // lanes per row (power of two <= 32)
  float eps;
};

struct RowNormBackwardParams {
  const void* x;         // [M, C] row-major: the forward's input
  const void* dy;        // [M, C] row-major
  void* dx;              // [M, C] row-major
  const float* weight;   // [C] or nullptr
  const float* mean;     // [M]
  const float* rstd;     // [M]
  float* dweight_part;   // [n_ctas, C] partial sums of dy * x_hat, or nullptr (not wanted)
  float* dbias_part;     // [n_ctas, C] partial sums of dy (with dweight_part)
  int64_t M, x_stride, dy_stride, dx_stride;
  int C;
  int row_threads;
};

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

struct GatePackParams {
  const void* ab;     // [4, C, M] channel-major (rows a_proj, a_gate, b_proj, b_gate), rows ab_stride apart
  const float* bias;  // [4, C]
  const void* mask;   // [M] or nullptr
  void* a;            // [C, M], rows out_stride apart
  void* b;            // [C, M]
  int64_t M, ab_stride, out_stride;
  int C;
  bool vector_ok;  // every row start is 16-byte aligned
};

struct GatePackBackwardParams {
  const void* ab;     // [4, C, M] as in the forward
  const float* bias;  // [4, C]
  const void* mask;   // [M] or nullptr
  const void* da;     // [C, M], rows d_stride apart
  const void* db;     // [C, M]
  void* dab;          // [4, C, M], rows dab_stride apart
  float* bias_part;   // [4 C, n_chunks]: partial row sums of dab (n_chunks = the grid's x extent)
  int64_t M, ab_stride, d_stride, dab_stride;
  int C;
  bool vector_ok;
};

struct SigmoidGateParams {
  const void* g;  // [M, C]
  const void* y;  // [M, C]
  void* out;      // [M, C]
  int64_t M, g_stride, y_stride, out_stride;
  int C;
  bool vector_ok;
};

struct SigmoidGateBackwardParams {
  const void* g;     // [M, C]
  const void* y;     // [M, C]
  const void* dout;  // [M, C]
  void* dg;          // [M, C]
  void* dy;          // [M, C]
  float* dg_part;    // [n_ctas, C]: partial column sums of dg
  float* dy_part;    // [n_ctas, C]: partial column sums of dy
  int64_t M, g_stride, y_stride, dout_stride, dg_stride, dy_stride;  // rows 16-byte aligned
  int C;
  int row_threads;   // lanes per row, as RowNormParams::row_threads
};

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
template <typename T>
void launch_gate_pack(const GatePackParams& p, cudaStream_t stream);
template <typename T>
void launch_gate_pack_backward(const GatePackBackwardParams& p, int n_chunks, cudaStream_t stream);
template <typename T>
void launch_sigmoid_gate(const SigmoidGateParams& p, cudaStream_t stream);
template <typename T>
void launch_sigmoid_gate_backward(const SigmoidGateBackwardParams& p, int n_ctas, cudaStream_t stream);

// Dynamic shared memory of the channel-norm kernels for C channels of T.
template <typename T>
constexpr int channel_norm_smem_bytes(int C) {
  return C * (64 + 16 / int(sizeof(T))) * int(sizeof(T)) + 2 * 64 * 4;
}

}  // namespace block
}  // namespace evoformer
