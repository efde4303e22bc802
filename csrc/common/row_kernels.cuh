// Device code the block-op kernel families share: parameters read and written in their own dtype,
// 16-byte vectors, rows spread over a segment of lanes (the row kernels: layer norms, gates, column
// sums), grid-stride spans of vectors, and per-CTA column sums added in a fixed order by the grid's
// last CTAs (atomic tickets only: bitwise reproducible).
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cutlass/numeric_types.h>

#include "common/block_params.h"

namespace evoformer {
namespace block {

__device__ __forceinline__ float param_load(const ParamTensor& t, int64_t i) {
  switch (t.dtype) {
    case kParamHalf: return __half2float(static_cast<const __half*>(t.ptr)[i]);
    case kParamBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(t.ptr)[i]);
    default: return static_cast<const float*>(t.ptr)[i];
  }
}

__device__ __forceinline__ void param_store(const ParamTensor& t, int64_t i, float v) {
  switch (t.dtype) {
    case kParamHalf: static_cast<__half*>(t.ptr)[i] = __float2half_rn(v); break;
    case kParamBFloat16: static_cast<__nv_bfloat16*>(t.ptr)[i] = __float2bfloat16_rn(v); break;
    default: static_cast<float*>(t.ptr)[i] = v;
  }
}

// 16-byte vectors of T (8 half/bfloat16 values or 4 floats) to and from float.
template <typename T>
struct Vec {
  static constexpr int kSize = 16 / int(sizeof(T));
  float v[kSize];

  __device__ __forceinline__ void load(const T* p) { unpack(*reinterpret_cast<const uint4*>(p)); }
  // the values of 16 raw bytes (e.g. a chunk kept in registers)
  __device__ __forceinline__ void unpack(const uint4 raw) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    if constexpr (std::is_same_v<T, float>) {
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = __uint_as_float(w[i]);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float2 f;
        if constexpr (std::is_same_v<T, cutlass::bfloat16_t>)
          f = make_float2(__uint_as_float(w[i] << 16), __uint_as_float(w[i] & 0xffff0000u));
        else
          f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
        v[2 * i] = f.x, v[2 * i + 1] = f.y;
      }
    }
  }
  __device__ __forceinline__ void store(T* p) const {
    uint32_t w[4];
    if constexpr (std::is_same_v<T, float>) {
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = __float_as_uint(v[i]);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
          __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
          w[i] = *reinterpret_cast<uint32_t*>(&h);
        } else {
          __half2 h = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
          w[i] = *reinterpret_cast<uint32_t*>(&h);
        }
      }
    }
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  }
};

// v rounded to T and back (what a tensor of T holds after storing v).
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return float(T(v));
  }
}

