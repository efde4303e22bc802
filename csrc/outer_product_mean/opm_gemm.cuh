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
// (project: out_row = Z, out_block = 32; input grad: out_row = C, out_block = R C). The projection can
// finish the module's update in its epilogue: out = residual + (product + bias) / denom[b, i, j] (the
// mean's division by the count of sequences, then the residual add of the pair stream), so that the
// [B, I, J, Z] projection is never written and read back by a separate pass.
//
// CTA: 256 threads, 8 warps as 4 row groups of 32 x 2 column halves of 64 (2 x 8 m16n8 tiles per
// warp, fp32 accumulators); three cp.async stages of the A and B tiles [128, 32] (rows padded to 40
// values: conflict-free ldmatrix), one CTA barrier per step. The grid walks a row tile's column tiles
// one after another (A comes from DRAM once); the result tile is staged in shared memory and stored
// as 16-byte pieces of 32-value rows.
//
// The weight gradient (OpmWeightGradParams) is the third product, a sum over (b, i, j):
//
//   dW[z, c C + e] = sum_{b, i, j} dout[b, i, j, z] . o[b, i, c, j, e]
//
// rows z, columns n = (c - c0) C + e of four c, k-steps of 32 j of one (b, i). Both operands are read
// as they lie, MN-major: A = dout[b, i, j0 : j0 + 32, :] and B = o[b, i, c0 : c0 + 4, j0 : j0 + 32, :]
// are stored [k][m] and [k][n] in shared memory (pitch 136, j past J and z past Z zero-filled) and
// read by transposing ldmatrix. Each CTA sums a range of k-steps (split-K) into float32 partials
// [splits, Z, C C], summed in order by the host.
#pragma once

#include <cstdint>

#include "common/check_launch.h"
#include "common/mma_sm80.cuh"
#include "outer_product_mean/opm_gemm.h"

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

// One k-step of 32 on a warp's [32, 64] tile (2 x 8 m16n8 accumulators). A fragments by ldmatrix from
// [m][k] rows (kAKMajor) or by transposing ldmatrix from [k][m] rows, B likewise from [n][k] rows
// (kBKMajor) or [k][n] rows; sa and sb are this lane's ldmatrix addresses of the first fragments
// (rows kAPitch / kBPitch values apart).
template <typename T, bool kAKMajor, int kAPitch, bool kBKMajor, int kBPitch>
__device__ __forceinline__ void opm_warp_step(float (&acc)[2][8][4], const T* sa, const T* sb) {
#pragma unroll
  for (int kk = 0; kk < kOpmStep / 16; ++kk) {
    uint32_t af[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      if constexpr (kAKMajor)
        ldsm_x4(sa + mt * 16 * kAPitch + kk * 16, af[mt][0], af[mt][1], af[mt][2], af[mt][3]);
      else
        ldsm_x4_trans(sa + kk * 16 * kAPitch + mt * 16, af[mt][0], af[mt][1], af[mt][2], af[mt][3]);
    }
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t bf[2][2];
      if constexpr (kBKMajor)
        ldsm_x4(sb + np * 16 * kBPitch + kk * 16, bf[0][0], bf[0][1], bf[1][0], bf[1][1]);
      else
        ldsm_x4_trans(sb + kk * 16 * kBPitch + np * 16, bf[0][0], bf[0][1], bf[1][0], bf[1][1]);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) mma<T>(acc[mt][2 * np + h], af[mt], bf[h]);
    }
  }
}

// A thread's place in the CTA tile: its warp's row group wm (32 rows) and column half wn (64
// columns), the rows and columns of its m16n8 accumulator values (element pair h of row tile mt,
// column tile nt) and its ldmatrix address in a row-major [128][kOpmPitch] A tile.
struct OpmLane {
  int lane, wm, wn, g, t;
  __device__ __forceinline__ explicit OpmLane(int tid)
      : lane(tid % 32), wm(tid / 32 % 4), wn(tid / 32 / 4), g(lane / 4), t(lane % 4) {}
  __device__ __forceinline__ int row(int mt, int h) const { return wm * 32 + mt * 16 + g + 8 * h; }
  __device__ __forceinline__ int col(int nt) const { return wn * 64 + nt * 8 + 2 * t; }
  // A rows m0 + lane % 16, k + 8 (lane / 16)
  __device__ __forceinline__ int a_offset() const { return (wm * 32 + lane % 16) * kOpmPitch + (lane / 16) * 8; }
};

