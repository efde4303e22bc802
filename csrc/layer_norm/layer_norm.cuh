// Layer-norm kernels of the block ops: normalisation over the channels of [M, C] rows (row-major,
// the layout of every Evoformer activation) and over the channels of a channel-major [C, M] tensor
// (the layout the triangle product leaves), forward and backward.
//
// Statistics are float32 in two passes over registers (mean, then the mean squared deviation), so
// large offsets cost no precision. Backward: dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) with
// g = dy * weight; the weight and bias gradients are per-CTA float32 partials [n_ctas, 2, C] that the
// grid's last CTAs add in a fixed order (atomic tickets only: bitwise reproducible). Weight and bias
// are read in their own dtype (ParamTensor).
#pragma once

#include "common/row_kernels.cuh"
#include "layer_norm/layer_norm.h"

namespace evoformer {
namespace block {

// The thread's columns of an affine parameter [C] as float (`absent` where it is not given or past C).
template <typename T, int kChunks>
__device__ __forceinline__ void load_affine(const RowNormThread<T, kChunks>& th, const ParamTensor& t, float absent,
                                            int C, float (&out)[kChunks][Vec<T>::kSize]) {
#pragma unroll
  for (int c = 0; c < kChunks; ++c)
#pragma unroll
    for (int i = 0; i < Vec<T>::kSize; ++i)
      out[c][i] = t.ptr != nullptr && th.valid(c, C) ? param_load(t, th.col(c) + i) : absent;
}

// A residual's scale as the row kernels read it (add_layer_norm's residual_scale; RowNormParams and
// RowNormBackwardParams, read from the kernel parameters where needed): nothing, one value per row,
// or a row of C values per row, rows located by p.scale_rows. load(p, row) fetches a row's values
// into registers; values(p, c) unpacks chunk c of the last row loaded (1 where there is no scale,
// so that r * values is r exactly).
template <typename T, int kChunks>
struct ResidualScale {
  float row_value = 1.f;
  RowChunks<kChunks> chunks;