// Sum over the `width` lanes of an aligned lane segment (width a power of two <= 32).
__device__ __forceinline__ float segment_sum(float x, int width) {
  for (int offset = width / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// ---- rows spread over lanes -----------------------------------------------------------------
// A row of C values is spread over a segment of `row_threads` lanes (C / kVec chunks of 16 bytes,
// chunk j held by lane j % row_threads as its (j / row_threads)-th chunk, up to kChunks of them).
// One CTA of kThreads threads handles rows_per_cta = kThreads / row_threads rows per step and loops
// over row groups with a grid stride.

template <typename T, int kChunks>
struct RowNormThread {
  static constexpr int kVec = Vec<T>::kSize;
  Vec<T> x[kChunks];
  int sub;         // lane within the row's segment
  int row_threads; // lanes per row

  __device__ __forceinline__ bool valid(int c, int C) const { return (sub + c * row_threads) * kVec < C; }
  __device__ __forceinline__ int col(int c) const { return (sub + c * row_threads) * kVec; }
};

// The lanes per row of a row kernel with kChunks 16-byte chunks per lane: a row of more than one
// chunk per lane spans the warp (launches give it 32 lanes), which the instantiation then knows at
// compile time; one chunk per lane takes row_threads as launched. A constant count makes a segment
// sum five straight shuffles and adds, where a count known only at run time makes each step a turn
// of a loop (seven instructions where two do): the layer-norm backward at [4096, 384] bf16 (two
// chunks per lane) 28.6 -> 21.8 us.
template <int kChunks>
__device__ __forceinline__ int row_lanes(int row_threads) {
  return kChunks > 1 ? 32 : row_threads;
}

// The thread of a row kernel (rows spread as in the row layer norm: row_threads lanes per row,
// kChunks 16-byte chunks per lane) and its CTA's row slots.
template <typename T, int kChunks>
struct RowSlots {
  RowNormThread<T, kChunks> th;
  int rows_per_cta, slot;

  __device__ __forceinline__ explicit RowSlots(int row_threads) {
    th.row_threads = row_threads;
    th.sub = int(threadIdx.x % 32u) % row_threads;
    rows_per_cta = kBlockOpThreads / row_threads;
    slot = threadIdx.x / row_threads;
  }
  __device__ __forceinline__ int64_t first_row() const { return int64_t(blockIdx.x) * rows_per_cta + slot; }
  __device__ __forceinline__ int64_t row_step() const { return int64_t(gridDim.x) * rows_per_cta; }
};

// A thread's raw 16-byte chunks of one row of a row-major tensor, loaded ahead of their use (the
// row kernels keep the next row group's chunks in flight while they work on the current one).
// Chunks past C or of a row past M are not loaded.
template <int kChunks>
struct RowChunks {
  uint4 raw[kChunks];

  template <typename T>
  __device__ __forceinline__ void load(const RowNormThread<T, kChunks>& th, const void* base, int64_t stride,
                                       int64_t row, int64_t M, int C) {
    if (row < M) load_row(th, static_cast<const T*>(base) + row * stride, C);
  }
  // the chunks of the row that starts at src
  template <typename T>
  __device__ __forceinline__ void load_row(const RowNormThread<T, kChunks>& th, const T* src, int C) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
      if (th.valid(c, C)) raw[c] = *reinterpret_cast<const uint4*>(src + th.col(c));
  }
};

// ---- spans of vectors -----------------------------------------------------------------------

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

// ---- column sums ----------------------------------------------------------------------------

// The sum of n floats p[0], p[stride], ... in that order, kInFlight loads in flight (read through
// L2: other CTAs wrote them). Not inlined: it runs in a grid's tail, and inlined, its loads' values and
// addresses raised the registers of the row kernels that call it (the gate backward's 64 to 65: three
// CTAs per SM where its grid is sized for four, +30 to +44 %).
template <int kInFlight = 8>
__device__ __noinline__ float add_rows_in_order(const float* p, int64_t stride, int n) {
  float total = 0.f;
  for (int r0 = 0; r0 < n; r0 += kInFlight) {
    float v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) v[u] = r0 + u < n ? __ldcg(p + (r0 + u) * stride) : 0.f;
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) total += v[u];
  }
  return total;
}

// Whether this CTA is the last of `count` to take a ticket from *ticket (every thread gets the
// answer). Fences on both sides: what the CTAs wrote before their tickets is visible to the last.
// The last sets the counter back to zero (every ticket of this launch is taken), so that the next
// launch on the stream may count on it without a memset (zeroed_tickets).
__device__ __forceinline__ bool last_to_arrive(unsigned* ticket, unsigned count) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(ticket, 1u) == count - 1;
    if (last) atomicExch(ticket, 0u);
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// Entry i (< kParts <= 3) of a small array (of kParts entries or more) by selects, not by a dynamic
// index (which would put the array in local memory): a scalar (the partial rows' pointers, held in
// registers) by value, a struct (ColumnTotals::out, kernel parameters) by reference, so that its fields
// are read from the entry selected.
template <int kParts, typename E, int kSize>
__device__ __forceinline__ std::conditional_t<std::is_scalar_v<E>, E, const E&> select_part(const E (&a)[kSize],
                                                                                          int i) {
  static_assert(kParts >= 1 && kParts <= 3 && kParts <= kSize, "a part of the array's first three entries");
  if constexpr (kParts == 1) return a[0];
  else if constexpr (kParts == 2) return i == 0 ? a[0] : a[1];
  else return i == 0 ? a[0] : i == 1 ? a[1] : a[2];
}

// Group sums the final stage reads in one round of loads: every group of a grid of up to 640 CTAs
// (four per SM on 160 SMs).
constexpr int kSumGroupsInFlight = 40;

