// Host code shared by every attention instantiation: the TMA map encoding, and the launches of the
// mask-bias preparation and the backward's delta pass (preprocess.cuh).
#include <stdexcept>
#include <string>

#include "attention/preprocess.cuh"

namespace evoformer {

// Blocks of `threads` for one thread per item of `total`, capped at 2^20: the kernels below loop with a
// grid stride over what does not fit.
static unsigned grid_stride_blocks(int64_t total, int threads) {
  const int64_t blocks = (total + threads - 1) / threads;
  return unsigned(blocks < (int64_t(1) << 20) ? blocks : (int64_t(1) << 20));
}

template <typename T>
void launch_prepare_mask(const void* mask, const MaskLayout& layout, float inv_scale, float* out, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t total = int64_t(layout.Bm) * layout.Nm * layout.lk_pad;
  if (total == 0) return;
  prepare_mask_kernel<T><<<grid_stride_blocks(total, kThreads), kThreads, 0, stream>>>(static_cast<const T*>(mask),
                                                                                        layout, inv_scale, out, total);
  check_launch("evoformer mask-bias preparation");
}

template void launch_prepare_mask<cutlass::half_t>(const void*, const MaskLayout&, float, float*, cudaStream_t);
template void launch_prepare_mask<cutlass::bfloat16_t>(const void*, const MaskLayout&, float, float*, cudaStream_t);
template void launch_prepare_mask<float>(const void*, const MaskLayout&, float, float*, cudaStream_t);

void encode_tile_map(CUtensorMap* map, CUtensorMapDataType type, int element_bytes, const void* base,
                     const TileMapDim* dims, int rank, CUtensorMapSwizzle swizzle, const char* kernel,
                     const char* tensor) {
  auto what = [&] { return std::string(kernel) + " (" + tensor + " tensor map)"; };  // only on failure
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static const Encode encode = [] {  // the driver function, looked up once (no link against libcuda)
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<Encode>(fn);
  }();
  if (encode == nullptr) throw std::runtime_error(what() + ": the driver lacks cuTensorMapEncodeTiled");
  cuuint64_t extent[5], stride[4];
  cuuint32_t box[5], step[5];
  for (int i = 0; i < rank; ++i) {
    const bool used = i == 0 || dims[i].stride != 0;
    extent[i] = used ? cuuint64_t(dims[i].extent) : 1;
    box[i] = cuuint32_t(dims[i].box);
    step[i] = 1;
    // strides of dimensions 1.. in bytes; an unused one (extent 1) still needs a valid value
    if (i > 0) stride[i - 1] = used ? cuuint64_t(dims[i].stride) * element_bytes : 16;
  }
  const CUresult r = encode(map, type, cuuint32_t(rank), const_cast<void*>(base), extent, stride, box, step,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error(what() + ": cuTensorMapEncodeTiled failed with CUresult " + std::to_string(int(r)));
}

template <typename Element>
void launch_backward_delta(const AttentionParams& p, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t rows = int64_t(p.B) * p.N * p.Lq * p.H;
  backward_delta_kernel<Element><<<grid_stride_blocks(rows, kThreads), kThreads, 0, stream>>>(p);
  check_launch("evoformer backward delta");
}

template void launch_backward_delta<cutlass::bfloat16_t>(const AttentionParams&, cudaStream_t);
template void launch_backward_delta<cutlass::half_t>(const AttentionParams&, cudaStream_t);
template void launch_backward_delta<float>(const AttentionParams&, cudaStream_t);

}  // namespace evoformer
