// Op kernels (TORCH_LIBRARY_IMPL) of the fused Evoformer attention: the guards that keep direct
// torch.ops calls memory-safe (the user-facing validation is Python's _inputs.validate), the biases'
// preparation into the layouts the kernels read (once per forward; the backward reuses it),
// dispatch to one instantiation of the family the caller chose, and the reductions of the
// bias-gradient partials to the biases' broadcast shapes.
//
// Ops (namespace evoformer_blocks_cuda, declared in evoformer_blocks/ops/_fused.py), CUDA only:
//   available_kernel_families(int device) -> str[]: the families this build can run on that device
//       ("sm80": compute capability >= 8.0; "sm90": also a build with sm_90a code and a 9.0 device).
//   kernel_smem_bytes(str family, ScalarType dtype, int head_dim, ScalarType? pair_dtype) -> int: the
//       most shared memory per block the family's kernels take for such inputs, forward or backward.
//   attach_portable_kernels(str library) -> (): a build whose architectures are all 9.0a keeps the
//       portable 16-bit kernels in a second library (portable_kernels.cu); this opens it, after which
//       the sm80 family runs 16-bit inputs too. Raises in other builds (they hold those kernels).
//   forward(Tensor q, Tensor k, Tensor v, Tensor? mask_bias, Tensor? pair_bias, float scale, str family)
//       -> (out [B,N,Lq,H,D], stats [B,N,H,Lq,2] fp32, mask_prepared, pair_prepared)
//       mask_prepared: the prepared mask float32 [B|1, N|1, Lk_pad] (evoformer_attention.h), [0] without
//       a mask bias. pair_prepared: [0] where the kernels read pair_bias in place (keys contiguous,
//       rows 16-byte aligned and a multiple of 16 bytes long), else the pair bias copied into kernel
//       layout [B|1, H|1, Lq, Lk_pad] (zero-padded).
//   gated_forward(the same arguments, Tensor gate, Tensor(a!) gated) -> the same results; also writes
//       gated = sigmoid(gate) * out (gate and gated [B, N, Lq, H, D] in q's dtype, D contiguous, gated's
//       rows aligned to two elements) in the forward's epilogue: the gated attention without a gate pass
//       (family "sm90" only).
//   backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor stats, Tensor mask_prepared,
//            Tensor? pair_bias, Tensor pair_prepared, float scale, str family, ScalarType? dmask_dtype,
//            bool need_dpair) -> (dq, dk, dv, dmask_bias, dpair_bias)
//       takes the forward's prepared tensors (and the caller's pair bias, read when pair_prepared is
//       [0]); dmask_dtype: the mask bias's dtype when its gradient is wanted, else None. dq, dk, dv
//       are dense and laid out like q, k, v (empty_in_memory_order). The bias gradients come in
//       their biases' broadcast shapes and dtypes; one not asked for is [0].
//   gated_attention_fwd(Tensor qkvg, Tensor? mask_bias, Tensor? pair_bias, int heads, bool transposed,
//                       float scale, str family) -> (y, out, stats, mask_prepared, pair_prepared)
//       the gated attention of a stacked projection qkvg [B, A, A', 4 H D] (q, k, v, gate g as column
//       blocks, read in place): y = sigmoid(g) * attention [B, A, A', H D], then forward's results
//   gated_attention_bwd(Tensor dy, Tensor qkvg, Tensor out, Tensor stats, Tensor mask_prepared,
//                       Tensor? pair_bias, Tensor pair_prepared, int heads, bool transposed, float scale,
//                       str family, ScalarType? dmask_dtype, bool need_dpair) -> (dqkvg, dmask_bias, dpair_bias)
//       dqkvg [B, A, A', 4 H D] contiguous; the bias gradients as backward returns them
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <cutlass/numeric_types.h>

#include "attention/attention_ops.h"
#include "attention/evoformer_attention.h"
#include "attention/kernel_entries.h"
#include "common/bindings_common.h"
#include "gating/gating_ops.h"

