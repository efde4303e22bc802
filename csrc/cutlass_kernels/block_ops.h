// Block-op kernels (layer norms and gates of the Evoformer modules): parameters and launchers.
//
// Legend: M rows (positions: every leading dim flattened), C channels. "Row-major" tensors are
// [M, C] with C contiguous and rows `*_stride` elements apart; "channel-major" ones are [C, M] with
// M contiguous and channels `*_stride` elements apart. Element types: cutlass::half_t,
// cutlass::bfloat16_t or float; statistics and affine parameters are float32.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernel_limits.h"

namespace evoformer {
namespace block {

constexpr int kBlockOpThreads = 256;  // threads per CTA of every block-op kernel

// A contiguous parameter tensor (weight, bias, their gradients) in its own float dtype: the
// kernels read and write it through param_load / param_store (layer_norm.cuh), so a model's
// float32 or half-precision parameters need no conversion on the host.
enum ParamDtype : int { kParamHalf = 0, kParamBFloat16 = 1, kParamFloat = 2 };

struct ParamTensor {
  void* ptr;  // contiguous; nullptr: absent
  int dtype;  // ParamDtype
};

// Where a kernel's per-CTA column partial sums end up (add_partials_in_last_cta): the last CTAs to
// finish add the partial rows in CTA order (a fixed order: bitwise reproducible) into out[i] [C],
// in out[i]'s dtype (the parameter's: no conversion on the host). tickets [ceil(n_ctas /
// kCtasPerSumGroup) + 1] are zeroed by the host before the launch; group_part holds
// [ceil(n_ctas / kCtasPerSumGroup), parts, C] floats. tickets == nullptr: the partials stay for
// the host.
constexpr int kCtasPerSumGroup = 16;

struct ColumnTotals {
  unsigned* tickets = nullptr;
  float* group_part = nullptr;
  ParamTensor out[2] = {{nullptr, kParamFloat}, {nullptr, kParamFloat}};
};

// Row kernels: a row is spread over up to limits::kRowMaxLanes lanes with up to kMaxRowChunks chunks
// of limits::kRowChunkBytes each (kernel_table.json: row_kernels).
constexpr int kMaxRowChunks = limits::kMaxRowChunks;
// CTAs per SM of the row layer norms' grids (grid-stride loops): the forward's, and the backward's
// (its one-chunk instantiation is compiled for that many).
constexpr int kRowNormCtasPerSm = 4;
constexpr int kRowNormScaledCtasPerSm = 3;  // the forward with a residual scale (layer_norm_rows_kernel)
constexpr int kRowNormBackwardCtasPerSm = 3;
// CTAs per SM of the gate backward that also sums the attention's delta (its one-chunk
// instantiation is compiled for that many; the plain one fits four without a bound).
constexpr int kGateDeltaCtasPerSm = 4;

// Where row m of an [M, C] operand starts when the operand is a permuted view (rows in another
// order than its memory): m = (m2 * mid + m1) * inner + m0 with m0 < inner and m1 < mid starts at
// m2 * s2 + m1 * s1 + m0 * s0 elements. A matrix with rows `stride` apart is strided(stride).
struct RowMap {
  int64_t inner, mid, s0, s1, s2;

