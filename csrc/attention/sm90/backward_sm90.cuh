// The sm90 (Hopper, sm_90a) backward kernels: the same functions and outputs as the sm80 dK/dV, dQ
// and pair-bias-gradient kernels (backward_sm80.cuh), with every product on wgmma. Tiles stored once
// serve both as the K-major operand of one product and, through their transposed GMMA view, as the
// MN-major operand of another (RowTileLayouts).
//
// dK/dV: CTA = one warpgroup (128 threads) x 64 keys of one (b, n, h), on the sm80 kernel's
// RowTileGrid; query step i: wait for block i's tiles (one barrier), start S^T at the biases and
// dP^T at -delta, issue S^T = K.Q^T and dP^T = V.dO^T, start copying block i + 1 (before the
// products at D > 32: DkdvConfig::kCopiesBehindScores), form P^T = exp2((S^T - m) * scale_log2 - l)
// and issue dV += P^T.dO, then form dS^T = P^T * (dP^T - delta) (its row sums are the mask-bias
// gradient) and issue dK += dS^T.Q, and wait for both.
// Q, dO, the pair tile and the statistics live in a 2-stage ring. At D > 32 (DkdvConfig::kOverlap)
// block i's dV and dK products are issued in step i + 1, behind S^T and dP^T of block i + 1, and run
// while that block's P^T and dS^T are formed; the ring then has three stages.
//
// dQ: CTA = one warpgroup x 64 query rows of one (b, n, h), on the sm80 dQ kernel's RowTileGrid.
// Key step j: wait for block j's tiles, one CTA barrier, thread 0 starts block j + 1's TMA copies
// (the key-block pipeline of sm90_pipeline.cuh, shared with the forward; Q and dO come once by
// cp.async), start S at the biases (init_scores) and dP at -delta, issue S and dP, then
// dQ += dS_{j-1}.K_{j-1}; wait for S and dP only, form dS_j = P_j * (dP_j - delta), then wait for
// dQ's product and keep dS_j in registers for the next step (key_block_loop says where ptxas puts
// that wait). K is therefore read one step after V: V, the pair and mask tiles live in a 2-stage
// ring, K in a 3-stage one.
//
// Pair-bias gradient: the sm80 kernel's grid and chunking (PairGradTile), S and dP on wgmma, the pair
// tile copied once (read into registers once above D = 32, per row step at D = 32), each row n's Q,
// dO, K, V and mask tiles by TMA (RowStepTma).
#pragma once

#include <type_traits>

#include "attention/epilogue.cuh"
#include "common/mma_sm80.cuh"
#include "attention/preprocess.cuh"
#include "common/sm90_layouts.cuh"
#include "attention/sm90/sm90_pipeline.cuh"
#include "attention/softmax.cuh"
#include "attention/tile_scheduler.cuh"

namespace evoformer {
namespace sm90 {

// The backward's two score accumulators on one warpgroup, S and dP [64, kCols] (fp32, in the
// m16n8 accumulator layout: s() and dp() as [kCols / 8][4]), and the products that fill them over d,
// S += A0 . B0^T and dP += A1 . B1^T, with A0, A1 [64, D] and B0, B1 [kCols, D] tiles in shared memory
// (RowTileLayouts::RowMajor): in the dK/dV kernel the CTA's K and V against a query block's Q and
// dO, in the dQ kernel the CTA's Q and dO against a key block's K and V.
template <typename Element, int kCols, int kHeadDim>
struct ScorePair {
  using Mma = SsMma<Element, kCols, kHeadDim>;
  using LayoutA = typename RowTileLayouts<Element, 64, kHeadDim>::RowMajor;
  using LayoutB = typename RowTileLayouts<Element, kCols, kHeadDim>::RowMajor;
  static constexpr int kTiles = kCols / 8;  // n8 column tiles of a warp's 16 rows
  using Acc = decltype(cute::partition_fragment_C(Mma{}, cute::Shape<cute::_64, cute::Int<kCols>>{}));
  static_assert(cute::size(Acc{}) == kTiles * 4, "wgmma fragments must match the m16n8 accumulator layout");

  Mma mma;
  decltype(Mma{}.get_thread_slice(0)) thr;
  Acc s_acc, dp_acc;

  __device__ __forceinline__ explicit ScorePair(int tid) : thr(mma.get_thread_slice(tid)) {}

  // The operands of a [64, D] (A) or [kCols, D] (B) tile at `smem`.
  __device__ __forceinline__ auto a(Element* smem) const {
    return thr.partition_fragment_A(cute::make_tensor(cute::make_smem_ptr(smem), LayoutA{}));
  }
  __device__ __forceinline__ auto b(Element* smem) const {
    return thr.partition_fragment_B(cute::make_tensor(cute::make_smem_ptr(smem), LayoutB{}));
  }

  __device__ __forceinline__ float (&s())[kTiles][4] {
    return *reinterpret_cast<float(*)[kTiles][4]>(cute::raw_pointer_cast(s_acc.data()));
  }
  __device__ __forceinline__ float (&dp())[kTiles][4] {
    return *reinterpret_cast<float(*)[kTiles][4]>(cute::raw_pointer_cast(dp_acc.data()));
  }

  // Issues and commits S += a0 . b0^T and dP += a1 . b1^T (operands from a() and b()).
  template <typename A0, typename B0, typename A1, typename B1>
  __device__ __forceinline__ void issue(const A0& a0, const B0& b0, const A1& a1, const B1& b1) {
    fence();
    cute::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < cute::size<2>(a0); ++kk) cute::gemm(mma, a0(cute::_, cute::_, kk), b0(cute::_, cute::_, kk), s_acc);
#pragma unroll
    for (int kk = 0; kk < cute::size<2>(a1); ++kk) cute::gemm(mma, a1(cute::_, cute::_, kk), b1(cute::_, cute::_, kk), dp_acc);
    cute::warpgroup_commit_batch();
  }
  // S and dP as the tensor cores leave them (after a wait), or before they are written again.
  __device__ __forceinline__ void fence() {
    cute::warpgroup_fence_operand(s_acc);
    cute::warpgroup_fence_operand(dp_acc);
  }
};

template <typename Element_, int kHeadDim_, int kPair_>
struct DkdvConfig {
  using Element = Element_;
  using PairT = typename PairType<kPair_, Element_>::type;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kPair = kPair_;
  static constexpr int kThreads = 128;
  static constexpr int kBlockN = 64;           // keys per CTA
  static constexpr int kBlockM = kHeadDim <= 64 ? 64 : 32;  // queries per step
  static constexpr int kQTiles = kBlockM / 8;                // n8 column tiles of a warp's 16 rows of S^T
  static constexpr int kDTiles = kHeadDim / 8;
  static constexpr int kPairPitch = kBlockN + 8;  // pair tile [kBlockM queries][kBlockN keys]

