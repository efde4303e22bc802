// The sm90 (Hopper, sm_90a) forward kernel: the same function and outputs as forward_sm80.cuh, with
// the two products on the warpgroup tensor-core instructions (wgmma): S = Q.K^T reads Q and K from
// shared memory, O += P.V takes P from registers and V from shared memory. The tensor cores run
// asynchronously to the softmax of the other warpgroups on the SM, and no B fragments pass through
// registers.
//
// CTA = EVOFORMER_SM90_WARPGROUPS warpgroups (default 1: 128 threads, 5 CTAs per SM) x 64 query
// rows each, of one (b, n, h), on the same RowTileGrid as the sm80 kernel. The tiles of each key
// block (K, V, the pair and mask tiles) arrive by TMA through the key-block pipeline
// (sm90_pipeline.cuh, shared with the dQ kernel). Key step j: wait for block j, one CTA barrier
// (every warp is done with the stages block j + 1 will overwrite), thread 0 starts block j + 1's
// copies, start S at the biases (init_scores, the pair tile read with ldmatrix), issue
// S = Q.K_j^T and then O += P_{j-1}.V_{j-1} (wgmma), wait for S only, run block j's softmax, then
// wait for P_{j-1}.V_{j-1}, rescale O and keep P_j in registers for the next step (ptxas moves that
// wait to the top of the softmax: see key_block_loop). V is therefore read one step after
// K: K, the pair and mask tiles live in a 2-stage ring, V in a 3-stage one. Q is copied once, with
// cp.async. For the gated attention (AttentionParams::gate) the epilogue also writes y =
// sigmoid(g) * O, the thread's gate values read into registers (GateFragment) before the key loop.
//
// Shared-memory tiles that wgmma reads use CuTe's GMMA swizzled layouts: Q [128, D] and K [keys, D]
// K-major; V [keys, D] is the B operand of P.V as (D, keys), i.e. MN-major. TMA writes them with the
// matching swizzle (64-byte rows at D = 32, 128-byte column slabs above); the pair tile is the dense
// 128-byte-swizzled tile of bias_tile_offset.
#pragma once

#include "attention/epilogue.cuh"
#include "common/mma_sm80.cuh"
#include "common/sm90_layouts.cuh"
#include "attention/sm90/sm90_pipeline.cuh"
#include "attention/softmax.cuh"
#include "attention/tile_scheduler.cuh"

// Warpgroups per CTA (64 query rows each); a build-time knob like the sm80 kernel's tiling macros.
// One warpgroup per CTA at 4 CTAs per SM measured faster than two at 2 per SM on most shapes of the
// benchmark suite (see benchmarks/DESIGN.md): the per-step barrier then spans 4 warps instead of 8.
#ifndef EVOFORMER_SM90_WARPGROUPS
#define EVOFORMER_SM90_WARPGROUPS 1
#endif
// Warps per SM the forward is compiled for where shared memory allows (registers per thread capped at
// 65536 / (32 * this)). 20 (five CTAs of one warpgroup at D = 32: 96 registers, 48 bytes spilled with
// a 16-bit pair bias) against 16 (four, 117 registers, no spills): the pair-biased forward 2-6 % faster
// on the suite, bitwise the same outputs (benchmarks/DESIGN.md); without a pair bias it takes 95
// registers either way, which five CTAs hold already.
#ifndef EVOFORMER_SM90_FWD_WARPS_PER_SM
#define EVOFORMER_SM90_FWD_WARPS_PER_SM 20
#endif

namespace evoformer {
namespace sm90 {

template <typename Element_, int kHeadDim_, int kPair_>
struct ForwardConfig {
  using Element = Element_;
  using PairT = typename PairType<kPair_, Element_>::type;
  static constexpr int kHeadDim = kHeadDim_;  // bucket; D is zero-padded up to it in shared memory
  static constexpr int kPair = kPair_;
  static constexpr int kWarpGroups = EVOFORMER_SM90_WARPGROUPS;
  static constexpr int kThreads = 128 * kWarpGroups;
  static constexpr int kBlockM = 64 * kWarpGroups;  // queries per CTA: 64 per warpgroup
  static constexpr int kBlockN = 64;                 // keys per step
  static constexpr int kNTiles = kBlockN / 8;        // n8 column tiles of a warp's 16 rows of S
  static constexpr int kDTiles = kHeadDim / 8;       // n8 column tiles of a warp's 16 rows of O
  using Tma = KeyBlockTma<Element, PairT, kHeadDim, kBlockM, kBlockN, kPair != kNoPair>;  // K, V, pair, mask tiles
  static constexpr int kPairPitch = Tma::kPairPitch;

