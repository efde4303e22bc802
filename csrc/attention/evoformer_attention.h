// Evoformer attention kernels: parameters and launcher declarations.
//
// Dimension legend: B batch, N rows sharing the pair bias, Lq / Lk query / key length, H heads,
// D head dim. Every pointer below is laid out as its comment says; strides are in elements and the
// last dimension of every tensor is contiguous. Host code (attention_bindings.cpp) prepares the tensors so
// that every row a kernel reads with 16-byte copies starts on a 16-byte boundary
// (limits::kRowAlignBytes).
//
// The mask bias has one form from the op to the kernels: the op takes mask_bias
// [B|1, N|1, 1, 1, Lk], additive, in q's dtype or float32; the forward prepares it once
// (launch_prepare_mask) into float32 [B|1, N|1, Lk_pad] divided by `scale`, zero past Lk, with Lk_pad
// the multiple of 4 at or above Lk (16-byte rows), and the backward reads that same prepared tensor.
//
// Kernel families (the one choice is made in Python, evoformer_blocks/ops/cutlass.py): sm80, the
// portable kernels (mma.sync, ldmatrix, cp.async; forward_sm80.cuh, backward_sm80.cuh) for every
// device of compute capability >= 8.0, the only family with float32 (TF32) kernels; sm90, the Hopper kernels (wgmma, TMA; forward_sm90.cuh,
// backward_sm90.cuh), code only in builds for sm_90a (EVOFORMER_SM90A) and run on 9.0 devices.
#pragma once

#include <cstdint>

#include <cuda.h>  // CUtensorMap (types only: the driver entry point is looked up at run time)
#include <cuda_runtime.h>

#include "common/check_launch.h"
#include "common/kernel_limits.h"  // PairKind, limits:: (generated from kernel_table.json)

namespace evoformer {

// Strides in elements of a [B, N, L, H, D] tensor whose D is contiguous (0 along a size-1 dimension).
struct RowStrides {
  int64_t b, n, l, h;
  // Offset of element (bi, ni, row, hi, 0).
  __host__ __device__ int64_t at(int64_t bi, int64_t ni, int64_t row, int64_t hi) const {
    return bi * b + ni * n + hi * h + row * l;
  }
};

struct AttentionParams {
  // ---- inputs --------------------------------------------------------------------------------
  const void* q;  // [B, N, Lq, H, D]
  const void* k;  // [B, N, Lk, H, D]
  const void* v;  // [B, N, Lk, H, D]
  RowStrides q_strides, k_strides, v_strides;

  // The prepared mask bias (see above): float32 [B|1, N|1, Lk_pad] = mask_bias / scale, zero past
  // Lk; a stride of 0 broadcasts. nullptr: no mask bias.
  const float* mask_scaled;
  int64_t mask_stride_b, mask_stride_n;

  // Pair bias [B|1, H|1, Lq, Lk_pad] in the kernel's PairKind type; rows 16-byte aligned and
  // readable up to a multiple of 16 bytes; a stride of 0 broadcasts. nullptr iff kNoPair.
  const void* pair;
  int64_t pair_stride_b, pair_stride_h, pair_stride_q;

  // ---- forward outputs / backward inputs --------------------------------------------------
  void* out;   // [B, N, Lq, H, D]
  RowStrides o_strides;
  // The gated attention (nullptr: none; the sm90 forward only): its epilogue also writes
  // y = sigmoid(gate) * out, from out as stored; gate and y [B, N, Lq, H, D] at their strides (D
  // contiguous, rows aligned to two elements).
  const void* gate;
  void* gated;
  RowStrides g_strides, y_strides;
  // Softmax statistics per query row, [B, N, H, Lq, 2] contiguous fp32: (m, l) with m = max_j S_ij
  // (raw score units, see below) and l the log2 of the forward's row sum in units of the weight it
  // gave a key at m (l = log2(sum_j exp2((S_ij - m) * scale_log2)) up to the rounding of those
  // weights to the element type; store_output_rows in epilogue.cuh), so that
  // P_ij = exp2((S_ij - m) * scale_log2 - l), exactly the forward's probability at S_ij = m.
  // Keeping m apart from l keeps P exact when |S| is huge (a row whose keys all carry a -1e9 mask:
  // P = 1 / L). Rows whose keys are all -inf store (0, +inf).
  float* stats;

  // ---- backward ----------------------------------------------------------------------------
  const void* dout;  // [B, N, Lq, H, D]
  RowStrides do_strides;
  float* delta;      // [B, N, H, Lq] contiguous: rowsum(dout * out)
  bool delta_ready;  // delta holds it already (the gate's backward summed it): no delta pass
  void* dq;          // [B, N, Lq, H, D], rows at dq_strides (D contiguous, every row 4-byte aligned)
  void* dk;          // [B, N, Lk, H, D], rows at dk_strides
  void* dv;          // [B, N, Lk, H, D], rows at dv_strides
  RowStrides dq_strides, dk_strides, dv_strides;
  float* dmask;      // [B, N, H, Lk] contiguous fp32 partial (sum over queries); nullptr: not wanted
  float* dpair;      // [n_chunks, B, H, Lq, Lk] contiguous fp32 partial (sum over the chunk's rows n);
                     // nullptr: not wanted
  int n_chunk_size;  // rows n summed by one CTA of the pair-bias gradient kernel
  int n_chunks;      // ceil(N / n_chunk_size)

