// Launchers of the layer-norm family's kernels (layer_norm.cuh for half, bfloat16 and float;
// weight_fold.cuh for parameters of any float dtype).
#include "common/block_launch.cuh"
#include "layer_norm/layer_norm.cuh"
#include "layer_norm/weight_fold.cuh"

namespace evoformer {
namespace block {

namespace {

template <typename Params>
void launch_channel_kernel(void (*kernel)(Params), const Params& p, int smem_bytes, cudaStream_t stream,
                           const char* name) {
  if (p.M == 0) return;
  if (smem_bytes > 48 * 1024) allow_dynamic_smem(kernel, smem_bytes, name);
  kernel<<<unsigned((p.M + kChannelTile - 1) / kChannelTile), kBlockOpThreads, smem_bytes, stream>>>(p);
  check_launch(name);
}

}  // namespace

template <typename T>
void launch_layer_norm_rows(const RowNormParams& p, int n_ctas, cudaStream_t stream) {
  launch_row_kernel<T>(
      p, p.residual_scale != nullptr, p.residual_bias.ptr != nullptr,
      [](auto chunks, auto scaled, auto biased) {
        return layer_norm_rows_kernel<T, decltype(chunks)::value, decltype(scaled)::value, decltype(biased)::value>;
      },
      n_ctas, 0, stream, "evoformer layer norm");
}

template <typename T>
void launch_layer_norm_rows_backward(const RowNormBackwardParams& p, int n_ctas, cudaStream_t stream) {
  const bool column_sums = p.bias_part != nullptr || p.affine_part != nullptr;  // else no shared memory
  const int parts = column_sums ? norm_backward_parts(p.bias_part != nullptr) : 0;
  const int smem = (kBlockOpThreads / p.row_threads) * parts * p.C * 4;
  launch_row_kernel<T>(
      p, p.dresidual != nullptr, p.bias_part != nullptr,
      [](auto chunks, auto residual, auto bias_grad) {
        return layer_norm_rows_backward_kernel<T, decltype(chunks)::value, decltype(residual)::value,
                                               decltype(bias_grad)::value>;
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

#define EVOFORMER_LAYER_NORM_OPS(T) \
  template void launch_layer_norm_rows<T>(const RowNormParams&, int, cudaStream_t); \
  template void launch_layer_norm_rows_backward<T>(const RowNormBackwardParams&, int, cudaStream_t); \
  template void launch_layer_norm_channels<T>(const ChannelNormParams&, cudaStream_t); \
  template void launch_layer_norm_channels_backward<T>(const ChannelNormBackwardParams&, cudaStream_t);
EVOFORMER_LAYER_NORM_OPS(cutlass::half_t)
EVOFORMER_LAYER_NORM_OPS(cutlass::bfloat16_t)
EVOFORMER_LAYER_NORM_OPS(float)
#undef EVOFORMER_LAYER_NORM_OPS

}  // namespace block
}  // namespace evoformer
