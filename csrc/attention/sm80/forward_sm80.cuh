// The sm80 forward kernel: o = softmax(scale * q.k^T + mask_bias + pair_bias) . v with an online
// softmax in the log2 domain, on mma.sync; writes o and the softmax statistics (row max, log2 row
// sum). The score accumulator starts at the biases divided by the scale (init_scores), so the biases
// cost one FFMA per element; probabilities are exp2((S - max) * scale * log2(e)).
//
// CTA = (query block, b * N + n) on blockIdx.x (query block fastest, see RowTileGrid), h on
// blockIdx.y. Each warp owns kMTiles * 16 query rows; K, V, the pair-bias tile and the mask tile of
// the next key block are copied (cp.async) while the current one is used. The query blocks of one
// (b, n, h) run side by side and share K and V through L2; the pair-bias tile of a query block is
// shared by the rows n, n_query_blocks CTAs apart.
//
// Element float runs the products on the TF32 tensor cores (mma_sm80.cuh: every 16-wide k-step is
// two m16n8k8 MMAs, operands rounded to TF32) with its own tiling (ForwardTilingTf32); softmax,
// biases, statistics and output stay float32.
#pragma once

#include "attention/epilogue.cuh"
#include "common/mma_sm80.cuh"
#include "attention/softmax.cuh"
#include "attention/tile_scheduler.cuh"

#include <type_traits>

// Tiling of the D = 32 and D = 64 buckets: warps per CTA, 16-row tiles per warp, keys per step and
// the minimum resident CTAs per SM compiled for (which caps registers per thread). Build-time knobs
// for tuning experiments, e.g. EVOFORMER_BLOCKS_EXTRA_CUDA_FLAGS="-DEVOFORMER_FWD_D32_MIN_BLOCKS=3"
// (see benchmarks/tune.sh); the defaults measured fastest on an H100 (see benchmarks/DESIGN.md).
#ifndef EVOFORMER_FWD_D32_WARPS
#define EVOFORMER_FWD_D32_WARPS 4
#endif
#ifndef EVOFORMER_FWD_D32_MTILES
#define EVOFORMER_FWD_D32_MTILES 2
#endif
#ifndef EVOFORMER_FWD_D32_BLOCK_N
#define EVOFORMER_FWD_D32_BLOCK_N 32
#endif
#ifndef EVOFORMER_FWD_D32_MIN_BLOCKS
#define EVOFORMER_FWD_D32_MIN_BLOCKS 4
#endif
#ifndef EVOFORMER_FWD_D64_WARPS
#define EVOFORMER_FWD_D64_WARPS 8
#endif
#ifndef EVOFORMER_FWD_D64_MTILES
#define EVOFORMER_FWD_D64_MTILES 1
#endif
#ifndef EVOFORMER_FWD_D64_BLOCK_N
#define EVOFORMER_FWD_D64_BLOCK_N 64
#endif
#ifndef EVOFORMER_FWD_D64_MIN_BLOCKS
#define EVOFORMER_FWD_D64_MIN_BLOCKS 2
#endif

