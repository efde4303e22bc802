// The sm80 backward kernels (mma.sync). Probabilities are recomputed from q, k, the biases and the
// forward's row statistics (m, l): P = exp2((S - m) * scale * log2(e) - l), S = (mask_bias +
// pair_bias) / scale + q.k formed as in the forward (a score accumulator that starts at the biases
// over the scale)
//   dV = P^T.dO    dP = dO.V^T    dS = P * (dP - delta), delta = rowsum(dO * O)
//   dQ = scale * dS.K    dK = scale * dS^T.Q    d(pair_bias) = sum_n dS    d(mask_bias) = sum_{h,i} dS
// Nothing is accumulated with atomics, so every gradient is bitwise reproducible:
//  - dK/dV kernel: CTA = (key block, b * N + n) on x (key block fastest), h on y; loops over query
//    blocks. It computes S^T = K.Q^T so that P^T and dS^T are A operands in registers for
//    dV += P^T.dO and dK += dS^T.Q; the row sums of dS^T are the mask-bias gradient of (b, n, h) per key.
//  - dQ kernel: CTA = (query block, b * N + n) on x, h on y; loops over key blocks; dQ stays in registers.
//  - pair-bias kernel (only when that gradient is wanted): CTA = (b, n-chunk, query block, key
//    block, h), loops over the chunk's rows n recomputing S, dP and dS, sums dS in registers and
//    writes its tile of the chunk's partial once. The partials ([n_chunks, B, H, Lq, Lk] fp32) are
//    summed by the host in a fixed order.
// Element float runs the products on the TF32 tensor cores (mma_sm80.cuh), with 32-query steps in
// the dK/dV kernel at D >= 64, 32-key steps in dQ and one pair-bias stage at D = 128 (bounding shared
// memory and registers); gradients are float32.
#pragma once

#include "attention/epilogue.cuh"
#include "common/mma_sm80.cuh"
#include "attention/preprocess.cuh"
#include "attention/softmax.cuh"
#include "attention/tile_scheduler.cuh"

#include <type_traits>

// Minimum resident CTAs per SM of the D = 32 backward kernels (see BackwardConfig); a build-time
// knob for tuning experiments like the forward's tiling macros.
#ifndef EVOFORMER_BWD_MIN_BLOCKS
#define EVOFORMER_BWD_MIN_BLOCKS 3
#endif

namespace evoformer {
namespace sm80 {

template <typename Element_, int kHeadDim_, int kPair_>
struct BackwardConfig {
  using Element = Element_;
  using PairT = typename PairType<kPair_, Element_>::type;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kPair = kPair_;
  // float32 inputs (TF32 tensor cores): tiles of twice the bytes
  static constexpr bool kTf32 = std::is_same_v<Element, float>;
  static_assert(!kTf32 || kHeadDim <= limits::kTf32MaxHeadDim,
                "float32 (TF32) kernels exist up to limits::kTf32MaxHeadDim");
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kPitch = kHeadDim + kChunkElems<Element>;  // +16 B per row: conflict-free ldmatrix
  static constexpr int kKSteps = kHeadDim / 16;
  static constexpr int kDTiles = kHeadDim / 8;
  static constexpr int kTileBytes16 = kPitch * sizeof(Element);  // one row of a q/k/v tile
  // Resident CTAs per SM compiled for: the register cap (168 at 3 CTAs) pays off at D = 32 and
  // makes D = 64 / 128 spill hundreds of bytes, so those keep the compiler's own allocation; float32
  // (93-160 KB of shared memory per CTA) fits at most two CTAs per SM anyway.
  static constexpr int kMinBlocksPerSM = kHeadDim <= 32 && !kTf32 ? EVOFORMER_BWD_MIN_BLOCKS : 1;

  // dK/dV kernel: 16 keys per warp, query steps of kBlockQ.
  static constexpr int kBlockKV = kWarps * 16;
  static constexpr int kBlockQ = kHeadDim <= (kTf32 ? 32 : 64) ? 64 : 32;
  static constexpr int kQTiles = kBlockQ / 8;
  static constexpr bool kKVInRegs = kHeadDim <= 64;  // keep K and V A-fragments in registers
  static constexpr int kPairPitchT = kBlockKV + 8;     // pair tile [kBlockQ queries][kBlockKV keys]
  static constexpr int kDkdvStageBytes =
      2 * kBlockQ * kTileBytes16 + (kPair ? kBlockQ * kPairPitchT * int(sizeof(PairT)) : 0) + 3 * kBlockQ * 4;
  static constexpr int kDkdvSmemBytes = 2 * kBlockKV * kTileBytes16 + 2 * kDkdvStageBytes;