  template <typename Params>
  __device__ __forceinline__ void load(const RowNormThread<T, kChunks>& th, const Params& p, int64_t row) {
    if (p.residual_scale == nullptr || row >= p.M) return;
    const T* src = static_cast<const T*>(p.residual_scale) + p.scale_rows.small(row);  // (M < 2^31: the host)
    if (p.scale_per_row) row_value = float(*src);
    else chunks.load_row(th, src, p.C);
  }
  template <typename Params>
  __device__ __forceinline__ Vec<T> values(const Params& p, int c) const {
    Vec<T> v;
    if (p.residual_scale != nullptr && !p.scale_per_row) {
      v.unpack(chunks.raw[c]);
    } else {
#pragma unroll
      for (int i = 0; i < Vec<T>::kSize; ++i) v.v[i] = row_value;
    }
    return v;
  }
};

// Forward: y = (x - mean) * rstd (* weight + bias when given); mean and rstd per row (float32).
// x, y: [M, C] with rows x_stride / y_stride elements apart (16-byte aligned); weight, bias: [C]
// or absent. With p.residual, x + residual (rounded to T, as a PyTorch add would) is written to
// p.sum and normalised instead of x; with p.residual_scale as well, x + residual * scale (the
// product rounded to T first, and never contracted into an FMA with the add: float32 sums are those
// of a PyTorch multiply and add, bit for bit). Each thread loads its chunks of the next row group's x (and
// residual, and scale) before it reduces and stores the current group's, so that two rows per thread
// are in flight: one row per warp at a time left the kernel waiting on DRAM latency.
//
// With p.residual_bias (kBiased), the residual is the update before its projection's bias: x +
// (residual + bias) (* scale), the biased update rounded to T first as a PyTorch add would round it.
//
// kScaled: the instantiation that reads p.residual_scale. Its registers (the scale's chunks loaded
// ahead, the row map) would take the plain one past 64 per thread at one chunk per lane, i.e. below
// the four CTAs per SM its grid is sized for (measured: the block's ten layer norms 0.80 -> 0.92 ms
// on an H100), so the scale has an instantiation of its own, launched three CTAs per SM; so has the
// bias (kBiased: its values held in registers, read once), launched as the scaled one.
template <typename T, int kChunks, bool kScaled, bool kBiased>
__global__ void __launch_bounds__(kBlockOpThreads, kChunks == 1 ? (kScaled || kBiased ? kRowNormScaledCtasPerSm : kRowNormCtasPerSm) : 1)
    layer_norm_rows_kernel(RowNormParams p) {
  using Th = RowNormThread<T, kChunks>;
  const int lanes = row_lanes<kChunks>(p.row_threads);
  RowSlots<T, kChunks> rs(lanes);
  Th& th = rs.th;
  const int rows_per_cta = rs.rows_per_cta, slot = rs.slot;
  const float inv_c = 1.f / float(p.C);
  const bool add = p.residual != nullptr;
  float weight[kChunks][Th::kVec], bias[kChunks][Th::kVec];  // of the thread's columns, read once
  load_affine(th, p.weight, 1.f, p.C, weight);
  load_affine(th, p.bias, 0.f, p.C, bias);
  float residual_bias[kBiased ? kChunks : 1][Th::kVec];  // (kBiased) the update's bias, read once
  if constexpr (kBiased) load_affine(th, p.residual_bias, 0.f, p.C, residual_bias);
  RowChunks<kChunks> next_x, next_r;  // the next row group's chunks, in flight
  ResidualScale<T, kChunks> next_s;  // and its scale (kScaled)
  next_x.load(th, p.x, p.x_stride, rs.first_row(), p.M, p.C);
  if (add) next_r.load(th, p.residual, p.residual_stride, rs.first_row(), p.M, p.C);
  if constexpr (kScaled) next_s.load(th, p, rs.first_row());
  for (int64_t group = blockIdx.x; group * rows_per_cta < p.M; group += gridDim.x) {  // uniform per CTA
    const int64_t row = group * rows_per_cta + slot;
    const bool row_ok = row < p.M;
    // this group's chunks out of the prefetch registers, then the next group's loads
    Vec<T> r[kChunks];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      th.x[c].unpack(next_x.raw[c]);
      if (add) r[c].unpack(next_r.raw[c]);
      if constexpr (kBiased) {
#pragma unroll
        for (int i = 0; i < Th::kVec; ++i) r[c].v[i] = round_to<T>(r[c].v[i] + residual_bias[c][i]);
      }
      if constexpr (kScaled) {
        const Vec<T> s = next_s.values(p, c);
#pragma unroll
        for (int i = 0; i < Th::kVec; ++i) r[c].v[i] = round_to<T>(__fmul_rn(r[c].v[i], s.v[i]));
      }
    }
    next_x.load(th, p.x, p.x_stride, row + rs.row_step(), p.M, p.C);
    if (add) next_r.load(th, p.residual, p.residual_stride, row + rs.row_step(), p.M, p.C);
    if constexpr (kScaled) next_s.load(th, p, row + rs.row_step());
    float sum = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if (row_ok && th.valid(c, p.C)) {
        if (add) {
#pragma unroll
          for (int i = 0; i < Th::kVec; ++i) th.x[c].v[i] = round_to<T>(th.x[c].v[i] + r[c].v[i]);
          th.x[c].store(static_cast<T*>(p.sum) + row * p.sum_stride + th.col(c));
        }
#pragma unroll
        for (int i = 0; i < Th::kVec; ++i) sum += th.x[c].v[i];
      }
    }
    const float mean = segment_sum(sum, lanes) * inv_c;
    float sq = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
      if (row_ok && th.valid(c, p.C)) {
#pragma unroll
        for (int i = 0; i < Th::kVec; ++i) {
          const float d = th.x[c].v[i] - mean;
          sq = fmaf(d, d, sq);
        }
      }
    const float rstd = rsqrtf(segment_sum(sq, lanes) * inv_c + p.eps);
    if (!row_ok) continue;
    T* y = static_cast<T*>(p.y) + row * p.y_stride;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if (!th.valid(c, p.C)) continue;
      Vec<T> out;
      const int col = th.col(c);
#pragma unroll
      for (int i = 0; i < Th::kVec; ++i) out.v[i] = fmaf((th.x[c].v[i] - mean) * rstd, weight[c][i], bias[c][i]);
      out.store(y + col);
    }
    if (th.sub == 0) {
      p.mean[row] = mean;
      p.rstd[row] = rstd;
    }
  }
}

