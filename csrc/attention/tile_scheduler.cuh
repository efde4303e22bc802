// Which CTA computes what, for the kernels of both families, and the launches that go with it:
// row-tile grids (the forward, dK/dV and dQ kernels: one CTA per tile of rows of one (b, n), heads on
// grid y) and pair-gradient grids (one CTA per [queries, keys] tile of (b, h) and chunk of rows n),
// plus the occupancy query that sizes the latter.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include <cutlass/fast_math.h>

#include "attention/evoformer_attention.h"

namespace evoformer {

// Grid of CTAs that each own one tile of one row (b, n): x = tile + n_tiles * (n + N * b), so CTAs
// that share a row's tiles (q, k, v of one (b, n, h)) are adjacent in launch order and the re-reads
// hit L2; heads run on blockIdx.y. The two divisions that decode x use multipliers precomputed on
// the host (cutlass::FastDivmod: a multiply-high and a shift each instead of a division routine);
// x < 2^31 (grid limit) is within FastDivmod's range.
struct RowTile {
  int64_t b, n;
  int tile;
};
struct RowTileGrid {
  cutlass::FastDivmod tiles, rows;
  unsigned n_ctas;  // B * N * n_tiles; the bindings keep it below 2^31

  RowTileGrid(int B, int N, int n_tiles) : tiles(n_tiles), rows(N), n_ctas(unsigned(int64_t(B) * N * n_tiles)) {}
  dim3 dims(int H) const { return dim3(n_ctas, unsigned(H)); }

  __device__ __forceinline__ RowTile decode() const {
    int bn, tile, b, n;
    tiles(bn, tile, int(blockIdx.x));
    rows(b, n, bn);
    return RowTile{b, n, tile};
  }
};

// Launches kernel(p, grid, extra...) with one CTA of `threads` threads per tile of kTileRows of
// `length` rows of each (b, n), and each head, after raising its dynamic shared-memory limit to
// smem_bytes; both steps are checked and a failure names `name`. Tiles of at least limits::kRowTile
// rows keep the grid within the limits the host checks.
template <int kTileRows, typename... Extra>
inline void launch_on_row_tiles(void (*kernel)(AttentionParams, RowTileGrid, Extra...), const AttentionParams& p,
                                int length, int threads, int smem_bytes, cudaStream_t stream, const char* name,
                                const Extra&... extra) {
  static_assert(kTileRows >= limits::kRowTile, "the host's grid limits assume tiles of at least kRowTile rows");
  allow_dynamic_smem(kernel, smem_bytes, name);
  const RowTileGrid grid(p.B, p.N, (length + kTileRows - 1) / kTileRows);
  kernel<<<grid.dims(p.H), threads, smem_bytes, stream>>>(p, grid, extra...);
  check_launch(name);
}

// The tile of a pair-bias-gradient CTA, [kPairGradTileQueries, kPairGradTileKeys] (kernel_limits.h):
// blockIdx.x = ((b * n_chunks + chunk) * n_query_blocks + query block) * n_key_blocks + key block,
// h = blockIdx.y; the CTA sums dS over rows n in [n_begin, n_end) for queries m0.. and keys n0..
// (32-bit unsigned decode: the grid's x extent is below 2^31).
struct PairGradTile {
  static constexpr int kQueries = limits::kPairGradTileQueries, kKeys = limits::kPairGradTileKeys;
  int64_t b, h, chunk;
  int m0, n0, rows_q, rows_k, n_begin, n_end;

  __device__ __forceinline__ explicit PairGradTile(const AttentionParams& p) {
    const int n_kb = (p.Lk + kKeys - 1) / kKeys, n_qb = (p.Lq + kQueries - 1) / kQueries;
    const unsigned x = blockIdx.x, x_qb = x / unsigned(n_kb), x_chunk = x_qb / unsigned(n_qb);
    const int kb = int(x - x_qb * unsigned(n_kb)), qb = int(x_qb - x_chunk * unsigned(n_qb));
    chunk = x_chunk % unsigned(p.n_chunks), b = x_chunk / unsigned(p.n_chunks), h = blockIdx.y;
    m0 = qb * kQueries, n0 = kb * kKeys;
    rows_q = min(kQueries, p.Lq - m0), rows_k = min(kKeys, p.Lk - n0);
    n_begin = int(chunk) * p.n_chunk_size, n_end = min(p.N, n_begin + p.n_chunk_size);
  }
};

// Launches a pair-bias-gradient kernel on its grid (PairGradTile) after raising its dynamic
// shared-memory limit; both steps are checked. `extra` follows the parameters (e.g. TMA maps).
template <typename... Extra>
inline void launch_pair_grad(void (*kernel)(AttentionParams, Extra...), const AttentionParams& p, int threads,
                             int smem_bytes, cudaStream_t stream, const char* name, const Extra&... extra) {
  allow_dynamic_smem(kernel, smem_bytes, name);
  const int64_t tiles = int64_t((p.Lq + PairGradTile::kQueries - 1) / PairGradTile::kQueries) *
                        ((p.Lk + PairGradTile::kKeys - 1) / PairGradTile::kKeys);
  kernel<<<dim3(unsigned(int64_t(p.B) * p.n_chunks * tiles), unsigned(p.H)), threads, smem_bytes, stream>>>(p, extra...);
  check_launch(name);
}

}  // namespace evoformer
