// The edges' gate backward (triangle_gate_backward_kernel, triangle_input.cuh) on Hopper (sm_90a) for a
// channel group of 32 or 64 (the backward's groups at N_res above 256), c_z = 128, whole 16-byte rows
// (triangle_gate_backward_runs_sm90): the same values per position, the bias sums per CTA of a
// persistent grid.
//
// As the input kernel's resident version (triangle_input_sm90.cuh): one CTA per SM keeps the group's
// weights in shared memory (a pass of two slots is 32 KB), three warpgroups walk 64-position tiles of
// their own (3 blockIdx.x + wg, + 3 gridDim.x, ...), each reading its x_hat tile once by ldmatrix into
// registers as the A operand of its products (wgmma with A in registers). Product i is slot i's 32
// projections and their 32 gates (64 columns of pass i / 2); while it runs the warpgroup finishes slot
// i - 1: its da / db rows [32 channels, 64 positions] read by transposing ldmatrix into the
// accumulators' layout from their staging tile, which at once takes the same slot's rows of the
// warpgroup's next tile (every copy has a tile to land, as has x_hat's), d_proj and d_gate staged per
// position and stored as that position's columns of dab. A warp adds its columns' sums into its own
// row of shared memory over all its tiles; the CTA adds its twelve warps' rows in order at the end
// (bias_part: one row per CTA; bitwise reproducible for a given grid).
//
// Shared memory: the weights (64 KB at a group of 64), per warpgroup the x_hat tile (16 KB), a da / db
// staging tile per slot [32 channels, 64 + 8 positions] and the d_proj / d_gate staging tile [64
// positions, 32 + 32 + 8], and the warps' sums [12 warps][slots][128].
#pragma once

#include <cutlass/arch/barrier.h>

#include "common/sm90_layouts.cuh"
#include "triangle_multiplication/resident_sm90.cuh"
#include "triangle_multiplication/triangle_input.cuh"

namespace evoformer {
namespace block {

template <typename T, int kSlots>
struct TriangleGateBackwardSm90Tile {
  static constexpr int kK = 128, kKSteps = kK / 16;
  static constexpr int kPasses = kSlots / 2;       // two slots per pass (channel groups of 32 or 64)
  static constexpr int kCols = 2 * kTriInSlot;      // a slot's projections and gates
  static constexpr int kRows = 64;                  // positions per warpgroup tile
  static constexpr int kWarpgroups = 3, kThreads = 128, kCtaThreads = kWarpgroups * kThreads;
  static constexpr int kWarps = kCtaThreads / 32;
  static constexpr int kDPitch = kRows + 8;         // elements per staged channel row of da / db
  static constexpr int kOutPitch = kCols + 8;       // elements per staged position: d_proj 32, d_gate 32
  using LayoutX = typename sm90::RowTileLayouts<T, kRows, kK>::RowMajor;
  using LayoutW = typename sm90::RowTileLayouts<T, kTriInPassCols, kK>::RowMajor;
  using Mma = sm90::RsMma<T, kCols, kK>;  // [64, 64] = x_hat [64, kK] (registers) . weights [64, kK]^T
  static constexpr int kWeightBytes = kTriInPassCols * kK * int(sizeof(T));
  static constexpr int kXBytes = kRows * kK * int(sizeof(T));
  static constexpr int kDBytes = kTriInSlot * kDPitch * int(sizeof(T));   // a slot's da / db rows
  static constexpr int kOutBytes = kRows * kOutPitch * int(sizeof(T));    // d_proj / d_gate per position
  static constexpr int kRedRow = 4 * kTriInSlot;                        // a warp's sums of a slot
  static constexpr int kXOffset = kPasses * kWeightBytes;
  static constexpr int kDOffset = kXOffset + kWarpgroups * kXBytes;
  static constexpr int kOutOffset = kDOffset + kWarpgroups * kSlots * kDBytes;
  static constexpr int kRedOffset = kOutOffset + kWarpgroups * kOutBytes;
  static constexpr int kSmemBytes = sm90::kSmemAlign + kRedOffset + kWarps * kSlots * kRedRow * 4;
  static_assert(kSmemBytes <= 227 * 1024, "a CTA's shared memory must fit an SM (227 KB)");
  static_assert(kXBytes % sm90::kSmemAlign == 0 && kWeightBytes % sm90::kSmemAlign == 0, "aligned tiles");
  static_assert(kDBytes % 16 == 0 && kOutBytes % 16 == 0, "16-byte aligned staging tiles");
};

// kSlots = 2 C / 32: 2 (C = 32) or 4 (C = 64).
template <typename T, int kSlots>
__global__ void __launch_bounds__(TriangleGateBackwardSm90Tile<T, kSlots>::kCtaThreads, 1)
    triangle_gate_backward_sm90_kernel(TriangleGateBackwardParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Tile = TriangleGateBackwardSm90Tile<T, kSlots>;
  extern __shared__ __align__(16) char tri_gb90_smem[];
  char* const smem = sm90::aligned_smem(tri_gb90_smem);
  T* const weights = reinterpret_cast<T*>(smem);
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128u), 0);  // warp-uniform
  const int tid = int(threadIdx.x % 128u), lane = tid % 32, g = lane / 4, warp = tid / 32;
  const int row0 = warp * 16 + g;  // the thread's rows of its warpgroup's tile: row0, row0 + 8
  T* const xs = reinterpret_cast<T*>(smem + Tile::kXOffset + wg * Tile::kXBytes);
  T* const dstage = reinterpret_cast<T*>(smem + Tile::kDOffset + wg * kSlots * Tile::kDBytes);  // [slot][32][kDPitch]
  T* const ostage = reinterpret_cast<T*>(smem + Tile::kOutOffset + wg * Tile::kOutBytes);
  float* const red = reinterpret_cast<float*>(smem + Tile::kRedOffset);  // [warps][slots][kRedRow]
  const auto wg_sync = [wg] { asm volatile("bar.sync %0, %1;" ::"r"(1 + wg), "r"(Tile::kThreads) : "memory"); };
  const auto x_offset = [](int r, int c) { return sm90::swizzled_offset<typename Tile::LayoutX, T>(r, c); };
  const sm90::SwizzledTileCopy<Tile::kRows, Tile::kK, Tile::kThreads> x_copy(tid, x_offset);
  constexpr int kBlocks = kSlots / 2;  // edge_blocks(p.C)

