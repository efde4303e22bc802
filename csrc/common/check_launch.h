// The launch check every kernel family's launchers use, the shared-memory allowance they raise
// before a launch, the per-device cache of what they ask the driver once per device, the device's
// shared-memory limit per CTA and the occupancy query that sizes persistent grids.
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include <cuda_runtime.h>

namespace evoformer {

// Throws std::runtime_error naming the kernel when the last launch failed.
inline void check_launch(const char* kernel_name) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(kernel_name) + ": CUDA error: " + cudaGetErrorString(err));
}

// Devices whose answers once_per_device keeps (indices past it are asked on every call).
constexpr int kCachedDevices = 64;

// ask(device)'s value for `device`, asked once per device and then read from `cache`, which holds
// value + 1 (0: not asked yet; two threads racing on a device's first call both ask, and store the
// same value).
template <typename Ask>
int once_per_device(std::atomic<int> (&cache)[kCachedDevices], int device, Ask&& ask) {
  const bool kept = device >= 0 && device < kCachedDevices;
  if (kept) {
    if (const int c = cache[device].load(std::memory_order_relaxed)) return c - 1;
  }
  const int value = ask(device);
  if (kept) cache[device].store(value + 1, std::memory_order_relaxed);
  return value;
}

// The most dynamic shared memory a CTA may opt into on the current device (227 KB on an H100, 163 KB on
// an A100, 99 KB on compute capability 8.6 and 8.9), asked once per device. Failures name `name`.
inline int max_dynamic_smem(const char* name) {
  static std::atomic<int> cache[kCachedDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) check_launch(name);
  return once_per_device(cache, device, [&](int d) {
    int bytes = 0;
    if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, d) != cudaSuccess) check_launch(name);
    return bytes;
  });
}

// Allows `kernel` up to smem_bytes of dynamic shared memory on the current device
// (cudaFuncAttributeMaxDynamicSharedMemorySize), asking the driver only when no earlier call
// allowed that much on this device: the attribute call costs host time comparable to a launch and
// every launch would otherwise repeat it. The attribute is an allowance (occupancy follows the
// launch's own size), so a larger one set before serves smaller launches. A failure names `name`.
inline void allow_dynamic_smem(const void* kernel, int smem_bytes, const char* name) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) check_launch(name);
  static std::mutex mutex;
  static auto* allowed = new std::map<std::pair<const void*, int>, int>();  // (kernel, device) -> bytes
  std::lock_guard<std::mutex> lock(mutex);
  int& bytes = (*allowed)[{kernel, device}];
  if (bytes >= smem_bytes) return;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes) != cudaSuccess) {
    const std::string error = cudaGetErrorString(cudaGetLastError());
    const int limit = max_dynamic_smem(name);
    if (smem_bytes > limit)
      throw std::runtime_error(std::string(name) + ": the kernel needs " + std::to_string(smem_bytes) +
                               " bytes of shared memory per CTA and this GPU allows " + std::to_string(limit) +
                               " (the fused kernels' limits are in the README)");
    throw std::runtime_error(std::string(name) + " (shared-memory attribute): CUDA error: " + error);
  }
  bytes = smem_bytes;
}

template <typename... Args>
inline void allow_dynamic_smem(void (*kernel)(Args...), int smem_bytes, const char* name) {
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem_bytes, name);
}

// CTAs of `kernel` (`threads` threads, `smem_bytes` of dynamic shared memory) resident per SM on the
// current device; queried once per device and kernel. Failures name `name`.
template <auto kKernel>
int resident_ctas_per_sm(int threads, int smem_bytes, const char* name) {
  static std::atomic<int> cache[kCachedDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) check_launch(name);
  return once_per_device(cache, device, [&](int) {
    int blocks = 0;
    allow_dynamic_smem(kKernel, smem_bytes, name);
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernel, threads, smem_bytes) != cudaSuccess)
      check_launch(name);
    return blocks;
  });
}

}  // namespace evoformer
