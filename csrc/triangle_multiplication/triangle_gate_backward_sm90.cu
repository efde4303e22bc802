// Launcher of the edges' gate backward on Hopper (triangle_gate_backward_sm90.cuh), half and bfloat16:
// a persistent grid of one CTA per SM (at most one per three 64-position tiles). The kernel holds code
// only in a build for sm_90a; launch_triangle_gate_backward chooses it for the "sm90" kernel family.
#include <algorithm>

#include "triangle_multiplication/triangle_gate_backward_sm90.cuh"

namespace evoformer {
namespace block {

int64_t triangle_gate_backward_sm90_ctas(const TriangleGateBackwardParams& p) {
  using Tile = TriangleGateBackwardSm90Tile<cutlass::half_t, 4>;
  const int64_t tiles = (p.M + Tile::kRows - 1) / Tile::kRows;
  return std::max<int64_t>(1, std::min<int64_t>((tiles + Tile::kWarpgroups - 1) / Tile::kWarpgroups, p.sm_count));
}

template <typename T, int kSlots>
void launch_sm90(const TriangleGateBackwardParams& p, cudaStream_t stream) {
  using Tile = TriangleGateBackwardSm90Tile<T, kSlots>;
  constexpr const char* kName = "evoformer triangle gate backward sm90";
  allow_dynamic_smem(triangle_gate_backward_sm90_kernel<T, kSlots>, Tile::kSmemBytes, kName);
  triangle_gate_backward_sm90_kernel<T, kSlots>
      <<<unsigned(triangle_gate_backward_sm90_ctas(p)), Tile::kCtaThreads, Tile::kSmemBytes, stream>>>(p);
  check_launch(kName);
}

// p.C is 32 or 64 (triangle_gate_backward_runs_sm90): two or four slots.
template <typename T>
void launch_triangle_gate_backward_sm90(const TriangleGateBackwardParams& p, cudaStream_t stream) {
  if (p.C == 32) launch_sm90<T, 2>(p, stream);
  else launch_sm90<T, 4>(p, stream);
}

template void launch_triangle_gate_backward_sm90<cutlass::half_t>(const TriangleGateBackwardParams&, cudaStream_t);
template void launch_triangle_gate_backward_sm90<cutlass::bfloat16_t>(const TriangleGateBackwardParams&,
                                                                      cudaStream_t);

}  // namespace block
}  // namespace evoformer