  using LayoutQ = typename RowTileLayouts<Element, kBlockM, kHeadDim>::RowMajor;
  using LayoutK = typename RowTileLayouts<Element, kBlockN, kHeadDim>::RowMajor;
  using LayoutVt = typename RowTileLayouts<Element, kBlockN, kHeadDim>::Transposed;

  // One warpgroup's products: S [64, kBlockN] = Q [64, D] . K^T; O [64, D] += P [64, kBlockN] . V.
  using MmaS = SsMma<Element, kBlockN, kHeadDim>;
  // Row sums of P on the tensor cores: [64, 8] += P . ones[kBlockN, 8] (every column is the row sum
  // of the rounded P, which is what P.V used).
  using MmaSum = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::_8, cute::Int<kBlockN>>>()));
  using LayoutOnes = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_INTER_Atom<Element>{},
                                                  cute::Shape<cute::_8, cute::Int<kBlockN>>{}));
  using MmaO = RsMmaMN<Element, kHeadDim, kBlockN>;

  // Shared memory (each wgmma or swizzled TMA tile 1024-byte aligned, as the swizzles require): Q,
  // then the pipeline's two stages of {K, pair tile, mask tile}, then three of V (read one step
  // later), the ones tile and the pipeline's transaction barriers.
  static constexpr int kQBytes = smem_align(kBlockM * kHeadDim * 2);
  static constexpr int kKVBytes = smem_align(kBlockN * kHeadDim * 2);  // K or V, one stage
  static constexpr int kPairBytes = Tma::kPairBytes;
  static constexpr int kMaskBytes = Tma::kMaskBytes;
  static constexpr int kKStageBytes = smem_align(kKVBytes + kPairBytes + kMaskBytes);
  static constexpr int kKStages = Tma::kStages, kVStages = Tma::kStages + 1;
  static constexpr int kRingBytes = kKStages * kKStageBytes + kVStages * kKVBytes;  // the K and V rings
  static constexpr int kOnesBytes = smem_align(8 * kBlockN * 2);
  // + base alignment
  static constexpr int kSmemBytes = kSmemAlign + kQBytes + kRingBytes + kOnesBytes + Tma::kBarrierBytes;
  // CTAs per SM compiled for (caps registers per thread): EVOFORMER_SM90_FWD_WARPS_PER_SM warps per SM
  // where shared memory allows.
  static constexpr int kMinBlocksPerSM = ctas_per_sm(kSmemBytes, EVOFORMER_SM90_FWD_WARPS_PER_SM * 32 / kThreads);
  static_assert(kSmemBytes <= 227 * 1024, "a CTA's shared memory must fit an SM (227 KB)");
  static_assert(kKVBytes % kSmemAlign == 0 && kPairBytes % kSmemAlign == 0, "swizzled TMA tiles stay 1024-aligned");
};

