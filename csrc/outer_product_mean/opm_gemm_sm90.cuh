// The outer product mean's tile GEMM on Hopper (sm_90a): the function, tiles, grid and epilogue of
// opm_gemm_kernel (opm_gemm.cuh: linear_out on the [i, c, j, e] intermediate and its input gradient),
// with the products on the warpgroup tensor-core instruction (wgmma) reading both operands from shared
// memory instead of mma.sync on ldmatrix fragments.
//
// Why: the mma.sync kernel reaches 150-240 TFLOP/s on an H200, each warp reloading its fragments and
// waiting on their fixed-latency chains at one CTA barrier per 32-value k-step; this one 0.185 ->
// 0.116 ms for the projection at N_res 384 (19.3 GFLOP), 0.248 -> 0.183 for its input gradient (three
// launches per Evoformer block; results bitwise equal: the tensor cores add the same products in the
// same order). Copies further ahead paid (four stages, two steps ahead: 0.135 / 0.198); stages of two
// or four k-steps (fewer barriers) at two or one CTA per SM did not (benchmarks/DESIGN.md,
// experiments); at three CTAs per SM (80 registers) the wgmma does not compile.
//
// CTA: 256 threads = two warpgroups on the [128 rows, 128 columns] tile; warpgroup wg takes rows
// 64 wg.. and all 128 columns (wgmma 64 x 128 x 16, two per k-step), warp w of it rows 16 w.. (its
// accumulators are sixteen n8 tiles of {(g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)}, the
// mma.sync C layout). Shared memory: six stages of the A and B tiles [128, 32] (97 KB: two CTAs per
// SM), both in CuTe's K-major GMMA layout (64-byte rows, 64-byte swizzle), filled by cp.async four
// k-steps ahead; every thread fences its copies to the async proxy before the barrier that precedes
// the step's wgmma.
// Step s's wgmma stays in flight across step s + 1's barrier (warpgroup_wait<1>), so a stage is
// refilled only after the barrier of the step two later, when both warpgroups are past it.
#pragma once

#include <cutlass/arch/barrier.h>

#include "common/sm90_layouts.cuh"
#include "outer_product_mean/opm_gemm.cuh"

namespace evoformer {
namespace block {

template <typename T>
struct OpmGemmSm90Tile {
  static constexpr int kStages = 6;
  static constexpr int kAhead = kStages - 2;  // k-steps copied ahead of the one multiplied
  using Layout = typename sm90::RowTileLayouts<T, kOpmTile, kOpmStep>::RowMajor;  // [128, 32], K-major
  // One warpgroup's [64, 128] += A [64, 32] . B [128, 32]^T
  using Mma = sm90::SsMma<T, kOpmTile, kOpmStep>;
  static constexpr int kTileBytes = kOpmTile * kOpmStep * int(sizeof(T));
  static constexpr int kStageBytes = 2 * kTileBytes;  // A, then B
  static constexpr int kSmemBytes = sm90::kSmemAlign + kStages * kStageBytes;
  static_assert(kTileBytes % sm90::kSmemAlign == 0, "swizzled tiles stay 1024-byte aligned");
  static_assert(kOpmTile * kOpmOutPitch * int(sizeof(T)) <= kStages * kStageBytes, "the staged result must fit");
};

template <typename T>
__global__ void __launch_bounds__(kOpmThreads, 2) opm_gemm_sm90_kernel(OpmGemmParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Tile = OpmGemmSm90Tile<T>;
  extern __shared__ __align__(16) char opm_sm90_smem[];
  char* const smem = sm90::aligned_smem(opm_sm90_smem);
  auto a_tile = [&](int stage) { return reinterpret_cast<T*>(smem + stage * Tile::kStageBytes); };
  auto b_tile = [&](int stage) { return reinterpret_cast<T*>(smem + stage * Tile::kStageBytes + Tile::kTileBytes); };
  const OpmTilePlace<T> place(p);  // (opm_gemm_kernel's grid)
  const int64_t bi = place.bi;
  const int col_tile = place.col_tile, row0 = place.row0, valid_rows = place.valid_rows;
  const T* const a = place.a;
  const T* const b = place.b;

  const int tid = int(threadIdx.x);
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);  // warp-uniform
  const int wg_tid = tid % 128;
  const sm90::SwizzledTileCopy<kOpmTile, kOpmStep, kOpmThreads> copy(
      tid, [](int r, int c) { return sm90::swizzled_offset<typename Tile::Layout, T>(r, c); });
  auto load_step = [&](int step) {
    const int stage = step % Tile::kStages;
    copy(a_tile(stage), a + int64_t(step) * p.a_step, p.a_row, valid_rows, kOpmStep);  // rows past A's: zeros
    copy(b_tile(stage), b + int64_t(step) * p.b_step, p.b_row, kOpmTile, kOpmStep);
  };
#pragma unroll
  for (int s = 0; s < Tile::kAhead; ++s) {
    if (s < p.steps) load_step(s);
    cp_async_commit();
  }

