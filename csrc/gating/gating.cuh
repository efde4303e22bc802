// Gating kernels of the block ops, forward and backward, 16 bytes per access.
//
// Sigmoid gate of an output: out = sigmoid(g) * y, all [M, C] (y may be a permuted view, RowMap);
// its backward can also sum the attention backward's delta (the gated attention).
// Column sums of [M, C] rows (the gradient of a projection's bias), with a ReLU's backward where asked.
// Rows scaled by one value each (a mask or a mean's denominator), with a residual added where given.
#pragma once

#include "common/mma_sm80.cuh"  // sigmoid, to_tf32
#include "common/row_kernels.cuh"
#include "gating/gating.h"

namespace evoformer {
namespace block {

// out = sigmoid(g) * y, [M, C] rows (g and out strided, y's rows where p.y_rows puts them).
template <typename T>
__global__ void __launch_bounds__(kBlockOpThreads) sigmoid_gate_kernel(SigmoidGateParams p) {
  constexpr int kVec = Vec<T>::kSize;
  for_each_span<kVec>(p.M, p.C, [&](int64_t r, int64_t c, int n) {
    Vec<T> g, y, out;
    load_span(g, static_cast<const T*>(p.g) + r * p.g_stride + c, n, p.vector_ok);
    load_span(y, static_cast<const T*>(p.y) + p.y_rows(r) + c, n, p.vector_ok);
#pragma unroll
    for (int e = 0; e < kVec; ++e) out.v[e] = sigmoid(g.v[e]) * y.v[e];
    store_span(out, static_cast<T*>(p.out) + r * p.out_stride + c, n, p.vector_ok);
  });
}

// out = x * s[r], x / s[r] or residual + x * s[r] per row r (RowScaleParams), 16 bytes per access.
template <typename T>
__global__ void __launch_bounds__(kBlockOpThreads) row_scale_kernel(RowScaleParams p) {
  constexpr int kVec = Vec<T>::kSize;
  for_each_span<kVec>(p.M, p.C, [&](int64_t r, int64_t c, int n) {
    Vec<T> x, residual;
    load_span(x, static_cast<const T*>(p.x) + r * p.x_stride + c, n, p.vector_ok);
    const float s = float(static_cast<const T*>(p.s)[r]);
    if (p.residual != nullptr) {
      load_span(residual, static_cast<const T*>(p.residual) + r * p.residual_stride + c, n, p.vector_ok);
#pragma unroll
      for (int e = 0; e < kVec; ++e) x.v[e] = __fmaf_rn(x.v[e], s, residual.v[e]);
    } else if (p.divide) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) x.v[e] = __fdiv_rn(x.v[e], s);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) x.v[e] = __fmul_rn(x.v[e], s);
    }
    store_span(x, static_cast<T*>(p.out) + r * p.out_stride + c, n, p.vector_ok);
  });
}

// The gate backward's share of the attention's delta (SigmoidGateBackwardParams::delta): the dot
// product of this lane's chunk c of row `row`, dy as stored times y, summed over the head's lanes
// (which hold the same chunk of this row: a head is 1 << delta_lanes_log2 aligned lanes), written by
// the head's first lane.
template <typename T, int kChunks>
__device__ __forceinline__ void add_head_delta(const SigmoidGateBackwardParams& p, const RowNormThread<T, kChunks>& th,
                                               int c, int64_t row, const Vec<T>& dy, const Vec<T>& y) {
  float dot = 0.f;
#pragma unroll
  for (int e = 0; e < Vec<T>::kSize; ++e) {
    const float stored = float(T(dy.v[e]));
    if constexpr (std::is_same_v<T, float>) {
      dot = fmaf(__uint_as_float(to_tf32(stored)), y.v[e], dot);  // dO as the TF32 products take it
    } else {
      dot = fmaf(stored, y.v[e], dot);
    }
  }
  const int head_lanes = 1 << p.delta_lanes_log2;
  const unsigned lane = threadIdx.x % 32u, first = lane & ~unsigned(head_lanes - 1);
  const unsigned mask = head_lanes == 32 ? 0xffffffffu : ((1u << head_lanes) - 1u) << first;
  for (int offset = head_lanes / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(mask, dot, offset);
  if (lane != first) return;
  // y's row (b N + n) Lq + i; delta [B, N, H, Lq] at ((b N + n) H + h) Lq + i
  const uint32_t r = uint32_t(p.o_rows.small(row)), i = r % uint32_t(p.delta_len);
  const int head = (th.sub + c * th.row_threads) >> p.delta_lanes_log2;
  p.delta[int64_t(r - i) * p.delta_heads + int64_t(head) * p.delta_len + i] = dot;
}

// dy = dout * sigmoid(g), dg = dout * y * sigmoid'(g), and the per-CTA column sums of both
// (dy_part, dg_part [n_ctas, C] float32, each optional: the gradients of the biases of the
// projections that made y and g). The sums add what was stored (rounded to T), as the GEMMs that
// follow see it. With p.delta, also the attention backward's delta (SigmoidGateBackwardParams):
// each lane's dot product of its chunk, then a shuffle sum over the head's lanes, which hold the
// same chunk of one row (whole heads are valid or not together: C is a whole number of heads).
//
// kDelta: the instantiation that sums delta (p.delta set); its row-to-head arithmetic would cost the
// plain one registers, so it has an instantiation of its own.
template <typename T, int kChunks, bool kDelta>
__global__ void __launch_bounds__(kBlockOpThreads, kChunks == 1 && kDelta ? kGateDeltaCtasPerSm : 0)
    sigmoid_gate_backward_kernel(SigmoidGateBackwardParams p) {
  constexpr int kVec = Vec<T>::kSize;
  extern __shared__ float gate_sums[];  // [rows_per_cta][2][C]
  const RowSlots<T, kChunks> rs(p.row_threads);
  const RowNormThread<T, kChunks>& th = rs.th;
  float sums[2][kChunks][kVec];  // (dy, dg)
#pragma unroll
  for (int c = 0; c < kChunks; ++c)
#pragma unroll
    for (int e = 0; e < kVec; ++e) sums[0][c][e] = 0.f, sums[1][c][e] = 0.f;
  for (int64_t row = rs.first_row(); row < p.M; row += rs.row_step()) {
    const int64_t y_row = p.y_rows(row);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if (!th.valid(c, p.C)) continue;
      const int col = th.col(c);
      Vec<T> g, y, d, dg, dy;
      g.load(static_cast<const T*>(p.g) + row * p.g_stride + col);
      y.load(static_cast<const T*>(p.y) + y_row + col);
      d.load(static_cast<const T*>(p.dout) + row * p.dout_stride + col);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float s = sigmoid(g.v[e]);
        dy.v[e] = d.v[e] * s;
        dg.v[e] = d.v[e] * y.v[e] * s * (1.f - s);
        sums[0][c][e] += float(T(dy.v[e]));
        sums[1][c][e] += float(T(dg.v[e]));
      }
      dy.store(static_cast<T*>(p.dy) + y_row + col);
      dg.store(static_cast<T*>(p.dg) + row * p.dg_stride + col);
      if constexpr (kDelta) add_head_delta(p, th, c, row, dy, y);
    }
  }
  float* const part[2] = {p.dy_part, p.dg_part};
  store_cta_column_sums<2>(th, rs.slot, rs.rows_per_cta, p.C, sums, gate_sums, part, p.C, p.totals);
}

