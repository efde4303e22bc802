// The triangle multiplication's fused input kernel on Hopper (sm_90a): the function, passes and
// outputs of triangle_input_kernel (triangle_input.cuh), with each pass's product on the warpgroup
// tensor-core instruction (wgmma) reading both operands from shared memory.
//
// Why: the mma.sync kernel spends about a fifth of its instructions on ldmatrix and mma.sync (eight
// warps each reload a pass's 64 weight columns into registers) and stalls on their fixed-latency
// dependencies; wgmma takes A (the x_hat tile) and B (the pass's weights) straight from shared
// memory, one instruction per 64 x 128 x 16 step per warpgroup, and leaves the registers and issue
// slots to the layer norm and the epilogues of the other CTA on the SM.
//
// CTA: 256 threads = two warpgroups, kTriInRows = 128 positions; warpgroup wg takes rows
// 64 wg.., warp w of it rows 16 w.. of those and all 128 columns of a pass (its accumulators are
// sixteen n8 tiles of {(g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)}, the mma.sync C layout).
// An edge pass's columns are (projections of slot 2q, their gates, projections of slot 2q + 1, their
// gates), so tile nt and tile nt + 4 of each half pair a projection with its gate in one thread.
//
// Shared memory (1024-byte aligned, as the swizzles need): the z / x_hat tile [128, kK] and two
// weight buffers [128, kK], both in CuTe's K-major GMMA layouts (128-byte swizzle); a buffer whose
// pass is multiplied takes the pass's staged results ([64 channels, 128 positions] or [128
// positions, 128 columns], pitch kTriInStagePitch), so a buffer is sized for the larger of the two,
// plus the pass's 128 biases, copied with its weights (read from global memory in the epilogue,
// after the product, their latency was a seventh of the kernel's stalls).
// c_z 128: 106 KB, two CTAs per SM (c_z 256: one). The copies are cp.async (generic proxy): every thread fences
// its copies and its layer-norm stores to the async proxy before the barrier that precedes a wgmma.
//
// The kernel is bound by issue and latency (ncu at N_res 768, c_z 128: 53 % of issue slots used,
// 0.95 eligible warps per scheduler, integer/logic the busiest pipe), not by DRAM (43 %), so its
// instructions count: the epilogues stage their results with stmatrix (an edge slot's gated values
// packed in channel pairs and stored transposed, four instructions instead of 32 two-byte stores; a
// g pass eight instead of 32), the first k-step of a pass overwrites the accumulators (no zeroing),
// and the weight rows' swizzled offsets are computed once. 197.6 M -> 170.1 M warp instructions,
// 0.42 -> 0.37 ms at N_res 768 (H100); bfloat16 gates on one tanh each (sigmoid_gated) then took
// it to 0.35-0.36 ms. Compiled a second time without bounds checks (kWhole: whole slots and
// columns, the common case; 118 M instructions) it takes 0.30 ms at N_res 768. A persistent
// variant (one CTA per SM walking the tiles, the next tile's z and the weights two passes ahead in
// flight) took 0.62 ms: with eight warps per SM each pass's product, epilogue and stores run back
// to back; two persistent CTAs per SM matched this kernel (0.43 ms), so the launches and tile
// prologues cost nothing measurable.
#pragma once

#include <cutlass/arch/barrier.h>

#include "common/sm90_layouts.cuh"
#include "triangle_multiplication/resident_sm90.cuh"
#include "triangle_multiplication/triangle_input.cuh"

