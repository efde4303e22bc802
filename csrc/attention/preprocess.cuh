// The small passes around the attention kernels, shared by both families, and the readers of what
// they leave: the mask-bias preparation (once per forward: the caller's mask bias into the layout
// every kernel reads), the backward's delta = rowsum(dO * O), and the per-row softmax statistics and
// delta as the backward kernels load them.
#pragma once

#include <cstdint>
#include <type_traits>

#include "attention/evoformer_attention.h"
#include "common/mma_sm80.cuh"

namespace evoformer {

// mask_bias [Bm, Nm, 1, 1, Lk] (any strides) -> float32 [Bm, Nm, Lk_pad] divided by the scale,
// zero past Lk (the prepared mask of evoformer_attention.h), in one launch; one thread per output
// element with a grid stride. T is cutlass::half_t, cutlass::bfloat16_t or float.
template <typename T>
__global__ void prepare_mask_kernel(const T* mask,  // [Bm, Nm, 1, 1, Lk], strides in `layout`
                                    MaskLayout layout, float inv_scale,
                                    float* out,  // [Bm, Nm, Lk_pad] contiguous
                                    int64_t total) {  // Bm * Nm * Lk_pad
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / layout.lk_pad;  // (b, n) flattened
    const int key = int(i - row * layout.lk_pad);
    const int64_t b = row / layout.Nm, n = row - b * layout.Nm;
    out[i] = key < layout.Lk ? float(mask[b * layout.stride_b + n * layout.stride_n + key * layout.stride_k]) * inv_scale
                             : 0.f;
  }
}

// delta [B, N, H, Lq] = rowsum(dout * out) in fp32 (float: dout rounded to TF32, as the backward's
// products take it), one thread per (b, n, i, h) row (h fastest) with
// a grid stride; rows are read 16 bytes at a time (D is a multiple of 8). Element: a 16-bit type or
// float.
template <typename Element>
__global__ void backward_delta_kernel(const AttentionParams p) {
  static_assert(limits::kHeadDimMultiple % 8 == 0, "rows of whole 16-byte chunks");
  const int64_t rows = int64_t(p.B) * p.N * p.Lq * p.H;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < rows; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t h = idx % p.H;
    const int64_t i = (idx / p.H) % p.Lq;
    const int64_t n = (idx / (int64_t(p.H) * p.Lq)) % p.N;
    const int64_t b = idx / (int64_t(p.H) * p.Lq * p.N);
    const Element* o = static_cast<const Element*>(p.out) + p.o_strides.at(b, n, i, h);    // [D]
    const Element* d = static_cast<const Element*>(p.dout) + p.do_strides.at(b, n, i, h);  // [D]
    float acc = 0.f;
    for (int c = 0; c < p.D; c += kChunkElems<Element>) {
      const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
      const uint4 dv = *reinterpret_cast<const uint4*>(d + c);
      const uint32_t ow[4] = {ov.x, ov.y, ov.z, ov.w}, dw[4] = {dv.x, dv.y, dv.z, dv.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        if constexpr (std::is_same_v<Element, float>) {
          // dO as the products see it (TF32): dP - delta then cancels where it should (at one key
          // dP = delta up to fp32 sums, so dS = 0 there as in exact arithmetic)
          acc = fmaf(__uint_as_float(ow[w]), __uint_as_float(to_tf32(__uint_as_float(dw[w]))), acc);
        } else {
          const float2 a = unpack2<Element>(ow[w]), e = unpack2<Element>(dw[w]);
          acc = fmaf(a.x, e.x, fmaf(a.y, e.y, acc));
        }
      }
    }
    p.delta[((b * p.N + n) * p.H + h) * p.Lq + i] = acc;
  }
}

// Softmax statistics (m, l) and delta of query row `row` of (b, n, h) = bnh; rows past Lq (tile
// padding) get l = +inf, so that P = exp2(... - inf) = 0 there, and delta = 0.
struct RowStat {
  float2 stats;
  float delta;
};
__device__ __forceinline__ RowStat row_stat(const AttentionParams& p, int64_t bnh, int row) {
  if (row >= p.Lq) return RowStat{make_float2(0.f, kInf), 0.f};
  return RowStat{reinterpret_cast<const float2*>(p.stats)[bnh * p.Lq + row], p.delta[bnh * p.Lq + row]};
}

// Statistics (m, l) and delta of a block of query rows, one thread per row (tid < rows): load()
// fetches them into registers together with the block's tiles and store() writes them to the
// block's shared-memory stage after the current block's math, so their global-load latency is hidden.
struct PendingRowStats {
  RowStat value{};  // (initialised: nvcc cannot see that the threads that store it load it first)
  __device__ __forceinline__ void load(const AttentionParams& p, int64_t bnh, int row0, int tid, int rows) {
    if (tid < rows) value = row_stat(p, bnh, row0 + tid);
  }
  __device__ __forceinline__ void store(float2* stats, float* delta, int tid, int rows) const {
    if (tid < rows) stats[tid] = value.stats, delta[tid] = value.delta;
  }
};

// This thread's two query rows (row0 and row0 + 8) of an accumulator tile.
__device__ __forceinline__ void load_row_stats(float2 (&stats_row)[2], float (&delta_row)[2], const AttentionParams& p,
                                               int64_t bnh, int row0) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const RowStat rs = row_stat(p, bnh, row0 + 8 * r);
    stats_row[r] = rs.stats;
    delta_row[r] = rs.delta;
  }
}

}  // namespace evoformer
