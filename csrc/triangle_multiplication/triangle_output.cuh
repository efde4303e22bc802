// The output half of the triangle multiplicative update in one kernel (AF2 Algorithms 11/12, the
// last line; the layer norm's affine parameters are folded into w_z on the host):
//
//   n_hat[m, :] = normalise(p[:, m])               over the C channels of position m (p channel-major)
//   y[m, n] = n_hat[m, :] . w_z[n, :] + b_z[n]
//   out[m, n] = sigmoid(g[m, n]) * y[m, n]
//
// (with p.residual, out = residual + that, the update times p.scale where given: the block's residual
// add of the outgoing update, done as out is written)
// out and n_hat (kept for the backward, which recomputes y from it; not written when p.n_hat is
// nullptr: a forward without a backward) are written row-major, rstd per position. In HBM this reads
// p and g once and writes out and n_hat once; it replaces the channel layer norm, the y GEMM and the
// gate kernel (which read n_hat, y and g back).
//
// CTA: 256 threads, 128 positions per tile; a persistent grid (as many CTAs as are resident) whose
// CTAs walk the tiles gridDim.x apart. w_z [G, C] is copied into shared memory once per CTA, the p
// tile [C, 128] (channel-major, as the triangle products leave it) and the g tile [128, G] per tile
// (cp.async), the next tile's p while this tile's epilogue runs and its g once this tile's out has
// left the g buffer (against one CTA per tile, the kernel 0.28-0.30 -> 0.25-0.26 ms at N_res 1024 and
// 0.160-0.166 -> 0.148-0.155 at 768; H200, one process, bitwise the same results). The
// statistics take eight lanes of a warp per four positions (every eighth channel each, in
// registers, summed by shuffles); the tile is normalised in place and stays channel-major, so it is
// the GEMM's A operand read with transposing ldmatrix (positions m, channels k), and n_hat goes to
// HBM straight from those A fragments. Warps as in triangle_input.cuh: 4 row groups of 32 positions
// x 2 column halves of 64. The epilogue writes out over g (each value by the thread that read g),
// which goes out as 16-byte rows.
#pragma once

#include <cstdint>

#include "triangle_multiplication/triangle_input.cuh"

namespace evoformer {
namespace block {

// threadIdx.x by a volatile read, which the compiler neither hoists out of a loop nor merges
__device__ __forceinline__ unsigned fresh_thread_index() {
  unsigned tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  return tid;
}

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
    return (kPElems + kWBuffer + kGElems) * int(sizeof(T));
  }
};

