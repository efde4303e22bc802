// Layouts and copies of the Hopper (sm_90a) kernels of every family: the aligned shared-memory base,
// the per-SM CTA count they compile for, CuTe GMMA shared-memory layouts of [rows, D] tiles and the
// wgmma types that read them, and a cp.async copy into those layouts.
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include <type_traits>

#include "common/mma_sm80.cuh"  // cp_async_16

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
// RsMma: A in registers, B in shared memory K-major (e.g. a normalised tile times weights [kN][kK]);
// RsMmaMN: A in registers, B in shared memory MN-major (B [kK, kN] stored with kN contiguous, e.g.
// O += P.V with V through RowTileLayouts::Transposed).
template <typename Element, int kN, int kK>
using SsMma = decltype(cute::make_tiled_mma(
    cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::Int<kN>, cute::Int<kK>>>()));
template <typename Element, int kN, int kK>
using RsMma = decltype(cute::make_tiled_mma(
    cute::GMMA::rs_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::Int<kN>, cute::Int<kK>>,
                               cute::GMMA::Major::K, cute::GMMA::Major::K>()));
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

// Offset in elements of element (r, c) in a swizzled shared-memory layout whose base is aligned to
// the swizzle's period (the swizzle acts on address bits, so it is evaluated on a null base).
template <typename Layout, typename Element>
__device__ __forceinline__ int swizzled_offset(int r, int c) {
  auto tile = cute::make_tensor(cute::make_smem_ptr(static_cast<Element*>(nullptr)), Layout{});
  return int(&tile(r, c) - static_cast<Element*>(nullptr));
}

}  // namespace sm90
}  // namespace evoformer