  const int64_t n_tiles = (p.M + Tile::kRows - 1) / Tile::kRows;
  const int64_t tile_step = Tile::kWarpgroups * int64_t(gridDim.x);
  // starts the copy of tile `tile`'s x_hat rows into xs (one cp.async group, empty past the last tile)
  const auto load_x = [&](int64_t tile) {
    start_row_tile_copy<Tile::kRows>(x_copy, xs, static_cast<const T*>(p.x_hat), p.x_stride, p.M, tile, n_tiles, p.K);
  };
  // Starts the copy of slot i's da / db rows of tile `tile` into its staging tile, [32 channels, 64
  // positions] (one group, empty past the last tile; positions past M zero-filled: M % 8 == 0).
  const auto load_d = [&](int64_t tile, int i) {
    if (tile < n_tiles) {
      const int64_t m0 = tile * Tile::kRows;
      const EdgeSlot slot(i, kBlocks);
      const T* const src = static_cast<const T*>(slot.edge == 0 ? p.da : p.db) + int64_t(slot.ch0) * p.M + m0;
#pragma unroll
      for (int j = 0; j < kTriInSlot * Tile::kRows / 8 / Tile::kThreads; ++j) {
        const int chunk = tid + j * Tile::kThreads, r = chunk / (Tile::kRows / 8), col = chunk % (Tile::kRows / 8) * 8;
        const bool ok = m0 + col < p.M;
        cp_async_16(dstage + i * (Tile::kDBytes / int(sizeof(T))) + r * Tile::kDPitch + col,
                    ok ? src + int64_t(r) * p.M + col : src, ok);
      }
    }
    cp_async_commit();
  };

  // the group's weights (a group per pass, by the loaders' kTriInThreads threads), the warps' sums
  // zeroed, then the first tile's x_hat and every slot's da / db rows. From here on a wait for the
  // oldest group leaves kSlots in flight: x_hat(t) has d(t, 0 ..) behind it, d(t, i) has d(t, i + 1 ..),
  // x_hat(t + 1) and d(t + 1, 0 .. i - 1).
  if (threadIdx.x < unsigned(kTriInThreads)) {
#pragma unroll 1
    for (int q = 0; q < kBlocks; ++q)
      triangle_input_load_weights<T, Tile::kKSteps, true>(
          p, weights + q * (Tile::kWeightBytes / int(sizeof(T))), q,
          [](int r, int c) { return sm90::swizzled_offset<typename Tile::LayoutW, T>(r, c); });
  }
  for (int i = int(threadIdx.x); i < Tile::kWarps * kSlots * Tile::kRedRow; i += Tile::kCtaThreads) red[i] = 0.f;
  int64_t tile = Tile::kWarpgroups * int64_t(blockIdx.x) + wg;
  load_x(tile);
#pragma unroll
  for (int i = 0; i < kSlots; ++i) load_d(tile, i);
  cp_async_wait<kSlots>();
  cutlass::arch::fence_view_async_shared();  // this thread's weight copies -> tensor cores
  __syncthreads();  // the weights every thread copied, the sums zeroed (the last CTA-wide barrier before the end)

