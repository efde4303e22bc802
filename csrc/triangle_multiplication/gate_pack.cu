// Launchers of the triangle multiplication's edge gates (gate_pack.cuh), half, bfloat16 and float.
#include "common/block_launch.cuh"
#include "triangle_multiplication/gate_pack.cuh"

namespace evoformer {
namespace block {

template <typename T>
void launch_gate_pack(const GatePackParams& p, cudaStream_t stream) {
  // (2 C channel rows of M positions)
  launch_spans(gate_pack_kernel<T>, p, row_spans<T>(int64_t(2) * p.C, p.M), stream, "evoformer triangle gate pack");
}

template <typename T>
void launch_gate_pack_backward(const GatePackBackwardParams& p, int n_chunks, cudaStream_t stream) {
  if (p.M == 0 || p.C == 0) return;
  gate_pack_backward_kernel<T><<<dim3(unsigned(n_chunks), unsigned(2 * p.C)), kBlockOpThreads, 0, stream>>>(p);
  check_launch("evoformer triangle gate pack backward");
}

#define EVOFORMER_GATE_PACK_OPS(T) \
  template void launch_gate_pack<T>(const GatePackParams&, cudaStream_t); \
  template void launch_gate_pack_backward<T>(const GatePackBackwardParams&, int, cudaStream_t);
EVOFORMER_GATE_PACK_OPS(cutlass::half_t)
EVOFORMER_GATE_PACK_OPS(cutlass::bfloat16_t)
EVOFORMER_GATE_PACK_OPS(float)
#undef EVOFORMER_GATE_PACK_OPS

}  // namespace block
}  // namespace evoformer
