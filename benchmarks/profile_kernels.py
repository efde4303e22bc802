"""Per-kernel CUDA times of one cutlass forward + backward (torch.profiler), for tuning.

    python benchmarks/profile_kernels.py [suite indices, default 0,4]
"""

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import SUITE, make_inputs, make_step, run_cutlass  # noqa: E402


def main() -> None:
    indices = [int(i) for i in (sys.argv[1] if len(sys.argv) > 1 else "0,4").split(",")]
    for index in indices:
        shape = SUITE[index]
        for want_pair_grad in (True, False):
            step, _ = make_step(run_cutlass, make_inputs(shape), backward=True, pair_grad=want_pair_grad)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            print(f"\n### {shape.name}, pair-bias gradient {'on' if want_pair_grad else 'off'} (5 iterations)")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=60))


if __name__ == "__main__":
    main()