namespace evoformer {
namespace {

enum class Family { kSm80, kSm90 };

std::string describe(const char* name, const at::Tensor& t) {
  return message::join(name, ": shape=", t.sizes(), " dtype=", t.scalar_type(), " device=", t.device(),
                       " stride=", t.strides());
}

// float16, bfloat16 (EVOFORMER_KERNEL_ELEMENTS) or float32 (TF32 tensor cores, sm80 family, D up to
// limits::kTf32MaxHeadDim).
bool kernel_dtype(at::ScalarType dtype) {
#define EVOFORMER_DTYPE_CASE(scalar, element) \
  if (dtype == at::k##scalar) return true;
  EVOFORMER_KERNEL_ELEMENTS(EVOFORMER_DTYPE_CASE)
#undef EVOFORMER_DTYPE_CASE
  return dtype == at::kFloat;
}

int head_dim_bucket(int64_t head_dim) {
  for (int bucket : limits::kHeadDimBuckets)
    if (head_dim <= bucket) return bucket;
  EVO_CHECK(false, "evoformer attention: head dim ", head_dim, " exceeds the largest bucket");
  return 0;
}

#ifdef EVOFORMER_PORTABLE_APART
// A Hopper-only build keeps the portable 16-bit instantiations in a library of their own
// (portable_kernels.cu), which attach_portable_kernels opens; its entry point, or null before that.
std::atomic<PortableEntry> portable_entry{nullptr};

Kernels portable_16bit_kernels(bool bfloat16, int bucket, int pair) {
  const PortableEntry entry = portable_entry.load(std::memory_order_acquire);
  EVO_CHECK(entry != nullptr, "evoformer attention: this build keeps the portable (sm80) 16-bit kernels in a library "
            "built on first use, and it is not loaded: choose the family through evoformer_blocks "
            "(EVOFORMER_BLOCKS_KERNELS=sm80, ops.cutlass.kernel_family), which builds and loads it");
  Kernels kernels{};
  EVO_CHECK(entry(bfloat16, bucket, pair, &kernels) == 1 && kernels.forward != nullptr,
            "evoformer attention: the portable kernels' library holds no instantiation for bucket ", bucket,
            " and pair kind ", pair);
  return kernels;
}
#endif

// The one place that maps (family, dtype, head dim, pair kind) to an instantiation's entry points.
Kernels kernels_for(Family family, at::ScalarType dtype, int head_dim, int pair) {
  const int bucket = head_dim_bucket(head_dim);
  auto entries = [family, bucket, pair](auto element) -> Kernels {
    using E = decltype(element);
    return by_shape<limits::kMaxHeadDim, limits::kPairKinds>(bucket, pair, [family](auto dim, auto kind) {
      constexpr int D = decltype(dim)::value, P = decltype(kind)::value;
      if (family == Family::kSm90) return sm90_kernels<E, D, P>();
#ifdef EVOFORMER_PORTABLE_APART
      return portable_16bit_kernels(std::is_same_v<E, cutlass::bfloat16_t>, D, P);
#else
      return sm80_kernels<E, D, P>();
#endif
    });
  };
#define EVOFORMER_DTYPE_CASE(scalar, element) \
  if (dtype == at::k##scalar) return entries(element{});
  EVOFORMER_KERNEL_ELEMENTS(EVOFORMER_DTYPE_CASE)
#undef EVOFORMER_DTYPE_CASE
  if (dtype == at::kFloat) {  // TF32: the sm80 family only, its buckets and pair kinds (guard_qkv checked D)
    EVO_CHECK(family == Family::kSm80, "evoformer attention: float32 inputs run on the sm80 kernel family only "
              "(TF32 tensor cores); pass family `sm80`");
    EVO_CHECK(pair != kPairFloat, "evoformer attention: float32 inputs take a float32 pair bias as kPairInput");
    return by_shape<limits::kTf32MaxHeadDim, limits::kTf32PairKinds>(bucket, pair, [](auto dim, auto kind) {
      return sm80_kernels<float, decltype(dim)::value, decltype(kind)::value>();
    });
  }
  EVO_CHECK(false, "evoformer attention: no kernels for dtype ", dtype);
  return Kernels{};
}

// The op attach_portable_kernels: opens the portable 16-bit kernels' library of a Hopper-only build
// (once; later calls return at once) and dispatches the sm80 family's 16-bit calls to it.
void attach_portable_kernels(const std::string& library) {
#ifdef EVOFORMER_PORTABLE_APART
  static std::mutex opening;
  const std::lock_guard<std::mutex> lock(opening);
  if (portable_entry.load(std::memory_order_acquire) != nullptr) return;
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);  // kept open for the process's life
  const char* why = handle == nullptr ? dlerror() : nullptr;
  EVO_CHECK(handle != nullptr, "evoformer attention: cannot open the portable kernels' library `", library, "`: ",
            why ? why : "unknown error");
  void* entry = dlsym(handle, kPortableEntryName);
  EVO_CHECK(entry != nullptr, "evoformer attention: `", library, "` has no entry point ", kPortableEntryName);
  portable_entry.store(reinterpret_cast<PortableEntry>(entry), std::memory_order_release);
#else
  EVO_CHECK(false, "evoformer attention: this build holds the portable kernels itself; `", library,
            "` was not needed");
#endif
}

// The pair kind the kernels read for a pair bias of `pair` dtype with q of `dtype` (no pair bias: kNoPair).
int pair_kind_of(std::optional<at::ScalarType> pair, at::ScalarType dtype) {
  return !pair.has_value() ? kNoPair : *pair == dtype ? kPairInput : kPairFloat;
}

// The largest head dim the kernels of q's `dtype` take: float32 runs the TF32 kernels, whose buckets
// end lower (guard_qkv and kernel_smem_bytes apply it).
int64_t max_head_dim(at::ScalarType dtype) {
  return dtype == at::kFloat ? limits::kTf32MaxHeadDim : limits::kMaxHeadDim;
}

// The op kernel_smem_bytes: the most shared memory per block that the kernels of `family` take for q
// of `dtype` with head dim `head_dim` and a pair bias of `pair_dtype` (None: no pair bias), forward or
// backward (no device is asked: a build's instantiations answer for any device).
int64_t kernel_smem_bytes(const std::string& family, at::ScalarType dtype, int64_t head_dim,
                          std::optional<at::ScalarType> pair_dtype) {
  EVO_CHECK(family == "sm80" || family == "sm90", "evoformer attention: `family` must be `sm80` or `sm90`, got `",
            family, "`");
  // (guard_qkv's head-dim rules)
  EVO_CHECK(kernel_dtype(dtype) && head_dim > 0 && head_dim % limits::kHeadDimMultiple == 0 &&
                head_dim <= max_head_dim(dtype),
            "evoformer attention: no kernels for dtype ", dtype, " and head dim ", head_dim);
  const Kernels kernels = kernels_for(family == "sm90" ? Family::kSm90 : Family::kSm80, dtype, int(head_dim),
                                      pair_kind_of(pair_dtype, dtype));
  return std::max(kernels.forward_smem_bytes(), kernels.backward_smem_bytes());
}

std::vector<std::string> available_kernel_families(int64_t device) {
  const int capability = compute_capability(device);
  std::vector<std::string> families;
  if (capability >= limits::kMinComputeCapability) families.push_back("sm80");
  if (hopper_kernels_available(device)) families.push_back("sm90");
  return families;
}

// The family named by the caller, which must be available on `device`.
// (checked per call without building the list, which only the error message names)
Family family_on(const std::string& family, int64_t device) {
  const bool sm90 = family == "sm90";
  const bool available = sm90 ? hopper_kernels_available(device)
                              : family == "sm80" && compute_capability(device) >= limits::kMinComputeCapability;
  EVO_CHECK(available, "evoformer attention: `family` must be one of the kernel families this build runs on device ",
            device, " (", available_kernel_families(device), "), got `", family, "`");
  return sm90 ? Family::kSm90 : Family::kSm80;
}

// The guards forward and backward share, for q, k, v: one CUDA device, an instantiated dtype, rank 5
// with k, v [B, N, Lk, H, D] matching q [B, N, Lq, H, D], D within the kernels' limits, and the grids
// within theirs.
void guard_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"q", q}, {"k", k}, {"v", v}}) {
    EVO_CHECK(t.is_cuda() && t.dim() == 5 && kernel_dtype(t.scalar_type()),
              "evoformer attention: `", name, "` must be a float16, bfloat16 or float32 CUDA tensor [B, N, L, H, D]; ",
              describe(name, t));
    EVO_CHECK(t.scalar_type() == q.scalar_type() && t.device() == q.device(),
              "evoformer attention: q, k, v must share dtype and device; ", describe(name, t));
  }
  EVO_CHECK(k.sizes() == v.sizes(), "evoformer attention: k and v must have one shape; ", describe("k", k), "; ",
            describe("v", v));
  EVO_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3) && q.size(4) == k.size(4),
            "evoformer attention: k must be [B, N, Lk, H, D] with q's B, N, H, D; ", describe("q", q), "; ",
            describe("k", k));
  EVO_CHECK(q.numel() > 0 && k.numel() > 0, "evoformer attention: every dimension of q and k must be at least 1; ",
            describe("q", q), "; ", describe("k", k));
  const int64_t d = q.size(4);
  EVO_CHECK(d % limits::kHeadDimMultiple == 0 && d <= limits::kMaxHeadDim,
            "evoformer attention: head dim D must be a multiple of ", limits::kHeadDimMultiple, " and at most ",
            limits::kMaxHeadDim, "; ", describe("q", q));
  EVO_CHECK(d <= max_head_dim(q.scalar_type()),
            "evoformer attention: float32 inputs (TF32 kernels) need head dim D at most ", limits::kTf32MaxHeadDim,
            "; ", describe("q", q));
  const int64_t tiles = (std::max(q.size(2), k.size(2)) + limits::kRowTile - 1) / limits::kRowTile;
  EVO_CHECK(q.size(0) * q.size(1) * tiles < (int64_t(1) << limits::kMaxGridXLog2) && q.size(3) <= limits::kMaxHeads,
            "evoformer attention: B * N * ceil(L / ", limits::kRowTile, ") must be below 2^", limits::kMaxGridXLog2,
            " and H at most ", limits::kMaxHeads, "; ", describe("q", q));
}