  // ---- sizes ---------------------------------------------------------------------------------
  int B, N, Lq, Lk, H, D;
  float scale;       // multiplies q.k
  float inv_scale;   // 1 / scale
  float scale_log2;  // scale * log2(e)
  // The kernels start each score accumulator at (mask + pair) / scale, add q.k with the tensor
  // cores, and take logits in log2 units from S * scale_log2 (the forward folds the row maximum into
  // that multiply, one FFMA per score); keys past Lk start at -inf.
};

// One instantiation per (direction, family, element type, head-dim bucket, pair kind) (generate.py);
// the element type is cutlass::half_t or cutlass::bfloat16_t, or float in the sm80 family only
// (TF32 tensor cores, buckets up to limits::kTf32MaxHeadDim, pair kinds limits::kTf32PairKinds). Each launcher checks its launches.
// The sm90 launchers hold code only in builds for sm_90a; the bindings call them only on a 9.0 device.

// The forward: out and stats.
template <typename Element, int kHeadDim, int kPair>
void launch_forward_sm80(const AttentionParams& params, cudaStream_t stream);
template <typename Element, int kHeadDim, int kPair>
void launch_forward_sm90(const AttentionParams& params, cudaStream_t stream);

// The backward: delta, dK/dV (and the mask-bias gradient partial when params.dmask is set), dQ and,
// when params.dpair is set, the pair-bias gradient partials.
template <typename Element, int kHeadDim, int kPair>
void launch_backward_sm80(const AttentionParams& params, cudaStream_t stream);
template <typename Element, int kHeadDim, int kPair>
void launch_backward_sm90(const AttentionParams& params, cudaStream_t stream);

// CTAs of a family's pair-bias-gradient kernel that fit on one SM at once (0 for instantiations
// without a pair bias); sizes that kernel's grid (choose_n_chunk_size in attention_bindings.cpp).
template <typename Element, int kHeadDim, int kPair>
int pair_grad_blocks_per_sm_sm80();
template <typename Element, int kHeadDim, int kPair>
int pair_grad_blocks_per_sm_sm90();

// Shared memory per CTA (bytes) of an instantiation's forward kernel and of its largest backward kernel:
// what a device must allow per block for them to launch (the op kernel_smem_bytes answers it, so that
// the cutlass backend leaves such inputs to another backend where the device allows less).
template <typename Element, int kHeadDim, int kPair>
int forward_smem_bytes_sm80();
template <typename Element, int kHeadDim, int kPair>
int forward_smem_bytes_sm90();
template <typename Element, int kHeadDim, int kPair>
int backward_smem_bytes_sm80();
template <typename Element, int kHeadDim, int kPair>
int backward_smem_bytes_sm90();

// delta = rowsum(dout * out) in float32 (attention.cu; the first pass of every backward launcher,
// skipped where params.delta_ready).
template <typename Element>
void launch_backward_delta(const AttentionParams& params, cudaStream_t stream);

// A mask bias [Bm, Nm, 1, 1, Lk] as launch_prepare_mask reads it (strides in elements) and the
// padded length Lk_pad of the prepared tensor.
struct MaskLayout {
  int64_t stride_b, stride_n, stride_k;
  int Bm, Nm, Lk, lk_pad;
};

// The prepared mask (see above) from the caller's mask bias in one launch into `out`
// ([Bm, Nm, Lk_pad] float32). T is cutlass::half_t, cutlass::bfloat16_t or float.
template <typename T>
void launch_prepare_mask(const void* mask, const MaskLayout& layout, float inv_scale, float* out, cudaStream_t stream);

// One dimension of a TMA tensor map: extent, stride in elements and box size (elements per copy).
// A dimension with stride 0 (size 1 or broadcast) is described as extent 1: the kernel then uses
// coordinate 0 for it (tma_coord).
struct TileMapDim {
  int64_t extent, stride;
  int box;
};
// Encodes `map` for TMA copies of boxes of a tensor of `rank` (<= 5) dimensions, innermost (dims[0],
// contiguous) first, of `element_bytes`-byte values (2: float16 / bfloat16 as `type`, 4: float32).
// Throws std::runtime_error naming `kernel` and `tensor` when the driver rejects it.
void encode_tile_map(CUtensorMap* map, CUtensorMapDataType type, int element_bytes, const void* base,
                     const TileMapDim* dims, int rank, CUtensorMapSwizzle swizzle, const char* kernel,
                     const char* tensor);

}  // namespace evoformer
