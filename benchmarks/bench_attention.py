"""Times evoformer_attention against its peers on the suite of ../shared/ANCHORS.md, in one process.

For each shape: the cutlass backend (on a Hopper GPU also with its portable sm80 kernels,
"cutlass-sm80"), FlexAttention (torch.compile'd, a score_mod that adds both
biases), SDPA (mask + pair bias materialized as one [B*N, H, L, L] attn_mask) and the eager backend.
Forward and forward+backward (gradients of q, k, v and the pair bias) are timed with
triton.testing.do_bench (median, L2 flushed before each run); peak extra memory is the CUDA
allocator's peak during one forward+backward above what the inputs hold. The cutlass output's
error against an fp32 reference is printed too.

    python benchmarks/bench_attention.py [--shapes all|quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from evoformer_blocks import ops  # noqa: E402

EXP_PER_S = 132 * 16 * 1.83e9  # H100 SXM MUFU.EX2 throughput (ANCHORS.md)
MMA_FLOP_PER_S = 989e12  # H100 SXM dense bf16


@dataclass(frozen=True)
class Shape:
    name: str
    rows: int  # N
    length: int  # L
    heads: int
    head_dim: int
    pair: bool
    batch: int = 1

    @property
    def elements(self) -> int:  # score elements B*N*H*L*L
        return self.batch * self.rows * self.heads * self.length**2

    def floors_ms(self) -> tuple[float, float]:
        """Forward and forward+backward floors (ANCHORS.md): exp unit vs tensor cores, whichever binds."""
        e = self.elements
        fwd = max(e / EXP_PER_S, 4 * self.head_dim * e / MMA_FLOP_PER_S)
        bwd = max(e / EXP_PER_S, 10 * self.head_dim * e / MMA_FLOP_PER_S)
        return fwd * 1e3, (fwd + bwd) * 1e3

    def flops(self) -> tuple[float, float]:
        fwd = 4 * self.head_dim * self.elements
        return fwd, 3.5 * fwd  # backward counted as 2.5x the forward (FlashAttention convention)


SUITE = [
    Shape("MSA row N512 L256 H8 D32", 512, 256, 8, 32, True),
    Shape("MSA col N256 L512 H8 D32", 256, 512, 8, 32, False),
    Shape("triangle N256 H4 D32", 256, 256, 4, 32, True),
    Shape("triangle N384 H4 D32", 384, 384, 4, 32, True),
    Shape("triangle N768 H4 D32", 768, 768, 4, 32, True),
    Shape("MSA row N128 L384 H8 D64", 128, 384, 8, 64, True),
]


def make_inputs(shape: Shape, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, n, l, h, d = shape.batch, shape.rows, shape.length, shape.heads, shape.head_dim
    q, k, v = (torch.randn(b, n, l, h, d, generator=gen, device="cuda").to(dtype) for _ in range(3))
    keep = torch.rand(b, n, 1, 1, l, generator=gen, device="cuda") > 0.1  # 10 % of keys off
    mask_bias = (1e9 * (keep.to(dtype) - 1)).to(dtype)
    pair_bias = torch.randn(b, 1, h, l, l, generator=gen, device="cuda").to(dtype) if shape.pair else None
    return q, k, v, mask_bias, pair_bias


# ---- implementations: f(q, k, v, mask_bias, pair_bias) -> out [B, N, L, H, D] -------------------
def run_cutlass(q, k, v, m, p):
    return ops.evoformer_attention(q, k, v, m, p, backend="cutlass")


def run_cutlass_sm80(q, k, v, m, p):
    """The cutlass backend with its portable (sm80) kernels, also on a Hopper GPU: make_step runs
    forward and backward with ``run_cutlass_sm80.env`` set."""
    return run_cutlass(q, k, v, m, p)


run_cutlass_sm80.env = {"EVOFORMER_BLOCKS_KERNELS": "sm80"}


@contextlib.contextmanager
def environment(variables: dict[str, str]):
    """Sets environment variables for the duration of a block."""
    previous = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def run_eager(q, k, v, m, p):
    return ops.evoformer_attention(q, k, v, m, p, backend="eager")


def run_sdpa(q, k, v, m, p):
    b, n, l, h, d = q.shape
    qh, kh, vh = (t.transpose(2, 3).reshape(b * n, h, l, d) for t in (q, k, v))  # [B*N, H, L, D]
    bias = m if p is None else m + p  # [B, N, H|1, L, L]
    bias = bias.expand(b, n, h, l, l).reshape(b * n, h, l, l)
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias)
    return out.reshape(b, n, h, l, d).transpose(2, 3)


_flex = None
_score_mods: dict = {}


def _score_mod(m, p, n):
    """One score_mod per bias pair, built once: a new closure per call would make torch.compile
    recompile until it gives up and runs flex_attention unfused."""
    key = (id(m), id(p), p is not None and p.requires_grad)  # the captured view must track grad
    if key not in _score_mods:
        b, l = m.shape[0], m.shape[-1]
        mask_flat = m.reshape(b * n, l)  # [B*N, Lk]
        if p is None:

            def score_mod(score, bi, hi, qi, ki):
                return score + mask_flat[bi, ki]

        elif b == 1:  # the suite's case: index the shared pair bias without a division
            pair = p.reshape(p.shape[2], l, l)  # [H, Lq, Lk]

            def score_mod(score, bi, hi, qi, ki):
                return score + mask_flat[bi, ki] + pair[hi, qi, ki]

        else:
            pair = p.reshape(b, p.shape[2], l, l)  # [B, H, Lq, Lk]

            def score_mod(score, bi, hi, qi, ki):
                return score + mask_flat[bi, ki] + pair[bi // n, hi, qi, ki]

        _score_mods[key] = (score_mod, m, p)  # keep the tensors alive while the closure is cached
    return _score_mods[key][0]


def run_flex(q, k, v, m, p):
    global _flex
    from torch.nn.attention.flex_attention import flex_attention

    if _flex is None:
        # One compiled flex_attention serves every shape and grad mode of the suite: lift dynamo's
        # recompile limit, or it silently falls back to the unfused (materializing) path.
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 4096)
        # dynamic=False: every shape gets its own static-shape kernel, as in a training run with a
        # fixed crop; otherwise the second shape seen turns the sizes symbolic and every later shape
        # runs a generic kernel several times slower than Flex's real one.
        _flex = torch.compile(flex_attention, dynamic=False)
    b, n, l, h, d = q.shape
    qh, kh, vh = (t.transpose(2, 3).reshape(b * n, h, l, d) for t in (q, k, v))  # [B*N, H, L, D]
    out = _flex(qh, kh, vh, score_mod=_score_mod(m, p, n))
    return out.reshape(b, n, h, l, d).transpose(2, 3)


IMPLS = {"cutlass": run_cutlass, "cutlass-sm80": run_cutlass_sm80, "flex": run_flex, "sdpa": run_sdpa, "eager": run_eager}


def make_step(fn, inputs, backward: bool, pair_grad: bool = True):
    """(step, leaves): step() runs fn's forward and, with `backward`, the gradients of q, k, v and
    (with `pair_grad`) the pair bias for one fixed random dout. `leaves` had requires_grad set to
    `backward`."""
    q, k, v, m, p = inputs
    leaves = [q, k, v] + ([p] if p is not None and pair_grad else [])
    for t in leaves:
        t.requires_grad_(backward)
    dout = torch.randn_like(q) if backward else None

    env = getattr(fn, "env", {})

    def step():
        with environment(env):
            out = fn(q, k, v, m, p)
            if backward:
                torch.autograd.grad(out, leaves, dout)
        return out

    return step, leaves


def bench(fn, inputs, backward: bool) -> tuple[float, float]:
    """(median ms, peak extra MiB) of forward or forward+backward."""
    from triton.testing import do_bench

    step, leaves = make_step(fn, inputs, backward)
    step()  # compile / build / warm up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    ms = do_bench(step, warmup=50, rep=300, return_mode="median")
    for t in leaves:
        t.requires_grad_(False)
    return ms, peak


def accuracy(inputs) -> float:
    q, k, v, m, p = inputs
    with torch.no_grad():
        out = run_cutlass(q, k, v, m, p).float()
        ref = run_eager(q.float(), k.float(), v.float(), m.float(), None if p is None else p.float())
    return ((out - ref).norm() / ref.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="all", help="'all', or comma-separated indices into the suite")
    parser.add_argument("--impls", default=None,
                        help="comma-separated, from " + ", ".join(IMPLS) + " (default: all; cutlass-sm80 only on a Hopper GPU)")
    parser.add_argument("--json", default=None, help="write all numbers here")
    parser.add_argument("--forward-only", action="store_true", help="skip forward+backward (quick A/B of forward kernels)")
    args = parser.parse_args()
    shapes = SUITE if args.shapes == "all" else [SUITE[int(i)] for i in args.shapes.split(",")]
    hopper = torch.cuda.get_device_capability() == (9, 0)
    impls = args.impls.split(",") if args.impls else [i for i in IMPLS if hopper or i != "cutlass-sm80"]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    results = []
    for shape in shapes:
        inputs = make_inputs(shape)
        row = {"shape": shape.name, "elements": shape.elements, "error_vs_fp32": accuracy(inputs)}
        floor_f, floor_fb = shape.floors_ms()
        flop_f, flop_fb = shape.flops()
        row["floor_ms"] = (floor_f, floor_fb)
        for impl in impls:
            try:
                f_ms, _ = bench(IMPLS[impl], inputs, backward=False)
                fb_ms, mib = (float("nan"), float("nan")) if args.forward_only else bench(IMPLS[impl], inputs, backward=True)
                row[impl] = {"fwd_ms": f_ms, "fwdbwd_ms": fb_ms, "peak_mib": mib}
            except Exception as exc:  # a peer failing on a shape is a result, not a crash
                row[impl] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
            torch.cuda.empty_cache()
        results.append(row)
        print(f"\n## {shape.name}  (score elements {shape.elements:.3g}; cutlass error vs fp32 {row['error_vs_fp32']:.2e})")
        print("| impl | fwd ms | fwd+bwd ms | peak extra MiB | fwd TFLOP/s | fwd % floor | f+b % floor |")
        print("|---|---|---|---|---|---|---|")
        for impl in impls:
            r = row[impl]
            if "error" in r:
                print(f"| {impl} | fails: {r['error']} | | | | | |")
                continue
            print(
                f"| {impl} | {r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | {r['peak_mib']:.0f} | "
                f"{flop_f / r['fwd_ms'] / 1e9:.0f} | {100 * floor_f / r['fwd_ms']:.0f} % | {100 * floor_fb / r['fwdbwd_ms']:.0f} % |"
            )
        if "cutlass" in impls and "error" not in row["cutlass"]:
            c = row["cutlass"]
            ratios = []
            for impl in impls:
                if impl != "cutlass" and "error" not in row[impl]:
                    ratios.append(
                        f"{impl}: fwd {row[impl]['fwd_ms'] / c['fwd_ms']:.2f}x, fwd+bwd {row[impl]['fwdbwd_ms'] / c['fwdbwd_ms']:.2f}x"
                    )
            print("speed-up of cutlass over " + "; ".join(ratios), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
