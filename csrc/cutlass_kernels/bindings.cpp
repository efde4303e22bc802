// TORCH_LIBRARY bindings of the fused Evoformer attention kernels: host-side checks, preparation of
// the biases into the layouts the kernels read, dispatch to one instantiation, and the reductions
// of the bias-gradient partials to the biases' broadcast shapes.
//
// Ops (namespace evoformer_blocks_cuda), CUDA only:
//   kernel_family(device) -> "sm90" | "sm80": the kernel family that runs on that device (sm90: the
//       Hopper forward and backward kernels)
//   forward(q, k, v, mask_bias?, pair_bias?, scale) -> (out [B,N,Lq,H,D], stats [B,N,H,Lq,2] fp32)
//   backward(dout, q, k, v, mask_bias?, pair_bias?, out, stats, scale, need_dmask, need_dpair)
//       -> (dq, dk, dv, dmask_bias, dpair_bias); a bias gradient not asked for is an empty tensor.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>

#include <cutlass/numeric_types.h>

#include "evoformer_attention.h"

namespace evoformer {
namespace {

using Launcher = void (*)(const AttentionParams&, cudaStream_t);
using BlocksQuery = int (*)(bool);

int head_dim_bucket(int head_dim) {
  int bucket = 0;
  for (int b : kHeadDimBuckets)
    if (bucket == 0 && head_dim <= b) bucket = b;
  TORCH_CHECK(bucket != 0, "evoformer attention: head dim ", head_dim, " exceeds the largest bucket");
  return bucket;
}

// The one place that maps (dtype, head dim, pair kind) to an instantiation: returns
// pick(Element{}, integral_constant<head-dim bucket>, integral_constant<pair kind>), which names a
// function of that instantiation (every branch must return the same pointer type).
template <typename Pick>
auto for_instantiation(at::ScalarType dtype, int head_dim, int pair, Pick&& pick) {
  using std::integral_constant;
  const int bucket = head_dim_bucket(head_dim);
  auto by_pair = [&](auto element, auto dim) {
    return pair == kNoPair      ? pick(element, dim, integral_constant<int, kNoPair>{})
           : pair == kPairInput ? pick(element, dim, integral_constant<int, kPairInput>{})
                                : pick(element, dim, integral_constant<int, kPairFloat>{});
  };
  auto by_bucket = [&](auto element) {
    return bucket == 32   ? by_pair(element, integral_constant<int, 32>{})
           : bucket == 64 ? by_pair(element, integral_constant<int, 64>{})
                          : by_pair(element, integral_constant<int, 128>{});
  };
  return dtype == at::kBFloat16 ? by_bucket(cutlass::bfloat16_t{}) : by_bucket(cutlass::half_t{});
}

enum class Direction { kForward, kForwardSm90, kBackward };

Launcher launcher_for(Direction direction, at::ScalarType dtype, int head_dim, int pair) {
  return for_instantiation(dtype, head_dim, pair, [direction](auto element, auto dim, auto kind) -> Launcher {
    using E = decltype(element);
    constexpr int D = decltype(dim)::value, P = decltype(kind)::value;
    switch (direction) {
      case Direction::kForward: return &launch_forward<E, D, P>;
      case Direction::kForwardSm90: return &launch_forward_sm90<E, D, P>;
      default: return &launch_backward<E, D, P>;
    }
  });
}

// Whether the Hopper kernels run (forward and backward): the build holds sm_90a code (EVOFORMER_SM90A, set by
// the JIT build when it compiles for 9.0a), the device has compute capability 9.0, and
// EVOFORMER_BLOCKS_KERNELS is unset or "auto" ("sm80" keeps the portable kernels; read on every call
// so that one process can time both).
bool use_sm90(int device) {
  const char* env = std::getenv("EVOFORMER_BLOCKS_KERNELS");
  const std::string choice = env == nullptr || env[0] == '\0' ? "auto" : env;
  TORCH_CHECK(choice == "auto" || choice == "sm80",
              "evoformer attention: EVOFORMER_BLOCKS_KERNELS must be `auto` or `sm80`, got `", choice, "`");
#ifdef EVOFORMER_SM90A
  if (choice == "sm80") return false;
  static int capability[64] = {};  // major * 10 + minor per device, 0 until asked
  TORCH_CHECK(device >= 0 && device < 64, "evoformer attention: device index ", device, " out of range");
  if (capability[device] == 0) {
    int major = 0, minor = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    capability[device] = major * 10 + minor;
  }
  return capability[device] == 90;
#else
  (void)device;
  return false;
#endif
}

// CTAs of the pair-bias-gradient kernel (its Hopper one with sm90) resident per SM for this dtype /
// head dim / pair kind.
int pair_grad_blocks_per_sm(at::ScalarType dtype, int head_dim, int pair, bool sm90) {
  return for_instantiation(dtype, head_dim, pair, [](auto element, auto dim, auto kind) -> BlocksQuery {
    return &backward_pair_grad_blocks_per_sm<decltype(element), decltype(dim)::value, decltype(kind)::value>;
  })(sm90);
}

std::string describe(const char* name, const at::Tensor& t) {
  std::ostringstream os;
  os << name << ": shape=" << t.sizes() << " dtype=" << t.scalar_type() << " device=" << t.device()
     << " stride=" << t.strides();
  return os.str();
}

// Every tensor argument must be on one CUDA device.
void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"q", q}, {"k", k}, {"v", v}}) {
    TORCH_CHECK(t.is_cuda(), "evoformer attention: `", name, "` must be a CUDA tensor; ", describe(name, t));
    TORCH_CHECK(t.dim() == 5, "evoformer attention: `", name, "` must be [B, N, L, H, D]; ", describe(name, t));
    TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
                "evoformer attention: `", name, "` must be float16 or bfloat16; ", describe(name, t));
    TORCH_CHECK(t.scalar_type() == q.scalar_type() && t.device() == q.device(),
                "evoformer attention: q, k, v must share dtype and device; ", describe(name, t));
  }
  TORCH_CHECK(k.sizes() == v.sizes(), "evoformer attention: k and v must have one shape; ", describe("k", k), "; ",
              describe("v", v));
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3) && q.size(4) == k.size(4),
              "evoformer attention: k must be [B, N, Lk, H, D] with q's B, N, H, D; ", describe("q", q), "; ",
              describe("k", k));
  const int64_t d = q.size(4);
  TORCH_CHECK(d % 8 == 0 && d >= 8 && d <= 128, "evoformer attention: head dim D must be a multiple of 8 in [8, 128]; ",
              describe("q", q));
  const int64_t blocks = (std::max(q.size(2), k.size(2)) + 63) / 64;  // the kernels' smallest tile is 64
  TORCH_CHECK(q.size(0) * q.size(1) * blocks < (int64_t(1) << 31) && q.size(3) <= 65535,
              "evoformer attention: B * N * ceil(L / 64) must be < 2^31 and H <= 65535; ", describe("q", q));
}