  using LayoutK = typename RowTileLayouts<Element, kBlockN, kHeadDim>::RowMajor;     // K and V
  using LayoutQ = typename RowTileLayouts<Element, kBlockM, kHeadDim>::RowMajor;     // Q and dO
  using LayoutQt = typename RowTileLayouts<Element, kBlockM, kHeadDim>::Transposed;  // Q, dO as (d, query)

  // S^T [64 keys, kBlockM] = K [64, D] . Q^T, and dP^T the same with V and dO.
  using Scores = ScorePair<Element, kBlockM, kHeadDim>;
  // dV [64, D] += P^T [64, kBlockM] . dO [kBlockM, D], and dK the same with dS^T and Q.
  using MmaG = RsMmaMN<Element, kHeadDim, kBlockM>;

  // Shared memory: K, V, then two stages of {Q, dO, pair tile, stats (float2), delta}.
  static constexpr int kKVBytes = smem_align(kBlockN * kHeadDim * 2);
  static constexpr int kQBytes = smem_align(kBlockM * kHeadDim * 2);
  static constexpr int kPairBytes = kPair ? kBlockM * kPairPitch * int(sizeof(PairT)) : 0;
  static constexpr int kStageBytes = smem_align(2 * kQBytes + kPairBytes + kBlockM * 12);
  // kOverlap: step i issues block i - 1's dV and dK products behind its own S^T and dP^T and forms
  // P^T and dS^T while they run, so three stages (block i - 1's products read theirs during step i
  // while block i + 1 is copied). Measured (H100, bf16, dK/dV kernel alone): D = 64 262 -> 245 us
  // at MSA row N128 L384; D = 32 slower (343 -> 399 us at MSA row N512 L256, 1.72 -> 1.93 ms at
  // triangle N768, where three CTAs per SM already overlap one another), so D = 32 keeps the plain
  // order and two stages.
  static constexpr bool kOverlap = kHeadDim > 32;
  static constexpr int kStages = kOverlap ? 3 : 2;
  // Without kOverlap, step i starts copying block i + 1 after it has issued S^T and dP^T, so that the
  // copies' issue (about 115 instructions per thread: addresses, predicates, the statistics' loads)
  // runs while the tensor cores work, instead of between the barrier and the products. Measured
  // (H200, one process, dK/dV kernel alone, bf16 D = 32, two instances): MSA column (no pair bias)
  // 0.580 -> 0.471 and 0.589 -> 0.477 ms; with a pair bias (168 registers, 32 bytes spilled, against
  // 153) MSA row 0.327 -> 0.346 and 0.380 -> 0.354, triangle N768 1.752 -> 1.825 and 2.009 -> 1.828.
  // With dV's and dK's products issued one at a time (the step's body) no variant spills: 160
  // registers with a 16-bit pair bias, 158 with a float32 one, 154 without. Against the copies
  // behind the products with the two issued together (H200, one process, dK/dV kernel alone):
  // MSA row 0.348 -> 0.332 ms, triangle N768 1.841 -> 1.741; float32 pair bias (which had kept the
  // copies first) MSA row 0.390 -> 0.367, triangle N768 2.171 -> 2.028; MSA column unchanged.
  static constexpr bool kCopiesBehindScores = !kOverlap;
  static constexpr int kSmemBytes = kSmemAlign + 2 * kKVBytes + kStages * kStageBytes;
  // S^T, dP^T, their A-operand copies and dK, dV stay in registers (about 100 + D per thread): the
  // register cap of 4 CTAs per SM (128) spills, 3 (168) fits D = 32, 2 (255) the wider heads.
  static constexpr int kMinBlocksPerSM = ctas_per_sm(kSmemBytes, kHeadDim <= 32 ? 3 : 2);
  static_assert(kSmemBytes <= 227 * 1024, "a CTA's shared memory must fit an SM (227 KB)");
};

template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSM)
    backward_sm90_dkdv_kernel(const AttentionParams p, const RowTileGrid grid) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Element = typename Cfg::Element;
  using PairT = typename Cfg::PairT;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kQTiles = Cfg::kQTiles, kDTiles = Cfg::kDTiles, kThreads = Cfg::kThreads;

  extern __shared__ __align__(16) char smem_raw[];
  char* smem = aligned_smem(smem_raw);
  Element* k_smem = reinterpret_cast<Element*>(smem);
  Element* v_smem = reinterpret_cast<Element*>(smem + Cfg::kKVBytes);
  char* ring = smem + 2 * Cfg::kKVBytes;
  auto q_smem = [&](int st) { return reinterpret_cast<Element*>(ring + st * Cfg::kStageBytes); };
  auto do_smem = [&](int st) { return reinterpret_cast<Element*>(ring + st * Cfg::kStageBytes + Cfg::kQBytes); };
  auto pair_smem = [&](int st) {  // [kBlockM][kPairPitch]
    return reinterpret_cast<PairT*>(ring + st * Cfg::kStageBytes + 2 * Cfg::kQBytes);
  };
  auto stats_smem = [&](int st) {  // [kBlockM] (m, l), then delta [kBlockM]
    return reinterpret_cast<float2*>(ring + st * Cfg::kStageBytes + 2 * Cfg::kQBytes + Cfg::kPairBytes);
  };
  auto delta_smem = [&](int st) { return reinterpret_cast<float*>(stats_smem(st) + kBlockM); };

  const int tid = threadIdx.x, lane = threadIdx.x % 32u;
  const int warp_row0 = (threadIdx.x / 32u) * 16;  // first of this warp's 16 keys in the CTA tile
  const int t = lane % 4;
  const RowTile rt = grid.decode();
  const int64_t b = rt.b, n = rt.n, h = blockIdx.y;
  const int64_t bnh = (b * p.N + n) * p.H + h;
  const int j0 = rt.tile * kBlockN;
  const int rows_k = min(kBlockN, p.Lk - j0);

  // q, dO [Lq, D] and pair [Lq, Lk_pad] (from key j0) advance one query block per step
  const Element* q = static_cast<const Element*>(p.q) + p.q_strides.at(b, n, 0, h);
  const Element* dout = static_cast<const Element*>(p.dout) + p.do_strides.at(b, n, 0, h);
  const PairT* pair = nullptr;
  if constexpr (Cfg::kPair != kNoPair)
    pair = static_cast<const PairT*>(p.pair) + b * p.pair_stride_b + h * p.pair_stride_h + j0;

  // Mask bias / scale of this thread's two keys; keys past Lk are -inf.
  float mask_key[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = j0 + warp_row0 + lane / 4 + 8 * r;
    mask_key[r] = key_mask_scaled(p, b, n, key);
  }

  static_assert(kBlockM <= kThreads, "one thread per query row of a block");
  PendingRowStats pending;  // the next query block's statistics
  auto store_pending = [&](int st) { pending.store(stats_smem(st), delta_smem(st), tid, kBlockM); };
  const SwizzledTileCopy<kBlockM, kHeadDim, kThreads> copy_q(
      tid, [](int r, int c) { return swizzled_offset<typename Cfg::LayoutQ, Element>(r, c); });
  const TileCopy<PairT, kBlockM, kBlockN, Cfg::kPairPitch, kThreads> copy_pair(tid);
  auto load_block = [&](int ib) {
    const int i0 = ib * kBlockM, rows = min(kBlockM, p.Lq - i0), st = ib % Cfg::kStages;
    copy_q(q_smem(st), q, p.q_strides.l, rows, p.D);
    copy_q(do_smem(st), dout, p.do_strides.l, rows, p.D);
    if constexpr (Cfg::kPair != kNoPair) {
      copy_pair(pair_smem(st), pair, p.pair_stride_q, rows, p.Lk - j0);
      pair += int64_t(kBlockM) * p.pair_stride_q;
    }
    pending.load(p, bnh, i0, tid, kBlockM);
    q += int64_t(kBlockM) * p.q_strides.l;
    dout += int64_t(kBlockM) * p.do_strides.l;
  };
  const int n_blocks = (p.Lq + kBlockM - 1) / kBlockM;
  // Starts copying query block ib + 1 (if any) as one cp.async group.
  auto load_next = [&](int ib) {
    if (ib + 1 < n_blocks) load_block(ib + 1);
    cp_async_commit();
  };

  {
    const SwizzledTileCopy<kBlockN, kHeadDim, kThreads> copy_k(
        tid, [](int r, int c) { return swizzled_offset<typename Cfg::LayoutK, Element>(r, c); });
    copy_k(k_smem, static_cast<const Element*>(p.k) + p.k_strides.at(b, n, j0, h), p.k_strides.l, rows_k, p.D);
    copy_k(v_smem, static_cast<const Element*>(p.v) + p.v_strides.at(b, n, j0, h), p.v_strides.l, rows_k, p.D);
  }
  load_block(0);
  store_pending(0);
  cp_async_commit();

  typename Cfg::Scores scores(tid);  // S^T, then P^T; dP^T - delta, then dS^T
  typename Cfg::MmaG mma_g;
  auto thr_g = mma_g.get_thread_slice(tid);
  const auto tSrK = scores.a(k_smem), tSrV = scores.a(v_smem);
  Tensor tGrdV = partition_fragment_C(mma_g, Shape<_64, Int<kHeadDim>>{});
  Tensor tGrdK = partition_fragment_C(mma_g, Shape<_64, Int<kHeadDim>>{});
  // P^T and dS^T as A operands (registers), two 16-bit values per register
  auto a_layout = make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)), Shape<_64, Int<kBlockM>>{},
                              Stride<Int<kBlockM>, _1>{});
  Tensor tGrP = thr_g.partition_fragment_A(a_layout);
  Tensor tGrdS = thr_g.partition_fragment_A(a_layout);
  static_assert(size(tGrdV) == kDTiles * 4 && size(tGrP) == kBlockM / 2,
                "wgmma fragments must match the m16n8 accumulator layout used by the helpers");
  float(&st_)[kQTiles][4] = scores.s();
  float(&dpt)[kQTiles][4] = scores.dp();
  float(&dv)[kDTiles][4] = *reinterpret_cast<float(*)[kDTiles][4]>(raw_pointer_cast(tGrdV.data()));
  float(&dk)[kDTiles][4] = *reinterpret_cast<float(*)[kDTiles][4]>(raw_pointer_cast(tGrdK.data()));
  uint32_t(&pa)[kBlockM / 16][4] = *reinterpret_cast<uint32_t(*)[kBlockM / 16][4]>(raw_pointer_cast(tGrP.data()));
  uint32_t(&dsa)[kBlockM / 16][4] = *reinterpret_cast<uint32_t(*)[kBlockM / 16][4]>(raw_pointer_cast(tGrdS.data()));

