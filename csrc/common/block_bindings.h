// Host helpers the bindings of the block-op families share (layer_norm_bindings.cpp,
// triangle_bindings.cpp, opm_bindings.cpp, gating_bindings.cpp): dispatch by dtype, new outputs
// (poisoned where asked), rows in the row kernels' layout, the row kernels' grids and fit, the column
// sums' partials, parameter tensors and row maps.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <cutlass/numeric_types.h>

#include "common/bindings_common.h"
#include "common/block_params.h"

namespace evoformer {
namespace block {

// Calls fn(T{}) with T the kernel element type of `dtype`.
template <typename Fn>
inline void by_dtype(at::ScalarType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case at::kHalf: fn(cutlass::half_t{}); break;
    case at::kBFloat16: fn(cutlass::bfloat16_t{}); break;
    case at::kFloat: fn(float{}); break;
    default: EVO_CHECK(false, op, ": tensors must be float16, bfloat16 or float32, got ", dtype);
  }
}

inline bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// A new output tensor; filled with NaN first when EVOFORMER_BLOCKS_POISON is set, so that a test sees
// any element a kernel fails to write.
inline at::Tensor output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = new_empty(sizes, options);
  maybe_poison(t);
  return t;
}

// Per-CTA partial sums [ctas, parts] float32 (parts floats per CTA), then the group partials, and the
// tickets (zeroed_tickets on `stream`) of a kernel whose last CTAs add the partials into `out`
// (ColumnTotals).
struct PartialSums {
  at::Tensor part;
  at::Tensor fresh_tickets;  // (while a graph is captured)
  ColumnTotals totals;

  PartialSums(int64_t ctas, int64_t parts, const at::TensorOptions& f32, ParamTensor out0, ParamTensor out1,
              cudaStream_t stream, ParamTensor out2 = {nullptr, kParamFloat}) {
    const int64_t groups = (ctas + kCtasPerSumGroup - 1) / kCtasPerSumGroup;
    part = output({(ctas + groups) * parts}, f32);  // [ctas + groups, parts]
    totals.group_part = part.data_ptr<float>() + ctas * parts;
    totals.tickets = zeroed_tickets(groups + 1, f32.device(), stream, &fresh_tickets);
    totals.out[0] = out0;
    totals.out[1] = out1;
    totals.out[2] = out2;
  }
  float* data() { return part.data_ptr<float>(); }
};

// Whether `family` ("sm80" or "sm90") runs the Hopper kernels of a block op on x's device; "sm90" needs
// a build holding sm_90a code and a 9.0 device.
inline bool hopper_family(const std::string& family, const at::Tensor& x, const char* op) {
  const bool hopper = family == "sm90";
  EVO_CHECK(family == "sm80" || (hopper && hopper_kernels_available(x.get_device())), op,
            ": `family` must be \"sm80\", or \"sm90\" with a build holding sm_90a code on a 9.0 device, got \"",
            family, "\"");
  return hopper;
}

// Whether a [M, C] matrix has the row kernels' layout: C contiguous, every row 16-byte aligned.
inline bool aligned_rows(const at::Tensor& rows) {
  const int64_t vec = 16 / rows.element_size();
  return rows.stride(1) == 1 && (rows.size(0) <= 1 || rows.stride(0) % vec == 0) && aligned16(rows) &&
         rows.size(1) % vec == 0;
}

// x as [M, C] rows with C contiguous and 16-byte aligned rows (a copy only when the layout is not).
inline at::Tensor as_rows(const at::Tensor& x, int64_t C) {
  at::Tensor rows = flat_rows(x, C);
  if (!aligned_rows(rows)) rows = rows.contiguous();
  return rows;
}

// Lanes per row of the row layer norm: a power of two covering the row's 16-byte chunks, at most 32.
inline int row_threads_for(int64_t C, int64_t element_size) {
  const int64_t chunks = C * element_size / 16;
  int t = 1;
  while (t < 32 && t < chunks) t *= 2;
  return t;
}

// Whether a row of C values fits the row kernels: whole chunks, at most kMaxRowChunks per lane
// (normalization.py's row_reasons states the same rule from kernel_table.json).
inline bool row_fits(int64_t C, int64_t element_size) {
  const int64_t bytes = C * element_size;
  return bytes % limits::kRowChunkBytes == 0 &&
         bytes <= int64_t(limits::kRowMaxLanes) * kMaxRowChunks * limits::kRowChunkBytes;
}

// CTAs of a row-kernel launch: one per group of rows, at most per_sm per SM (the backward's affine
// partials have one row per CTA).
inline int row_norm_ctas(int64_t M, int row_threads, int per_sm = kRowNormCtasPerSm) {
  const int64_t groups = (M + kBlockOpThreads / row_threads - 1) / (kBlockOpThreads / row_threads);
  return int(std::max<int64_t>(1, std::min<int64_t>(groups, int64_t(per_sm) * current_sm_count())));
}

inline void check_cuda(const at::Tensor& t, const char* name, const char* op) {
  EVO_CHECK(t.is_cuda(), op, ": `", name, "` must be a CUDA tensor, got ", t.device());
}

// An absent parameter tensor.
constexpr ParamTensor kNoParam{nullptr, kParamFloat};

// The dtypes the block-op kernels read parameters in (ParamDtype).
inline bool is_param_dtype(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat; }
inline bool is_param_dtype(const at::Tensor& t) {
  return is_param_dtype(t.scalar_type());
}

inline ParamTensor param_tensor(const at::Tensor& t) {
  const int dtype = t.scalar_type() == at::kHalf       ? kParamHalf
                    : t.scalar_type() == at::kBFloat16 ? kParamBFloat16
                                                       : kParamFloat;
  return ParamTensor{t.data_ptr(), dtype};
}

// The rows of y [..., C] as a RowMap: its leading dims with size-1 dims dropped and nesting dims
// merged, if that leaves at most three. False when it does not.
inline bool row_map_of(const at::Tensor& y, RowMap& map) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (size, stride), outer to inner
  for (int64_t d = 0; d + 1 < y.dim(); ++d) {
    if (y.size(d) == 1) continue;
    if (!dims.empty() && dims.back().second == y.size(d) * y.stride(d)) {
      dims.back() = {dims.back().first * y.size(d), y.stride(d)};
    } else {
      dims.emplace_back(y.size(d), y.stride(d));
    }
  }
  if (dims.size() > 3) return false;
  while (dims.size() < 3) dims.insert(dims.begin(), {1, 0});
  map = RowMap{dims[2].first, dims[1].first, dims[2].second, dims[1].second, dims[0].second};
  return true;
}

}  // namespace block
}  // namespace evoformer
