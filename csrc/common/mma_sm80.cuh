// The sm80 tensor-core building blocks (mma.sync, ldmatrix, cp.async through CuTe's SM80 atoms),
// wrapped for the fragment layouts used here, with the conversions and fast math around them.
// The sm80 kernels are built from them; the Hopper kernels use the conversions, the cp.async copies
// and the accumulator-to-A-fragment repacking.
//
// The helpers speak of k-steps of 16 for every Element. For 16-bit Elements a k-step is one
// mma.sync m16n8k16 (g = lane / 4, t = lane % 4):
//   A (16x16, row-major)  a0: (g, 2t..2t+1)  a1: (g+8, 2t..)  a2: (g, 2t+8..)  a3: (g+8, 2t+8..)
//   B (16x8, k x n)       b0: (k 2t..2t+1, n g)               b1: (k 2t+8.., n g)
//   C (16x8, fp32)        c0,c1: (g, 2t..2t+1)                c2,c3: (g+8, 2t..2t+1)
// Two C tiles side by side (16 columns) therefore hold exactly an A fragment's 16x16 values, which
// is how probabilities move from one product to the next without leaving registers.
//
// For float (TF32 tensor cores) a k-step is two mma.sync m16n8k8 (k 0-7, then k 8-15), one 32-bit
// value per register, operands rounded to TF32 (cvt.rna: round to nearest) before the product:
//   A (16x8)  a0: (g, t)  a1: (g+8, t)  a2: (g, t+4)  a3: (g+8, t+4)      (registers 0-3, 4-7)
//   B (8x8)   b0: (k t, n g)  b1: (k t+4, n g)                            (registers 0-1, 2-3)
//   C         as above.
// ldmatrix (b16) of 8 rows x 16 bytes gives lane (g, t) the 32-bit word t of row g: for float rows
// that is the A pattern (four matrices: rows 0-7 / 8-15 x floats 0-3 / 4-7) and, for a tile stored
// n-major (rows n, floats k), the B pattern, so row-major A and n-major B load as for 16-bit types.
// An A operand taken from C tiles uses the keys of each k8 step in the order 0, 2, 4, 6, 1, 3, 5, 7:
// A = (c0, c2, c1, c3) of one C tile, and the k-major B that multiplies it follows the same order,
// b0 = B[k 2t][n g], b1 = B[k 2t+1][n g] (two 32-bit shared-memory loads: there is no transposing
// ldmatrix for 32-bit data; with rows D + 4 floats apart they are bank-conflict free).
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <cutlass/numeric_types.h>

namespace evoformer {

// The most shared memory one CTA of the portable kernels may take: an A100's opt-in limit (163 KB;
// an H100 allows 227 KB), so that every sm80 configuration launches on compute capability 8.0.
constexpr int kSm80MaxSmemPerCta = 163 * 1024;

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

// Registers of one k-step's A operand (16 rows x 16 k) and of one n8 tile's B operand (16 k x 8 n).
template <typename Element>
constexpr int kARegs = 2 * int(sizeof(Element));
template <typename Element>
constexpr int kBRegs = int(sizeof(Element));
// Elements per 16-byte row chunk (one row of an ldmatrix matrix).
template <typename Element>
constexpr int kChunkElems = 16 / int(sizeof(Element));

// x rounded to TF32 (10-bit mantissa, round to nearest, ties away from zero), as a 32-bit register.
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// One mma.sync m16n8k8 with TF32 operands, fp32 accumulation: acc += a * b.
__device__ __forceinline__ void mma_tf32_k8(float (&acc)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                            uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// acc += a * b on one 16x8 tile over one k-step of 16, fp32 accumulation.
template <typename Element>
__device__ __forceinline__ void mma(float (&acc)[4], const uint32_t (&a)[kARegs<Element>],
                                    const uint32_t (&b)[kBRegs<Element>]) {
  if constexpr (std::is_same_v<Element, float>) {
    mma_tf32_k8(acc, a[0], a[1], a[2], a[3], b[0], b[1]);
    mma_tf32_k8(acc, a[4], a[5], a[6], a[7], b[2], b[3]);
  } else {
    MmaAtom<Element>::Op::fma(acc[0], acc[1], acc[2], acc[3], a[0], a[1], a[2], a[3], b[0], b[1], acc[0], acc[1],
                              acc[2], acc[3]);
  }
}

// Two floats -> two Elements in one register (first in the low half); 16-bit Elements only.
template <typename Element>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  static_assert(sizeof(Element) == 2, "pack2 packs 16-bit Elements");
  if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
    __nv_bfloat162 r = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&r);
  } else {
    __half2 r = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&r);
  }
}

