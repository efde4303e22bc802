// The triangle multiplication's fused input kernel on Hopper (sm_90a): the function, passes and
// outputs of triangle_input_kernel (triangle_input.cuh), with each pass's product on the warpgroup
// tensor-core instruction (wgmma) reading both operands from shared memory.
//
// Why: the mma.sync kernel spends about a fifth of its instructions on ldmatrix and mma.sync (eight
// warps each reload a pass's 64 weight columns into registers) and stalls on their fixed-latency
// dependencies; wgmma takes A (the x_hat tile) and B (the pass's weights) straight from shared
// memory, one instruction per 64 x 128 x 16 step per warpgroup, and leaves the registers and issue
// slots to the layer norm and the epilogues of the other CTA on the SM.
//
// CTA: 256 threads = two warpgroups, kTriInRows = 128 positions; warpgroup wg takes rows
// 64 wg.., warp w of it rows 16 w.. of those and all 128 columns of a pass (its accumulators are
// sixteen n8 tiles of {(g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)}, the mma.sync C layout).
// An edge pass's columns are (projections of slot 2q, their gates, projections of slot 2q + 1, their
// gates), so tile nt and tile nt + 4 of each half pair a projection with its gate in one thread.
//
// Shared memory (1024-byte aligned, as the swizzles need): the z / x_hat tile [128, kK] and two
// weight buffers [128, kK], both in CuTe's K-major GMMA layouts (128-byte swizzle); a buffer whose
// pass is multiplied takes the pass's staged results ([64 channels, 128 positions] or [128
// positions, 128 columns], pitch kTriInStagePitch), so a buffer is sized for the larger of the two.
// c_z 128: 106 KB, two CTAs per SM (c_z 256: one). The copies are cp.async (generic proxy): every thread fences
// its copies and its layer-norm stores to the async proxy before the barrier that precedes a wgmma.
#pragma once

#include <cutlass/arch/barrier.h>

#include "sm90_layouts.cuh"
#include "triangle_input.cuh"

namespace evoformer {
namespace block {

template <typename T, int kKSteps>
struct TriangleInputSm90Tile {
  static constexpr int kK = 16 * kKSteps;
  using LayoutX = typename sm90::RowTileLayouts<T, kTriInRows, kK>::RowMajor;      // [positions, kK]
  using LayoutW = typename sm90::RowTileLayouts<T, kTriInPassCols, kK>::RowMajor;  // [columns, kK]
  // One warpgroup's pass: [64, 128] = x_hat [64, kK] . weights [128, kK]^T
  using Mma = sm90::SsMma<T, kTriInPassCols, kK>;
  static constexpr int kStageBytes = kTriInPassCols * kTriInStagePitch * int(sizeof(T));
  static constexpr int kWeightBytes = kTriInPassCols * kK * int(sizeof(T));
  static constexpr int kXBytes = sm90::smem_align(kTriInRows * kK * int(sizeof(T)));
  static constexpr int kBufferBytes = sm90::smem_align(kWeightBytes > kStageBytes ? kWeightBytes : kStageBytes);
  static constexpr int kSmemBytes = sm90::kSmemAlign + kXBytes + 2 * kBufferBytes;  // + base alignment
  static_assert(kSmemBytes <= 227 * 1024, "a CTA's shared memory must fit an SM (227 KB)");
  static constexpr int kMinBlocksPerSM = sm90::ctas_per_sm(kSmemBytes, 2);  // c_z 256: one (no register cap)
};

template <typename T, int kKSteps>
__global__ void __launch_bounds__(kTriInThreads, (TriangleInputSm90Tile<T, kKSteps>::kMinBlocksPerSM))
    triangle_input_sm90_kernel(TriangleInputParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Tile = TriangleInputSm90Tile<T, kKSteps>;
  extern __shared__ __align__(16) char tri_in90_smem[];
  char* const smem = sm90::aligned_smem(tri_in90_smem);
  T* const xs = reinterpret_cast<T*>(smem);  // LayoutX: z, then x_hat
  auto buffer = [&](int i) { return reinterpret_cast<T*>(smem + Tile::kXBytes + i * Tile::kBufferBytes); };
  const auto x_offset = [](int r, int c) { return sm90::swizzled_offset<typename Tile::LayoutX, T>(r, c); };
  const auto w_offset = [](int r, int c) { return sm90::swizzled_offset<typename Tile::LayoutW, T>(r, c); };

  const int64_t m0 = int64_t(blockIdx.x) * kTriInRows;
  const int valid_rows = int(p.M - m0 < kTriInRows ? p.M - m0 : kTriInRows);
  const int blocks = edge_blocks(p.C);  // = edge passes
  const int passes = blocks + (p.G + kTriInPassCols - 1) / kTriInPassCols;

  // z tile (group 0), the first two passes' weights (groups 1, 2)
  sm90::SwizzledTileCopy<kTriInRows, Tile::kK, kTriInThreads>(threadIdx.x, x_offset)(
      xs, static_cast<const T*>(p.z) + m0 * p.z_stride, p.z_stride, valid_rows, p.K);
  cp_async_commit();
  triangle_input_load_weights<T, kKSteps>(p, buffer(0), 0, w_offset);
  if (passes > 1) triangle_input_load_weights<T, kKSteps>(p, buffer(1), 1, w_offset);
  else cp_async_commit();
  cp_async_wait<2>();
  __syncthreads();

  triangle_input_normalise<T, Tile::kK>(p, xs, x_offset, m0, valid_rows);

  const int lane = threadIdx.x % 32u, g = lane / 4, t = lane % 4;
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128u), 0);  // warp-uniform
  const int row0 = wg * 64 + int(threadIdx.x % 128u) / 32 * 16 + g;  // the thread's rows: row0, row0 + 8
  float mask[1][2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = row0 + 8 * hh;
    mask[0][hh] = p.mask != nullptr && r < valid_rows ? float(static_cast<const T*>(p.mask)[m0 + r]) : 1.f;
  }

