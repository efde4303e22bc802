// Forward kernel: o = softmax(scale * q.k^T + mask_bias + pair_bias) . v with an online softmax in
// the log2 domain; writes o and the softmax statistics (row max, log2 row sum). The score
// accumulator starts at the biases divided by the scale (init_scores), so the biases cost one FFMA
// per element; probabilities are exp2((S - max) * scale * log2(e)).
//
// CTA = (query block, group of rows n, b) on blockIdx.x (query block fastest), h on blockIdx.y. A
// CTA runs its rows n one after another as one pipeline of (n, key block) steps: the K, V, mask
// (and pair) tiles of the next step, and the Q tile of the next row, are copied (cp.async) while
// the current step computes. The pair bias [query block, Lk] does not depend on n: when it fits in
// shared memory next to the pipeline (fwd_pair_resident) it is copied once per CTA instead of once
// per row, which removes most of the kernel's L2 traffic. Each warp owns 16 query rows.
#pragma once

#include "kernel_utils.cuh"

namespace evoformer {

template <typename Element_, int kHeadDim_, int kPair_>
struct ForwardConfig {
  using Element = Element_;
  using PairT = typename PairType<kPair_, Element_>::type;
  static constexpr int kHeadDim = kHeadDim_;  // bucket; D is zero-padded up to it in shared memory
  static constexpr int kPair = kPair_;
  // 16 query rows per warp keeps the per-thread state small (S: 32 registers) so that two CTAs of
  // 8 warps fit an SM; the 8 warps share each K/V/pair tile copied into shared memory.
  static constexpr int kWarps = kHeadDim <= 64 ? 8 : 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMinBlocksPerSM = EVOFORMER_FWD_MIN_BLOCKS;
  static constexpr int kMTiles = 1;                       // 16-row MMA tiles per warp
  static constexpr int kBlockM = kWarps * kMTiles * 16;   // queries per CTA
  static constexpr int kBlockN = 64;                      // keys per step
  static constexpr int kNTiles = kBlockN / 8;             // n8 tiles of S per 16 rows
  static constexpr int kDTiles = kHeadDim / 8;            // n8 tiles of O per 16 rows
  static constexpr int kKSteps = kHeadDim / 16;           // k16 steps of q.k^T
  static constexpr bool kQInRegs = kHeadDim <= 64;        // else Q fragments are re-read from smem
  static constexpr int kPitch = kHeadDim + 8;             // +16 B per row: conflict-free ldmatrix
  static constexpr int kPairPitch = kBlockN + 8;          // +16/32 B per row: conflict-free reads
  static constexpr int kQBytes = kBlockM * kPitch * sizeof(Element);
  static constexpr int kKVBytes = kBlockN * kPitch * sizeof(Element);  // K or V, one stage
  static constexpr int kPairTileBytes = kPair ? kBlockM * kPairPitch * int(sizeof(PairT)) : 0;
  static constexpr int kMaskBytes = kBlockN * sizeof(float);
  // Keep the pair row block resident only while two CTAs still fit an SM.
  static constexpr int kResidentBudget = 113 * 1024;