template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSM)
    forward_sm90_kernel(const AttentionParams p, const RowTileGrid grid, const __grid_constant__ KeyBlockMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Element = typename Cfg::Element;
  using PairT = typename Cfg::PairT;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kNTiles = Cfg::kNTiles, kDTiles = Cfg::kDTiles, kThreads = Cfg::kThreads;

  extern __shared__ __align__(16) char smem_raw[];
  char* smem = aligned_smem(smem_raw);
  Element* q_smem = reinterpret_cast<Element*>(smem);
  char* k_ring = smem + Cfg::kQBytes;                                    // per stage: K, pair tile, mask tile
  char* v_ring = k_ring + Cfg::kKStages * Cfg::kKStageBytes;             // per stage: V
  auto k_smem = [&](int st) { return reinterpret_cast<Element*>(k_ring + st * Cfg::kKStageBytes); };
  auto pair_smem = [&](int st) {  // [kBlockM][kPairPitch]
    return reinterpret_cast<PairT*>(k_ring + st * Cfg::kKStageBytes + Cfg::kKVBytes);
  };
  auto mask_smem = [&](int st) {  // [kBlockN]
    return reinterpret_cast<float*>(k_ring + st * Cfg::kKStageBytes + Cfg::kKVBytes + Cfg::kPairBytes);
  };
  auto v_smem = [&](int st) { return reinterpret_cast<Element*>(v_ring + st * Cfg::kKVBytes); };
  Element* ones_smem = reinterpret_cast<Element*>(k_ring + Cfg::kRingBytes);  // [8, kBlockN] of 1
  uint64_t* block_full = reinterpret_cast<uint64_t*>(k_ring + Cfg::kRingBytes + Cfg::kOnesBytes);  // [Tma::kStages]
  Tensor sQ = make_tensor(make_smem_ptr(q_smem), typename Cfg::LayoutQ{});  // [kBlockM, kHeadDim]

  const int tid = threadIdx.x, lane = threadIdx.x % 32u;
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128u), 0);  // warp-uniform
  const int wg_tid = threadIdx.x % 128u;
  const int warp_row0 = wg * 64 + (wg_tid / 32) * 16;  // first of this warp's 16 rows in the CTA tile
  const RowTile rt = grid.decode();
  const int64_t b = rt.b, n = rt.n, h = blockIdx.y;
  const int m0 = rt.tile * kBlockM;
  const int rows_q = min(kBlockM, p.Lq - m0);

  const Element* q = static_cast<const Element*>(p.q) + p.q_strides.at(b, n, m0, h);  // [Lq, D] from m0
  const bool has_mask = p.mask_scaled != nullptr;

  // Key block jb's tiles into their ring stages (issued by one thread).
  auto issue_block = [&](int jb) {
    const int ks = jb % Cfg::kKStages;
    Cfg::Tma::issue(maps, block_full, p, b, n, h, m0, jb, k_smem(ks), v_smem(jb % Cfg::kVStages), pair_smem(ks),
                    mask_smem(ks));
  };

  const int n_blocks = (p.Lk + kBlockN - 1) / kBlockN;
  Cfg::Tma::start(block_full, issue_block, p, k_ring, Cfg::kRingBytes);
  for (int i = tid; i < 8 * kBlockN; i += kThreads) ones_smem[i] = Element(1.f);
  SwizzledTileCopy<kBlockM, kHeadDim, kThreads>(tid, [](int r, int c) { return swizzled_offset<typename Cfg::LayoutQ, Element>(r, c); })(
      q_smem, q, p.q_strides.l, rows_q, p.D);  // [kBlockM, kHeadDim] (LayoutQ)
  cp_async_commit();
  const OutputRows<Element> rows(p, b, n, h);  // [Lq, D] slices
  GateFragment<Element, kDTiles> gate;         // read now, used by the epilogue
  gate.load(rows, m0 + warp_row0 + lane / 4, p.Lq, p.D, lane);
  Cfg::Tma::finish_prologue();  // Q (and the ones tile) in place for the tensor cores

  // This warpgroup's operands: Q rows [64 wg, 64 wg + 64), K / V of each stage.
  typename Cfg::MmaS mma_s;
  typename Cfg::MmaO mma_o;
  typename Cfg::MmaSum mma_sum;
  auto thr_s = mma_s.get_thread_slice(wg_tid);
  auto thr_o = mma_o.get_thread_slice(wg_tid);
  Tensor tSumrOnes = mma_sum.get_thread_slice(wg_tid).partition_fragment_B(
      make_tensor(make_smem_ptr(ones_smem), typename Cfg::LayoutOnes{}));
  Tensor tSumrSum = partition_fragment_C(mma_sum, Shape<_64, _8>{});  // row sums: (g, .) in 0-1, (g + 8, .) in 2-3
  Tensor tSrQ = thr_s.partition_fragment_A(local_tile(sQ, Shape<_64, Int<kHeadDim>>{}, make_coord(wg, 0)));
  Tensor tSrS = partition_fragment_C(mma_s, Shape<_64, Int<kBlockN>>{});  // fp32, rows of this thread
  Tensor tOrO = partition_fragment_C(mma_o, Shape<_64, Int<kHeadDim>>{});
  // P as the A operand of P.V (registers): the same (row, key) values as S, two 16-bit per register
  Tensor tOrP = thr_o.partition_fragment_A(
      make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)), Shape<_64, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{}));
  static_assert(size(tSrS) == kNTiles * 4 && size(tOrO) == kDTiles * 4 && size(tOrP) == kBlockN / 2,
                "wgmma fragments must match the m16n8 accumulator layout used by the softmax helpers");
  // The accumulator fragments of a warp's 16 rows are laid out as kNTiles (kDTiles) n8 tiles of
  // {(g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)}, like mma.sync's C tiles.
  float(&s)[kNTiles][4] = *reinterpret_cast<float(*)[kNTiles][4]>(raw_pointer_cast(tSrS.data()));
  float(&o)[kDTiles][4] = *reinterpret_cast<float(*)[kDTiles][4]>(raw_pointer_cast(tOrO.data()));
  float(&row_sum)[4] = *reinterpret_cast<float(*)[4]>(raw_pointer_cast(tSumrSum.data()));
  static_assert(size(tSumrSum) == 4, "row-sum accumulator: one m16n8 tile per warp");
  uint32_t(&pa)[kBlockN / 16][4] = *reinterpret_cast<uint32_t(*)[kBlockN / 16][4]>(raw_pointer_cast(tOrP.data()));

