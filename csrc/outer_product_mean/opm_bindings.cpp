// Op kernels (TORCH_LIBRARY_IMPL) of the outer product mean: its linear_out around the [i, c, j, e]
// intermediate (opm_gemm.h), forward, input gradient and weight gradient.
// The Python ops (evoformer_blocks.ops) validate the arguments; the checks here only guard the
// kernels' memory accesses for direct torch.ops calls.
//
// Ops (namespace evoformer_blocks_cuda, declared in evoformer_blocks/ops/_fused.py), CUDA only:
//   opm_project(outer [B, I, C, J, C], weight [Z, C C], bias? [Z], denom? [B, I, J], residual? [B, I, J, Z],
//       family) -> [B, I, J, Z]: the outer product mean's linear_out on its [i, c, j, e] intermediate (no
//       [i, j, c, e] copy), divided by denom and added to residual where given (both in outer's dtype);
//       C = 32, Z a multiple of 128, float16 or bfloat16, weight and bias rounded to outer's dtype;
//       family "sm80" runs the mma.sync tile GEMM (opm_gemm.cuh), "sm90" the Hopper one (opm_gemm_sm90.cuh)
//   opm_project_input_grad(dout [B, I, J, Z], weight [Z, C C], family) -> [B, I, C, J, C]: its input
//       gradient
//   opm_project_weight_grad(dout [B, I, J, Z], outer [B, I, C, J, C], weight_dtype) -> [Z, C C]: its
//       weight gradient (Z at most 128), float32 partial sums added in a fixed order
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "common/block_bindings.h"
#include "outer_product_mean/opm_gemm.h"
#include "outer_product_mean/opm_ops.h"