#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = 0.f, dv[dt][e] = 0.f;
  float dmask_acc[2] = {0.f, 0.f};

  // b (dO or Q: block ib's tile in shared memory) as the B operand of dV's or dK's product
  auto b_operand = [&](Element* b) {
    return thr_g.partition_fragment_B(make_tensor(make_smem_ptr(b), typename Cfg::LayoutQt{}));
  };
  // acc += a . b with a (P^T or dS^T) in registers: the wgmma instructions only (the callers fence,
  // arrive and commit)
  auto product = [&](auto& acc, auto& a, auto& tGrB) {
#pragma unroll
    for (int kk = 0; kk < size<2>(a); ++kk) gemm(mma_g, a(_, _, kk), tGrB(_, _, kk), acc);
  };
  // dV += P^T_{ib}.dO_{ib};  dK += dS^T_{ib}.Q_{ib}, with P^T and dS^T in registers (pa, dsa), issued
  // as one batch without waiting (kOverlap).
  auto issue_grads = [&](int ib) {
    const int st = ib % Cfg::kStages;
    Tensor tGrdO = b_operand(do_smem(st));
    Tensor tGrQ = b_operand(q_smem(st));
    warpgroup_fence_operand(tGrdV);
    warpgroup_fence_operand(tGrdK);
    warpgroup_fence_operand(tGrP);
    warpgroup_fence_operand(tGrdS);
    warpgroup_arrive();
    product(tGrdV, tGrP, tGrdO);
    product(tGrdK, tGrdS, tGrQ);
    warpgroup_commit_batch();
  };
  // One of those products issued alone, as its own batch (without kOverlap).
  auto issue_one = [&](auto& acc, auto& a, Element* b) {
    Tensor tGrB = b_operand(b);
    warpgroup_fence_operand(acc);
    warpgroup_fence_operand(a);
    warpgroup_arrive();
    product(acc, a, tGrB);
    warpgroup_commit_batch();
  };

  for (int ib = 0; ib < n_blocks; ++ib) {
    const int st = ib % Cfg::kStages;
    cp_async_wait<0>();                        // this thread's copies of query block ib have landed
    cutlass::arch::fence_view_async_shared();  // ... and are visible to the tensor cores
    // everyone's copies and statistics of block ib landed; the products that read the stage block
    // ib + 1 takes (block ib - 1's, or ib - 2's with kOverlap) are done
    __syncthreads();
    if constexpr (!Cfg::kCopiesBehindScores) load_next(ib);

    // S^T = (mask + pair)^T / scale + K . Q^T;  dP^T - delta = -delta + V . dO^T
    const float2* sStats = stats_smem(st);
    const float* sDelta = delta_smem(st);
    if constexpr (Cfg::kPair != kNoPair) load_bias_tile<kQTiles, Cfg::kPairPitch, true>(st_, pair_smem(st), warp_row0, lane);
#pragma unroll
    for (int qt = 0; qt < kQTiles; ++qt) {
      const float2 dl = *reinterpret_cast<const float2*>(sDelta + qt * 8 + 2 * t);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        st_[qt][e] = Cfg::kPair != kNoPair ? fmaf(st_[qt][e], p.inv_scale, mask_key[e / 2]) : mask_key[e / 2];
        dpt[qt][e] = -(e % 2 ? dl.y : dl.x);
      }
    }
    scores.issue(tSrK, scores.b(q_smem(st)), tSrV, scores.b(do_smem(st)));
    if constexpr (Cfg::kCopiesBehindScores) load_next(ib);
    if (Cfg::kOverlap && ib > 0) {
      issue_grads(ib - 1);
      warpgroup_wait<1>();  // S^T and dP^T done; block ib - 1's dV and dK products may still run
    } else {
      warpgroup_wait<0>();
    }
    scores.fence();

    // P^T = exp2((S^T - m) * scale_log2 - l) with (m, l) of the query (column); dS^T = P^T * (dP^T - delta),
    // whose row sums are the mask-bias gradient.
    if constexpr (Cfg::kOverlap) {
#pragma unroll
      for (int qt = 0; qt < kQTiles; ++qt) {
        const float2 c[2] = {sStats[qt * 8 + 2 * t], sStats[qt * 8 + 2 * t + 1]};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          st_[qt][e] = fast_exp2(fmaf(st_[qt][e] - c[e % 2].x, p.scale_log2, -c[e % 2].y));
          dpt[qt][e] *= st_[qt][e];
          dmask_acc[e / 2] += dpt[qt][e];
        }
      }
      if (ib + 1 < n_blocks) store_pending((ib + 1) % Cfg::kStages);
      warpgroup_wait<0>();  // block ib - 1's products done: pa and dsa may change