  // Shared memory: Q [2][kBlockM][kPitch] | 2 stages of {K, V [kBlockN][kPitch], mask [kBlockN],
  // pair [kBlockM][kPairPitch] when streamed} | pair [kBlockM][resident_pitch] when resident.
  __host__ __device__ static constexpr int resident_pitch(int n_key_blocks) { return n_key_blocks * kBlockN + 8; }
  __host__ __device__ static constexpr int stage_bytes(bool resident) {
    return 2 * kKVBytes + kMaskBytes + (resident ? 0 : kPairTileBytes);
  }
  __host__ __device__ static constexpr int smem_bytes(bool resident, int n_key_blocks) {
    return 2 * kQBytes + 2 * stage_bytes(resident) +
           (resident ? kBlockM * resident_pitch(n_key_blocks) * int(sizeof(PairT)) : 0);
  }
};

template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSM) forward_kernel(const AttentionParams p) {
  using Element = typename Cfg::Element;
  using PairT = typename Cfg::PairT;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kPitch = Cfg::kPitch;
  constexpr int kMTiles = Cfg::kMTiles, kNTiles = Cfg::kNTiles, kDTiles = Cfg::kDTiles;
  constexpr int kThreads = Cfg::kThreads;
  constexpr bool kHasPair = Cfg::kPair != kNoPair;

  const int n_key_blocks = (p.Lk + kBlockN - 1) / kBlockN;
  const bool resident = kHasPair && p.fwd_pair_resident;
  const int stage_bytes = Cfg::stage_bytes(resident);
  extern __shared__ __align__(16) char smem[];
  char* stages = smem + 2 * Cfg::kQBytes;
  auto stage_q = [&](int s) { return reinterpret_cast<Element*>(smem + s * Cfg::kQBytes); };  // [kBlockM][kPitch]
  auto stage_k = [&](int s) { return reinterpret_cast<Element*>(stages + s * stage_bytes); };   // [kBlockN][kPitch]
  auto stage_v = [&](int s) { return stage_k(s) + kBlockN * kPitch; };                          // [kBlockN][kPitch]
  auto stage_mask = [&](int s) { return reinterpret_cast<float*>(stage_v(s) + kBlockN * kPitch); };  // [kBlockN]
  auto stage_pair = [&](int s) { return reinterpret_cast<PairT*>(stage_mask(s) + kBlockN); };  // [kBlockM][kPairPitch]
  PairT* resident_pair = reinterpret_cast<PairT*>(stages + 2 * stage_bytes);  // [kBlockM][resident pitch]
  const int resident_pitch = Cfg::resident_pitch(n_key_blocks);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, t = lane % 4;
  const int n_query_blocks = (p.Lq + kBlockM - 1) / kBlockM;
  const int n_groups = (p.N + p.fwd_n_group - 1) / p.fwd_n_group;
  const int64_t x = blockIdx.x;
  const int m0 = int(x % n_query_blocks) * kBlockM;
  const int64_t group = (x / n_query_blocks) % n_groups, b = x / (int64_t(n_query_blocks) * n_groups);
  const int64_t h = blockIdx.y;
  const int n_begin = int(group) * p.fwd_n_group, n_end = min(p.N, n_begin + p.fwd_n_group);
  const int rows_q = min(kBlockM, p.Lq - m0);
  const int warp_row0 = warp * kMTiles * 16;

  const PairT* pair = nullptr;  // [Lq, Lk_pad] rows of this (b, h), from query m0
  if constexpr (kHasPair)
    pair = static_cast<const PairT*>(p.pair) + b * p.pair_stride_b + h * p.pair_stride_h + int64_t(m0) * p.pair_stride_q;

  // Copies for pipeline step (row n, key block jb) into stage s; with `with_q`, also row n's Q tile.
  auto load_step = [&](int s, int64_t n, int jb, bool with_q, int q_buffer) {
    const int n0 = jb * kBlockN;
    const int rows_k = min(kBlockN, p.Lk - n0);
    if (with_q) {
      const Element* q = static_cast<const Element*>(p.q) + b * p.q_stride_b + n * p.q_stride_n + h * p.q_stride_h +
                         int64_t(m0) * p.q_stride_l;
      load_tile_async<Element, kBlockM, Cfg::kHeadDim, kPitch, kThreads>(stage_q(q_buffer), q, p.q_stride_l, rows_q,
                                                                         p.D, tid);
    }
    const Element* k = static_cast<const Element*>(p.k) + b * p.k_stride_b + n * p.k_stride_n + h * p.k_stride_h +
                       int64_t(n0) * p.k_stride_l;
    const Element* v = static_cast<const Element*>(p.v) + b * p.v_stride_b + n * p.v_stride_n + h * p.v_stride_h +
                       int64_t(n0) * p.v_stride_l;
    load_tile_async<Element, kBlockN, Cfg::kHeadDim, kPitch, kThreads>(stage_k(s), k, p.k_stride_l, rows_k, p.D, tid);
    load_tile_async<Element, kBlockN, Cfg::kHeadDim, kPitch, kThreads>(stage_v(s), v, p.v_stride_l, rows_k, p.D, tid);
    if (p.mask_scaled)
      load_tile_async<float, 1, kBlockN, kBlockN, kThreads>(
          stage_mask(s), p.mask_scaled + b * p.mask_stride_b + n * p.mask_stride_n + n0, 0, 1, p.Lk - n0, tid);
    if constexpr (kHasPair) {
      if (!resident)
        load_tile_async<PairT, kBlockM, kBlockN, Cfg::kPairPitch, kThreads>(stage_pair(s), pair + n0, p.pair_stride_q,
                                                                            rows_q, p.Lk - n0, tid);
    }
  };

  if constexpr (kHasPair) {
    if (resident)  // the whole [kBlockM, Lk] pair row block, once for all rows n of this CTA
      for (int jb = 0; jb < n_key_blocks; ++jb)
        load_tile_async<PairT, kBlockM, kBlockN, Cfg::kPairPitch, kThreads>(
            resident_pair + jb * kBlockN, pair + jb * kBlockN, p.pair_stride_q, rows_q, p.Lk - jb * kBlockN, tid,
            resident_pitch);
  }
  load_step(0, n_begin, 0, /*with_q=*/true, 0);
  cp_async_commit();

  float o[kMTiles][kDTiles][4];
  float row_max_s[kMTiles][2], row_sum_s[kMTiles][2];  // max of S (raw units), this thread's partial row sums
  uint32_t qf[kMTiles][Cfg::kKSteps][4];               // Q as A operand (when Cfg::kQInRegs)

  const int steps = (n_end - n_begin) * n_key_blocks;
  for (int step = 0; step < steps; ++step) {
    const int s = step & 1;
    const int n_idx = step / n_key_blocks, jb = step % n_key_blocks;
    const int64_t n = n_begin + n_idx;
    const int n0 = jb * kBlockN;
    if (step + 1 < steps) {
      const bool next_row = jb + 1 == n_key_blocks;
      load_step(s ^ 1, next_row ? n + 1 : n, next_row ? 0 : jb + 1, next_row, (n_idx + 1) & 1);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const Element* sQ = stage_q(n_idx & 1);
    if (jb == 0) {  // a new row n: fresh accumulators
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.f;
#pragma unroll
        for (int r = 0; r < 2; ++r) row_max_s[mt][r] = -kInf, row_sum_s[mt][r] = 0.f;
      }
      if constexpr (Cfg::kQInRegs) load_a_frags<kMTiles, Cfg::kKSteps, kPitch>(qf, sQ, warp_row0, lane);
    }
    const Element* sK = stage_k(s);
    const Element* sV = stage_v(s);
    const float* sMask = p.mask_scaled ? stage_mask(s) : nullptr;
    const PairT* sPair = resident ? resident_pair + n0 : stage_pair(s);
    const int pair_pitch = resident ? resident_pitch : Cfg::kPairPitch;

    // S = (mask + pair) / scale + Q . K^T  [kMTiles * 16 rows, kBlockN keys] per warp
    float sc[kMTiles][kNTiles][4];
    if (n0 + kBlockN > p.Lk)
      init_scores<kHasPair, true, kMTiles, kNTiles, Cfg::kPairPitch>(sc, sMask, sPair, warp_row0, p.Lk - n0,
                                                                     p.inv_scale, lane, pair_pitch);
    else
      init_scores<kHasPair, false, kMTiles, kNTiles, Cfg::kPairPitch>(sc, sMask, sPair, warp_row0, p.Lk - n0,
                                                                      p.inv_scale, lane, pair_pitch);
#pragma unroll
    for (int kk = 0; kk < Cfg::kKSteps; ++kk) {
      uint32_t q_tmp[kMTiles][1][4];
      if constexpr (!Cfg::kQInRegs) load_a_frags<kMTiles, 1, kPitch>(q_tmp, sQ + kk * 16, warp_row0, lane);
#pragma unroll
      for (int nt = 0; nt < kNTiles; nt += 2) {
        uint32_t bf[2][2];
        load_b_frags_nmajor<kPitch>(bf, sK, nt * 8, kk * 16, lane);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          const uint32_t(&a)[4] = Cfg::kQInRegs ? qf[mt][kk] : q_tmp[mt][0];
          mma<Element>(sc[mt][nt], a, bf[0][0], bf[0][1]);
          mma<Element>(sc[mt][nt + 1], a, bf[1][0], bf[1][1]);
        }
      }
    }

    // Online softmax: p = exp2((S - max) * scale_log2). Subtracting before scaling makes equal
    // scores give exactly equal weights even when |S| is huge (fully masked rows); what was
    // accumulated is rescaled by exp2((old max - new max) * scale_log2).
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float mx = fmaxf(row_max_s[mt][r], quad_max(row_max<kNTiles>(sc[mt], r)));
        const float m_use = mx == -kInf ? 0.f : mx;  // all keys so far -inf: exp2(-inf) = 0
        const float alpha = fast_exp2((row_max_s[mt][r] - m_use) * p.scale_log2);
        row_max_s[mt][r] = mx;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          sc[mt][nt][2 * r] = fast_exp2((sc[mt][nt][2 * r] - m_use) * p.scale_log2);
          sc[mt][nt][2 * r + 1] = fast_exp2((sc[mt][nt][2 * r + 1] - m_use) * p.scale_log2);
        }
        row_sum_s[mt][r] = fmaf(row_sum_s[mt][r], alpha, row_sum<kNTiles>(sc[mt], r));
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) o[mt][dt][2 * r] *= alpha, o[mt][dt][2 * r + 1] *= alpha;
      }

    // O += P . V
