// Host helpers shared by the bindings of every kernel family (the attention's and the block ops'
// *_bindings.cpp): error messages without iostreams, tensors made without a dispatcher call, poisoned
// outputs, the device's SM count and compute capability, and whether the Hopper kernels can run.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/core/TensorImpl.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/check_launch.h"
#include "common/kernel_limits.h"

namespace evoformer {

// Error messages of the bindings are joined without iostreams. With the torch 2.11 CUDA 13 wheel
// and Ubuntu's g++ 13.3, constructing an std::ostringstream inside an extension ends the process
// with SIGSEGV, and TORCH_CHECK joins a message of several pieces through one (c10::str, inlined
// here; c10::Join too). A message that is one std::string takes no stream, so EVO_CHECK joins the
// pieces itself.
namespace message {
inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, char v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void append(std::string& s, T v) {
  s += std::to_string(v);
}
inline void append(std::string& s, double v) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", v);
  s += text;
}
inline void append(std::string& s, at::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}
inline void append(std::string& s, const std::vector<std::string>& v) {  // "a, b, c"
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ", ";
    s += v[i];
  }
}
inline void append(std::string& s, at::ScalarType v) { s += c10::toString(v); }
inline void append(std::string& s, const at::Device& v) { s += v.str(); }

template <typename... Pieces>
std::string join(const Pieces&... pieces) {
  std::string s;
  (append(s, pieces), ...);
  return s;
}
}  // namespace message

// TORCH_CHECK with the message joined by message::join (evaluated only when `cond` fails).
#define EVO_CHECK(cond, ...) TORCH_CHECK(cond, ::evoformer::message::join(__VA_ARGS__))

// Tensors made without a dispatcher call. Every op call through the dispatcher costs host time (and
// is an ATen call in a profile); a binding that takes views of its operands for the kernels' pointers
// and strides, or allocates its outputs and scratch, made dozens per call through at::view, select,
// transpose and empty. These make the same tensors directly.
//
// A new CUDA tensor of `options`' dtype and device (at::empty's, without the dispatcher).
inline at::Tensor new_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::Tensor(at::detail::empty_cuda(sizes, options));
}

// `base`'s storage seen with `sizes`, `strides` and `offset` (elements from the storage's start): a
// view as at::as_strided makes one, without the dispatcher and without autograd's view tracking (it
// shares base's memory, not its version counter), for the tensors a binding reads or writes itself
// or returns as a new result.
inline at::Tensor raw_view(const at::Tensor& base, at::IntArrayRef sizes, at::IntArrayRef strides, int64_t offset) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(), base.dtype());
  impl->set_sizes_and_strides(sizes, strides, offset);
  return at::Tensor(std::move(impl));
}

// raw_view of a contiguous tensor with other sizes (its elements in the same order).
inline at::Tensor raw_reshape(const at::Tensor& base, at::IntArrayRef sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= sizes[d];
  }
  return raw_view(base, sizes, strides, base.storage_offset());
}

// `t` with its last two dims swapped (at::transpose(-2, -1)'s view, raw_view's way).
inline at::Tensor raw_transpose(const at::Tensor& t) {
  std::vector<int64_t> sizes(t.sizes().begin(), t.sizes().end()), strides(t.strides().begin(), t.strides().end());
  const size_t d = sizes.size();
  std::swap(sizes[d - 1], sizes[d - 2]);
  std::swap(strides[d - 1], strides[d - 2]);
  return raw_view(t, sizes, strides, t.storage_offset());
}

// t's `length` entries of dim `dim` from `start` (at::narrow's view, raw_view's way).
inline at::Tensor raw_narrow(const at::Tensor& t, int64_t dim, int64_t start, int64_t length) {
  std::vector<int64_t> sizes(t.sizes().begin(), t.sizes().end());
  sizes[dim] = length;
  return raw_view(t, sizes, t.strides(), t.storage_offset() + start * t.stride(dim));
}

// t with other sizes, its elements in the same order: raw_reshape where t is contiguous, else
// t.reshape (a view where the strides allow one, else a copy).
inline at::Tensor reshaped(const at::Tensor& t, at::IntArrayRef sizes) {
  return t.is_contiguous() ? raw_reshape(t, sizes) : t.reshape(sizes);
}

// x [..., C] as its rows [M, C] (reshaped).
inline at::Tensor flat_rows(const at::Tensor& x, int64_t C) {
  return C > 0 ? reshaped(x, {x.numel() / C, C}) : x.reshape({-1, C});
}

// at::linear(x, weight, bias) for x [..., in]: the GEMM at::linear runs for a contiguous x (addmm of
// the bias, else mm, on x's rows and weight's transposed view: the same call, so the same bits)
// without its reshape, transpose and view ops; at::linear itself for any other x.
inline at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const int64_t in = x.dim() >= 2 ? x.size(-1) : 0;
  if (in == 0 || x.numel() == 0 || !x.is_contiguous() || weight.dim() != 2 || (bias.has_value() && bias->dim() != 1))
    return at::linear(x, weight, bias);
  const at::Tensor rows = flat_rows(x, in);  // [M, in]
  const at::Tensor out = bias.has_value() ? at::addmm(*bias, rows, raw_transpose(weight))
                                          : at::mm(rows, raw_transpose(weight));  // [M, out]
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = weight.size(0);
  return raw_reshape(out, sizes);  // [..., out]
}