#pragma unroll
      for (int kc = 0; kc < kBlockM / 16; ++kc) {
        c_to_a_frag<Element>(pa[kc], st_, kc);
        c_to_a_frag<Element>(dsa[kc], dpt, kc);
      }
    } else {
      // P^T first, into dV's product; then dS^T into dK's (ptxas still schedules dS^T's arithmetic
      // above both products; this order is what leaves the pair-biased kernel unspilled)
#pragma unroll
      for (int qt = 0; qt < kQTiles; ++qt) {
        const float2 c[2] = {sStats[qt * 8 + 2 * t], sStats[qt * 8 + 2 * t + 1]};
#pragma unroll
        for (int e = 0; e < 4; ++e) st_[qt][e] = fast_exp2(fmaf(st_[qt][e] - c[e % 2].x, p.scale_log2, -c[e % 2].y));
      }
#pragma unroll
      for (int kc = 0; kc < kBlockM / 16; ++kc) c_to_a_frag<Element>(pa[kc], st_, kc);
      issue_one(tGrdV, tGrP, do_smem(st));
      scores.fence();
#pragma unroll
      for (int qt = 0; qt < kQTiles; ++qt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          dpt[qt][e] *= st_[qt][e];
          dmask_acc[e / 2] += dpt[qt][e];
        }
#pragma unroll
      for (int kc = 0; kc < kBlockM / 16; ++kc) c_to_a_frag<Element>(dsa[kc], dpt, kc);
      issue_one(tGrdK, tGrdS, q_smem(st));
      if (ib + 1 < n_blocks) store_pending((ib + 1) % Cfg::kStages);
      warpgroup_wait<0>();
      warpgroup_fence_operand(tGrP);  // (the tensor cores read P^T and dS^T from these until the wait)
      warpgroup_fence_operand(tGrdS);
    }
    warpgroup_fence_operand(tGrdV);
    warpgroup_fence_operand(tGrdK);
  }
  if constexpr (Cfg::kOverlap) {
    issue_grads(n_blocks - 1);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tGrdV);
    warpgroup_fence_operand(tGrdK);
  }
  cp_async_wait<0>();  // no copy may be in flight when the CTA exits

  store_dkdv_rows<Element, kDTiles>(dk, dv, dmask_acc, p, b, n, h, j0 + warp_row0 + lane / 4, lane);
#endif
}