namespace evoformer {
namespace block {

template <typename T, int kKSteps>
struct TriangleInputSm90Tile {
  static constexpr int kK = 16 * kKSteps;
  using LayoutX = typename sm90::RowTileLayouts<T, kTriInRows, kK>::RowMajor;      // [positions, kK]
  using LayoutW = typename sm90::RowTileLayouts<T, kTriInPassCols, kK>::RowMajor;  // [columns, kK]
  // One warpgroup's pass: [64, 128] = x_hat [64, kK] . weights [128, kK]^T
  using Mma = sm90::SsMma<T, kTriInPassCols, kK>;
  static constexpr int kStageBytes = kTriInPassCols * kTriInStagePitch * int(sizeof(T));
  static constexpr int kWeightBytes = kTriInPassCols * kK * int(sizeof(T));
  static constexpr int kXBytes = sm90::smem_align(kTriInRows * kK * int(sizeof(T)));
  // a buffer's pass biases (128 floats, or 128 values of T for a g pass) after its weights / stage
  static constexpr int kBiasOffset = kWeightBytes > kStageBytes ? kWeightBytes : kStageBytes;
  static constexpr int kBufferBytes = sm90::smem_align(kBiasOffset + kTriInPassCols * 4);
  static constexpr int kSmemBytes = sm90::kSmemAlign + kXBytes + 2 * kBufferBytes;  // + base alignment
  static_assert(kSmemBytes <= 227 * 1024, "a CTA's shared memory must fit an SM (227 KB)");
  static constexpr int kMinBlocksPerSM = sm90::ctas_per_sm(kSmemBytes, 2);  // c_z 256: one (no register cap)
};

// Starts the copy of pass q's biases into `bias` (joining the cp.async group the weight copy then
// commits): an edge pass's [slot 2q + h][projection, gate][32 channels] floats of b_ab (threads 0-31,
// 4 channels each), a g pass's 128 values of b_g from column n0 (threads 0-15, 8 each); zeros past
// C or G. b_ab and b_g are 16-byte aligned (the host checks). kWhole: C % 32 == 0 (every slot whole).
template <typename T, bool kWhole, typename Params>
__device__ __forceinline__ void triangle_input_load_bias(const Params& p, void* bias, int q) {
  const int tid = int(threadIdx.x), blocks = edge_blocks(p.C);
  if (q < blocks) {
    if (tid >= 32) return;
    const int h = tid / 16, s = tid / 8 % 2, c = tid % 8 * 4;
    const EdgeSlot slot(2 * q + h, blocks);
    const bool ok = kWhole || (slot.edge < 2 && slot.ch0 + c < p.C);
    const float* src = p.b_ab + (ok ? int64_t(2 * slot.edge + s) * p.c_rows + slot.ch0 + c : 0);
    cp_async_16(static_cast<float*>(bias) + tid * 4, src, ok);
  } else if (tid < kTriInPassCols / 8) {
    const int n = (q - blocks) * kTriInPassCols + tid * 8;
    const bool ok = n < p.G;
    cp_async_16(static_cast<T*>(bias) + tid * 8, static_cast<const T*>(p.b_g) + (ok ? n : 0), ok);
  }
}

// stage_gated_slot for one warpgroup's accumulators (kMTiles = 1), the same values packed in pairs of
// channels and stored transposed (stmatrix) as 16-byte runs of positions in the channel rows:
// four instructions per slot instead of 32 two-byte stores. `stage` points at the slot's first
// staged row and the warp's first position (16 positions per warp). kWhole (C % 32 == 0): no channel
// is past C, and a thread's two adjacent channels' biases come in one 8-byte load each.
// kPitch: elements between staged rows.
template <typename T, bool kWhole, int kPitch = kTriInStagePitch>
__device__ __forceinline__ void stage_gated_slot_sm90(const TriangleInputParams& p, const EdgeSlot& slot,
                                                      const float* bias_proj, const float* bias_gate,
                                                      const float (*acc)[4], const float (&mask)[1][2], T* stage,
                                                      int lane) {
  if (!kWhole && slot.edge >= 2) return;
  const int t = lane % 4;
  uint32_t packed[4][2];  // [tile nt][half hh]: channels nt * 8 + 2 t, + 1 at position g + 8 hh
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    float bp[2], bg[2];  // [e]: the biases of channels slot.ch0 + nt * 8 + 2 t + e
    if constexpr (kWhole) {
      const float2 p2 = *reinterpret_cast<const float2*>(bias_proj + nt * 8 + 2 * t);
      const float2 g2 = *reinterpret_cast<const float2*>(bias_gate + nt * 8 + 2 * t);
      bp[0] = p2.x, bp[1] = p2.y, bg[0] = g2.x, bg[1] = g2.y;
    } else {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = nt * 8 + 2 * t + e;
        bp[e] = slot.ch0 + c < p.C ? bias_proj[c] : 0.f;
        bg[e] = slot.ch0 + c < p.C ? bias_gate[c] : 0.f;
      }
    }
    float v[2][2];  // [hh][e]
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = 2 * hh + e;
        v[hh][e] = sigmoid_gated<T>(acc[4 + nt][i], bg[e], acc[nt][i] + bp[e], mask[0][hh]);
      }
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) packed[nt][hh] = pack2<T>(v[hh][0], v[hh][1]);
  }
  // lane l addresses stored row l % 8 (channel nt * 8 + l % 8) of tile l / 8 = (nt pair, hh)
  const int tile = lane / 8, k = lane % 8;