// Two Elements in one register -> two floats; 16-bit Elements only.
template <typename Element>
__device__ __forceinline__ float2 unpack2(uint32_t x) {
  static_assert(sizeof(Element) == 2, "unpack2 unpacks 16-bit Elements");
  if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
    return make_float2(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&x));
  }
}

// residual + piece * scale for eight 16-bit Elements at once (16-byte pieces of a row), in float32
// and rounded once; `scale` (eight Elements, 16-byte aligned) may be nullptr: 1. The epilogues that
// finish a module's residual update with it read the residual where they write the result.
template <typename Element>
__device__ __forceinline__ uint4 add_to_residual(uint4 piece, const Element* residual, const Element* scale) {
  const uint4 res = *reinterpret_cast<const uint4*>(residual);
  const uint4 sc = scale != nullptr ? *reinterpret_cast<const uint4*>(scale) : uint4{};
  uint32_t* const v = reinterpret_cast<uint32_t*>(&piece);
  const uint32_t* const r = reinterpret_cast<const uint32_t*>(&res);
  const uint32_t* const f = reinterpret_cast<const uint32_t*>(&sc);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    float2 x = unpack2<Element>(v[q]);
    if (scale != nullptr) {
      const float2 k = unpack2<Element>(f[q]);
      x.x *= k.x, x.y *= k.y;
    }
    const float2 y = unpack2<Element>(r[q]);
    v[q] = pack2<Element>(y.x + x.x, y.y + x.y);
  }
  return piece;
}

// x as the tensor cores see it when it is an A operand of Element type (rounded to Element, or to
// TF32 for float).
template <typename Element>
__device__ __forceinline__ float round_operand(float x) {
  if constexpr (std::is_same_v<Element, float>)
    return __uint_as_float(to_tf32(x));
  else
    return unpack2<Element>(pack2<Element>(x, 0.f)).x;
}

// Stores lo, hi to dst[0], dst[1] as Elements (dst 2 * sizeof(Element)-byte aligned).
template <typename Element>
__device__ __forceinline__ void store2(Element* dst, float lo, float hi) {
  if constexpr (std::is_same_v<Element, float>)
    *reinterpret_cast<float2*>(dst) = make_float2(lo, hi);
  else
    *reinterpret_cast<uint32_t*>(dst) = pack2<Element>(lo, hi);
}

// Rounds freshly loaded float operand registers to TF32 (nothing for 16-bit Elements).
template <typename Element, int kRegs>
__device__ __forceinline__ void round_operands(uint32_t (&r)[kRegs]) {
  if constexpr (std::is_same_v<Element, float>) {
#pragma unroll
    for (int i = 0; i < kRegs; ++i) r[i] = to_tf32(__uint_as_float(r[i]));
  }
}

// 1 / x in one MUFU op (no denormal handling: x >= 1 where it is used, a softmax row sum).
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 2^x in one MUFU op (no denormal results).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The sigmoid of the gates (the block ops' gate kernels, the attention forward's gated epilogue and
// the triangle kernels' float16 gates, so that fused and unfused gates give the same values): 1 / (1 +
// 2^(-x log2 e)), one exp2 and one reciprocal on the MUFU (the denominator is >= 1; 0 for x < -88,
// where 2^... is inf). Four instructions per value; the IEEE division took about eighteen.
__device__ __forceinline__ float sigmoid(float x) { return fast_rcp(1.f + fast_exp2(-1.4426950408889634f * x)); }

// ldmatrix.x4: lane l addresses row (l % 8) of 8x8 matrix (l / 8); register r_i holds matrix i.
__device__ __forceinline__ void ldsm_x4(const void* smem, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(smem), r0, r1, r2, r3);
}
// The same, each 8x8 matrix transposed.
__device__ __forceinline__ void ldsm_x4_trans(const void* smem, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                              uint32_t& r3) {
  cute::SM75_U16x8_LDSM_T::copy(*reinterpret_cast<const cute::uint128_t*>(smem), r0, r1, r2, r3);
}

