// Launchers of the outer product mean's tile GEMM (opm_gemm.cuh), half and bfloat16.
#include "opm_gemm.cuh"

namespace evoformer {
namespace block {

namespace {
template <typename T, bool kRelu>
void launch_tile_gemm(const OpmGemmParams& p, int64_t batches, int column_tiles, cudaStream_t stream,
                      const char* name) {
  if (p.rows == 0 || batches == 0) return;
  constexpr int smem = opm_tile_gemm_smem_bytes<T, kRelu>();
  if (cudaFuncSetAttribute(opm_gemm_kernel<T, kRelu>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
      cudaSuccess)
    check_launch(name);
  const dim3 grid(unsigned((p.rows + kOpmTile - 1) / kOpmTile), unsigned(column_tiles), unsigned(batches));
  opm_gemm_kernel<T, kRelu><<<grid, kOpmThreads, smem, stream>>>(p);
  check_launch(name);
}
}  // namespace

template <typename T>
void launch_opm_gemm(const OpmGemmParams& p, int64_t batches, int column_tiles, cudaStream_t stream) {
  launch_tile_gemm<T, false>(p, batches, column_tiles, stream, "evoformer outer product mean GEMM");
}

template <typename T>
void launch_relu_grad_gemm(const OpmGemmParams& p, int column_tiles, cudaStream_t stream) {
  launch_tile_gemm<T, true>(p, 1, column_tiles, stream, "evoformer ReLU backward GEMM");
}

template <typename T>
void launch_opm_weight_grad(const OpmWeightGradParams& p, int splits, cudaStream_t stream) {
  if (p.steps == 0 || splits == 0) return;
  constexpr int smem = opm_weight_grad_smem_bytes<T>();
  const char* name = "evoformer outer product mean weight gradient";
  if (cudaFuncSetAttribute(opm_weight_grad_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
      cudaSuccess)
    check_launch(name);
  opm_weight_grad_kernel<T><<<dim3(unsigned(splits), unsigned(32 * 32 / kOpmTile)), kOpmThreads, smem, stream>>>(p);
  check_launch(name);
}

template void launch_opm_gemm<cutlass::half_t>(const OpmGemmParams&, int64_t, int, cudaStream_t);
template void launch_opm_gemm<cutlass::bfloat16_t>(const OpmGemmParams&, int64_t, int, cudaStream_t);
template void launch_relu_grad_gemm<cutlass::half_t>(const OpmGemmParams&, int, cudaStream_t);
template void launch_relu_grad_gemm<cutlass::bfloat16_t>(const OpmGemmParams&, int, cudaStream_t);
template void launch_opm_weight_grad<cutlass::half_t>(const OpmWeightGradParams&, int, cudaStream_t);
template void launch_opm_weight_grad<cutlass::bfloat16_t>(const OpmWeightGradParams&, int, cudaStream_t);

}  // namespace block
}  // namespace evoformer
