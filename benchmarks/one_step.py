"""Warmed-up forward (+ backward) steps of one implementation on a suite shape: a target for ncu /
compute-sanitizer (benchmarks/profile.sh runs it under ncu).

    python benchmarks/one_step.py [SHAPE_INDEX] [IMPL] [fwd|fwdbwd]
    python benchmarks/one_step.py --shapes 0 --impls cutlass-sm80 --forward-only
    ncu --kernel-name regex:forward_sm90 --launch-skip 3 --launch-count 1 python benchmarks/one_step.py 0
"""

import harness
from bench_attention import SUITE, attention_step, command_line


def main() -> None:
    cli = command_line(__doc__, default_shapes="0", default_impls=["cutlass"], positional=True, json_output=False)
    cli.add_argument("mode", nargs="?", choices=("fwd", "fwdbwd"), default="fwdbwd",
                     help="forward only, or forward+backward (default)")
    args = cli.parse()
    backward = args.mode == "fwdbwd" and not args.forward_only
    for index in args.shapes:
        for impl in args.impls:
            harness.warm_up(attention_step(impl, SUITE[index], backward=backward), iters=5)
            print("done", SUITE[index].name, impl, "forward+backward" if backward else "forward", flush=True)


if __name__ == "__main__":
    main()