// Backward: dx from dy, x, the saved mean / rstd and the weight (plus p.dsum where given: the
// gradient that reaches x by another path, added before the one rounding); with want_affine_grad, each CTA
// writes its partial sums of dy * x_hat and dy over its rows into affine_part [gridDim.x, 2, C]
// (float32). With p.dresidual, dx * residual_scale (dx rounded first) is written there too: the
// gradient of a scaled residual (add_layer_norm's). The next row group's x and dy are loaded ahead,
// as in the forward.
// With p.bias_part (kBiasGrad), each CTA also writes its column sums of the residual's gradient (as
// stored: dresidual with a scale, else dx) there: the gradient of add_layer_norm's residual_bias.
// One chunk per lane (rows up to 256 half-precision values, AF2's widths): registers capped for the
// CTAs per SM the host sizes its grid for (kRowNormBackwardCtasPerSm). kScaled: the instantiation
// that writes p.dresidual (the scale's registers made the plain one spill at four chunks per lane);
// kBiasGrad the one with the third sum.
template <typename T, int kChunks, bool kScaled, bool kBiasGrad>
__global__ void __launch_bounds__(kBlockOpThreads, kChunks == 1 ? kRowNormBackwardCtasPerSm : 1)
    layer_norm_rows_backward_kernel(RowNormBackwardParams p) {
  using Th = RowNormThread<T, kChunks>;
  constexpr int kVec = Th::kVec;
  constexpr int kParts = norm_backward_parts(kBiasGrad);
  extern __shared__ float partial_smem[];  // [rows_per_cta][kParts][C] when a column sum is wanted
  const int lanes = row_lanes<kChunks>(p.row_threads);
  RowSlots<T, kChunks> rs(lanes);
  Th& th = rs.th;
  const int rows_per_cta = rs.rows_per_cta, slot = rs.slot;
  const float inv_c = 1.f / float(p.C);
  // over the thread's rows: dy * x_hat (the weight's gradient), dy (the bias's), with kBiasGrad the
  // residual's gradient (the residual bias's)
  float sums[kParts][kChunks][kVec];
  float (&dw)[kChunks][kVec] = sums[kWeightPart];
  float (&db)[kChunks][kVec] = sums[kBiasPart];
#pragma unroll
  for (int k = 0; k < kParts; ++k)
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
#pragma unroll
      for (int i = 0; i < kVec; ++i) sums[k][c][i] = 0.f;

  const bool has_dsum = p.dsum != nullptr;
  float weight[kChunks][kVec];  // of the thread's columns, read once
  load_affine(th, p.weight, 1.f, p.C, weight);
  RowChunks<kChunks> next_x, next_dy;  // the next row group's chunks, in flight
  next_x.load(th, p.x, p.x_stride, rs.first_row(), p.M, p.C);
  next_dy.load(th, p.dy, p.dy_stride, rs.first_row(), p.M, p.C);
  for (int64_t group = blockIdx.x; group * rows_per_cta < p.M; group += gridDim.x) {  // uniform per CTA
    const int64_t row = group * rows_per_cta + slot;
    const bool row_ok = row < p.M;
    const float mean = row_ok ? p.mean[row] : 0.f, rstd = row_ok ? p.rstd[row] : 0.f;
    // this group's chunks out of the prefetch registers, then the next group's loads
    Vec<T> g[kChunks];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) th.x[c].unpack(next_x.raw[c]), g[c].unpack(next_dy.raw[c]);
    RowChunks<kChunks> dsum;  // this group's, used last (in flight during the reductions)
    if (has_dsum) dsum.load(th, p.dsum, p.dsum_stride, row, p.M, p.C);
    ResidualScale<T, kChunks> scale;  // this group's, used last
    if constexpr (kScaled) scale.load(th, p, row);
    next_x.load(th, p.x, p.x_stride, row + rs.row_step(), p.M, p.C);
    next_dy.load(th, p.dy, p.dy_stride, row + rs.row_step(), p.M, p.C);
    float sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if (row_ok && th.valid(c, p.C)) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const float xh = (th.x[c].v[i] - mean) * rstd;
          th.x[c].v[i] = xh;
          dw[c][i] = fmaf(g[c].v[i], xh, dw[c][i]);
          db[c][i] += g[c].v[i];
          g[c].v[i] *= weight[c][i];
          sum_g += g[c].v[i];
          sum_gx = fmaf(g[c].v[i], xh, sum_gx);
        }
      }
    }
    const float mean_g = segment_sum(sum_g, lanes) * inv_c;
    const float mean_gx = segment_sum(sum_gx, lanes) * inv_c;
    if (!row_ok) continue;
    T* dx = static_cast<T*>(p.dx) + row * p.dx_stride;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if (!th.valid(c, p.C)) continue;
      Vec<T> out;
