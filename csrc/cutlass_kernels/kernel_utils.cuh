// Building blocks shared by the forward and backward kernels: CuTe's SM80 tensor-core MMA,
// ldmatrix and cp.async atoms wrapped for the fragment layouts used here, conversions and exp2.
//
// Fragment layouts of mma.sync m16n8k16 (g = lane / 4, t = lane % 4):
//   A (16x16, row-major)  a0: (g, 2t..2t+1)  a1: (g+8, 2t..)  a2: (g, 2t+8..)  a3: (g+8, 2t+8..)
//   B (16x8, k x n)       b0: (k 2t..2t+1, n g)               b1: (k 2t+8.., n g)
//   C (16x8, fp32)        c0,c1: (g, 2t..2t+1)                c2,c3: (g+8, 2t..2t+1)
// Two C tiles side by side (16 columns) therefore hold exactly an A fragment's 16x16 values, which
// is how probabilities move from one product to the next without leaving registers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <cutlass/fast_math.h>
#include <cutlass/numeric_types.h>

#include "evoformer_attention.h"

// Forward tiling of the D = 32 and D = 64 buckets: warps per CTA, 16-row tiles per warp, keys per
// step and the minimum resident CTAs per SM compiled for (which caps registers per thread). A/B
// knobs at build time, e.g. EVOFORMER_BLOCKS_EXTRA_CUDA_FLAGS="-DEVOFORMER_FWD_D32_MIN_BLOCKS=3"
// (see benchmarks/tune.sh); the defaults are the fastest measured on an H100 (benchmarks/RESULTS.md).
#ifndef EVOFORMER_FWD_D32_WARPS
#define EVOFORMER_FWD_D32_WARPS 4
#endif
#ifndef EVOFORMER_FWD_D32_MTILES
#define EVOFORMER_FWD_D32_MTILES 2
#endif
#ifndef EVOFORMER_FWD_D32_BLOCK_N
#define EVOFORMER_FWD_D32_BLOCK_N 32
#endif
#ifndef EVOFORMER_FWD_D32_MIN_BLOCKS
#define EVOFORMER_FWD_D32_MIN_BLOCKS 4
#endif
#ifndef EVOFORMER_FWD_D64_WARPS
#define EVOFORMER_FWD_D64_WARPS 8
#endif
#ifndef EVOFORMER_FWD_D64_MTILES
#define EVOFORMER_FWD_D64_MTILES 1
#endif
#ifndef EVOFORMER_FWD_D64_BLOCK_N
#define EVOFORMER_FWD_D64_BLOCK_N 64
#endif
#ifndef EVOFORMER_FWD_D64_MIN_BLOCKS
#define EVOFORMER_FWD_D64_MIN_BLOCKS 2
#endif
// Minimum resident CTAs per SM of the D = 32 backward kernels (see BackwardConfig).
#ifndef EVOFORMER_BWD_MIN_BLOCKS
#define EVOFORMER_BWD_MIN_BLOCKS 3
#endif

namespace evoformer {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kInf = __builtin_huge_valf();

template <typename Element>
struct MmaAtom;
template <>
struct MmaAtom<cutlass::bfloat16_t> {
  using Op = cute::SM80_16x8x16_F32BF16BF16F32_TN;
};
template <>
struct MmaAtom<cutlass::half_t> {
  using Op = cute::SM80_16x8x16_F32F16F16F32_TN;
};

// acc += a * b on one 16x8x16 tile, fp32 accumulation.
template <typename Element>
__device__ __forceinline__ void mma(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  MmaAtom<Element>::Op::fma(acc[0], acc[1], acc[2], acc[3], a[0], a[1], a[2], a[3], b0, b1, acc[0], acc[1],
                            acc[2], acc[3]);
}

// Two floats -> two Elements in one register (first in the low half).
template <typename Element>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
    __nv_bfloat162 r = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&r);
  } else {
    __half2 r = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&r);
  }
}

// Two Elements in one register -> two floats.
template <typename Element>
__device__ __forceinline__ float2 unpack2(uint32_t x) {
  if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
    return make_float2(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&x));
  }
}