// Zeros [n] of `options`' dtype and CUDA device, made once per (device, dtype, n) and then shared:
// callers only read them (a concatenation copies them), as primitives._zeros's are on the Python
// side. A new one while the current stream captures a CUDA graph (its memory and fill would belong
// to the graph). The cache is never freed (nor torn down at exit, after the allocator).
inline at::Tensor cached_zeros(int64_t n, const at::TensorOptions& options) {
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None)
    return at::zeros({n}, options);
  using Key = std::tuple<int, int, int64_t>;  // device index, dtype, n
  static std::mutex mutex;
  static auto* cache = new std::map<Key, at::Tensor>();
  const Key key{options.device().index(), static_cast<int>(c10::typeMetaToScalarType(options.dtype())), n};
  std::lock_guard<std::mutex> lock(mutex);
  auto found = cache->find(key);
  if (found == cache->end()) found = cache->emplace(key, at::zeros({n}, options)).first;
  return found->second;
}

// Ticket counters for one launch whose CTAs take them through last_to_arrive (row_kernels.cuh),
// zero when that launch starts on `stream`, [n] unsigned on `device`. Outside graph capture they are
// the start of a buffer kept per (device, stream) and made zero once: the CTA that takes a counter's
// last ticket sets it back to zero, so the next launch on the stream finds it zero without a memset
// before it (stream order; a buffer that grows is freed into the caching allocator, which hands it
// out again only behind the launches already queued on the stream). While the stream captures a
// CUDA graph, counters of the graph's own, zeroed by a memset node: a replay may run beside other
// work on the capture stream. `*keep` holds such fresh counters until the launch is queued. The
// buffers are never freed (nor torn down at exit, after the allocator).
inline unsigned* zeroed_tickets(int64_t n, at::Device device, cudaStream_t stream, at::Tensor* keep) {
  const auto options = at::TensorOptions().dtype(at::kInt).device(device);
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    *keep = at::empty({n}, options);
    C10_CUDA_CHECK(cudaMemsetAsync(keep->data_ptr(), 0, n * sizeof(unsigned), stream));
    return reinterpret_cast<unsigned*>(keep->data_ptr());
  }
  using Key = std::pair<int, cudaStream_t>;  // device index, stream
  static std::mutex mutex;
  static auto* buffers = new std::map<Key, at::Tensor>();
  std::lock_guard<std::mutex> lock(mutex);
  at::Tensor& buffer = (*buffers)[Key{device.index(), stream}];
  if (!buffer.defined() || buffer.numel() < n) {
    buffer = at::empty({std::max<int64_t>(n, buffer.defined() ? 2 * buffer.numel() : 1024)}, options);
    C10_CUDA_CHECK(cudaMemsetAsync(buffer.data_ptr(), 0, buffer.numel() * sizeof(unsigned), stream));
  }
  return reinterpret_cast<unsigned*>(buffer.data_ptr());
}

// `t` in `dtype`: t itself where it has that dtype (Tensor::to would return it too, after a call
// through the dispatcher).
inline at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

