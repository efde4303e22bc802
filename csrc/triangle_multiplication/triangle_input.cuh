// The input half of the triangle multiplicative update in one kernel: the layer norm of z, the
// projections and gates of both edges and the output gate's projection (AF2 Algorithms 11/12,
// lines 1-4; the layer norm's affine parameters are folded into the weights on the host).
//
//   x_hat = normalise(z)                                       [M, K] (K = c_z), in shared memory only
//   a[c, m] = mask[m] * sigmoid(x_hat W_ag[c]^T + b_ag[c]) * (x_hat W_ap[c]^T + b_ap[c])   (b likewise)
//   g[m, n] = x_hat W_g[n]^T + b_g[n]
//
// a, b are written channel-major [C, M] (the triangle products' batched GEMMs read them so) and g
// row-major [M, G]; mean and rstd [M] of every row are written for the backward. In HBM this reads
// z once and writes a, b and g once: x_hat, the [4C, M] projections before their gates and the
// gates' inputs never leave the chip.
//
// CTA: 256 threads, kRows = 128 positions. The z tile is copied (cp.async) into shared memory and
// normalised there (two lanes per row, two passes in float32, rounded to T as the tensor cores read
// it). The output columns then run in passes of 128 through the same x_hat tile. The edges' channels
// are cut into slots of 32 (slot = edge * blocks + block, blocks = ceil(C / 32)); edge pass q covers
// slots 2q and 2q + 1, its columns ordered (projections of slot 2q, their gates, projections of slot
// 2q + 1, their gates), so that in each of the two column halves a warp can own every projection
// value pairs with its gate value in the same thread, and no pass is half empty when C is a
// multiple of 32 but not of 64. A g pass covers 128 columns of g. The weight rows of pass q + 1 are
// copied while pass q multiplies (two buffers). Warps: 4 row groups of 32 x 2 column halves of 64,
// mma.sync m16n8k16 with fp32 accumulation. The epilogue stages the
// pass's results in the pass's weight buffer (its products are done) and stores them as 16-byte
// rows: channel rows of a / b, position rows of g.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/check_launch.h"
#include "common/mma_sm80.cuh"
#include "common/row_kernels.cuh"
#include "triangle_multiplication/triangle.h"