namespace evoformer {
namespace sm80 {

// Tiling per head-dim bucket: {warps, 16-row tiles per warp, keys per step, min CTAs per SM}.
// Every warp's state is one or two 16-row tiles (S: 16-32 registers per tile) so that 16 warps fit
// an SM; at D = 32 two row tiles per warp over 32-key steps give each warp two independent softmax
// chains at the same register count. The warps share each K/V/pair tile copied into shared memory.
template <int kHeadDim, int kPair>
struct ForwardTiling {  // D = 128
  static constexpr int kWarps = 4, kMTiles = 1, kBlockN = 64, kMinBlocks = 2;
};
template <int kPair>
struct ForwardTiling<32, kPair> {
  // fp32 pair tiles take more registers: one CTA fewer per SM instead of spilling
  static constexpr int kWarps = EVOFORMER_FWD_D32_WARPS, kMTiles = EVOFORMER_FWD_D32_MTILES,
                       kBlockN = EVOFORMER_FWD_D32_BLOCK_N,
                       kMinBlocks = EVOFORMER_FWD_D32_MIN_BLOCKS - (kPair == kPairFloat ? 1 : 0);
};
template <int kPair>
struct ForwardTiling<64, kPair> {
  static constexpr int kWarps = EVOFORMER_FWD_D64_WARPS, kMTiles = EVOFORMER_FWD_D64_MTILES,
                       kBlockN = EVOFORMER_FWD_D64_BLOCK_N, kMinBlocks = EVOFORMER_FWD_D64_MIN_BLOCKS;
};

// Tiling of float32 inputs (TF32 tensor cores): shared-memory tiles twice the 16-bit ones, so 32
// keys per step and fewer resident CTAs (D = 32: 78 KB with a pair tile, 37 KB without; D = 64:
// 111 KB / 71 KB; D = 128: 122 KB / 112 KB per CTA), which also leaves room for A fragments twice
// as wide. At D = 128 the Q fragments are re-read from shared memory, as for 16-bit inputs.
template <int kHeadDim, int kPair>
struct ForwardTilingTf32 {  // D = 32
  static constexpr int kWarps = 4, kMTiles = 2, kBlockN = 32, kMinBlocks = kPair == kNoPair ? 3 : 2;
};
template <int kPair>
struct ForwardTilingTf32<64, kPair> {
  static constexpr int kWarps = 8, kMTiles = 1, kBlockN = 32, kMinBlocks = kPair == kNoPair ? 2 : 1;
};
template <int kPair>
struct ForwardTilingTf32<128, kPair> {
  static constexpr int kWarps = 4, kMTiles = 1, kBlockN = 32, kMinBlocks = 1;
};

template <typename Element_, int kHeadDim_, int kPair_>
struct ForwardConfig {
  using Element = Element_;
  using PairT = typename PairType<kPair_, Element_>::type;
  static constexpr int kHeadDim = kHeadDim_;  // bucket; D is zero-padded up to it in shared memory
  static constexpr int kPair = kPair_;
  static_assert(!std::is_same_v<Element, float> || kHeadDim <= limits::kTf32MaxHeadDim,
                "float32 (TF32) kernels exist up to limits::kTf32MaxHeadDim");
  using Tiling = std::conditional_t<std::is_same_v<Element, float>, ForwardTilingTf32<kHeadDim, kPair>,
                                    ForwardTiling<kHeadDim, kPair>>;
  static constexpr int kWarps = Tiling::kWarps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMinBlocksPerSM = Tiling::kMinBlocks;
  static constexpr int kMTiles = Tiling::kMTiles;  // 16-row MMA tiles per warp
  static constexpr int kBlockM = kWarps * kMTiles * 16;   // queries per CTA
  static constexpr int kBlockN = Tiling::kBlockN;        // keys per step
  static constexpr int kNTiles = kBlockN / 8;             // n8 tiles of S per 16 rows
  static constexpr int kDTiles = kHeadDim / 8;            // n8 tiles of O per 16 rows
  static constexpr int kKSteps = kHeadDim / 16;           // k16 steps of q.k^T
  static constexpr bool kQInRegs = kHeadDim <= 64;        // else Q fragments are re-read from smem
  static constexpr int kPitch = kHeadDim + kChunkElems<Element>;  // +16 B per row: conflict-free ldmatrix
  static constexpr int kPairPitch = kBlockN + 8;          // +16/32 B per row: conflict-free reads
  static constexpr int kQBytes = kBlockM * kPitch * sizeof(Element);
  static constexpr int kKVBytes = kBlockN * kPitch * sizeof(Element);  // K or V, one stage
  static constexpr int kPairBytes = kPair ? kBlockM * kPairPitch * int(sizeof(PairT)) : 0;  // one stage
  static constexpr int kMaskBytes = kBlockN * sizeof(float);                               // one stage
  static constexpr int kSmemBytes = kQBytes + 2 * (2 * kKVBytes + kPairBytes + kMaskBytes);
  static_assert(kSmemBytes <= kSm80MaxSmemPerCta, "the forward's shared memory exceeds an A100's limit per CTA");
};

template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSM)
    forward_sm80_kernel(const AttentionParams p, const RowTileGrid grid) {
  using Element = typename Cfg::Element;
  using PairT = typename Cfg::PairT;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kPitch = Cfg::kPitch;
  constexpr int kMTiles = Cfg::kMTiles, kNTiles = Cfg::kNTiles, kDTiles = Cfg::kDTiles;
  constexpr int kThreads = Cfg::kThreads;

  extern __shared__ __align__(16) char smem[];
  Element* sQ = reinterpret_cast<Element*>(smem);                                   // [kBlockM][kPitch]
  Element* sK = reinterpret_cast<Element*>(smem + Cfg::kQBytes);                    // [2][kBlockN][kPitch]
  Element* sV = reinterpret_cast<Element*>(smem + Cfg::kQBytes + 2 * Cfg::kKVBytes);  // [2][kBlockN][kPitch]
  PairT* sPair = reinterpret_cast<PairT*>(smem + Cfg::kQBytes + 4 * Cfg::kKVBytes);   // [2][kBlockM][kPairPitch]
  float* sMask = reinterpret_cast<float*>(smem + Cfg::kQBytes + 4 * Cfg::kKVBytes + 2 * Cfg::kPairBytes);  // [2][kBlockN]

  const int tid = threadIdx.x, lane = threadIdx.x % 32u, warp = threadIdx.x / 32u;  // unsigned: no sign fix-ups
  const int g = lane / 4;
  const RowTile rt = grid.decode();
  const int64_t b = rt.b, n = rt.n, h = blockIdx.y;
  const int m0 = rt.tile * kBlockM;
  const int rows_q = min(kBlockM, p.Lq - m0);
  const int warp_row0 = warp * kMTiles * 16;

  const Element* q = static_cast<const Element*>(p.q) + p.q_strides.at(b, n, m0, h);  // [Lq, D]
  const Element* k = static_cast<const Element*>(p.k) + p.k_strides.at(b, n, 0, h);  // [Lk, D], advanced per key block
  const Element* v = static_cast<const Element*>(p.v) + p.v_strides.at(b, n, 0, h);  // [Lk, D], advanced per key block
  const PairT* pair = nullptr;  // [Lq, Lk_pad] rows of this (b, h), from query m0, advanced per key block
  if constexpr (Cfg::kPair != kNoPair)
    pair = static_cast<const PairT*>(p.pair) + b * p.pair_stride_b + h * p.pair_stride_h + int64_t(m0) * p.pair_stride_q;
  const bool has_mask = p.mask_scaled != nullptr;
  const float* mask = has_mask ? p.mask_scaled + b * p.mask_stride_b + n * p.mask_stride_n : nullptr;  // [Lk_pad], advanced per key block

  // Per-thread copy plans; the K / V / pair / mask pointers advance one key block per step.
  const TileCopy<Element, kBlockN, Cfg::kHeadDim, kPitch, kThreads> copy_k(tid), copy_v(tid);
  const TileCopy<PairT, kBlockM, kBlockN, Cfg::kPairPitch, kThreads> copy_pair(tid);
  const TileCopy<float, 1, kBlockN, kBlockN, kThreads> copy_mask(tid);
  auto load_stage = [&](int stage, int n0) {
    const int rows_k = min(kBlockN, p.Lk - n0);
    copy_k(sK + stage * kBlockN * kPitch, k, p.k_strides.l, rows_k, p.D);
    copy_v(sV + stage * kBlockN * kPitch, v, p.v_strides.l, rows_k, p.D);
    if constexpr (Cfg::kPair != kNoPair) {
      copy_pair(sPair + stage * kBlockM * Cfg::kPairPitch, pair, p.pair_stride_q, rows_q, p.Lk - n0);
      pair += kBlockN;
    }
    if (has_mask) {
      copy_mask(sMask + stage * kBlockN, mask, 0, 1, p.Lk - n0);
      mask += kBlockN;
    }
    k += int64_t(kBlockN) * p.k_strides.l;
    v += int64_t(kBlockN) * p.v_strides.l;
  };

  load_tile_async<Element, kBlockM, Cfg::kHeadDim, kPitch, kThreads>(sQ, q, p.q_strides.l, rows_q, p.D, tid);
  load_stage(0, 0);
  cp_async_commit();

  float o[kMTiles][kDTiles][4];
  // max of S (raw units) per row; row sums of P as a tensor-core accumulator (rows g, g + 8 in
  // elements 0-1, 2-3; see mma_c_by_kmajor)
  float row_max_s[kMTiles][2], row_sum_acc[kMTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) row_max_s[mt][r] = -kInf;
#pragma unroll
    for (int e = 0; e < 4; ++e) row_sum_acc[mt][e] = 0.f;
  }
  uint32_t qf[kMTiles][Cfg::kKSteps][kARegs<Element>];  // Q as A operand, loaded once (when Cfg::kQInRegs)

