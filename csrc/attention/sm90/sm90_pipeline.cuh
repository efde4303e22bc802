// The TMA pipelines of the Hopper attention kernels. KeyBlockTma: the key-block pipeline of the
// kernels that stream key blocks past a fixed tile of kBlockM queries of one (b, n, h): the forward
// and the dQ kernel (RowStepTma, at the end, is the pair-bias gradient's row pipeline). Each key block brings K and V
// [kBlockN, D] (RowTileTma), the pair-bias tile [kBlockM, kBlockN] (PairTileTma) and the mask tile
// [kBlockN] of the prepared mask [B|1, N|1, Lk_pad]. One thread issues a block's copies; they
// complete on that block's transaction barrier, one of kStages in shared memory (block jb on
// full[jb % kStages], phase (jb / kStages) % 2), so the copies cost the other threads nothing.
//
// A kernel's part: shared memory for the barriers (kBarrierBytes) and rings for the tiles, where
// the ring that block jb + 1 overwrites must be free once every warp has passed step jb's CTA
// barrier (the K or V ring of kStages stages holds blocks jb and jb + 1; the other, read one step
// later, holds three); and an issue_block(jb) that calls issue() with block jb's ring stages.
//
//   host:    KeyBlockMaps maps{}; Tma::encode(maps, p, "kernel name");   // a __grid_constant__ argument
//   kernel:  Tma::start(full, issue_block, p, rings, ring_bytes);  // thread 0: barriers, block 0's copies
//            ... the kernel's own cp.async copies (Q, ...), cp_async_commit() ...
//            Tma::finish_prologue();              // those copies landed and are visible; barriers ready
//            key_block_loop<Tma>(full, n_blocks, issue_block, ...);  // below: begin_step, then block jb's math
#pragma once

#include <cutlass/arch/barrier.h>

#include "attention/sm90/tma_tiles.cuh"
#include "common/sm90_layouts.cuh"

namespace evoformer {
namespace sm90 {

// kStages transaction barriers in shared memory, one per stage of a pipeline: step s completes on
// full[s % kStages] in phase (s / kStages) % 2; one thread arms each and issues its copies.
template <int kStages_>
struct StageBarriers {
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  static constexpr int kStages = kStages_;
  static constexpr int kBarrierBytes = kStages * int(sizeof(uint64_t));

  // One thread: initialises the barriers full[kStages] (one arrival each: the issuing thread's).
  __device__ __forceinline__ static void init(uint64_t* full) {
#pragma unroll
    for (int st = 0; st < kStages; ++st) Barrier::init(&full[st], 1);
    cutlass::arch::fence_barrier_init();
  }

  // Waits until step `step`'s copies have landed.
  __device__ __forceinline__ static void wait(uint64_t* full, int step) {
    Barrier::wait(&full[step % kStages], (step / kStages) % 2);
  }

  // Where the copies leave columns of their tiles unwritten (`narrow`: rows narrower than the tiles),
  // every thread of the CTA (kThreads where the caller knows it, else blockDim.x) zeroes the rings
  // [rings, rings + ring_bytes) (the products read those columns), fenced before later copies and
  // synced; nothing otherwise.
  template <int kThreads = 0>
  __device__ __forceinline__ static void zero_rings(bool narrow, char* rings, int ring_bytes) {
    if (!narrow) return;
    const int threads = kThreads > 0 ? kThreads : int(blockDim.x);
    for (int i = int(threadIdx.x) * 16; i < ring_bytes; i += threads * 16)
      *reinterpret_cast<uint4*>(rings + i) = make_uint4(0, 0, 0, 0);
    cutlass::arch::fence_view_async_shared();  // the zeros before the copies (async proxy)
    __syncthreads();
  }

  // Prologue: zero_rings, then thread 0 initialises the barriers and issues step 0 (issue(0)).
  template <int kThreads = 0, typename Issue>
  __device__ __forceinline__ static void start(uint64_t* full, Issue&& issue, bool narrow, char* rings,
                                               int ring_bytes) {
    zero_rings<kThreads>(narrow, rings, ring_bytes);
    if (threadIdx.x == 0) {
      init(full);
      issue(0);
    }
  }
};

// TMA copies of [kCols] key tiles of row (b, n) of the prepared mask bias [B|1, N|1, Lk_pad] (float32).
template <int kCols>
struct MaskTileTma {
  static constexpr int kBytes = kCols * 4;

