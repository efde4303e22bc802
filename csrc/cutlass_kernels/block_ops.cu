// Launchers of the block-op kernels (layer_norm.cuh, gating.cuh for half, bfloat16 and float;
// weight_fold.cuh for parameters of any float dtype).
#include <stdexcept>
#include <string>

#include "evoformer_attention.h"  // check_launch
#include "gating.cuh"
#include "weight_fold.cuh"

namespace evoformer {
namespace block {

namespace {

// CTAs for a grid-stride kernel over `items` 16-byte spans: enough to fill the GPU a few times
// over, never more than there is work for.
unsigned span_grid(int64_t items) {
  const int64_t blocks = (items + kBlockOpThreads - 1) / kBlockOpThreads;
  return unsigned(blocks < 8192 ? (blocks > 0 ? blocks : 1) : 8192);
}

// Lanes' 16-byte chunks of a row of C values spread over row_threads lanes.
template <typename T>
int chunks_per_lane(int C, int row_threads) {
  return (C / Vec<T>::kSize + row_threads - 1) / row_threads;
}

template <typename Params>
void launch_rows(void (*kernel)(Params), const Params& p, int n_ctas, int smem_bytes, cudaStream_t stream,
                 const char* name) {
  if (smem_bytes > 48 * 1024 &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes) != cudaSuccess)
    check_launch(name);
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

template <typename Params>
void launch_channel_kernel(void (*kernel)(Params), const Params& p, int smem_bytes, cudaStream_t stream,
                           const char* name) {
  if (p.M == 0) return;
  if (smem_bytes > 48 * 1024 &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes) != cudaSuccess)
    check_launch(name);
  kernel<<<unsigned((p.M + kChannelTile - 1) / kChannelTile), kBlockOpThreads, smem_bytes, stream>>>(p);
  check_launch(name);
}

}  // namespace

template <typename T>
void launch_layer_norm_rows(const RowNormParams& p, int n_ctas, cudaStream_t stream) {
  launch_row_kernel<T>(
      p, p.residual_scale != nullptr,
      [](auto chunks, auto scaled) { return layer_norm_rows_kernel<T, decltype(chunks)::value, decltype(scaled)::value>; },
      n_ctas, 0, stream, "evoformer layer norm");
}

template <typename T>
void launch_layer_norm_rows_backward(const RowNormBackwardParams& p, int n_ctas, cudaStream_t stream) {
  const int smem = p.affine_part != nullptr ? (kBlockOpThreads / p.row_threads) * 2 * p.C * 4 : 0;
  launch_row_kernel<T>(
      p, p.dresidual != nullptr,
      [](auto chunks, auto residual) {
        return layer_norm_rows_backward_kernel<T, decltype(chunks)::value, decltype(residual)::value>;
      },
      n_ctas, smem, stream, "evoformer layer norm backward");
}

template <typename T>
void launch_layer_norm_channels(const ChannelNormParams& p, cudaStream_t stream) {
  launch_channel_kernel(layer_norm_channels_kernel<T>, p, channel_norm_smem_bytes<T>(p.C), stream,
                        "evoformer channel layer norm");
}

template <typename T>
void launch_layer_norm_channels_backward(const ChannelNormBackwardParams& p, cudaStream_t stream) {
  launch_channel_kernel(layer_norm_channels_backward_kernel<T>, p, channel_norm_smem_bytes<T>(p.C), stream,
                        "evoformer channel layer norm backward");
}

template <typename T>
void launch_gate_pack(const GatePackParams& p, cudaStream_t stream) {
  const int64_t spans = int64_t(2) * p.C * ((p.M + Vec<T>::kSize - 1) / Vec<T>::kSize);
  if (spans == 0) return;
  gate_pack_kernel<T><<<span_grid(spans), kBlockOpThreads, 0, stream>>>(p);
  check_launch("evoformer triangle gate pack");
}

template <typename T>
void launch_gate_pack_backward(const GatePackBackwardParams& p, int n_chunks, cudaStream_t stream) {
  if (p.M == 0 || p.C == 0) return;
  gate_pack_backward_kernel<T><<<dim3(unsigned(n_chunks), unsigned(2 * p.C)), kBlockOpThreads, 0, stream>>>(p);
  check_launch("evoformer triangle gate pack backward");
}

template <typename T>
void launch_sigmoid_gate(const SigmoidGateParams& p, cudaStream_t stream) {
  const int64_t spans = p.M * ((p.C + Vec<T>::kSize - 1) / Vec<T>::kSize);
  if (spans == 0) return;
  sigmoid_gate_kernel<T><<<span_grid(spans), kBlockOpThreads, 0, stream>>>(p);
  check_launch("evoformer sigmoid gate");
}

template <typename T>
void launch_sigmoid_gate_backward(const SigmoidGateBackwardParams& p, int n_ctas, cudaStream_t stream) {
  const int smem = (kBlockOpThreads / p.row_threads) * 2 * p.C * 4;
  launch_row_kernel<T>(
      p, p.delta != nullptr,
      [](auto chunks, auto delta) { return sigmoid_gate_backward_kernel<T, decltype(chunks)::value, decltype(delta)::value>; },
      n_ctas, smem, stream, "evoformer sigmoid gate backward");
}

template <typename T>
void launch_column_sum(const ColumnSumParams& p, int n_ctas, cudaStream_t stream) {
  launch_row_kernel<T>(p, column_sum_kernel<T, 1>, column_sum_kernel<T, 2>, column_sum_kernel<T, kMaxRowChunks>,
                       n_ctas, (kBlockOpThreads / p.row_threads) * p.C * 4, stream, "evoformer column sum");
}

namespace {
template <typename Params>
int rows_of(const Params& p) {
  int rows = 0;
  for (int g = 0; g < p.n_groups; ++g) rows += p.group[g].R;
  return rows;
}
}  // namespace

void launch_fold_affine(const FoldParams& p, cudaStream_t stream) {
  const int rows = rows_of(p);
  if (rows == 0) return;
  fold_affine_kernel<<<unsigned((rows + kFoldWarps - 1) / kFoldWarps), kFoldWarps * 32, 0, stream>>>(p);
  check_launch("evoformer layer-norm affine fold");
}

void launch_unfold_affine_grads(const UnfoldParams& p, cudaStream_t stream) {
  const int row_ctas = (rows_of(p) + kFoldWarps - 1) / kFoldWarps;
  int column_ctas = 0;
  for (int n = 0; n < p.n_norms; ++n) column_ctas += column_chunks(p.K[n]);
  if (row_ctas + column_ctas == 0) return;
  unfold_affine_grads_kernel<<<unsigned(row_ctas + column_ctas), kFoldWarps * 32, 0, stream>>>(p, row_ctas);
  check_launch("evoformer layer-norm affine gradients");
}

#define EVOFORMER_BLOCK_OPS(T)                                                                      \
  template void launch_layer_norm_rows<T>(const RowNormParams&, int, cudaStream_t);                 \
  template void launch_layer_norm_rows_backward<T>(const RowNormBackwardParams&, int, cudaStream_t); \
  template void launch_layer_norm_channels<T>(const ChannelNormParams&, cudaStream_t);              \
  template void launch_layer_norm_channels_backward<T>(const ChannelNormBackwardParams&, cudaStream_t); \
  template void launch_gate_pack<T>(const GatePackParams&, cudaStream_t);                           \
  template void launch_gate_pack_backward<T>(const GatePackBackwardParams&, int, cudaStream_t);     \
  template void launch_sigmoid_gate<T>(const SigmoidGateParams&, cudaStream_t);                     \
  template void launch_sigmoid_gate_backward<T>(const SigmoidGateBackwardParams&, int, cudaStream_t);     \
  template void launch_column_sum<T>(const ColumnSumParams&, int, cudaStream_t);
EVOFORMER_BLOCK_OPS(cutlass::half_t)
EVOFORMER_BLOCK_OPS(cutlass::bfloat16_t)
EVOFORMER_BLOCK_OPS(float)
#undef EVOFORMER_BLOCK_OPS

}  // namespace block
}  // namespace evoformer
