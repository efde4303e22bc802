// The outer product mean's family: parameters and launchers of the tile GEMM around its [i, c, j, e]
// intermediate (linear_out and its input gradient) and of the weight gradient (block_params.h has the
// legend).
#pragma once

#include "common/block_params.h"

namespace evoformer {
namespace block {

// One tile GEMM of the outer product mean around its [i, c, j, e] intermediate (opm_gemm.cuh): per
// batch z-index bi (grid.z), row tile, column tile of 128: out[r, n] = sum over steps s of the
// 32-value dot products of A row r and B row n (+ bias[n]); 16-bit elements, every pointer and
// stride 16-byte aligned.
constexpr int kOpmTile = limits::kOpmTile;  // rows and columns of a CTA's tile
constexpr int kOpmStep = limits::kOpmStep;  // k values per step
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

// grid (row tiles * column_tiles, 1, batches <= limits::kOpmMaxBatches); _sm90: the same GEMM on the
// Hopper tensor-core instructions (opm_gemm_sm90.cuh; a build for sm_90a on a 9.0 device)
template <typename T>
void launch_opm_gemm(const OpmGemmParams& p, int64_t batches, int column_tiles, cudaStream_t stream);
template <typename T>
void launch_opm_gemm_sm90(const OpmGemmParams& p, int64_t batches, int column_tiles, cudaStream_t stream);

// The outer product mean's weight gradient (opm_gemm.cuh): dW[z, c C + e] = sum over (b, i, j) of
// dout[b, i, j, z] o[b, i, c, j, e], C = limits::kOpmHidden, Z <= kOpmTile, as float32 partials
// [splits, Z, C C].
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

}  // namespace block
}  // namespace evoformer