namespace evoformer {
namespace block {

constexpr int kTriInRows = 128;      // positions per CTA
constexpr int kTriInPassCols = 128;  // output columns per pass
constexpr int kTriInThreads = 256;
constexpr int kTriInSlot = 32;         // channels of one edge per slot; a pass holds two slots
constexpr int kTriInStagePitch = kTriInPassCols + 8;   // elements per staged row (bank-conflict free)

// tanh(x) in one MUFU op (absolute error about 2^-11).
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// One step of sum_rows_scattered: lanes `offset` apart add their halves v[0 .. kHalf) and v[kHalf ..
// 2 kHalf), the lane with `offset` set keeping the upper one, into v[0 .. kHalf). The halves are
// chosen by a bit select (a ?: on the values lets the compiler index the array at run time, in
// local memory).
template <int kHalf, int N>
__device__ __forceinline__ void sum_rows_step(float (&v)[N], int lane, int offset) {
  const uint32_t upper = (lane & offset) != 0 ? 0xffffffffu : 0u;
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    const uint32_t lo = __float_as_uint(v[i]), hi = __float_as_uint(v[i + kHalf]);
    const float send = __uint_as_float((lo & upper) | (hi & ~upper));
    v[i] = __uint_as_float((hi & upper) | (lo & ~upper)) + __shfl_xor_sync(0xffffffffu, send, offset);
  }
}

// Sums v[0 .. N) over the eight lanes g = lane / 4 that share lane % 4 (the rows of an mma.sync
// accumulator column) by a reduce-scatter: afterwards lane g holds the totals of v[g N / 8 .. (g + 1)
// N / 8) in v[0 .. N / 8). 7N / 8 shuffles where every lane's totals would take 3N; one fixed order.
template <int N>
__device__ __forceinline__ void sum_rows_scattered(float (&v)[N], int lane) {
  static_assert(N % 8 == 0, "eight lanes take N / 8 totals each");
  sum_rows_step<N / 2>(v, lane, 16);  // lane bit 4: bit 2 of g
  sum_rows_step<N / 4>(v, lane, 8);
  sum_rows_step<N / 8>(v, lane, 4);
}

// The triangle kernels' sigmoid gates (the edges' and the output's), forward and backward, with s =
// sigmoid(gate + b_g). For bfloat16 s = (1 + tanh((gate + b_g) / 2)) / 2: one MUFU op instead of two,
// and the halves fold into the multiplies around it (up to three instructions fewer per value). Its
// absolute error, about 2^-12, is under a quarter of a bfloat16 ulp at s = 0.5, and the backward
// recomputes s the same way. float16 (three more significant bits) keeps exp2 and a reciprocal.
template <typename T>
constexpr bool kTanhGates = std::is_same_v<T, cutlass::bfloat16_t>;

// mask * s * proj (no bias: pass -0.f, which the compiler drops, as it cannot drop + 0.f)
template <typename T>
__device__ __forceinline__ float sigmoid_gated(float gate, float bias_gate, float proj, float mask) {
  if constexpr (kTanhGates<T>) {
    const float half_mask = 0.5f * mask;
    return fmaf(fast_tanh(fmaf(gate, 0.5f, 0.5f * bias_gate)), half_mask, half_mask) * proj;
  } else {
    return sigmoid(gate + bias_gate) * proj * mask;
  }
}

// s * proj: a gate without bias or mask (the output gate)
template <typename T>
__device__ __forceinline__ float sigmoid_gated(float gate, float proj) {
  return sigmoid_gated<T>(gate, -0.f, proj, 1.f);
}

// d_proj = d * s, d_gate = d * proj * s * (1 - s), for d the masked gradient of the gated value
template <typename T>
__device__ __forceinline__ void sigmoid_gated_backward(float d, float gate, float bias_gate, float proj,
                                                       float& d_proj, float& d_gate) {
  if constexpr (kTanhGates<T>) {
    const float t = fast_tanh(fmaf(gate, 0.5f, 0.5f * bias_gate)), half_d = 0.5f * d;
    d_proj = fmaf(half_d, t, half_d);                   // d (1 + t) / 2
    d_gate = half_d * proj * fmaf(-0.5f * t, t, 0.5f);  // s (1 - s) = (1 - t^2) / 4
  } else {
    const float s = sigmoid(gate + bias_gate);
    d_proj = d * s;
    d_gate = d * proj * s * (1.f - s);
  }
}

template <typename T>
__device__ __forceinline__ void sigmoid_gated_backward(float d, float gate, float proj, float& d_proj, float& d_gate) {
  sigmoid_gated_backward<T>(d, gate, -0.f, proj, d_proj, d_gate);
}

template <int kKSteps>
struct TriangleInputTile {
  static constexpr int kK = 16 * kKSteps;  // c_z rounded up; the columns past c_z are zeros
  static constexpr int kPitch = kK + 8;    // elements per shared-memory row (ldmatrix conflict free)
  static constexpr int kBuffer =           // elements of one weight / staging buffer
      kTriInPassCols * (kPitch > kTriInStagePitch ? kPitch : kTriInStagePitch);
  static constexpr int kSmemElems = kTriInRows * kPitch + 2 * kBuffer;
};

template <typename T, int kKSteps>
constexpr int triangle_input_smem_bytes() {
  return TriangleInputTile<kKSteps>::kSmemElems * int(sizeof(T));
}

// Edge slot `slot`: its edge (0: a, 1: b; 2: past the last slot) and first channel.
// Compares instead of an integer division (a long instruction sequence with a runtime divisor);
// every slot past the last has edge 2.
struct EdgeSlot {
  int edge, ch0;
  __device__ __forceinline__ EdgeSlot(int slot, int blocks)
      : edge(int(slot >= blocks) + int(slot >= 2 * blocks)), ch0((slot - edge * blocks) * kTriInSlot) {}
};

__device__ __forceinline__ int edge_blocks(int C) { return (C + kTriInSlot - 1) / kTriInSlot; }

// Starts the copy of pass q's weight tile [128 rows, kK] into `smem` (one cp.async group), element
// (row, col) at smem + offset_of(row, col) (a padded pitch for mma.sync, a GMMA swizzle for wgmma).
// A thread copies the 16-byte chunk at column `col` of rows row0 + j * kRowStep of each 32-row
// group: group 2h + s of an edge pass holds the projection (s = 0) or gate (s = 1) rows of slot
// 2q + h, a g pass rows n0.. of w_g. Rows past C (or G) are zeros. kWhole: every slot is whole and
// K fills the bucket (C % 32 == 0, K == kK), so no edge row or column needs a bounds check.
template <typename T, int kKSteps, bool kWhole = false, typename Params, typename OffsetOf>
__device__ __forceinline__ void triangle_input_load_weights(const Params& p, T* smem, int q, OffsetOf&& offset_of) {
  using Tile = TriangleInputTile<kKSteps>;
  constexpr int kChunksPerRow = Tile::kK / 8;
  constexpr int kRowStep = kTriInThreads / kChunksPerRow;
  static_assert(32 % kRowStep == 0, "row steps tile the 32-row groups");
  const int col = int(threadIdx.x % unsigned(kChunksPerRow)) * 8;
  const int row0 = int(threadIdx.x / unsigned(kChunksPerRow));
  const bool col_ok = kWhole || col < p.K;
  const int blocks = edge_blocks(p.C);
  if (q < blocks) {
    const T* const w = static_cast<const T*>(p.w_ab) + col;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const EdgeSlot slot(2 * q + h, blocks);
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int j = 0; j < 32 / kRowStep; ++j) {
          const int ch = slot.ch0 + row0 + j * kRowStep;  // the row's channel
          const bool ok = kWhole || (col_ok && slot.edge < 2 && ch < p.C);
          const T* src = w + (int64_t(2 * slot.edge + s) * p.c_rows + ch) * p.K;
          cp_async_16(smem + offset_of((2 * h + s) * 32 + row0 + j * kRowStep, col), ok ? src : w, ok);
        }
    }
  } else {
    const int n0 = (q - blocks) * kTriInPassCols + row0;
    const T* const w = static_cast<const T*>(p.w_g) + int64_t(n0) * p.K + col;
#pragma unroll
    for (int r = 0; r < kTriInPassCols; r += kRowStep) {
      const bool ok = col_ok && n0 + r < p.G;
      cp_async_16(smem + offset_of(row0 + r, col), ok ? w + int64_t(r) * p.K : w, ok);
    }
  }
  cp_async_commit();
}