template <typename Element_, int kHeadDim_, int kPair_>
struct DqConfig {
  using Element = Element_;
  using PairT = typename PairType<kPair_, Element_>::type;
  static constexpr int kHeadDim = kHeadDim_;  // bucket; D is zero-padded up to it in shared memory
  static constexpr int kPair = kPair_;
  static constexpr int kThreads = 128;
  static constexpr int kBlockM = 64;           // queries per CTA
  static constexpr int kBlockN = 64;           // keys per step
  static constexpr int kNTiles = kBlockN / 8;  // n8 column tiles of a warp's 16 rows of S
  static constexpr int kDTiles = kHeadDim / 8;
  using Tma = KeyBlockTma<Element, PairT, kHeadDim, kBlockM, kBlockN, kPair != kNoPair>;  // K, V, pair, mask tiles
  static constexpr int kPairPitch = Tma::kPairPitch;

  using LayoutQ = typename RowTileLayouts<Element, kBlockM, kHeadDim>::RowMajor;  // Q and dO
  using LayoutK = typename RowTileLayouts<Element, kBlockN, kHeadDim>::RowMajor;  // K and V
  using LayoutKt = typename RowTileLayouts<Element, kBlockN, kHeadDim>::Transposed;  // K as (d, key)

  // S [64, kBlockN] = Q [64, D] . K^T, and dP the same with dO and V.
  using Scores = ScorePair<Element, kBlockN, kHeadDim>;
  // dQ [64, D] += dS [64, kBlockN] . K [kBlockN, D]
  using MmaDq = RsMmaMN<Element, kHeadDim, kBlockN>;

  // Shared memory (each wgmma or swizzled TMA tile 1024-byte aligned): Q, dO, three stages of K (read
  // one step later), the pipeline's two stages of {V, pair tile, mask tile}, then its transaction
  // barriers.
  static constexpr int kQBytes = smem_align(kBlockM * kHeadDim * 2);
  static constexpr int kKVBytes = smem_align(kBlockN * kHeadDim * 2);
  static constexpr int kPairBytes = Tma::kPairBytes;
  static constexpr int kMaskBytes = Tma::kMaskBytes;
  static constexpr int kVStageBytes = smem_align(kKVBytes + kPairBytes + kMaskBytes);
  static constexpr int kKStages = Tma::kStages + 1, kVStages = Tma::kStages;
  static constexpr int kRingBytes = kKStages * kKVBytes + kVStages * kVStageBytes;  // the K and V rings
  static constexpr int kSmemBytes = kSmemAlign + 2 * kQBytes + kRingBytes + Tma::kBarrierBytes;
  static constexpr int kMinBlocksPerSM = ctas_per_sm(kSmemBytes, 512 / kThreads);
  static_assert(kSmemBytes <= 227 * 1024, "a CTA's shared memory must fit an SM (227 KB)");
};

template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSM)
    backward_sm90_dq_kernel(const AttentionParams p, const RowTileGrid grid, const __grid_constant__ KeyBlockMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Element = typename Cfg::Element;
  using PairT = typename Cfg::PairT;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kNTiles = Cfg::kNTiles, kDTiles = Cfg::kDTiles, kThreads = Cfg::kThreads;

  extern __shared__ __align__(16) char smem_raw[];
  char* smem = aligned_smem(smem_raw);
  Element* q_smem = reinterpret_cast<Element*>(smem);
  Element* do_smem = reinterpret_cast<Element*>(smem + Cfg::kQBytes);
  char* k_ring = smem + 2 * Cfg::kQBytes;                    // per stage: K
  char* v_ring = k_ring + Cfg::kKStages * Cfg::kKVBytes;    // per stage: V, pair tile, mask tile
  auto k_smem = [&](int st) { return reinterpret_cast<Element*>(k_ring + st * Cfg::kKVBytes); };
  auto v_smem = [&](int st) { return reinterpret_cast<Element*>(v_ring + st * Cfg::kVStageBytes); };
  auto pair_smem = [&](int st) {  // [kBlockM][kPairPitch]
    return reinterpret_cast<PairT*>(v_ring + st * Cfg::kVStageBytes + Cfg::kKVBytes);
  };
  auto mask_smem = [&](int st) {  // [kBlockN]
    return reinterpret_cast<float*>(v_ring + st * Cfg::kVStageBytes + Cfg::kKVBytes + Cfg::kPairBytes);
  };
  uint64_t* block_full = reinterpret_cast<uint64_t*>(k_ring + Cfg::kRingBytes);  // [Tma::kStages]

  const int tid = threadIdx.x, lane = threadIdx.x % 32u;
  const int warp_row0 = (threadIdx.x / 32u) * 16;  // first of this warp's 16 rows in the CTA tile
  const RowTile rt = grid.decode();
  const int64_t b = rt.b, n = rt.n, h = blockIdx.y;
  const int64_t bnh = (b * p.N + n) * p.H + h;
  const int m0 = rt.tile * kBlockM;
  const int rows_q = min(kBlockM, p.Lq - m0);

  const Element* q = static_cast<const Element*>(p.q) + p.q_strides.at(b, n, m0, h);  // [Lq, D] from m0
  const Element* dout = static_cast<const Element*>(p.dout) + p.do_strides.at(b, n, m0, h);
  const bool has_mask = p.mask_scaled != nullptr;

  // Key block jb's tiles into their ring stages (issued by one thread).
  auto issue_block = [&](int jb) {
    const int vs = jb % Cfg::kVStages;
    Cfg::Tma::issue(maps, block_full, p, b, n, h, m0, jb, k_smem(jb % Cfg::kKStages), v_smem(vs), pair_smem(vs),
                    mask_smem(vs));
  };

  const int n_blocks = (p.Lk + kBlockN - 1) / kBlockN;
  Cfg::Tma::start(block_full, issue_block, p, k_ring, Cfg::kRingBytes);
  {  // Q and dO [kBlockM, kHeadDim] (LayoutQ)
    const SwizzledTileCopy<kBlockM, kHeadDim, kThreads> copy_q(
        tid, [](int r, int c) { return swizzled_offset<typename Cfg::LayoutQ, Element>(r, c); });
    copy_q(q_smem, q, p.q_strides.l, rows_q, p.D);
    copy_q(do_smem, dout, p.do_strides.l, rows_q, p.D);
  }
  cp_async_commit();

  float2 stats_row[2];
  float delta_row[2];
  load_row_stats(stats_row, delta_row, p, bnh, m0 + warp_row0 + lane / 4);
  Cfg::Tma::finish_prologue();  // Q and dO in place for the tensor cores

  typename Cfg::Scores scores(tid);  // S; dP - delta, then dS
  typename Cfg::MmaDq mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);
  const auto tSrQ = scores.a(q_smem), tSrdO = scores.a(do_smem);
  Tensor tQrdQ = partition_fragment_C(mma_dq, Shape<_64, Int<kHeadDim>>{});
  // dS as the A operand of dS.K (registers): the same (row, key) values as S, two 16-bit per register
  Tensor tQrdS = thr_dq.partition_fragment_A(
      make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)), Shape<_64, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{}));
  static_assert(size(tQrdQ) == kDTiles * 4 && size(tQrdS) == kBlockN / 2,
                "wgmma fragments must match the m16n8 accumulator layout used by the softmax helpers");
  float(&s)[kNTiles][4] = scores.s();
  float(&dp)[kNTiles][4] = scores.dp();
  float(&dq)[kDTiles][4] = *reinterpret_cast<float(*)[kDTiles][4]>(raw_pointer_cast(tQrdQ.data()));
  uint32_t(&dsa)[kBlockN / 16][4] = *reinterpret_cast<uint32_t(*)[kBlockN / 16][4]>(raw_pointer_cast(tQrdS.data()));