  typename Tile::Mma mma;
  auto thr = mma.get_thread_slice(tid);
  // x_hat as the products' A operand (the mma.sync A layout, as in the input kernel)
  auto tXr = make_a_fragment_sm90<Tile::kRows, Tile::kK, T>(thr);
  static_assert(size(tXr) == Tile::kK / 2, "a thread's x_hat: two rows of 32 columns");
  uint32_t(&xa)[Tile::kKSteps][4] = *reinterpret_cast<uint32_t(*)[Tile::kKSteps][4]>(raw_pointer_cast(tXr.data()));
  Tensor acc0 = partition_fragment_C(mma, Shape<Int<Tile::kRows>, Int<Tile::kCols>>{});
  Tensor acc1 = partition_fragment_C(mma, Shape<Int<Tile::kRows>, Int<Tile::kCols>>{});
  static_assert(size(acc0) == Tile::kCols / 2, "eight n8 accumulator tiles per thread");
  float* const red_warp = red + (wg * 4 + warp) * kSlots * Tile::kRedRow;
  // product i into acc: slot i's columns (rows 64 (i % 2).. of pass i / 2's weights)
  const auto issue = [&](int i, auto& acc) {
    issue_half_pass_sm90<typename Tile::LayoutW, Tile::kCols, Tile::kK>(mma, thr, tXr, acc, weights, i);
  };

#pragma unroll 1
  for (; tile < n_tiles; tile += tile_step) {
    const int64_t m0 = tile * Tile::kRows;
    const int valid_rows = int(p.M - m0 < Tile::kRows ? p.M - m0 : Tile::kRows);
    cp_async_wait<kSlots>();
    wg_sync();  // the tile's x_hat rows (every thread's copies)
    load_a_rows_sm90<typename Tile::LayoutX>(xa, xs, warp, lane);
    float mask[1][2];
    row_pair_mask_sm90<T>(mask, p.mask, m0, row0, valid_rows);
    wg_sync();  // every warp has its x_hat rows: xs takes the next tile's
    load_x(tile + tile_step);

    // Slot i's backward from acc (product i): its da / db rows, then the copy of the next tile's, d_proj
    // and d_gate staged per position and stored to dab, the sums added to the warp's row.
    const auto epilogue = [&](int i, auto& acc_tensor) {
      warpgroup_fence_operand(acc_tensor);
      const float(*acc)[4] = reinterpret_cast<const float(*)[4]>(raw_pointer_cast(acc_tensor.data()));
      T* const ds = dstage + i * (Tile::kDBytes / int(sizeof(T)));
      cp_async_wait<kSlots>();
      wg_sync();  // slot i's rows (every thread's copies)
      uint32_t d_in[1][4][2];
      gate_backward_load_slot<T, 1, Tile::kDPitch>(ds + warp * 16, d_in, lane);
      wg_sync();  // every warp has read the rows: the staging tile takes the next tile's
      load_d(tile + tile_step, i);
      const EdgeSlot slot(i, kBlocks);
      const float* const bias_proj = p.b_ab + 2 * slot.edge * p.c_rows + slot.ch0;
      gate_backward_slot<T, 1, true, Tile::kOutPitch, kTriInSlot>(p, slot, bias_proj, bias_proj + p.c_rows, acc,
                                                                 mask, d_in, ostage + warp * 16 * Tile::kOutPitch,
                                                                 red_warp + i * Tile::kRedRow, lane);
      wg_sync();  // d_proj and d_gate staged: [64 positions, (proj 32, gate 32)]
      // a thread stores 16-byte runs (kind j / 4, channels 8 (j % 4)..) of positions tid / 8, + 16, ...
      const int j = tid % 8, kind = j / 4, c8 = j % 4 * 8;
      T* const dst = static_cast<T*>(p.dab) + (2 * slot.edge + kind) * p.C + slot.ch0 + c8;
#pragma unroll
      for (int r = tid / 8; r < Tile::kRows; r += Tile::kThreads / 8) {
        if (r >= valid_rows) break;
        *reinterpret_cast<uint4*>(dst + (m0 + r) * p.dab_ld) =
            *reinterpret_cast<const uint4*>(ostage + r * Tile::kOutPitch + kind * kTriInSlot + c8);
      }
      wg_sync();  // the staged gradients are stored: ostage is free
    };

    run_products_sm90<kSlots>(issue, epilogue, acc0, acc1);  // (x_hat's registers are then free)
  }
  cp_async_wait<0>();  // (the empty groups past the last tile)
  __syncthreads();     // every warp's sums
  // the CTA's sums: column (2 edge + kind) C + ch, the twelve warps' rows added in order
  for (int col = int(threadIdx.x); col < 4 * p.C; col += Tile::kCtaThreads) {
    const int edge = col / (2 * p.C), kind = col / p.C % 2, ch = col % p.C;
    const int i = edge * kBlocks + ch / kTriInSlot, c = kind * 2 * kTriInSlot + ch % kTriInSlot;
    float total = 0.f;
    for (int w = 0; w < Tile::kWarps; ++w) total += red[(w * kSlots + i) * Tile::kRedRow + c];
    p.bias_part[int64_t(blockIdx.x) * 4 * p.C + col] = total;
  }
#endif
}

}  // namespace block
}  // namespace evoformer