  // The map of p.mask_scaled; a rejection names `kernel`.
  static void encode(CUtensorMap* map, const AttentionParams& p, const char* kernel) {
    const TileMapDim dims[3] = {{p.Lk, 1, kCols}, {p.N, p.mask_stride_n, 1}, {p.B, p.mask_stride_b, 1}};
    encode_tile_map(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, p.mask_scaled, dims, 3, CU_TENSOR_MAP_SWIZZLE_NONE,
                    kernel, "mask-bias");
  }
  __device__ __forceinline__ static void copy(const CUtensorMap* map, uint64_t* bar, float* dst, int key0,
                                              const AttentionParams& p, int64_t b, int64_t n) {
    cute::SM90_TMA_LOAD_3D::copy(map, bar, uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL), dst, key0,
                                 tma_coord(p.mask_stride_n, n), tma_coord(p.mask_stride_b, b));
  }
};

struct KeyBlockMaps {
  CUtensorMap k, v, pair, mask;  // a map is left unset when its tensor is absent
};

template <typename Element, typename PairT, int kHeadDim, int kBlockM, int kBlockN, bool kHasPair>
struct KeyBlockTma : StageBarriers<2> {  // two key blocks in flight, one transaction barrier each
  using Rows = RowTileTma<Element, kHeadDim, kBlockN>;
  using Pair = PairTileTma<PairT, Element, kBlockM, kBlockN>;
  using Mask = MaskTileTma<kBlockN>;
  static constexpr int kPairBytes = kHasPair ? Pair::kBytes : 0;
  static constexpr int kMaskBytes = Mask::kBytes;
  static constexpr int kPairPitch = Pair::kPitch;

  // Host: the maps of one launch's K, V, pair and mask tensors; a rejected map throws naming
  // `kernel` and the tensor (the message is composed only then).
  static void encode(KeyBlockMaps& maps, const AttentionParams& p, const char* kernel) {
    Rows::encode(&maps.k, p.k, p.k_strides, p.Lk, p, kernel, "k");
    Rows::encode(&maps.v, p.v, p.v_strides, p.Lk, p, kernel, "v");
    if constexpr (kHasPair) Pair::encode(&maps.pair, p, kernel);
    if (p.mask_scaled != nullptr) Mask::encode(&maps.mask, p, kernel);
  }

  // One thread: arms block jb's barrier for key block jb of row (b, n), head h, queries from m0, and
  // starts its copies into the given tiles (pair / mask ignored when absent).
  __device__ __forceinline__ static void issue(const KeyBlockMaps& maps, uint64_t* full, const AttentionParams& p,
                                               int64_t b, int64_t n, int64_t h, int m0, int jb, Element* k_dst,
                                               Element* v_dst, PairT* pair_dst, float* mask_dst) {
    uint64_t* bar = &full[jb % kStages];
    const bool has_mask = p.mask_scaled != nullptr;
    Barrier::arrive_and_expect_tx(bar, 2 * Rows::bytes(p.D) + kPairBytes + (has_mask ? kMaskBytes : 0));
    const int n0 = jb * kBlockN;
    Rows::copy(&maps.k, bar, k_dst, n0, p.k_strides, b, n, h);
    Rows::copy(&maps.v, bar, v_dst, n0, p.v_strides, b, n, h);
    if constexpr (kHasPair) Pair::copy(&maps.pair, bar, pair_dst, m0, n0, p, b, h);
    if (has_mask) Mask::copy(&maps.mask, bar, mask_dst, n0, p, b, n);
  }

  // Prologue (StageBarriers::start): the rings zeroed where K and V rows are narrower than their
  // tiles (Rows::narrow), then key block 0 issued (issue_block(0)).
  template <typename IssueBlock>
  __device__ __forceinline__ static void start(uint64_t* full, IssueBlock&& issue_block, const AttentionParams& p,
                                               char* rings, int ring_bytes) {
    StageBarriers<2>::start(full, issue_block, Rows::narrow(p.D), rings, ring_bytes);
  }

  // Ends the prologue after the kernel's own committed cp.async copies: waits for this thread's,
  // makes them visible to the tensor cores, and syncs the CTA (everyone's have landed; the barriers
  // are initialised).
  __device__ __forceinline__ static void finish_prologue() {
    cp_async_wait<0>();
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
  }