// 1 / x in one MUFU op (no denormal handling: x >= 1 where it is used, a softmax row sum).
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ldmatrix.x4: lane l addresses row (l % 8) of 8x8 matrix (l / 8); register r_i holds matrix i.
__device__ __forceinline__ void ldsm_x4(const void* smem, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(smem), r0, r1, r2, r3);
}
// The same, each 8x8 matrix transposed.
__device__ __forceinline__ void ldsm_x4_trans(const void* smem, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                              uint32_t& r3) {
  cute::SM75_U16x8_LDSM_T::copy(*reinterpret_cast<const cute::uint128_t*>(smem), r0, r1, r2, r3);
}

// 16-byte global -> shared copy; zero-fills the destination when !pred (a source size of 0: src is
// then not read, so it may point past the tensor).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool pred) {
  cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(*reinterpret_cast<const cute::uint128_t*>(gmem),
                                                              *reinterpret_cast<cute::uint128_t*>(smem), pred);
}
__device__ __forceinline__ void cp_async_commit() { cute::cp_async_fence(); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  cute::cp_async_wait<kPending>();
}

// Copies [kRows, kCols] tiles of 2- or 4-byte values (rows `row_stride` apart in global memory,
// 16-byte aligned) into shared memory with row pitch kPitch, 16 bytes per cp.async. A thread
// always copies the same column chunk of rows row0, row0 + kRowStep, ... (fixed at construction),
// so each copy costs one predicate and one address per chunk.
// Rows >= valid_rows and chunks starting at or past valid_cols are zero-filled.
template <typename T, int kRows, int kCols, int kPitch, int kThreads>
struct TileCopy {
  static constexpr int kPerChunk = 16 / sizeof(T);
  static constexpr int kChunksPerRow = kCols / kPerChunk;
  static_assert(kCols % kPerChunk == 0, "tile width must be a whole number of 16-byte chunks");
  static_assert(kThreads % kChunksPerRow == 0, "each thread must keep one column chunk");
  static constexpr int kRowStep = kThreads / kChunksPerRow;
  static constexpr int kIters = (kRows + kRowStep - 1) / kRowStep;

  int row0, col;

  __device__ __forceinline__ explicit TileCopy(int tid)
      : row0(int(unsigned(tid) / kChunksPerRow)), col(int(unsigned(tid) % kChunksPerRow) * kPerChunk) {}

  __device__ __forceinline__ void operator()(T* smem, const T* gmem, int64_t row_stride, int valid_rows,
                                             int valid_cols) const {
    const bool col_ok = col < valid_cols;
    T* s = smem + row0 * kPitch + col;
    const T* g = gmem + row0 * row_stride + col;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int r = row0 + it * kRowStep;
      if (kRows % kRowStep == 0 || r < kRows) {
        const bool pred = col_ok && r < valid_rows;
        cp_async_16(s + it * kRowStep * kPitch, g + it * kRowStep * row_stride, pred);  // !pred: nothing is read
      }
    }
  }
};

// One-off copy of a tile (see TileCopy).
template <typename T, int kRows, int kCols, int kPitch, int kThreads>
__device__ __forceinline__ void load_tile_async(T* smem, const T* gmem, int64_t row_stride, int valid_rows,
                                                int valid_cols, int tid) {
  TileCopy<T, kRows, kCols, kPitch, kThreads>{tid}(smem, gmem, row_stride, valid_rows, valid_cols);
}

// Loads A fragments of a [16 * kMTiles, 16 * kKTiles] row-major tile in shared memory whose first
// row is `row0` (pitch kPitch elements): frag[m][k] is the A operand of rows m*16.., cols k*16...
template <int kMTiles, int kKTiles, int kPitch, typename Element>
__device__ __forceinline__ void load_a_frags(uint32_t (&frag)[kMTiles][kKTiles][4], const Element* smem, int row0,
                                             int lane) {
  const int mat = lane / 8;
  const int row = row0 + (mat % 2) * 8 + lane % 8;
  const int col = (mat / 2) * 8;
#pragma unroll
  for (int m = 0; m < kMTiles; ++m)
#pragma unroll
    for (int k = 0; k < kKTiles; ++k)
      ldsm_x4(smem + (row + m * 16) * kPitch + col + k * 16, frag[m][k][0], frag[m][k][1], frag[m][k][2],
              frag[m][k][3]);
}

