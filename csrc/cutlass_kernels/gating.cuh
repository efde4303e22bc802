// Element-wise gating kernels of the block ops, forward and backward, 16 bytes per access.
//
// Triangle multiplication, projections and gates of the a and b edges (channel-major, from one GEMM):
//   ab [4, C, M] = (a_proj, a_gate, b_proj, b_gate) before their biases; bias [4, C] float32;
//   mask [M] (nullptr: all ones)
//   a[c, m] = mask[m] * sigmoid(a_gate[c, m] + bias_ag[c]) * (a_proj[c, m] + bias_ap[c]), b likewise.
// Sigmoid gate of an output: out = sigmoid(g) * y, all [M, C] with the same layout.
#pragma once

#include "layer_norm.cuh"

namespace evoformer {
namespace block {

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }

// Calls fn(row, col, n) for every span of kVec consecutive columns of a [rows, cols] index space
// (n <= kVec of them in range), with a grid stride.
template <int kVec, typename Fn>
__device__ __forceinline__ void for_each_span(int64_t rows, int64_t cols, Fn&& fn) {
  const int64_t per_row = (cols + kVec - 1) / kVec;
  const int64_t total = rows * per_row;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = t / per_row, c = (t - r * per_row) * kVec;
    fn(r, c, cols - c < kVec ? int(cols - c) : kVec);
  }
}

// Loads n <= kVec values (the rest 0), as one vector when n == kVec and `vector_ok`.
template <typename T>
__device__ __forceinline__ void load_span(Vec<T>& v, const T* p, int n, bool vector_ok) {
  if (vector_ok && n == Vec<T>::kSize) {
    v.load(p);
  } else {
#pragma unroll
    for (int e = 0; e < Vec<T>::kSize; ++e) v.v[e] = e < n ? float(p[e]) : 0.f;
  }
}
template <typename T>
__device__ __forceinline__ void store_span(const Vec<T>& v, T* p, int n, bool vector_ok) {
  if (vector_ok && n == Vec<T>::kSize) {
    v.store(p);
  } else {
#pragma unroll
    for (int e = 0; e < Vec<T>::kSize; ++e)
      if (e < n) p[e] = T(v.v[e]);
  }
}

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

// Backward of gate_pack: from da, db [C, M] and the recomputed ab, d(ab) [4, C, M].
template <typename T>
__global__ void __launch_bounds__(kBlockOpThreads) gate_pack_backward_kernel(GatePackBackwardParams p) {
  constexpr int kVec = Vec<T>::kSize;
  const T* ab = static_cast<const T*>(p.ab);
  const T* mask = static_cast<const T*>(p.mask);
  for_each_span<kVec>(int64_t(2) * p.C, p.M, [&](int64_t r, int64_t m, int n) {
    const int64_t edge = r / p.C, c = r - edge * p.C;
    const int64_t proj_row = 2 * edge * p.C + c, gate_row = proj_row + p.C;
    Vec<T> vp, vg, vm, vd, d_proj, d_gate;
    load_span(vp, ab + proj_row * p.ab_stride + m, n, p.vector_ok);
    load_span(vg, ab + gate_row * p.ab_stride + m, n, p.vector_ok);
    load_span(vd, static_cast<const T*>(edge == 0 ? p.da : p.db) + c * p.d_stride + m, n, p.vector_ok);
    if (mask != nullptr) load_span(vm, mask + m, n, p.vector_ok);
    const float bp = p.bias[proj_row], bg = p.bias[gate_row];
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float d = mask != nullptr ? vd.v[e] * vm.v[e] : vd.v[e];
      const float s = sigmoid(vg.v[e] + bg);
      d_proj.v[e] = d * s;
      d_gate.v[e] = d * (vp.v[e] + bp) * s * (1.f - s);
    }
    T* dab = static_cast<T*>(p.dab);
    store_span(d_proj, dab + proj_row * p.dab_stride + m, n, p.vector_ok);
    store_span(d_gate, dab + gate_row * p.dab_stride + m, n, p.vector_ok);
  });
}

// out = sigmoid(g) * y, [M, C] rows (strides of each tensor in elements).
template <typename T>
__global__ void __launch_bounds__(kBlockOpThreads) sigmoid_gate_kernel(SigmoidGateParams p) {
  constexpr int kVec = Vec<T>::kSize;
  for_each_span<kVec>(p.M, p.C, [&](int64_t r, int64_t c, int n) {
    Vec<T> g, y, out;
    load_span(g, static_cast<const T*>(p.g) + r * p.g_stride + c, n, p.vector_ok);
    load_span(y, static_cast<const T*>(p.y) + r * p.y_stride + c, n, p.vector_ok);
#pragma unroll
    for (int e = 0; e < kVec; ++e) out.v[e] = sigmoid(g.v[e]) * y.v[e];
    store_span(out, static_cast<T*>(p.out) + r * p.out_stride + c, n, p.vector_ok);
  });
}

// dy = dout * sigmoid(g), dg = dout * y * sigmoid'(g) (written over the given outputs).
template <typename T>
__global__ void __launch_bounds__(kBlockOpThreads) sigmoid_gate_backward_kernel(SigmoidGateBackwardParams p) {
  constexpr int kVec = Vec<T>::kSize;
  for_each_span<kVec>(p.M, p.C, [&](int64_t r, int64_t c, int n) {
    Vec<T> g, y, d, dg, dy;
    load_span(g, static_cast<const T*>(p.g) + r * p.g_stride + c, n, p.vector_ok);
    load_span(y, static_cast<const T*>(p.y) + r * p.y_stride + c, n, p.vector_ok);
    load_span(d, static_cast<const T*>(p.dout) + r * p.dout_stride + c, n, p.vector_ok);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float s = sigmoid(g.v[e]);
      dy.v[e] = d.v[e] * s;
      dg.v[e] = d.v[e] * y.v[e] * s * (1.f - s);
    }
    store_span(dy, static_cast<T*>(p.dy) + r * p.dy_stride + c, n, p.vector_ok);
    store_span(dg, static_cast<T*>(p.dg) + r * p.dg_stride + c, n, p.vector_ok);
  });
}

}  // namespace block
}  // namespace evoformer