// a [m, K] . b [K, n] for a K that counts positions (a weight's gradient: its rows of dy^T times
// the inputs, summed over every position), in a's dtype. cuBLAS 13.0 (the torch 2.11 CUDA 13 wheel)
// picks, for such long products of narrow matrices, split-K kernels that leave terms out of the sum
// where K is not a multiple of 256: on an H200, 85 of 2,476 bf16 and fp16 products swept (K from 100
// to 150,000, outputs 4 x 128 to 512 x 256) came back without their last rows, e.g. [128, 16,900] x
// [16,900, 128] (the triangle update's output weight at N_res 130). None of 336 products of a K that
// is a multiple of 256 did, nor any strided-batched one. So where K is not a multiple of 256 and longer
// than kRowsProductChunk, the sum runs as a batched product over S slices of K (float32 results,
// summed over the slices in a fixed order, then rounded once): slices of a length that divides K
// (positions are B N^2 or B N_seq N_res: such a length exists unless K is prime or nearly), else
// equal slices and one more product of the rows left over. Elsewhere it is at::mm.
constexpr int64_t kRowsProductChunk = 1024;
inline at::Tensor rows_product(const at::Tensor& a, const at::Tensor& b) {
  const int64_t m = a.size(0), K = a.size(1), n = b.size(1);
  if (K % 256 == 0 || K <= kRowsProductChunk) return at::mm(a, b);
  // slices of at least 256 rows, at most 128 of them and at most 32 MiB of float32 results (at least
  // 8: a batch of one may be split): the shortest length in [lo, 4 lo] dividing K
  const int64_t most = std::min<int64_t>(128, std::max<int64_t>(8, (int64_t(32) << 20) / (4 * m * n)));
  const int64_t lo = std::max<int64_t>(256, (K + most - 1) / most);
  int64_t per = 0;
  for (int64_t d = lo; d <= 4 * lo && per == 0; ++d)
    if (K % d == 0) per = d;
  if (per == 0) per = K / std::max<int64_t>(1, std::min<int64_t>(most, K / 256));  // equal slices, rows left over
  const int64_t slices = K / per, whole = slices * per;
  const auto product = [&](const at::Tensor& x, const at::Tensor& y) {  // float32 results
    return a.scalar_type() == at::kFloat ? at::bmm(x, y) : at::bmm(x, y, at::kFloat);
  };
  // [S, m, per] x [S, per, n]: slice s holds rows [s per, (s + 1) per) of K (views of a and b)
  const at::Tensor a3 = raw_view(a, {slices, m, per}, {per * a.stride(1), a.stride(0), a.stride(1)}, a.storage_offset());
  const at::Tensor b3 = raw_view(b, {slices, per, n}, {per * b.stride(0), b.stride(0), b.stride(1)}, b.storage_offset());
  at::Tensor sum = product(a3, b3).sum(0);  // [m, n] float32
  if (whole < K) {  // the rows past the slices (fewer than S): one more batch of one
    const at::Tensor a1 = raw_view(a, {1, m, K - whole}, {0, a.stride(0), a.stride(1)},
                                   a.storage_offset() + whole * a.stride(1));
    const at::Tensor b1 = raw_view(b, {1, K - whole, n}, {0, b.stride(0), b.stride(1)},
                                   b.storage_offset() + whole * b.stride(0));
    sum.add_(product(a1, b1).select(0, 0));
  }
  return as_dtype(sum, a.scalar_type());
}

// a [B, m, K] . b [B, K, n] for a K that counts positions (the outer product mean's sum over the
// sequences, its gradients' sums over residues and channels), in a's dtype. cuBLAS 13.0 treats a batch
// of one like a plain product and drops terms of it too: on an H200, 3 of 276 bf16 and fp16 batch-1
// products swept (outputs 128 x 128 to 3,072 x 3,072, K from 1,025 to 40,000; and [S, 32 N] x [32 N, 32 N])
// came back wrong, [384 x 384] at K 4,994, [512 x 512] at K 33,793 and [768 x 768] at K 11,713, none of
// an output of 1,024 x 1,024 or more. So a batch of one with K not a multiple of 256, longer than
// kRowsProductChunk and an output of at most kRowsBatchOutputs values runs as rows_product; every other
// product is at::bmm.
constexpr int64_t kRowsBatchOutputs = int64_t(1) << 20;
inline at::Tensor rows_bmm(const at::Tensor& a, const at::Tensor& b) {
  const int64_t K = a.size(2);
  if (a.size(0) != 1 || K % 256 == 0 || K <= kRowsProductChunk || a.size(1) * b.size(2) > kRowsBatchOutputs)
    return at::bmm(a, b);
  return rows_product(a.select(0, 0), b.select(0, 0)).unsqueeze(0);  // [1, m, n]
}

// EVOFORMER_BLOCKS_POISON=1 fills outputs with NaN before the kernels run, so a test sees any
// element a kernel fails to write (read once per process).
inline bool poison_outputs() {
  static const bool poison = [] {
    const char* env = std::getenv("EVOFORMER_BLOCKS_POISON");
    return env != nullptr && env[0] != '\0' && env[0] != '0';
  }();
  return poison;
}

inline void maybe_poison(at::Tensor& t) {
  if (poison_outputs() && t.defined() && t.numel() > 0) t.fill_(std::nan(""));
}

// Streaming multiprocessors of the current device, asked once per device (the row kernels' grids ask
// per launch).
inline int current_sm_count() {
  static std::atomic<int> cache[kCachedDevices];
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  return once_per_device(cache, device, [](int d) {
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, d));
    return sms;
  });
}

// Compute capability of `device` as major * 10 + minor, asked once per device.
inline int compute_capability(int64_t device) {
  static std::atomic<int> cache[kCachedDevices];
  EVO_CHECK(device >= 0 && device < kCachedDevices, "evoformer_blocks: CUDA device index ", device,
            " must be in [0, ", kCachedDevices, ")");
  return once_per_device(cache, int(device), [](int d) {
    int major = 0, minor = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d));
    return major * 10 + minor;
  });
}

// Whether the Hopper (sm_90a) kernels can run on `device`: a build holding sm_90a code and a device
// of compute capability 9.0 (the "sm90" kernel family; "sm80" runs on every device >= 8.0).
inline bool hopper_kernels_available(int64_t device) {
#ifdef EVOFORMER_SM90A
  return compute_capability(device) == limits::kSm90ComputeCapability;
#else
  (void)device;
  return false;
#endif
}

}  // namespace evoformer