// B fragments from a tile stored with the n index along rows and k along columns ("n-major", e.g.
// K[key][d] for S = Q.K^T): for 16 consecutive n starting at n0 and 16 k starting at k0, returns
// {b0, b1} of the n8 tile at n0 and of the n8 tile at n0 + 8.
template <int kPitch, typename Element>
__device__ __forceinline__ void load_b_frags_nmajor(uint32_t (&b)[2][2], const Element* smem, int n0, int k0,
                                                    int lane) {
  const int mat = lane / 8;
  const int row = n0 + (mat / 2) * 8 + lane % 8;
  const int col = k0 + (mat % 2) * 8;
  ldsm_x4(smem + row * kPitch + col, b[0][0], b[0][1], b[1][0], b[1][1]);
}

// B fragments from a tile stored with the k index along rows and n along columns ("k-major", e.g.
// V[key][d] for O = P.V): for 16 k starting at k0 and 16 n starting at n0, returns {b0, b1} of the
// n8 tile at n0 and of the n8 tile at n0 + 8.
template <int kPitch, typename Element>
__device__ __forceinline__ void load_b_frags_kmajor(uint32_t (&b)[2][2], const Element* smem, int k0, int n0,
                                                    int lane) {
  const int mat = lane / 8;
  const int row = k0 + (mat % 2) * 8 + lane % 8;
  const int col = n0 + (mat / 2) * 8;
  ldsm_x4_trans(smem + row * kPitch + col, b[0][0], b[0][1], b[1][0], b[1][1]);
}

// A fragment for k-chunk `kc` (16 columns) built from fp32 C tiles 2kc and 2kc+1 of one m16 row
// tile.
template <typename Element, int kNTiles>
__device__ __forceinline__ void c_to_a_frag(uint32_t (&a)[4], const float (&c)[kNTiles][4], int kc) {
  a[0] = pack2<Element>(c[2 * kc][0], c[2 * kc][1]);
  a[1] = pack2<Element>(c[2 * kc][2], c[2 * kc][3]);
  a[2] = pack2<Element>(c[2 * kc + 1][0], c[2 * kc + 1][1]);
  a[3] = pack2<Element>(c[2 * kc + 1][2], c[2 * kc + 1][3]);
}

// Maximum over the 2 * kNTiles values of one row (r) of an accumulator tile, as a tree so the
// dependency chain is log2 deep rather than linear.
template <int kNTiles>
__device__ __forceinline__ float row_max(const float (&c)[kNTiles][4], int r) {
  float v[kNTiles];
#pragma unroll
  for (int i = 0; i < kNTiles; ++i) v[i] = fmaxf(c[i][2 * r], c[i][2 * r + 1]);
#pragma unroll
  for (int w = 1; w < kNTiles; w *= 2)
#pragma unroll
    for (int i = 0; i + w < kNTiles; i += 2 * w) v[i] = fmaxf(v[i], v[i + w]);
  return v[0];
}

// Grid of CTAs that each own one tile of one row (b, n): x = tile + n_tiles * (n + N * b), so CTAs
// that share a row's tiles (q, k, v of one (b, n, h)) are adjacent in launch order and the re-reads
// hit L2; heads run on blockIdx.y. The two divisions that decode x use multipliers precomputed on
// the host (cutlass::FastDivmod: a multiply-high and a shift each instead of a division routine);
// x < 2^31 (grid limit) is within FastDivmod's range.
struct RowTile {
  int64_t b, n;
  int tile;
};
struct RowTileGrid {
  cutlass::FastDivmod tiles, rows;
  unsigned n_ctas;  // B * N * n_tiles; the bindings keep it below 2^31

  RowTileGrid(int B, int N, int n_tiles) : tiles(n_tiles), rows(N), n_ctas(unsigned(int64_t(B) * N * n_tiles)) {}
  dim3 dims(int H) const { return dim3(n_ctas, unsigned(H)); }