#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[dt][e] = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) row_sum[e] = 0.f;
  float row_max_s[2] = {-kInf, -kInf};

  // O += P_{jb}.V_{jb} with P in registers (pa), issued without waiting.
  auto issue_pv = [&](int jb) __attribute__((always_inline)) {
    Tensor sVt = make_tensor(make_smem_ptr(v_smem(jb % Cfg::kVStages)), typename Cfg::LayoutVt{});
    Tensor tOrV = thr_o.partition_fragment_B(sVt);
    warpgroup_fence_operand(tOrO);
    warpgroup_fence_operand(tSumrSum);
    warpgroup_fence_operand(tOrP);
    warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < size<2>(tOrP); ++kk) gemm(mma_o, tOrP(_, _, kk), tOrV(_, _, kk), tOrO);
#pragma unroll
    for (int kk = 0; kk < size<2>(tOrP); ++kk) gemm(mma_sum, tOrP(_, _, kk), tSumrOnes(_, _, kk), tSumrSum);
    warpgroup_commit_batch();
  };

  float alpha[2];  // the rescale of O and the row sums by the step's new row maxima
  key_block_loop<typename Cfg::Tma>(
      block_full, n_blocks, issue_block,
      [&](int jb) __attribute__((always_inline)) {  // S = (mask + pair) / scale + Q . K^T
        const int ks = jb % Cfg::kKStages;
        const int n0 = jb * kBlockN;
        const PairT* sPair = pair_smem(ks);
        const float* sMask = has_mask ? mask_smem(ks) : nullptr;
        init_block_scores<Cfg::kPair != kNoPair, kNTiles, Cfg::kPairPitch>(s, sMask, sPair, warp_row0, p.Lk - n0,
                                                                           p.inv_scale, lane);
        Tensor sK = make_tensor(make_smem_ptr(k_smem(ks)), typename Cfg::LayoutK{});
        Tensor tSrK = thr_s.partition_fragment_B(sK);
        warpgroup_fence_operand(tSrS);
        warpgroup_arrive();
#pragma unroll
        for (int kk = 0; kk < size<2>(tSrQ); ++kk) gemm(mma_s, tSrQ(_, _, kk), tSrK(_, _, kk), tSrS);
        warpgroup_commit_batch();
      },
      issue_pv,
      [&]() __attribute__((always_inline)) {  // the softmax of S
        warpgroup_fence_operand(tSrS);
        softmax_step<kNTiles, kResidualPerScore<Element>>(s, row_max_s, alpha, p.scale_log2);
      },
      [&]() __attribute__((always_inline)) {  // O and the row sums
        warpgroup_fence_operand(tOrO);
        warpgroup_fence_operand(tSumrSum);
      },
      [&]() __attribute__((always_inline)) {  // O and the row sums rescaled; P_jb into registers (pa)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          row_sum[2 * r] *= alpha[r], row_sum[2 * r + 1] *= alpha[r];
#pragma unroll
          for (int dt = 0; dt < kDTiles; ++dt) o[dt][2 * r] *= alpha[r], o[dt][2 * r + 1] *= alpha[r];
        }
#pragma unroll
        for (int kc = 0; kc < kBlockN / 16; ++kc) c_to_a_frag<Element>(pa[kc], s, kc);
      });

  const float row_total[2] = {row_sum[0], row_sum[2]};
  float2* stats = reinterpret_cast<float2*>(p.stats) + ((b * p.N + n) * p.H + h) * p.Lq;  // [Lq]
  store_output_rows<Element, kDTiles>(o, row_total, row_max_s, p.scale_log2, rows, &gate, stats,
                                      m0 + warp_row0 + lane / 4, p.Lq, p.D, lane);
#endif
}

}  // namespace sm90

template <typename Element, int kHeadDim, int kPair>
int forward_smem_bytes_sm90() {
  return sm90::ForwardConfig<Element, kHeadDim, kPair>::kSmemBytes;
}

template <typename Element, int kHeadDim, int kPair>
void launch_forward_sm90(const AttentionParams& p, cudaStream_t stream) {
  using Cfg = sm90::ForwardConfig<Element, kHeadDim, kPair>;
  constexpr const char* kName = "evoformer forward sm90";
  sm90::KeyBlockMaps maps{};
  Cfg::Tma::encode(maps, p, kName);
  launch_on_row_tiles<Cfg::kBlockM>(sm90::forward_sm90_kernel<Cfg>, p, p.Lq, Cfg::kThreads, Cfg::kSmemBytes, stream,
                                    kName, maps);
}

}  // namespace evoformer