// The same into the padded [128, kK + 8] tile of the mma.sync kernels.
template <typename T, int kKSteps, typename Params>
__device__ __forceinline__ void triangle_input_load_weights(const Params& p, T* smem, int q) {
  triangle_input_load_weights<T, kKSteps>(p, smem, q,
                                          [](int r, int c) { return r * TriangleInputTile<kKSteps>::kPitch + c; });
}

// acc = A . (pass weights[col_half * 64.., :])^T for one warp: two m16 row tiles x eight n8 column
// tiles, k over kKSteps * 16; a_frags(kk, af) loads the A operands of k-step kk for both row tiles
// (the weight tile is n-major, pitch kK + 8). kBKMajor: acc = A . weights[:, col_half * 64..] instead,
// the tile read as k-major B (rows k, ldmatrix.trans); a column half past the tile's kK columns gets
// zeros.
template <typename T, int kKSteps, bool kBKMajor = false, typename AFrags>
__device__ __forceinline__ void triangle_pass_products(float (&acc)[2][8][4], AFrags&& a_frags, const T* wbuf,
                                                       int col_half, int lane) {
  constexpr int kPitch = TriangleInputTile<kKSteps>::kPitch;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
  if (kBKMajor && col_half * 64 >= TriangleInputTile<kKSteps>::kK) return;
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    uint32_t af[2][kARegs<T>];
    a_frags(kk, af);
#pragma unroll
    for (int n16 = 0; n16 < 4; ++n16) {
      uint32_t bf[2][kBRegs<T>];
      if constexpr (kBKMajor)
        load_b_frags_kmajor<kPitch>(bf, wbuf, kk * 16, col_half * 64 + n16 * 16, lane);
      else
        load_b_frags_nmajor<kPitch>(bf, wbuf, col_half * 64 + n16 * 16, kk * 16, lane);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        mma<T>(acc[mt][2 * n16], af[mt], bf[0]);
        mma<T>(acc[mt][2 * n16 + 1], af[mt], bf[1]);
      }
    }
  }
}

// acc[mt][nt][2 hh + e] += bias[n + e] for the warp's columns n = n0 + col_half * 64 + nt * 8 + 2 t
// (nothing past G, which is even; kWhole: no column is), rounded to T when kRound (the value a T
// tensor keeps).
template <typename T, bool kRound, bool kWhole = false>
__device__ __forceinline__ void add_column_bias(float (&acc)[2][8][4], const T* bias, int n0, int G, int col_half,
                                                int t) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const int n = n0 + col_half * 64 + nt * 8 + 2 * t;
    const bool ok = kWhole || n < G;
    const float b[2] = {ok ? float(bias[n]) : 0.f, ok ? float(bias[n + 1]) : 0.f};
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float v = acc[mt][nt][i] + b[i % 2];
        acc[mt][nt][i] = kRound ? round_to<T>(v) : v;
      }
  }
}

// The same with A = the row-major x_hat tile's rows row_group * 32.. (pitch kK + 8), the weight tile
// n-major or (kBKMajor) k-major.
template <typename T, int kKSteps, bool kBKMajor = false>
__device__ __forceinline__ void triangle_input_pass_products(float (&acc)[2][8][4], const T* xs, const T* wbuf,
                                                             int row_group, int col_half, int lane) {
  constexpr int kPitch = TriangleInputTile<kKSteps>::kPitch;
  const auto a_frags = [&](int kk, uint32_t(&af)[2][kARegs<T>]) {
    uint32_t frags[2][1][kARegs<T>];
    load_a_frags<2, 1, kPitch>(frags, xs + kk * 16, row_group * 32, lane);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int i = 0; i < kARegs<T>; ++i) af[mt][i] = frags[mt][0][i];
  };
  triangle_pass_products<T, kKSteps, kBKMajor>(acc, a_frags, wbuf, col_half, lane);
}

// The mask of the thread's four rows (m tile mt, half hh: row row_group * 32 + mt * 16 + g + 8 hh of
// the CTA's positions from m0); 1 without a mask or past the last row.
template <typename T>
__device__ __forceinline__ void triangle_row_masks(float (&mask)[2][2], const void* mask_ptr, int64_t m0,
                                                   int valid_rows, int row_group, int g) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = row_group * 32 + mt * 16 + g + 8 * hh;
      mask[mt][hh] = mask_ptr != nullptr && r < valid_rows ? float(static_cast<const T*>(mask_ptr)[m0 + r]) : 1.f;
    }
}

// Launches `kernel` on one CTA of kTriInThreads threads per kTriInRows positions of the M positions,
// after raising its dynamic shared-memory limit to smem_bytes; both steps are checked.
template <typename Params>
inline void launch_on_position_tiles(void (*kernel)(Params), const Params& p, int64_t M, int smem_bytes,
                                     cudaStream_t stream, const char* name) {
  allow_dynamic_smem(kernel, smem_bytes, name);
  kernel<<<unsigned((M + kTriInRows - 1) / kTriInRows), kTriInThreads, smem_bytes, stream>>>(p);
  check_launch(name);
}

