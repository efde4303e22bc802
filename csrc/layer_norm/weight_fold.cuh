// Kernels that fold layer-norm affine parameters into the projections after them, and map the
// folded projections' gradients back (layer_norm.h, "Folding a layer norm's affine parameters").
// The tensors are small (weights, not activations): what matters is one launch instead of a few
// dozen tensor ops on the host. Warp per projection row for the element-wise parts and the row
// dot products (lane partials, then a fixed butterfly); for the column sums, a CTA per few layer-norm
// columns whose threads split the rows, their partials added in a fixed order. No atomics: bitwise
// reproducible.
#pragma once

#include "common/row_kernels.cuh"  // param_load, param_store
#include "layer_norm/layer_norm.h"

namespace evoformer {
namespace block {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Row r of the concatenated groups' rows: the group and the row within it (false past the end).
template <typename Group>
__device__ __forceinline__ bool locate_row(const Group* groups, int n_groups, int r, int& g, int& row) {
  for (g = 0; g < n_groups; ++g) {
    if (r < groups[g].R) {
      row = r;
      return true;
    }
    r -= groups[g].R;
  }
  return false;
}

constexpr int kFoldWarps = 8;  // warps per CTA (kFoldWarps * 32 threads)
// The column sums: kFoldColumns layer-norm columns per CTA, each summed by kFoldPhases threads that
// take every kFoldPhases-th row. A lane per column with the warps over the rows (32 columns per CTA)
// left four CTAs per layer norm of 128 columns, each thread 80 rows of dependent loads in sequence
// (0.067 ms per launch, the same at every N_res).
constexpr int kFoldColumns = 4;
constexpr int kFoldPhases = kFoldWarps * 32 / kFoldColumns;

__host__ __device__ constexpr int column_chunks(int K) { return (K + kFoldColumns - 1) / kFoldColumns; }

// W'[r, :] = W[r, :] * w,  c'[r] = c[r] + W[r, :] . b
__global__ void __launch_bounds__(kFoldWarps * 32) fold_affine_kernel(FoldParams p) {
  int g, r;
  if (!locate_row(p.group, p.n_groups, int(blockIdx.x) * kFoldWarps + int(threadIdx.x / 32), g, r)) return;
  const FoldGroup& G = p.group[g];
  const ParamTensor &w = p.w[G.norm], &b = p.b[G.norm];
  const int lane = threadIdx.x % 32;
  float dot = 0.f;
  for (int k = lane; k < G.K; k += 32) {
    const int64_t i = int64_t(r) * G.K + k;
    const float x = param_load(G.W, i);
    param_store(G.W_out, i, x * param_load(w, k));
    dot = fmaf(x, param_load(b, k), dot);
  }
  dot = warp_sum(dot);
  if (lane == 0) param_store(G.c_out, r, param_load(G.c, r) + dot);
}

// CTAs [0, row_ctas): dW[r, :] = dW'[r, :] * w + dc'[r] * b and dc[r] = dc'[r], a warp per row.
// CTAs from row_ctas on: kFoldColumns columns k of one layer norm each, summing over the rows of the
// groups behind it: dw[k] = sum dW'[r, k] * W[r, k], db[k] = sum W[r, k] * dc'[r]. Thread phase
// (of kFoldPhases per column) takes rows phase, phase + kFoldPhases, ... of each group in order; the
// phases' partials are then added in phase order, so the sums are the same on every run.
__global__ void __launch_bounds__(kFoldWarps * 32) unfold_affine_grads_kernel(UnfoldParams p, int row_ctas) {
  if (int(blockIdx.x) < row_ctas) {
    int g, r;
    if (!locate_row(p.group, p.n_groups, int(blockIdx.x) * kFoldWarps + int(threadIdx.x / 32), g, r)) return;
    const UnfoldGroup& G = p.group[g];
    const ParamTensor &w = p.w[G.norm], &b = p.b[G.norm];
    const int lane = threadIdx.x % 32;
    const float dc = param_load(G.dc_folded, r);
    for (int k = lane; k < G.K; k += 32) {
      const int64_t i = int64_t(r) * G.K + k;
      param_store(G.dW, i, fmaf(param_load(G.dW_folded, i), param_load(w, k), dc * param_load(b, k)));
    }
    if (lane == 0) param_store(G.dc, r, dc);
    return;
  }
  int chunk = int(blockIdx.x) - row_ctas, n = 0;
  while (n < p.n_norms && chunk >= column_chunks(p.K[n])) chunk -= column_chunks(p.K[n++]);
  if (n == p.n_norms) return;  // uniform over the CTA
  const int column = int(threadIdx.x) % kFoldColumns, phase = int(threadIdx.x) / kFoldColumns;
  const int k = chunk * kFoldColumns + column;
  const bool active = k < p.K[n];
  float dw = 0.f, db = 0.f;
  if (active) {
    for (int g = 0; g < p.n_groups; ++g) {
      const UnfoldGroup& G = p.group[g];
      if (G.norm != n) continue;
#pragma unroll 4
      for (int r = phase; r < G.R; r += kFoldPhases) {
        const int64_t i = int64_t(r) * G.K + k;
        const float W = param_load(G.W, i);
        dw = fmaf(param_load(G.dW_folded, i), W, dw);
        db = fmaf(W, param_load(G.dc_folded, r), db);
      }
    }
  }
  __shared__ float partial[2][kFoldPhases][kFoldColumns];
  partial[0][phase][column] = dw;
  partial[1][phase][column] = db;
  __syncthreads();
  if (phase != 0 || !active) return;
  dw = db = 0.f;
  for (int ph = 0; ph < kFoldPhases; ++ph) {
    dw += partial[0][ph][column];
    db += partial[1][ph][column];
  }
  param_store(p.dw[n], k, dw);
  param_store(p.db[n], k, db);
}

}  // namespace block
}  // namespace evoformer
