"""Warmed-up forward (+ backward) steps of one implementation on a suite shape: a target for ncu /
compute-sanitizer.

    python benchmarks/one_step.py [SHAPE_INDEX] [IMPL: cutlass|flex|sdpa|eager] [fwd|fwdbwd]
    ncu --kernel-name regex:forward_kernel --launch-skip 3 --launch-count 1 python benchmarks/one_step.py 0
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import IMPLS, SUITE, make_inputs, make_step  # noqa: E402

shape = SUITE[int(sys.argv[1]) if len(sys.argv) > 1 else 0]
impl = sys.argv[2] if len(sys.argv) > 2 else "cutlass"
backward = (sys.argv[3] if len(sys.argv) > 3 else "fwdbwd") == "fwdbwd"
step, _ = make_step(IMPLS[impl], make_inputs(shape), backward)
for _ in range(5):
    step()
torch.cuda.synchronize()
print("done", shape.name, impl, "forward+backward" if backward else "forward")