#pragma unroll
  for (int pair = 0; pair < 2; ++pair) {
    const int nt = 2 * pair + tile / 2, hh = tile % 2;
    stsm_x4_trans(stage + (nt * 8 + k) * kPitch + 8 * hh, packed[2 * pair][0], packed[2 * pair][1],
                      packed[2 * pair + 1][0], packed[2 * pair + 1][1]);
  }
}

// A g product's columns plus their biases, staged as rows of positions by stmatrix: kPairs pairs of
// n8 accumulator tiles acc[0 .. 2 kPairs) (tile (nt, hh): positions g + 8 hh, columns nt * 8 + 2 t, + 1),
// bias[nt * 8 + 2 t, + 1] (values of T). lane_stage: the lane's stmatrix row, position
// l % 8 + 8 (l / 8 % 2) of its warp's 16 and column 8 (l / 16) of the first pair (lane l addresses row
// l % 8 of tile l / 8 of each group of four); pair j at + 16 j.
template <typename T, int kPairs>
__device__ __forceinline__ void stage_g_columns_sm90(const float (*acc)[4], const T* bias, T* lane_stage, int t) {
#pragma unroll
  for (int pair = 0; pair < kPairs; ++pair) {
    uint32_t packed[2][2];  // [nt of the pair][hh]
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int nt = 2 * pair + u;
      const float b0 = float(bias[nt * 8 + 2 * t]), b1 = float(bias[nt * 8 + 2 * t + 1]);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) packed[u][hh] = pack2<T>(acc[nt][2 * hh] + b0, acc[nt][2 * hh + 1] + b1);
    }
    stsm_x4(lane_stage + pair * 16, packed[0][0], packed[0][1], packed[1][0], packed[1][1]);
  }
}