// Layer norm of the z tile in place (x_hat, no affine: it is folded into the weights), element (r, c)
// at xs + offset_of(r, c); mean and rstd of the valid rows to p.mean / p.rstd. Two lanes per row
// (threads tid = 2 r, 2 r + 1 of those that normalise the tile);
// lane h of the pair reads the 16-byte chunks c with (c / 4) % 2 == h (the pair's two 64-byte runs
// fall on different banks) once into registers, then passes over them three times: sum, squared
// deviations, normalised values written back. kWhole: K == kK (no chunk past K).
template <typename T, int kK, bool kWhole = false, typename OffsetOf>
__device__ __forceinline__ void triangle_input_normalise(const TriangleInputParams& p, T* xs, OffsetOf&& offset_of,
                                                         int64_t m0, int valid_rows, int tid = int(threadIdx.x)) {
  constexpr int kChunks = kK / 16;  // per lane
  const int r = int(unsigned(tid) / 2u), h = int(unsigned(tid) % 2u);  // two lanes per row
  const auto chunk_col = [h](int j) { return ((j / 4) * 8 + h * 4 + j % 4) * 8; };
  const auto chunk = [&](int j) { return xs + offset_of(r, chunk_col(j)); };
  // the lane's chunks, read once and kept as raw bytes (columns past K are zeros, not written back)
  uint4 raw[kChunks];
#pragma unroll
  for (int j = 0; j < kChunks; ++j) raw[j] = *reinterpret_cast<const uint4*>(chunk(j));
  // fn(x, j) for the values x of each chunk j that holds columns below K
  const auto each_chunk = [&](auto&& fn) {
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      if (!kWhole && chunk_col(j) >= p.K) continue;
      Vec<T> x;
      x.unpack(raw[j]);
      fn(x, j);
    }
  };
  float sum = 0.f, sq = 0.f;
  each_chunk([&](Vec<T>& x, int) {
#pragma unroll
    for (int e = 0; e < 8; ++e) sum += x.v[e];
  });
  const float inv_k = 1.f / float(p.K);
  const float mean = segment_sum(sum, 2) * inv_k;
  each_chunk([&](Vec<T>& x, int) {
#pragma unroll
    for (int e = 0; e < 8; ++e) sq += (x.v[e] - mean) * (x.v[e] - mean);
  });
  const float rstd = rsqrtf(segment_sum(sq, 2) * inv_k + p.eps);
  each_chunk([&](Vec<T>& x, int j) {
#pragma unroll
    for (int e = 0; e < 8; ++e) x.v[e] = (x.v[e] - mean) * rstd;
    x.store(chunk(j));
  });
  if (h == 0 && r < valid_rows) p.mean[m0 + r] = mean, p.rstd[m0 + r] = rstd;
}

// An edge pass's gated values of one slot, staged as rows (channels) of [64 channels, 128
// positions] (pitch kTriInStagePitch): a[c, m] = mask * sigmoid(gate + b_g) * (proj + b_p). acc holds
// the slot's tiles of the thread's kMTiles m16 row tiles: projection tile nt of row tile mt at
// acc[8 mt + nt], its gate at acc[8 mt + 4 + nt]; `stage` points at the slot's first staged row and
// the thread's first row (row tile mt at + 16 mt, half hh at + 8 hh). bias_proj / bias_gate [32]:
// the biases of the slot's channels (global or shared memory; read only below C).
template <typename T, int kMTiles>
__device__ __forceinline__ void stage_gated_slot(const TriangleInputParams& p, const EdgeSlot& slot,
                                                 const float* bias_proj, const float* bias_gate,
                                                 const float (*acc)[4], const float (&mask)[kMTiles][2], T* stage,
                                                 int t) {
  if (slot.edge >= 2) return;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = nt * 8 + 2 * t + e;  // channel slot.ch0 + c
      const float bp = slot.ch0 + c < p.C ? bias_proj[c] : 0.f;
      const float bg = slot.ch0 + c < p.C ? bias_gate[c] : 0.f;
      T* const s = stage + (nt * 8 + 2 * t + e) * kTriInStagePitch;
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int i = 2 * hh + e;
          s[mt * 16 + 8 * hh] =
              T(sigmoid_gated<T>(acc[8 * mt + 4 + nt][i], bg, acc[8 * mt + nt][i] + bp, mask[mt][hh]));
        }
    }
}

// Stores the staged [kSlots * 32 channel rows (slots slot0, slot0 + 1, ...), kPositions positions]
// (pitch kPitch) as channel rows of a or b (an edge pass q: slot0 = 2q, two slots): of the kThreads
// threads that store it, thread tid stores 8 positions from `col` of staged rows lr0,
// lr0 + kThreads / (kPositions / 8), ... kWhole: every slot whole (C % 32 == 0) and p.vector_ok.
template <typename T, bool kWhole = false, int kPositions = kTriInRows, int kThreads = kTriInThreads,
          int kPitch = kTriInStagePitch, int kSlots = 2>
__device__ __forceinline__ void triangle_input_store_edges(const TriangleInputParams& p, const T* stage, int slot0,
                                                           int64_t m0, int valid_rows, int tid = int(threadIdx.x)) {
  constexpr int kSpans = kPositions / 8;
  const int blocks = edge_blocks(p.C);
  const int col = int(unsigned(tid) % unsigned(kSpans)) * 8, lr0 = int(unsigned(tid) / unsigned(kSpans));
  if (col >= valid_rows) return;
#pragma unroll
  for (int lr = lr0; lr < kSlots * kTriInSlot; lr += kThreads / kSpans) {
    const EdgeSlot slot(slot0 + lr / kTriInSlot, blocks);
    const int ch = slot.ch0 + lr % kTriInSlot;
    if (!kWhole && (slot.edge >= 2 || ch >= p.C)) continue;
    const T* src = stage + lr * kPitch + col;
    T* dst = static_cast<T*>(slot.edge == 0 ? p.a : p.b) + int64_t(ch) * p.M + m0 + col;
    if (kWhole || p.vector_ok) {  // M % 8 == 0: a whole span
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int e = 0; e < 8 && col + e < valid_rows; ++e) dst[e] = src[e];
    }
  }
}

