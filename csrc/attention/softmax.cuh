// Per-score code shared by the forward and backward kernels of both families: the score
// accumulator's start at the biases over the scale (mask + pair tiles in shared memory, the pair
// tile in either of two layouts), the online softmax step of the forward and the recomputation of
// P and dS in the backward. Everything works on a warp's 16-row tile in mma.sync's accumulator
// layout (mma_sm80.cuh), which the Hopper kernels' wgmma fragments share.
#pragma once

#include <type_traits>

#include "attention/evoformer_attention.h"
#include "common/mma_sm80.cuh"

namespace evoformer {

// The element type of a pair-bias tile of pair kind kPair (kNoPair: unused, Element).
template <int kPair, typename Element>
struct PairType {
  using type = std::conditional_t<kPair == kPairFloat, float, Element>;
};

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

// Sets a warp's 16-row score tile to the biases divided by the scale, s = fma(pair, 1 / scale, mask)
// per score (the mask bias is already divided by the scale and is per column; without kHasPair,
// s = mask), so that after S += q.k the logits in log2 units are x = S * scale_log2. `pair` holds
// the pair-bias values in accumulator layout and may be `s` itself. With kCheckKeys (the last key
// block), keys at or past `valid_keys` start at -inf.
template <bool kHasPair, bool kCheckKeys, int kNTiles>
__device__ __forceinline__ void add_key_biases(float (&s)[kNTiles][4], const float (&pair)[kNTiles][4],
                                               const float* mask_tile, int valid_keys, float inv_scale, int lane) {
  const int t = lane % 4;
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
    const int col = nt * 8 + 2 * t;
    float2 cb = mask_tile ? *reinterpret_cast<const float2*>(mask_tile + col) : make_float2(0.f, 0.f);
    if (kCheckKeys && col >= valid_keys) cb.x = -kInf;
    if (kCheckKeys && col + 1 >= valid_keys) cb.y = -kInf;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if constexpr (kHasPair) {
        s[nt][2 * r] = fmaf(pair[nt][2 * r], inv_scale, cb.x);
        s[nt][2 * r + 1] = fmaf(pair[nt][2 * r + 1], inv_scale, cb.y);
      } else {
        s[nt][2 * r] = cb.x;
        s[nt][2 * r + 1] = cb.y;
      }
    }
  }
}

