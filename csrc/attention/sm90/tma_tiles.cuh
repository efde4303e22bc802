// TMA copies of the Hopper attention kernels' tiles: [rows, D] row tiles of Q, K, V and dO into the
// GMMA layouts of common/sm90_layouts.cuh, and pair-bias tiles into the layout bias_tile_offset reads.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>

#include <type_traits>

#include "attention/evoformer_attention.h"
#include "attention/softmax.cuh"  // swizzled128
#include "common/sm90_layouts.cuh"

namespace evoformer {
namespace sm90 {

// A TMA coordinate along a dimension of stride `stride`: encode_tile_map describes a dimension of
// stride 0 (size 1 or broadcast) as extent 1, where only coordinate 0 exists.
__device__ __forceinline__ int tma_coord(int64_t stride, int64_t index) { return stride != 0 ? int(index) : 0; }

// TMA copies of [kRows, D] row tiles of one (b, n, h) of a [B, N, L, H, D] tensor (Q, K, V, dO)
// into the layout of RowTileLayouts<Element, kRows, kHeadDim>: 64-byte swizzle at D = 32; above,
// column slabs of 64 values with the 128-byte swizzle (one box per slab).
//
// Where D is narrower than one slab (D < kBox: 8, 16, 24 on the 32 bucket, 40, 48, 56 on the 64
// one), the box is D values wide, every read in bounds: the copy lays each row out at the swizzle's
// width, as a full slab's, and leaves the columns past D alone, which the kernel zeroes once
// (KeyBlockTma::start). A box of kBox values cut by the tensor's bound at D instead read 16 or 48
// bytes of 64 per row slowly: the forward took 1.5 times as long at D = 8 or 24 as at D = 16 or
// 32 (H100, N 1024, L 384, H 8: 1.42 against 0.93 ms).
template <typename Element, int kHeadDim, int kRows>
struct RowTileTma {
  static constexpr int kBox = kHeadDim < 64 ? kHeadDim : 64;  // values of d per box (<= 128 bytes)
  static constexpr int kBoxes = kHeadDim / kBox;
  static constexpr CUtensorMapDataType kType = std::is_same_v<Element, cutlass::bfloat16_t>
                                                   ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                   : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;

  // Whether a tensor of head dim D gets the narrow box (columns past D never written).
  __host__ __device__ static constexpr bool narrow(int D) { return kBoxes == 1 && D < kBox; }
  // Bytes one tile's copies deliver (what its transaction barrier waits for).
  __host__ __device__ static constexpr int bytes(int D) { return kRows * (narrow(D) ? D : kHeadDim) * 2; }

  // The map of `length` rows of a [B, N, length, H, D] tensor at `base`; a rejection names `kernel`
  // and `tensor`.
  static void encode(CUtensorMap* map, const void* base, const RowStrides& st, int length, const AttentionParams& p,
                     const char* kernel, const char* tensor) {
    const int box = narrow(p.D) ? p.D : kBox;
    const TileMapDim dims[5] = {{p.D, 1, box}, {length, st.l, kRows}, {p.H, st.h, 1}, {p.N, st.n, 1}, {p.B, st.b, 1}};
    encode_tile_map(map, kType, 2, base, dims, 5, kHeadDim == 32 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B,
                    kernel, tensor);
  }
  // Rows row0.. of (b, n, h) into dst, completing on bar (armed by the caller).
  __device__ __forceinline__ static void copy(const CUtensorMap* map, uint64_t* bar, Element* dst, int row0,
                                              const RowStrides& st, int64_t b, int64_t n, int64_t h) {
#pragma unroll
    for (int c = 0; c < kBoxes; ++c)
      cute::SM90_TMA_LOAD_5D::copy(map, bar, uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL), dst + c * kRows * kBox,
                                   c * kBox, row0, tma_coord(st.h, h), tma_coord(st.n, n), tma_coord(st.b, b));
  }
};

// TMA copies of [kRows queries, kCols keys] tiles of the pair bias [B|1, H|1, Lq, Lk] into
// bias_tile_offset's swizzled128(kRows) layout (one box per 128-byte column slab).
template <typename PairT, typename Element, int kRows, int kCols>
struct PairTileTma {
  static constexpr int kBox = 128 / int(sizeof(PairT));  // keys per box
  static constexpr int kBoxes = kCols / kBox;
  static constexpr int kBytes = kRows * kCols * int(sizeof(PairT));
  static constexpr int kPitch = swizzled128(kRows);
  static_assert(kCols % kBox == 0, "whole boxes");

  // The map of p.pair; a rejection names `kernel`.
  static void encode(CUtensorMap* map, const AttentionParams& p, const char* kernel) {
    const TileMapDim dims[4] = {
        {p.Lk, 1, kBox}, {p.Lq, p.pair_stride_q, kRows}, {p.H, p.pair_stride_h, 1}, {p.B, p.pair_stride_b, 1}};
    encode_tile_map(map, sizeof(PairT) == 4 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : RowTileTma<Element, 32, 1>::kType,
                    int(sizeof(PairT)), p.pair, dims, 4, CU_TENSOR_MAP_SWIZZLE_128B, kernel, "pair-bias");
  }
  __device__ __forceinline__ static void copy(const CUtensorMap* map, uint64_t* bar, PairT* dst, int query0, int key0,
                                              const AttentionParams& p, int64_t b, int64_t h) {
#pragma unroll
    for (int c = 0; c < kBoxes; ++c)
      cute::SM90_TMA_LOAD_4D::copy(map, bar, uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL), dst + c * kRows * kBox,
                                   key0 + c * kBox, query0, tma_coord(p.pair_stride_h, h), tma_coord(p.pair_stride_b, b));
  }
};

}  // namespace sm90
}  // namespace evoformer
