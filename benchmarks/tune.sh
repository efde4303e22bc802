#!/usr/bin/env bash
# A/B of build-time tuning knobs on the GPU machine: each variant builds its own extension (the flags
# are part of the cache key) and times the cutlass backend on the given suite shapes.
#   bash benchmarks/tune.sh "0,4" "" "-DEVOFORMER_FWD_D32_MIN_BLOCKS=3" "-DEVOFORMER_BWD_MIN_BLOCKS=2"
# Knobs: EVOFORMER_FWD_D32_* / EVOFORMER_FWD_D64_* (WARPS, MTILES, BLOCK_N, MIN_BLOCKS) and
# EVOFORMER_BWD_MIN_BLOCKS, in kernel_utils.cuh.
set -u
shapes=$1; shift
for flags in "$@"; do
  echo "=== variant: '${flags:-default}'"
  EVOFORMER_BLOCKS_EXTRA_CUDA_FLAGS="$flags" python3 benchmarks/bench_attention.py --shapes "$shapes" --impls cutlass 2>&1 \
    | grep -E "^\| cutlass|^## |built the CUDA"
done
