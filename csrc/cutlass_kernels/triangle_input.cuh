// The input half of the triangle multiplicative update in one kernel: the layer norm of z, the
// projections and gates of both edges and the output gate's projection (AF2 Algorithms 11/12,
// lines 1-4; the layer norm's affine parameters are folded into the weights on the host).
//
//   x_hat = normalise(z)                                       [M, K] (K = c_z), in shared memory only
//   a[c, m] = mask[m] * sigmoid(x_hat W_ag[c]^T + b_ag[c]) * (x_hat W_ap[c]^T + b_ap[c])   (b likewise)
//   g[m, n] = x_hat W_g[n]^T + b_g[n]
//
// a, b are written channel-major [C, M] (the triangle products' batched GEMMs read them so) and g
// row-major [M, G]; mean and rstd [M] of every row are written for the backward. In HBM this reads
// z once and writes a, b and g once: x_hat, the [4C, M] projections before their gates and the
// gates' inputs never leave the chip.
//
// CTA: 256 threads, kRows = 128 positions. The z tile is copied (cp.async) into shared memory and
// normalised there (two lanes per row, two passes in float32, rounded to T as the tensor cores read
// it). The output columns then run in passes of 128 through the same x_hat tile: an edge pass covers
// 64 channels of one edge, its columns ordered (projection of channels 0-31, their gates, projection
// of 32-63, their gates), so that each of the two column halves a warp can own pairs every
// projection value with its gate value in the same thread; a g pass covers 128 columns of g. The
// weight rows of pass q + 1 are copied while pass q multiplies (two buffers). Warps: 4 row groups of
// 32 x 2 column halves of 64, mma.sync m16n8k16 with fp32 accumulation. The epilogue stages the
// pass's results in the pass's weight buffer (its products are done) and stores them as 16-byte
// rows: channel rows of a / b, position rows of g.
#pragma once

#include <cstdint>

#include "gating.cuh"
#include "mma_sm80.cuh"