// kWhole: C == 16 kKSteps, G == 128 and p.vector_ok (c = c_z = 128, N_res^2 a multiple of 8),
// compiled without the bounds checks on channels, columns and stores.
template <typename T, int kKSteps, bool kWhole>
__global__ void __launch_bounds__(kTriInThreads, 2) triangle_output_kernel(TriangleOutputParams p) {
  using Tile = TriangleOutputTile<kKSteps>;
  constexpr int kSP = kTriInStagePitch;
  extern __shared__ __align__(16) unsigned char tri_out_smem[];
  T* const ps = reinterpret_cast<T*>(tri_out_smem);  // [kK, kSP]: p, then n_hat (channel-major)
  T* const wb = ps + Tile::kPElems;                   // [128, kPitch]: w_z
  T* const gs = wb + Tile::kWBuffer;                  // [128, kSP]: g, then out
  const int tiles = int((p.M + kTriInRows - 1) / kTriInRows);
  const auto rows_of = [&](int64_t tile) {
    const int64_t m0 = tile * kTriInRows;
    return int(p.M - m0 < kTriInRows ? p.M - m0 : kTriInRows);
  };
  // p tile: channel rows, 16 bytes along positions (plain loads where rows are unaligned)
  const auto load_p = [&](int64_t tile, unsigned tid) {
    constexpr int kSpans = kTriInRows / 8;
    const int64_t m0 = tile * kTriInRows;
    const int valid_rows = rows_of(tile);
    const int col = int(tid % unsigned(kSpans)) * 8, c0 = int(tid / unsigned(kSpans));
    const T* const src0 = static_cast<const T*>(p.p) + m0 + col;
#pragma unroll
    for (int c = c0; c < Tile::kK; c += kTriInThreads / kSpans) {
      const bool ok = (kWhole || c < p.C) && col < valid_rows;
      T* dst = ps + c * kSP + col;
      if (kWhole || p.vector_ok) {
        cp_async_16(dst, ok ? src0 + int64_t(c) * p.M : src0, ok);
      } else {
        for (int e = 0; e < 8; ++e) dst[e] = ok && col + e < valid_rows ? src0[int64_t(c) * p.M + e] : T(0.f);
      }
    }
  };
  const auto load_g = [&](int64_t tile, unsigned tid) {
    load_tile_async<T, kTriInRows, kTriInPassCols, kSP, kTriInThreads>(
        gs, static_cast<const T*>(p.g) + tile * kTriInRows * p.G, p.G, rows_of(tile), p.G, tid);
  };

  // The CTA's tiles blockIdx.x, + gridDim.x, ...: w_z once (group 0), the first tile's p and g (groups
  // 1, 2); every later tile's p is copied while the previous tile's epilogue runs, its g once that
  // tile's out has left the g buffer (one group each, committed also when empty, so that the waits
  // below always count the same).
  load_tile_async<T, kTriInPassCols, Tile::kK, Tile::kPitch, kTriInThreads>(wb, static_cast<const T*>(p.w_z), p.C,
                                                                            p.G, p.C, threadIdx.x);
  cp_async_commit();
  load_p(blockIdx.x, threadIdx.x);
  cp_async_commit();
  load_g(blockIdx.x, threadIdx.x);
  cp_async_commit();
  for (int tile = int(blockIdx.x); tile < tiles; tile += int(gridDim.x)) {
    // the thread index read afresh per tile (volatile): what derives from it is not kept across the loop
    const unsigned tid = fresh_thread_index();
    const int64_t m0 = int64_t(tile) * kTriInRows;
    const int next = tile + int(gridDim.x);
    const int valid_rows = rows_of(tile);
    cp_async_wait<1>();  // w_z and this tile's p (its g may still be in flight)
    __syncthreads();
    // Layer norm over the channels of each position, from registers: a thread holds four consecutive
    // positions of every eighth channel (group cg = lane % 8: channels cg, cg + 8, ...), read and
    // written back 8 bytes at a time (lanes ordered so that a half-warp's reads cover the 32 banks
    // once); the eight groups of a position are lanes of one warp, so its sums meet by shuffles. Two
    // passes over the registers (mean, then the centred squares), one over shared memory.
    {
      constexpr int kGroups = 8, kPerThread = Tile::kK / kGroups;
      static_assert(kTriInThreads / 32 * (32 / kGroups) * 4 == kTriInRows, "a warp covers 16 positions x 8 groups");
      const int lane = int(tid % 32u), cg = lane % kGroups;
      const int pos0 = (int(tid / 32u) * (32 / kGroups) + lane / kGroups) * 4;
      uint2 v[kPerThread];  // channel cg + 8 j at positions pos0 .. pos0 + 3 (zeros past C)
      float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        v[j] = *reinterpret_cast<const uint2*>(ps + (cg + kGroups * j) * kSP + pos0);
        const float2 lo = unpack2<T>(v[j].x), hi = unpack2<T>(v[j].y);
        sum[0] += lo.x, sum[1] += lo.y, sum[2] += hi.x, sum[3] += hi.y;
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) sum[k] = segment_sum(sum[k], kGroups);
      float mean[4], sq[4] = {0.f, 0.f, 0.f, 0.f};
      const float inv_c = 1.f / float(p.C);
#pragma unroll
      for (int k = 0; k < 4; ++k) mean[k] = sum[k] * inv_c;
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        if (!kWhole && cg + kGroups * j >= p.C) continue;
        const float2 lo = unpack2<T>(v[j].x), hi = unpack2<T>(v[j].y);
        const float x[4] = {lo.x - mean[0], lo.y - mean[1], hi.x - mean[2], hi.y - mean[3]};
#pragma unroll
        for (int k = 0; k < 4; ++k) sq[k] = fmaf(x[k], x[k], sq[k]);
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) sq[k] = segment_sum(sq[k], kGroups);
      float rstd[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) rstd[k] = rsqrtf(sq[k] * inv_c + p.eps);
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        if (!kWhole && cg + kGroups * j >= p.C) continue;
        const float2 lo = unpack2<T>(v[j].x), hi = unpack2<T>(v[j].y);
        const uint2 out{pack2<T>((lo.x - mean[0]) * rstd[0], (lo.y - mean[1]) * rstd[1]),
                        pack2<T>((hi.x - mean[2]) * rstd[2], (hi.y - mean[3]) * rstd[3])};
        *reinterpret_cast<uint2*>(ps + (cg + kGroups * j) * kSP + pos0) = out;
      }