// Starts a warp's 16-row score tile at the biases divided by the scale (add_key_biases); the pair
// tile holds rows row0.. of this stage (see load_bias_tile).
template <bool kHasPair, bool kCheckKeys, int kNTiles, int kPairPitch, typename PairT>
__device__ __forceinline__ void init_scores(float (&s)[kNTiles][4], const float* mask_tile, const PairT* pair_tile,
                                            int row0, int valid_keys, float inv_scale, int lane) {
  if constexpr (kHasPair) load_bias_tile<kNTiles, kPairPitch, false>(s, pair_tile, row0, lane);
  add_key_biases<kHasPair, kCheckKeys, kNTiles>(s, s, mask_tile, valid_keys, inv_scale, lane);
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

// Whether the forward of Element takes the rounding residual delta out of every score's exponent
// (softmax_step).
template <typename Element>
constexpr bool kResidualPerScore = std::is_same_v<Element, cutlass::half_t>;

// delta = m * scale_log2 - M for a row maximum m (0 before any finite key).
__device__ __forceinline__ float log2_row_max_residual(float m, float m_log2, float scale_log2) {
  return m == -kInf ? 0.f : fmaf(m, scale_log2, -m_log2);
}

// One online-softmax step for rows g and g + 8 (r = 0, 1) of a 16-row score tile in accumulator
// layout: updates the running maxima m (raw score units), turns the scores into probabilities
// exp2(S * scale_log2 - M) in place (one FFMA and one MUFU op per score; M = log2_row_max(m)) and
// returns in alpha the factor by which what was accumulated for each row must be rescaled.
// Ties stay exact even when |S| is huge (fully masked rows, S ~ -1e9 / scale): the FFMA rounds
// S * scale_log2 - M once, so every score equal to m gets the same weight 2^delta, with
// delta = m * scale_log2 - M the rounding residual of M; it cancels in O = P.V / rowsum, and
// store_output_rows takes that weight, as rounded for P.V, out of the statistics.
//
// float16 cannot hold 2^delta (|delta| up to 64 at a -1e9 fill: it overflows or flushes to zero,
// and the row turns NaN), so its kernels take delta out of every exponent (kResidualPerScore: one
// FADD per score, exactly 0 at the maximum, weight 1); bfloat16 holds it and keeps one FFMA.
template <int kNTiles, bool kSubtractResidual = false>
__device__ __forceinline__ void softmax_step(float (&s)[kNTiles][4], float (&row_max_s)[2], float (&alpha)[2],
                                             float scale_log2) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float mx = fmaxf(row_max_s[r], quad_max(row_max<kNTiles>(s, r)));
    const float m_log2 = log2_row_max(mx, scale_log2);
    // what was accumulated carries 2^-M_old (2^-(M_old + delta_old) with kSubtractResidual), M_old =
    // log2_row_max(previous m); before any finite key it is all zeros and alpha = exp2(-inf) = 0
    float shift = __fsub_rn(__fmul_rn(row_max_s[r], scale_log2), m_log2);
    float residual = 0.f;
    if constexpr (kSubtractResidual) {
      residual = log2_row_max_residual(mx, m_log2, scale_log2);
      shift += log2_row_max_residual(row_max_s[r], log2_row_max(row_max_s[r], scale_log2), scale_log2) - residual;
    }
    alpha[r] = fast_exp2(shift);
    row_max_s[r] = mx;
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      if constexpr (kSubtractResidual) {
        s[nt][2 * r] = fast_exp2(fmaf(s[nt][2 * r], scale_log2, -m_log2) - residual);
        s[nt][2 * r + 1] = fast_exp2(fmaf(s[nt][2 * r + 1], scale_log2, -m_log2) - residual);
      } else {
        s[nt][2 * r] = fast_exp2(fmaf(s[nt][2 * r], scale_log2, -m_log2));
        s[nt][2 * r + 1] = fast_exp2(fmaf(s[nt][2 * r + 1], scale_log2, -m_log2));
      }
    }
  }
}

// dS = P * (dP - delta) in place of `dp` (which holds dP - delta) for rows g and g + 8 of a 16-row
// accumulator tile, with P = exp2((S - m) * scale_log2 - l) recomputed from the scores S and the
// rows' forward statistics (m, l).
template <int kNTiles>
__device__ __forceinline__ void scores_to_ds(float (&dp)[kNTiles][4], const float (&sc)[kNTiles][4],
                                             const float2 (&stats_row)[2], float scale_log2) {
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      dp[nt][e] *= fast_exp2(fmaf(sc[nt][e] - stats_row[e / 2].x, scale_log2, -stats_row[e / 2].y));
}

// Starts a 16-row accumulator tile at -delta of its rows g and g + 8, so that adding dO.V^T to it
// gives dP - delta.
template <int kNTiles>
__device__ __forceinline__ void start_at_minus_delta(float (&dp)[kNTiles][4], const float (&delta_row)[2]) {
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dp[nt][e] = -delta_row[e / 2];
}

// The mask bias over the scale of key `key` of row (b, n), as the score accumulators start; keys
// at or past Lk are -inf.
__device__ __forceinline__ float key_mask_scaled(const AttentionParams& p, int64_t b, int64_t n, int key) {
  return key < p.Lk ? (p.mask_scaled ? p.mask_scaled[b * p.mask_stride_b + n * p.mask_stride_n + key] : 0.f) : -kInf;
}

}  // namespace evoformer