// Stores a g pass's staged [kRows positions, kCols columns from n0] (pitch kPitch) as rows of g (G is a
// multiple of 8: whole 16-byte spans), by kThreads threads (tid: the thread's index among them).
template <typename T, int kRows = kTriInRows, int kCols = kTriInPassCols, int kThreads = kTriInThreads,
          int kPitch = kTriInStagePitch>
__device__ __forceinline__ void triangle_input_store_g(const TriangleInputParams& p, const T* stage, int n0,
                                                       int64_t m0, int valid_rows, int tid = int(threadIdx.x)) {
  constexpr int kSpans = kCols / 8;
  const int col = int(unsigned(tid) % unsigned(kSpans)) * 8, r0 = int(unsigned(tid) / unsigned(kSpans));
  if (n0 + col >= p.G) return;
#pragma unroll
  for (int r = r0; r < kRows; r += kThreads / kSpans) {
    if (r >= valid_rows) break;
    *reinterpret_cast<uint4*>(static_cast<T*>(p.g) + (m0 + r) * p.G + n0 + col) =
        *reinterpret_cast<const uint4*>(stage + r * kPitch + col);
  }
}

// f(std::integral_constant<int, kKSteps>) for the bucket of K = c_z: 64, 128 or 256 (k-steps of 16).
template <typename F>
inline void by_k_bucket(int K, F&& f) {
  static_assert(limits::kTriangleInputMaxK == 256, "one bucket per c_z range");
  if (K <= 64)
    f(std::integral_constant<int, 4>{});
  else if (K <= 128)
    f(std::integral_constant<int, 8>{});
  else
    f(std::integral_constant<int, 16>{});
}

template <typename T, int kKSteps>
__global__ void __launch_bounds__(kTriInThreads, 2) triangle_input_kernel(TriangleInputParams p) {
  using Tile = TriangleInputTile<kKSteps>;
  constexpr int kPitch = Tile::kPitch;
  extern __shared__ __align__(16) unsigned char tri_in_smem[];
  T* const xs = reinterpret_cast<T*>(tri_in_smem);  // [kRows, kPitch]: z, then x_hat
  T* const ws = xs + kTriInRows * kPitch;           // two [kBuffer] weight / staging buffers
  const int64_t m0 = int64_t(blockIdx.x) * kTriInRows;
  const int valid_rows = int(p.M - m0 < kTriInRows ? p.M - m0 : kTriInRows);
  const int blocks = edge_blocks(p.C);  // = edge passes
  const int passes = blocks + (p.G + kTriInPassCols - 1) / kTriInPassCols;

  // z tile (group 0), the first two passes' weights (groups 1, 2)
  load_tile_async<T, kTriInRows, Tile::kK, kPitch, kTriInThreads>(xs, static_cast<const T*>(p.z) + m0 * p.z_stride,
                                                                  p.z_stride, valid_rows, p.K, threadIdx.x);
  cp_async_commit();
  triangle_input_load_weights<T, kKSteps>(p, ws, 0);
  if (passes > 1) triangle_input_load_weights<T, kKSteps>(p, ws + Tile::kBuffer, 1);
  else cp_async_commit();
  cp_async_wait<2>();
  __syncthreads();

  triangle_input_normalise<T, Tile::kK>(p, xs, [](int r, int c) { return r * kPitch + c; }, m0, valid_rows);

  const int warp = threadIdx.x / 32u, lane = threadIdx.x % 32u;
  const int g = lane / 4, t = lane % 4;
  const int row_group = warp % 4, col_half = warp / 4;  // rows row_group * 32.., columns col_half * 64..
  float mask[2][2];  // of the thread's four rows
  triangle_row_masks<T>(mask, p.mask, m0, valid_rows, row_group, g);

  for (int q = 0; q < passes; ++q) {
    T* const wbuf = ws + (q % 2) * Tile::kBuffer;
    cp_async_wait<1>();
    __syncthreads();  // x_hat (q = 0) and pass q's weights are in shared memory

    float acc[2][8][4];
    triangle_input_pass_products<T, kKSteps>(acc, xs, wbuf, row_group, col_half, lane);
    __syncthreads();  // every warp is done with the weights: the buffer takes the staged results

    if (q < blocks) {
      // edge pass: the warp's column half is slot 2q + col_half; tiles 0-3 projections, 4-7 gates;
      // staged [64 rows (the two slots' channels), 128 positions]
      const EdgeSlot slot(2 * q + col_half, blocks);
      const float* const bias_proj = p.b_ab + 2 * slot.edge * p.c_rows + slot.ch0;
      stage_gated_slot<T, 2>(p, slot, bias_proj, bias_proj + p.c_rows, &acc[0][0], mask,
                             wbuf + col_half * kTriInSlot * kTriInStagePitch + row_group * 32 + g, t);
      __syncthreads();
      triangle_input_store_edges<T>(p, wbuf, 2 * q, m0, valid_rows);
    } else {
      // g pass: columns n0.. of g, plus their bias
      const int n0 = (q - blocks) * kTriInPassCols;
      add_column_bias<T, false>(acc, static_cast<const T*>(p.b_g), n0, p.G, col_half, t);
      T* const stage = wbuf + (row_group * 32 + g) * kTriInStagePitch + col_half * 64 + 2 * t;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh)
            store2<T>(stage + (mt * 16 + 8 * hh) * kTriInStagePitch + nt * 8, acc[mt][nt][2 * hh],
                      acc[mt][nt][2 * hh + 1]);
      __syncthreads();
      triangle_input_store_g<T>(p, wbuf, n0, m0, valid_rows);
    }
    __syncthreads();  // the staged results are stored: the buffer takes pass q + 2's weights
    if (q + 2 < passes) triangle_input_load_weights<T, kKSteps>(p, wbuf, q + 2);
    else cp_async_commit();
  }
}