  // dQ kernel: 16 queries per warp, key steps of kBlockK (float32: 32, which keeps its score and
  // dP tiles and twice-as-wide Q / dO fragments within the register cap without spills).
  static constexpr int kBlockQ2 = kWarps * 16;
  static constexpr int kBlockK = kTf32 ? 32 : 64;
  static constexpr int kNTiles = kBlockK / 8;
  static constexpr bool kQInRegs = kHeadDim <= 64;  // keep Q and dO A-fragments in registers
  static constexpr int kPairPitch = kBlockK + 8;
  static constexpr int kDqStageBytes =
      2 * kBlockK * kTileBytes16 + (kPair ? kBlockQ2 * kPairPitch * int(sizeof(PairT)) : 0) + kBlockK * 4;
  static constexpr int kDqSmemBytes = 2 * kBlockQ2 * kTileBytes16 + 2 * kDqStageBytes;

  // Pair-bias kernel: a [kBlockQ2, kBlockKB] tile, 16 queries per warp; per row n a stage holds Q,
  // dO [kBlockQ2][kPitch], K, V [kBlockKB][kPitch], mask [kBlockKB], stats [kBlockQ2] (float2) and
  // delta [kBlockQ2]; the pair tile [kBlockQ2][kPairPitchB] is loaded once. Two stages (the next
  // row's copies overlap this row's math) where they fit shared memory; float32 at D = 128 (a stage
  // of 135 KB) has one, loaded after the row's math.
  static constexpr int kBlockKB = limits::kPairGradTileKeys;
  static constexpr int kNTilesB = kBlockKB / 8;
  static constexpr int kPairPitchB = kBlockKB + 8;
  static constexpr int kBiasStageBytes = 2 * kBlockQ2 * kTileBytes16 + 2 * kBlockKB * kTileBytes16 + kBlockKB * 4 +
                                         kBlockQ2 * 8 + kBlockQ2 * 4;
  static constexpr int kBiasPairBytes = kPair ? kBlockQ2 * kPairPitchB * int(sizeof(PairT)) : 0;
  static constexpr int kBiasStages = kBiasPairBytes + 2 * kBiasStageBytes <= kSm80MaxSmemPerCta ? 2 : 1;
  static constexpr int kBiasSmemBytes = kBiasPairBytes + kBiasStages * kBiasStageBytes;
  static_assert(kBiasSmemBytes <= kSm80MaxSmemPerCta && kDkdvSmemBytes <= kSm80MaxSmemPerCta &&
                    kDqSmemBytes <= kSm80MaxSmemPerCta,
                "a backward kernel's shared memory exceeds an A100's limit per CTA");
  static_assert(kBlockQ2 == limits::kPairGradTileQueries,
                "the pair-bias kernel's tile is the one its launch and the host size the grid from");
};

template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSM)
    backward_sm80_dkdv_kernel(const AttentionParams p, const RowTileGrid grid) {
  using Element = typename Cfg::Element;
  using PairT = typename Cfg::PairT;
  constexpr int kPitch = Cfg::kPitch, kBlockKV = Cfg::kBlockKV, kBlockQ = Cfg::kBlockQ;
  constexpr int kQTiles = Cfg::kQTiles, kDTiles = Cfg::kDTiles, kKSteps = Cfg::kKSteps;
  constexpr int kThreads = Cfg::kThreads, kPairPitch = Cfg::kPairPitchT;

  extern __shared__ __align__(16) char smem[];
  Element* sK = reinterpret_cast<Element*>(smem);  // [kBlockKV][kPitch]
  Element* sV = sK + kBlockKV * kPitch;             // [kBlockKV][kPitch]
  char* stages = smem + 2 * kBlockKV * Cfg::kTileBytes16;
  // stage s: Q [kBlockQ][kPitch], dO [kBlockQ][kPitch], pair [kBlockQ][kPairPitch], stats [kBlockQ] (float2),
  // delta [kBlockQ]
  auto stage_q = [&](int s) { return reinterpret_cast<Element*>(stages + s * Cfg::kDkdvStageBytes); };
  auto stage_do = [&](int s) { return stage_q(s) + kBlockQ * kPitch; };
  auto stage_pair = [&](int s) { return reinterpret_cast<PairT*>(stage_do(s) + kBlockQ * kPitch); };
  auto stage_stats = [&](int s) {
    return reinterpret_cast<float2*>(stages + (s + 1) * Cfg::kDkdvStageBytes - 3 * kBlockQ * 4);
  };
  auto stage_delta = [&](int s) { return reinterpret_cast<float*>(stage_stats(s) + kBlockQ); };

  const int tid = threadIdx.x, lane = threadIdx.x % 32u, warp = threadIdx.x / 32u;  // unsigned: no sign fix-ups
  const int g = lane / 4, t = lane % 4;
  const RowTile rt = grid.decode();
  const int64_t b = rt.b, n = rt.n, h = blockIdx.y;
  const int j0 = rt.tile * kBlockKV;
  const int rows_k = min(kBlockKV, p.Lk - j0);
  const int64_t bnh = (b * p.N + n) * p.H + h;

  // q, dO [Lq, D] and pair [Lq, Lk_pad] (from key j0) advance one query block per step
  const Element* q = static_cast<const Element*>(p.q) + p.q_strides.at(b, n, 0, h);
  const Element* dout = static_cast<const Element*>(p.dout) + p.do_strides.at(b, n, 0, h);
  const Element* k = static_cast<const Element*>(p.k) + p.k_strides.at(b, n, j0, h);  // [Lk, D] from key j0
  const Element* v = static_cast<const Element*>(p.v) + p.v_strides.at(b, n, j0, h);
  const PairT* pair = nullptr;
  if constexpr (Cfg::kPair != kNoPair)
    pair = static_cast<const PairT*>(p.pair) + b * p.pair_stride_b + h * p.pair_stride_h + j0;

  // Mask bias / scale of this thread's two keys; keys past Lk are -inf.
  float mask_key[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = j0 + warp * 16 + g + 8 * r;
    mask_key[r] = key_mask_scaled(p, b, n, key);
  }

  static_assert(kBlockQ <= kThreads, "one thread per query row of a block");
  PendingRowStats pending;  // the next query block's statistics
  auto store_pending = [&](int s) { pending.store(stage_stats(s), stage_delta(s), tid, kBlockQ); };
  // Per-thread copy plans; the q / dO / pair pointers advance one query block per step.
  const TileCopy<Element, kBlockQ, Cfg::kHeadDim, kPitch, kThreads> copy_q(tid), copy_do(tid);
  const TileCopy<PairT, kBlockQ, kBlockKV, kPairPitch, kThreads> copy_pair(tid);
  auto load_stage = [&](int s, int i0) {
    const int rows = min(kBlockQ, p.Lq - i0);
    copy_q(stage_q(s), q, p.q_strides.l, rows, p.D);
    copy_do(stage_do(s), dout, p.do_strides.l, rows, p.D);
    if constexpr (Cfg::kPair != kNoPair) copy_pair(stage_pair(s), pair, p.pair_stride_q, rows, p.Lk - j0);
    pending.load(p, bnh, i0, tid, kBlockQ);
    q += int64_t(kBlockQ) * p.q_strides.l;
    dout += int64_t(kBlockQ) * p.do_strides.l;
    if constexpr (Cfg::kPair != kNoPair) pair += int64_t(kBlockQ) * p.pair_stride_q;
  };

  load_tile_async<Element, kBlockKV, Cfg::kHeadDim, kPitch, kThreads>(sK, k, p.k_strides.l, rows_k, p.D, tid);
  load_tile_async<Element, kBlockKV, Cfg::kHeadDim, kPitch, kThreads>(sV, v, p.v_strides.l, rows_k, p.D, tid);
  load_stage(0, 0);
  store_pending(0);
  cp_async_commit();

  float dk[kDTiles][4], dv[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = 0.f, dv[dt][e] = 0.f;
  float dmask_acc[2] = {0.f, 0.f};
  uint32_t kf[1][kKSteps][kARegs<Element>], vf[1][kKSteps][kARegs<Element>];  // used when Cfg::kKVInRegs

  const int n_blocks = (p.Lq + kBlockQ - 1) / kBlockQ;
  for (int ib = 0; ib < n_blocks; ++ib) {
    const int s = ib & 1;
    if (ib + 1 < n_blocks) load_stage(s ^ 1, (ib + 1) * kBlockQ);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if constexpr (Cfg::kKVInRegs) {
      if (ib == 0) {
        load_a_frags<1, kKSteps, kPitch>(kf, sK, warp * 16, lane);
        load_a_frags<1, kKSteps, kPitch>(vf, sV, warp * 16, lane);
      }
    }
    const Element* sQ = stage_q(s);
    const Element* sdO = stage_do(s);
    const PairT* sPair = stage_pair(s);
    const float2* sStats = stage_stats(s);
    const float* sDelta = stage_delta(s);

    // S^T = (mask + pair)^T / scale + K . Q^T  [16 keys of this warp, kBlockQ queries]
    float st[kQTiles][4];
    if constexpr (Cfg::kPair != kNoPair) load_bias_tile<kQTiles, kPairPitch, true>(st, sPair, warp * 16, lane);
#pragma unroll
    for (int qt = 0; qt < kQTiles; ++qt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        st[qt][e] = Cfg::kPair != kNoPair ? fmaf(st[qt][e], p.inv_scale, mask_key[e / 2]) : mask_key[e / 2];
    mma_a_by_nmajor<Element, kQTiles, kKSteps, kPitch>(
        st, [&](int kk) { return a_frag_of<kKSteps, kPitch, Cfg::kKVInRegs>(kf[0], sK, warp * 16, kk, lane); }, sQ,
        lane);

    // P^T = exp2((S^T - m) * scale_log2 - l), (m, l) of the query (column)
#pragma unroll
    for (int qt = 0; qt < kQTiles; ++qt) {
      const float2 c0 = sStats[qt * 8 + 2 * t], c1 = sStats[qt * 8 + 2 * t + 1];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        st[qt][2 * r] = fast_exp2(fmaf(st[qt][2 * r] - c0.x, p.scale_log2, -c0.y));
        st[qt][2 * r + 1] = fast_exp2(fmaf(st[qt][2 * r + 1] - c1.x, p.scale_log2, -c1.y));
      }
    }

    // dV += P^T . dO
    mma_c_by_kmajor<Element, kQTiles, kDTiles, kPitch>(dv, st, sdO, lane);

    // dP^T - delta = V . dO^T - delta: the accumulator starts at -delta of the query (column).
    float dpt[kQTiles][4];
#pragma unroll
    for (int qt = 0; qt < kQTiles; ++qt) {
      const float2 dl = *reinterpret_cast<const float2*>(sDelta + qt * 8 + 2 * t);
#pragma unroll
      for (int r = 0; r < 2; ++r) dpt[qt][2 * r] = -dl.x, dpt[qt][2 * r + 1] = -dl.y;
    }
    mma_a_by_nmajor<Element, kQTiles, kKSteps, kPitch>(
        dpt, [&](int kk) { return a_frag_of<kKSteps, kPitch, Cfg::kKVInRegs>(vf[0], sV, warp * 16, kk, lane); }, sdO,
        lane);

    // dS^T = P^T * (dP^T - delta); its row sums are the mask-bias gradient.
#pragma unroll
    for (int qt = 0; qt < kQTiles; ++qt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        dpt[qt][2 * r] *= st[qt][2 * r];
        dpt[qt][2 * r + 1] *= st[qt][2 * r + 1];
        dmask_acc[r] += dpt[qt][2 * r] + dpt[qt][2 * r + 1];
      }

    // dK += dS^T . Q
    mma_c_by_kmajor<Element, kQTiles, kDTiles, kPitch>(dk, dpt, sQ, lane);
    if (ib + 1 < n_blocks) store_pending(s ^ 1);
    __syncthreads();  // the next iteration's copies overwrite this stage
  }

  store_dkdv_rows<Element, kDTiles>(dk, dv, dmask_acc, p, b, n, h, j0 + warp * 16 + g, lane);
}

// S = (mask + pair) / scale + Q.K^T and dP = dO.V^T for one warp's 16 query rows and a key tile of
// kNTiles * 8 keys (the pair tile's rows kPairPitch apart), then dS = P * (dP - delta) with
// P = exp2((S - m) * scale_log2 - l); dS is left in `dp`. The A fragments of Q and dO come from
// qf / dof when kFragsInRegs, else from sQ / sdO.
template <typename Cfg, int kNTiles, int kPairPitch, bool kHasMask, bool kFragsInRegs>
__device__ __forceinline__ void compute_ds_tile(float (&dp)[kNTiles][4], const AttentionParams& p,
                                                const uint32_t (&qf)[1][Cfg::kKSteps][kARegs<typename Cfg::Element>],
                                                const uint32_t (&dof)[1][Cfg::kKSteps][kARegs<typename Cfg::Element>],
                                                const typename Cfg::Element* sQ, const typename Cfg::Element* sdO,
                                                const typename Cfg::Element* sK, const typename Cfg::Element* sV,
                                                const typename Cfg::PairT* sPair, const float* sMask,
                                                const float2 (&stats_row)[2], const float (&delta_row)[2],
                                                int warp_row0, int valid_keys, int lane) {
  using Element = typename Cfg::Element;
  constexpr int kKSteps = Cfg::kKSteps, kPitch = Cfg::kPitch;
  float sc[kNTiles][4];
  init_block_scores<Cfg::kPair != kNoPair, kNTiles, kPairPitch>(sc, kHasMask ? sMask : nullptr, sPair, warp_row0,
                                                                     valid_keys, p.inv_scale, lane);
  start_at_minus_delta<kNTiles>(dp, delta_row);
  mma_a_by_nmajor<Element, kNTiles, kKSteps, kPitch>(
      sc, [&](int kk) { return a_frag_of<kKSteps, kPitch, kFragsInRegs>(qf[0], sQ, warp_row0, kk, lane); }, sK, lane);
  mma_a_by_nmajor<Element, kNTiles, kKSteps, kPitch>(
      dp, [&](int kk) { return a_frag_of<kKSteps, kPitch, kFragsInRegs>(dof[0], sdO, warp_row0, kk, lane); }, sV, lane);
  scores_to_ds<kNTiles>(dp, sc, stats_row, p.scale_log2);
}

template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSM)
    backward_sm80_dq_kernel(const AttentionParams p, const RowTileGrid grid) {
  using Element = typename Cfg::Element;
  using PairT = typename Cfg::PairT;
  constexpr int kPitch = Cfg::kPitch, kBlockQ = Cfg::kBlockQ2, kBlockK = Cfg::kBlockK;
  constexpr int kDTiles = Cfg::kDTiles, kKSteps = Cfg::kKSteps;
  constexpr int kThreads = Cfg::kThreads, kPairPitch = Cfg::kPairPitch;

  extern __shared__ __align__(16) char smem[];
  Element* sQ = reinterpret_cast<Element*>(smem);  // [kBlockQ][kPitch]
  Element* sdO = sQ + kBlockQ * kPitch;             // [kBlockQ][kPitch]
  char* stages = smem + 2 * kBlockQ * Cfg::kTileBytes16;
  // stage s: K [kBlockK][kPitch], V [kBlockK][kPitch], pair [kBlockQ][kPairPitch], mask [kBlockK]
  auto stage_k = [&](int s) { return reinterpret_cast<Element*>(stages + s * Cfg::kDqStageBytes); };
  auto stage_v = [&](int s) { return stage_k(s) + kBlockK * kPitch; };
  auto stage_pair = [&](int s) { return reinterpret_cast<PairT*>(stage_v(s) + kBlockK * kPitch); };
  auto stage_mask = [&](int s) {
    return reinterpret_cast<float*>(stages + (s + 1) * Cfg::kDqStageBytes - kBlockK * 4);
  };

  const int tid = threadIdx.x, lane = threadIdx.x % 32u, warp = threadIdx.x / 32u;  // unsigned: no sign fix-ups
  const int g = lane / 4;
  const RowTile rt = grid.decode();
  const int64_t b = rt.b, n = rt.n, h = blockIdx.y;
  const int64_t bnh = (b * p.N + n) * p.H + h;
  const int m0 = rt.tile * kBlockQ;
  const int rows_q = min(kBlockQ, p.Lq - m0);
  const int warp_row0 = warp * 16;

  const Element* q = static_cast<const Element*>(p.q) + p.q_strides.at(b, n, m0, h);  // [Lq, D] from query m0
  const Element* dout = static_cast<const Element*>(p.dout) + p.do_strides.at(b, n, m0, h);
  // K, V [Lk, D], advanced one key block per step
  const Element* k = static_cast<const Element*>(p.k) + p.k_strides.at(b, n, 0, h);
  const Element* v = static_cast<const Element*>(p.v) + p.v_strides.at(b, n, 0, h);
  const bool has_mask = p.mask_scaled != nullptr;
  const float* mask = has_mask ? p.mask_scaled + b * p.mask_stride_b + n * p.mask_stride_n : nullptr;  // [Lk_pad], advanced per key block
  const PairT* pair = nullptr;  // [Lq, Lk_pad] of (b, h), from query m0, advanced per key block
  if constexpr (Cfg::kPair != kNoPair)
    pair = static_cast<const PairT*>(p.pair) + b * p.pair_stride_b + h * p.pair_stride_h + int64_t(m0) * p.pair_stride_q;

  // Per-thread copy plans; the K / V / pair / mask pointers advance one key block per step.
  const TileCopy<Element, kBlockK, Cfg::kHeadDim, kPitch, kThreads> copy_k(tid), copy_v(tid);
  const TileCopy<PairT, kBlockQ, kBlockK, kPairPitch, kThreads> copy_pair(tid);
  const TileCopy<float, 1, kBlockK, kBlockK, kThreads> copy_mask(tid);
  auto load_stage = [&](int s, int n0) {
    const int rows_k = min(kBlockK, p.Lk - n0);
    copy_k(stage_k(s), k, p.k_strides.l, rows_k, p.D);
    copy_v(stage_v(s), v, p.v_strides.l, rows_k, p.D);
    if constexpr (Cfg::kPair != kNoPair) {
      copy_pair(stage_pair(s), pair, p.pair_stride_q, rows_q, p.Lk - n0);
      pair += kBlockK;
    }
    if (has_mask) {
      copy_mask(stage_mask(s), mask, 0, 1, p.Lk - n0);
      mask += kBlockK;
    }
    k += int64_t(kBlockK) * p.k_strides.l;
    v += int64_t(kBlockK) * p.v_strides.l;
  };

  load_tile_async<Element, kBlockQ, Cfg::kHeadDim, kPitch, kThreads>(sQ, q, p.q_strides.l, rows_q, p.D, tid);
  load_tile_async<Element, kBlockQ, Cfg::kHeadDim, kPitch, kThreads>(sdO, dout, p.do_strides.l, rows_q, p.D, tid);
  load_stage(0, 0);
  cp_async_commit();

  float2 stats_row[2];
  float delta_row[2];
  load_row_stats(stats_row, delta_row, p, bnh, m0 + warp_row0 + g);
  float dq[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[dt][e] = 0.f;
  uint32_t qf[1][kKSteps][kARegs<Element>], dof[1][kKSteps][kARegs<Element>];  // used when Cfg::kQInRegs

  const int n_blocks = (p.Lk + kBlockK - 1) / kBlockK;
  for (int jb = 0; jb < n_blocks; ++jb) {
    const int s = jb & 1;
    const int n0 = jb * kBlockK;
    if (jb + 1 < n_blocks) load_stage(s ^ 1, n0 + kBlockK);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if constexpr (Cfg::kQInRegs) {
      if (jb == 0) {
        load_a_frags<1, kKSteps, kPitch>(qf, sQ, warp_row0, lane);
        load_a_frags<1, kKSteps, kPitch>(dof, sdO, warp_row0, lane);
      }
    }
    const Element* sK = stage_k(s);
    float ds[Cfg::kNTiles][4];
    if (has_mask)
      compute_ds_tile<Cfg, Cfg::kNTiles, kPairPitch, true, Cfg::kQInRegs>(
          ds, p, qf, dof, sQ, sdO, sK, stage_v(s), stage_pair(s), stage_mask(s), stats_row, delta_row, warp_row0,
          p.Lk - n0, lane);
    else
      compute_ds_tile<Cfg, Cfg::kNTiles, kPairPitch, false, Cfg::kQInRegs>(
          ds, p, qf, dof, sQ, sdO, sK, stage_v(s), stage_pair(s), nullptr, stats_row, delta_row, warp_row0, p.Lk - n0,
          lane);

    // dQ += dS . K
    mma_c_by_kmajor<Element, Cfg::kNTiles, kDTiles, kPitch>(dq, ds, sK, lane);
    __syncthreads();  // the next iteration's copies overwrite this stage
  }

  Element* dq_out = static_cast<Element*>(p.dq) + p.dq_strides.at(b, n, 0, h);  // [Lq, D], rows dq_strides.l apart
  store_scaled_rows<Element, kDTiles>(dq, dq_out, p.dq_strides.l, m0 + warp_row0 + g, p.Lq, p.D, p.scale, lane);
}

// The sm80 pair-bias-gradient kernel decodes its PairGradTile grid and writes its partial inline
// rather than through PairGradTile and store_pair_partial: that form compiled to a different
// register allocation here and measured slower on an H100 (see benchmarks/DESIGN.md), so the Hopper
// kernel alone uses those helpers.
template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSM)
    backward_sm80_dpair_kernel(const AttentionParams p) {
  using Element = typename Cfg::Element;
  using PairT = typename Cfg::PairT;
  constexpr int kPitch = Cfg::kPitch, kBlockQ = Cfg::kBlockQ2, kBlockK = Cfg::kBlockKB;
  constexpr int kNTiles = Cfg::kNTilesB, kThreads = Cfg::kThreads, kPairPitch = Cfg::kPairPitchB;
  constexpr int kParts = Cfg::kTf32 ? 2 : 1, kSub = kNTiles / kParts;

  extern __shared__ __align__(16) char smem[];
  PairT* sPair = reinterpret_cast<PairT*>(smem);  // [kBlockQ][kPairPitch]
  char* stages = smem + Cfg::kBiasPairBytes;
  // stage s: Q, dO [kBlockQ][kPitch], K, V [kBlockK][kPitch], mask [kBlockK], stats [kBlockQ], delta [kBlockQ]
  auto stage_q = [&](int s) { return reinterpret_cast<Element*>(stages + s * Cfg::kBiasStageBytes); };
  auto stage_do = [&](int s) { return stage_q(s) + kBlockQ * kPitch; };
  auto stage_k = [&](int s) { return stage_do(s) + kBlockQ * kPitch; };
  auto stage_v = [&](int s) { return stage_k(s) + kBlockK * kPitch; };
  auto stage_mask = [&](int s) { return reinterpret_cast<float*>(stage_v(s) + kBlockK * kPitch); };
  auto stage_stats = [&](int s) { return reinterpret_cast<float2*>(stage_mask(s) + kBlockK); };
  auto stage_delta = [&](int s) { return reinterpret_cast<float*>(stage_stats(s) + kBlockQ); };

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;  // (signed: the unsigned form spills here)
  const int g = lane / 4, t = lane % 4;
  // blockIdx.x = ((b * n_chunks + chunk) * n_query_blocks + query block) * n_key_blocks + key block
  const int n_kb = (p.Lk + kBlockK - 1) / kBlockK, n_qb = (p.Lq + kBlockQ - 1) / kBlockQ;
  // (32-bit unsigned arithmetic: the grid's x extent is below 2^31)
  const unsigned x = blockIdx.x, x_qb = x / unsigned(n_kb), x_chunk = x_qb / unsigned(n_qb);
  const int64_t kb = x - x_qb * unsigned(n_kb), qb = x_qb - x_chunk * unsigned(n_qb);
  const int64_t chunk = x_chunk % unsigned(p.n_chunks), b = x_chunk / unsigned(p.n_chunks);
  const int64_t h = blockIdx.y;
  const int m0 = int(qb) * kBlockQ, n0 = int(kb) * kBlockK;
  const int rows_q = min(kBlockQ, p.Lq - m0), rows_k = min(kBlockK, p.Lk - n0);
  const int n_begin = int(chunk) * p.n_chunk_size, n_end = min(p.N, n_begin + p.n_chunk_size);
  const int warp_row0 = warp * 16;

  if constexpr (Cfg::kPair != kNoPair) {
    const PairT* pair = static_cast<const PairT*>(p.pair) + b * p.pair_stride_b + h * p.pair_stride_h +
                        int64_t(m0) * p.pair_stride_q + n0;  // [Lq, Lk_pad] tile of (b, h)
    load_tile_async<PairT, kBlockQ, kBlockK, kPairPitch, kThreads>(sPair, pair, p.pair_stride_q, rows_q, p.Lk - n0, tid);
  }
  // Per-thread copy plans; the q / dO / K / V / mask pointers start at row n_begin and advance one
  // row n per step. The row statistics are plain loads (staging them through registers or
  // cp.async made this kernel spill at its 168-register cap).
  const TileCopy<Element, kBlockQ, Cfg::kHeadDim, kPitch, kThreads> copy_q(tid), copy_do(tid);
  const TileCopy<Element, kBlockK, Cfg::kHeadDim, kPitch, kThreads> copy_k(tid), copy_v(tid);
  const TileCopy<float, 1, kBlockK, kBlockK, kThreads> copy_mask(tid);
  const Element* q = static_cast<const Element*>(p.q) + p.q_strides.at(b, n_begin, m0, h);  // [kBlockQ, D] tile of row n
  const Element* dout = static_cast<const Element*>(p.dout) + p.do_strides.at(b, n_begin, m0, h);
  const Element* k = static_cast<const Element*>(p.k) + p.k_strides.at(b, n_begin, n0, h);  // [kBlockK, D] tile of row n
  const Element* v = static_cast<const Element*>(p.v) + p.v_strides.at(b, n_begin, n0, h);
  const float* mask = p.mask_scaled ? p.mask_scaled + b * p.mask_stride_b + n_begin * p.mask_stride_n + n0 : nullptr;
  auto load_stage = [&](int s, int64_t n) {
    copy_q(stage_q(s), q, p.q_strides.l, rows_q, p.D);
    copy_do(stage_do(s), dout, p.do_strides.l, rows_q, p.D);
    copy_k(stage_k(s), k, p.k_strides.l, rows_k, p.D);
    copy_v(stage_v(s), v, p.v_strides.l, rows_k, p.D);
    if (mask) copy_mask(stage_mask(s), mask, 0, 1, p.Lk - n0);
    const int64_t bnh = (b * p.N + n) * p.H + h;
    for (int c = tid; c < kBlockQ; c += kThreads) {
      const RowStat rs = row_stat(p, bnh, m0 + c);
      stage_stats(s)[c] = rs.stats;
      stage_delta(s)[c] = rs.delta;
    }
    q += p.q_strides.n, dout += p.do_strides.n, k += p.k_strides.n, v += p.v_strides.n;
    if (mask) mask += p.mask_stride_n;
  };

  load_stage(0, n_begin);
  cp_async_commit();
  float acc[kNTiles][4];
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
  const uint32_t unused_frags[1][Cfg::kKSteps][kARegs<Element>] = {};  // Q and dO fragments are read from shared memory

  for (int n = n_begin; n < n_end; ++n) {
    const int s = Cfg::kBiasStages == 2 ? (n - n_begin) & 1 : 0;
    if constexpr (Cfg::kBiasStages == 2) {
      if (n + 1 < n_end) load_stage(s ^ 1, n + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    float2 stats_row[2];
    float delta_row[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      stats_row[r] = stage_stats(s)[warp_row0 + g + 8 * r];
      delta_row[r] = stage_delta(s)[warp_row0 + g + 8 * r];
    }
    if constexpr (kParts == 1) {
      float ds[kNTiles][4];
      if (p.mask_scaled)
        compute_ds_tile<Cfg, kNTiles, kPairPitch, true, false>(ds, p, unused_frags, unused_frags, stage_q(s),
                                                                stage_do(s), stage_k(s), stage_v(s), sPair,
                                                                stage_mask(s), stats_row, delta_row, warp_row0,
                                                                p.Lk - n0, lane);
      else
        compute_ds_tile<Cfg, kNTiles, kPairPitch, false, false>(ds, p, unused_frags, unused_frags, stage_q(s),
                                                                 stage_do(s), stage_k(s), stage_v(s), sPair, nullptr,
                                                                 stats_row, delta_row, warp_row0, p.Lk - n0, lane);
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] += ds[nt][e];
    } else {
      // float32: dS in kParts key slices of kSub n8 tiles, so that S and dP of a slice fit the
      // registers next to the accumulator without spills (the 16-bit form above is the one measured:
      // another register allocation of this kernel was slower, DESIGN.md)
#pragma unroll
      for (int part = 0; part < kParts; ++part) {
        const int key0 = part * kSub * 8;
        float ds[kSub][4];
        const float* mask_part = p.mask_scaled ? stage_mask(s) + key0 : nullptr;
        compute_ds_tile<Cfg, kSub, kPairPitch, true, false>(ds, p, unused_frags, unused_frags, stage_q(s), stage_do(s),
                                                            stage_k(s) + key0 * kPitch, stage_v(s) + key0 * kPitch,
                                                            sPair + key0, mask_part, stats_row, delta_row, warp_row0,
                                                            p.Lk - n0 - key0, lane);
#pragma unroll
        for (int nt = 0; nt < kSub; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[part * kSub + nt][e] += ds[nt][e];
      }
    }
    __syncthreads();  // the next copies overwrite this stage
    if constexpr (Cfg::kBiasStages == 1) {
      if (n + 1 < n_end) load_stage(0, n + 1);
      cp_async_commit();
    }
  }

  // This CTA's tile of the chunk's partial: [Lq, Lk] fp32 of (chunk, b, h), written once.
  float* out = p.dpair + ((chunk * p.B + b) * p.H + h) * int64_t(p.Lq) * p.Lk;
  const bool lk_even = (p.Lk % 2) == 0;
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = m0 + warp_row0 + g + 8 * r;
      const int col = n0 + nt * 8 + 2 * t;
      if (row >= p.Lq || col >= p.Lk) continue;
      float* ptr = out + int64_t(row) * p.Lk + col;
      if (lk_even) {
        *reinterpret_cast<float2*>(ptr) = make_float2(acc[nt][2 * r], acc[nt][2 * r + 1]);
      } else {
        ptr[0] = acc[nt][2 * r];
        if (col + 1 < p.Lk) ptr[1] = acc[nt][2 * r + 1];
      }
    }
}

}  // namespace sm80

template <typename Element, int kHeadDim, int kPair>
int backward_smem_bytes_sm80() {
  using Cfg = sm80::BackwardConfig<Element, kHeadDim, kPair>;
  const int bytes = std::max(Cfg::kDkdvSmemBytes, Cfg::kDqSmemBytes);
  return kPair == kNoPair ? bytes : std::max(bytes, Cfg::kBiasSmemBytes);
}

template <typename Element, int kHeadDim, int kPair>
int pair_grad_blocks_per_sm_sm80() {
  if constexpr (kPair == kNoPair) {
    return 0;
  } else {
    using Cfg = sm80::BackwardConfig<Element, kHeadDim, kPair>;
    return resident_ctas_per_sm<sm80::backward_sm80_dpair_kernel<Cfg>>(
        Cfg::kThreads, Cfg::kBiasSmemBytes, "evoformer backward pair bias sm80 (occupancy query)");
  }
}

template <typename Element, int kHeadDim, int kPair>
void launch_backward_sm80(const AttentionParams& p, cudaStream_t stream) {
  using Cfg = sm80::BackwardConfig<Element, kHeadDim, kPair>;
  if (!p.delta_ready) launch_backward_delta<Element>(p, stream);
  launch_on_row_tiles<Cfg::kBlockKV>(sm80::backward_sm80_dkdv_kernel<Cfg>, p, p.Lk, Cfg::kThreads,
                                     Cfg::kDkdvSmemBytes, stream, "evoformer backward dK/dV sm80");
  launch_on_row_tiles<Cfg::kBlockQ2>(sm80::backward_sm80_dq_kernel<Cfg>, p, p.Lq, Cfg::kThreads, Cfg::kDqSmemBytes,
                                     stream, "evoformer backward dQ sm80");
  if constexpr (kPair != kNoPair) {
    if (p.dpair != nullptr)
      launch_pair_grad(sm80::backward_sm80_dpair_kernel<Cfg>, p, Cfg::kThreads, Cfg::kBiasSmemBytes, stream,
                       "evoformer backward pair bias sm80");
  }
}

}  // namespace evoformer