  typename Tile::Mma mma;
  auto thr = mma.get_thread_slice(wg_tid);
  Tensor tAcc = partition_fragment_C(mma, Shape<_64, Int<kOpmTile>>{});  // fp32, rows of this thread
  static_assert(size(tAcc) == kOpmTile / 2, "sixteen n8 accumulator tiles per thread");
  for (int step = 0; step < p.steps; ++step) {
    cp_async_wait<Tile::kAhead - 1>();         // this thread's copies of `step` landed
    cutlass::arch::fence_view_async_shared();  // ... and are visible to the tensor cores
    __syncthreads();  // everyone's; both warpgroups' products of step - 2 are done: its stage is free
    if (step + Tile::kAhead < p.steps) load_step(step + Tile::kAhead);
    cp_async_commit();
    const int stage = step % Tile::kStages;
    Tensor sA = make_tensor(make_smem_ptr(a_tile(stage)), typename Tile::Layout{});
    Tensor tAr = thr.partition_fragment_A(local_tile(sA, Shape<_64, Int<kOpmStep>>{}, make_coord(wg, 0)));
    Tensor tBr = thr.partition_fragment_B(make_tensor(make_smem_ptr(b_tile(stage)), typename Tile::Layout{}));
    warpgroup_fence_operand(tAcc);
    warpgroup_arrive();
    if (step == 0) mma.accumulate_ = GMMA::ScaleOut::Zero;  // the first k-step overwrites the accumulators
#pragma unroll
    for (int kk = 0; kk < size<2>(tAr); ++kk) {
      gemm(mma, tAr(_, _, kk), tBr(_, _, kk), tAcc);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_wait<1>();  // step - 1's products done (this warpgroup's)
    warpgroup_fence_operand(tAcc);
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(tAcc);
  cp_async_wait<0>();  // no copy in flight
  __syncthreads();     // both warpgroups' products are done: the stages are free

  // the epilogue of opm_gemm_kernel, from this thread's accumulator rows and columns
  float(&acc)[kOpmTile / 8][4] = *reinterpret_cast<float(*)[kOpmTile / 8][4]>(raw_pointer_cast(tAcc.data()));
  T* const staged = reinterpret_cast<T*>(smem);
  const int lane = tid % 32, g = lane / 4, t = lane % 4;
  const int row = wg * 64 + (wg_tid / 32) * 16 + g;  // and row + 8
  const float inv[2] = {opm_row_scale<T>(p, bi, row0, row, valid_rows),
                        opm_row_scale<T>(p, bi, row0, row + 8, valid_rows)};
#pragma unroll
  for (int nt = 0; nt < kOpmTile / 8; ++nt) {
    const int col = nt * 8 + 2 * t;
    const float2 bias = opm_bias_pair<T>(p, col_tile, col);
#pragma unroll
    for (int h = 0; h < 2; ++h)
      opm_stage_pair<T>(staged, row + 8 * h, col, acc[nt][2 * h], acc[nt][2 * h + 1], bias, inv[h]);
  }
  __syncthreads();
  opm_store_staged<T>(p, staged, bi, row0, col_tile, valid_rows, tid);
#endif
}

}  // namespace block
}  // namespace evoformer