  const int n_blocks = (p.Lk + kBlockN - 1) / kBlockN;
  for (int jb = 0; jb < n_blocks; ++jb) {
    const int stage = jb & 1;
    const int n0 = jb * kBlockN;
    if (jb + 1 < n_blocks) load_stage(stage ^ 1, n0 + kBlockN);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if constexpr (Cfg::kQInRegs) {
      if (jb == 0) load_a_frags<kMTiles, Cfg::kKSteps, kPitch>(qf, sQ, warp_row0, lane);
    }
    const Element* sKs = sK + stage * kBlockN * kPitch;
    const Element* sVs = sV + stage * kBlockN * kPitch;
    const PairT* sPairs = sPair + stage * kBlockM * Cfg::kPairPitch;
    const float* sMasks = has_mask ? sMask + stage * kBlockN : nullptr;

    // S = (mask + pair) / scale + Q . K^T  [kMTiles * 16 rows, kBlockN keys] per warp
    float s[kMTiles][kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      init_block_scores<Cfg::kPair != kNoPair, kNTiles, Cfg::kPairPitch>(s[mt], sMasks, sPairs, warp_row0 + mt * 16,
                                                                         p.Lk - n0, p.inv_scale, lane);
      mma_a_by_nmajor<Element, kNTiles, Cfg::kKSteps, kPitch>(
          s[mt],
          [&](int kk) { return a_frag_of<Cfg::kKSteps, kPitch, Cfg::kQInRegs>(qf[mt], sQ, warp_row0 + mt * 16, kk, lane); },
          sKs, lane);
    }

    // Online softmax (softmax_step); what was accumulated is rescaled by alpha.
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      float alpha[2];
      softmax_step<kNTiles, kResidualPerScore<Element>>(s[mt], row_max_s[mt], alpha, p.scale_log2);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        row_sum_acc[mt][2 * r] *= alpha[r], row_sum_acc[mt][2 * r + 1] *= alpha[r];
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) o[mt][dt][2 * r] *= alpha[r], o[mt][dt][2 * r + 1] *= alpha[r];
      }
    }

    // O += P . V
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
      mma_c_by_kmajor<Element, kNTiles, kDTiles, kPitch, true>(o[mt], s[mt], sVs, lane, &row_sum_acc[mt]);
    __syncthreads();  // the next iteration's copies overwrite this stage
  }

  // Epilogue (store_output_rows): o / rowsum and the row statistics (no gate: the sm90 family's only).
  const OutputRows<Element> rows(p, b, n, h);  // [Lq, D] slices
  float2* stats = reinterpret_cast<float2*>(p.stats) + ((b * p.N + n) * p.H + h) * p.Lq;  // [Lq]
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    const float row_sum[2] = {row_sum_acc[mt][0], row_sum_acc[mt][2]};
    store_output_rows<Element, kDTiles>(o[mt], row_sum, row_max_s[mt], p.scale_log2, rows, nullptr, stats,
                                        m0 + warp_row0 + mt * 16 + g, p.Lq, p.D, lane);
  }
}

}  // namespace sm80

template <typename Element, int kHeadDim, int kPair>
int forward_smem_bytes_sm80() {
  return sm80::ForwardConfig<Element, kHeadDim, kPair>::kSmemBytes;
}

template <typename Element, int kHeadDim, int kPair>
void launch_forward_sm80(const AttentionParams& p, cudaStream_t stream) {
  using Cfg = sm80::ForwardConfig<Element, kHeadDim, kPair>;
  launch_on_row_tiles<Cfg::kBlockM>(sm80::forward_sm80_kernel<Cfg>, p, p.Lq, Cfg::kThreads, Cfg::kSmemBytes, stream,
                                    "evoformer forward sm80");
}

}  // namespace evoformer