__device__ __forceinline__ void opm_zero(float (&acc)[2][8][4]) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
}

constexpr int kOpmOutPitch = kOpmTile + 8;  // the staged result tile [128 rows][128 columns]
static_assert(kOpmTile * kOpmOutPitch * 2 <= kOpmStages * kOpmStageElems * 2, "the staged result must fit the stages");

// A CTA's tile of either tile GEMM (this one and opm_gemm_sm90.cuh's). Grid: x = row tile *
// column_tiles + column tile (the column tiles sharing A's rows run together, so A comes from DRAM
// once), z = (b, i); A's rows and B's of the tile from their first k-step.
template <typename T>
struct OpmTilePlace {
  int64_t bi;
  int col_tile, row0, valid_rows;
  const T* a;
  const T* b;
  __device__ __forceinline__ explicit OpmTilePlace(const OpmGemmParams& p)
      : bi(blockIdx.z), col_tile(int(blockIdx.x % unsigned(p.column_tiles))),
        row0(int(blockIdx.x / unsigned(p.column_tiles)) * kOpmTile),
        valid_rows(p.rows - row0 < kOpmTile ? p.rows - row0 : kOpmTile),
        a(static_cast<const T*>(p.a) + bi * p.a_batch + int64_t(row0) * p.a_row),
        b(static_cast<const T*>(p.b) + int64_t(col_tile) * p.b_tile) {}
};

// The epilogue of both tile GEMMs, on a tile staged [128 rows]
// [kOpmOutPitch] in shared memory: the value (row r, column col) is (product + bias[col]) / denom of
// row r, rounded; then whole rows of 32-value blocks go out by 16-byte stores, plus the residual.

// 1 / denom[b, i, row0 + r] (1 without a denominator, and for rows past the valid ones).
template <typename T>
__device__ __forceinline__ float opm_row_scale(const OpmGemmParams& p, int64_t bi, int row0, int r, int valid_rows) {
  return p.denom != nullptr && r < valid_rows ? 1.f / float(static_cast<const T*>(p.denom)[bi * p.rows + row0 + r])
                                              : 1.f;
}

// The biases of columns col, col + 1 of column tile col_tile (zeros without a bias).
template <typename T>
__device__ __forceinline__ float2 opm_bias_pair(const OpmGemmParams& p, int col_tile, int col) {
  if (p.bias == nullptr) return make_float2(0.f, 0.f);
  return unpack2<T>(*reinterpret_cast<const uint32_t*>(static_cast<const T*>(p.bias) + col_tile * kOpmTile + col));
}

// Stages the product pair (row, col), (row, col + 1) with its biases and its row's 1 / denom.
template <typename T>
__device__ __forceinline__ void opm_stage_pair(T* staged, int row, int col, float v0, float v1, float2 bias,
                                               float inv) {
  store2<T>(staged + row * kOpmOutPitch + col, (v0 + bias.x) * inv, (v1 + bias.y) * inv);
}