  __device__ __forceinline__ RowTile decode() const {
    int bn, tile, b, n;
    tiles(bn, tile, int(blockIdx.x));
    rows(b, n, bn);
    return RowTile{b, n, tile};
  }
};

// Launches kernel(p, grid, extra...) with one CTA of `threads` threads per tile of `tile_rows` of
// `length` rows of each (b, n), and each head, after raising its dynamic shared-memory limit to
// smem_bytes; both steps are checked and a failure names `name`.
template <typename... Extra>
inline void launch_on_row_tiles(void (*kernel)(AttentionParams, RowTileGrid, Extra...), const AttentionParams& p,
                                int length, int tile_rows, int threads, int smem_bytes, cudaStream_t stream,
                                const char* name, const Extra&... extra) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes) != cudaSuccess)
    check_launch((std::string(name) + " (shared-memory attribute)").c_str());
  const RowTileGrid grid(p.B, p.N, (length + tile_rows - 1) / tile_rows);
  kernel<<<grid.dims(p.H), threads, smem_bytes, stream>>>(p, grid, extra...);
  check_launch(name);
}

// One m16n8k16 A operand held in registers.
struct AFrag {
  uint32_t r[4];
};

// acc[nt] += A . B for one warp's 16 rows: k runs over kKSteps * 16, A's fragment for k-step kk
// comes from a_frag(kk), and B is an n-major shared-memory tile (smem[n][k], pitch kPitch) whose
// n covers kNTiles * 8 columns. E.g. S = Q.K^T (smem = K) or dP = dO.V^T (smem = V).
template <typename Element, int kNTiles, int kKSteps, int kPitch, typename AFragFn>
__device__ __forceinline__ void mma_a_by_nmajor(float (&acc)[kNTiles][4], AFragFn&& a_frag, const Element* smem,
                                                int lane) {
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    const AFrag a = a_frag(kk);
#pragma unroll
    for (int nt = 0; nt < kNTiles; nt += 2) {
      uint32_t bf[2][2];
      load_b_frags_nmajor<kPitch>(bf, smem, nt * 8, kk * 16, lane);
      mma<Element>(acc[nt], a.r, bf[0][0], bf[0][1]);
      mma<Element>(acc[nt + 1], a.r, bf[1][0], bf[1][1]);
    }
  }
}

// acc[dt] += C . B for one warp's 16 rows: C is an fp32 accumulator tile [16, kCTiles * 8] (e.g.
// probabilities or dS, rounded to Element as the A operand) and B a k-major shared-memory tile
// (smem[k][n], pitch kPitch) whose n covers kDTiles * 8 columns. E.g. O += P.V or dQ += dS.K.
// With kRowSums, also row_sums += C . ones (16 x 8): every column of that tile is the row sum of the
// rounded C (rows g and g + 8 in elements 0-1 and 2-3), one tensor-core op per 16 columns instead
// of a chain of adds.
template <typename Element, int kCTiles, int kDTiles, int kPitch, bool kRowSums = false>
__device__ __forceinline__ void mma_c_by_kmajor(float (&acc)[kDTiles][4], const float (&c)[kCTiles][4],
                                                const Element* smem, int lane, float (*row_sums)[4] = nullptr) {
#pragma unroll
  for (int kc = 0; kc < kCTiles / 2; ++kc) {
    uint32_t a[4];
    c_to_a_frag<Element>(a, c, kc);
    if constexpr (kRowSums) {
      const uint32_t ones = pack2<Element>(1.f, 1.f);
      mma<Element>(*row_sums, a, ones, ones);
    }
#pragma unroll
    for (int dt = 0; dt < kDTiles; dt += 2) {
      uint32_t bf[2][2];
      load_b_frags_kmajor<kPitch>(bf, smem, kc * 16, dt * 8, lane);
      mma<Element>(acc[dt], a, bf[0][0], bf[0][1]);
      mma<Element>(acc[dt + 1], a, bf[1][0], bf[1][1]);
    }
  }
}