#pragma unroll
      for (int i = 0; i < kVec; ++i) out.v[i] = rstd * (g[c].v[i] - mean_g - th.x[c].v[i] * mean_gx);
      if (has_dsum) {
        Vec<T> d;
        d.unpack(dsum.raw[c]);
#pragma unroll
        for (int i = 0; i < kVec; ++i) out.v[i] += d.v[i];
      }
      out.store(dx + th.col(c));
      if constexpr (kScaled) {
        const Vec<T> s = scale.values(p, c);
#pragma unroll
        for (int i = 0; i < kVec; ++i) out.v[i] = round_to<T>(out.v[i]) * s.v[i];
        out.store(static_cast<T*>(p.dresidual) + row * p.dresidual_stride + th.col(c));
      }
      if constexpr (kBiasGrad) {  // (the values as stored)
#pragma unroll
        for (int i = 0; i < kVec; ++i) sums[kResidualBiasPart][c][i] += round_to<T>(out.v[i]);
      }
    }
  }
  if (p.affine_part == nullptr && p.bias_part == nullptr) return;
  // rows of [gridDim.x, kParts, C]: dweight, dbias (nullptr where not wanted), with kBiasGrad dresidual_bias
  float* part[kParts];
  part[kWeightPart] = p.affine_part;
  part[kBiasPart] = p.affine_part == nullptr ? nullptr : p.affine_part + p.C;
  if constexpr (kBiasGrad) part[kResidualBiasPart] = p.bias_part;
  store_cta_column_sums<kParts>(th, slot, rows_per_cta, p.C, sums, partial_smem, part, kParts * int64_t(p.C), p.totals);
}

// ---- channel-major layer norm -----------------------------------------------------------------
// x: [C, M] (channel c of position m at c * x_stride + m); y: [M, C] position-major (rows y_stride
// apart), y = (x - mean) * rstd with mean and rstd over the C channels of each position. A CTA
// takes kTilePositions positions: it copies the [C, kTilePositions] slab into shared memory with
// 16-byte loads along positions, computes each position's statistics (kThreads / kTilePositions
// threads per position) and writes [kTilePositions, C] rows with 16-byte stores.
constexpr int kChannelTile = 64;  // positions per CTA

template <typename T>
__global__ void __launch_bounds__(kBlockOpThreads) layer_norm_channels_kernel(ChannelNormParams p) {
  constexpr int kVec = Vec<T>::kSize;
  constexpr int kPitch = kChannelTile + kVec;  // shared row pitch (elements): shifts banks per channel
  constexpr int kPerPos = kBlockOpThreads / kChannelTile;  // threads per position for the statistics
  extern __shared__ __align__(16) char channel_smem[];
  T* tile = reinterpret_cast<T*>(channel_smem);                                        // [C][kPitch]
  float* stats = reinterpret_cast<float*>(channel_smem + p.C * kPitch * int(sizeof(T)));  // [2][kChannelTile]
  const int64_t m0 = int64_t(blockIdx.x) * kChannelTile;
  const int valid = p.M - m0 < kChannelTile ? int(p.M - m0) : kChannelTile;
  const T* x = static_cast<const T*>(p.x);

  // 1. the [C, kChannelTile] slab, 16 bytes per load along positions (scalar at a ragged edge)
  const int chunks = p.C * (kChannelTile / kVec);
  for (int i = threadIdx.x; i < chunks; i += blockDim.x) {
    const int c = i / (kChannelTile / kVec), j = (i % (kChannelTile / kVec)) * kVec;
    const T* src = x + int64_t(c) * p.x_stride + m0 + j;
    T* dst = tile + c * kPitch + j;
    if (p.vector_ok && j + kVec <= valid) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int e = 0; e < kVec; ++e) dst[e] = j + e < valid ? src[e] : T(0.f);
    }
  }
  __syncthreads();

  // 2. statistics: kPerPos threads per position, channels c = part, part + kPerPos, ...
  {
    const int pos = threadIdx.x / kPerPos, part = threadIdx.x % kPerPos;
    float sum = 0.f;
    for (int c = part; c < p.C; c += kPerPos) sum += float(tile[c * kPitch + pos]);
    const float mean = segment_sum(sum, kPerPos) / float(p.C);
    float sq = 0.f;
    for (int c = part; c < p.C; c += kPerPos) {
      const float d = float(tile[c * kPitch + pos]) - mean;
      sq = fmaf(d, d, sq);
    }
    const float rstd = rsqrtf(segment_sum(sq, kPerPos) / float(p.C) + p.eps);
    if (part == 0) {
      stats[pos] = mean;
      stats[kChannelTile + pos] = rstd;
      if (pos < valid) p.mean[m0 + pos] = mean, p.rstd[m0 + pos] = rstd;
    }
  }
  __syncthreads();

  // 3. rows [pos][C], 16 bytes (kVec channels) per store
  const int row_chunks = p.C / kVec;
  for (int i = threadIdx.x; i < valid * row_chunks; i += blockDim.x) {
    const int pos = i / row_chunks, c0 = (i % row_chunks) * kVec;
    const float mean = stats[pos], rstd = stats[kChannelTile + pos];
    Vec<T> out;
#pragma unroll
    for (int e = 0; e < kVec; ++e) out.v[e] = (float(tile[(c0 + e) * kPitch + pos]) - mean) * rstd;
    out.store(static_cast<T*>(p.y) + (m0 + pos) * p.y_stride + c0);
  }
}