// `t` (dout, out) must be a CUDA tensor of q's dtype, shape and device.
void guard_like_q(const char* name, const at::Tensor& t, const at::Tensor& q) {
  EVO_CHECK(t.device() == q.device() && t.scalar_type() == q.scalar_type() && t.sizes() == q.sizes(),
            "evoformer attention backward: `", name, "` must match q's shape, dtype and device; ", describe(name, t),
            "; ", describe("q", q));
}

// A tensor the kernels write at its strides (two elements at a time): `like`'s shape, dtype and
// device, D contiguous, even strides and a pointer aligned to two elements.
void guard_strided_out(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like) {
  bool ok = t.device() == like.device() && t.scalar_type() == like.scalar_type() && t.sizes() == like.sizes() &&
            t.stride(4) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % (2 * t.element_size()) == 0;
  for (int d = 0; d < 4; ++d) ok = ok && t.stride(d) % 2 == 0;
  EVO_CHECK(ok, op, ": `", name, "` must match its input's shape, dtype and device, with D contiguous and even row ",
            "strides; ", describe(name, t), "; ", describe("input", like));
}

// A caller's buffer for a gradient of q, k or v: like its input, D contiguous and every row aligned
// to two elements (the kernels store pairs of elements). Absent: the binding allocates a contiguous one.
void guard_gradient_out(const char* name, const std::optional<at::Tensor>& t, const at::Tensor& like) {
  if (t.has_value()) guard_strided_out("evoformer attention backward", name, *t, like);
}

void check_scale(double scale) {
  EVO_CHECK(std::isfinite(scale) && scale > 0, "evoformer attention: `scale` must be positive and finite, got ", scale);
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// A stride the kernel can use: 0 for a size-1 dimension (never stepped over).
int64_t kstride(const at::Tensor& t, int dim) { return t.size(dim) == 1 ? 0 : t.stride(dim); }

// q/k/v/out/dout as the kernels read them: D contiguous, every row 16-byte aligned. Copies only
// when the given layout does not allow that.
at::Tensor kernel_layout(const at::Tensor& t) {
  const int64_t per_chunk = limits::kRowAlignBytes / t.element_size();
  bool ok = t.stride(4) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % limits::kRowAlignBytes == 0;
  for (int d = 0; d < 4; ++d) ok = ok && kstride(t, d) % per_chunk == 0;
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

// A new dense [B, N, L, H, D] tensor laid out like t: its (b, n, l, h) dims in the order of t's
// strides (largest first, ties in dim order), D innermost. The gradient of a permuted view then
// has the permuted layout, and whoever permutes it back gets a contiguous tensor, not a copy.
// The fake implementation (ops/cutlass.py, memory_order) orders the dims the same way.
at::Tensor empty_in_memory_order(const at::Tensor& t) {
  std::vector<int64_t> order = {0, 1, 2, 3};
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return t.stride(a) > t.stride(b); });
  order.push_back(4);
  return at::empty_permuted(t.sizes(), order, t.options());
}

// The kernel strides (b, n, l, h) of a [B, N, L, H, D] tensor.
RowStrides row_strides(const at::Tensor& t) {
  return RowStrides{kstride(t, 0), kstride(t, 1), kstride(t, 2), kstride(t, 3)};
}

// The parameters every launch shares: q, k, v in kernel layout (kept alive by the caller), the
// sizes and the scale.
struct Operands {
  at::Tensor q, k, v;  // [B, N, Lq, H, D], [B, N, Lk, H, D] x 2
  AttentionParams p{};
};
Operands operands(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, double scale) {
  Operands r;
  r.q = kernel_layout(q_in), r.k = kernel_layout(k_in), r.v = kernel_layout(v_in);
  AttentionParams& p = r.p;
  p.q = r.q.data_ptr(), p.k = r.k.data_ptr(), p.v = r.v.data_ptr();
  p.q_strides = row_strides(r.q), p.k_strides = row_strides(r.k), p.v_strides = row_strides(r.v);
  p.B = int(r.q.size(0)), p.N = int(r.q.size(1)), p.Lq = int(r.q.size(2)), p.Lk = int(r.k.size(2));
  p.H = int(r.q.size(3)), p.D = int(r.q.size(4));
  p.scale = float(scale), p.inv_scale = float(1.0 / scale), p.scale_log2 = float(scale * M_LOG2E);
  return r;
}