// A stride the kernel can use: 0 for a size-1 dimension (never stepped over).
int64_t kstride(const at::Tensor& t, int dim) { return t.size(dim) == 1 ? 0 : t.stride(dim); }

// q/k/v/out/dout as the kernels read them: D contiguous, every row 16-byte aligned. Copies only
// when the given layout does not allow that.
at::Tensor kernel_layout(const at::Tensor& t) {
  bool ok = t.stride(4) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int d = 0; d < 4; ++d) ok = ok && kstride(t, d) % 8 == 0;
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

// The kernel strides (b, n, l, h) of a [B, N, L, H, D] tensor.
RowStrides row_strides(const at::Tensor& t) {
  return RowStrides{kstride(t, 0), kstride(t, 1), kstride(t, 2), kstride(t, 3)};
}

void set_qkv(AttentionParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_strides = row_strides(q);
  p.k_strides = row_strides(k);
  p.v_strides = row_strides(v);
  p.B = int(q.size(0)), p.N = int(q.size(1)), p.Lq = int(q.size(2)), p.Lk = int(k.size(2));
  p.H = int(q.size(3)), p.D = int(q.size(4));
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// mask_bias [B|1, N|1, 1, 1, Lk] -> float32 [B|1, N|1, Lk_pad] divided by scale (one small launch).
// Needs p.Lk and p.inv_scale set.
at::Tensor prepare_mask(AttentionParams& p, const std::optional<at::Tensor>& mask_bias, const at::Tensor& q) {
  p.mask_scaled = nullptr;
  p.mask_stride_b = p.mask_stride_n = 0;
  if (!mask_bias.has_value()) return at::Tensor();
  const at::Tensor& m = *mask_bias;
  TORCH_CHECK(m.device() == q.device() && m.is_floating_point(),
              "evoformer attention: `mask_bias` must be a floating tensor on q's device; ", describe("mask_bias", m));
  TORCH_CHECK(m.dim() == 5 && (m.size(0) == p.B || m.size(0) == 1) && (m.size(1) == p.N || m.size(1) == 1) &&
                  m.size(2) == 1 && m.size(3) == 1 && m.size(4) == p.Lk,
              "evoformer attention: `mask_bias` must be [B|1, N|1, 1, 1, Lk]; ", describe("mask_bias", m), "; ",
              describe("q", q));
  const int64_t bm = m.size(0), nm = m.size(1), lk_pad = round_up(p.Lk, 4);
  at::Tensor prepared = at::empty({bm, nm, lk_pad}, m.options().dtype(at::kFloat));
  const MaskLayout layout{kstride(m, 0), kstride(m, 1), m.stride(4), int(bm), int(nm), p.Lk, int(lk_pad)};
  auto launch = [&](auto element) {
    launch_prepare_mask<decltype(element)>(m.data_ptr(), layout, p.inv_scale, prepared.data_ptr<float>(),
                                           c10::cuda::getCurrentCUDAStream());
  };
  switch (m.scalar_type()) {
    case at::kHalf: launch(cutlass::half_t{}); break;
    case at::kBFloat16: launch(cutlass::bfloat16_t{}); break;
    case at::kFloat: launch(float{}); break;
    default:
      TORCH_CHECK(false, "evoformer attention: `mask_bias` must be float16, bfloat16 or float32; ",
                  describe("mask_bias", m));
  }
  p.mask_scaled = prepared.data_ptr<float>();
  p.mask_stride_b = bm == 1 ? 0 : nm * lk_pad;
  p.mask_stride_n = nm == 1 ? 0 : lk_pad;
  return prepared;
}

// pair_bias [B|1, 1, H|1, Lq, Lk] -> [B|1, H|1, Lq, Lk(_pad)] with keys contiguous and every row
// 16-byte aligned and readable to a multiple of 16 bytes; copies (zero-padded) only when needed.
// Returns the tensor the kernel reads and sets the pair kind.
at::Tensor prepare_pair(AttentionParams& p, int& pair_kind, const std::optional<at::Tensor>& pair_bias,
                        const at::Tensor& q) {
  p.pair = nullptr;
  p.pair_stride_b = p.pair_stride_h = p.pair_stride_q = 0;
  pair_kind = kNoPair;
  if (!pair_bias.has_value()) return at::Tensor();
  const at::Tensor& pb = *pair_bias;
  TORCH_CHECK(pb.device() == q.device() && (pb.scalar_type() == q.scalar_type() || pb.scalar_type() == at::kFloat),
              "evoformer attention: `pair_bias` must be on q's device with q's dtype or float32; ",
              describe("pair_bias", pb), "; ", describe("q", q));
  TORCH_CHECK(pb.dim() == 5 && (pb.size(0) == p.B || pb.size(0) == 1) && pb.size(1) == 1 &&
                  (pb.size(2) == p.H || pb.size(2) == 1) && pb.size(3) == p.Lq && pb.size(4) == p.Lk,
              "evoformer attention: `pair_bias` must be [B|1, 1, H|1, Lq, Lk]; ", describe("pair_bias", pb), "; ",
              describe("q", q));
  pair_kind = pb.scalar_type() == at::kFloat ? kPairFloat : kPairInput;
  at::Tensor t = pb.select(1, 0);  // [B|1, H|1, Lq, Lk]
  const int64_t per_chunk = 16 / t.element_size();
  bool ok = t.stride(3) == 1 && p.Lk % per_chunk == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int d = 0; d < 3; ++d) ok = ok && kstride(t, d) % per_chunk == 0;
  if (!ok) {
    at::Tensor padded = at::zeros({t.size(0), t.size(1), p.Lq, round_up(p.Lk, per_chunk)}, t.options());
    padded.narrow(3, 0, p.Lk).copy_(t);
    t = padded;
  }
  p.pair = t.data_ptr();
  p.pair_stride_b = kstride(t, 0);
  p.pair_stride_h = kstride(t, 1);
  p.pair_stride_q = t.stride(2);
  return t;
}

