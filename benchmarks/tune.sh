#!/usr/bin/env bash
# A/B of build-time tuning knobs on the GPU machine: each variant builds its own extension (the flags
# are part of the cache key) and times the cutlass backend on the given suite shapes.
#   bash benchmarks/tune.sh "0,4" "" "-DEVOFORMER_FWD_D32_MIN_BLOCKS=3" "-DEVOFORMER_BWD_MIN_BLOCKS=2"
#   IMPLS=cutlass-sm80 bash benchmarks/tune.sh "0,4" "" "-DEVOFORMER_FWD_D64_BLOCK_N=32"
# Knobs (defaults in csrc/attention/, grep -rn EVOFORMER_ there): EVOFORMER_FWD_D32_* and
# EVOFORMER_FWD_D64_* (WARPS, MTILES, BLOCK_N, MIN_BLOCKS) and EVOFORMER_BWD_MIN_BLOCKS act on the
# portable kernels, which a Hopper GPU runs as IMPLS=cutlass-sm80; EVOFORMER_SM90_WARPGROUPS and
# EVOFORMER_SM90_FWD_WARPS_PER_SM act on the Hopper forward. IMPLS (default cutlass) is passed to
# bench_attention.py --impls.
set -u
shapes=$1; shift
for flags in "$@"; do
  echo "=== variant: '${flags:-default}'"
  EVOFORMER_BLOCKS_EXTRA_CUDA_FLAGS="$flags" python3 benchmarks/bench_attention.py --shapes "$shapes" \
    --impls "${IMPLS:-cutlass}" 2>&1 | grep -E "^\| cutlass|^## |built the CUDA"
done