// ---- backward of the edges ------------------------------------------------------------------------
// Per pass (two slots, as in the forward): the projections and gates are recomputed from the x_hat
// tile (x_hat is an input here: the backward keeps it for the weight gradients), and with
// d = mask * da (or db), s = sigmoid(gate + b_g), proj = ... + b_p:
//   d_proj = d * s,   d_gate = d * proj * s * (1 - s)
// written per position as columns of dab ([M, 4 C], rows dab_ld apart: the host puts dg's columns
// beside the first channel group's, so that one GEMM takes dx_hat's terms of both), and the CTA's
// sum of each column (of the values rounded to T, as the GEMMs that follow read them) into
// bias_part: the lanes of a channel add their four rows, shuffles add the eight lane rows, and the
// four row groups are added in order through shared memory (no atomics: bitwise reproducible).
// Shared memory: the x_hat tile, one weight tile (the next pass's weights are copied while this
// pass's epilogue runs, its da / db rows while its product runs) and one [128, 128] tile whose first
// 64 rows receive the pass's da / db rows (channel-major, as they lie in HBM) and which, once every
// warp has read them, takes d_proj and d_gate per position ([128 positions, 64 + 64 columns]): about
// 104 KB at c_z 128, two CTAs per SM.
template <int kKSteps>
struct TriangleGateBackwardTile {
  static constexpr int kPitch = TriangleInputTile<kKSteps>::kPitch;
  static constexpr int kStageElems = kTriInPassCols * kTriInStagePitch;
  template <typename T>
  static constexpr int bytes() {
    return (2 * kTriInRows * kPitch + kStageElems) * int(sizeof(T)) + 4 * kTriInPassCols * int(sizeof(float));
  }
};

// Copies pass q's da / db rows (channels of slots 2q, 2q + 1; positions m0.. of the CTA) into the
// first 64 rows of `ds`, zeros past C and M: cp.async where rows are 16-byte aligned (one group),
// else plain loads.
template <typename T>
__device__ __forceinline__ void triangle_gate_backward_load_d(const TriangleGateBackwardParams& p, T* ds, int q,
                                                              int64_t m0, int valid_rows) {
  constexpr int kSpans = kTriInRows / 8;
  const int col = int(threadIdx.x % unsigned(kSpans)) * 8, lr0 = int(threadIdx.x / unsigned(kSpans));
  const int blocks = edge_blocks(p.C);
#pragma unroll
  for (int lr = lr0; lr < 2 * kTriInSlot; lr += kTriInThreads / kSpans) {
    const EdgeSlot slot(2 * q + lr / kTriInSlot, blocks);
    const int ch = slot.ch0 + lr % kTriInSlot;
    const bool ok = slot.edge < 2 && ch < p.C && col < valid_rows;
    T* dst = ds + lr * kTriInStagePitch + col;
    const T* src = static_cast<const T*>(slot.edge == 0 ? p.da : p.db) + int64_t(ok ? ch : 0) * p.M + m0 + col;
    if (p.vector_ok) {
      cp_async_16(dst, ok ? src : static_cast<const T*>(p.da), ok);
    } else {
      for (int e = 0; e < 8; ++e) dst[e] = ok && col + e < valid_rows ? src[e] : T(0.f);
    }
  }
  cp_async_commit();
}

// Stages a slot's d_proj and d_gate (gate_backward_slot's) per position: `stage` points at the
// warp's first position row and the slot's first column of the [128 positions, kTriInStagePitch]
// tile; d_gate 64 columns further. The 8 x 8 tiles (positions mt * 16 + 8 hh.., channels nt * 8..)
// go out with stmatrix on sm_90 (four-byte stores before; either is free of bank conflicts at this
// pitch).
template <typename T, int kMTiles, int kPitch = kTriInStagePitch, int kKindCols = 2 * kTriInSlot>
__device__ __forceinline__ void stage_gate_grads(const uint32_t (&d_out)[2][kMTiles][4][2], T* stage, int lane) {
#pragma unroll
  for (int kind = 0; kind < 2; ++kind) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // lane l addresses row l % 8 of tile l / 8 = (nt of the pair, hh)
    T* const lane_row = stage + (lane % 8 + 8 * (lane / 8 % 2)) * kPitch + kind * kKindCols +
                        8 * (lane / 16);
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int pair = 0; pair < 2; ++pair)
        stsm_x4(lane_row + mt * 16 * kPitch + pair * 16, d_out[kind][mt][2 * pair][0],
                d_out[kind][mt][2 * pair][1], d_out[kind][mt][2 * pair + 1][0], d_out[kind][mt][2 * pair + 1][1]);