namespace evoformer {
namespace block {

constexpr int kTriInRows = 128;      // positions per CTA
constexpr int kTriInPassCols = 128;  // output columns per pass
constexpr int kTriInThreads = 256;
constexpr int kTriInEdgeChannels = kTriInPassCols / 2;  // channels of one edge per pass
constexpr int kTriInStagePitch = kTriInPassCols + 8;   // elements per staged row (bank-conflict free)

// sigmoid(x) from one exp2 and one reciprocal (MUFU; the denominator is >= 1).
__device__ __forceinline__ float fast_sigmoid(float x) {
  return fast_rcp(1.f + fast_exp2(-1.4426950408889634f * x));
}

template <int kKSteps>
struct TriangleInputTile {
  static constexpr int kK = 16 * kKSteps;  // c_z rounded up; the columns past c_z are zeros
  static constexpr int kPitch = kK + 8;    // elements per shared-memory row (ldmatrix conflict free)
  static constexpr int kBuffer =           // elements of one weight / staging buffer
      kTriInPassCols * (kPitch > kTriInStagePitch ? kPitch : kTriInStagePitch);
  static constexpr int kSmemElems = kTriInRows * kPitch + 2 * kBuffer;
};

template <typename T, int kKSteps>
constexpr int triangle_input_smem_bytes() {
  return TriangleInputTile<kKSteps>::kSmemElems * int(sizeof(T));
}

// Starts the copy of pass q's weight tile [128 rows, kK] into `smem` (one cp.async group). A thread
// copies the 16-byte chunk at column `col` of rows row0 + j * kRowStep of each 32-row group: group
// 2h + s of an edge pass holds the projection (s = 0) or gate (s = 1) rows of channels
// block * 64 + 32h.., a g pass rows n0.. of w_g. Rows past C (or G) are zeros.
template <typename T, int kKSteps>
__device__ __forceinline__ void triangle_input_load_weights(const TriangleInputParams& p, T* smem, int q,
                                                            int edge_passes) {
  using Tile = TriangleInputTile<kKSteps>;
  constexpr int kChunksPerRow = Tile::kK / 8;
  constexpr int kRowStep = kTriInThreads / kChunksPerRow;
  static_assert(32 % kRowStep == 0, "row steps tile the 32-row groups");
  const int col = int(threadIdx.x % unsigned(kChunksPerRow)) * 8;
  const int row0 = int(threadIdx.x / unsigned(kChunksPerRow));
  const bool col_ok = col < p.K;
  T* const dst = smem + row0 * Tile::kPitch + col;
  if (q < 2 * edge_passes) {
    const int edge = q / edge_passes;
    const int ch0 = (q - edge * edge_passes) * kTriInEdgeChannels + row0;
    const T* const w = static_cast<const T*>(p.w_ab) + (int64_t(2 * edge) * p.C + ch0) * p.K + col;
#pragma unroll
    for (int grp = 0; grp < 4; ++grp)
#pragma unroll
      for (int j = 0; j < 32 / kRowStep; ++j) {
        const int ch = ch0 + (grp / 2) * 32 + j * kRowStep;  // the row's channel
        const bool ok = col_ok && ch < p.C;
        const T* src = w + (int64_t(grp % 2) * p.C + (grp / 2) * 32 + j * kRowStep) * p.K;
        cp_async_16(dst + (grp * 32 + j * kRowStep) * Tile::kPitch, ok ? src : w, ok);
      }
  } else {
    const int n0 = (q - 2 * edge_passes) * kTriInPassCols + row0;
    const T* const w = static_cast<const T*>(p.w_g) + int64_t(n0) * p.K + col;
#pragma unroll
    for (int r = 0; r < kTriInPassCols; r += kRowStep) {
      const bool ok = col_ok && n0 + r < p.G;
      cp_async_16(dst + r * Tile::kPitch, ok ? w + int64_t(r) * p.K : w, ok);
    }
  }
  cp_async_commit();
}

template <typename T, int kKSteps>
__global__ void __launch_bounds__(kTriInThreads, 2) triangle_input_kernel(TriangleInputParams p) {
  using Tile = TriangleInputTile<kKSteps>;
  constexpr int kPitch = Tile::kPitch;
  extern __shared__ __align__(16) unsigned char tri_in_smem[];
  T* const xs = reinterpret_cast<T*>(tri_in_smem);  // [kRows, kPitch]: z, then x_hat
  T* const ws = xs + kTriInRows * kPitch;           // two [kBuffer] weight / staging buffers
  const int64_t m0 = int64_t(blockIdx.x) * kTriInRows;
  const int valid_rows = int(p.M - m0 < kTriInRows ? p.M - m0 : kTriInRows);
  const int edge_passes = (p.C + kTriInEdgeChannels - 1) / kTriInEdgeChannels;
  const int passes = 2 * edge_passes + (p.G + kTriInPassCols - 1) / kTriInPassCols;

  // z tile (group 0), the first two passes' weights (groups 1, 2)
  load_tile_async<T, kTriInRows, Tile::kK, kPitch, kTriInThreads>(xs, static_cast<const T*>(p.z) + m0 * p.z_stride,
                                                                  p.z_stride, valid_rows, p.K, threadIdx.x);
  cp_async_commit();
  triangle_input_load_weights<T, kKSteps>(p, ws, 0, edge_passes);
  if (passes > 1) triangle_input_load_weights<T, kKSteps>(p, ws + Tile::kBuffer, 1, edge_passes);
  else cp_async_commit();
  cp_async_wait<2>();
  __syncthreads();

  // Layer norm: two lanes per row; lane h of the pair reads the 16-byte chunks c with (c / 4) % 2 == h
  // (the pair's two 64-byte runs fall on different banks), three times: sum, squared deviations,
  // normalised values written back.
  {
    constexpr int kChunks = Tile::kK / 16;  // per lane
    const int r = threadIdx.x / 2u, h = threadIdx.x % 2u;
    T* row = xs + r * kPitch;
    const auto chunk_col = [h](int j) { return ((j / 4) * 8 + h * 4 + j % 4) * 8; };
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      Vec<T> x;
      x.load(row + chunk_col(j));
#pragma unroll
      for (int e = 0; e < 8; ++e) sum += x.v[e];  // columns past K are zeros
    }
    const float inv_k = 1.f / float(p.K);
    const float mean = segment_sum(sum, 2) * inv_k;
    float sq = 0.f;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      if (chunk_col(j) >= p.K) continue;
      Vec<T> x;
      x.load(row + chunk_col(j));
#pragma unroll
      for (int e = 0; e < 8; ++e) sq += (x.v[e] - mean) * (x.v[e] - mean);
    }
    const float rstd = rsqrtf(segment_sum(sq, 2) * inv_k + p.eps);
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      if (chunk_col(j) >= p.K) continue;
      Vec<T> x;
      x.load(row + chunk_col(j));
#pragma unroll
      for (int e = 0; e < 8; ++e) x.v[e] = (x.v[e] - mean) * rstd;
      x.store(row + chunk_col(j));
    }
    if (h == 0 && r < valid_rows) p.mean[m0 + r] = mean, p.rstd[m0 + r] = rstd;
  }

  const int warp = threadIdx.x / 32u, lane = threadIdx.x % 32u;
  const int g = lane / 4, t = lane % 4;
  const int row_group = warp % 4, col_half = warp / 4;  // rows row_group * 32.., columns col_half * 64..
  // the thread's four rows: (m tile mt, half i / 2) -> row_group * 32 + mt * 16 + g + 8 * (i / 2)
  float mask[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = row_group * 32 + mt * 16 + g + 8 * hh;
      mask[mt][hh] = p.mask != nullptr && r < valid_rows ? float(static_cast<const T*>(p.mask)[m0 + r]) : 1.f;
    }

  for (int q = 0; q < passes; ++q) {
    T* const wbuf = ws + (q % 2) * Tile::kBuffer;
    cp_async_wait<1>();
    __syncthreads();  // x_hat (q = 0) and pass q's weights are in shared memory

    float acc[2][8][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t af[2][1][kARegs<T>];
      load_a_frags<2, 1, kPitch>(af, xs + kk * 16, row_group * 32, lane);
#pragma unroll
      for (int n16 = 0; n16 < 4; ++n16) {
        uint32_t bf[2][kBRegs<T>];
        load_b_frags_nmajor<kPitch>(bf, wbuf, col_half * 64 + n16 * 16, kk * 16, lane);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          mma<T>(acc[mt][2 * n16], af[mt][0], bf[0]);
          mma<T>(acc[mt][2 * n16 + 1], af[mt][0], bf[1]);
        }
      }
    }
    __syncthreads();  // every warp is done with the weights: the buffer takes the staged results

    if (q < 2 * edge_passes) {
      // edge pass: column tiles 0-3 are projections, 4-7 the gates of the same channels
      const int edge = q / edge_passes;
      const int ch0 = (q % edge_passes) * kTriInEdgeChannels;
      const float* const bias_proj = p.b_ab + 2 * edge * p.C;
      const float* const bias_gate = bias_proj + p.C;
      // staged [64 channels, 128 positions]: the thread's channel col_half * 32 + nt * 8 + 2t + e
      T* const stage = wbuf + (col_half * 32 + 2 * t) * kTriInStagePitch + row_group * 32 + g;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int ch = ch0 + col_half * 32 + nt * 8 + 2 * t + e;
          const float bp = ch < p.C ? bias_proj[ch] : 0.f;
          const float bg = ch < p.C ? bias_gate[ch] : 0.f;
          T* const s = stage + (nt * 8 + e) * kTriInStagePitch;
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int i = 2 * hh + e;
              s[mt * 16 + 8 * hh] =
                  T(fast_sigmoid(acc[mt][nt + 4][i] + bg) * (acc[mt][nt][i] + bp) * mask[mt][hh]);
            }
        }
      __syncthreads();
      // [64 channels, 128 positions] -> rows of a or b: the thread stores 8 positions from `col` of
      // channels lc0, lc0 + 16, ...
      T* const out = static_cast<T*>(edge == 0 ? p.a : p.b);
      constexpr int kSpans = kTriInRows / 8;
      const int col = int(threadIdx.x % unsigned(kSpans)) * 8, lc0 = int(threadIdx.x / unsigned(kSpans));
      if (col < valid_rows) {
#pragma unroll
        for (int lc = lc0; lc < kTriInEdgeChannels; lc += kTriInThreads / kSpans) {
          if (ch0 + lc >= p.C) break;
          const T* src = wbuf + lc * kTriInStagePitch + col;
          T* dst = out + int64_t(ch0 + lc) * p.M + m0 + col;
          if (p.vector_ok) {  // M % 8 == 0: a whole span
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
          } else {
            for (int e = 0; e < 8 && col + e < valid_rows; ++e) dst[e] = src[e];
          }
        }
      }
    } else {
      // g pass: columns n0.. of g, plus their bias
      const int n0 = (q - 2 * edge_passes) * kTriInPassCols;
      const T* b_g = static_cast<const T*>(p.b_g);
      T* const stage = wbuf + (row_group * 32 + g) * kTriInStagePitch + col_half * 64 + 2 * t;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int n = n0 + col_half * 64 + nt * 8 + 2 * t;
        const float b0 = n < p.G ? float(b_g[n]) : 0.f;  // G is even: n + 1 < G too
        const float b1 = n < p.G ? float(b_g[n + 1]) : 0.f;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            store2<T>(stage + (mt * 16 + 8 * hh) * kTriInStagePitch + nt * 8, acc[mt][nt][2 * hh] + b0,
                      acc[mt][nt][2 * hh + 1] + b1);
          }
      }
      __syncthreads();
      // [128 positions, 128 columns] -> rows of g (G is a multiple of 8: whole 16-byte spans)
      constexpr int kSpans = kTriInPassCols / 8;
      const int col = int(threadIdx.x % unsigned(kSpans)) * 8, r0 = int(threadIdx.x / unsigned(kSpans));
      if (n0 + col < p.G) {
#pragma unroll
        for (int r = r0; r < kTriInRows; r += kTriInThreads / kSpans) {
          if (r >= valid_rows) break;
          *reinterpret_cast<uint4*>(static_cast<T*>(p.g) + (m0 + r) * p.G + n0 + col) =
              *reinterpret_cast<const uint4*>(wbuf + r * kTriInStagePitch + col);
        }
      }
    }
    __syncthreads();  // the staged results are stored: the buffer takes pass q + 2's weights
    if (q + 2 < passes) triangle_input_load_weights<T, kKSteps>(p, wbuf, q + 2, edge_passes);
    else cp_async_commit();
  }
}

}  // namespace block
}  // namespace evoformer