#pragma unroll
    for (int kc = 0; kc < kBlockN / 16; ++kc) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) c_to_a_frag<Element>(a[mt], sc[mt], kc);
#pragma unroll
      for (int dt = 0; dt < kDTiles; dt += 2) {
        uint32_t bf[2][2];
        load_b_frags_kmajor<kPitch>(bf, sV, kc * 16, dt * 8, lane);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma<Element>(o[mt][dt], a[mt], bf[0][0], bf[0][1]);
          mma<Element>(o[mt][dt + 1], a[mt], bf[1][0], bf[1][1]);
        }
      }
    }

    if (jb + 1 == n_key_blocks) {
      // Row n done: o / rowsum and the row statistics (max, log2 rowsum); (0, +inf) for rows whose
      // keys are all -inf, so the backward's exp2(... - inf) gives P = 0 there.
      Element* out = static_cast<Element*>(p.out) + b * p.o_stride_b + n * p.o_stride_n + h * p.o_stride_h;  // [Lq, D]
      float2* stats = reinterpret_cast<float2*>(p.stats) + ((b * p.N + n) * p.H + h) * p.Lq;               // [Lq]
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float sum = quad_sum(row_sum_s[mt][r]);
          const float inv = sum > 0.f ? 1.f / sum : 0.f;
          const int row = m0 + warp_row0 + mt * 16 + g + 8 * r;
          if (row < p.Lq) {
            Element* orow = out + int64_t(row) * p.o_stride_l;
#pragma unroll
            for (int dt = 0; dt < kDTiles; ++dt) {
              const int d = dt * 8 + 2 * t;
              if (d < p.D)
                *reinterpret_cast<uint32_t*>(orow + d) =
                    pack2<Element>(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv);
            }
            if (t == 0)
              stats[row] = sum > 0.f ? make_float2(row_max_s[mt][r], __log2f(sum)) : make_float2(0.f, kInf);
          }
        }
    }
    __syncthreads();  // the next step's copies overwrite this stage
  }
}