// The A fragment of k-step kk of a warp's 16 rows: from registers when `frags` holds them, else
// read from the row-major shared-memory tile smem[row][k] (pitch kPitch) starting at row0.
template <int kKSteps, int kPitch, bool kInRegs, typename Element>
__device__ __forceinline__ AFrag a_frag_of(const uint32_t (&frags)[kKSteps][4], const Element* smem, int row0, int kk,
                                           int lane) {
  AFrag f;
  if constexpr (kInRegs) {
#pragma unroll
    for (int i = 0; i < 4; ++i) f.r[i] = frags[kk][i];
  } else {
    uint32_t tmp[1][1][4];
    load_a_frags<1, 1, kPitch>(tmp, smem + kk * 16, row0, lane);
#pragma unroll
    for (int i = 0; i < 4; ++i) f.r[i] = tmp[0][0][i];
  }
  return f;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Shared-memory bias tiles [rows][cols] come in two layouts, told apart by their kPitch:
// kPitch >= 0: row-major, rows kPitch values apart (cp.async copies, padded against bank conflicts);
// kPitch = swizzled128(rows): the dense tile a TMA copy with CU_TENSOR_MAP_SWIZZLE_128B writes:
// column slabs of 128 bytes ([slab][rows][128 B]; one slab for 64 16-bit keys, two for 64 fp32
// ones), and within a slab the 16-byte chunk c of row r stored at chunk c ^ (r % 8).
constexpr int swizzled128(int rows) { return -rows; }
template <int kPitch, typename T>
__device__ __forceinline__ int bias_tile_offset(int row, int col) {
  if constexpr (kPitch >= 0) {
    return row * kPitch + col;
  } else {
    constexpr int kRows = -kPitch, kSlab = 128 / int(sizeof(T)), kChunk = 16 / int(sizeof(T));
    const int slab = col / kSlab, c = col % kSlab;
    return (slab * kRows + row) * kSlab + ((c / kChunk) ^ (row % 8)) * kChunk + c % kChunk;
  }
}

// Pair-bias values of a warp's 16-row score tile in accumulator layout: out[nt][e] is the bias of
// score (row g + 8 * (e / 2), column nt * 8 + 2t + e % 2). The tile lives in shared memory, either
// with score rows along its rows (kTransposed = false: tile[row0 + row][col]) or transposed
// (tile[col][row0 + row], the dK/dV kernel's S^T). 16-bit tiles are read with ldmatrix, four 8x8
// blocks at a time; fp32 tiles element-wise.
template <int kNTiles, int kPitch, bool kTransposed, typename T>
__device__ __forceinline__ void load_bias_tile(float (&out)[kNTiles][4], const T* tile, int row0, int lane) {
  static_assert(kPitch >= 0 || !kTransposed, "transposed bias tiles are row-major (cp.async)");
  const int g = lane / 4, t = lane % 4;
  if constexpr (sizeof(T) == 2) {
    static_assert(kNTiles % 2 == 0, "ldmatrix covers two n8 tiles");
    const int mat = lane / 8;
#pragma unroll
    for (int nt = 0; nt < kNTiles; nt += 2) {
      uint32_t r[4];
      if constexpr (!kTransposed) {
        // matrices: (rows 0-7, cols nt), (rows 8-15, cols nt), (rows 0-7, cols nt+1), (rows 8-15, cols nt+1)
        ldsm_x4(tile + bias_tile_offset<kPitch, T>(row0 + (mat % 2) * 8 + lane % 8, nt * 8 + (mat / 2) * 8), r[0], r[1],
                r[2], r[3]);
      } else {
        // stored [col][row]; transposed 8x8 blocks in the same order as above
        ldsm_x4_trans(tile + (nt * 8 + (mat / 2) * 8 + lane % 8) * kPitch + row0 + (mat % 2) * 8, r[0], r[1], r[2],
                      r[3]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 v = unpack2<T>(r[i]);
        out[nt + i / 2][2 * (i % 2)] = v.x;
        out[nt + i / 2][2 * (i % 2) + 1] = v.y;
      }
    }
  } else {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + g + 8 * r, col = nt * 8 + 2 * t;
        float2 v;
        if constexpr (!kTransposed) {
          v = *reinterpret_cast<const float2*>(tile + bias_tile_offset<kPitch, T>(row, col));
        } else {
          v = make_float2(tile[col * kPitch + row], tile[(col + 1) * kPitch + row]);
        }
        out[nt][2 * r] = v.x;
        out[nt][2 * r + 1] = v.y;
      }
  }
}

// Starts a warp's 16-row score tile at the biases divided by the scale, so that after S += q.k the
// logits in log2 units are x = S * scale_log2. Columns are the stage's keys: the mask bias (already
// divided by the scale) is per column; the pair tile holds rows row0.. of this stage (see
// load_bias_tile). With kCheckKeys (the last key block), keys at or past `valid_keys` start at -inf.
template <bool kHasPair, bool kCheckKeys, int kNTiles, int kPairPitch, typename PairT>
__device__ __forceinline__ void init_scores(float (&s)[kNTiles][4], const float* mask_tile, const PairT* pair_tile,
                                            int row0, int valid_keys, float inv_scale, int lane) {
  const int t = lane % 4;
  if constexpr (kHasPair) load_bias_tile<kNTiles, kPairPitch, false>(s, pair_tile, row0, lane);
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
    const int col = nt * 8 + 2 * t;
    float2 cb = mask_tile ? *reinterpret_cast<const float2*>(mask_tile + col) : make_float2(0.f, 0.f);
    if (kCheckKeys && col >= valid_keys) cb.x = -kInf;
    if (kCheckKeys && col + 1 >= valid_keys) cb.y = -kInf;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if constexpr (kHasPair) {
        s[nt][2 * r] = fmaf(s[nt][2 * r], inv_scale, cb.x);
        s[nt][2 * r + 1] = fmaf(s[nt][2 * r + 1], inv_scale, cb.y);
      } else {
        s[nt][2 * r] = cb.x;
        s[nt][2 * r + 1] = cb.y;
      }
    }
  }
}

