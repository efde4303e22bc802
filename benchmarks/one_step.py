"""One warmed-up cutlass forward + backward of a suite shape: a target for ncu / compute-sanitizer.

    ncu --kernel-name regex:forward_kernel --launch-skip 3 --launch-count 1 python benchmarks/one_step.py 0
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import SUITE, make_inputs, run_cutlass  # noqa: E402

shape = SUITE[int(sys.argv[1]) if len(sys.argv) > 1 else 0]
q, k, v, m, p = make_inputs(shape)
leaves = [t.requires_grad_(True) for t in (q, k, v) + ((p,) if p is not None else ())]
dout = torch.randn_like(q)
for _ in range(5):
    torch.autograd.grad(run_cutlass(q, k, v, m, p), leaves, dout)
torch.cuda.synchronize()
print("done", shape.name)