// EVOFORMER_BLOCKS_POISON=1 fills outputs with NaN before the kernels run, so a test sees any
// element a kernel fails to write.
bool poison_outputs() {
  static const bool poison = [] {
    const char* env = std::getenv("EVOFORMER_BLOCKS_POISON");
    return env != nullptr && env[0] != '\0' && env[0] != '0';
  }();
  return poison;
}
void maybe_poison(at::Tensor& t) {
  if (poison_outputs() && t.defined() && t.numel() > 0) t.fill_(std::nan(""));
}

// Everything forward and backward share: checks, the kernel layouts of q/k/v, the prepared biases
// and the parameters describing them. Call under the device guard.
struct Prepared {
  at::Tensor q, k, v, mask, pair;
  AttentionParams p{};
  int pair_kind = kNoPair;
};
Prepared prepare(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                 const std::optional<at::Tensor>& mask_bias, const std::optional<at::Tensor>& pair_bias, double scale) {
  Prepared r;
  r.q = kernel_layout(q_in), r.k = kernel_layout(k_in), r.v = kernel_layout(v_in);
  set_qkv(r.p, r.q, r.k, r.v);
  r.p.scale = float(scale), r.p.inv_scale = float(1.0 / scale), r.p.scale_log2 = float(scale * M_LOG2E);
  r.mask = prepare_mask(r.p, mask_bias, r.q);
  r.pair = prepare_pair(r.p, r.pair_kind, pair_bias, r.q);
  return r;
}