#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[dt][e] = 0.f;

  // dQ += dS_{jb}.K_{jb} with dS in registers (dsa), issued without waiting.
  auto issue_dq = [&](int jb) __attribute__((always_inline)) {
    Tensor tQrK = thr_dq.partition_fragment_B(
        make_tensor(make_smem_ptr(k_smem(jb % Cfg::kKStages)), typename Cfg::LayoutKt{}));
    warpgroup_fence_operand(tQrdQ);
    warpgroup_fence_operand(tQrdS);
    warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < size<2>(tQrdS); ++kk) gemm(mma_dq, tQrdS(_, _, kk), tQrK(_, _, kk), tQrdQ);
    warpgroup_commit_batch();
  };

  key_block_loop<typename Cfg::Tma>(
      block_full, n_blocks, issue_block,
      [&](int jb) __attribute__((always_inline)) {  // S = (mask + pair) / scale + Q . K^T;  dP - delta = -delta + dO . V^T
        const int vs = jb % Cfg::kVStages;
        const int n0 = jb * kBlockN;
        const PairT* sPair = pair_smem(vs);
        const float* sMask = has_mask ? mask_smem(vs) : nullptr;
        init_block_scores<Cfg::kPair != kNoPair, kNTiles, Cfg::kPairPitch>(s, sMask, sPair, warp_row0, p.Lk - n0,
                                                                           p.inv_scale, lane);
        start_at_minus_delta<kNTiles>(dp, delta_row);
        scores.issue(tSrQ, scores.b(k_smem(jb % Cfg::kKStages)), tSrdO, scores.b(v_smem(vs)));
      },
      issue_dq,
      [&]() __attribute__((always_inline)) {  // dS_jb while dS_{jb-1}.K_{jb-1} runs
        scores.fence();
        scores_to_ds<kNTiles>(dp, s, stats_row, p.scale_log2);
      },
      [&]() __attribute__((always_inline)) { warpgroup_fence_operand(tQrdQ); },
      [&]() __attribute__((always_inline)) {  // dS_jb into registers (dsa)
#pragma unroll
        for (int kc = 0; kc < kBlockN / 16; ++kc) c_to_a_frag<Element>(dsa[kc], dp, kc);
      });

  Element* dq_out = static_cast<Element*>(p.dq) + p.dq_strides.at(b, n, 0, h);  // [Lq, D], rows dq_strides.l apart
  store_scaled_rows<Element, kDTiles>(dq, dq_out, p.dq_strides.l, m0 + warp_row0 + lane / 4, p.Lq, p.D, p.scale, lane);
#endif
}

template <typename Element_, int kHeadDim_, int kPair_>
struct DpairConfig {
  using Element = Element_;
  using PairT = typename PairType<kPair_, Element_>::type;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kPair = kPair_;
  static constexpr int kThreads = 128;
  static constexpr int kBlockM = 64;  // queries of the tile
  static constexpr int kBlockN = 64;  // keys of the tile
  static constexpr int kNTiles = kBlockN / 8;
  static constexpr int kPairPitch = kBlockN + (kPair == kPairFloat ? 4 : 8);
  static_assert(kBlockM == PairGradTile::kQueries && kBlockN == PairGradTile::kKeys, "the grid's tile");

  using LayoutQ = typename RowTileLayouts<Element, kBlockM, kHeadDim>::RowMajor;  // Q and dO
  using LayoutK = typename RowTileLayouts<Element, kBlockN, kHeadDim>::RowMajor;  // K and V
  using MmaS = SsMma<Element, kBlockN, kHeadDim>;  // S = Q.K^T and dP = dO.V^T
  using Tma = RowStepTma<Element, kHeadDim, kBlockM, kBlockN>;  // Q, dO, K, V and mask tiles per row n

  // Shared memory: the pair tile (at D = 32; above, it lands in the second stage: kPairAreaBytes),
  // then two stages (one per row n) of {Q, dO, K, V (swizzled TMA tiles, 1024-byte aligned), mask
  // tile, stats (float2), delta}, then the stages' barriers.
  static constexpr int kTileBytes = smem_align(64 * kHeadDim * 2);  // Q, dO, K or V
  static constexpr int kPairBytes = smem_align(kPair ? kBlockM * kPairPitch * int(sizeof(PairT)) : 0);
  static constexpr int kStageBytes = smem_align(4 * kTileBytes + Tma::kMaskBytes + kBlockM * 12);
  static constexpr int kStages = Tma::kStages;
  static constexpr int kRingBytes = kStages * kStageBytes;
  // S, dP and the dS sum in registers (about 100 per thread). Above D = 32 (2 CTAs per SM, as shared
  // memory allows) the pair tile is read into registers once (kPairInRegisters: 32 more per
  // thread); at D = 32 each row step reads it from shared memory, as the forward does, which keeps
  // the kernel under the 128 registers of 4 CTAs per SM (115 against 151 and 3 CTAs). Measured
  // (H200, one process, kernel alone, 16-bit pair bias): MSA row 0.212 -> 0.191 ms, triangle N768
  // 1.336 -> 1.251; a float32 pair bias -3 to -6 %.
  static constexpr bool kPairInRegisters = kHeadDim > 32;
  // With kPairInRegisters the pair tile is copied into the second ring stage, which row step 1's
  // copies overwrite only after every warp has read the tile into registers: no area of its own, so
  // that at D = 64 three CTAs fit an SM (67 KB each instead of 76).
  static constexpr int kPairAreaBytes = kPairInRegisters ? 0 : kPairBytes;
  static_assert(!kPairInRegisters || kPairBytes <= kStageBytes, "the pair tile fits a ring stage");
  static constexpr int kSmemBytes = kSmemAlign + kPairAreaBytes + kRingBytes + Tma::kBarrierBytes;
  static constexpr int kMinBlocksPerSM = ctas_per_sm(kSmemBytes, kHeadDim <= 32 ? 4 : 3);
  static_assert(kSmemBytes <= 227 * 1024, "a CTA's shared memory must fit an SM (227 KB)");
};