template <typename Element, int kHeadDim, int kPair>
void launch_forward(const AttentionParams& params, cudaStream_t stream) {
  using Cfg = ForwardConfig<Element, kHeadDim, kPair>;
  AttentionParams p = params;
  const int n_key_blocks = (p.Lk + Cfg::kBlockN - 1) / Cfg::kBlockN;
  const int64_t n_query_blocks = (p.Lq + Cfg::kBlockM - 1) / Cfg::kBlockM;
  p.fwd_pair_resident = kPair != kNoPair && Cfg::smem_bytes(true, n_key_blocks) <= Cfg::kResidentBudget;
  // Rows per CTA: enough CTAs for about two waves of two CTAs per SM, the rest as rows per CTA.
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    check_launch("evoformer forward (device attributes)");
  const int64_t per_group = int64_t(p.B) * p.H * n_query_blocks;
  const int64_t groups = std::max<int64_t>(1, std::min<int64_t>(p.N, (4 * int64_t(sms) + per_group - 1) / per_group));
  p.fwd_n_group = int((p.N + groups - 1) / groups);
  const int64_t n_groups = (p.N + p.fwd_n_group - 1) / p.fwd_n_group;
  const int smem = Cfg::smem_bytes(p.fwd_pair_resident, n_key_blocks);

  auto kernel = forward_kernel<Cfg>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
    check_launch("evoformer forward (shared-memory attribute)");
  const dim3 grid(unsigned(int64_t(p.B) * n_groups * n_query_blocks), unsigned(p.H));
  kernel<<<grid, Cfg::kThreads, smem, stream>>>(p);
  check_launch("evoformer forward");
}

}  // namespace evoformer
