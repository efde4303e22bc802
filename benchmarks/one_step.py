"""Warmed-up forward (+ backward) steps of one implementation on a suite shape, or of the triangle
multiplication (outgoing, c_z = c_hidden = 128, bf16) at N_res given by --triangle: a target for ncu /
compute-sanitizer (benchmarks/profile.sh runs it under ncu).

    python benchmarks/one_step.py [SHAPE_INDEX] [IMPL] [fwd|fwdbwd]
    python benchmarks/one_step.py --shapes 0 --impls cutlass-sm80 --forward-only
    python benchmarks/one_step.py --triangle 768 [fwd|fwdbwd]
    ncu --kernel-name regex:forward_sm90 --launch-skip 3 --launch-count 1 python benchmarks/one_step.py 0
"""

import harness
from bench_attention import SUITE, attention_step, command_line
from bench_block import DTYPE, randomized, triangle_inputs

import evoformer_blocks as eb


def triangle_step(n_res: int, backward: bool):
    """One call of TriangleMultiplicationOutgoing(128, 128) on the triangle sweep's inputs
    (bench_block.triangle_inputs), forward or forward+backward."""
    z, mask = triangle_inputs(n_res)
    module = randomized(eb.TriangleMultiplicationOutgoing(128, 128)).to("cuda", DTYPE)
    return harness.make_step(lambda: module(z, mask), [z, *module.parameters()], backward=backward)


def main() -> None:
    cli = command_line(__doc__, default_shapes="0", default_impls=["cutlass"], positional=True, json_output=False)
    cli.add_argument("mode", nargs="?", choices=("fwd", "fwdbwd"), default="fwdbwd",
                     help="forward only, or forward+backward (default)")
    cli.add_argument("--triangle", type=int, default=0, help="N_res: run the triangle multiplication instead")
    args = cli.parse()
    backward = args.mode == "fwdbwd" and not args.forward_only
    if args.triangle:
        harness.warm_up(triangle_step(args.triangle, backward), iters=5)
        print("done triangle multiplication N_res", args.triangle, "forward+backward" if backward else "forward")
        return
    for index in args.shapes:
        for impl in args.impls:
            harness.warm_up(attention_step(impl, SUITE[index], backward=backward), iters=5)
            print("done", SUITE[index].name, impl, "forward+backward" if backward else "forward", flush=True)


if __name__ == "__main__":
    main()