// Backward of layer_norm_channels (no affine: folded into the next projection by the caller):
// from dy and x_hat [M, C] position-major (rows 16-byte aligned) and rstd [M], dx [C, M] channel-major:
// dx = rstd * (dy - mean(dy) - x_hat * mean(dy * x_hat)). A CTA computes kChannelTile positions into
// a shared [C, kChannelTile] tile and writes it with 16-byte stores along positions.
template <typename T>
__global__ void __launch_bounds__(kBlockOpThreads) layer_norm_channels_backward_kernel(ChannelNormBackwardParams p) {
  constexpr int kVec = Vec<T>::kSize;
  constexpr int kPitch = kChannelTile + kVec;
  constexpr int kPerPos = kBlockOpThreads / kChannelTile;
  extern __shared__ __align__(16) char channel_smem[];
  T* tile = reinterpret_cast<T*>(channel_smem);  // [C][kPitch]
  const int64_t m0 = int64_t(blockIdx.x) * kChannelTile;
  const int valid = p.M - m0 < kChannelTile ? int(p.M - m0) : kChannelTile;
  // kPerPos threads per position, each taking the 16-byte chunks part, part + kPerPos, ... of its
  // rows of dy and x_hat (read twice: the second pass hits L1)
  const int pos = threadIdx.x / kPerPos, part = threadIdx.x % kPerPos;
  const bool pos_ok = pos < valid;
  const T* dy = static_cast<const T*>(p.dy) + (m0 + pos) * p.dy_stride;
  const T* xh = static_cast<const T*>(p.x_hat) + (m0 + pos) * p.x_hat_stride;
  const int row_chunks = p.C / kVec;
  float sum_g = 0.f, sum_gx = 0.f;
  if (pos_ok)
    for (int k = part; k < row_chunks; k += kPerPos) {
      Vec<T> g, x;
      g.load(dy + k * kVec);
      x.load(xh + k * kVec);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        sum_g += g.v[e];
        sum_gx = fmaf(g.v[e], x.v[e], sum_gx);
      }
    }
  const float mean_g = segment_sum(sum_g, kPerPos) / float(p.C);
  const float mean_gx = segment_sum(sum_gx, kPerPos) / float(p.C);
  const float rstd = pos_ok ? p.rstd[m0 + pos] : 0.f;
  for (int k = part; k < row_chunks; k += kPerPos) {
    Vec<T> g, x;
    if (pos_ok) {
      g.load(dy + k * kVec);
      x.load(xh + k * kVec);
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e)
      tile[(k * kVec + e) * kPitch + pos] = pos_ok ? T(rstd * (g.v[e] - mean_g - x.v[e] * mean_gx)) : T(0.f);
  }
  __syncthreads();
  const int chunks = p.C * (kChannelTile / kVec);
  for (int i = threadIdx.x; i < chunks; i += blockDim.x) {
    const int c = i / (kChannelTile / kVec), j = (i % (kChannelTile / kVec)) * kVec;
    T* dst = static_cast<T*>(p.dx) + int64_t(c) * p.dx_stride + m0 + j;
    const T* src = tile + c * kPitch + j;
    if (p.vector_ok && j + kVec <= valid) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int e = 0; e < kVec && j + e < valid; ++e) dst[e] = src[e];
    }
  }
}

}  // namespace block
}  // namespace evoformer
