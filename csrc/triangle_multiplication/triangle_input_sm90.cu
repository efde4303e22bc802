// Launcher of the triangle multiplication's Hopper input kernel (triangle_input_sm90.cuh), half and
// bfloat16, per c_z bucket (64, 128, 256) one kernel with bounds checks and one without (whole slots
// and columns: C % 32 == 0, c_z == the bucket, N_res^2 % 8 == 0), and at c_z = c = 128 with whole
// 16-byte stores the kernel with the weights resident on a persistent grid. The kernels hold code only
// in a build for sm_90a; the host launches them for the "sm90" kernel family.
#include <algorithm>

#include "triangle_multiplication/triangle_input_sm90.cuh"

namespace evoformer {
namespace block {

template <typename T>
void launch_triangle_input_sm90(const TriangleInputParams& p, cudaStream_t stream) {
  if (p.M == 0) return;
  if (triangle_input_resident(p)) {
    // one CTA per SM (at most one per three 64-position tiles), each warpgroup walking its tiles
    using Tile = TriangleInputResidentTile<T>;
    constexpr const char* kName = "evoformer triangle input sm90 resident";
    const int64_t ctas = (p.M + Tile::kWarpgroups * Tile::kRows - 1) / (Tile::kWarpgroups * Tile::kRows);
    allow_dynamic_smem(triangle_input_sm90_resident_kernel<T>, Tile::kSmemBytes, kName);
    triangle_input_sm90_resident_kernel<T>
        <<<unsigned(std::max<int64_t>(1, std::min<int64_t>(ctas, p.sm_count))), Tile::kCtaThreads, Tile::kSmemBytes,
           stream>>>(p);
    check_launch(kName);
    return;
  }
  by_k_bucket(p.K, [&](auto steps) {
    constexpr int kKSteps = decltype(steps)::value;
    constexpr int kSmem = TriangleInputSm90Tile<T, kKSteps>::kSmemBytes;
    constexpr const char* kName = "evoformer triangle input sm90";
    if (p.C % kTriInSlot == 0 && p.K == 16 * kKSteps && p.vector_ok)
      launch_on_position_tiles(triangle_input_sm90_kernel<T, kKSteps, true>, p, p.M, kSmem, stream, kName);
    else
      launch_on_position_tiles(triangle_input_sm90_kernel<T, kKSteps, false>, p, p.M, kSmem, stream, kName);
  });
}

template void launch_triangle_input_sm90<cutlass::half_t>(const TriangleInputParams&, cudaStream_t);
template void launch_triangle_input_sm90<cutlass::bfloat16_t>(const TriangleInputParams&, cudaStream_t);

}  // namespace block
}  // namespace evoformer