#pragma unroll
      for (int k = 0; k < 4; ++k)  // lanes cg = 0 .. 3 write the statistics of positions pos0 + cg
        if (cg == k && pos0 + k < valid_rows) p.rstd[m0 + pos0 + k] = rstd[k];
    }
    cp_async_wait<0>();
    __syncthreads();  // the normalised tile, w_z and g are in

    // y = n_hat . w_z^T: A from the channel-major tile (transposing ldmatrix), B from w_z rows. The A
    // fragments are n_hat's rows [position, C] as stored: each register holds two channels of one
    // position, so they go to HBM from there as 4-byte stores (the warps of column half h take the
    // k-steps of parity h; a k-step's two stores per position fill a 32-byte sector).
    const int warp = tid / 32u, lane = tid % 32u;
    const int g = lane / 4, t = lane % 4;
    const int row_group = warp % 4, col_half = warp / 4;
    float acc[2][8][4];
    const int mat = lane / 8;
    T* const n_hat = static_cast<T*>(p.n_hat);
    triangle_pass_products<T, kKSteps>(
        acc,
        [&](int kk, uint32_t(&af)[2][kARegs<T>]) {
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            ldsm_x4_trans(ps + (kk * 16 + (mat / 2) * 8 + lane % 8) * kSP + row_group * 32 + mt * 16 + (mat % 2) * 8,
                          af[mt][0], af[mt][1], af[mt][2], af[mt][3]);
            if (kk % 2 != col_half) continue;
#pragma unroll
            for (int i = 0; i < 4; ++i) {  // register i: position g + 8 (i % 2), channels 2t (+ 8 for i >= 2)
              const int r = row_group * 32 + mt * 16 + g + 8 * (i % 2), c = kk * 16 + 8 * (i / 2) + 2 * t;
              if (n_hat != nullptr && r < valid_rows && (kWhole || c < p.C))
                *reinterpret_cast<uint32_t*>(n_hat + (m0 + r) * p.C + c) = af[mt][i];
            }
          }
        },
        wb, col_half, lane);

    __syncthreads();  // every warp's products have read the p tile: it takes the next tile's p
    if (next < tiles) load_p(next, tid);
    cp_async_commit();

    // out = sigmoid(g) * y over the g tile (each value rewritten by the thread that reads it), y rounded
    // to T as the backward recomputes it
    add_column_bias<T, true, kWhole>(acc, static_cast<const T*>(p.b_z), 0, p.G, col_half, t);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int n = col_half * 64 + nt * 8 + 2 * t;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = row_group * 32 + mt * 16 + g + 8 * hh;
          T* const gp = gs + r * kSP + n;
          const float2 gv = unpack2<T>(*reinterpret_cast<const uint32_t*>(gp));  // (one 4-byte load)
          store2<T>(gp, sigmoid_gated<T>(gv.x, acc[mt][nt][2 * hh]),
                    sigmoid_gated<T>(gv.y, acc[mt][nt][2 * hh + 1]));
        }
    }
    __syncthreads();
    // out rows [position, G] (G a multiple of 8: whole 16-byte spans)
    {
      constexpr int kSpans = kTriInPassCols / 8;
      const int col = int(tid % unsigned(kSpans)) * 8, r0 = int(tid / unsigned(kSpans));
      if (kWhole || col < p.G) {
#pragma unroll
        for (int r = r0; r < kTriInRows; r += kTriInThreads / kSpans) {
          if (r >= valid_rows) break;
          const int64_t at = (m0 + r) * p.G + col;
          uint4 piece = *reinterpret_cast<const uint4*>(gs + r * kSP + col);
          if (p.residual != nullptr) {  // the block's residual add (and its dropout's scale) on the way out
            const T* scale = nullptr;
            if (p.scale != nullptr) {
              const int64_t m = m0 + r, j = m % p.n_res, b = m / (p.n_res * p.n_res);
              scale = static_cast<const T*>(p.scale) + (b * p.n_res + j) * p.G + col;
            }
            piece = add_to_residual<T>(piece, static_cast<const T*>(p.residual) + at, scale);
          }
          *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + at) = piece;
        }
      }
    }
    __syncthreads();  // out has left the g buffer: it takes the next tile's g
    if (next < tiles) load_g(next, tid);
    cp_async_commit();
  }
}

