// Launcher of the triangle multiplication's fused output kernel (triangle_output.cuh), half and
// bfloat16, one instantiation per bucket of the hidden width C (64, 128).
#include "triangle_output.cuh"

namespace evoformer {
namespace block {

namespace {
template <typename T, int kKSteps>
void launch_bucket(const TriangleOutputParams& p, cudaStream_t stream) {
  launch_on_position_tiles(triangle_output_kernel<T, kKSteps>, p, p.M, TriangleOutputTile<kKSteps>::template bytes<T>(),
                           stream, "evoformer triangle output");
}
}  // namespace

template <typename T>
void launch_triangle_output(const TriangleOutputParams& p, cudaStream_t stream) {
  static_assert(kTriangleOutputMaxC == 128 && kTriangleOutputMaxG == kTriInPassCols, "buckets and one pass");
  if (p.M == 0) return;
  if (p.C <= 64)
    launch_bucket<T, 4>(p, stream);
  else
    launch_bucket<T, 8>(p, stream);
}

template void launch_triangle_output<cutlass::half_t>(const TriangleOutputParams&, cudaStream_t);
template void launch_triangle_output<cutlass::bfloat16_t>(const TriangleOutputParams&, cudaStream_t);

}  // namespace block
}  // namespace evoformer