// sm_90 and later only (stmatrix; callers guard their use): stores four 8 x 8 tiles of 16-bit values
// from the mma C-fragment layout (register i of lane l: row l / 4, columns 2 (l % 4) and + 1 of tile
// i), each transposed: lanes 8 i .. 8 i + 7 give the shared-memory addresses of tile i's stored rows
// (its columns), each of 16 bytes.
__device__ __forceinline__ void stsm_x4_trans(const void* row, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                   unsigned(__cvta_generic_to_shared(row))),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// The same without the transpose: lanes 8 i .. 8 i + 7 give the addresses of tile i's rows.
__device__ __forceinline__ void stsm_x4(const void* row, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                   unsigned(__cvta_generic_to_shared(row))),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
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
// (float: two ldmatrix.x4 per k-step, at columns 0 and 8 of it, rounded to TF32).
template <int kMTiles, int kKTiles, int kPitch, typename Element>
__device__ __forceinline__ void load_a_frags(uint32_t (&frag)[kMTiles][kKTiles][kARegs<Element>], const Element* smem,
                                             int row0, int lane) {
  constexpr int kPerStep = kARegs<Element> / 4;  // ldmatrix.x4 per k-step
  const int mat = lane / 8;
  const int row = row0 + (mat % 2) * 8 + lane % 8;
  const int col = (mat / 2) * kChunkElems<Element>;
#pragma unroll
  for (int m = 0; m < kMTiles; ++m)
#pragma unroll
    for (int k = 0; k < kKTiles; ++k) {
#pragma unroll
      for (int h = 0; h < kPerStep; ++h)
        ldsm_x4(smem + (row + m * 16) * kPitch + col + k * 16 + h * 8, frag[m][k][4 * h], frag[m][k][4 * h + 1],
                frag[m][k][4 * h + 2], frag[m][k][4 * h + 3]);
      round_operands<Element>(frag[m][k]);
    }
}

// B fragments from a tile stored with the n index along rows and k along columns ("n-major", e.g.
// K[key][d] for S = Q.K^T): for 16 consecutive n starting at n0 and 16 k starting at k0, returns
// the B operands of the n8 tile at n0 (b[0]) and of the n8 tile at n0 + 8 (b[1]).
template <int kPitch, typename Element>
__device__ __forceinline__ void load_b_frags_nmajor(uint32_t (&b)[2][kBRegs<Element>], const Element* smem, int n0,
                                                    int k0, int lane) {
  const int mat = lane / 8;
  if constexpr (std::is_same_v<Element, float>) {
    // per n8 tile, matrices at floats k0 + 0, 4, 8, 12: b0, b1 of k8 step 0, then of step 1
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      ldsm_x4(smem + (n0 + nt * 8 + lane % 8) * kPitch + k0 + mat * 4, b[nt][0], b[nt][1], b[nt][2], b[nt][3]);
      round_operands<Element>(b[nt]);
    }
  } else {
    const int row = n0 + (mat / 2) * 8 + lane % 8;
    const int col = k0 + (mat % 2) * 8;
    ldsm_x4(smem + row * kPitch + col, b[0][0], b[0][1], b[1][0], b[1][1]);
  }
}

// B fragments from a tile stored with the k index along rows and n along columns ("k-major", e.g.
// V[key][d] for O = P.V): for 16 k starting at k0 and 16 n starting at n0, returns the B operands
// of the n8 tile at n0 (b[0]) and of the n8 tile at n0 + 8 (b[1]). For float the keys of each k8
// step are in the order of c_to_a_frag's A: registers (k 2t, k 2t+1) of step 0, then of step 1.
template <int kPitch, typename Element>
__device__ __forceinline__ void load_b_frags_kmajor(uint32_t (&b)[2][kBRegs<Element>], const Element* smem, int k0,
                                                    int n0, int lane) {
  if constexpr (std::is_same_v<Element, float>) {
    const int g = lane / 4, t = lane % 4;
    const float* base = smem + (k0 + 2 * t) * kPitch + n0 + g;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i)  // keys k0 + 2t, 2t + 1, 8 + 2t, 9 + 2t
        b[nt][i] = to_tf32(base[((i / 2) * 8 + i % 2) * kPitch + nt * 8]);
  } else {
    const int mat = lane / 8;
    const int row = k0 + (mat % 2) * 8 + lane % 8;
    const int col = n0 + (mat / 2) * 8;
    ldsm_x4_trans(smem + row * kPitch + col, b[0][0], b[0][1], b[1][0], b[1][1]);
  }
}

// A fragment for k-chunk `kc` (16 columns) built from fp32 C tiles 2kc and 2kc+1 of one m16 row
// tile (float: (c0, c2, c1, c3) of each tile rounded to TF32, keys in the order 0, 2, 4, 6, 1, 3,
// 5, 7 of each k8 step; see the top of this file).
template <typename Element, int kNTiles>
__device__ __forceinline__ void c_to_a_frag(uint32_t (&a)[kARegs<Element>], const float (&c)[kNTiles][4], int kc) {
  if constexpr (std::is_same_v<Element, float>) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float(&ct)[4] = c[2 * kc + h];
      a[4 * h] = to_tf32(ct[0]), a[4 * h + 1] = to_tf32(ct[2]);
      a[4 * h + 2] = to_tf32(ct[1]), a[4 * h + 3] = to_tf32(ct[3]);
    }
  } else {
    a[0] = pack2<Element>(c[2 * kc][0], c[2 * kc][1]);
    a[1] = pack2<Element>(c[2 * kc][2], c[2 * kc][3]);
    a[2] = pack2<Element>(c[2 * kc + 1][0], c[2 * kc + 1][1]);
    a[3] = pack2<Element>(c[2 * kc + 1][2], c[2 * kc + 1][3]);
  }
}