#else
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          *reinterpret_cast<uint32_t*>(stage + (mt * 16 + 8 * hh + g) * kPitch + kind * kKindCols +
                                       nt * 8 + 2 * t) = d_out[kind][mt][nt][hh];
#endif
  }
}

// A slot's staged da / db values for the thread's kMTiles m16 row tiles (the rows as in
// stage_gated_slot): `ds` points at the slot's first staged row and the warp's first row. The staged
// values travel as 8 x 8 tiles (tile (mt, nt, hh): positions mt * 16 + 8 hh.., channels nt * 8..),
// read with transposing ldmatrix into the accumulators' layout: d_in[mt][nt][hh] holds channels
// nt * 8 + 2 t, + 1 of position g + 8 hh.
template <typename T, int kMTiles, int kPitch = kTriInStagePitch>
__device__ __forceinline__ void gate_backward_load_slot(const T* ds, uint32_t (&d_in)[kMTiles][4][2], int lane) {
  // lane l addresses stored row l % 8 (channel nt * 8 + l % 8) of tile l / 8 = (nt of the pair, hh)
  const T* const lane_row = ds + (lane / 16 * 8 + lane % 8) * kPitch + 8 * (lane / 8 % 2);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int pair = 0; pair < 2; ++pair)
      ldsm_x4_trans(lane_row + pair * 16 * kPitch + mt * 16, d_in[mt][2 * pair][0], d_in[mt][2 * pair][1],
                    d_in[mt][2 * pair + 1][0], d_in[mt][2 * pair + 1][1]);
}

// The gates' backward of one slot for the thread's kMTiles m16 row tiles (acc as in
// stage_gated_slot): d = mask * d_in (gate_backward_load_slot's), d_proj and d_gate staged per
// position by stage_gate_grads at `stage` (the warp's first position row, the slot's first column).
// The sums of each channel's d_proj and d_gate over the warp's rows (of the values rounded to T, as
// the GEMMs that follow read them) go to red_row[c] and red_row[64 + c] (c the channel in the slot);
// kAccumulate: added to what red_row holds (a warp's sums over the tiles it walks).
template <typename T, int kMTiles, bool kAccumulate = false, int kPitch = kTriInStagePitch,
          int kKindCols = 2 * kTriInSlot>
__device__ __forceinline__ void gate_backward_slot(const TriangleGateBackwardParams& p, const EdgeSlot& slot,
                                                   const float* bias_proj, const float* bias_gate,
                                                   const float (*acc)[4], const float (&mask)[kMTiles][2],
                                                   const uint32_t (&d_in)[kMTiles][4][2], T* stage, float* red_row,
                                                   int lane) {
  if (slot.edge >= 2) return;
  const int g = lane / 4, t = lane % 4;
  uint32_t d_out[2][kMTiles][4][2];  // [proj, gate][mt][nt][hh], packed as d_in
  float sums[16] = {};               // [proj, gate][nt][e]: the thread's rows of channel nt * 8 + 2 t + e
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    float bp[2], bg[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = nt * 8 + 2 * t + e;  // channel slot.ch0 + c
      bp[e] = slot.ch0 + c < p.C ? bias_proj[c] : 0.f;
      bg[e] = slot.ch0 + c < p.C ? bias_gate[c] : 0.f;
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float2 d_pair = unpack2<T>(d_in[mt][nt][hh]);
        float d_proj[2], d_gate[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int i = 2 * hh + e;
          sigmoid_gated_backward<T>((e == 0 ? d_pair.x : d_pair.y) * mask[mt][hh], acc[8 * mt + 4 + nt][i], bg[e],
                                    acc[8 * mt + nt][i] + bp[e], d_proj[e], d_gate[e]);
        }
        d_out[0][mt][nt][hh] = pack2<T>(d_proj[0], d_proj[1]);
        d_out[1][mt][nt][hh] = pack2<T>(d_gate[0], d_gate[1]);
        const float2 rp = unpack2<T>(d_out[0][mt][nt][hh]), rg = unpack2<T>(d_out[1][mt][nt][hh]);
        sums[2 * nt] += rp.x, sums[2 * nt + 1] += rp.y, sums[8 + 2 * nt] += rg.x, sums[8 + 2 * nt + 1] += rg.y;
      }
  }
  // over the eight lanes g of each channel: lane g ends with kind g / 4, tile nt = g % 4, e = 0, 1
  sum_rows_scattered(sums, lane);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float& total = red_row[(g / 4) * 2 * kTriInSlot + (g % 4) * 8 + 2 * t + e];
    total = kAccumulate ? total + sums[e] : sums[e];
  }
  stage_gate_grads<T, kMTiles, kPitch, kKindCols>(d_out, stage, lane);
}