// init_scores for a key block of kNTiles * 8 keys of which `valid_keys` exist: the variant that
// checks keys only for a block that runs past Lk.
template <bool kHasPair, int kNTiles, int kPairPitch, typename PairT>
__device__ __forceinline__ void init_block_scores(float (&s)[kNTiles][4], const float* mask_tile,
                                                  const PairT* pair_tile, int row0, int valid_keys, float inv_scale,
                                                  int lane) {
  if (valid_keys < kNTiles * 8)
    init_scores<kHasPair, true, kNTiles, kPairPitch>(s, mask_tile, pair_tile, row0, valid_keys, inv_scale, lane);
  else
    init_scores<kHasPair, false, kNTiles, kPairPitch>(s, mask_tile, pair_tile, row0, valid_keys, inv_scale, lane);
}

// The row maximum m (raw score units) in log2 units as the exps use it: M = m * scale_log2, rounded
// once (never contracted into an FMA), so that every step and the epilogue see the same M for the
// same m; m = -inf (no finite key yet) uses M = 0.
__device__ __forceinline__ float log2_row_max(float m, float scale_log2) {
  return m == -kInf ? 0.f : __fmul_rn(m, scale_log2);
}

// One online-softmax step for rows g and g + 8 (r = 0, 1) of a 16-row score tile in accumulator
// layout: updates the running maxima m (raw score units), turns the scores into probabilities
// exp2(S * scale_log2 - M) in place (one FFMA and one MUFU op per score; M = log2_row_max(m)) and
// returns in alpha the factor by which what was accumulated for each row must be rescaled.
// Ties stay exact even when |S| is huge (fully masked rows, S ~ -1e9 / scale): the FFMA rounds
// S * scale_log2 - M once, so every score equal to m gets the same weight 2^delta, with
// delta = m * scale_log2 - M the rounding residual of M; store_output_rows takes delta out of the
// statistics, where it matters, and it cancels in O = P.V / rowsum.
template <int kNTiles>
__device__ __forceinline__ void softmax_step(float (&s)[kNTiles][4], float (&row_max_s)[2], float (&alpha)[2],
                                             float scale_log2) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float mx = fmaxf(row_max_s[r], quad_max(row_max<kNTiles>(s, r)));
    const float m_log2 = log2_row_max(mx, scale_log2);
    // what was accumulated carries 2^-M_old, M_old = log2_row_max(previous m); before any finite
    // key it is all zeros and alpha = exp2(-inf) = 0
    alpha[r] = fast_exp2(__fsub_rn(__fmul_rn(row_max_s[r], scale_log2), m_log2));
    row_max_s[r] = mx;
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      s[nt][2 * r] = fast_exp2(fmaf(s[nt][2 * r], scale_log2, -m_log2));
      s[nt][2 * r + 1] = fast_exp2(fmaf(s[nt][2 * r + 1], scale_log2, -m_log2));
    }
  }
}

