"""float32 attention on the suite: the fused TF32 kernels against eager float32 with and without TF32
matmuls, forward and forward+backward time, peak memory and accuracy, all in one process.

Implementations (float32 q, k, v and biases; 10 % of keys masked as 1e9 * (mask - 1)):
    cutlass     the fused kernels (the portable family on every GPU: TF32 tensor cores)
    eager_tf32  the eager backend with torch.backends.cuda.matmul.allow_tf32 = True
    eager       the eager backend in float32 (TF32 matmuls off, PyTorch's default)
Accuracy: the relative error ||x - ref|| / ||ref|| of the output and of each gradient (dO all ones)
against the eager backend in float64, on the first eight rows N of the shape (the float64 reference
of a whole shape would not fit). Shapes: the attention suite, plus its last shape at D = 128 (the
largest head-dim bucket).

    python benchmarks/bench_float32.py [--shapes all|0,1] [--impls cutlass,eager_tf32,eager] [--json out.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import SUITE, Shape, grad_leaves, make_inputs  # noqa: E402
from harness import CommandLine, Impl, fmt, markdown_table, measure, run_info_line, speedup, write_json  # noqa: E402

from evoformer_blocks import ops  # noqa: E402

TF32 = {"cutlass": False, "eager_tf32": True, "eager": False}  # allow_tf32 while each one runs
IMPLS = {name: Impl(name, lambda q, k, v, m, p, backend=("eager" if name != "cutlass" else "cutlass"):
                    ops.evoformer_attention(q, k, v, m, p, backend=backend)) for name in TF32}
ERROR_ROWS = 8
SHAPES = SUITE + [Shape("MSA row N128 L384 H8 D128", 128, 384, 8, 128, True)]


def errors(impl: str, inputs) -> list[float]:
    """Relative errors of (out, dq, dk, dv, d pair_bias) against float64 eager on ERROR_ROWS rows."""
    sub = [None if t is None else (t[:, :ERROR_ROWS] if t.dim() == 5 and t.shape[1] > 1 else t) for t in inputs]

    def run(backend, cast):
        leaves = [None if t is None else t.detach().to(cast).requires_grad_(i != 3) for i, t in enumerate(sub)]
        out = ops.evoformer_attention(*leaves, backend=backend)
        out.backward(torch.ones_like(out))
        return [out] + [t.grad for i, t in enumerate(leaves) if t is not None and i != 3]

    ref = run("eager", torch.float64)
    got = run("cutlass" if impl == "cutlass" else "eager", torch.float32)
    return [((x.double() - r).norm() / r.norm()).item() for x, r in zip(got, ref)]


def main() -> None:
    cli = CommandLine(__doc__, shapes=[s.name for s in SHAPES], impls=list(IMPLS))
    args = cli.parse()
    print(run_info_line(), flush=True)
    results, table = [], []
    for index in args.shapes:
        shape = SHAPES[index]
        inputs = make_inputs(shape, torch.float32)
        row = {"shape": shape.name, "impls": {}}
        for name in args.impls:
            previous = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = TF32[name]
            try:
                result = measure(IMPLS[name], inputs, grad_leaves(inputs), forward_only=args.forward_only)
                errs = errors(name, inputs) if result.ok else []
            finally:
                torch.backends.cuda.matmul.allow_tf32 = previous
            row["impls"][name] = dict(result.as_dict(), errors=errs)
            table.append([shape.name, name, result.cell(), fmt(result.peak_mib, 0) if result.ok else "–",
                          " / ".join(f"{e:.1e}" for e in errs) or "–"])
            print(f"  {shape.name} {name}: {result.cell()}", flush=True)
        impls = row["impls"]
        if "cutlass" in impls and "eager" in impls:
            c, e = impls["cutlass"], impls["eager"]
            print(f"  cutlass over eager: fwd {speedup(e.get('fwd_ms'), c.get('fwd_ms'))}, "
                  f"f+b {speedup(e.get('fwdbwd_ms'), c.get('fwdbwd_ms'))}", flush=True)
        results.append(row)
        del inputs
        torch.cuda.empty_cache()
    print(markdown_table(["shape", "impl", "fwd / fwd+bwd ms", "peak MiB f+b",
                          "rel. error out / dq / dk / dv (/ d pair)"], table), flush=True)
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
