"""Host (CPU) time to enqueue one forward+backward versus its GPU time, per implementation: a call
whose enqueue time exceeds its GPU time is host-bound.

    python benchmarks/host_overhead.py [suite indices, default 2] [implementations, default cutlass,flex] [profile]

With `profile`, also prints where the host time of the first implementation goes (cProfile,
cumulative, 20 calls).
"""

import cProfile
import pstats

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import IMPLS, SUITE, make_inputs, make_step  # noqa: E402


def main() -> None:
    indices = [int(i) for i in (sys.argv[1] if len(sys.argv) > 1 else "2").split(",")]
    impls = (sys.argv[2] if len(sys.argv) > 2 else "cutlass,flex").split(",")
    for index in indices:
        shape = SUITE[index]
        for impl in impls:
            step, _ = make_step(IMPLS[impl], make_inputs(shape), backward=True)
            for _ in range(10):
                step()
            torch.cuda.synchronize()
            iters = 50
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # GPU time with the queue kept full: enqueue everything behind a long sleep kernel.
            torch.cuda._sleep(400_000_000)  # ~0.2 s at H100 clocks
            start.record()
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            host_ms = (time.perf_counter() - t0) * 1e3 / iters
            end.record()
            torch.cuda.synchronize()
            gpu_ms = start.elapsed_time(end) / iters
            print(f"{shape.name:28s} {impl:8s} host enqueue {host_ms:.3f} ms/iter, GPU {gpu_ms:.3f} ms/iter"
                  f"{'  (host-bound when not queued ahead)' if host_ms > gpu_ms else ''}", flush=True)
            if len(sys.argv) > 3 and sys.argv[3] == "profile" and impl == impls[0]:
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(20):
                    step()
                profiler.disable()
                torch.cuda.synchronize()
                pstats.Stats(profiler).sort_stats("cumulative").print_stats(28)


if __name__ == "__main__":
    main()