// Keys of the prepared mask: Lk rounded up to whole 16-byte float32 rows.
int64_t mask_lk_pad(int64_t lk) { return round_up(lk, limits::kRowAlignBytes / int64_t(sizeof(float))); }

// Points p at a prepared mask (float32 [B|1, N|1, Lk_pad] contiguous, guarded here) or, for [0], at none.
void use_mask(AttentionParams& p, const at::Tensor& prepared, const at::Tensor& q) {
  p.mask_scaled = nullptr;
  p.mask_stride_b = p.mask_stride_n = 0;
  if (prepared.numel() == 0) return;
  const int64_t lk_pad = mask_lk_pad(p.Lk);
  EVO_CHECK(prepared.device() == q.device() && prepared.scalar_type() == at::kFloat && prepared.dim() == 3 &&
                (prepared.size(0) == p.B || prepared.size(0) == 1) &&
                (prepared.size(1) == p.N || prepared.size(1) == 1) && prepared.size(2) == lk_pad &&
                prepared.is_contiguous(),
            "evoformer attention: `mask_prepared` must be the forward's contiguous float32 [B|1, N|1, ", lk_pad,
            "] on q's device, or [0]; ", describe("mask_prepared", prepared));
  p.mask_scaled = prepared.data_ptr<float>();
  p.mask_stride_b = prepared.size(0) == 1 ? 0 : prepared.size(1) * lk_pad;
  p.mask_stride_n = prepared.size(1) == 1 ? 0 : lk_pad;
}

// The prepared mask (evoformer_attention.h) of mask_bias [B|1, N|1, 1, 1, Lk] in one launch, or [0]
// without one; points p at it. Needs p's sizes and scale set.
at::Tensor prepare_mask(AttentionParams& p, const std::optional<at::Tensor>& mask_bias, const at::Tensor& q) {
  if (!mask_bias.has_value()) {
    use_mask(p, at::Tensor(), q);
    return new_empty({0}, q.options().dtype(at::kFloat));
  }
  const at::Tensor& m = *mask_bias;
  EVO_CHECK(m.device() == q.device() &&
                (m.scalar_type() == at::kHalf || m.scalar_type() == at::kBFloat16 || m.scalar_type() == at::kFloat),
            "evoformer attention: `mask_bias` must be a float16, bfloat16 or float32 tensor on q's device; ",
            describe("mask_bias", m));
  EVO_CHECK(m.dim() == 5 && (m.size(0) == p.B || m.size(0) == 1) && (m.size(1) == p.N || m.size(1) == 1) &&
                m.size(2) == 1 && m.size(3) == 1 && m.size(4) == p.Lk,
            "evoformer attention: `mask_bias` must be [B|1, N|1, 1, 1, Lk]; ", describe("mask_bias", m), "; ",
            describe("q", q));
  const int64_t bm = m.size(0), nm = m.size(1), lk_pad = mask_lk_pad(p.Lk);
  at::Tensor prepared = new_empty({bm, nm, lk_pad}, m.options().dtype(at::kFloat));  // [B|1, N|1, Lk_pad]
  const MaskLayout layout{kstride(m, 0), kstride(m, 1), m.stride(4), int(bm), int(nm), p.Lk, int(lk_pad)};
  auto launch = [&](auto element) {
    launch_prepare_mask<decltype(element)>(m.data_ptr(), layout, p.inv_scale, prepared.data_ptr<float>(),
                                           c10::cuda::getCurrentCUDAStream());
  };
  if (m.scalar_type() == at::kHalf)
    launch(cutlass::half_t{});
  else if (m.scalar_type() == at::kBFloat16)
    launch(cutlass::bfloat16_t{});
  else
    launch(float{});
  use_mask(p, prepared, q);
  return prepared;
}

// Whether t [B|1, H|1, Lq, Lk(_pad)] is in the kernels' pair-bias layout: keys contiguous, every row
// 16-byte aligned and readable to a multiple of 16 bytes. Python's pair_needs_copy (ops/cutlass.py)
// applies the same rule to the metadata, for the fake implementation's pair_prepared; here the
// pointer is checked too (a storage whose start is not 16-byte aligned gets a copy).
bool pair_in_kernel_layout(const at::Tensor& t) {
  const int64_t per_chunk = limits::kRowAlignBytes / t.element_size();
  bool ok = t.stride(3) == 1 && t.size(3) % per_chunk == 0 &&
            reinterpret_cast<uintptr_t>(t.data_ptr()) % limits::kRowAlignBytes == 0;
  for (int d = 0; d < 3; ++d) ok = ok && kstride(t, d) % per_chunk == 0;
  return ok;
}

// pair_bias [B|1, 1, H|1, Lq, Lk] on q's device, q's dtype or float32 (guarded here), as the
// [B|1, H|1, Lq, Lk] view the kernels read.
at::Tensor pair_view(const at::Tensor& pb, const AttentionParams& p, const at::Tensor& q) {
  EVO_CHECK(pb.device() == q.device() && (pb.scalar_type() == q.scalar_type() || pb.scalar_type() == at::kFloat),
            "evoformer attention: `pair_bias` must be on q's device with q's dtype or float32; ",
            describe("pair_bias", pb), "; ", describe("q", q));
  EVO_CHECK(pb.dim() == 5 && (pb.size(0) == p.B || pb.size(0) == 1) && pb.size(1) == 1 &&
                (pb.size(2) == p.H || pb.size(2) == 1) && pb.size(3) == p.Lq && pb.size(4) == p.Lk,
            "evoformer attention: `pair_bias` must be [B|1, 1, H|1, Lq, Lk]; ", describe("pair_bias", pb), "; ",
            describe("q", q));
  return raw_view(pb, {pb.size(0), pb.size(2), pb.size(3), pb.size(4)},
                  {pb.stride(0), pb.stride(2), pb.stride(3), pb.stride(4)}, pb.storage_offset());  // pb[:, 0]
}

