"""Host (CPU) time to enqueue one forward+backward versus its GPU time, per implementation: a call
whose enqueue time exceeds its GPU time is host-bound.

    python benchmarks/host_overhead.py [SHAPE_INDICES, default 2] [IMPLS, default cutlass,flex] [profile]
    python benchmarks/host_overhead.py --shapes 0,2,5 --impls cutlass,flex,sdpa --profile

With `profile`, also prints where the host time of the first implementation goes (cProfile,
cumulative, 20 calls).
"""

import cProfile
import pstats

import torch

import harness
from bench_attention import SUITE, attention_step, command_line


def main() -> None:
    cli = command_line(__doc__, default_shapes="2", default_impls=["cutlass", "flex"], positional=True)
    cli.add_argument("profile", nargs="?", choices=("profile",), help="the same as --profile")
    cli.add_argument("--profile", dest="cprofile", action="store_true",
                     help="cProfile the host time of the first implementation")
    args = cli.parse()
    print(harness.run_info_line(), flush=True)
    backward = not args.forward_only
    results = []
    for index in args.shapes:
        shape = SUITE[index]
        for impl in args.impls:
            try:
                step = attention_step(impl, shape, backward=backward)
                harness.warm_up(step, iters=10)
                host_ms, gpu_ms = harness.host_and_gpu_ms(step, iters=50)
            except Exception as exc:  # a peer that cannot run this shape
                results.append({"shape": shape.name, "impl": impl, "error": harness.failure_reason(exc)})
                print(f"{shape.name:28s} {impl:12s} fails: {results[-1]['error']}", flush=True)
                continue
            results.append({"shape": shape.name, "impl": impl, "host_ms": host_ms, "gpu_ms": gpu_ms})
            print(f"{shape.name:28s} {impl:12s} host enqueue {host_ms:.3f} ms/iter, GPU {gpu_ms:.3f} ms/iter"
                  f"{'  (host-bound when not queued ahead)' if host_ms > gpu_ms else ''}", flush=True)
            if (args.profile or args.cprofile) and impl == args.impls[0]:
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(20):
                    step()
                profiler.disable()
                torch.cuda.synchronize()
                pstats.Stats(profiler).sort_stats("cumulative").print_stats(28)
    if args.json:
        harness.write_json(args.json, results, backward=backward)


if __name__ == "__main__":
    main()