// Pair-bias gradient: CTA = a [64 queries, 64 keys] tile of (b, h) and a chunk of rows n
// (PairGradTile); per row n: S = Q.K^T and dP = dO.V^T on wgmma, dS = P * (dP - delta), summed in
// registers over the chunk and written once. Row n's tiles come by TMA (RowStepTma, thread 0 issues
// row n + 1's while row n is computed); the pair tile once by cp.async (DpairConfig::kPairInRegisters
// says where each step reads it from).
template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSM)
    backward_sm90_dpair_kernel(const AttentionParams p, const __grid_constant__ RowStepMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Element = typename Cfg::Element;
  using PairT = typename Cfg::PairT;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
  constexpr int kNTiles = Cfg::kNTiles, kThreads = Cfg::kThreads;

  extern __shared__ __align__(16) char smem_raw[];
  char* smem = aligned_smem(smem_raw);
  char* ring = smem + Cfg::kPairAreaBytes;
  // [kBlockM][kPairPitch]: its own area, or (kPairInRegisters) the second ring stage until row 1
  PairT* sPair = reinterpret_cast<PairT*>(Cfg::kPairInRegisters ? ring + Cfg::kStageBytes : smem);
  uint64_t* row_full = reinterpret_cast<uint64_t*>(ring + Cfg::kRingBytes);  // [Tma::kStages]
  auto tile_smem = [&](int st, int i) {  // i: 0 Q, 1 dO, 2 K, 3 V
    return reinterpret_cast<Element*>(ring + st * Cfg::kStageBytes + i * Cfg::kTileBytes);
  };
  auto mask_smem = [&](int st) { return reinterpret_cast<float*>(ring + st * Cfg::kStageBytes + 4 * Cfg::kTileBytes); };
  auto stats_smem = [&](int st) { return reinterpret_cast<float2*>(mask_smem(st) + kBlockN); };
  auto delta_smem = [&](int st) { return reinterpret_cast<float*>(stats_smem(st) + kBlockM); };

  const int tid = threadIdx.x, lane = threadIdx.x % 32u;
  const int warp_row0 = (threadIdx.x / 32u) * 16;
  const PairGradTile tile(p);
  const int64_t b = tile.b, h = tile.h;
  const int steps = tile.n_end - tile.n_begin;  // rows n of the chunk

  static_assert(Cfg::kPair != kNoPair, "the pair-bias gradient kernel runs only with a pair bias");
  {
    const PairT* pair = static_cast<const PairT*>(p.pair) + b * p.pair_stride_b + h * p.pair_stride_h +
                        int64_t(tile.m0) * p.pair_stride_q + tile.n0;  // [Lq, Lk_pad] tile of (b, h)
    load_tile_async<PairT, kBlockM, kBlockN, Cfg::kPairPitch, kThreads>(sPair, pair, p.pair_stride_q, tile.rows_q,
                                                                        p.Lk - tile.n0, tid);
    cp_async_commit();
  }
  // Row step s (row n_begin + s) into stage s % kStages (issued by one thread).
  auto issue_row = [&](int step) {
    const int st = step % Cfg::kStages;
    Cfg::Tma::issue(maps, row_full, p, step, b, tile.n_begin + step, h, tile.m0, tile.n0, tile_smem(st, 0),
                    tile_smem(st, 1), tile_smem(st, 2), tile_smem(st, 3), mask_smem(st));
  };
  // (the second stage, where the pair tile is in flight with kPairInRegisters, is zeroed after it is read)
  Cfg::Tma::template start<kThreads>(row_full, issue_row, p, ring,
                                     Cfg::kPairInRegisters ? Cfg::kStageBytes : Cfg::kRingBytes);
  // Row n's statistics are loaded into registers one step ahead and stored to its stage after the
  // products of the row before are issued.
  PendingRowStats pending;
  pending.load(p, (b * p.N + tile.n_begin) * p.H + h, tile.m0, tid, kBlockM);
  pending.store(stats_smem(0), delta_smem(0), tid, kBlockM);

  typename Cfg::MmaS mma_s;
  auto thr_s = mma_s.get_thread_slice(tid);
  Tensor tSrS = partition_fragment_C(mma_s, Shape<_64, Int<kBlockN>>{});
  Tensor tSrdP = partition_fragment_C(mma_s, Shape<_64, Int<kBlockN>>{});
  static_assert(size(tSrS) == kNTiles * 4, "wgmma fragments must match the m16n8 accumulator layout");
  float(&s)[kNTiles][4] = *reinterpret_cast<float(*)[kNTiles][4]>(raw_pointer_cast(tSrS.data()));
  float(&dp)[kNTiles][4] = *reinterpret_cast<float(*)[kNTiles][4]>(raw_pointer_cast(tSrdP.data()));
  float acc[kNTiles][4];
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;

  // The pair tile is the same for every row n. With kPairInRegisters it is read into registers once,
  // keys past Lk at -inf, so that each row's scores start at fma(pair, 1 / scale, mask)
  // (add_key_biases, as the forward's); else each row step reads it (init_block_scores).
  float pair_reg[kNTiles][4];
  cp_async_wait<0>();  // the pair tile has landed
  __syncthreads();     // ... everyone's, with row 0's statistics and the initialised barriers
  if constexpr (Cfg::kPairInRegisters) {
    load_bias_tile<kNTiles, Cfg::kPairPitch, false>(pair_reg, sPair, warp_row0, lane);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (nt * 8 + 2 * (lane % 4) + e % 2 >= tile.rows_k) pair_reg[nt][e] = -kInf;
    __syncthreads();  // every warp has read the tile: row step 1 may take its stage
    // that stage's unwritten columns zeroed, as the prologue zeroed the first
    Cfg::Tma::template zero_rings<kThreads>(Cfg::Tma::RowsQ::narrow(p.D), ring + Cfg::kStageBytes, Cfg::kStageBytes);
  }

  const bool has_mask = p.mask_scaled != nullptr;
  for (int step = 0; step < steps; ++step) {
    const int st = step % Cfg::kStages;
    // every warp is done with the step before (its stage is the next step's) and this step's
    // statistics are stored
    if (step > 0) __syncthreads();
    if (step + 1 < steps) {
      if (tid == 0) issue_row(step + 1);
      pending.load(p, (b * p.N + tile.n_begin + step + 1) * p.H + h, tile.m0, tid, kBlockM);
    }
    Cfg::Tma::wait(row_full, step);  // this row's tiles have landed

    float2 stats_row[2];
    float delta_row[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      stats_row[r] = stats_smem(st)[warp_row0 + lane / 4 + 8 * r];
      delta_row[r] = delta_smem(st)[warp_row0 + lane / 4 + 8 * r];
    }
    const float* sMask = has_mask ? mask_smem(st) : nullptr;
    if constexpr (Cfg::kPairInRegisters)
      add_key_biases<true, false, kNTiles>(s, pair_reg, sMask, tile.rows_k, p.inv_scale, lane);
    else
      init_block_scores<true, kNTiles, Cfg::kPairPitch>(s, sMask, sPair, warp_row0, tile.rows_k, p.inv_scale, lane);
    start_at_minus_delta<kNTiles>(dp, delta_row);
    Tensor tSrQ = thr_s.partition_fragment_A(make_tensor(make_smem_ptr(tile_smem(st, 0)), typename Cfg::LayoutQ{}));
    Tensor tSrdO = thr_s.partition_fragment_A(make_tensor(make_smem_ptr(tile_smem(st, 1)), typename Cfg::LayoutQ{}));
    Tensor tSrK = thr_s.partition_fragment_B(make_tensor(make_smem_ptr(tile_smem(st, 2)), typename Cfg::LayoutK{}));
    Tensor tSrV = thr_s.partition_fragment_B(make_tensor(make_smem_ptr(tile_smem(st, 3)), typename Cfg::LayoutK{}));
    warpgroup_fence_operand(tSrS);
    warpgroup_fence_operand(tSrdP);
    warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < size<2>(tSrQ); ++kk) gemm(mma_s, tSrQ(_, _, kk), tSrK(_, _, kk), tSrS);
#pragma unroll
    for (int kk = 0; kk < size<2>(tSrdO); ++kk) gemm(mma_s, tSrdO(_, _, kk), tSrV(_, _, kk), tSrdP);
    warpgroup_commit_batch();
    if (step + 1 < steps) pending.store(stats_smem(st ^ 1), delta_smem(st ^ 1), tid, kBlockM);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    warpgroup_fence_operand(tSrdP);

    scores_to_ds<kNTiles>(dp, s, stats_row, p.scale_log2);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] += dp[nt][e];
  }

  store_pair_partial<kNTiles>(acc, p, tile, tile.m0 + warp_row0 + lane / 4, tile.n0, lane);