// Points p at the pair-bias tensor the kernels read (t [B|1, H|1, Lq, Lk(_pad)] in kernel layout)
// and returns its pair kind: kPairInput in q's dtype (float32 for float32 q), else kPairFloat.
int use_pair(AttentionParams& p, const at::Tensor& t, const at::Tensor& q) {
  p.pair = t.data_ptr();
  p.pair_stride_b = kstride(t, 0);
  p.pair_stride_h = kstride(t, 1);
  p.pair_stride_q = t.stride(2);
  return pair_kind_of(t.scalar_type(), q.scalar_type());
}

// The forward's pair bias: pair_bias itself where it is in kernel layout ([0] returned), else a
// zero-padded copy in kernel layout (returned, read by the kernels). Sets p and the pair kind.
at::Tensor prepare_pair(AttentionParams& p, int& pair_kind, const std::optional<at::Tensor>& pair_bias,
                        const at::Tensor& q) {
  p.pair = nullptr;
  p.pair_stride_b = p.pair_stride_h = p.pair_stride_q = 0;
  pair_kind = kNoPair;
  if (!pair_bias.has_value()) return new_empty({0}, q.options());
  const at::Tensor t = pair_view(*pair_bias, p, q);  // [B|1, H|1, Lq, Lk]
  if (pair_in_kernel_layout(t)) {
    pair_kind = use_pair(p, t, q);
    return new_empty({0}, t.options());
  }
  const int64_t per_chunk = limits::kRowAlignBytes / t.element_size();
  at::Tensor padded = at::zeros({t.size(0), t.size(1), p.Lq, round_up(p.Lk, per_chunk)}, t.options());  // [B|1, H|1, Lq, Lk_pad]
  padded.narrow(3, 0, p.Lk).copy_(t);  // keys past Lk stay zero
  pair_kind = use_pair(p, padded, q);
  return padded;
}

