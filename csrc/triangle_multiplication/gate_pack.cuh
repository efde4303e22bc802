// The triangle multiplication's edge gates where its fused input kernel does not run, forward and
// backward, 16 bytes per access: projections and gates of the a and b edges (channel-major, from one
// GEMM):
//   ab [4, C, M] = (a_proj, a_gate, b_proj, b_gate) before their biases; bias [4, C] float32;
//   mask [M] (nullptr: all ones)
//   a[c, m] = mask[m] * sigmoid(a_gate[c, m] + bias_ag[c]) * (a_proj[c, m] + bias_ap[c]), b likewise.
#pragma once

#include "common/mma_sm80.cuh"  // sigmoid
#include "common/row_kernels.cuh"
#include "triangle_multiplication/triangle.h"

namespace evoformer {
namespace block {

template <typename T>
__global__ void __launch_bounds__(kBlockOpThreads) gate_pack_kernel(GatePackParams p) {
  constexpr int kVec = Vec<T>::kSize;
  const T* ab = static_cast<const T*>(p.ab);
  const T* mask = static_cast<const T*>(p.mask);
  for_each_span<kVec>(int64_t(2) * p.C, p.M, [&](int64_t r, int64_t m, int n) {
    // r = edge * C + c: edge 0 writes a, 1 writes b
    const int64_t edge = r / p.C, c = r - edge * p.C;
    const T* proj = ab + (2 * edge * p.C + c) * p.ab_stride + m;
    const T* gate = proj + p.C * p.ab_stride;
    Vec<T> vp, vg, vm, out;
    load_span(vp, proj, n, p.vector_ok);
    load_span(vg, gate, n, p.vector_ok);
    if (mask != nullptr) load_span(vm, mask + m, n, p.vector_ok);
    const float bp = p.bias[2 * edge * p.C + c], bg = p.bias[(2 * edge + 1) * p.C + c];
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float v = sigmoid(vg.v[e] + bg) * (vp.v[e] + bp);
      out.v[e] = mask != nullptr ? v * vm.v[e] : v;
    }
    store_span(out, static_cast<T*>(edge == 0 ? p.a : p.b) + c * p.out_stride + m, n, p.vector_ok);
  });
}

// Sum over the CTA's threads, valid in thread 0 (`scratch`: one float per warp).
__device__ __forceinline__ float cta_sum(float x, float* scratch) {
  x = segment_sum(x, 32);
  const int warp = threadIdx.x / 32u, lane = threadIdx.x % 32u;
  __syncthreads();  // scratch may still be read by an earlier cta_sum
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float total = 0.f;
  if (threadIdx.x == 0)
    for (int w = 0; w < int(blockDim.x / 32u); ++w) total += scratch[w];
  return total;
}

// Backward of gate_pack: from da, db [C, M] and the recomputed ab, d(ab) [4, C, M], and the bias
// gradient's partial sums bias_part[4 C, n_chunks], which a row's last CTA adds (p.tickets).
// CTA = (M-chunk blockIdx.x, row blockIdx.y = edge * C + c): it handles the projection and gate
// rows of that edge and channel.
template <typename T>
__global__ void __launch_bounds__(kBlockOpThreads) gate_pack_backward_kernel(GatePackBackwardParams p) {
  constexpr int kVec = Vec<T>::kSize;
  __shared__ float scratch[kBlockOpThreads / 32];
  const T* ab = static_cast<const T*>(p.ab);
  const T* mask = static_cast<const T*>(p.mask);
  const int64_t edge = blockIdx.y / p.C, c = blockIdx.y - edge * p.C;
  const int64_t proj_row = 2 * edge * p.C + c, gate_row = proj_row + p.C;
  const float bp = p.bias[proj_row], bg = p.bias[gate_row];
  const T* proj = ab + proj_row * p.ab_stride;
  const T* gate = ab + gate_row * p.ab_stride;
  const T* dout = static_cast<const T*>(edge == 0 ? p.da : p.db) + c * p.d_stride;
  T* d_proj_out = static_cast<T*>(p.dab) + proj_row * p.dab_stride;
  T* d_gate_out = static_cast<T*>(p.dab) + gate_row * p.dab_stride;
  const int64_t spans = (p.M + kVec - 1) / kVec, per_chunk = (spans + gridDim.x - 1) / gridDim.x;
  const int64_t s_end = min(spans, (blockIdx.x + 1) * per_chunk);
  float sum_proj = 0.f, sum_gate = 0.f;
  for (int64_t s = blockIdx.x * per_chunk + threadIdx.x; s < s_end; s += blockDim.x) {
    const int64_t m = s * kVec;
    const int n = p.M - m < kVec ? int(p.M - m) : kVec;
    Vec<T> vp, vg, vm, vd, d_proj, d_gate;
    load_span(vp, proj + m, n, p.vector_ok);
    load_span(vg, gate + m, n, p.vector_ok);
    load_span(vd, dout + m, n, p.vector_ok);
    if (mask != nullptr) load_span(vm, mask + m, n, p.vector_ok);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float d = mask != nullptr ? vd.v[e] * vm.v[e] : vd.v[e];
      const float sg = sigmoid(vg.v[e] + bg);
      d_proj.v[e] = d * sg;
      d_gate.v[e] = d * (vp.v[e] + bp) * sg * (1.f - sg);
    }
    store_span(d_proj, d_proj_out + m, n, p.vector_ok);
    store_span(d_gate, d_gate_out + m, n, p.vector_ok);
    // the bias gradients sum what was stored (rounded to T), as the GEMMs that follow see it
#pragma unroll
    for (int e = 0; e < kVec; ++e)
      if (e < n) sum_proj += float(T(d_proj.v[e])), sum_gate += float(T(d_gate.v[e]));
  }
  const float total_proj = cta_sum(sum_proj, scratch);
  const float total_gate = cta_sum(sum_gate, scratch);
  if (threadIdx.x == 0) {
    p.bias_part[proj_row * gridDim.x + blockIdx.x] = total_proj;
    p.bias_part[gate_row * gridDim.x + blockIdx.x] = total_gate;
  }
  // the row's last chunk adds the row's partials in chunk order (thread 0: projection, 1: gate)
  if (p.tickets == nullptr || !last_to_arrive(p.tickets + blockIdx.y, gridDim.x) || threadIdx.x >= 2) return;
  const int64_t row = threadIdx.x == 0 ? proj_row : gate_row;
  p.bias_total[(row / p.C) * p.total_stride + row % p.C] =
      add_rows_in_order(p.bias_part + row * gridDim.x, 1, int(gridDim.x));
}

}  // namespace block
}  // namespace evoformer