// The staged tile to out (+ residual), 16-byte pieces (row r, columns 8 q ..): each 32-value block's
// row is 64 contiguous bytes of out. After a barrier that follows the staging.
template <typename T>
__device__ __forceinline__ void opm_store_staged(const OpmGemmParams& p, const T* staged, int64_t bi, int row0,
                                                 int col_tile, int valid_rows, int tid) {
  const int64_t tile_offset = bi * p.out_batch + int64_t(col_tile) * p.out_tile;
  T* const out = static_cast<T*>(p.out) + tile_offset;
  const T* const residual = p.residual != nullptr ? static_cast<const T*>(p.residual) + tile_offset : nullptr;
  constexpr int kPieces = kOpmTile / 8;  // per row
#pragma unroll 4
  for (int idx = tid; idx < kOpmTile * kPieces; idx += kOpmThreads) {
    const int r = idx / kPieces, col = (idx % kPieces) * 8;
    if (r < valid_rows) {
      const int64_t at = int64_t(row0 + r) * p.out_row + (col / 32) * p.out_block + col % 32;
      uint4 piece = *reinterpret_cast<const uint4*>(staged + r * kOpmOutPitch + col);
      if (residual != nullptr) piece = add_to_residual<T>(piece, residual + at, nullptr);
      *reinterpret_cast<uint4*>(out + at) = piece;
    }
  }
}

// The rounded result is staged in the stages' memory and written by 16-byte stores of whole rows of
// 32-value blocks (the mma fragments' 4-byte pieces would leave half of each 32-byte sector per store).
template <typename T>
__global__ void __launch_bounds__(kOpmThreads, 2) opm_gemm_kernel(OpmGemmParams p) {
  extern __shared__ __align__(16) unsigned char opm_smem[];
  T* const smem = reinterpret_cast<T*>(opm_smem);
  const OpmTilePlace<T> place(p);
  const int64_t bi = place.bi;
  const int col_tile = place.col_tile, row0 = place.row0, valid_rows = place.valid_rows;
  const T* const a = place.a;
  const T* const b = place.b;

  const int tid = int(threadIdx.x);
  const OpmLane ln(tid);
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
  opm_zero(acc);

  // ldmatrix lane addresses: A (OpmLane); B ([n][k]) rows n0 + lane % 8 + 8 (lane / 16), k + 8 ((lane / 8) % 2)
  const int a_off = ln.a_offset();
  const int b_off = (ln.wn * 64 + ln.lane % 8 + 8 * (ln.lane / 16)) * kOpmPitch + ((ln.lane / 8) % 2) * 8;
  for (int step = 0; step < p.steps; ++step) {
    cp_async_wait<kOpmStages - 2>();  // this thread's copies of `step` landed
    __syncthreads();                  // everyone's; the stage `step + 2` takes is no longer read
    if (step + kOpmStages - 1 < p.steps) load_step(step + kOpmStages - 1);
    cp_async_commit();
    const T* const sa = smem + (step % kOpmStages) * kOpmStageElems;
    opm_warp_step<T, true, kOpmPitch, true, kOpmPitch>(acc, sa + a_off, sa + kOpmTile * kOpmPitch + b_off);
  }
  cp_async_wait<0>();  // no copy in flight
  __syncthreads();     // every warp is past its last step: the stages are free

  // the product plus the bias where given, over the row's denominator where given, rounded, staged
  // [128 rows][kOpmOutPitch] in the stages' memory
  T* const staged = smem;
  float inv[2][2];  // [mt][h]: 1 / denom of the thread's rows
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) inv[mt][h] = opm_row_scale<T>(p, bi, row0, ln.row(mt, h), valid_rows);
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const int col = ln.col(nt);
    const float2 bias = opm_bias_pair<T>(p, col_tile, col);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        opm_stage_pair<T>(staged, ln.row(mt, h), col, acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1], bias, inv[mt][h]);
  }
  __syncthreads();
  opm_store_staged<T>(p, staged, bi, row0, col_tile, valid_rows, tid);
}

static_assert(limits::kOpmHidden == 32, "the weight gradient's tiles are written for c = 32");
constexpr int kOpmKnPitch = kOpmTile + 8;  // the weight gradient's [32 k][128 m or n] tiles
constexpr int kOpmWgStageElems = 2 * kOpmStep * kOpmKnPitch;

template <typename T>
constexpr int opm_weight_grad_smem_bytes() {
  return kOpmStages * kOpmWgStageElems * int(sizeof(T));
}