// kWhole: C % 32 == 0, K == 16 kKSteps and p.vector_ok (the common case: c_z and c multiples of 32,
// N_res^2 a multiple of 8), compiled without the bounds checks on channels, columns and stores.
template <typename T, int kKSteps, bool kWhole>
__global__ void __launch_bounds__(kTriInThreads, (TriangleInputSm90Tile<T, kKSteps>::kMinBlocksPerSM))
    triangle_input_sm90_kernel(TriangleInputParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Tile = TriangleInputSm90Tile<T, kKSteps>;
  extern __shared__ __align__(16) char tri_in90_smem[];
  char* const smem = sm90::aligned_smem(tri_in90_smem);
  T* const xs = reinterpret_cast<T*>(smem);  // LayoutX: z, then x_hat
  auto buffer = [&](int i) { return reinterpret_cast<T*>(smem + Tile::kXBytes + i * Tile::kBufferBytes); };
  auto bias_of = [&](int i) { return smem + Tile::kXBytes + i * Tile::kBufferBytes + Tile::kBiasOffset; };
  const auto x_offset = [](int r, int c) { return sm90::swizzled_offset<typename Tile::LayoutX, T>(r, c); };
  // The swizzled offsets of the weight rows this thread copies (rows w_row0 + i * kRowStep at its
  // column chunk: the same for every pass), computed once instead of per pass.
  constexpr int kRowStep = kTriInThreads / (Tile::kK / 8);
  const int w_row0 = int(threadIdx.x / unsigned(Tile::kK / 8));
  int w_offsets[kTriInPassCols / kRowStep];
#pragma unroll
  for (int i = 0; i < kTriInPassCols / kRowStep; ++i)
    w_offsets[i] = sm90::swizzled_offset<typename Tile::LayoutW, T>(w_row0 + i * kRowStep,
                                                                     int(threadIdx.x % unsigned(Tile::kK / 8)) * 8);
  const auto w_offset = [&](int r, int) { return w_offsets[(r - w_row0) / kRowStep]; };
  // pass q's weights and biases into buffer q % 2 (one cp.async group)
  const auto load_pass = [&](int q) {
    triangle_input_load_bias<T, kWhole>(p, bias_of(q % 2), q);
    triangle_input_load_weights<T, kKSteps, kWhole>(p, buffer(q % 2), q, w_offset);
  };

  const int64_t m0 = int64_t(blockIdx.x) * kTriInRows;
  const int valid_rows = int(p.M - m0 < kTriInRows ? p.M - m0 : kTriInRows);
  const int blocks = edge_blocks(p.C);  // = edge passes
  const int passes = blocks + (p.G + kTriInPassCols - 1) / kTriInPassCols;

  // z tile (group 0), the first two passes' weights (groups 1, 2)
  sm90::SwizzledTileCopy<kTriInRows, Tile::kK, kTriInThreads>(threadIdx.x, x_offset)(
      xs, static_cast<const T*>(p.z) + m0 * p.z_stride, p.z_stride, valid_rows, p.K);
  cp_async_commit();
  load_pass(0);
  if (passes > 1) load_pass(1);
  else cp_async_commit();  // (an empty group: the waits below count three)

  // the mask of the thread's two rows, read while the copies land
  const int lane = threadIdx.x % 32u, g = lane / 4, t = lane % 4;
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128u), 0);  // warp-uniform
  const int row0 = wg * 64 + int(threadIdx.x % 128u) / 32 * 16 + g;  // the thread's rows: row0, row0 + 8
  float mask[1][2];
  row_pair_mask_sm90<T>(mask, p.mask, m0, row0, valid_rows);

  cp_async_wait<2>();
  __syncthreads();
  triangle_input_normalise<T, Tile::kK, kWhole>(p, xs, x_offset, m0, valid_rows);

  typename Tile::Mma mma;
  auto thr = mma.get_thread_slice(threadIdx.x % 128u);
  Tensor sX = make_tensor(make_smem_ptr(xs), typename Tile::LayoutX{});
  Tensor tXr = thr.partition_fragment_A(local_tile(sX, Shape<_64, Int<Tile::kK>>{}, make_coord(wg, 0)));
  Tensor tAcc = partition_fragment_C(mma, Shape<_64, Int<kTriInPassCols>>{});
  static_assert(size(tAcc) == kTriInPassCols / 2, "sixteen n8 accumulator tiles per thread");
  float(&acc)[kTriInPassCols / 8][4] = *reinterpret_cast<float(*)[kTriInPassCols / 8][4]>(raw_pointer_cast(tAcc.data()));

  // Stores pass q's staged results (in buffer q % 2) to a, b or g.
  const auto store_pass = [&](int q) {
    if (q < blocks) triangle_input_store_edges<T, kWhole>(p, buffer(q % 2), 2 * q, m0, valid_rows);
    else triangle_input_store_g<T>(p, buffer(q % 2), (q - blocks) * kTriInPassCols, m0, valid_rows);
  };

  // Pass q: its product runs on the tensor cores while the threads store pass q - 1's staged results;
  // then pass q + 1's weights go into the buffer those results leave, and pass q's epilogue stages
  // its results in the buffer its weights leave. Two CTA barriers per pass.
  for (int q = 0; q < passes; ++q) {
    T* const wbuf = buffer(q % 2);
    if (q == 0) cp_async_wait<1>();  // (pass 1's copies may still run)
    else cp_async_wait<0>();
    cutlass::arch::fence_view_async_shared();  // this thread's copies (and x_hat stores) -> tensor cores
    __syncthreads();  // pass q's weights and x_hat are in shared memory, pass q - 1's results staged

    Tensor tWr = thr.partition_fragment_B(make_tensor(make_smem_ptr(wbuf), typename Tile::LayoutW{}));
    warpgroup_fence_operand(tAcc);
    warpgroup_arrive();
    mma.accumulate_ = GMMA::ScaleOut::Zero;  // the first k-step overwrites the accumulators (no zeroing)
#pragma unroll
    for (int kk = 0; kk < size<2>(tXr); ++kk) {
      gemm(mma, tXr(_, _, kk), tWr(_, _, kk), tAcc);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    if (q > 0) store_pass(q - 1);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tAcc);
    __syncthreads();  // pass q's weights and pass q - 1's staged results are read: both buffers are free
    if (q > 0 && q + 1 < passes) load_pass(q + 1);  // (pass 1 was copied with pass 0)

    if (q < blocks) {
      // edge pass: half h of the columns is slot 2q + h; its tiles 8h.. are projections, 8h + 4.. gates.
      // Staged [64 rows (the two slots' channels), 128 positions].
      const float* const bias = reinterpret_cast<const float*>(bias_of(q % 2));  // [h][proj, gate][32]
#pragma unroll
      for (int h = 0; h < 2; ++h)
        stage_gated_slot_sm90<T, kWhole>(p, EdgeSlot(2 * q + h, blocks), bias + 64 * h, bias + 64 * h + 32, acc + 8 * h,
                                 mask, wbuf + h * kTriInSlot * kTriInStagePitch + (row0 - g), lane);
    } else {
      // g pass: columns n0.. of g, plus their bias; staged [128 positions, 128 columns] by stmatrix
      const T* const bias = reinterpret_cast<const T*>(bias_of(q % 2));  // [128] from column n0, zeros past G
      stage_g_columns_sm90<T, kTriInPassCols / 16>(
          acc, bias, wbuf + (row0 - g + lane % 8 + 8 * (lane / 8 % 2)) * kTriInStagePitch + 8 * (lane / 16), t);
    }
  }
  __syncthreads();  // the last pass's results are staged
  store_pass(passes - 1);
