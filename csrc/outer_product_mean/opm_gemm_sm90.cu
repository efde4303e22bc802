// Launcher of the outer product mean's Hopper tile GEMM (opm_gemm_sm90.cuh), half and bfloat16. The
// kernel holds code only in a build for sm_90a; the host launches it for the "sm90" kernel family.
#include "outer_product_mean/opm_gemm_sm90.cuh"

namespace evoformer {
namespace block {

template <typename T>
void launch_opm_gemm_sm90(const OpmGemmParams& params, int64_t batches, int column_tiles, cudaStream_t stream) {
  if (params.rows == 0 || batches == 0 || column_tiles == 0) return;
  OpmGemmParams p = params;
  p.column_tiles = column_tiles;
  constexpr const char* kName = "evoformer outer product mean GEMM sm90";
  constexpr int kSmem = OpmGemmSm90Tile<T>::kSmemBytes;
  allow_dynamic_smem(opm_gemm_sm90_kernel<T>, kSmem, kName);
  const dim3 grid(unsigned((p.rows + kOpmTile - 1) / kOpmTile * column_tiles), 1, unsigned(batches));
  opm_gemm_sm90_kernel<T><<<grid, kOpmThreads, kSmem, stream>>>(p);
  check_launch(kName);
}

template void launch_opm_gemm_sm90<cutlass::half_t>(const OpmGemmParams&, int64_t, int, cudaStream_t);
template void launch_opm_gemm_sm90<cutlass::bfloat16_t>(const OpmGemmParams&, int64_t, int, cudaStream_t);

}  // namespace block
}  // namespace evoformer