namespace evoformer {
namespace block {
namespace {

constexpr int64_t kOpmC = limits::kOpmHidden;  // c_hidden the kernels take

void check_opm_operand(const at::Tensor& t, const char* name, const char* op) {
  check_cuda(t, name, op);
  EVO_CHECK(t.is_contiguous() && (t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16) && aligned16(t),
            op, ": `", name, "` must be a contiguous, 16-byte aligned float16 or bfloat16 tensor, got ", t.sizes(),
            " ", t.scalar_type());
}

// weight [Z, C C] in `like`'s dtype and device, contiguous
at::Tensor opm_weight(const at::Tensor& weight, const at::Tensor& like, int64_t c, const char* op) {
  EVO_CHECK(weight.dim() == 2 && weight.size(1) == c * c && weight.device() == like.device(), op,
            ": `weight` must be [Z, ", c * c, "] on the input's device, got ", weight.sizes());
  return weight.to(like.scalar_type()).contiguous();
}

// The tile GEMM's grid x (row tiles times column tiles) must stay below 2^31.
void check_tile_grid(int64_t rows, int64_t column_tiles, const char* op) {
  EVO_CHECK((rows + kOpmTile - 1) / kOpmTile * column_tiles < (int64_t(1) << 31), op, ": too many tiles (",
            rows, " rows, ", column_tiles, " column tiles of ", kOpmTile, ")");
}

// The tile GEMM of the family (hopper: opm_gemm_sm90.cuh) on the current stream.
template <typename T>
void launch_tile_gemm(bool hopper, const OpmGemmParams& p, int64_t batches, int column_tiles) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (hopper) launch_opm_gemm_sm90<T>(p, batches, column_tiles, stream);
  else launch_opm_gemm<T>(p, batches, column_tiles, stream);
}

template <typename Fn>
void by_half_dtype(at::ScalarType dtype, Fn&& fn) {
  if (dtype == at::kHalf) fn(cutlass::half_t{});
  else fn(cutlass::bfloat16_t{});
}

}  // namespace

at::Tensor opm_project(const at::Tensor& outer, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in,
                       const std::optional<at::Tensor>& denom_in, const std::optional<at::Tensor>& residual_in,
                       const std::string& family) {
  const char* op = "outer product mean projection";
  check_opm_operand(outer, "outer", op);
  const bool hopper = hopper_family(family, outer, op);
  EVO_CHECK(outer.dim() == 5 && outer.size(2) == kOpmC && outer.size(4) == kOpmC, op,
            ": `outer` must be [B, I, ", kOpmC, ", J, ", kOpmC, "], got ", outer.sizes());
  const int64_t B = outer.size(0), I = outer.size(1), J = outer.size(3), C = kOpmC;
  const c10::cuda::CUDAGuard guard(outer.device());
  const at::Tensor weight = opm_weight(weight_in, outer, C, op);
  const int64_t Z = weight.size(0);
  EVO_CHECK(Z % kOpmTile == 0 && B * I <= limits::kOpmMaxBatches && J < (int64_t(1) << 31), op,
            ": Z must be a multiple of ", kOpmTile, " and B * I at most ", limits::kOpmMaxBatches, ", got Z = ", Z,
            ", B * I = ", B * I);
  at::Tensor bias;
  if (bias_in.has_value()) {
    EVO_CHECK(bias_in->numel() == Z && bias_in->device() == outer.device(), op, ": `bias` must be [", Z, "]");
    bias = bias_in->to(outer.scalar_type()).contiguous();
  }
  at::Tensor denom, residual;
  if (denom_in.has_value()) {
    denom = *denom_in;
    check_cuda(denom, "denom", op);
    EVO_CHECK(denom.sizes() == at::IntArrayRef({B, I, J}) && denom.scalar_type() == outer.scalar_type() &&
                  denom.is_contiguous(),
              op, ": `denom` must be a contiguous [", B, ", ", I, ", ", J, "] tensor of outer's dtype, got ",
              denom.sizes(), " ", denom.scalar_type());
  }
  if (residual_in.has_value()) {
    residual = *residual_in;
    check_opm_operand(residual, "residual", op);
    EVO_CHECK(residual.sizes() == at::IntArrayRef({B, I, J, Z}) && residual.scalar_type() == outer.scalar_type(),
              op, ": `residual` must be [", B, ", ", I, ", ", J, ", ", Z, "] of outer's dtype, got ",
              residual.sizes(), " ", residual.scalar_type());
  }
  check_tile_grid(J, Z / kOpmTile, op);
  at::Tensor out = output({B, I, J, Z}, outer.options());
  OpmGemmParams p{};
  p.a = outer.data_ptr(), p.b = weight.data_ptr(), p.bias = bias.defined() ? bias.data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.denom = denom.defined() ? denom.data_ptr() : nullptr;
  p.residual = residual.defined() ? residual.data_ptr() : nullptr;
  p.a_batch = C * J * C, p.a_row = C, p.a_step = J * C;        // A row j, step c: outer[b, i, c, j, :]
  p.b_tile = kOpmTile * C * C, p.b_row = C * C, p.b_step = C;  // B row z, step c: weight[z, c C : c C + C]
  p.out_batch = J * Z, p.out_tile = kOpmTile, p.out_row = Z, p.out_block = 32;
  p.rows = int(J), p.steps = int(C);
  by_half_dtype(outer.scalar_type(), [&](auto e) {
    launch_tile_gemm<decltype(e)>(hopper, p, B * I, int(Z / kOpmTile));
  });
  return out;
}

at::Tensor opm_project_input_grad(const at::Tensor& dout, const at::Tensor& weight_in, const std::string& family) {
  const char* op = "outer product mean projection backward";
  check_opm_operand(dout, "dout", op);
  const bool hopper = hopper_family(family, dout, op);
  EVO_CHECK(dout.dim() == 4, op, ": `dout` must be [B, I, J, Z], got ", dout.sizes());
  const int64_t B = dout.size(0), I = dout.size(1), J = dout.size(2), Z = dout.size(3), C = kOpmC;
  const c10::cuda::CUDAGuard guard(dout.device());
  const at::Tensor weight = opm_weight(weight_in, dout, C, op);
  EVO_CHECK(weight.size(0) == Z && Z % kOpmStep == 0 && B * I <= limits::kOpmMaxBatches && J < (int64_t(1) << 31), op,
            ": Z must match weight [Z, C C] and be a multiple of ", kOpmStep, ", and B * I at most ",
            limits::kOpmMaxBatches, "; got dout ",
            dout.sizes(), ", weight ", weight.sizes());
  const at::Tensor wt = weight.t().contiguous();  // [C C, Z]: B rows (c, e), k along z
  check_tile_grid(J, C * C / kOpmTile, op);
  at::Tensor d_outer = output({B, I, C, J, C}, dout.options());
  OpmGemmParams p{};
  p.a = dout.data_ptr(), p.b = wt.data_ptr(), p.bias = nullptr, p.out = d_outer.data_ptr();
  p.a_batch = J * Z, p.a_row = Z, p.a_step = kOpmStep;                  // A row j, step s: dout[b, i, j, 32 s :]
  p.b_tile = int64_t(kOpmTile) * Z, p.b_row = Z, p.b_step = kOpmStep;  // B row n of tile y: wt[128 y + n, 32 s :]
  p.out_batch = C * J * C, p.out_tile = (kOpmTile / C) * J * C, p.out_row = C, p.out_block = J * C;
  p.rows = int(J), p.steps = int(Z / kOpmStep);
  by_half_dtype(dout.scalar_type(), [&](auto e) {
    launch_tile_gemm<decltype(e)>(hopper, p, B * I, int(C * C / kOpmTile));
  });
  return d_outer;
}

at::Tensor opm_project_weight_grad(const at::Tensor& dout, const at::Tensor& outer, at::ScalarType weight_dtype) {
  const char* op = "outer product mean projection weight gradient";
  check_opm_operand(dout, "dout", op);
  check_opm_operand(outer, "outer", op);
  EVO_CHECK(dout.dim() == 4 && outer.dim() == 5 && outer.size(0) == dout.size(0) && outer.size(1) == dout.size(1) &&
                outer.size(2) == kOpmC && outer.size(3) == dout.size(2) && outer.size(4) == kOpmC &&
                outer.scalar_type() == dout.scalar_type() && outer.device() == dout.device(),
            op, ": `dout` [B, I, J, Z] and `outer` [B, I, ", kOpmC, ", J, ", kOpmC, "] do not match: ", dout.sizes(), ", ",
            outer.sizes());
  EVO_CHECK(is_param_dtype(weight_dtype), op, ": `weight_dtype` must be a float type, got ", weight_dtype);
  const int64_t B = dout.size(0), I = dout.size(1), J = dout.size(2), Z = dout.size(3), C = kOpmC;
  EVO_CHECK(Z <= kOpmTile && Z % 8 == 0 && J < (int64_t(1) << 30), op, ": Z must be a multiple of 8 up to ",
            kOpmTile, ", got ", Z);
  const c10::cuda::CUDAGuard guard(dout.device());
  const int64_t BI = B * I, chunks = (J + kOpmStep - 1) / kOpmStep;
  const int64_t steps = BI * chunks;
  if (steps == 0) return at::zeros({Z, C * C}, dout.options().dtype(weight_dtype));
  EVO_CHECK(steps < (int64_t(1) << 31), op, ": too many k-steps (", steps, ")");
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(steps, 2 * current_sm_count() / (C * C / kOpmTile)));
  at::Tensor partial = output({splits, Z, C * C}, dout.options().dtype(at::kFloat));
  OpmWeightGradParams p{};
  p.dout = dout.data_ptr(), p.outer = outer.data_ptr(), p.partial = partial.data_ptr<float>();
  p.outer_batch = C * J * C;
  p.J = int(J), p.Z = int(Z), p.chunks = int(chunks), p.steps = int(steps);
  by_half_dtype(dout.scalar_type(), [&](auto e) {
    launch_opm_weight_grad<decltype(e)>(p, int(splits), c10::cuda::getCurrentCUDAStream());
  });
  return partial.sum(0).to(weight_dtype);  // [Z, C C], partials added in a fixed order
}

}  // namespace block
}  // namespace evoformer

// (schemas: evoformer_blocks/ops/_fused.py)
TORCH_LIBRARY_IMPL(evoformer_blocks_cuda, CUDA, m) {
  m.impl("opm_project", &evoformer::block::opm_project);
  m.impl("opm_project_input_grad", &evoformer::block::opm_project_input_grad);
  m.impl("opm_project_weight_grad", &evoformer::block::opm_project_weight_grad);
}
