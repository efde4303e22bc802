// The launch check every kernel family's launchers use.
#pragma once

#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

namespace evoformer {

// Throws std::runtime_error naming the kernel when the last launch failed.
inline void check_launch(const char* kernel_name) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(kernel_name) + ": CUDA error: " + cudaGetErrorString(err));
}

}  // namespace evoformer
