// The output half of the triangle multiplicative update in one kernel (AF2 Algorithms 11/12, the
// last line; the layer norm's affine parameters are folded into w_z on the host):
//
//   n_hat[m, :] = normalise(p[:, m])               over the C channels of position m (p channel-major)
//   y[m, n] = n_hat[m, :] . w_z[n, :] + b_z[n]
//   out[m, n] = sigmoid(g[m, n]) * y[m, n]
//
// out and n_hat (kept for the backward, which recomputes y from it) are written row-major, rstd per
// position. In HBM this reads p and g once and writes out and n_hat once; it replaces the channel
// layer norm, the y GEMM and the gate kernel (which read n_hat, y and g back).
//
// CTA: 256 threads, 128 positions. The p tile [C, 128] (channel-major, as the triangle products
// leave it), w_z [G, C] and the g tile [128, G] are copied into shared memory (cp.async). The
// statistics take two threads per position (channel halves, warp-uniform: conflict-free column
// reads); the tile is normalised in place and stays channel-major, so it is the GEMM's A operand
// read with transposing ldmatrix (positions m, channels k). Warps as in triangle_input.cuh: 4 row
// groups of 32 positions x 2 column halves of 64. The epilogue writes out over g (each value by the
// thread that read g), which goes out as 16-byte rows.
#pragma once

#include <cstdint>

#include "triangle_input.cuh"

namespace evoformer {
namespace block {

template <int kKSteps>
struct TriangleOutputTile {
  // C rounded up (channels past C are zeros); weight rows as the input kernel's (triangle_pass_products)
  static constexpr int kK = TriangleInputTile<kKSteps>::kK;
  static constexpr int kPitch = TriangleInputTile<kKSteps>::kPitch;
  static constexpr int kWBuffer = kTriInPassCols * kPitch;
  static constexpr int kPElems = kK * kTriInStagePitch;          // [kK channels, 128 positions]
  static constexpr int kGElems = kTriInRows * kTriInStagePitch;  // [128 positions, G <= 128]
  template <typename T>
  static constexpr int bytes() {
    return (kPElems + kWBuffer + kGElems) * int(sizeof(T)) + 4 * kTriInRows * int(sizeof(float));
  }
};

template <typename T, int kKSteps>
__global__ void __launch_bounds__(kTriInThreads, 2) triangle_output_kernel(TriangleOutputParams p) {
  using Tile = TriangleOutputTile<kKSteps>;
  constexpr int kSP = kTriInStagePitch;
  extern __shared__ __align__(16) unsigned char tri_out_smem[];
  T* const ps = reinterpret_cast<T*>(tri_out_smem);  // [kK, kSP]: p, then n_hat (channel-major)
  T* const wb = ps + Tile::kPElems;                   // [128, kPitch]: w_z
  T* const gs = wb + Tile::kWBuffer;                  // [128, kSP]: g, then out
  float* const red = reinterpret_cast<float*>(gs + Tile::kGElems);  // [2][128] sums, [2][128] squares
  const int64_t m0 = int64_t(blockIdx.x) * kTriInRows;
  const int valid_rows = int(p.M - m0 < kTriInRows ? p.M - m0 : kTriInRows);

  // p tile (group 0): channel rows, 16 bytes along positions (plain loads where rows are unaligned)
  {
    constexpr int kSpans = kTriInRows / 8;
    const int col = int(threadIdx.x % unsigned(kSpans)) * 8, c0 = int(threadIdx.x / unsigned(kSpans));
    const T* const src0 = static_cast<const T*>(p.p) + m0 + col;
#pragma unroll
    for (int c = c0; c < Tile::kK; c += kTriInThreads / kSpans) {
      const bool ok = c < p.C && col < valid_rows;
      T* dst = ps + c * kSP + col;
      if (p.vector_ok) {
        cp_async_16(dst, ok ? src0 + int64_t(c) * p.M : src0, ok);
      } else {
        for (int e = 0; e < 8; ++e) dst[e] = ok && col + e < valid_rows ? src0[int64_t(c) * p.M + e] : T(0.f);
      }
    }
    cp_async_commit();
  }
  // w_z (group 1) and the g tile (group 2)
  load_tile_async<T, kTriInPassCols, Tile::kK, Tile::kPitch, kTriInThreads>(wb, static_cast<const T*>(p.w_z), p.C,
                                                                            p.G, p.C, threadIdx.x);
  cp_async_commit();
  load_tile_async<T, kTriInRows, kTriInPassCols, kSP, kTriInThreads>(gs, static_cast<const T*>(p.g) + m0 * p.G, p.G,
                                                                     valid_rows, p.G, threadIdx.x);
  cp_async_commit();
  cp_async_wait<2>();
  __syncthreads();

  // Layer norm over the channels of each position: thread = (position, channel half h), channels
  // h, h + 2, ... (h is warp-uniform), four independent partial sums; the halves meet in `red`.
  {
    const int pos = threadIdx.x % unsigned(kTriInRows), h = threadIdx.x / unsigned(kTriInRows);
    T* const column = ps + h * kSP + pos;
    float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < Tile::kK / 2; ++j) part[j % 4] += float(column[2 * j * kSP]);  // rows past C are zeros
    red[h * kTriInRows + pos] = (part[0] + part[1]) + (part[2] + part[3]);
    __syncthreads();
    const float mean = (red[pos] + red[kTriInRows + pos]) / float(p.C);
#pragma unroll
    for (int j = 0; j < Tile::kK / 2; ++j) {
      const float d = float(column[2 * j * kSP]) - mean;
      if (2 * j + h < p.C) part[j % 4] = j < 4 ? d * d : fmaf(d, d, part[j % 4]);
      else if (j < 4) part[j % 4] = 0.f;
    }
    red[(2 + h) * kTriInRows + pos] = (part[0] + part[1]) + (part[2] + part[3]);
    __syncthreads();
    const float rstd = rsqrtf((red[2 * kTriInRows + pos] + red[3 * kTriInRows + pos]) / float(p.C) + p.eps);
#pragma unroll
    for (int j = 0; j < Tile::kK / 2; ++j)
      if (2 * j + h < p.C) column[2 * j * kSP] = T((float(column[2 * j * kSP]) - mean) * rstd);
    if (h == 0 && pos < valid_rows) p.rstd[m0 + pos] = rstd;
  }
  __syncthreads();