template <typename T>
__global__ void __launch_bounds__(kOpmThreads, 2) opm_weight_grad_kernel(OpmWeightGradParams p) {
  extern __shared__ __align__(16) unsigned char opm_wg_smem[];
  T* const smem = reinterpret_cast<T*>(opm_wg_smem);
  // grid: x = split, y = column tile (four c from c0 = 4 y)
  const int step_begin = int((int64_t(p.steps) * blockIdx.x) / gridDim.x);
  const int step_end = int((int64_t(p.steps) * (blockIdx.x + 1)) / gridDim.x);
  const int n_steps = step_end - step_begin;
  const int c0 = int(blockIdx.y) * (kOpmTile / 32);
  const int tid = int(threadIdx.x);
  const OpmLane ln(tid);
  // Both tiles [32 j][16 chunks of 8], two rows per thread (j = row, row + 16): A chunk q is
  // dout[b, i, j, 8 q ..] (zero past Z), B chunk q is o[b, i, c0 + q / 4, j, 8 (q % 4) ..]; rows past J zero
  const int row = tid / 16, chunk = tid % 16;
  const bool a_col_ok = chunk * 8 < p.Z;
  const int64_t b_col = int64_t(c0 + chunk / 4) * p.J * 32 + (chunk % 4) * 8;
  auto load_step = [&](int local) {
    const int step = step_begin + local;  // (b, i) = step / chunks, j from 32 (step % chunks)
    T* const sa = smem + (local % kOpmStages) * kOpmWgStageElems;
    T* const sb = sa + kOpmStep * kOpmKnPitch;
    const int bi = step / p.chunks, j0 = (step - bi * p.chunks) * kOpmStep;
    const T* const d = static_cast<const T*>(p.dout) + int64_t(bi) * p.J * p.Z + chunk * 8;
    const T* const o = static_cast<const T*>(p.outer) + int64_t(bi) * p.outer_batch + b_col;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k = row + 16 * h, j = j0 + k;
      const bool in = j < p.J;
      cp_async_16(sa + k * kOpmKnPitch + chunk * 8, d + int64_t(in && a_col_ok ? j : 0) * p.Z, in && a_col_ok);
      cp_async_16(sb + k * kOpmKnPitch + chunk * 8, o + int64_t(in ? j : 0) * 32, in);
    }
  };
#pragma unroll
  for (int s = 0; s < kOpmStages - 1; ++s) {
    if (s < n_steps) load_step(s);
    cp_async_commit();
  }

  float acc[2][8][4];
  opm_zero(acc);

  // Both operands [k][m or n], read by transposing ldmatrix: lane l addresses row k + l % 8 + 8 (l / 16)
  // at column m0 + 8 ((l / 8) % 2) (A) or n0 + 8 (l / 16) with rows k + l % 8 + 8 ((l / 8) % 2) (B)
  const int a_off = (ln.lane % 8 + 8 * (ln.lane / 16)) * kOpmKnPitch + ln.wm * 32 + 8 * ((ln.lane / 8) % 2);
  const int b_off = (ln.lane % 8 + 8 * ((ln.lane / 8) % 2)) * kOpmKnPitch + ln.wn * 64 + 8 * (ln.lane / 16);
  for (int local = 0; local < n_steps; ++local) {
    cp_async_wait<kOpmStages - 2>();
    __syncthreads();
    if (local + kOpmStages - 1 < n_steps) load_step(local + kOpmStages - 1);
    cp_async_commit();
    const T* const sa = smem + (local % kOpmStages) * kOpmWgStageElems;
    opm_warp_step<T, false, kOpmKnPitch, false, kOpmKnPitch>(acc, sa + a_off, sa + kOpmStep * kOpmKnPitch + b_off);
  }
  cp_async_wait<0>();

  // partial [split, Z, C C] float32: row z, column c0 C + n
  float* const part = p.partial + int64_t(blockIdx.x) * p.Z * (32 * 32) + c0 * 32;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const int col = ln.col(nt);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = ln.row(mt, h);
        if (r < p.Z)
          *reinterpret_cast<float2*>(part + int64_t(r) * (32 * 32) + col) =
              make_float2(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
      }
  }
}

}  // namespace block
}  // namespace evoformer
