// Launchers of the gating family's kernels (gating.cuh), half, bfloat16 and float.
#include "common/block_launch.cuh"
#include "gating/gating.cuh"

namespace evoformer {
namespace block {

template <typename T>
void launch_sigmoid_gate(const SigmoidGateParams& p, cudaStream_t stream) {
  launch_spans(sigmoid_gate_kernel<T>, p, row_spans<T>(p.M, p.C), stream, "evoformer sigmoid gate");
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

template <typename T>
void launch_row_scale(const RowScaleParams& p, cudaStream_t stream) {
  launch_spans(row_scale_kernel<T>, p, row_spans<T>(p.M, p.C), stream, "evoformer row scale");
}

#define EVOFORMER_GATING_OPS(T) \
  template void launch_sigmoid_gate<T>(const SigmoidGateParams&, cudaStream_t); \
  template void launch_sigmoid_gate_backward<T>(const SigmoidGateBackwardParams&, int, cudaStream_t); \
  template void launch_column_sum<T>(const ColumnSumParams&, int, cudaStream_t); \
  template void launch_row_scale<T>(const RowScaleParams&, cudaStream_t);
EVOFORMER_GATING_OPS(cutlass::half_t)
EVOFORMER_GATING_OPS(cutlass::bfloat16_t)
EVOFORMER_GATING_OPS(float)
#undef EVOFORMER_GATING_OPS

}  // namespace block
}  // namespace evoformer
