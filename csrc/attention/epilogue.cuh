// Epilogues: how a warp's 16-row accumulator tiles (mma.sync's C layout, which the Hopper kernels'
// wgmma fragments share) leave the kernels of both families: the forward's output and row
// statistics (with the Hopper kernel's gated output), dQ, dK / dV with the mask-bias gradient, and
// the pair-bias-gradient partials.
#pragma once

#include <cstdint>
#include <type_traits>

#include "attention/evoformer_attention.h"
#include "common/mma_sm80.cuh"
#include "attention/softmax.cuh"
#include "attention/tile_scheduler.cuh"

namespace evoformer {

// The [Lq, D] slices of (b, n, h) the forward's epilogue writes: out, and with a gate (p.gate) the
// gated output y = sigmoid(gate) * out beside it.
template <typename Element>
struct OutputRows {
  Element* out;
  int64_t o_stride;
  const Element* gate;  // nullptr: no gate
  Element* y;
  int64_t g_stride, y_stride;

  __device__ OutputRows(const AttentionParams& p, int64_t b, int64_t n, int64_t h)
      : out(static_cast<Element*>(p.out) + p.o_strides.at(b, n, 0, h)), o_stride(p.o_strides.l),
        gate(p.gate != nullptr ? static_cast<const Element*>(p.gate) + p.g_strides.at(b, n, 0, h) : nullptr),
        y(p.gate != nullptr ? static_cast<Element*>(p.gated) + p.y_strides.at(b, n, 0, h) : nullptr),
        g_stride(p.g_strides.l), y_stride(p.y_strides.l) {}
};

// The gate values of a thread's share of a warp's 16-row output tile (rows g and g + 8 from `row`,
// columns dt * 8 + 2 t, + 1; zeros past Lq and D), loaded into registers before the key loop so
// that their latency hides behind it (loaded in the epilogue, they cost more than the gate pass
// they replace at L = 384). The sm90 forward's only (16-bit Elements): in the sm80 kernels the
// registers spill.
template <typename Element, int kDTiles>
struct GateFragment {
  static_assert(sizeof(Element) == 2, "the gated epilogue is the 16-bit Hopper forward's");
  uint32_t v[2][kDTiles];  // one pair of values per word

  __device__ void load(const OutputRows<Element>& rows, int row, int Lq, int D, int lane) {
    if (rows.gate == nullptr) return;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const Element* grow = rows.gate + int64_t(row + 8 * r) * rows.g_stride;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const int d = dt * 8 + 2 * (lane % 4);
        v[r][dt] = row + 8 * r < Lq && d < D ? *reinterpret_cast<const uint32_t*>(grow + d) : 0u;
      }
    }
  }
  __device__ float2 get(int r, int dt) const { return unpack2<Element>(v[r][dt]); }
};

// Forward epilogue of one 16-row tile: o / rowsum into out[row][0..D) (rows g and g + 8 of the tile
// are `row` and `row + 8`, written when < Lq; `rows` as OutputRows says), where rows.gate is set
// also y[row][d] = sigmoid(gate[row][d]) * out[row][d] of out as stored (the gate kernel's values:
// it read out back; `gate` loaded by GateFragment::load at the same `row`; nullptr in kernels
// without a gated epilogue, which then compile none), and the row statistics (m, l) into
// stats[row] (see below and AttentionParams::stats); rows whose keys are all -inf get (0, +inf),
// so the backward's exp2(... - inf) gives P = 0 there.
template <typename Element, int kDTiles>
__device__ __forceinline__ void store_output_rows(const float (&o)[kDTiles][4], const float (&row_sum)[2],
                                                  const float (&row_max_s)[2], float scale_log2,
                                                  const OutputRows<Element>& rows,
                                                  const GateFragment<Element, kDTiles>* gate, float2* stats, int row,
                                                  int Lq, int D, int lane) {
  const int t = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r, row += 8) {
    const float sum = row_sum[r];
    const float inv = sum > 0.f ? fast_rcp(sum) : 0.f;  // sum >= 2^-64: the row maximum contributes 2^delta
    if (row < Lq) {
      Element* orow = rows.out + int64_t(row) * rows.o_stride;
      auto store = [&](auto check_d) {
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          const int d = dt * 8 + 2 * t;
          if (!decltype(check_d)::value || d < D)
            store2<Element>(orow + d, o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
        }
        if constexpr (sizeof(Element) == 2) {  // (GateFragment's Elements)
          if (gate == nullptr || rows.gate == nullptr) return;
          Element* yrow = rows.y + int64_t(row) * rows.y_stride;
#pragma unroll
          for (int dt = 0; dt < kDTiles; ++dt) {
            const int d = dt * 8 + 2 * t;
            if (!decltype(check_d)::value || d < D) {
              // out as stored: rounded to Element
              const float2 stored = unpack2<Element>(pack2<Element>(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv));
              const float2 g = gate->get(r, dt);
              store2<Element>(yrow + d, sigmoid(g.x) * stored.x, sigmoid(g.y) * stored.y);
            }
          }
        }
      };
      if (D == kDTiles * 8)
        store(std::false_type{});  // D fills its bucket: no per-column test
      else
        store(std::true_type{});
      // (m, l) with l = log2(sum / rho): the backward's P = exp2((S - m) * scale_log2 - l) is then
      // exactly rho / sum at a key that ties the maximum (S - m = 0), the probability the forward
      // gave it. rho is that key's weight as P.V and the row sum saw it: exp2(delta) rounded to
      // Element (TF32 for float), delta = m * scale_log2 - M the rounding residual of M (softmax_step; this FFMA of
      // the same operands gives the same delta, the same ex2 and rounding the same rho). It matters
      // where |M| is huge (every key masked by a finite fill: |delta| up to 64 at -1e9): exp2(delta)
      // is no Element value there, and l = log2(sum) - delta (the unrounded weight) put P off by
      // Element's rounding of it (up to 2^-8 in bf16: dV = dO * (1 - 2^-8) at L = 1). A row of L
      // tied keys sums to L * rho, exact in fp32 (rho has at most 11 significant bits; L < 2^13),
      // so sum / rho = L exactly (IEEE division) and P = exp2(-log2(L)): 1 at L = 1, 1 / L up to
      // the MUFU approximations otherwise. Elsewhere |delta| is below Element's precision, rho = 1
      // and l = log2(sum). Once per row: nothing changes per score in either direction.
      const float m_log2 = log2_row_max(row_max_s[r], scale_log2);
      // (with kResidualPerScore the forward took delta out of every exponent: rho = 1)
      const float delta = kResidualPerScore<Element> ? 0.f : log2_row_max_residual(row_max_s[r], m_log2, scale_log2);
      const float rho = round_operand<Element>(fast_exp2(delta));  // rounded as c_to_a_frag
      if (t == 0)
        stats[row] = sum > 0.f ? make_float2(row_max_s[r], __log2f(__fdiv_rn(sum, rho))) : make_float2(0.f, kInf);
    }
  }
}