  typename Tile::Mma mma;
  auto thr = mma.get_thread_slice(threadIdx.x % 128u);
  Tensor sX = make_tensor(make_smem_ptr(xs), typename Tile::LayoutX{});
  Tensor tXr = thr.partition_fragment_A(local_tile(sX, Shape<_64, Int<Tile::kK>>{}, make_coord(wg, 0)));
  Tensor tAcc = partition_fragment_C(mma, Shape<_64, Int<kTriInPassCols>>{});
  static_assert(size(tAcc) == kTriInPassCols / 2, "sixteen n8 accumulator tiles per thread");
  float(&acc)[kTriInPassCols / 8][4] = *reinterpret_cast<float(*)[kTriInPassCols / 8][4]>(raw_pointer_cast(tAcc.data()));

  for (int q = 0; q < passes; ++q) {
    T* const wbuf = buffer(q % 2);
    cp_async_wait<1>();
    cutlass::arch::fence_view_async_shared();  // this thread's copies (and x_hat stores) -> tensor cores
    __syncthreads();                            // x_hat (q = 0) and pass q's weights are in shared memory

#pragma unroll
    for (int nt = 0; nt < kTriInPassCols / 8; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
    Tensor tWr = thr.partition_fragment_B(make_tensor(make_smem_ptr(wbuf), typename Tile::LayoutW{}));
    warpgroup_fence_operand(tAcc);
    warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < size<2>(tXr); ++kk) gemm(mma, tXr(_, _, kk), tWr(_, _, kk), tAcc);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(tAcc);
    __syncthreads();  // both warpgroups are done with the weights: the buffer takes the staged results

    if (q < blocks) {
      // edge pass: half h of the columns is slot 2q + h; its tiles 8h.. are projections, 8h + 4.. gates.
      // Staged [64 rows (the two slots' channels), 128 positions].
#pragma unroll
      for (int h = 0; h < 2; ++h)
        stage_gated_slot<T, 1>(p, EdgeSlot(2 * q + h, blocks), acc + 8 * h, mask,
                               wbuf + h * kTriInSlot * kTriInStagePitch + row0, t);
      __syncthreads();
      triangle_input_store_edges<T>(p, wbuf, q, m0, valid_rows);
    } else {
      // g pass: columns n0.. of g, plus their bias; staged [128 positions, 128 columns]
      const int n0 = (q - blocks) * kTriInPassCols;
      const T* const bias = static_cast<const T*>(p.b_g);
      T* const stage = wbuf + row0 * kTriInStagePitch + 2 * t;
#pragma unroll
      for (int nt = 0; nt < kTriInPassCols / 8; ++nt) {
        const int n = n0 + nt * 8 + 2 * t;
        const float b0 = n < p.G ? float(bias[n]) : 0.f, b1 = n < p.G ? float(bias[n + 1]) : 0.f;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          store2<T>(stage + 8 * hh * kTriInStagePitch + nt * 8, acc[nt][2 * hh] + b0, acc[nt][2 * hh + 1] + b1);
      }
      __syncthreads();
      triangle_input_store_g<T>(p, wbuf, n0, m0, valid_rows);
    }
    __syncthreads();  // the staged results are stored: the buffer takes pass q + 2's weights
    if (q + 2 < passes) triangle_input_load_weights<T, kKSteps>(p, wbuf, q + 2, w_offset);
    else cp_async_commit();
  }
#endif
}

}  // namespace block
}  // namespace evoformer