#endif
}

}  // namespace sm90

template <typename Element, int kHeadDim, int kPair>
void launch_backward_sm90(const AttentionParams& p, cudaStream_t stream) {
  using Dkdv = sm90::DkdvConfig<Element, kHeadDim, kPair>;
  using Dq = sm90::DqConfig<Element, kHeadDim, kPair>;
  constexpr const char* kDqName = "evoformer backward dQ sm90";
  if (!p.delta_ready) launch_backward_delta<Element>(p, stream);
  launch_on_row_tiles<Dkdv::kBlockN>(sm90::backward_sm90_dkdv_kernel<Dkdv>, p, p.Lk, Dkdv::kThreads, Dkdv::kSmemBytes,
                                     stream, "evoformer backward dK/dV sm90");
  sm90::KeyBlockMaps dq_maps{};
  Dq::Tma::encode(dq_maps, p, kDqName);
  launch_on_row_tiles<Dq::kBlockM>(sm90::backward_sm90_dq_kernel<Dq>, p, p.Lq, Dq::kThreads, Dq::kSmemBytes, stream,
                                   kDqName, dq_maps);
  if constexpr (kPair != kNoPair) {
    using Dpair = sm90::DpairConfig<Element, kHeadDim, kPair>;
    constexpr const char* kDpairName = "evoformer backward pair bias sm90";
    if (p.dpair != nullptr) {
      sm90::RowStepMaps dpair_maps{};
      Dpair::Tma::encode(dpair_maps, p, kDpairName);
      launch_pair_grad(sm90::backward_sm90_dpair_kernel<Dpair>, p, Dpair::kThreads, Dpair::kSmemBytes, stream,
                       kDpairName, dpair_maps);
    }
  }
}

template <typename Element, int kHeadDim, int kPair>
int backward_smem_bytes_sm90() {
  const int bytes = std::max(sm90::DkdvConfig<Element, kHeadDim, kPair>::kSmemBytes,
                             sm90::DqConfig<Element, kHeadDim, kPair>::kSmemBytes);
  if constexpr (kPair == kNoPair) {
    return bytes;
  } else {
    return std::max(bytes, sm90::DpairConfig<Element, kHeadDim, kPair>::kSmemBytes);
  }
}

template <typename Element, int kHeadDim, int kPair>
int pair_grad_blocks_per_sm_sm90() {
  if constexpr (kPair == kNoPair) {
    return 0;
  } else {
    using Cfg = sm90::DpairConfig<Element, kHeadDim, kPair>;
    return resident_ctas_per_sm<sm90::backward_sm90_dpair_kernel<Cfg>>(
        Cfg::kThreads, Cfg::kSmemBytes, "evoformer backward pair bias sm90 (occupancy query)");
  }
}

}  // namespace evoformer
