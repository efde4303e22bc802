// Layouts and copies of the Hopper (sm_90a) kernels: the aligned shared-memory base, the per-SM CTA
// count they compile for, CuTe GMMA shared-memory layouts of [rows, D] tiles and the wgmma types that
// read them, a cp.async copy into those layouts, and TMA copies of row tiles and pair-bias tiles.
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include <type_traits>

#include "evoformer_attention.h"
#include "mma_sm80.cuh"  // cp_async_16
#include "softmax.cuh"   // swizzled128

namespace evoformer {
namespace sm90 {

// Shared-memory base for wgmma tiles: the swizzled layouts need kSmemAlign-byte alignment. Aligned
// by an offset from the raw pointer (not through an integer cast), so the compiler still knows every
// pointer derived from it is shared memory and emits LDS rather than generic loads. Kernels reserve
// kSmemAlign extra bytes for it.
constexpr int kSmemAlign = 1024;
constexpr int smem_align(int bytes) { return (bytes + kSmemAlign - 1) / kSmemAlign * kSmemAlign; }
__device__ __forceinline__ char* aligned_smem(char* smem_raw) {
  return smem_raw + (kSmemAlign - unsigned(__cvta_generic_to_shared(smem_raw)) % kSmemAlign) % kSmemAlign;
}

// CTAs per SM a Hopper kernel is compiled for (__launch_bounds__' minimum, which caps registers per
// thread): at most `reg_cap_ctas`, and no more than fit the SM's shared memory (228 KB, 1 KB of it
// reserved per CTA).
constexpr int ctas_per_sm(int smem_bytes, int reg_cap_ctas) {
  const int by_smem = 228 * 1024 / (smem_bytes + 1024);
  return by_smem < 1 ? 1 : (by_smem < reg_cap_ctas ? by_smem : reg_cap_ctas);
}

// GMMA layouts of a [kRows, kHeadDim] tile of 16-bit values stored row by row (e.g. K[key][d]):
// RowMajor views it as (row, d), the K-major operand of a product over d (S = Q.K^T);
// Transposed views the same bytes as (d, row), the MN-major operand of a product over rows
// (O += P.V, dQ += dS.K). 64-byte rows (D = 32) use the 64-byte swizzle, wider rows the 128-byte
// one; Transposed tiles its atoms rows-first, so that for every D element (r, c) of RowMajor and
// element (c, r) of Transposed are the same byte.
template <typename Element, int kRows, int kHeadDim>
struct RowTileLayouts {
  using AtomK = std::conditional_t<kHeadDim == 32, cute::GMMA::Layout_K_SW64_Atom<Element>,
                                   cute::GMMA::Layout_K_SW128_Atom<Element>>;
  using AtomMN = std::conditional_t<kHeadDim == 32, cute::GMMA::Layout_MN_SW64_Atom<Element>,
                                    cute::GMMA::Layout_MN_SW128_Atom<Element>>;
  using RowMajor = decltype(cute::tile_to_shape(AtomK{}, cute::Shape<cute::Int<kRows>, cute::Int<kHeadDim>>{}));
  using Transposed = decltype(cute::tile_to_shape(AtomMN{}, cute::Shape<cute::Int<kHeadDim>, cute::Int<kRows>>{},
                                                  cute::Step<cute::_2, cute::_1>{}));
};

// One warpgroup's wgmma [64, kN] += A [64, kK] . B with fp32 accumulation:
// SsMma: A and B in shared memory, both K-major (B stored [kN][kK], e.g. S = Q.K^T);
// RsMmaMN: A in registers, B in shared memory MN-major (B [kK, kN] stored with kN contiguous, e.g.
// O += P.V with V through RowTileLayouts::Transposed).
template <typename Element, int kN, int kK>
using SsMma = decltype(cute::make_tiled_mma(
    cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::Int<kN>, cute::Int<kK>>>()));
template <typename Element, int kN, int kK>
using RsMmaMN = decltype(cute::make_tiled_mma(
    cute::GMMA::rs_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::Int<kN>, cute::Int<kK>>,
                               cute::GMMA::Major::K, cute::GMMA::Major::MN>()));

// Copies [kRows, kCols] tiles of 16-bit values (rows `row_stride` apart in global memory) into a
// CuTe shared-memory layout, 16 bytes per cp.async. A thread always copies the same column chunk of
// rows row0, row0 + kRowStep, ...; their swizzled shared-memory offsets are computed once, at
// construction. Rows >= valid_rows and chunks at or past valid_cols are zero-filled.
template <int kRows, int kCols, int kThreads>
struct SwizzledTileCopy {
  static constexpr int kChunks = kCols / 8;
  static_assert(kThreads % kChunks == 0, "each thread must keep one column chunk");
  static constexpr int kRowStep = kThreads / kChunks;
  static constexpr int kIters = (kRows + kRowStep - 1) / kRowStep;
  int row0, col;
  int offset[kIters];  // elements from the tile's start

  // offset_of(row, col): the element's offset in the shared-memory layout.
  template <typename OffsetOf>
  __device__ __forceinline__ SwizzledTileCopy(int tid, OffsetOf&& offset_of)
      : row0(int(unsigned(tid) / kChunks)), col(int(unsigned(tid) % kChunks) * 8) {
#pragma unroll
    for (int it = 0; it < kIters; ++it) offset[it] = offset_of(row0 + it * kRowStep, col);
  }

  template <typename T>
  __device__ __forceinline__ void operator()(T* smem, const T* gmem, int64_t row_stride, int valid_rows,
                                             int valid_cols) const {
    const bool col_ok = col < valid_cols;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int r = row0 + it * kRowStep;
      if (kRows % kRowStep == 0 || r < kRows)
        cp_async_16(smem + offset[it], gmem + r * row_stride + col, col_ok && r < valid_rows);
    }
  }
};

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

// Offset in elements of element (r, c) in a swizzled shared-memory layout whose base is aligned to
// the swizzle's period (the swizzle acts on address bits, so it is evaluated on a null base).
template <typename Layout, typename Element>
__device__ __forceinline__ int swizzled_offset(int r, int c) {
  auto tile = cute::make_tensor(cute::make_smem_ptr(static_cast<Element*>(nullptr)), Layout{});
  return int(&tile(r, c) - static_cast<Element*>(nullptr));
}

}  // namespace sm90
}  // namespace evoformer
