// Launcher of the triangle multiplication's Hopper input kernel (triangle_input_sm90.cuh), half and
// bfloat16, one instantiation per c_z bucket (64, 128, 256). The kernels hold code only in a build for
// sm_90a; the host launches them for the "sm90" kernel family.
#include "triangle_input_sm90.cuh"

namespace evoformer {
namespace block {

template <typename T>
void launch_triangle_input_sm90(const TriangleInputParams& p, cudaStream_t stream) {
  if (p.M == 0) return;
  by_k_bucket(p.K, [&](auto steps) {
    constexpr int kKSteps = decltype(steps)::value;
    launch_on_position_tiles(triangle_input_sm90_kernel<T, kKSteps>, p, p.M,
                             TriangleInputSm90Tile<T, kKSteps>::kSmemBytes, stream, "evoformer triangle input sm90");
  });
}

template void launch_triangle_input_sm90<cutlass::half_t>(const TriangleInputParams&, cudaStream_t);
template void launch_triangle_input_sm90<cutlass::bfloat16_t>(const TriangleInputParams&, cudaStream_t);

}  // namespace block
}  // namespace evoformer