// Stores rows g and g + 8 of a warp's 16-row accumulator tile, times `scale`, into out[row][0..D)
// (`row` is the tile's row g; rows `row_stride` apart, written when < `rows`).
template <typename Element, int kDTiles>
__device__ __forceinline__ void store_scaled_rows(const float (&acc)[kDTiles][4], Element* out, int64_t row_stride,
                                                  int row, int rows, int D, float scale, int lane) {
  const int t = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row + 8 * r;
    if (i < rows) {
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const int d = dt * 8 + 2 * t;
        if (d < D)
          store2<Element>(out + i * row_stride + d, acc[dt][2 * r] * scale, acc[dt][2 * r + 1] * scale);
      }
    }
  }
}

// dK/dV epilogue of a warp's 16 keys (rows g and g + 8 of its accumulator tiles; `key` is row g's
// index): dK * scale and dV into their [B, N, Lk, H, D] tensors (at their strides), and the per-key mask-bias
// gradient of (b, n, h) (the quad-summed dmask_acc) when it is wanted; keys past Lk are skipped.
template <typename Element, int kDTiles>
__device__ __forceinline__ void store_dkdv_rows(const float (&dk)[kDTiles][4], const float (&dv)[kDTiles][4],
                                                const float (&dmask_acc)[2], const AttentionParams& p, int64_t b,
                                                int64_t n, int64_t h, int key, int lane) {
  Element* dk_out = static_cast<Element*>(p.dk) + p.dk_strides.at(b, n, 0, h);  // [Lk, D], rows dk_strides.l apart
  Element* dv_out = static_cast<Element*>(p.dv) + p.dv_strides.at(b, n, 0, h);
  store_scaled_rows<Element, kDTiles>(dk, dk_out, p.dk_strides.l, key, p.Lk, p.D, p.scale, lane);
  store_scaled_rows<Element, kDTiles>(dv, dv_out, p.dv_strides.l, key, p.Lk, p.D, 1.f, lane);
  const int64_t bnh = (b * p.N + n) * p.H + h;
#pragma unroll
  for (int r = 0; r < 2; ++r, key += 8) {
    const float dm = quad_sum(dmask_acc[r]);
    if (key < p.Lk && p.dmask != nullptr && lane % 4 == 0) p.dmask[bnh * p.Lk + key] = dm;
  }
}

// A warp's 16-row tile (rows g and g + 8 from `row`, keys from col0) of the chunk's partial pair-bias
// gradient: [Lq, Lk] fp32 of (chunk, b, h), each element written once.
template <int kNTiles>
__device__ __forceinline__ void store_pair_partial(const float (&acc)[kNTiles][4], const AttentionParams& p,
                                                   const PairGradTile& tile, int row, int col0, int lane) {
  float* out = p.dpair + ((tile.chunk * p.B + tile.b) * p.H + tile.h) * int64_t(p.Lq) * p.Lk;
  const bool lk_even = (p.Lk % 2) == 0;
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = row + 8 * r, j = col0 + nt * 8 + 2 * (lane % 4);
      if (i >= p.Lq || j >= p.Lk) continue;
      float* ptr = out + int64_t(i) * p.Lk + j;
      if (lk_even) {
        *reinterpret_cast<float2*>(ptr) = make_float2(acc[nt][2 * r], acc[nt][2 * r + 1]);
      } else {
        ptr[0] = acc[nt][2 * r];
        if (j + 1 < p.Lk) ptr[1] = acc[nt][2 * r + 1];
      }
    }
}

}  // namespace evoformer