#endif
}


// The AF2/AF3 widths (c_z = c = G = 128: four edge passes and one g pass) on a persistent grid, one
// CTA per SM, with every pass's weights resident in shared memory for the CTA's life and three
// warpgroups working apart: warpgroup wg takes 64-position tiles 3 blockIdx.x + wg, + 3 gridDim.x, ...
// with a z tile and a staging area of its own, so it never waits for the others, whose layer norms,
// epilogues and stores fill the SM while its products run.
//
// A warpgroup normalises its tile into registers, where its products read it (wgmma with A in
// registers, 32 per thread): the z tile is read once, by ldmatrix in the A operand's layout, and the
// next tile's z is copied into it while this tile's products run. A pass is two products of 64
// columns (an edge slot's 32 projections and their gates, or half of g), each followed by its
// epilogue; product i + 1 runs while product i's epilogue and stores do (two accumulator sets of 32).
//
// Why (benchmarks/DESIGN.md, the triangle paragraph): with two warpgroups and x_hat in shared memory
// each warpgroup's tile took 13.6k cycles at N_res 1024, of which the z wait (1.4k) and the layer norm
// (2.5k) ran beside no product of its own, and a third warpgroup fitted neither the registers (two
// 128-column accumulator sets: 186 per thread) nor the shared memory (an x_hat tile of 16 KB beside
// the z tile). Here x_hat needs no shared memory, the z copy has a whole tile to land, and products of
// 64 columns halve the accumulators.
//
// Shared memory: the five passes' weights [128 columns, 128] (LayoutW, 160 KB), per warpgroup a z tile
// [64, 128] (LayoutZ, 16 KB) and a staging area (an edge slot [32 channels, 64 positions] or a quarter
// of g [64 positions, 32 columns]), the biases: 231,936 bytes with the alignment.
template <typename T>
struct TriangleInputResidentTile {
  static constexpr int kK = 128, kKSteps = kK / 16, kEdgePasses = 4, kPasses = kEdgePasses + 1;
  static constexpr int kCols = 64;                  // columns per product
  static constexpr int kProducts = 2 * kPasses;     // product i: edge slot i (i < 8), then g's halves
  static constexpr int kRows = 64;                  // positions per warpgroup tile
  static constexpr int kWarpgroups = 3, kThreads = 128, kCtaThreads = kWarpgroups * kThreads;
  static constexpr int kEdgePitch = kRows + 8;      // elements per staged channel row of an edge slot
  static constexpr int kGCols = 32, kGPitch = kGCols + 8;  // a staged quarter of g: columns, pitch
  using LayoutZ = typename sm90::RowTileLayouts<T, kRows, kK>::RowMajor;
  using LayoutW = typename sm90::RowTileLayouts<T, kTriInPassCols, kK>::RowMajor;
  using Mma = sm90::RsMma<T, kCols, kK>;  // [64, 64] = x_hat [64, kK] (registers) . weights [64, kK]^T
  static constexpr int kWeightBytes = kTriInPassCols * kK * int(sizeof(T));
  static constexpr int kZBytes = kRows * kK * int(sizeof(T));
  static constexpr int kStageElems =
      kTriInSlot * kEdgePitch > kRows * kGPitch ? kTriInSlot * kEdgePitch : kRows * kGPitch;
  static constexpr int kStageBytes = kStageElems * int(sizeof(T));
  static constexpr int kBiasBytes = kTriInPassCols * 4;  // a pass's biases (floats; a g pass's in T)
  static constexpr int kZOffset = kPasses * kWeightBytes;
  static constexpr int kStageOffset = kZOffset + kWarpgroups * kZBytes;
  static constexpr int kBiasOffset = kStageOffset + kWarpgroups * kStageBytes;
  static constexpr int kSmemBytes = sm90::kSmemAlign + kBiasOffset + kPasses * kBiasBytes;
  static_assert(kSmemBytes <= 227 * 1024, "a CTA's shared memory must fit an SM (227 KB)");
  static_assert(kZBytes % sm90::kSmemAlign == 0 && kWeightBytes % sm90::kSmemAlign == 0, "aligned tiles");
  static_assert(kStageBytes % 16 == 0, "16-byte aligned staging areas");
};

