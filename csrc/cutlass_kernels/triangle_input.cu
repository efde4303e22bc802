// Launchers of the triangle multiplication's fused input kernel and its edges' backward
// (triangle_input.cuh), half and bfloat16, one instantiation per c_z bucket (64, 128, 256).
#include "triangle_input.cuh"

namespace evoformer {
namespace block {

namespace {
template <typename T, int kKSteps>
void launch_bucket(const TriangleInputParams& p, cudaStream_t stream) {
  launch_on_position_tiles(triangle_input_kernel<T, kKSteps>, p, p.M, triangle_input_smem_bytes<T, kKSteps>(), stream,
                           "evoformer triangle input");
}
template <typename T, int kKSteps>
void launch_backward_bucket(const TriangleGateBackwardParams& p, cudaStream_t stream) {
  launch_on_position_tiles(triangle_gate_backward_kernel<T, kKSteps>, p, p.M,
                           TriangleGateBackwardTile<kKSteps>::template bytes<T>(), stream,
                           "evoformer triangle gate backward");
}
}  // namespace

template <typename T>
void launch_triangle_gate_backward(const TriangleGateBackwardParams& p, cudaStream_t stream) {
  static_assert(kTriangleGateBackwardRows == kTriInRows, "one bias_part row per CTA");
  if (p.M == 0 || p.C == 0) return;
  if (p.K <= 64)
    launch_backward_bucket<T, 4>(p, stream);
  else if (p.K <= 128)
    launch_backward_bucket<T, 8>(p, stream);
  else
    launch_backward_bucket<T, 16>(p, stream);
}

template <typename T>
void launch_triangle_input(const TriangleInputParams& p, cudaStream_t stream) {
  static_assert(kTriangleInputMaxK == 256, "one bucket per c_z range");
  if (p.M == 0) return;
  if (p.K <= 64)
    launch_bucket<T, 4>(p, stream);
  else if (p.K <= 128)
    launch_bucket<T, 8>(p, stream);
  else
    launch_bucket<T, 16>(p, stream);
}

template void launch_triangle_input<cutlass::half_t>(const TriangleInputParams&, cudaStream_t);
template void launch_triangle_input<cutlass::bfloat16_t>(const TriangleInputParams&, cudaStream_t);
template void launch_triangle_gate_backward<cutlass::half_t>(const TriangleGateBackwardParams&, cudaStream_t);
template void launch_triangle_gate_backward<cutlass::bfloat16_t>(const TriangleGateBackwardParams&, cudaStream_t);

}  // namespace block
}  // namespace evoformer
