// The key-block TMA pipeline of the Hopper kernels that stream key blocks past a fixed tile of
// kBlockM queries of one (b, n, h): the forward and the dQ kernel. Each key block brings K and V
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
//            for (jb = 0; jb < n_blocks; ++jb) {
//              Tma::begin_step(full, jb, n_blocks, issue_block);  // block jb landed; jb + 1 issued
//              ... block jb's math ...
//            }
#pragma once

#include <cutlass/arch/barrier.h>

#include "sm90_layouts.cuh"

namespace evoformer {
namespace sm90 {

struct KeyBlockMaps {
  CUtensorMap k, v, pair, mask;  // a map is left unset when its tensor is absent
};

template <typename Element, typename PairT, int kHeadDim, int kBlockM, int kBlockN, bool kHasPair>
struct KeyBlockTma {
  using Rows = RowTileTma<Element, kHeadDim, kBlockN>;
  using Pair = PairTileTma<PairT, Element, kBlockM, kBlockN>;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  static constexpr int kStages = 2;  // key blocks in flight, one transaction barrier each
  static constexpr int kBarrierBytes = kStages * int(sizeof(uint64_t));
  static constexpr int kPairBytes = kHasPair ? Pair::kBytes : 0;
  static constexpr int kMaskBytes = kBlockN * 4;
  static constexpr int kPairPitch = Pair::kPitch;

  // Host: the maps of one launch's K, V, pair and mask tensors; a rejected map throws naming
  // `kernel` and the tensor (the message is composed only then).
  static void encode(KeyBlockMaps& maps, const AttentionParams& p, const char* kernel) {
    Rows::encode(&maps.k, p.k, p.k_strides, p.Lk, p, kernel, "k");
    Rows::encode(&maps.v, p.v, p.v_strides, p.Lk, p, kernel, "v");
    if constexpr (kHasPair) Pair::encode(&maps.pair, p, kernel);
    if (p.mask_scaled != nullptr) {
      const TileMapDim dims[3] = {{p.Lk, 1, kBlockN}, {p.N, p.mask_stride_n, 1}, {p.B, p.mask_stride_b, 1}};
      encode_tile_map(&maps.mask, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, p.mask_scaled, dims, 3,
                      CU_TENSOR_MAP_SWIZZLE_NONE, kernel, "mask-bias");
    }
  }

  // One thread: initialises the barriers full[kStages] (one arrival each: the issuing thread's).
  __device__ __forceinline__ static void init(uint64_t* full) {
#pragma unroll
    for (int st = 0; st < kStages; ++st) Barrier::init(&full[st], 1);
    cutlass::arch::fence_barrier_init();
  }

  // Waits until key block jb's copies have landed.
  __device__ __forceinline__ static void wait(uint64_t* full, int jb) {
    Barrier::wait(&full[jb % kStages], (jb / kStages) % 2);
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
    if (has_mask)
      cute::SM90_TMA_LOAD_3D::copy(&maps.mask, bar, uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL), mask_dst, n0,
                                   tma_coord(p.mask_stride_n, n), tma_coord(p.mask_stride_b, b));
  }

  // Prologue: where K and V rows are narrower than their tiles (Rows::narrow), every thread zeroes
  // the rings [rings, rings + ring_bytes) first (the copies never write the columns past D, which
  // the products read); then thread 0 initialises the barriers and starts key block 0
  // (issue_block(0)).
  template <typename IssueBlock>
  __device__ __forceinline__ static void start(uint64_t* full, IssueBlock&& issue_block, const AttentionParams& p,
                                               char* rings, int ring_bytes) {
    if (Rows::narrow(p.D)) {
      for (int i = int(threadIdx.x) * 16; i < ring_bytes; i += int(blockDim.x) * 16)
        *reinterpret_cast<uint4*>(rings + i) = make_uint4(0, 0, 0, 0);
      cutlass::arch::fence_view_async_shared();  // the zeros before the copies (async proxy)
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      init(full);
      issue_block(0);
    }
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

}  // namespace sm90
}  // namespace evoformer