// Adds the rows x (masked by relu_out > 0 and stored to p.masked where kRelu) that this thread's row
// slot visits into sums, in row order, with the next kAhead rows' chunks in flight.
template <int kAhead, bool kRelu, typename T, int kChunks>
__device__ __forceinline__ void add_column_rows(const ColumnSumParams& p, const RowSlots<T, kChunks>& rs,
                                                float (&sums)[1][kChunks][Vec<T>::kSize]) {
  const RowNormThread<T, kChunks>& th = rs.th;
  const int64_t step = rs.row_step();
  RowChunks<kChunks> next_x[kAhead], next_y[kAhead];  // rows row + a * step
#pragma unroll
  for (int a = 0; a < kAhead; ++a) {
    next_x[a].load(th, p.x, p.x_stride, rs.first_row() + a * step, p.M, p.C);
    if constexpr (kRelu) next_y[a].load(th, p.relu_out, p.relu_stride, rs.first_row() + a * step, p.M, p.C);
  }
  for (int64_t first = rs.first_row(); first < p.M; first += kAhead * step) {
#pragma unroll
    for (int a = 0; a < kAhead; ++a) {
      const int64_t row = first + a * step;
      if (row >= p.M) break;
      Vec<T> x[kChunks], y[kChunks];
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        x[c].unpack(next_x[a].raw[c]);
        if constexpr (kRelu) y[c].unpack(next_y[a].raw[c]);
      }
      next_x[a].load(th, p.x, p.x_stride, row + kAhead * step, p.M, p.C);
      if constexpr (kRelu) next_y[a].load(th, p.relu_out, p.relu_stride, row + kAhead * step, p.M, p.C);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        if (!th.valid(c, p.C)) continue;
        if constexpr (kRelu) {  // the ReLU's backward: x where relu_out > 0, else 0
#pragma unroll
          for (int e = 0; e < Vec<T>::kSize; ++e) x[c].v[e] = y[c].v[e] > 0.f ? x[c].v[e] : 0.f;
          x[c].store(static_cast<T*>(p.masked) + row * p.masked_stride + th.col(c));
        }
#pragma unroll
        for (int e = 0; e < Vec<T>::kSize; ++e) sums[0][c][e] += x[c].v[e];
      }
    }
  }
}

// part[blockIdx.x, :] = the sum of x's rows blockIdx.x's row slots visit (see ColumnSumParams; with
// p.relu_out, of x masked by relu_out > 0, which is also written to p.masked). Each thread adds its
// rows in row order while the next ones load: one row ahead with a ReLU (whose masked stores keep
// more in flight, as the row layer norms' stores do), 4 / kChunks rows (64 bytes) ahead without one
// (a pure read with one row per thread in flight: 2.9-3.0 TB/s on 128- and 256-channel rows on an
// H200, 3.3-3.4 with four). The sums do not depend on how far ahead the loads run.
template <typename T, int kChunks>
__global__ void __launch_bounds__(kBlockOpThreads) column_sum_kernel(ColumnSumParams p) {
  extern __shared__ float column_sums[];  // [rows_per_cta][C]
  const RowSlots<T, kChunks> rs(p.row_threads);
  float sums[1][kChunks][Vec<T>::kSize];
#pragma unroll
  for (int c = 0; c < kChunks; ++c)
#pragma unroll
    for (int e = 0; e < Vec<T>::kSize; ++e) sums[0][c][e] = 0.f;
  if (p.relu_out != nullptr) add_column_rows<1, true>(p, rs, sums);
  else add_column_rows<4 / kChunks, false>(p, rs, sums);
  const RowNormThread<T, kChunks>& th = rs.th;
  float* const part[1] = {p.part};
  store_cta_column_sums<1>(th, rs.slot, rs.rows_per_cta, p.C, sums, column_sums, part, p.C, p.totals);
}

}  // namespace block
}  // namespace evoformer
