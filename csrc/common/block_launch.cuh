// Host-side launches the block-op kernel families share (nvcc translation units only): grids of
// grid-stride span kernels, and the row kernels' launches by chunks per lane (common/row_kernels.cuh).
#pragma once

#include <stdexcept>
#include <string>
#include <type_traits>

#include "common/check_launch.h"
#include "common/row_kernels.cuh"

namespace evoformer {
namespace block {

// CTAs for a grid-stride kernel over `items` 16-byte spans: enough to fill the GPU a few times
// over, never more than there is work for.
inline unsigned span_grid(int64_t items) {
  const int64_t blocks = (items + kBlockOpThreads - 1) / kBlockOpThreads;
  return unsigned(blocks < 8192 ? (blocks > 0 ? blocks : 1) : 8192);
}

// 16-byte spans of T covering M rows of C values (each row's last span possibly partial).
template <typename T>
int64_t row_spans(int64_t M, int64_t C) {
  return M * ((C + Vec<T>::kSize - 1) / Vec<T>::kSize);
}

// Launches a grid-stride kernel over `spans` 16-byte spans (span_grid CTAs; nothing where there are none).
template <typename Params>
void launch_spans(void (*kernel)(Params), const Params& p, int64_t spans, cudaStream_t stream, const char* name) {
  if (spans == 0) return;
  kernel<<<span_grid(spans), kBlockOpThreads, 0, stream>>>(p);
  check_launch(name);
}

// Lanes' 16-byte chunks of a row of C values spread over row_threads lanes.
template <typename T>
int chunks_per_lane(int C, int row_threads) {
  return (C / Vec<T>::kSize + row_threads - 1) / row_threads;
}

template <typename Params>
void launch_rows(void (*kernel)(Params), const Params& p, int n_ctas, int smem_bytes, cudaStream_t stream,
                 const char* name) {
  if (smem_bytes > 48 * 1024) allow_dynamic_smem(kernel, smem_bytes, name);
  kernel<<<unsigned(n_ctas), kBlockOpThreads, smem_bytes, stream>>>(p);
  check_launch(name);
}

// Launches the instantiation of a row kernel (row_threads lanes per row, as the row layer norm) for
// the 16-byte chunks per lane that a row of p.C values of T needs: one, two or four.
template <typename Params>
using RowKernel = void (*)(Params);
template <typename T, typename Params>
void launch_row_kernel(const Params& p, RowKernel<Params> one, RowKernel<Params> two, RowKernel<Params> four,
                       int n_ctas, int smem_bytes, cudaStream_t stream, const char* name) {
  static_assert(kMaxRowChunks == 4, "one instantiation per chunk count");
  if (p.M == 0) return;
  const int chunks = chunks_per_lane<T>(p.C, p.row_threads);
  if (chunks > kMaxRowChunks) throw std::runtime_error(std::string(name) + ": row too wide");
  launch_rows(chunks <= 1 ? one : chunks <= 2 ? two : four, p, n_ctas, smem_bytes, stream, name);
}

// The same for a row kernel with a bool template flag: pick(chunks, flag) names the instantiation
// (both std::integral_constant), the flag's value chosen at run time.
template <typename T, typename Params, typename Pick>
void launch_row_kernel(const Params& p, bool flag, Pick pick, int n_ctas, int smem_bytes, cudaStream_t stream,
                       const char* name) {
  const auto with = [&](auto f) {
    launch_row_kernel<T>(p, pick(std::integral_constant<int, 1>{}, f), pick(std::integral_constant<int, 2>{}, f),
                         pick(std::integral_constant<int, kMaxRowChunks>{}, f), n_ctas, smem_bytes, stream, name);
  };
  if (flag) with(std::true_type{});
  else with(std::false_type{});
}

// The same with two bool template flags: pick(chunks, flag, flag2).
template <typename T, typename Params, typename Pick>
void launch_row_kernel(const Params& p, bool flag, bool flag2, Pick pick, int n_ctas, int smem_bytes,
                       cudaStream_t stream, const char* name) {
  const auto with = [&](auto f) {
    launch_row_kernel<T>(p, flag2, [&](auto chunks, auto f2) { return pick(chunks, f, f2); }, n_ctas, smem_bytes,
                         stream, name);
  };
  if (flag) with(std::true_type{});
  else with(std::false_type{});
}

}  // namespace block
}  // namespace evoformer
