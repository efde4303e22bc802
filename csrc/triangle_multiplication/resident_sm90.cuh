// What the triangle multiplication's resident Hopper kernels share (the input kernel at c_z = c = 128,
// triangle_input_sm90.cuh, and the edges' gate backward, triangle_gate_backward_sm90.cuh): a warpgroup
// reads its 64-position tile of 16-bit rows once, by ldmatrix, into registers in the layout of the wgmma
// A operand, multiplies it by 64-column slices of weights resident in shared memory, and keeps two such
// products in flight, the next one running while the previous one's epilogue does.
#pragma once

#include <cute/tensor.hpp>

#include "common/mma_sm80.cuh"  // ldsm_x4
#include "common/sm90_layouts.cuh"

namespace evoformer {
namespace block {

// A warpgroup's rows of a [64, 16 kKSteps] tile in the layout `Layout` (element (r, c) at
// swizzled_offset<Layout, T>(r, c)) into xa, the wgmma A operand in registers: xa[kk] holds k-step kk's
// (row0, 16 kk + 2 t, + 1), (row0 + 8, ..), (row0, 16 kk + 8 + 2 t, + 1), (row0 + 8, ..) with row0 =
// 16 warp + lane / 4, t = lane % 4 (the mma.sync A layout). `warp` is the warp's index in its warpgroup.
template <typename Layout, typename T, int kKSteps>
__device__ __forceinline__ void load_a_rows_sm90(uint32_t (&xa)[kKSteps][4], const T* tile, int warp, int lane) {
  // lane l addresses row l % 8 + 8 (l / 8 % 2) of the warp's 16, columns 16 kk + 8 (l / 16)
  const int row = warp * 16 + lane % 8 + 8 * (lane / 8 % 2), col = 8 * (lane / 16);
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk)
    ldsm_x4(tile + sm90::swizzled_offset<Layout, T>(row, 16 * kk + col), xa[kk][0], xa[kk][1], xa[kk][2], xa[kk][3]);
}

// The wgmma A operand of a warpgroup's [kRows, kK] rows of T in registers (load_a_rows_sm90's layout).
template <int kRows, int kK, typename T, typename ThrMma>
__device__ __forceinline__ auto make_a_fragment_sm90(const ThrMma& thr) {
  using namespace cute;
  return thr.partition_fragment_A(
      make_tensor(make_smem_ptr(static_cast<T*>(nullptr)), Shape<Int<kRows>, Int<kK>>{}, Stride<Int<kK>, _1>{}));
}

// Starts the copy of row tile `tile` (kRows rows from row tile * kRows of the M rows at `rows`, `stride`
// apart, `cols` columns; n_tiles = ceil(M / kRows)) into `smem` by `copy` (a SwizzledTileCopy): one
// cp.async group, empty past the last tile.
template <int kRows, typename Copy, typename T>
__device__ __forceinline__ void start_row_tile_copy(const Copy& copy, T* smem, const T* rows, int64_t stride,
                                                    int64_t M, int64_t tile, int64_t n_tiles, int cols) {
  if (tile < n_tiles) {
    const int64_t m0 = tile * kRows;
    copy(smem, rows + m0 * stride, stride, int(M - m0 < kRows ? M - m0 : kRows), cols);
  }
  cp_async_commit();
}

// The 0/1 mask ([M] of T, or nullptr: ones) of a thread's rows row0 and row0 + 8 of the tile at m0;
// rows at or past valid_rows read as 1.
template <typename T>
__device__ __forceinline__ void row_pair_mask_sm90(float (&mask)[1][2], const void* mask_ptr, int64_t m0, int row0,
                                                   int valid_rows) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = row0 + 8 * hh;
    mask[0][hh] = mask_ptr != nullptr && r < valid_rows ? float(static_cast<const T*>(mask_ptr)[m0 + r]) : 1.f;
  }
}

// Product i into acc as one committed wgmma batch: the A fragment tXr (registers) times rows
// kCols (i % 2).. of weight tile i / 2 (tiles [128, kK] of LayoutW, back to back from `weights`), so
// that product 2q + h is half h of pass q's 128 columns.
template <typename LayoutW, int kCols, int kK, typename T, typename Mma, typename ThrMma, typename FragA,
          typename Acc>
__device__ __forceinline__ void issue_half_pass_sm90(Mma& mma, ThrMma& thr, FragA& tXr, Acc& acc, const T* weights,
                                                     int i) {
  using namespace cute;
  constexpr int kTileElems = 2 * kCols * kK;
  Tensor sW = make_tensor(make_smem_ptr(weights + (i / 2) * kTileElems), LayoutW{});
  Tensor tWr = thr.partition_fragment_B(local_tile(sW, Shape<Int<kCols>, Int<kK>>{}, make_coord(i % 2, 0)));
  warpgroup_fence_operand(tXr);
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  mma.accumulate_ = GMMA::ScaleOut::Zero;  // the first k-step overwrites the accumulators
#pragma unroll
  for (int kk = 0; kk < size<2>(tXr); ++kk) {
    gemm(mma, tXr(_, _, kk), tWr(_, _, kk), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

// Products 0 .. kProducts - 1 of a warpgroup's tile, two in flight: product i + 1 runs while product
// i's epilogue does. issue(i, acc) starts product i in acc (one committed wgmma batch); epilogue(i, acc)
// finishes it. acc0 takes the even products, acc1 the odd ones. On return no product is in flight (the
// A operand's registers are free).
template <int kProducts, typename Issue, typename Epilogue, typename Acc>
__device__ __forceinline__ void run_products_sm90(Issue&& issue, Epilogue&& epilogue, Acc& acc0, Acc& acc1) {
  static_assert(kProducts % 2 == 0 && kProducts >= 2, "products in pairs");
  issue(0, acc0);
  issue(1, acc1);
#pragma unroll
  for (int i = 0; i < kProducts; i += 2) {
    cute::warpgroup_wait<1>();  // product i
    epilogue(i, acc0);
    if (i + 2 < kProducts) {
      issue(i + 2, acc0);
      cute::warpgroup_wait<1>();  // product i + 1
    } else {
      cute::warpgroup_wait<0>();  // the last product
    }
    epilogue(i + 1, acc1);
    if (i + 3 < kProducts) issue(i + 3, acc1);
  }
}

}  // namespace block
}  // namespace evoformer