void check_scale(double scale) {
  TORCH_CHECK(std::isfinite(scale) && scale > 0, "evoformer attention: `scale` must be positive and finite, got ", scale);
}

std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                           const std::optional<at::Tensor>& mask_bias,
                                           const std::optional<at::Tensor>& pair_bias, double scale) {
  check_qkv(q_in, k_in, v_in);
  check_scale(scale);
  const c10::cuda::CUDAGuard guard(q_in.device());
  Prepared prep = prepare(q_in, k_in, v_in, mask_bias, pair_bias, scale);
  AttentionParams& p = prep.p;
  const at::Tensor& q = prep.q;

  at::Tensor out = at::empty({p.B, p.N, p.Lq, p.H, p.D}, q.options());
  at::Tensor stats = at::empty({p.B, p.N, p.H, p.Lq, 2}, q.options().dtype(at::kFloat));
  maybe_poison(out);
  maybe_poison(stats);
  p.out = out.data_ptr();
  p.o_strides = row_strides(out);
  p.stats = stats.data_ptr<float>();
  p.sm90 = use_sm90(q.get_device());
  const Direction direction = p.sm90 ? Direction::kForwardSm90 : Direction::kForward;
  launcher_for(direction, q.scalar_type(), p.D, prep.pair_kind)(p, c10::cuda::getCurrentCUDAStream());
  return {out, stats};
}

