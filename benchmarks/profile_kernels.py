"""Per-kernel CUDA times of one cutlass forward + backward (torch.profiler), with and without the
pair-bias gradient, for tuning.

    python benchmarks/profile_kernels.py [SHAPE_INDICES, default 0,4] [IMPLS, default cutlass]
    python benchmarks/profile_kernels.py --shapes 0,4 --impls cutlass,cutlass-sm80
"""

from torch.profiler import ProfilerActivity, profile

import harness
from bench_attention import SUITE, attention_step, command_line


def main() -> None:
    cli = command_line(__doc__, default_shapes="0,4", default_impls=["cutlass"], positional=True, json_output=False)
    args = cli.parse()
    print(harness.run_info_line(), flush=True)
    iters = 5
    for index in args.shapes:
        shape = SUITE[index]
        for impl in args.impls:
            for pair_grad in (True, False) if shape.pair and not args.forward_only else (False,):
                step = attention_step(impl, shape, backward=not args.forward_only, pair_grad=pair_grad)
                harness.warm_up(step)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    harness.warm_up(step, iters)
                grad = f", pair-bias gradient {'on' if pair_grad else 'off'}" if shape.pair else ""
                print(f"\n### {shape.name}, {impl}{grad} ({iters} iterations)")
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=60))


if __name__ == "__main__":
    main()