// The forward of both entry points below; gate_in / gated: the gated attention's gate and the
// caller's output for y = sigmoid(gate) * out (both or neither).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> run_forward(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const std::optional<at::Tensor>& mask_bias,
    const std::optional<at::Tensor>& pair_bias, double scale, const std::string& family,
    const at::Tensor* gate_in = nullptr, at::Tensor* gated = nullptr) {
  guard_qkv(q_in, k_in, v_in);
  at::Tensor gate;
  if (gated != nullptr) {
    const char* op = "evoformer gated attention";
    EVO_CHECK(gate_in->device() == q_in.device() && gate_in->scalar_type() == q_in.scalar_type() &&
                  gate_in->sizes() == q_in.sizes() && gate_in->stride(4) == 1,
              op, ": `gate` must match q's shape, dtype and device with D contiguous; ", describe("gate", *gate_in),
              "; ", describe("q", q_in));
    guard_strided_out(op, "gated", *gated, q_in);
    for (const at::Tensor* t : {&q_in, &k_in, &v_in, gate_in})
      EVO_CHECK(!gated->is_alias_of(*t), op, ": `gated` must not share storage with q, k, v or gate; ",
                describe("gated", *gated));
    gate = kernel_layout(*gate_in);
  }
  check_scale(scale);
  const Family fam = family_on(family, q_in.get_device());
  EVO_CHECK(gated == nullptr || fam == Family::kSm90,
            "evoformer gated attention: the gated forward runs on the sm90 kernel family only, got \"", family, "\"");
  const c10::cuda::CUDAGuard guard(q_in.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  Operands ops = operands(q_in, k_in, v_in, scale);
  AttentionParams& p = ops.p;
  const at::Tensor& q = ops.q;
  at::Tensor mask_prepared = prepare_mask(p, mask_bias, q);
  int pair_kind = kNoPair;
  at::Tensor pair_prepared = prepare_pair(p, pair_kind, pair_bias, q);

  at::Tensor out = new_empty({p.B, p.N, p.Lq, p.H, p.D}, q.options());
  at::Tensor stats = new_empty({p.B, p.N, p.H, p.Lq, 2}, q.options().dtype(at::kFloat));
  maybe_poison(out);
  maybe_poison(stats);
  if (gated != nullptr) maybe_poison(*gated);
  p.out = out.data_ptr();
  p.o_strides = row_strides(out);
  p.stats = stats.data_ptr<float>();
  if (gated != nullptr) {
    p.gate = gate.data_ptr(), p.g_strides = row_strides(gate);
    p.gated = gated->data_ptr(), p.y_strides = row_strides(*gated);
  }
  kernels_for(fam, q.scalar_type(), p.D, pair_kind).forward(p, stream);
  return {out, stats, mask_prepared, pair_prepared};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask_bias,
    const std::optional<at::Tensor>& pair_bias, double scale, const std::string& family) {
  return run_forward(q, k, v, mask_bias, pair_bias, scale, family);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask_bias,
    const std::optional<at::Tensor>& pair_bias, double scale, const std::string& family,
    const at::Tensor& gate, at::Tensor& gated) {
  return run_forward(q, k, v, mask_bias, pair_bias, scale, family, &gate, &gated);
}

// Rows n summed by one CTA of the pair-bias gradient kernel. Its grid is ctas_per_chunk CTAs per
// n-chunk, each looping over the chunk's rows; with `slots` CTAs resident on the GPU its time goes
// as waves * (rows per chunk + a per-CTA overhead of about two rows). The count that (nearly)
// minimises this is taken, so the last wave is not left mostly empty; each chunk costs a
// [B, H, Lq, Lk] fp32 partial, 256 MiB in all at most.
int choose_n_chunk_size(const AttentionParams& p, int blocks_per_sm) {
  constexpr int kBlockQ = limits::kPairGradTileQueries, kBlockK = limits::kPairGradTileKeys;
  const int64_t slots = int64_t(current_sm_count()) * std::max(blocks_per_sm, 1);
  const int64_t ctas_per_chunk =
      int64_t(p.B) * p.H * ((p.Lq + kBlockQ - 1) / kBlockQ) * ((p.Lk + kBlockK - 1) / kBlockK);
  const int64_t slab_bytes = int64_t(p.B) * p.H * p.Lq * p.Lk * 4;
  const int64_t budget_chunks = std::max<int64_t>(1, (int64_t(256) << 20) / std::max<int64_t>(slab_bytes, 1));
  // Beyond ~16 waves the last wave's waste is small; no need to search further.
  const int64_t max_chunks = std::max<int64_t>(1, std::min<int64_t>({int64_t(p.N), budget_chunks, 16 * slots / ctas_per_chunk + 1}));
  constexpr int64_t kOverheadRows = 2;
  auto cost = [&](int64_t chunks) {
    const int64_t waves = (chunks * ctas_per_chunk + slots - 1) / slots;
    return waves * ((p.N + chunks - 1) / chunks + kOverheadRows);
  };
  int64_t best_cost = cost(1);
  for (int64_t chunks = 2; chunks <= max_chunks; ++chunks) best_cost = std::min(best_cost, cost(chunks));
  // The fewest chunks within 3 % of the best: memory for the partials grows with the count.
  int64_t chunks = 1;
  while (cost(chunks) * 100 > best_cost * 103) ++chunks;
  return int((p.N + chunks - 1) / chunks);
}

// The backward of the ops backward and gated_attention_bwd; dq_out, dk_out, dv_out: the caller's
// gradient tensors (any layout with D contiguous and even row strides: the gated attention's are
// column blocks of its projection's gradient), or absent (new ones laid out like q, k, v);
// delta_in: rowsum(dout * out) [B, N, H, Lq] float32 contiguous, summed by the caller (the gated
// attention's gate backward), or absent (the delta pass runs).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> run_backward(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& stats_in, const at::Tensor& mask_prepared,
    const std::optional<at::Tensor>& pair_bias, const at::Tensor& pair_prepared, double scale,
    const std::string& family, std::optional<at::ScalarType> dmask_dtype, bool need_dpair,
    const std::optional<at::Tensor>& dq_out, const std::optional<at::Tensor>& dk_out,
    const std::optional<at::Tensor>& dv_out, const std::optional<at::Tensor>& delta_in = std::nullopt) {
  guard_qkv(q_in, k_in, v_in);
  guard_gradient_out("dq_out", dq_out, q_in);
  guard_gradient_out("dk_out", dk_out, k_in);
  guard_gradient_out("dv_out", dv_out, v_in);
  check_scale(scale);
  guard_like_q("dout", dout_in, q_in);
  guard_like_q("out", out_in, q_in);
  EVO_CHECK(stats_in.device() == q_in.device() && stats_in.scalar_type() == at::kFloat && stats_in.dim() == 5 &&
                stats_in.size(0) == q_in.size(0) && stats_in.size(1) == q_in.size(1) &&
                stats_in.size(2) == q_in.size(3) && stats_in.size(3) == q_in.size(2) && stats_in.size(4) == 2,
            "evoformer attention backward: `stats` must be float32 [B, N, H, Lq, 2] on q's device; ",
            describe("stats", stats_in));
  const Family fam = family_on(family, q_in.get_device());
  const c10::cuda::CUDAGuard guard(q_in.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  Operands ops = operands(q_in, k_in, v_in, scale);
  AttentionParams& p = ops.p;
  const at::Tensor &q = ops.q, &k = ops.k, &v = ops.v;

  // The forward's prepared biases.
  use_mask(p, mask_prepared, q);
  int pair_kind = kNoPair;
  if (pair_bias.has_value()) {
    at::Tensor t = pair_view(*pair_bias, p, q);  // [B|1, H|1, Lq, Lk]
    if (pair_prepared.numel() > 0) {  // the forward's copy [B|1, H|1, Lq, Lk_pad]
      EVO_CHECK(pair_prepared.device() == q.device() && pair_prepared.scalar_type() == t.scalar_type() &&
                    pair_prepared.dim() == 4 && pair_prepared.size(0) == t.size(0) &&
                    pair_prepared.size(1) == t.size(1) && pair_prepared.size(2) == p.Lq &&
                    pair_prepared.size(3) >= p.Lk,
                "evoformer attention backward: `pair_prepared` must be the forward's copy of `pair_bias` or [0]; ",
                describe("pair_prepared", pair_prepared), "; ", describe("pair_bias", *pair_bias));
      t = pair_prepared;
    }
    EVO_CHECK(pair_in_kernel_layout(t),
              "evoformer attention backward: the pair bias the kernels read must be in kernel layout (the forward's "
              "`pair_prepared` when it made a copy); ",
              describe("pair_bias", *pair_bias), "; ", describe("pair_prepared", pair_prepared));
    pair_kind = use_pair(p, t, q);
  } else {
    EVO_CHECK(pair_prepared.numel() == 0, "evoformer attention backward: `pair_prepared` without `pair_bias`; ",
              describe("pair_prepared", pair_prepared));
  }
  const bool need_dmask = dmask_dtype.has_value() && p.mask_scaled != nullptr;
  need_dpair = need_dpair && pair_kind != kNoPair;

  const at::Tensor out = kernel_layout(out_in), dout = kernel_layout(dout_in), stats = stats_in.contiguous();
  p.out = out.data_ptr();
  p.o_strides = row_strides(out);
  p.dout = dout.data_ptr();
  p.do_strides = row_strides(dout);
  p.stats = const_cast<float*>(stats.data_ptr<float>());

  const Kernels kernels = kernels_for(fam, q.scalar_type(), p.D, pair_kind);
  const auto f32 = q.options().dtype(at::kFloat);
  p.delta_ready = delta_in.has_value() && delta_in->defined();
  if (p.delta_ready) {
    EVO_CHECK(delta_in->device() == q.device() && delta_in->scalar_type() == at::kFloat && delta_in->is_contiguous() &&
                  delta_in->sizes() == at::IntArrayRef({p.B, p.N, p.H, p.Lq}),
              "evoformer attention backward: `delta` must be float32 [B, N, H, Lq] contiguous on q's device; ",
              describe("delta", *delta_in));
  }
  at::Tensor delta = p.delta_ready ? *delta_in : new_empty({p.B, p.N, p.H, p.Lq}, f32);
  // dq, dk, dv in the layouts q, k, v came in (not the kernel-layout copies: the fake sees those); a
  // new one only where the caller gave none (value_or would allocate one either way)
  const auto gradient = [](const std::optional<at::Tensor>& given, const at::Tensor& like) {
    return given.has_value() ? *given : empty_in_memory_order(like);
  };
  at::Tensor dq = gradient(dq_out, q_in), dk = gradient(dk_out, k_in), dv = gradient(dv_out, v_in);
  at::Tensor dmask_part = need_dmask ? new_empty({p.B, p.N, p.H, p.Lk}, f32) : at::Tensor();  // [B, N, H, Lk]
  p.n_chunk_size = need_dpair ? choose_n_chunk_size(p, kernels.pair_grad_blocks_per_sm()) : p.N;
  p.n_chunks = (p.N + p.n_chunk_size - 1) / p.n_chunk_size;
  at::Tensor dpair_part = need_dpair ? new_empty({p.n_chunks, p.B, p.H, p.Lq, p.Lk}, f32) : at::Tensor();  // [chunks, B, H, Lq, Lk]
  for (at::Tensor* t : {&dq, &dk, &dv, &dmask_part, &dpair_part}) maybe_poison(*t);
  if (!p.delta_ready) maybe_poison(delta);
  p.delta = delta.data_ptr<float>();
  p.dq = dq.data_ptr(), p.dk = dk.data_ptr(), p.dv = dv.data_ptr();
  p.dq_strides = row_strides(dq), p.dk_strides = row_strides(dk), p.dv_strides = row_strides(dv);
  p.dmask = need_dmask ? dmask_part.data_ptr<float>() : nullptr;
  p.dpair = need_dpair ? dpair_part.data_ptr<float>() : nullptr;
  kernels.backward(p, stream);

  // Reduce the partials to the biases' own (broadcast) shapes and dtypes; fixed-order torch sums.
  at::Tensor dmask = new_empty({0}, q.options()), dpair = new_empty({0}, q.options());
  if (need_dmask) {
    at::Tensor r = dmask_part.sum(2);  // [B, N, Lk]
    if (mask_prepared.size(0) == 1) r = r.sum(0, /*keepdim=*/true);
    if (mask_prepared.size(1) == 1) r = r.sum(1, /*keepdim=*/true);
    dmask = r.view({mask_prepared.size(0), mask_prepared.size(1), 1, 1, p.Lk}).to(*dmask_dtype);  // [B|1, N|1, 1, 1, Lk]
  }
  if (need_dpair) {
    const at::Tensor& pb = *pair_bias;
    // (contiguous; a sum over a dim of size 1 would copy it unchanged)
    at::Tensor r = p.n_chunks == 1 ? raw_reshape(dpair_part, {p.B, p.H, p.Lq, p.Lk}) : dpair_part.sum(0);  // [B, H, Lq, Lk]
    if (pb.size(0) == 1 && r.size(0) != 1) r = r.sum(0, /*keepdim=*/true);
    if (pb.size(2) == 1 && r.size(1) != 1) r = r.sum(1, /*keepdim=*/true);
    const std::vector<int64_t> sizes = {r.size(0), 1, r.size(1), p.Lq, p.Lk};  // [B|1, 1, H|1, Lq, Lk]
    if (pb.scalar_type() == at::kFloat) {
      dpair = raw_reshape(r, sizes);
    } else {
      dpair = new_empty(sizes, r.options().dtype(pb.scalar_type()));
      raw_reshape(dpair, r.sizes()).copy_(r);  // rounded to the pair bias's dtype
    }
  }
  return {dq, dk, dv, dmask, dpair};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& stats, const at::Tensor& mask_prepared, const std::optional<at::Tensor>& pair_bias,
    const at::Tensor& pair_prepared, double scale, const std::string& family,
    std::optional<at::ScalarType> dmask_dtype, bool need_dpair) {
  return run_backward(dout, q, k, v, out, stats, mask_prepared, pair_bias, pair_prepared, scale, family, dmask_dtype,
                      need_dpair, std::nullopt, std::nullopt, std::nullopt);
}

// ---- the gated attention of a stacked projection (ops.gated_evoformer_attention) ----
// qkvg [B, A, A', 4 H D] holds q, k, v and the gate g as four column blocks. The attention runs along
// A' (N = A, L = A') or, transposed, along A (N = A', L = A); nothing is copied: q, k, v are strided
// views in the attention's orientation [B, N, L, H, D] and g stays [B, A, A', H D].
struct GatedViews {
  at::Tensor q, k, v, g;
};

GatedViews gated_views(const at::Tensor& qkvg, int64_t heads, bool transposed) {
  const char* op = "evoformer gated attention";
  EVO_CHECK(qkvg.dim() == 4 && heads > 0 && qkvg.size(3) % (4 * heads) == 0, op,
            ": `qkvg` must be [B, A, A', 4 H D] with H = heads = ", heads, "; ", describe("qkvg", qkvg));
  const int64_t D = qkvg.size(3) / (4 * heads), width = heads * D;
  const int64_t s0 = qkvg.stride(0), s1 = qkvg.stride(1), s2 = qkvg.stride(2), s3 = qkvg.stride(3);
  const int64_t n = transposed ? qkvg.size(2) : qkvg.size(1), l = transposed ? qkvg.size(1) : qkvg.size(2);
  const int64_t sn = transposed ? s2 : s1, sl = transposed ? s1 : s2, start = qkvg.storage_offset();
  // block i of the last dim seen as [B, N, L, H, D] (attention along A', or along A when transposed)
  const auto block = [&](int64_t i) {
    return raw_view(qkvg, {qkvg.size(0), n, l, heads, D}, {s0, sn, sl, D * s3, s3}, start + i * width * s3);
  };
  at::Tensor g = raw_view(qkvg, {qkvg.size(0), qkvg.size(1), qkvg.size(2), width}, {s0, s1, s2, s3},
                          start + 3 * width * s3);  // g [B, A, A', H D]
  return {block(0), block(1), block(2), g};
}

// [B, A, A', H D] (the gate's layout) as [B, N, L, H, D] (the attention's), a view.
at::Tensor attention_view(const at::Tensor& t, int64_t heads, bool transposed) {
  const int64_t D = t.size(3) / heads;
  const int64_t n = transposed ? t.size(2) : t.size(1), l = transposed ? t.size(1) : t.size(2);
  const int64_t sn = transposed ? t.stride(2) : t.stride(1), sl = transposed ? t.stride(1) : t.stride(2);
  return raw_view(t, {t.size(0), n, l, heads, D}, {t.stride(0), sn, sl, D * t.stride(3), t.stride(3)},
                  t.storage_offset());
}

// The attention output [B, N, L, H, D] as [B, A, A', H D] (the inverse of attention_view), a view
// where its (H, D) dims flatten into one (the kernels' outputs: contiguous), else a copy.
at::Tensor gated_output_view(const at::Tensor& out, bool transposed) {
  if (out.stride(3) != out.size(4) * out.stride(4)) return (transposed ? out.transpose(1, 2) : out).flatten(-2);
  const int64_t a = transposed ? out.size(2) : out.size(1), a2 = transposed ? out.size(1) : out.size(2);
  const int64_t sa = transposed ? out.stride(2) : out.stride(1), sa2 = transposed ? out.stride(1) : out.stride(2);
  return raw_view(out, {out.size(0), a, a2, out.size(3) * out.size(4)}, {out.stride(0), sa, sa2, out.stride(4)},
                  out.storage_offset());
}

}  // namespace