// Whether triangle_input_sm90_resident_kernel runs p: the widths it is built for, whole 16-byte stores.
inline bool triangle_input_resident(const TriangleInputParams& p) {
  return p.K == 128 && p.C == 128 && p.G == 128 && p.c_rows == p.C && p.vector_ok;
}

// Normalises a warpgroup's tile rows held in the wgmma A layout (xa[kk]: rows r, r + 8 at columns
// 16 kk + 2 t, + 1 in registers 0, 1 and at + 8, + 9 in registers 2, 3; the four lanes of a quad hold
// a row), in place: x_hat = (z - mean) * rstd, rounded to T; mean and rstd per row into mean[2], rstd[2].
template <typename T, int kKSteps>
__device__ __forceinline__ void normalise_a_rows(uint32_t (&xa)[kKSteps][4], float (&mean)[2], float (&rstd)[2],
                                                 float eps) {
  constexpr float kInvK = 1.f / float(16 * kKSteps);
  float sum[2] = {0.f, 0.f}, sq[2] = {0.f, 0.f};
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = unpack2<T>(xa[kk][i]);
      sum[i % 2] += v.x + v.y;
    }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) mean[hh] = segment_sum(sum[hh], 4) * kInvK;
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = unpack2<T>(xa[kk][i]);
      sq[i % 2] += (v.x - mean[i % 2]) * (v.x - mean[i % 2]) + (v.y - mean[i % 2]) * (v.y - mean[i % 2]);
    }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) rstd[hh] = rsqrtf(segment_sum(sq[hh], 4) * kInvK + eps);
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = unpack2<T>(xa[kk][i]);
      xa[kk][i] = pack2<T>((v.x - mean[i % 2]) * rstd[i % 2], (v.y - mean[i % 2]) * rstd[i % 2]);
    }
}