// One k-step's A operand held in registers.
template <typename Element>
struct AFrag {
  uint32_t r[kARegs<Element>];
};

// acc[nt] += A . B for one warp's 16 rows: k runs over kKSteps * 16, A's fragment for k-step kk
// comes from a_frag(kk), and B is an n-major shared-memory tile (smem[n][k], pitch kPitch) whose
// n covers kNTiles * 8 columns. E.g. S = Q.K^T (smem = K) or dP = dO.V^T (smem = V).
template <typename Element, int kNTiles, int kKSteps, int kPitch, typename AFragFn>
__device__ __forceinline__ void mma_a_by_nmajor(float (&acc)[kNTiles][4], AFragFn&& a_frag, const Element* smem,
                                                int lane) {
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    const AFrag<Element> a = a_frag(kk);
#pragma unroll
    for (int nt = 0; nt < kNTiles; nt += 2) {
      uint32_t bf[2][kBRegs<Element>];
      load_b_frags_nmajor<kPitch>(bf, smem, nt * 8, kk * 16, lane);
      mma<Element>(acc[nt], a.r, bf[0]);
      mma<Element>(acc[nt + 1], a.r, bf[1]);
    }
  }
}

// acc[dt] += C . B for one warp's 16 rows: C is an fp32 accumulator tile [16, kCTiles * 8] (e.g.
// probabilities or dS, rounded to Element (float: TF32) as the A operand) and B a k-major shared-memory tile
// (smem[k][n], pitch kPitch) whose n covers kDTiles * 8 columns. E.g. O += P.V or dQ += dS.K.
// With kRowSums, also row_sums += C . ones (16 x 8): every column of that tile is the row sum of the
// rounded C (rows g and g + 8 in elements 0-1 and 2-3), one tensor-core op per 16 columns instead
// of a chain of adds.
template <typename Element, int kCTiles, int kDTiles, int kPitch, bool kRowSums = false>
__device__ __forceinline__ void mma_c_by_kmajor(float (&acc)[kDTiles][4], const float (&c)[kCTiles][4],
                                                const Element* smem, int lane, float (*row_sums)[4] = nullptr) {
#pragma unroll
  for (int kc = 0; kc < kCTiles / 2; ++kc) {
    uint32_t a[kARegs<Element>];
    c_to_a_frag<Element>(a, c, kc);
    if constexpr (kRowSums) {
      uint32_t ones[kBRegs<Element>];
#pragma unroll
      for (int i = 0; i < kBRegs<Element>; ++i) {
        if constexpr (std::is_same_v<Element, float>)
          ones[i] = __float_as_uint(1.f);
        else
          ones[i] = pack2<Element>(1.f, 1.f);
      }
      mma<Element>(*row_sums, a, ones);
    }
#pragma unroll
    for (int dt = 0; dt < kDTiles; dt += 2) {
      uint32_t bf[2][kBRegs<Element>];
      load_b_frags_kmajor<kPitch>(bf, smem, kc * 16, dt * 8, lane);
      mma<Element>(acc[dt], a, bf[0]);
      mma<Element>(acc[dt + 1], a, bf[1]);
    }
  }
}

// The A fragment of k-step kk of a warp's 16 rows: from registers when `frags` holds them, else
// read from the row-major shared-memory tile smem[row][k] (pitch kPitch) starting at row0.
template <int kKSteps, int kPitch, bool kInRegs, typename Element>
__device__ __forceinline__ AFrag<Element> a_frag_of(const uint32_t (&frags)[kKSteps][kARegs<Element>],
                                                    const Element* smem, int row0, int kk, int lane) {
  AFrag<Element> f;
  if constexpr (kInRegs) {
#pragma unroll
    for (int i = 0; i < kARegs<Element>; ++i) f.r[i] = frags[kk][i];
  } else {
    uint32_t tmp[1][1][kARegs<Element>];
    load_a_frags<1, 1, kPitch>(tmp, smem + kk * 16, row0, lane);
#pragma unroll
    for (int i = 0; i < kARegs<Element>; ++i) f.r[i] = tmp[0][0][i];
  }
  return f;
}

// Max / sum over the four lanes of a quad (the lanes that share rows g and g + 8 of a C tile).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
}  // namespace evoformer