// (y = sigmoid(g) * attention(q, k, v) [B, A, A', H D] contiguous, then forward's out, stats,
// mask_prepared, pair_prepared). The sm90 family writes y in the attention's epilogue; sm80 runs the
// gate kernel on out after it.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_attention_fwd(
    const at::Tensor& qkvg, const std::optional<at::Tensor>& mask_bias, const std::optional<at::Tensor>& pair_bias,
    int64_t heads, bool transposed, double scale, const std::string& family) {
  const GatedViews in = gated_views(qkvg, heads, transposed);
  if (family != "sm90") {
    auto [out, stats, mask_prepared, pair_prepared] =
        run_forward(in.q, in.k, in.v, mask_bias, pair_bias, scale, family);  // out [B, N, L, H, D]
    at::Tensor y = block::sigmoid_gate_forward(in.g, gated_output_view(out, transposed));  // [B, A, A', H D]
    return {y, out, stats, mask_prepared, pair_prepared};
  }
  at::Tensor y = new_empty(in.g.sizes(), in.g.options());  // [B, A, A', H D]
  at::Tensor gated = attention_view(y, heads, transposed);  // [B, N, L, H, D]
  const at::Tensor gate = attention_view(in.g, heads, transposed);
  auto [out, stats, mask_prepared, pair_prepared] =
      run_forward(in.q, in.k, in.v, mask_bias, pair_bias, scale, family, &gate, &gated);
  return {y, out, stats, mask_prepared, pair_prepared};
}