// The output half's backward in one kernel. With y = n_hat . w_z^T + b_z recomputed on the tensor
// cores (rounded to T, as the forward's out used it) and s = sigmoid(g):
//
//   dy = dout * s    dg = dout * y * s * (1 - s)                       [M, G], written row-major
//                                                                       (dg's rows dg_ld apart)
//   dn_hat = dy . w_z                                                   [M, C], in registers only
//   dp[c, m] = rstd[m] * (dn_hat - mean_c(dn_hat) - n_hat * mean_c(dn_hat * n_hat))   channel-major
//
// plus per-CTA column sums of dy and dg as stored (the biases' gradients, added in CTA order by the
// last CTAs). In HBM this reads n_hat, g and dout once and writes dg, dy and dp once; it replaces
// y's GEMM, the gate backward kernel, dn_hat's GEMM and the channel layer norm's backward (which
// wrote y, dn_hat and read them back). The weights' gradients (dy^T n_hat, dg^T x_hat) and dx_hat's
// first term (dg w_g) stay cuBLAS GEMMs on the host, which takes the latter two together with the
// first channel group's edge terms (dg's rows are the first G columns of [dg | dab]).
//
// CTA: 256 threads, 128 positions, three [128, kTriInStagePitch] buffers (two CTAs per SM):
//   A: n_hat (first product's A operand) -> g, rewritten in place as dg -> n_hat again (reloaded
//      from L2 while the second product runs)
//   W: w_z (first product's B read n-major, the second's k-major: ldmatrix.trans) -> dp staged
//      channel-major
//   D: dout, rewritten in place as dy (second product's A operand)
// The products use triangle_pass_products' warp layout (4 row groups of 32 x 2 column halves of
// 64); every elementwise value is rewritten by the thread that read it, so the only barriers are
// those between the buffers' roles.
template <typename T, int kKSteps>
__global__ void __launch_bounds__(kTriInThreads, 2)
    triangle_output_backward_kernel(TriangleOutputBackwardParams p) {
  using Tile = TriangleInputTile<kKSteps>;
  constexpr int kP = Tile::kPitch, kSP = kTriInStagePitch, kBuf = kTriInRows * kSP;
  static_assert(kP <= kSP, "an operand tile fits a buffer's rows");
  extern __shared__ __align__(16) unsigned char tri_out_bwd_smem[];
  T* const as = reinterpret_cast<T*>(tri_out_bwd_smem);  // [128, kP]: n_hat, g -> dg, n_hat
  T* const ws = as + kBuf;                                 // [128, kP]: w_z, w_z^T; [C, kSP]: dp
  T* const ds = ws + kBuf;                                 // [128, kP]: dout -> dy
  float* const red = reinterpret_cast<float*>(ds + kBuf);  // [8][128]: column sums, then row sums
  const int64_t m0 = int64_t(blockIdx.x) * kTriInRows;
  const int valid_rows = int(p.M - m0 < kTriInRows ? p.M - m0 : kTriInRows);
  const T* const n_hat = static_cast<const T*>(p.n_hat) + m0 * p.C;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int row_group = warp % 4, col_half = warp / 4;

  // n_hat and w_z (group 0), dout (group 1); rows and columns past the valid ones are zeros
  load_tile_async<T, kTriInRows, Tile::kK, kP, kTriInThreads>(as, n_hat, p.C, valid_rows, p.C, tid);
  load_tile_async<T, kTriInPassCols, Tile::kK, kP, kTriInThreads>(ws, static_cast<const T*>(p.w_z), p.C, p.G, p.C,
                                                                  tid);
  cp_async_commit();
  load_tile_async<T, kTriInRows, Tile::kK, kP, kTriInThreads>(ds, static_cast<const T*>(p.dout) + m0 * p.G, p.G,
                                                              valid_rows, p.G, tid);
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();

  float acc[2][8][4];
  triangle_input_pass_products<T, kKSteps>(acc, as, ws, row_group, col_half, lane);  // n_hat . w_z^T
  __syncthreads();  // every warp is done with n_hat and w_z

  // g over n_hat (group 2), while y is finished in registers
  load_tile_async<T, kTriInRows, Tile::kK, kP, kTriInThreads>(as, static_cast<const T*>(p.g) + m0 * p.G, p.G,
                                                              valid_rows, p.G, tid);
  cp_async_commit();
  add_column_bias<T, true>(acc, static_cast<const T*>(p.b_z), 0, p.G, col_half, t);  // y
  cp_async_wait<0>();
  __syncthreads();  // g and dout are in

  // dy over dout, dg over g (rows past the valid ones: dout = g = 0, so dy = dg = 0), and this CTA's
  // column sums of both as stored: a thread's four rows, the eight lanes g of its columns (a
  // reduce-scatter per pair of tiles nt), then the four row groups in order through `red` [row
  // group][dy, dg][128 columns]
#pragma unroll
  for (int pair = 0; pair < 4; ++pair) {
    float col_sums[8] = {};  // [dy, dg][nt of the pair][e]: the thread's rows of column n + e
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int nt = 2 * pair + u, n = col_half * 64 + nt * 8 + 2 * t;
      if (n >= p.G) continue;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = row_group * 32 + mt * 16 + g + 8 * hh;
          uint32_t* const gp = reinterpret_cast<uint32_t*>(as + r * kP + n);
          uint32_t* const dp_ = reinterpret_cast<uint32_t*>(ds + r * kP + n);
          const float2 gv = unpack2<T>(*gp), dv = unpack2<T>(*dp_);
          float dy[2], dg[2];
          sigmoid_gated_backward<T>(dv.x, gv.x, acc[mt][nt][2 * hh], dy[0], dg[0]);
          sigmoid_gated_backward<T>(dv.y, gv.y, acc[mt][nt][2 * hh + 1], dy[1], dg[1]);
          const uint32_t packed_dy = pack2<T>(dy[0], dy[1]), packed_dg = pack2<T>(dg[0], dg[1]);
          *dp_ = packed_dy;
          *gp = packed_dg;
          const float2 rdy = unpack2<T>(packed_dy), rdg = unpack2<T>(packed_dg);  // as stored
          col_sums[2 * u] += rdy.x, col_sums[2 * u + 1] += rdy.y, col_sums[4 + 2 * u] += rdg.x;
          col_sums[4 + 2 * u + 1] += rdg.y;
        }
    }
    // lane g ends with kind g / 4 (dy, dg), tile 2 pair + g % 4 / 2, e = g % 2 (past G: zeros, not read)
    sum_rows_scattered(col_sums, lane);
    red[(2 * row_group + g / 4) * kTriInRows + col_half * 64 + (2 * pair + g % 4 / 2) * 8 + 2 * t + g % 2] =
        col_sums[0];
  }
  __syncthreads();
  {
    const int col = tid % kTriInRows, which = tid / kTriInRows;  // which: dy (threads 0-127), dg
    if (col < p.G) {
      float total = 0.f;
#pragma unroll
      for (int rg = 0; rg < 4; ++rg) total += red[(2 * rg + which) * kTriInRows + col];
      (which == 0 ? p.dy_part : p.dg_part)[int64_t(blockIdx.x) * p.G + col] = total;
    }
  }
  // dy and dg rows [position, G] (G a multiple of 8: whole 16-byte spans)
  {
    const int spans = p.G / 8;
    for (int i = tid; i < valid_rows * spans; i += kTriInThreads) {
      const int r = i / spans, c = (i - r * spans) * 8;
      *reinterpret_cast<uint4*>(static_cast<T*>(p.dy) + (m0 + r) * p.G + c) =
          *reinterpret_cast<const uint4*>(ds + r * kP + c);
      *reinterpret_cast<uint4*>(static_cast<T*>(p.dg) + (m0 + r) * p.dg_ld + c) =
          *reinterpret_cast<const uint4*>(as + r * kP + c);
    }
  }
  __syncthreads();  // dg is out: its buffer takes n_hat again

  load_tile_async<T, kTriInRows, Tile::kK, kP, kTriInThreads>(as, n_hat, p.C, valid_rows, p.C, tid);
  cp_async_commit();
  float rstd[2][2];  // the layer norm's of the thread's rows (mt, hh), read while the product runs
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = row_group * 32 + mt * 16 + g + 8 * hh;
      rstd[mt][hh] = r < valid_rows ? p.rstd[m0 + r] : 0.f;
    }
  triangle_input_pass_products<T, kKSteps, true>(acc, ds, ws, row_group, col_half, lane);  // dn_hat = dy . w_z
  cp_async_wait<0>();
  __syncthreads();  // n_hat is in; every warp is done with w_z (the buffer takes dp)

  // per position: sums over the channels of dn_hat and dn_hat * n_hat (the thread's channels, then
  // the quad, then the two column halves in order)
  float sums[3][2][2];  // [mean of dn_hat, of dn_hat * n_hat, rstd][mt][hh], the means times rstd
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = row_group * 32 + mt * 16 + g + 8 * hh;
      float s_d = 0.f, s_dx = 0.f;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int n = col_half * 64 + nt * 8 + 2 * t;
        if (n >= p.C) continue;  // C is even: n + 1 < C too
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float d = acc[mt][nt][2 * hh + e];
          s_d += d;
          s_dx = fmaf(d, float(as[r * kP + n + e]), s_dx);
        }
      }
