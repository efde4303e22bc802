// What every block-op kernel family shares: the CTA size, parameter tensors in their own dtype, the
// column sums that the grid's last CTAs add in a fixed order, the row kernels' limits and row maps.
//
// Legend: M rows (positions: every leading dim flattened), C channels. "Row-major" tensors are
// [M, C] with C contiguous and rows `*_stride` elements apart; "channel-major" ones are [C, M] with
// M contiguous and channels `*_stride` elements apart. Element types: cutlass::half_t,
// cutlass::bfloat16_t or float; statistics and affine parameters are float32.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "common/kernel_limits.h"

namespace evoformer {
namespace block {

constexpr int kBlockOpThreads = 256;  // threads per CTA of every block-op kernel

// A contiguous parameter tensor (weight, bias, their gradients) in its own float dtype: the
// kernels read and write it through param_load / param_store (row_kernels.cuh), so a model's
// float32 or half-precision parameters need no conversion on the host.
enum ParamDtype : int { kParamHalf = 0, kParamBFloat16 = 1, kParamFloat = 2 };

struct ParamTensor {
  void* ptr;  // contiguous; nullptr: absent
  int dtype;  // ParamDtype
};

// Where a kernel's per-CTA column partial sums end up (add_partials_in_last_cta): the last CTAs to
// finish add the partial rows in CTA order (a fixed order: bitwise reproducible) into out[i] [C],
// in out[i]'s dtype (the parameter's: no conversion on the host). tickets [ceil(n_ctas /
// kCtasPerSumGroup) + 1] are zero when the launch starts and zero again when it ends (the last CTA
// to take a counter's ticket resets it: zeroed_tickets); group_part holds
// [ceil(n_ctas / kCtasPerSumGroup), parts, C] floats. tickets == nullptr: the partials stay for
// the host.
constexpr int kCtasPerSumGroup = 16;

struct ColumnTotals {
  unsigned* tickets = nullptr;
  float* group_part = nullptr;
  ParamTensor out[3] = {{nullptr, kParamFloat}, {nullptr, kParamFloat}, {nullptr, kParamFloat}};
};

// Row kernels: a row is spread over up to limits::kRowMaxLanes lanes with up to kMaxRowChunks chunks
// of limits::kRowChunkBytes each (kernel_table.json: row_kernels).
constexpr int kMaxRowChunks = limits::kMaxRowChunks;
// CTAs per SM of a row kernel's grid (grid-stride loops) unless its family says otherwise
// (layer_norm.h, gating.h).
constexpr int kRowNormCtasPerSm = 4;

// Where row m of an [M, C] operand starts when the operand is a permuted view (rows in another
// order than its memory): m = (m2 * mid + m1) * inner + m0 with m0 < inner and m1 < mid starts at
// m2 * s2 + m1 * s1 + m0 * s0 elements. A matrix with rows `stride` apart is strided(stride).
struct RowMap {
  int64_t inner, mid, s0, s1, s2;

  static RowMap strided(int64_t stride) { return RowMap{0, 1, stride, 0, 0}; }
  __host__ __device__ __forceinline__ int64_t operator()(int64_t m) const {
    if (inner == 0) return m * s0;
    const int64_t q = m / inner;
    return (q / mid) * s2 + (q % mid) * s1 + (m - q * inner) * s0;
  }
  // The same for m < 2^31 (the caller's guarantee): 32-bit divisions, where a 64-bit one is a
  // subroutine call on the GPU (whose calling convention made a row kernel spill registers).
  __host__ __device__ __forceinline__ int64_t small(int64_t m) const {
    if (inner == 0) return m * s0;
    const uint32_t q = uint32_t(m) / uint32_t(inner), q2 = q / uint32_t(mid);
    return int64_t(q2) * s2 + int64_t(q - q2 * uint32_t(mid)) * s1 + (m - int64_t(q) * inner) * s0;
  }
};

}  // namespace block
}  // namespace evoformer
