// Launchers of the outer product mean's tile GEMM (opm_gemm.cuh), half and bfloat16.
#include "outer_product_mean/opm_gemm.cuh"

namespace evoformer {
namespace block {

namespace {
// kernel<<<grid, kOpmThreads, smem>>>(params) after raising its dynamic shared-memory limit; both
// steps checked and named `name`.
template <typename Params>
void launch_with_smem(void (*kernel)(Params), dim3 grid, int smem, cudaStream_t stream, const char* name,
                      const Params& params) {
  allow_dynamic_smem(kernel, smem, name);
  kernel<<<grid, kOpmThreads, smem, stream>>>(params);
  check_launch(name);
}

}  // namespace

template <typename T>
void launch_opm_gemm(const OpmGemmParams& params, int64_t batches, int column_tiles, cudaStream_t stream) {
  if (params.rows == 0 || batches == 0 || column_tiles == 0) return;
  OpmGemmParams p = params;
  p.column_tiles = column_tiles;
  const dim3 grid(unsigned((p.rows + kOpmTile - 1) / kOpmTile * column_tiles), 1, unsigned(batches));
  launch_with_smem(opm_gemm_kernel<T>, grid, opm_gemm_smem_bytes<T>(), stream, "evoformer outer product mean GEMM", p);
}

template <typename T>
void launch_opm_weight_grad(const OpmWeightGradParams& p, int splits, cudaStream_t stream) {
  if (p.steps == 0 || splits == 0) return;
  constexpr int kColumnTiles = limits::kOpmHidden * limits::kOpmHidden / kOpmTile;  // of the [Z, C C] gradient
  launch_with_smem(opm_weight_grad_kernel<T>, dim3(unsigned(splits), unsigned(kColumnTiles)),
                   opm_weight_grad_smem_bytes<T>(), stream, "evoformer outer product mean weight gradient", p);
}

template void launch_opm_gemm<cutlass::half_t>(const OpmGemmParams&, int64_t, int, cudaStream_t);
template void launch_opm_gemm<cutlass::bfloat16_t>(const OpmGemmParams&, int64_t, int, cudaStream_t);
template void launch_opm_weight_grad<cutlass::half_t>(const OpmWeightGradParams&, int, cudaStream_t);
template void launch_opm_weight_grad<cutlass::bfloat16_t>(const OpmWeightGradParams&, int, cudaStream_t);

}  // namespace block
}  // namespace evoformer