// Forward epilogue of one 16-row tile: o / rowsum into out[row][0..D) (rows g and g + 8 of the tile
// are `row` and `row + 8`, written when < Lq; out is the [Lq, D] slice of this (b, n, h), rows
// `o_stride` apart) and the row statistics (max, log2 rowsum) into stats[row]; rows whose keys are
// all -inf get (0, +inf), so the backward's exp2(... - inf) gives P = 0 there.
template <typename Element, int kDTiles>
__device__ __forceinline__ void store_output_rows(const float (&o)[kDTiles][4], const float (&row_sum)[2],
                                                  const float (&row_max_s)[2], float scale_log2, Element* out,
                                                  int64_t o_stride, float2* stats, int row, int Lq, int D,
                                                  int lane) {
  const int t = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r, row += 8) {
    const float sum = row_sum[r];
    const float inv = sum > 0.f ? fast_rcp(sum) : 0.f;  // sum >= 2^-64: the row maximum contributes 2^delta
    if (row < Lq) {
      Element* orow = out + int64_t(row) * o_stride;
      auto store = [&](auto check_d) {
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          const int d = dt * 8 + 2 * t;
          if (!decltype(check_d)::value || d < D)
            *reinterpret_cast<uint32_t*>(orow + d) = pack2<Element>(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
        }
      };
      if (D == kDTiles * 8)
        store(std::false_type{});  // D fills its bucket: no per-column test
      else
        store(std::true_type{});
      // (m, log2 of sum_i exp2((S_i - m) * scale_log2)), the form the backward recomputes P from:
      // the probabilities summed here carry 2^delta (softmax_step), which log2(sum) - delta removes
      const float m_log2 = log2_row_max(row_max_s[r], scale_log2);
      const float delta = fmaf(row_max_s[r], scale_log2, -m_log2);
      if (t == 0) stats[row] = sum > 0.f ? make_float2(row_max_s[r], __log2f(sum) - delta) : make_float2(0.f, kInf);
    }
  }
}

// Stores rows g and g + 8 of a warp's 16-row accumulator tile, times `scale`, into out[row][0..D)
// (`row` is the tile's row g; rows `row_stride` apart, written when < `rows`).
template <typename Element, int kDTiles>
__device__ __forceinline__ void store_scaled_rows(const float (&acc)[kDTiles][4], Element* out, int64_t row_stride,
                                                  int row, int rows, int D, float scale, int lane) {
  const int t = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row + 8 * r;
    if (i < rows) {
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const int d = dt * 8 + 2 * t;
        if (d < D)
          *reinterpret_cast<uint32_t*>(out + i * row_stride + d) =
              pack2<Element>(acc[dt][2 * r] * scale, acc[dt][2 * r + 1] * scale);
      }
    }
  }
}

// The mask bias over the scale of key `key` of row (b, n), as the score accumulators start; keys
// at or past Lk are -inf.
__device__ __forceinline__ float key_mask_scaled(const AttentionParams& p, int64_t b, int64_t n, int key) {
  return key < p.Lk ? (p.mask_scaled ? p.mask_scaled[b * p.mask_stride_b + n * p.mask_stride_n + key] : 0.f) : -kInf;
}

template <int kPair, typename Element>
struct PairType {
  using type = std::conditional_t<kPair == kPairFloat, float, Element>;
};

}  // namespace evoformer
