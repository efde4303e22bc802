// An attention instantiation's host entry points, and the compile-time walk from a run-time
// (head-dim bucket, pair kind) to one instantiation. attention_bindings.cpp dispatches through it;
// portable_kernels.cu answers through it for the portable 16-bit kernels when a Hopper-only build
// keeps them in a library of their own (built on first use; see there).
#pragma once

#include <cstddef>
#include <iterator>
#include <type_traits>

#include "attention/evoformer_attention.h"

namespace evoformer {

using Launcher = void (*)(const AttentionParams&, cudaStream_t);
using IntQuery = int (*)();

// One instantiation's entry points in one family.
struct Kernels {
  Launcher forward, backward;
  IntQuery pair_grad_blocks_per_sm, forward_smem_bytes, backward_smem_bytes;
};

template <typename E, int D, int P>
Kernels sm80_kernels() {
  return {&launch_forward_sm80<E, D, P>, &launch_backward_sm80<E, D, P>, &pair_grad_blocks_per_sm_sm80<E, D, P>,
          &forward_smem_bytes_sm80<E, D, P>, &backward_smem_bytes_sm80<E, D, P>};
}

template <typename E, int D, int P>
Kernels sm90_kernels() {
  return {&launch_forward_sm90<E, D, P>, &launch_backward_sm90<E, D, P>, &pair_grad_blocks_per_sm_sm90<E, D, P>,
          &forward_smem_bytes_sm90<E, D, P>, &backward_smem_bytes_sm90<E, D, P>};
}

// pick(integral_constant<kHeadDimBuckets[i]>) for the bucket `bucket` (one of those up to kMaxBucket).
template <typename R, int kMaxBucket = limits::kMaxHeadDim, size_t I = 0, typename Pick>
R by_bucket(int bucket, Pick&& pick) {
  constexpr int kBucket = limits::kHeadDimBuckets[I];
  if constexpr (I + 1 == std::size(limits::kHeadDimBuckets) || limits::kHeadDimBuckets[I + 1] > kMaxBucket) {
    return pick(std::integral_constant<int, kBucket>{});
  } else {
    return bucket == kBucket ? pick(std::integral_constant<int, kBucket>{})
                             : by_bucket<R, kMaxBucket, I + 1>(bucket, pick);
  }
}

// pick(integral_constant<kKinds[i]>) for the pair kind `pair` (one of kKinds).
template <typename R, const auto& kKinds, size_t I = 0, typename Pick>
R by_pair_kind(int pair, Pick&& pick) {
  constexpr int kKind = kKinds[I];
  if constexpr (I + 1 == std::size(kKinds)) {
    return pick(std::integral_constant<int, kKind>{});
  } else {
    return pair == kKind ? pick(std::integral_constant<int, kKind>{}) : by_pair_kind<R, kKinds, I + 1>(pair, pick);
  }
}

// make(integral_constant<bucket>, integral_constant<pair kind>) for a bucket up to kMaxBucket and one
// of kKinds.
template <int kMaxBucket, const auto& kKinds, typename Make>
Kernels by_shape(int bucket, int pair, Make&& make) {
  return by_bucket<Kernels, kMaxBucket>(
      bucket, [&](auto dim) { return by_pair_kind<Kernels, kKinds>(pair, [&](auto kind) { return make(dim, kind); }); });
}

// The portable 16-bit instantiations' entry points for (bfloat16 or float16, bucket, pair kind), as
// the library of a Hopper-only build that holds them answers (extern "C", looked up by name: the
// core library finds it with dlsym). Returns 0 for a bucket or pair kind it does not hold.
extern "C" int evoformer_portable_16bit_kernels(int bfloat16, int bucket, int pair, Kernels* out);
inline constexpr const char* kPortableEntryName = "evoformer_portable_16bit_kernels";
using PortableEntry = int (*)(int, int, int, Kernels*);

}  // namespace evoformer
