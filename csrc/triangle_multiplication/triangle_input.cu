// Launchers of the triangle multiplication's fused input kernel and its edges' backward
// (triangle_input.cuh), half and bfloat16, one instantiation per c_z bucket (64, 128, 256); where
// p.hopper and the group fits, the edges' backward runs the sm_90a kernel instead
// (triangle_gate_backward_sm90.cu).
#include <algorithm>

#include "triangle_multiplication/triangle_input.cuh"

namespace evoformer {
namespace block {

bool triangle_gate_backward_runs_sm90(const TriangleGateBackwardParams& p) {
  return p.hopper && p.K == 128 && (p.C == 32 || p.C == 64) && p.vector_ok && p.dab_vector_ok && p.sm_count > 0;
}

int64_t triangle_gate_backward_parts(const TriangleGateBackwardParams& p) {
  if (triangle_gate_backward_runs_sm90(p)) return triangle_gate_backward_sm90_ctas(p);
  return (p.M + kTriInRows - 1) / kTriInRows;
}

int triangle_input_half_smem_bytes(int K) {
  int bytes = 0;
  by_k_bucket(K, [&](auto steps) {
    constexpr int kKSteps = decltype(steps)::value;
    using T = cutlass::bfloat16_t;
    bytes = std::max(triangle_input_smem_bytes<T, kKSteps>(), TriangleGateBackwardTile<kKSteps>::template bytes<T>());
  });
  return bytes;
}

template <typename T>
void launch_triangle_gate_backward(const TriangleGateBackwardParams& p, cudaStream_t stream) {
  static_assert(limits::kTriangleTileRows == kTriInRows, "one bias_part row per CTA");
  if (p.M == 0 || p.C == 0) return;
  if (triangle_gate_backward_runs_sm90(p)) return launch_triangle_gate_backward_sm90<T>(p, stream);
  by_k_bucket(p.K, [&](auto steps) {
    constexpr int kKSteps = decltype(steps)::value;
    launch_on_position_tiles(triangle_gate_backward_kernel<T, kKSteps>, p, p.M,
                             TriangleGateBackwardTile<kKSteps>::template bytes<T>(), stream,
                             "evoformer triangle gate backward");
  });
}

template <typename T>
void launch_triangle_input(const TriangleInputParams& p, cudaStream_t stream) {
  if (p.M == 0) return;
  if (p.hopper) return launch_triangle_input_sm90<T>(p, stream);
  by_k_bucket(p.K, [&](auto steps) {
    constexpr int kKSteps = decltype(steps)::value;
    launch_on_position_tiles(triangle_input_kernel<T, kKSteps>, p, p.M, triangle_input_smem_bytes<T, kKSteps>(),
                             stream, "evoformer triangle input");
  });
}

template void launch_triangle_input<cutlass::half_t>(const TriangleInputParams&, cudaStream_t);
template void launch_triangle_input<cutlass::bfloat16_t>(const TriangleInputParams&, cudaStream_t);
template void launch_triangle_gate_backward<cutlass::half_t>(const TriangleGateBackwardParams&, cudaStream_t);
template void launch_triangle_gate_backward<cutlass::bfloat16_t>(const TriangleGateBackwardParams&, cudaStream_t);

}  // namespace block
}  // namespace evoformer
