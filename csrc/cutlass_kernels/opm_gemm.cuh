// The outer product mean's two products around its [i, c, j, e] intermediate, without the swap to
// [i, j, c, e] that linear_out's GEMM would need (OuterProductMean, AF2 Algorithm 10). The outer
// product's GEMM over the sequences leaves o[b, i, c, j, e] (c, e < C = 32); per residue i:
//
//   project:     out[b, i, j, z]  = sum_{c, e} o[b, i, c, j, e] . W[z, c C + e] + bias[z]
//   input grad:  do[b, i, c, j, e] = sum_z dout[b, i, j, z] . W[z, c C + e]   (W^T given as wt [C C, Z])
//
// Both are one tile GEMM (OpmGemmParams): a CTA computes a [128 rows, 128 columns] tile of one (b, i)
// over k-steps of 32 values, A and B both K-major with uniform strides per row and per k-step:
//
//   project:     rows j, columns z;  A row j, step c = o + (c R + j) C;  B row z, step c = W + z C^2 + c C
//   input grad:  rows j, columns n = (c - c0) C + e of the tile's four c from c0;
//                A row j, step s = dout + j Z + 32 s;  B row n, step s = wt + (c0 C + n) Z + 32 s
//
// and a tile's output (row r, column n) lands at out + r * out_row + (n / 32) * out_block + n % 32
// (project: out_row = Z, out_block = 32; input grad: out_row = C, out_block = R C).
//
// CTA: 256 threads, 8 warps as 4 row groups of 32 x 2 column halves of 64 (2 x 8 m16n8 tiles per
// warp, fp32 accumulators); three cp.async stages of the A and B tiles [128, 32] (rows padded to 40
// values: conflict-free ldmatrix), one CTA barrier per step.
#pragma once

#include <cstdint>

#include "block_ops.h"
#include "evoformer_attention.h"  // check_launch
#include "mma_sm80.cuh"

namespace evoformer {
namespace block {

constexpr int kOpmPitch = 40;      // shared-memory row pitch (values)
constexpr int kOpmStages = 3;
constexpr int kOpmStageElems = 2 * kOpmTile * kOpmPitch;  // A and B tiles of one stage
constexpr int kOpmThreads = 256;

template <typename T>
constexpr int opm_gemm_smem_bytes() {
  return kOpmStages * kOpmStageElems * int(sizeof(T));
}

template <typename T>
__global__ void __launch_bounds__(kOpmThreads, 2) opm_gemm_kernel(OpmGemmParams p) {
  extern __shared__ __align__(16) unsigned char opm_smem[];
  T* const smem = reinterpret_cast<T*>(opm_smem);
  // grid: x = row tile, y = column tile, z = (b, i)
  const int64_t bi = blockIdx.z;
  const int row0 = int(blockIdx.x) * kOpmTile;
  const int valid_rows = p.rows - row0 < kOpmTile ? p.rows - row0 : kOpmTile;
  const T* const a = static_cast<const T*>(p.a) + bi * p.a_batch + int64_t(row0) * p.a_row;
  const T* const b = static_cast<const T*>(p.b) + int64_t(blockIdx.y) * p.b_tile;

  const int tid = int(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int wm = warp % 4, wn = warp / 4;
  const TileCopy<T, kOpmTile, kOpmStep, kOpmPitch, kOpmThreads> copy(tid);
  auto load_step = [&](int step) {
    T* const sa = smem + (step % kOpmStages) * kOpmStageElems;
    copy(sa, a + int64_t(step) * p.a_step, p.a_row, valid_rows, kOpmStep);
    copy(sa + kOpmTile * kOpmPitch, b + int64_t(step) * p.b_step, p.b_row, kOpmTile, kOpmStep);
  };
#pragma unroll
  for (int s = 0; s < kOpmStages - 1; ++s) {
    if (s < p.steps) load_step(s);
    cp_async_commit();
  }

  float acc[2][8][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;

  // ldmatrix lane addresses: A (row-major [m][k]) rows m0 + lane % 16, k + 8 (lane / 16);
  // B ([n][k]) rows n0 + lane % 8 + 8 (lane / 16), k + 8 ((lane / 8) % 2)
  const int a_off = (wm * 32 + lane % 16) * kOpmPitch + (lane / 16) * 8;
  const int b_off = (wn * 64 + lane % 8 + 8 * (lane / 16)) * kOpmPitch + ((lane / 8) % 2) * 8;
  for (int step = 0; step < p.steps; ++step) {
    cp_async_wait<kOpmStages - 2>();  // this thread's copies of `step` landed
    __syncthreads();                  // everyone's; the stage `step + 2` takes is no longer read
    if (step + kOpmStages - 1 < p.steps) load_step(step + kOpmStages - 1);
    cp_async_commit();
    const T* const sa = smem + (step % kOpmStages) * kOpmStageElems;
    const T* const sb = sa + kOpmTile * kOpmPitch;
#pragma unroll
    for (int kk = 0; kk < kOpmStep / 16; ++kk) {
      uint32_t af[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
        ldsm_x4(sa + a_off + mt * 16 * kOpmPitch + kk * 16, af[mt][0], af[mt][1], af[mt][2], af[mt][3]);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t bf[2][2];
        ldsm_x4(sb + b_off + np * 16 * kOpmPitch + kk * 16, bf[0][0], bf[0][1], bf[1][0], bf[1][1]);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) mma<T>(acc[mt][2 * np + h], af[mt], bf[h]);
      }
    }
  }
  cp_async_wait<0>();  // no copy in flight at exit

  // epilogue: (row, col) pairs of adjacent columns, plus the bias where given
  T* const out = static_cast<T*>(p.out) + bi * p.out_batch + int64_t(blockIdx.y) * p.out_tile;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const int col = wn * 64 + nt * 8 + 2 * t;
    float b0 = 0.f, b1 = 0.f;
    if (p.bias != nullptr) {
      const T* const bias = static_cast<const T*>(p.bias) + int(blockIdx.y) * kOpmTile + col;
      const float2 bb = unpack2<T>(*reinterpret_cast<const uint32_t*>(bias));
      b0 = bb.x, b1 = bb.y;
    }
    T* const out_col = out + int64_t(col / 32) * p.out_block + col % 32;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = wm * 32 + mt * 16 + g + 8 * h;
        if (r < valid_rows)
          store2<T>(out_col + int64_t(row0 + r) * p.out_row, acc[mt][nt][2 * h] + b0, acc[mt][nt][2 * h + 1] + b1);
      }
  }
}

}  // namespace block
}  // namespace evoformer
