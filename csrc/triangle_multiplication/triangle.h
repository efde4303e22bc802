// The triangle multiplicative update's family: parameters and launchers of its fused input half
// (layer norm, both edges' projections and gates, the output gate's projection), of the edges' gates
// alone (gate_pack, where the fused input kernel does not run) and of its fused output half, forward
// and backward (block_params.h has the legend).
#pragma once

#include "common/block_params.h"

namespace evoformer {
namespace block {

struct GatePackParams {
  const void* ab;     // [4, C, M] channel-major (rows a_proj, a_gate, b_proj, b_gate), rows ab_stride apart
  const float* bias;  // [4, C]
  const void* mask;   // [M] or nullptr
  void* a;            // [C, M], rows out_stride apart
  void* b;            // [C, M]
  int64_t M, ab_stride, out_stride;
  int C;
  bool vector_ok;  // every row start is 16-byte aligned
};

struct GatePackBackwardParams {
  const void* ab;     // [4, C, M] as in the forward
  const float* bias;  // [4, C]
  const void* mask;   // [M] or nullptr
  const void* da;     // [C, M], rows d_stride apart
  const void* db;     // [C, M]
  void* dab;          // [4, C, M], rows dab_stride apart
  float* bias_part;   // [4 C, n_chunks]: partial row sums of dab (n_chunks = the grid's x extent)
  int64_t M, ab_stride, d_stride, dab_stride;
  int C;
  bool vector_ok;
  // The row sums: the last of a row's n_chunks CTAs (counted on tickets[blockIdx.y], [2 C], zero at
  // the launch and left zero: zeroed_tickets) adds its partials in chunk order into bias_total[(r / C) * total_stride + r % C]
  // for its rows r. tickets == nullptr: the partials stay for the host.
  unsigned* tickets = nullptr;
  float* bias_total = nullptr;
  int64_t total_stride = 0;
};

// The triangle multiplication's input half in one kernel (triangle_input.cuh): layer norm of z, both
// edges' projections and gates, the output gate's projection. Folded weights (no affine left).
struct TriangleInputParams {
  const void* z;       // [M, K] row-major, rows z_stride apart (16-byte aligned)
  const void* w_ab;    // [4 C, K]: rows a_proj, a_gate, b_proj, b_gate, of z's type
  const float* b_ab;   // [4 C]
  const void* w_g;     // [G, K], z's type
  const void* b_g;     // [G], z's type
  const void* mask;    // [M], z's type, or nullptr
  void* a;             // [C, M] channel-major
  void* b;             // [C, M]
  void* g;             // [M, G] row-major
  float* mean;         // [M]
  float* rstd;         // [M]
  int64_t M, z_stride;
  int K, C, G;         // K, G multiples of 8; K <= limits::kTriangleInputMaxK
  float eps;
  bool vector_ok;      // a and b rows can be stored 16 bytes at a time (M % 8 == 0, aligned bases)
  int c_rows = 0;      // channels between w_ab's / b_ab's four row blocks (C)
  bool hopper = false; // run the sm_90a (wgmma) kernel: only where block_hopper_kernels() says so
  int sm_count = 0;    // the device's SMs (the Hopper kernel's persistent grid at c_z = c = 128)
};

// Its backward for the edges (a group of C channels of c_rows): the projections and gates recomputed
// from x_hat, then d(ab) from da, db as gate_pack_backward computes it, and per-CTA partial row sums
// of d(ab) (the biases' gradients).
struct TriangleGateBackwardParams {
  const void* x_hat;   // [M, K] row-major, rows x_stride apart (16-byte aligned)
  const void* w_ab;    // [4, c_rows, K] folded; the group's first channel at the pointer
  const float* b_ab;   // [4, c_rows], likewise
  const void* mask;    // [M] or nullptr
  const void* da;      // [C, M] channel-major, rows M apart
  const void* db;      // [C, M]
  void* dab;           // [M, 4 C] per position, rows dab_ld apart: columns (a_proj, a_gate, b_proj, b_gate) x C
  float* bias_part;    // [triangle_gate_backward_parts(p), 4 C]: each CTA's sums of the dab columns (as rounded to T)
  int64_t M, x_stride;
  int K, C, c_rows;
  bool vector_ok;      // M % 8 == 0 and 16-byte aligned da, db
  const void* w_g = nullptr;  // no g passes
  int G = 0;
  int64_t dab_ld = 0;          // dab's row stride
  bool dab_vector_ok = false;  // dab's rows can be written 16 bytes at a time (dab_ld, C % 8 == 0, aligned base)
  bool hopper = false;         // run the sm_90a kernel where it fits (the forward's kernel family)
  int sm_count = 0;            // the device's SMs (the sm_90a kernel's persistent grid)
};

// The triangle multiplication's output half in one kernel (triangle_output.cuh): the channel layer
// norm of p, the output projection (w_z folded) and the gate, out = sigmoid(g) * (n_hat w_z^T + b_z).
struct TriangleOutputParams {
  const void* p;     // [C, M] channel-major, rows M apart
  const void* g;     // [M, G] row-major
  const void* w_z;   // [G, C] folded
  const void* b_z;   // [G]
  void* out;         // [M, G]: sigmoid(g) * (n_hat w_z^T + b_z), plus the residual where given
  void* n_hat;       // [M, C]
  float* rstd;       // [M]
  int64_t M;
  int C, G;          // multiples of 8, C <= limits::kTriangleOutputMaxC, G <= limits::kTriangleOutputMaxG
  float eps;
  bool vector_ok;    // p's rows can be read 16 bytes at a time (M % 8 == 0, aligned base)
  // Optional (nullptr: absent): out = residual + update (* scale), residual [M, G] row-major (the op's
  // input z), scale [B, N, G] per (b, j, column) of position m = (b N + i) N + j (a row-wise dropout
  // mask shared by the rows i); n_res = N.
  const void* residual;
  const void* scale;
  int64_t n_res;
  int sm_count;  // the device's SMs: the kernel's persistent grid is sm_count x its resident CTAs per SM
};

// The output half's backward in one kernel (triangle_output.cuh), under the same limits: with y =
// n_hat w_z^T + b_z recomputed, dy = dout sigmoid(g), dg = dout y sigmoid'(g), and the channel
// layer norm's backward of dn_hat = dy w_z into dp. One CTA per limits::kTriangleTileRows positions.
struct TriangleOutputBackwardParams {
  const void* n_hat;  // [M, C] row-major (saved by the forward)
  const void* w_z;    // [G, C] folded
  const void* b_z;    // [G]
  const void* g;      // [M, G]
  const void* dout;   // [M, G]
  const float* rstd;  // [M]: the channel layer norm's
  void* dg;           // [M, G], rows dg_ld apart
  void* dy;           // [M, G]
  void* dp;           // [C, M] channel-major
  float* dy_part;     // [ceil(M / 128), G]: per-CTA column sums of dy (as stored), then of dg
  float* dg_part;
  ColumnTotals totals;  // out[0] the sum of dy_part (db_z), out[1] of dg_part (db_g)
  int64_t M;
  int C, G;
  bool vector_ok;  // dp's rows can be written 16 bytes at a time (M % 8 == 0, aligned base)
  int64_t dg_ld = 0;  // dg's row stride (a multiple of 8, >= G; 16-byte aligned dg)
};

// Launchers, one instantiation per element type T; each checks its launch. gate_pack: half,
// bfloat16 and float. The fused kernels: half and bfloat16 only (T = cutlass::half_t,
// cutlass::bfloat16_t), K <= limits::kTriangleInputMaxK, one CTA per limits::kTriangleTileRows
// positions (the backward's bias_part, dy_part and dg_part have one row per CTA), but for the
// persistent Hopper kernels (the input kernel at c_z = c = 128, the gate backward where
// triangle_gate_backward_runs_sm90: at most one CTA per SM, bias_part one row per CTA of that grid).
template <typename T>
void launch_gate_pack(const GatePackParams& p, cudaStream_t stream);
template <typename T>
void launch_gate_pack_backward(const GatePackBackwardParams& p, int n_chunks, cudaStream_t stream);
template <typename T>
void launch_triangle_input(const TriangleInputParams& p, cudaStream_t stream);
template <typename T>
void launch_triangle_input_sm90(const TriangleInputParams& p, cudaStream_t stream);  // (p.hopper)
template <typename T>
void launch_triangle_gate_backward(const TriangleGateBackwardParams& p, cudaStream_t stream);
template <typename T>
void launch_triangle_gate_backward_sm90(const TriangleGateBackwardParams& p, cudaStream_t stream);  // (resident)
// Whether launch_triangle_gate_backward runs the sm_90a kernel (p.hopper, c_z = 128, a group of 32 or 64
// channels, 16-byte rows), that kernel's grid, and the rows of bias_part a launch writes (one per CTA).
bool triangle_gate_backward_runs_sm90(const TriangleGateBackwardParams& p);
int64_t triangle_gate_backward_sm90_ctas(const TriangleGateBackwardParams& p);
int64_t triangle_gate_backward_parts(const TriangleGateBackwardParams& p);
// The most dynamic shared memory a CTA of a fused half's portable kernels takes, forward or backward:
// the input half's (input kernel, edges' gate backward) at c_z = K, the output half's (output kernel,
// its backward) at c = C; 16-bit elements. A GPU that allows less runs that half unfused: compute
// capability 8.6 and 8.9 allow 99 KB, where these take 104 and 106 KB at c_z = c = 128; an A100 163 KB,
// where the input half takes 198 KB at c_z = 256. (The Hopper kernels run only on compute capability
// 9.0, which allows 227 KB.)
int triangle_input_half_smem_bytes(int K);
int triangle_output_half_smem_bytes(int C);
template <typename T>
void launch_triangle_output(const TriangleOutputParams& p, cudaStream_t stream);
template <typename T>
void launch_triangle_output_backward(const TriangleOutputBackwardParams& p, cudaStream_t stream);

}  // namespace block
}  // namespace evoformer