// After a pass's gate_backward_slot calls (and a barrier): the CTA's bias sums of the pass's
// channels, red [kGroups][128] added in order into bias_part, and the staged d_proj / d_gate
// (ds, [128 positions, kTriInStagePitch]) stored as the positions' columns of dab.
template <typename T, int kGroups>
__device__ __forceinline__ void gate_backward_store(const TriangleGateBackwardParams& p, const T* ds, const float* red,
                                                    int q, int64_t m0, int valid_rows) {
  const int blocks = edge_blocks(p.C);
  // the pass's column rr (threads 0-127): kind rr / 64 (projection, gate) of staged channel lr = rr % 64
  if (threadIdx.x < kTriInPassCols) {
    const int kind = int(threadIdx.x) / (2 * kTriInSlot), lr = int(threadIdx.x) % (2 * kTriInSlot);
    const EdgeSlot s(2 * q + lr / kTriInSlot, blocks);
    const int ch = s.ch0 + lr % kTriInSlot;
    if (s.edge < 2 && ch < p.C) {
      float total = 0.f;
#pragma unroll
      for (int rg = 0; rg < kGroups; ++rg) total += red[rg * kTriInPassCols + threadIdx.x];
      p.bias_part[int64_t(blockIdx.x) * 4 * p.C + (2 * s.edge + kind) * p.C + ch] = total;
    }
  }
  // staged column rr: kind rr / 64 (projection, gate) of staged channel lr = rr % 64; a thread stores
  // 8 columns (one channel run) of one position, a warp two positions' 16 runs
  constexpr int kSpans = kTriInPassCols / 8;
  for (int i = int(threadIdx.x); i < kTriInRows * kSpans; i += kTriInThreads) {
    const int r = i / kSpans, rr = i % kSpans * 8;
    if (r >= valid_rows) break;  // (r grows with i)
    const int kind = rr / (2 * kTriInSlot), lr = rr % (2 * kTriInSlot);
    const EdgeSlot s(2 * q + lr / kTriInSlot, blocks);
    const int ch = s.ch0 + lr % kTriInSlot;
    if (s.edge >= 2 || ch >= p.C) continue;
    const T* src = ds + r * kTriInStagePitch + rr;
    T* dst = static_cast<T*>(p.dab) + (m0 + r) * p.dab_ld + (2 * s.edge + kind) * p.C + ch;
    if (p.dab_vector_ok) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int e = 0; e < 8 && ch + e < p.C; ++e) dst[e] = src[e];
    }
  }
}

template <typename T, int kKSteps>
__global__ void __launch_bounds__(kTriInThreads, 2) triangle_gate_backward_kernel(TriangleGateBackwardParams p) {
  using Tile = TriangleInputTile<kKSteps>;
  constexpr int kPitch = Tile::kPitch;
  extern __shared__ __align__(16) unsigned char tri_bwd_smem[];
  T* const xs = reinterpret_cast<T*>(tri_bwd_smem);  // [kRows, kPitch]: x_hat
  T* const wb = xs + kTriInRows * kPitch;           // [128, kPitch]: the pass's weights
  T* const ds = wb + kTriInPassCols * kPitch;        // [128, kTriInStagePitch]: d, then d_proj / d_gate
  float* const red = reinterpret_cast<float*>(ds + TriangleGateBackwardTile<kKSteps>::kStageElems);  // [4][128]
  const int64_t m0 = int64_t(blockIdx.x) * kTriInRows;
  const int valid_rows = int(p.M - m0 < kTriInRows ? p.M - m0 : kTriInRows);
  const int blocks = edge_blocks(p.C);  // = passes

  load_tile_async<T, kTriInRows, Tile::kK, kPitch, kTriInThreads>(
      xs, static_cast<const T*>(p.x_hat) + m0 * p.x_stride, p.x_stride, valid_rows, p.K, threadIdx.x);
  cp_async_commit();
  triangle_input_load_weights<T, kKSteps>(p, wb, 0);
  triangle_gate_backward_load_d<T>(p, ds, 0, m0, valid_rows);

  const int warp = threadIdx.x / 32u, lane = threadIdx.x % 32u, g = lane / 4;
  const int row_group = warp % 4, col_half = warp / 4;
  float mask[2][2];
  triangle_row_masks<T>(mask, p.mask, m0, valid_rows, row_group, g);

  for (int q = 0; q < blocks; ++q) {
    cp_async_wait<1>();  // (the pass's d rows, copied last, may still be in flight: the product does not read them)
    __syncthreads();     // x_hat and the pass's weights are in shared memory

    float acc[2][8][4];
    triangle_input_pass_products<T, kKSteps>(acc, xs, wb, row_group, col_half, lane);
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the weights; the pass's d rows are in shared memory
    if (q + 1 < blocks) triangle_input_load_weights<T, kKSteps>(p, wb, q + 1);

    const EdgeSlot slot(2 * q + col_half, blocks);
    const float* const bias_proj = p.b_ab + 2 * slot.edge * p.c_rows + slot.ch0;
    uint32_t d_in[2][4][2];
    if (slot.edge < 2) gate_backward_load_slot<T, 2>(ds + col_half * kTriInSlot * kTriInStagePitch + row_group * 32, d_in, lane);
    __syncthreads();  // every warp has read its d values: the tile takes the gradients per position
    gate_backward_slot<T, 2>(p, slot, bias_proj, bias_proj + p.c_rows, &acc[0][0], mask, d_in,
                             ds + row_group * 32 * kTriInStagePitch + col_half * kTriInSlot,
                             red + row_group * kTriInPassCols + col_half * kTriInSlot, lane);
    __syncthreads();
    gate_backward_store<T, 4>(p, ds, red, q, m0, valid_rows);
    __syncthreads();  // the staged results are stored: the tile takes the next pass's d rows
    if (q + 1 < blocks) triangle_gate_backward_load_d<T>(p, ds, q + 1, m0, valid_rows);
  }
}

}  // namespace block
}  // namespace evoformer