  // Step jb of the key loop: waits for block jb; when a block jb + 1 exists, syncs the CTA (every
  // warp is done with the ring stages block jb + 1 takes) and thread 0 issues it.
  template <typename IssueBlock>
  __device__ __forceinline__ static void begin_step(uint64_t* full, int jb, int n_blocks, IssueBlock&& issue_block) {
    wait(full, jb);
    if (jb + 1 < n_blocks) {
      __syncthreads();
      if (threadIdx.x == 0) issue_block(jb + 1);
    }
  }
};

// The key-block loop of the kernels on KeyBlockTma (the forward and the dQ kernel): per key block jb,
// wait for its tiles (and start block jb + 1's), issue its score products, then the deferred
// product of block jb - 1 (O += P.V, dQ += dS.K: it reads the register operand step jb - 1 left),
// wait for the scores only and form the next operand from them (softmax, dS); then wait for the
// deferred product too and repack the operand into registers for the next step. The last block's
// deferred product runs after the loop. The source orders form() before that wait, but ptxas
// (CUDA 13.0, sm_90a) schedules the wait at the top of form(), so a warp forms its operand after the
// product has landed; the other CTAs' warps cover the wait (a fence that kept form() above it
// measured no faster: benchmarks/DESIGN.md). The kernel's parts are
// lambdas marked __attribute__((always_inline)), so that each is inlined where the loop calls it
// before the kernel is optimized:
//   scores(jb)    start block jb's score accumulators (the biases) and issue and commit its products
//   deferred(jb)  issue and commit the product that reads block jb's register operand
//   form()        the scores have landed: fence them and compute on them
//   settle()      the deferred product has landed: fence its accumulators
//   repack()      turn the formed scores into the next deferred product's register operand
template <typename Tma, typename IssueBlock, typename Scores, typename Deferred, typename Form, typename Settle,
          typename Repack>
__device__ __forceinline__ void key_block_loop(uint64_t* full, int n_blocks, IssueBlock&& issue_block, Scores&& scores,
                                               Deferred&& deferred, Form&& form, Settle&& settle, Repack&& repack) {
  for (int jb = 0; jb < n_blocks; ++jb) {
    // block jb landed; jb + 1 issued once every warp has finished the products whose stages it takes
    Tma::begin_step(full, jb, n_blocks, issue_block);
    scores(jb);
    if (jb > 0) {
      deferred(jb - 1);
      cute::warpgroup_wait<1>();  // the scores done; block jb - 1's deferred product may still run
    } else {
      cute::warpgroup_wait<0>();
    }
    form();
    cute::warpgroup_wait<0>();  // block jb - 1's deferred product done: its operand registers may change
    settle();
    repack();
  }
  deferred(n_blocks - 1);
  cute::warpgroup_wait<0>();
  settle();
}

// The row pipeline of the pair-bias gradient, whose CTA keeps one [kBlockM queries, kBlockN keys]
// tile of (b, h) and steps through rows n: row n brings Q and dO [kBlockM, D] (queries from m0), K
// and V [kBlockN, D] (keys from n0) (RowTileTma) and the mask tile [kBlockN]. Thread 0 issues a
// row's copies; they complete on the transaction barrier of its stage (step s on full[s % kStages],
// phase (s / kStages) % 2), as in KeyBlockTma; start() zeroes the ring first where rows are narrow.
struct RowStepMaps {
  CUtensorMap q, dout, k, v, mask;  // mask left unset when absent
};

template <typename Element, int kHeadDim, int kBlockM, int kBlockN>
struct RowStepTma : StageBarriers<2> {  // two rows in flight
  using RowsQ = RowTileTma<Element, kHeadDim, kBlockM>;
  using RowsK = RowTileTma<Element, kHeadDim, kBlockN>;
  using Mask = MaskTileTma<kBlockN>;
  static constexpr int kMaskBytes = Mask::kBytes;

  static void encode(RowStepMaps& maps, const AttentionParams& p, const char* kernel) {
    RowsQ::encode(&maps.q, p.q, p.q_strides, p.Lq, p, kernel, "q");
    RowsQ::encode(&maps.dout, p.dout, p.do_strides, p.Lq, p, kernel, "dout");
    RowsK::encode(&maps.k, p.k, p.k_strides, p.Lk, p, kernel, "k");
    RowsK::encode(&maps.v, p.v, p.v_strides, p.Lk, p, kernel, "v");
    if (p.mask_scaled != nullptr) Mask::encode(&maps.mask, p, kernel);
  }

  // One thread: arms step `step`'s barrier and starts row n's copies into the given tiles.
  __device__ __forceinline__ static void issue(const RowStepMaps& maps, uint64_t* full, const AttentionParams& p,
                                               int step, int64_t b, int64_t n, int64_t h, int m0, int n0,
                                               Element* q_dst, Element* do_dst, Element* k_dst, Element* v_dst,
                                               float* mask_dst) {
    uint64_t* bar = &full[step % kStages];
    const bool has_mask = p.mask_scaled != nullptr;
    Barrier::arrive_and_expect_tx(bar, 2 * RowsQ::bytes(p.D) + 2 * RowsK::bytes(p.D) + (has_mask ? kMaskBytes : 0));
    RowsQ::copy(&maps.q, bar, q_dst, m0, p.q_strides, b, n, h);
    RowsQ::copy(&maps.dout, bar, do_dst, m0, p.do_strides, b, n, h);
    RowsK::copy(&maps.k, bar, k_dst, n0, p.k_strides, b, n, h);
    RowsK::copy(&maps.v, bar, v_dst, n0, p.v_strides, b, n, h);
    if (has_mask) Mask::copy(&maps.mask, bar, mask_dst, n0, p, b, n);
  }

  // Prologue (StageBarriers::start): the ring zeroed where Q, dO, K and V rows are narrower than
  // their tiles (one head dim for all four), then row step 0 issued (issue_row(0)); kThreads: the CTA's.
  template <int kThreads, typename IssueRow>
  __device__ __forceinline__ static void start(uint64_t* full, IssueRow&& issue_row, const AttentionParams& p,
                                               char* ring, int ring_bytes) {
    StageBarriers<2>::start<kThreads>(full, issue_row, RowsQ::narrow(p.D), ring, ring_bytes);
  }
};

}  // namespace sm90
}  // namespace evoformer