template <typename T>
__global__ void __launch_bounds__(TriangleInputResidentTile<T>::kCtaThreads, 1)
    triangle_input_sm90_resident_kernel(TriangleInputParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Tile = TriangleInputResidentTile<T>;
  extern __shared__ __align__(16) char tri_res_smem[];
  char* const smem = sm90::aligned_smem(tri_res_smem);
  T* const weights = reinterpret_cast<T*>(smem);
  char* const biases = smem + Tile::kBiasOffset;
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128u), 0);  // warp-uniform
  const int tid = int(threadIdx.x % 128u), lane = tid % 32, g = lane / 4, t = lane % 4;
  const int row0 = tid / 32 * 16 + g;  // the thread's rows of its warpgroup's tile: row0, row0 + 8
  T* const zs = reinterpret_cast<T*>(smem + Tile::kZOffset + wg * Tile::kZBytes);
  T* const stage = reinterpret_cast<T*>(smem + Tile::kStageOffset + wg * Tile::kStageBytes);
  const auto wg_sync = [wg] { asm volatile("bar.sync %0, %1;" ::"r"(1 + wg), "r"(Tile::kThreads) : "memory"); };
  const auto z_offset = [](int r, int c) { return sm90::swizzled_offset<typename Tile::LayoutZ, T>(r, c); };
  const sm90::SwizzledTileCopy<Tile::kRows, Tile::kK, Tile::kThreads> z_copy(tid, z_offset);

  const int64_t n_tiles = (p.M + Tile::kRows - 1) / Tile::kRows;
  const int64_t tile_step = Tile::kWarpgroups * int64_t(gridDim.x);
  // starts the copy of tile `tile`'s z rows into zs (one cp.async group, empty past the last tile)
  const auto load_z = [&](int64_t tile) {
    start_row_tile_copy<Tile::kRows>(z_copy, zs, static_cast<const T*>(p.z), p.z_stride, p.M, tile, n_tiles, p.K);
  };

  // every pass's weights and biases (five groups, by the loaders' kTriInThreads threads), then the
  // first tile's z
  if (threadIdx.x < unsigned(kTriInThreads)) {
#pragma unroll 1
    for (int q = 0; q < Tile::kPasses; ++q) {
      triangle_input_load_bias<T, true>(p, biases + q * Tile::kBiasBytes, q);
      triangle_input_load_weights<T, Tile::kKSteps, true>(
          p, weights + q * (Tile::kWeightBytes / int(sizeof(T))), q,
          [](int r, int c) { return sm90::swizzled_offset<typename Tile::LayoutW, T>(r, c); });
    }
  }
  int64_t tile = Tile::kWarpgroups * int64_t(blockIdx.x) + wg;
  load_z(tile);
  cp_async_wait<0>();
  cutlass::arch::fence_view_async_shared();  // this thread's weight copies -> tensor cores
  __syncthreads();  // the weights and biases every thread copied (the last CTA-wide barrier)

  typename Tile::Mma mma;
  auto thr = mma.get_thread_slice(tid);
  // x_hat as the products' A operand, two 16-bit values per register: xa[kk] is k-step kk's
  // (row0, 16 kk + 2 t), (row0 + 8, ..), (row0, 16 kk + 8 + 2 t), (row0 + 8, ..), the mma.sync A layout
  auto tXr = make_a_fragment_sm90<Tile::kRows, Tile::kK, T>(thr);
  static_assert(size(tXr) == Tile::kK / 2, "a thread's x_hat: two rows of 32 columns");
  uint32_t(&xa)[Tile::kKSteps][4] = *reinterpret_cast<uint32_t(*)[Tile::kKSteps][4]>(raw_pointer_cast(tXr.data()));
  Tensor acc0 = partition_fragment_C(mma, Shape<Int<Tile::kRows>, Int<Tile::kCols>>{});
  Tensor acc1 = partition_fragment_C(mma, Shape<Int<Tile::kRows>, Int<Tile::kCols>>{});
  static_assert(size(acc0) == Tile::kCols / 2, "eight n8 accumulator tiles per thread");
  // product i into acc: slot i's or half i - 8 of g's columns (rows 64 (i % 2).. of pass i / 2's weights)
  const auto issue = [&](int i, auto& acc) {
    issue_half_pass_sm90<typename Tile::LayoutW, Tile::kCols, Tile::kK>(mma, thr, tXr, acc, weights, i);
  };