  // n_hat rows [position, C]: 8 channels per 16-byte store
  {
    const int spans = p.C / 8;
    for (int s = threadIdx.x; s < valid_rows * spans; s += kTriInThreads) {
      const int pos = s / spans, c = (s - pos * spans) * 8;
      uint32_t w[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const T lo = ps[(c + 2 * e) * kSP + pos], hi = ps[(c + 2 * e + 1) * kSP + pos];
        w[e] = uint32_t(reinterpret_cast<const uint16_t&>(lo)) | (uint32_t(reinterpret_cast<const uint16_t&>(hi)) << 16);
      }
      *reinterpret_cast<uint4*>(static_cast<T*>(p.n_hat) + (m0 + pos) * p.C + c) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // w_z and g are in

  // y = n_hat . w_z^T: A from the channel-major tile (transposing ldmatrix), B from w_z rows
  const int warp = threadIdx.x / 32u, lane = threadIdx.x % 32u;
  const int g = lane / 4, t = lane % 4;
  const int row_group = warp % 4, col_half = warp / 4;
  float acc[2][8][4];
  const int mat = lane / 8;
  triangle_pass_products<T, kKSteps>(
      acc,
      [&](int kk, uint32_t(&af)[2][kARegs<T>]) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
          ldsm_x4_trans(ps + (kk * 16 + (mat / 2) * 8 + lane % 8) * kSP + row_group * 32 + mt * 16 + (mat % 2) * 8,
                        af[mt][0], af[mt][1], af[mt][2], af[mt][3]);
      },
      wb, col_half, lane);

  // out = sigmoid(g) * y over the g tile (each value rewritten by the thread that reads it), y rounded
  // to T as the backward recomputes it
  const T* const b_z = static_cast<const T*>(p.b_z);
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const int n = col_half * 64 + nt * 8 + 2 * t;
    const float b0 = n < p.G ? float(b_z[n]) : 0.f;  // G is even: n + 1 < G too
    const float b1 = n < p.G ? float(b_z[n + 1]) : 0.f;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = row_group * 32 + mt * 16 + g + 8 * hh;
        const float y0 = round_to<T>(acc[mt][nt][2 * hh] + b0), y1 = round_to<T>(acc[mt][nt][2 * hh + 1] + b1);
        T* const gp = gs + r * kSP + n;
        store2<T>(gp, fast_sigmoid(float(gp[0])) * y0, fast_sigmoid(float(gp[1])) * y1);
      }
  }
  __syncthreads();
  // out rows [position, G] (G a multiple of 8: whole 16-byte spans)
  {
    constexpr int kSpans = kTriInPassCols / 8;
    const int col = int(threadIdx.x % unsigned(kSpans)) * 8, r0 = int(threadIdx.x / unsigned(kSpans));
    if (col < p.G) {
#pragma unroll
      for (int r = r0; r < kTriInRows; r += kTriInThreads / kSpans) {
        if (r >= valid_rows) break;
        const int64_t at = (m0 + r) * p.G + col;
        *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + at) = *reinterpret_cast<const uint4*>(gs + r * kSP + col);
      }
    }
  }
}

}  // namespace block
}  // namespace evoformer