  static RowMap strided(int64_t stride) { return RowMap{0, 1, stride, 0, 0}; }
  __host__ __device__ __forceinline__ int64_t operator()(int64_t m) const {
    if (inner == 0) return m * s0;
    const int64_t q = m / inner;
    return (q / mid) * s2 + (q % mid) * s1 + (m - q * inner) * s0;
  }
  // The same for m < 2^31 (the caller's guarantee): 32-bit divisions, where a 64-bit one is a
  // subroutine call on the GPU (whose calling convention made a row kernel spill registers).
  __host__ __device__ __forceinline__ int64_t small(int64_t m) const {
    if (inner == 0) return m * s0;
    const uint32_t q = uint32_t(m) / uint32_t(inner), q2 = q / uint32_t(mid);
    return int64_t(q2) * s2 + int64_t(q - q2 * uint32_t(mid)) * s1 + (m - int64_t(q) * inner) * s0;
  }
};

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
};

struct RowNormBackwardParams {
  const void* x;         // [M, C] row-major: the forward's input
  const void* dy;        // [M, C] row-major
  void* dx;              // [M, C] row-major
  ParamTensor weight;    // [C] or absent
  const float* mean;     // [M]
  const float* rstd;     // [M]
  float* affine_part;    // [n_ctas, 2, C] partial sums of dy * x_hat and of dy, or nullptr (not wanted)
  int64_t M, x_stride, dy_stride, dx_stride;
  int C;
  int row_threads;
  ColumnTotals totals;   // affine_part's sums: out[0] dweight, out[1] dbias
  const void* dsum = nullptr;  // [M, C] row-major or nullptr: a gradient of x to add to dx
  int64_t dsum_stride = 0;
  // With residual_scale (the forward's, located as there), dresidual ([M, C] row-major) gets
  // dx * scale (dx rounded first, as autograd's multiply would take it).
  const void* residual_scale = nullptr;
  RowMap scale_rows{0, 1, 0, 0, 0};
  bool scale_per_row = true;
  void* dresidual = nullptr;
  int64_t dresidual_stride = 0;
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
  // The row sums: the last of a row's n_chunks CTAs (counted on tickets[blockIdx.y], [2 C], zeroed
  // by the host) adds its partials in chunk order into bias_total[(r / C) * total_stride + r % C]
  // for its rows r. tickets == nullptr: the partials stay for the host.
  unsigned* tickets = nullptr;
  float* bias_total = nullptr;
  int64_t total_stride = 0;
};

// The triangle multiplication's input half in one kernel (triangle_input.cuh): layer norm of z, both
// edges' projections and gates, the output gate's projection. Folded weights (no affine left).
struct TriangleInputParams {
  const void* z;       // [M, K] row-major, rows z_stride apart (16-byte aligned)
  const void* w_ab;    // [4 C, K]: rows a_proj, a_gate, b_proj, b_gate, of z's type
  const float* b_ab;   // [4 C]
  const void* w_g;     // [G, K], z's type
  const void* b_g;     // [G], z's type
  const void* mask;    // [M], z's type, or nullptr
  void* a;             // [C, M] channel-major
  void* b;             // [C, M]
  void* g;             // [M, G] row-major
  float* mean;         // [M]
  float* rstd;         // [M]
  int64_t M, z_stride;
  int K, C, G;         // K, G multiples of 8; K <= kTriangleInputMaxK
  float eps;
  bool vector_ok;      // a and b rows can be stored 16 bytes at a time (M % 8 == 0, aligned bases)
  int c_rows = 0;      // channels between w_ab's / b_ab's four row blocks (C)
  bool hopper = false; // run the sm_90a (wgmma) kernel: only where block_hopper_kernels() says so
};
constexpr int kTriangleInputMaxK = 256;

// Its backward for the edges (a group of C channels of c_rows): the projections and gates recomputed
// from x_hat, then d(ab) from da, db as gate_pack_backward computes it, and per-CTA partial row sums
// of d(ab) (the biases' gradients).
struct TriangleGateBackwardParams {
  const void* x_hat;   // [M, K] row-major, rows x_stride apart (16-byte aligned)
  const void* w_ab;    // [4, c_rows, K] folded; the group's first channel at the pointer
  const float* b_ab;   // [4, c_rows], likewise
  const void* mask;    // [M] or nullptr
  const void* da;      // [C, M] channel-major, rows M apart
  const void* db;      // [C, M]
  void* dab;           // [4, C, M]: rows (a_proj, a_gate, b_proj, b_gate) x C channels
  float* bias_part;    // [n_ctas, 4 C]: the CTA's sums of the dab rows (as rounded to T)
  int64_t M, x_stride;
  int K, C, c_rows;
  bool vector_ok;      // M % 8 == 0 and 16-byte aligned da, db, dab
  const void* w_g = nullptr;  // no g passes
  int G = 0;
};

// The triangle multiplication's output half in one kernel (triangle_output.cuh): the channel layer
// norm of p, the output projection (w_z folded) and the gate, out = sigmoid(g) * (n_hat w_z^T + b_z).
struct TriangleOutputParams {
  const void* p;     // [C, M] channel-major, rows M apart
  const void* g;     // [M, G] row-major
  const void* w_z;   // [G, C] folded
  const void* b_z;   // [G]
  void* out;         // [M, G]: sigmoid(g) * (n_hat w_z^T + b_z), plus the residual where given
  void* n_hat;       // [M, C]
  float* rstd;       // [M]
  int64_t M;
  int C, G;          // multiples of 8, C <= kTriangleOutputMaxC, G <= kTriangleOutputMaxG
  float eps;
  bool vector_ok;    // p's rows can be read 16 bytes at a time (M % 8 == 0, aligned base)
  // Optional (nullptr: absent): out = residual + update (* scale), residual [M, G] row-major (the op's
  // input z), scale [B, N, G] per (b, j, column) of position m = (b N + i) N + j (a row-wise dropout
  // mask shared by the rows i); n_res = N.
  const void* residual;
  const void* scale;
  int64_t n_res;
};
constexpr int kTriangleOutputMaxC = 128;
constexpr int kTriangleOutputMaxG = 128;

// The output half's backward in one kernel (triangle_output.cuh), under the same limits: with y =
// n_hat w_z^T + b_z recomputed, dy = dout sigmoid(g), dg = dout y sigmoid'(g), and the channel
// layer norm's backward of dn_hat = dy w_z into dp. One CTA per 128 positions.
struct TriangleOutputBackwardParams {
  const void* n_hat;  // [M, C] row-major (saved by the forward)
  const void* w_z;    // [G, C] folded
  const void* w_zt;   // [C, G]: w_z transposed (the second product's B operand, n-major)
  const void* b_z;    // [G]
  const void* g;      // [M, G]
  const void* dout;   // [M, G]
  const float* rstd;  // [M]: the channel layer norm's
  void* dg;           // [M, G]
  void* dy;           // [M, G]
  void* dp;           // [C, M] channel-major
  float* dy_part;     // [ceil(M / 128), G]: per-CTA column sums of dy (as stored), then of dg
  float* dg_part;
  ColumnTotals totals;  // out[0] the sum of dy_part (db_z), out[1] of dg_part (db_g)
  int64_t M;
  int C, G;
  bool vector_ok;  // dp's rows can be written 16 bytes at a time (M % 8 == 0, aligned base)
};

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

// Folding a layer norm's affine parameters into the projection that follows it:
//   LN(x) W^T + c = x_hat W'^T + c'  with  W' = W diag(w), c' = W b + c   (W [R, K], c [R], w, b [K])
// and mapping the folded projection's gradients back onto every parameter:
//   dW = dW' diag(w) + dc' b^T,  dc = dc',  dw = colsum(dW' * W),  db = W^T dc'.
// Parameters come in any float dtype (each tensor its own, read and written through ParamTensor);
// every sum is float32 in a fixed order (bitwise reproducible).
constexpr int kMaxFoldGroups = 3;  // projections per launch
constexpr int kMaxFoldNorms = 2;   // layer norms per launch

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
template <typename T>
void launch_gate_pack(const GatePackParams& p, cudaStream_t stream);
template <typename T>
void launch_gate_pack_backward(const GatePackBackwardParams& p, int n_chunks, cudaStream_t stream);
template <typename T>
void launch_sigmoid_gate(const SigmoidGateParams& p, cudaStream_t stream);
template <typename T>
void launch_sigmoid_gate_backward(const SigmoidGateBackwardParams& p, int n_ctas, cudaStream_t stream);
template <typename T>
void launch_column_sum(const ColumnSumParams& p, int n_ctas, cudaStream_t stream);

// Half and bfloat16 only (T = cutlass::half_t, cutlass::bfloat16_t); K <= kTriangleInputMaxK.
template <typename T>
void launch_triangle_input(const TriangleInputParams& p, cudaStream_t stream);
template <typename T>
void launch_triangle_input_sm90(const TriangleInputParams& p, cudaStream_t stream);  // (p.hopper)
// One CTA per 128 positions: bias_part has ceil(M / 128) rows.
template <typename T>
void launch_triangle_gate_backward(const TriangleGateBackwardParams& p, cudaStream_t stream);
constexpr int kTriangleGateBackwardRows = 128;

// One tile GEMM of the outer product mean around its [i, c, j, e] intermediate (opm_gemm.cuh): per
// batch z-index bi (grid.z), row tile, column tile of 128: out[r, n] = sum over steps s of the
// 32-value dot products of A row r and B row n (+ bias[n]); 16-bit elements, every pointer and
// stride 16-byte aligned.
constexpr int kOpmTile = 128;  // rows and columns of a CTA's tile
constexpr int kOpmStep = 32;   // k values per step
struct OpmGemmParams {
  const void* a;     // A row r, step s at a + bi * a_batch + r * a_row + s * a_step
  const void* b;     // B row n (of column tile y), step s at b + y * b_tile + n * b_row + s * b_step
  const void* bias;  // [columns] in the element type, or nullptr
  void* out;         // (r, n) at out + bi * out_batch + y * out_tile + r * out_row + (n / 32) * out_block + n % 32
  // Optional epilogue inputs (nullptr: absent), both in the element type: the result of row r is
  // divided by denom[bi * rows + r], then residual (laid out as out) is added.
  const void* denom;
  const void* residual;
  int64_t a_batch, a_row, a_step, b_tile, b_row, b_step;
  int64_t out_batch, out_tile, out_row, out_block;
  int rows;          // valid rows of A per batch index
  int steps;         // k-steps of 32
  int column_tiles;  // grid x = row tiles * column_tiles
};

// grid (row tiles * column_tiles, 1, batches <= 65535)
template <typename T>
void launch_opm_gemm(const OpmGemmParams& p, int64_t batches, int column_tiles, cudaStream_t stream);

// The outer product mean's weight gradient (opm_gemm.cuh): dW[z, c C + e] = sum over (b, i, j) of
// dout[b, i, j, z] o[b, i, c, j, e], C = 32, Z <= 128, as float32 partials [splits, Z, C C].
struct OpmWeightGradParams {
  const void* dout;     // [B I, J, Z]
  const void* outer;    // o [B I, C, J, C]
  float* partial;       // [splits, Z, C C]
  int64_t outer_batch;  // C J C
  int J, Z;
  int chunks;  // ceil(J / 32)
  int steps;   // B I chunks
};
template <typename T>
void launch_opm_weight_grad(const OpmWeightGradParams& p, int splits, cudaStream_t stream);

template <typename T>
void launch_triangle_output(const TriangleOutputParams& p, cudaStream_t stream);
template <typename T>
void launch_triangle_output_backward(const TriangleOutputBackwardParams& p, cudaStream_t stream);
constexpr int kTriangleOutputBackwardRows = 128;

// Dynamic shared memory of the channel-norm kernels for C channels of T.
template <typename T>
constexpr int channel_norm_smem_bytes(int C) {
  return C * (64 + 16 / int(sizeof(T))) * int(sizeof(T)) + 2 * 64 * 4;
}

}  // namespace block
}  // namespace evoformer