#pragma unroll 1
  for (; tile < n_tiles; tile += tile_step) {
    const int64_t m0 = tile * Tile::kRows;
    const int valid_rows = int(p.M - m0 < Tile::kRows ? p.M - m0 : Tile::kRows);
    cp_async_wait<0>();
    wg_sync();  // the tile's z rows (every thread's copies)
    load_a_rows_sm90<typename Tile::LayoutZ>(xa, zs, tid / 32, lane);
    float mask[1][2];
    row_pair_mask_sm90<T>(mask, p.mask, m0, row0, valid_rows);
    wg_sync();  // every warp has its rows: the next tile's z goes where they were
    load_z(tile + tile_step);
    {
      float mean[2], rstd[2];
      normalise_a_rows<T>(xa, mean, rstd, p.eps);
      if (t == 0)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          if (row0 + 8 * hh < valid_rows) p.mean[m0 + row0 + 8 * hh] = mean[hh], p.rstd[m0 + row0 + 8 * hh] = rstd[hh];
    }

    // Product i's epilogue from acc. Edge slot i: gated values staged [32 channels, 64 positions],
    // stored as channel rows of a or b. g columns 64 u.. (i = 8 + u) plus their bias: staged in two
    // quarters [64 positions, 32 columns] by stmatrix, stored as rows of g. The staging area is free
    // again after each store's second barrier.
    const auto epilogue = [&](int i, auto& acc_tensor) {
      warpgroup_fence_operand(acc_tensor);
      float(&acc)[Tile::kCols / 8][4] =
          *reinterpret_cast<float(*)[Tile::kCols / 8][4]>(raw_pointer_cast(acc_tensor.data()));
      if (i < 2 * Tile::kEdgePasses) {
        // [h][proj, gate][32] of pass i / 2; this slot's half h = i % 2
        const float* const bias = reinterpret_cast<const float*>(biases + (i / 2) * Tile::kBiasBytes) + 64 * (i % 2);
        stage_gated_slot_sm90<T, true, Tile::kEdgePitch>(p, EdgeSlot(i, Tile::kEdgePasses), bias, bias + kTriInSlot,
                                                         acc, mask, stage + (row0 - g), lane);
        wg_sync();
        triangle_input_store_edges<T, true, Tile::kRows, Tile::kThreads, Tile::kEdgePitch, 1>(p, stage, i, m0,
                                                                                               valid_rows, tid);
        wg_sync();
      } else {
        const int u = i - 2 * Tile::kEdgePasses;
        const T* const bias = reinterpret_cast<const T*>(biases + Tile::kEdgePasses * Tile::kBiasBytes) + Tile::kCols * u;
        T* const lane_stage = stage + (row0 - g + lane % 8 + 8 * (lane / 8 % 2)) * Tile::kGPitch + 8 * (lane / 16);
#pragma unroll
        for (int v = 0; v < Tile::kCols / Tile::kGCols; ++v) {
          stage_g_columns_sm90<T, Tile::kGCols / 16>(acc + Tile::kGCols / 8 * v, bias + Tile::kGCols * v, lane_stage, t);
          wg_sync();
          triangle_input_store_g<T, Tile::kRows, Tile::kGCols, Tile::kThreads, Tile::kGPitch>(
              p, stage, Tile::kCols * u + Tile::kGCols * v, m0, valid_rows, tid);
          wg_sync();
        }
      }
    };

    run_products_sm90<Tile::kProducts>(issue, epilogue, acc0, acc1);  // (x_hat's registers are then free)
  }
  cp_async_wait<0>();  // (the empty group past the last tile)
#endif
}

}  // namespace block
}  // namespace evoformer