// Adds the partial rows part[i][0 .. gridDim.x) (rows part_stride floats apart) into totals.out[i],
// in a fixed order whichever CTAs finish last, so the result is bitwise reproducible: the last CTA
// of each kCtasPerSumGroup consecutive CTAs adds its group's rows in order into totals.group_part,
// and the last of those adds the groups in order. Two short stages, because one CTA adding every
// row alone (528 rows on an H100) would run for tens of microseconds after the rest of the grid.
// Each stage is the grid's tail, the GPU otherwise idle: its threads take the (part, column) pairs
// together and load all of a pair's rows at once, one round of L2 latency per pair a thread takes
// (at C = 256 with two parts, two per stage), where eight loads at a time, part after part, took up
// to ten in the second stage (33 groups at 528 CTAs).
// Every thread of every CTA calls this after its CTA stored its partials.
template <int kParts>
__device__ __forceinline__ void add_partials_in_last_cta(const ColumnTotals& totals, float* const (&part)[kParts],
                                                         int64_t part_stride, int C) {
  static_assert(kParts >= 1 && kParts <= 3, "ColumnTotals holds three totals");
  const int n_groups = (int(gridDim.x) + kCtasPerSumGroup - 1) / kCtasPerSumGroup;
  const int group = int(blockIdx.x) / kCtasPerSumGroup, first = group * kCtasPerSumGroup;
  const int in_group = min(kCtasPerSumGroup, int(gridDim.x) - first);
  if (!last_to_arrive(totals.tickets + group, unsigned(in_group))) return;
  for (int k = threadIdx.x; k < kParts * C; k += blockDim.x) {
    const int i = kParts == 1 ? 0 : k / C, col = k - i * C;
    const float* rows = select_part<kParts>(part, i);
    if (rows == nullptr) continue;
    totals.group_part[(int64_t(group) * kParts + i) * C + col] =
        add_rows_in_order<kCtasPerSumGroup>(rows + first * part_stride + col, part_stride, in_group);
  }
  if (!last_to_arrive(totals.tickets + n_groups, unsigned(n_groups))) return;
  for (int k = threadIdx.x; k < kParts * C; k += blockDim.x) {
    const int i = kParts == 1 ? 0 : k / C, col = k - i * C;
    if (select_part<kParts>(part, i) == nullptr) continue;
    param_store(select_part<kParts>(totals.out, i), col,
                add_rows_in_order<kSumGroupsInFlight>(totals.group_part + i * C + col, kParts * C, n_groups));
  }
}

// The CTA's column sums: thread (slot, lane) holds sums[i] over its rows for its columns; row
// blockIdx.x of part[i] (rows part_stride floats apart; skipped when nullptr) gets their sum over the
// CTA's row slots, in slot order; with totals.tickets, the grid's last CTAs add all rows into
// totals.out (add_partials_in_last_cta). smem: kParts * rows_per_cta * C floats.
template <int kParts, typename T, int kChunks>
__device__ __forceinline__ void store_cta_column_sums(const RowNormThread<T, kChunks>& th, int slot, int rows_per_cta,
                                                      int C, const float (&sums)[kParts][kChunks][Vec<T>::kSize],
                                                      float* smem, float* const (&part)[kParts], int64_t part_stride,
                                                      const ColumnTotals& totals) {
  float* mine = smem + slot * kParts * C;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    if (!th.valid(c, C)) continue;
#pragma unroll
    for (int i = 0; i < kParts; ++i)
#pragma unroll
      for (int e = 0; e < Vec<T>::kSize; ++e) mine[i * C + th.col(c) + e] = sums[i][c][e];
  }
  __syncthreads();
  for (int col = threadIdx.x; col < C; col += blockDim.x) {
#pragma unroll
    for (int i = 0; i < kParts; ++i) {
      if (part[i] == nullptr) continue;
      float total = 0.f;
      for (int s = 0; s < rows_per_cta; ++s) total += smem[(s * kParts + i) * C + col];
      part[i][int64_t(blockIdx.x) * part_stride + col] = total;
    }
  }
  if (totals.tickets != nullptr) add_partials_in_last_cta<kParts>(totals, part, part_stride, C);
}

}  // namespace block
}  // namespace evoformer