#pragma unroll
      for (int off = 1; off < 4; off *= 2) {
        s_d += __shfl_xor_sync(0xffffffffu, s_d, off);
        s_dx += __shfl_xor_sync(0xffffffffu, s_dx, off);
      }
      if (t == 0) red[(0 * 2 + col_half) * kTriInRows + r] = s_d, red[(1 * 2 + col_half) * kTriInRows + r] = s_dx;
    }
  __syncthreads();
  const float inv_c = 1.f / float(p.C);
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = row_group * 32 + mt * 16 + g + 8 * hh;
      // scaled by rstd: dp = rstd * dn_hat - sums[0] - n_hat * sums[1]
#pragma unroll
      for (int k = 0; k < 2; ++k)
        sums[k][mt][hh] =
            rstd[mt][hh] * (red[(2 * k) * kTriInRows + r] + red[(2 * k + 1) * kTriInRows + r]) * inv_c;
      sums[2][mt][hh] = rstd[mt][hh];
    }
  // dp staged channel-major [C, kSP] in the weight buffer
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const int n = col_half * 64 + nt * 8 + 2 * t;
    if (n >= p.C) continue;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = row_group * 32 + mt * 16 + g + 8 * hh;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float x = float(as[r * kP + n + e]);
          ws[(n + e) * kSP + r] =
              T(fmaf(sums[2][mt][hh], acc[mt][nt][2 * hh + e], -fmaf(x, sums[1][mt][hh], sums[0][mt][hh])));
        }
      }
  }
  __syncthreads();
  // dp channel rows: 8 positions per 16-byte store
  {
    constexpr int kSpans = kTriInRows / 8;
    const int col = (tid % kSpans) * 8, c0 = tid / kSpans;
    if (col < valid_rows) {
      for (int c = c0; c < p.C; c += kTriInThreads / kSpans) {
        const T* const src = ws + c * kSP + col;
        T* const dst = static_cast<T*>(p.dp) + int64_t(c) * p.M + m0 + col;
        if (p.vector_ok) {
          *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
          for (int e = 0; e < 8 && col + e < valid_rows; ++e) dst[e] = src[e];
        }
      }
    }
  }
  float* const part[2] = {p.dy_part, p.dg_part};
  if (p.totals.tickets != nullptr) add_partials_in_last_cta<2>(p.totals, part, p.G, p.G);
}

// Dynamic shared memory of triangle_output_backward_kernel: three buffers and the sums (8 x 128 floats:
// the column sums' [4 row groups][2], then the layer norm's [2][2 column halves]).
template <typename T>
constexpr int triangle_output_backward_smem_bytes() {
  return 3 * kTriInRows * kTriInStagePitch * int(sizeof(T)) + 8 * kTriInRows * int(sizeof(float));
}


}  // namespace block
}  // namespace evoformer