// (d qkvg [B, A, A', 4 H D] contiguous, d mask_bias, d pair_bias as backward returns them) from y's
// gradient dy and the forward's outputs: the gate's backward writes dg into dqkvg's last block and
// dO (with the attention backward's delta = rowsum(dO * out) where the gate kernel can sum it), then
// the attention's backward writes dq, dk, dv into the other three.
std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_attention_bwd(
    const at::Tensor& dy, const at::Tensor& qkvg, const at::Tensor& out, const at::Tensor& stats,
    const at::Tensor& mask_prepared, const std::optional<at::Tensor>& pair_bias, const at::Tensor& pair_prepared,
    int64_t heads, bool transposed, double scale, const std::string& family,
    std::optional<at::ScalarType> dmask_dtype, bool need_dpair) {
  const GatedViews in = gated_views(qkvg, heads, transposed);
  EVO_CHECK(out.dim() == 5 && out.size(3) == heads, "evoformer gated attention: `out` must be [B, N, L, H, D]; ",
            describe("out", out));
  at::Tensor dqkvg = new_empty(qkvg.sizes(), qkvg.options());  // the kernels write all of it
  GatedViews d = gated_views(dqkvg, heads, transposed);
  const int64_t batch = out.size(0), rows = out.size(1), length = out.size(2);
  auto [dout_rows, delta] =
      block::sigmoid_gate_backward_into(dy, in.g, gated_output_view(out, transposed), d.g, heads, length);
  const at::Tensor dout = attention_view(dout_rows, heads, transposed);  // dO [B, N, L, H, D]
  std::optional<at::Tensor> delta_rows;
  if (delta.numel() > 0) delta_rows = raw_reshape(delta, {batch, rows, heads, length});  // [B, N, H, L]
  auto grads = run_backward(dout, in.q, in.k, in.v, out, stats, mask_prepared, pair_bias, pair_prepared, scale,
                            family, dmask_dtype, need_dpair, d.q, d.k, d.v, delta_rows);
  return {dqkvg, std::get<3>(grads), std::get<4>(grads)};
}

}  // namespace evoformer

// The schemas are declared in Python (evoformer_blocks/ops/_fused.py, with the fake implementations
// that torch.compile traces); the extension registers the kernels.
TORCH_LIBRARY_IMPL(evoformer_blocks_cuda, CompositeExplicitAutograd, m) {
  m.impl("available_kernel_families", &evoformer::available_kernel_families);
  m.impl("kernel_smem_bytes", &evoformer::kernel_smem_bytes);
  m.impl("attach_portable_kernels", &evoformer::attach_portable_kernels);
}

TORCH_LIBRARY_IMPL(evoformer_blocks_cuda, CUDA, m) {
  m.impl("forward", &evoformer::forward);
  m.impl("gated_forward", &evoformer::gated_forward);
  m.impl("backward", &evoformer::backward);
  m.impl("gated_attention_fwd", &evoformer::gated_attention_fwd);
  m.impl("gated_attention_bwd", &evoformer::gated_attention_bwd);
}