// Rows n summed by one CTA of the pair-bias gradient kernel. Its grid is ctas_per_chunk CTAs per
// n-chunk, each looping over the chunk's rows; with `slots` CTAs resident on the GPU its time goes
// as waves * (rows per chunk + a per-CTA overhead of about two rows). The count that (nearly)
// minimises this is taken, so the last wave is not left mostly empty; each chunk costs a
// [B, H, Lq, Lk] fp32 partial, 256 MiB in all at most.
int choose_n_chunk_size(const AttentionParams& p, int block_q, int block_k, int blocks_per_sm) {
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t slots = int64_t(sms) * std::max(blocks_per_sm, 1);
  const int64_t ctas_per_chunk =
      int64_t(p.B) * p.H * ((p.Lq + block_q - 1) / block_q) * ((p.Lk + block_k - 1) / block_k);
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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& mask_bias, const std::optional<at::Tensor>& pair_bias, const at::Tensor& out_in,
    const at::Tensor& stats_in, double scale, bool need_dmask, bool need_dpair) {
  check_qkv(q_in, k_in, v_in);
  check_scale(scale);
  TORCH_CHECK(dout_in.sizes() == q_in.sizes() && dout_in.scalar_type() == q_in.scalar_type() &&
                  out_in.sizes() == q_in.sizes() && out_in.scalar_type() == q_in.scalar_type(),
              "evoformer attention backward: `dout` and `out` must match q; ", describe("dout", dout_in), "; ",
              describe("out", out_in), "; ", describe("q", q_in));
  TORCH_CHECK(stats_in.scalar_type() == at::kFloat && stats_in.dim() == 5 && stats_in.size(0) == q_in.size(0) &&
                  stats_in.size(1) == q_in.size(1) && stats_in.size(2) == q_in.size(3) &&
                  stats_in.size(3) == q_in.size(2) && stats_in.size(4) == 2,
              "evoformer attention backward: `stats` must be float32 [B, N, H, Lq, 2]; ", describe("stats", stats_in));
  const c10::cuda::CUDAGuard guard(q_in.device());
  Prepared prep = prepare(q_in, k_in, v_in, mask_bias, pair_bias, scale);
  AttentionParams& p = prep.p;
  const at::Tensor &q = prep.q, &k = prep.k, &v = prep.v;
  const at::Tensor out = kernel_layout(out_in), dout = kernel_layout(dout_in), stats = stats_in.contiguous();
  need_dmask = need_dmask && prep.mask.defined();
  need_dpair = need_dpair && prep.pair.defined();

  p.out = out.data_ptr();
  p.o_strides = row_strides(out);
  p.dout = dout.data_ptr();
  p.do_strides = row_strides(dout);
  p.stats = const_cast<float*>(stats.data_ptr<float>());

  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor delta = at::empty({p.B, p.N, p.H, p.Lq}, f32);
  at::Tensor dq = at::empty(q.sizes(), q.options()), dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  at::Tensor dmask_part = need_dmask ? at::empty({p.B, p.N, p.H, p.Lk}, f32) : at::Tensor();
  p.sm90 = use_sm90(q.get_device());
  p.n_chunk_size = need_dpair ? choose_n_chunk_size(p, /*block_q=*/64, /*block_k=*/64,
                                                    pair_grad_blocks_per_sm(q.scalar_type(), p.D, prep.pair_kind, p.sm90))
                              : p.N;
  p.n_chunks = (p.N + p.n_chunk_size - 1) / p.n_chunk_size;
  at::Tensor dpair_part = need_dpair ? at::empty({p.n_chunks, p.B, p.H, p.Lq, p.Lk}, f32) : at::Tensor();
  for (at::Tensor* t : {&delta, &dq, &dk, &dv, &dmask_part, &dpair_part}) maybe_poison(*t);
  p.delta = delta.data_ptr<float>();
  p.dq = dq.data_ptr(), p.dk = dk.data_ptr(), p.dv = dv.data_ptr();
  p.dmask = need_dmask ? dmask_part.data_ptr<float>() : nullptr;
  p.dpair = need_dpair ? dpair_part.data_ptr<float>() : nullptr;
  launcher_for(Direction::kBackward, q.scalar_type(), p.D, prep.pair_kind)(p, c10::cuda::getCurrentCUDAStream());

  // Reduce the partials to the biases' own (broadcast) shapes; fixed-order torch sums.
  at::Tensor dmask = at::empty({0}, q.options()), dpair = at::empty({0}, q.options());
  if (need_dmask) {
    const at::Tensor& m = *mask_bias;
    at::Tensor r = dmask_part.sum(2);  // [B, N, Lk]
    if (m.size(0) == 1) r = r.sum(0, /*keepdim=*/true);
    if (m.size(1) == 1) r = r.sum(1, /*keepdim=*/true);
    dmask = r.view({m.size(0), m.size(1), 1, 1, p.Lk}).to(m.scalar_type());
  }
  if (need_dpair) {
    const at::Tensor& pb = *pair_bias;
    at::Tensor r = p.n_chunks == 1 ? dpair_part.select(0, 0) : dpair_part.sum(0);  // [B, H, Lq, Lk]
    if (pb.size(0) == 1) r = r.sum(0, /*keepdim=*/true);
    if (pb.size(2) == 1) r = r.sum(1, /*keepdim=*/true);
    dpair = r.unsqueeze(1).to(pb.scalar_type());  // [B|1, 1, H|1, Lq, Lk]
  }
  return {dq, dk, dv, dmask, dpair};
}

// Which kernels run on `device` now: "sm90" (Hopper wgmma) or "sm80" (see use_sm90).
std::string kernel_family(int64_t device) { return use_sm90(int(device)) ? "sm90" : "sm80"; }

}  // namespace
}  // namespace evoformer

TORCH_LIBRARY(evoformer_blocks_cuda, m) {
  m.def("kernel_family(int device) -> str", &evoformer::kernel_family);
  m.def("forward(Tensor q, Tensor k, Tensor v, Tensor? mask_bias, Tensor? pair_bias, float scale) -> (Tensor, Tensor)");
  m.def(
      "backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor? mask_bias, Tensor? pair_bias, Tensor out, "
      "Tensor stats, float scale, bool need_dmask, bool need_dpair) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(evoformer_blocks_cuda, CUDA, m) {
  m.impl("forward", &evoformer::forward);
  m.impl("backward", &evoformer::backward);
}
