// Code shared by every instantiation: the launch check and the backward's delta pass.
#include <stdexcept>
#include <string>

#include "backward_kernels.cuh"

namespace evoformer {

void check_launch(const char* kernel_name) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(kernel_name) + ": CUDA error: " + cudaGetErrorString(err));
}

template <typename Element>
void launch_backward_delta(const AttentionParams& p, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t rows = int64_t(p.B) * p.N * p.Lq * p.H;
  const int64_t blocks = (rows + kThreads - 1) / kThreads;
  const unsigned grid = unsigned(blocks < (int64_t(1) << 20) ? blocks : (int64_t(1) << 20));  // grid-stride beyond
  backward_delta_kernel<Element><<<grid, kThreads, 0, stream>>>(p);
  check_launch("evoformer backward delta");
}

template void launch_backward_delta<cutlass::bfloat16_t>(const AttentionParams&, cudaStream_t);
template void launch_backward_delta<cutlass::half_t>(const AttentionParams&, cudaStream_t);

}  // namespace evoformer
