// Launchers of the triangle multiplication's fused output kernel and of its backward
// (triangle_output.cuh), half and bfloat16, one instantiation per bucket of the widths (64, 128); the
// forward also without bounds checks where c and c_z fill the bucket and one pass (C == the bucket,
// G == 128) and rows are 16-byte aligned.
#include <algorithm>

#include "triangle_multiplication/triangle_output.cuh"

namespace evoformer {
namespace block {

namespace {
// One persistent grid: as many CTAs as are resident at once (p.sm_count x the kernel's CTAs per SM),
// each walking the tiles gridDim.x apart (one per tile where there are fewer tiles).
template <auto kKernel>
void launch_persistent(const TriangleOutputParams& p, int smem_bytes, cudaStream_t stream, const char* name) {
  const int64_t tiles = (p.M + kTriInRows - 1) / kTriInRows;
  const int64_t resident = int64_t(p.sm_count) * resident_ctas_per_sm<kKernel>(kTriInThreads, smem_bytes, name);
  allow_dynamic_smem(kKernel, smem_bytes, name);
  kKernel<<<unsigned(std::max<int64_t>(1, std::min(tiles, resident))), kTriInThreads, smem_bytes, stream>>>(p);
  check_launch(name);
}

template <typename T, int kKSteps>
void launch_bucket(const TriangleOutputParams& p, cudaStream_t stream) {
  constexpr int kSmem = TriangleOutputTile<kKSteps>::template bytes<T>();
  constexpr const char* kName = "evoformer triangle output";
  if (p.C == 16 * kKSteps && p.G == kTriInPassCols && p.vector_ok)
    launch_persistent<triangle_output_kernel<T, kKSteps, true>>(p, kSmem, stream, kName);
  else
    launch_persistent<triangle_output_kernel<T, kKSteps, false>>(p, kSmem, stream, kName);
}
}  // namespace

int triangle_output_half_smem_bytes(int C) {
  using T = cutlass::bfloat16_t;
  const int forward = C <= 64 ? TriangleOutputTile<4>::bytes<T>() : TriangleOutputTile<8>::bytes<T>();
  return std::max(forward, triangle_output_backward_smem_bytes<T>());
}

template <typename T>
void launch_triangle_output(const TriangleOutputParams& p, cudaStream_t stream) {
  static_assert(limits::kTriangleOutputMaxC == 128 && limits::kTriangleOutputMaxG == kTriInPassCols, "buckets and one pass");
  if (p.M == 0) return;
  if (p.C <= 64)
    launch_bucket<T, 4>(p, stream);
  else
    launch_bucket<T, 8>(p, stream);
}

template <typename T>
void launch_triangle_output_backward(const TriangleOutputBackwardParams& p, cudaStream_t stream) {
  static_assert(limits::kTriangleTileRows == kTriInRows, "the host sizes the partial sums by CTA");
  if (p.M == 0) return;
  constexpr int smem = triangle_output_backward_smem_bytes<T>();
  const char* name = "evoformer triangle output backward";
  if (p.C <= 64 && p.G <= 64)
    launch_on_position_tiles(triangle_output_backward_kernel<T, 4>, p, p.M, smem, stream, name);
  else
    launch_on_position_tiles(triangle_output_backward_kernel<T, 8>, p, p.M, smem, stream, name);
}

template void launch_triangle_output<cutlass::half_t>(const TriangleOutputParams&, cudaStream_t);
template void launch_triangle_output<cutlass::bfloat16_t>(const TriangleOutputParams&, cudaStream_t);
template void launch_triangle_output_backward<cutlass::half_t>(const TriangleOutputBackwardParams&, cudaStream_t);
template void launch_triangle_output_backward<cutlass::bfloat16_t>(const TriangleOutputBackwardParams&,
                                                                   cudaStream_t);

}  // namespace block
}  // namespace evoformer
