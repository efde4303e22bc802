// The entry point of the portable 16-bit attention kernels' own library. A build whose architectures
// are all 9.0a runs 16-bit attention on the Hopper kernels, so it leaves the portable 16-bit
// instantiations (36 of its translation units) out of the core library and builds them, with this
// file and attention.cu, into a second library the first time the sm80 family is chosen for them
// (evoformer_blocks/ops/_build.py, load_portable). The core library opens that library and asks
// this function for an instantiation's entry points (attention_bindings.cpp, kernels_for). Other
// builds compile everything into one library and leave this file out.
#include <algorithm>
#include <iterator>

#include <cutlass/numeric_types.h>

#include "attention/kernel_entries.h"

extern "C" int evoformer_portable_16bit_kernels(int bfloat16, int bucket, int pair, evoformer::Kernels* out) {
  using namespace evoformer;
  const bool known_bucket = std::find(std::begin(limits::kHeadDimBuckets), std::end(limits::kHeadDimBuckets),
                                      bucket) != std::end(limits::kHeadDimBuckets);
  const bool known_pair =
      std::find(std::begin(limits::kPairKinds), std::end(limits::kPairKinds), pair) != std::end(limits::kPairKinds);
  if (!known_bucket || !known_pair || out == nullptr) return 0;
  auto make = [](auto element) {
    return [](auto dim, auto kind) {
      return sm80_kernels<decltype(element), decltype(dim)::value, decltype(kind)::value>();
    };
  };
  *out = bfloat16 ? by_shape<limits::kMaxHeadDim, limits::kPairKinds>(bucket, pair, make(cutlass::bfloat16_t{}))
                  : by_shape<limits::kMaxHeadDim, limits::kPairKinds>(bucket, pair, make(cutlass::half_t{}));
  return 1;
}
