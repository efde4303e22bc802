"""Times evoformer_attention against its peers on the attention suite, in one process.

For each shape of SUITE: the cutlass backend (on a GPU where it runs its Hopper kernels also with its
portable sm80 kernels, "cutlass-sm80", forward and backward), FlexAttention (torch.compile'd, a
score_mod that adds both biases), SDPA (mask + pair bias materialized as one [B*N, H, L, L]
attn_mask) and the eager backend. Forward and forward+backward (gradients of q, k, v and the pair
bias) are timed with triton.testing.do_bench (median, L2 flushed before each run); peak extra memory
is the CUDA allocator's peak during one forward+backward above what the inputs hold; % of floor is
the H100's exp-unit / tensor-core floor (Shape.floors_ms) over the measured time. The cutlass
output's error against an fp32 reference is printed too. On an H100 the stored numbers of the peers
that do not run in this process (cuEquivariance, trifast, DeepSpeed; RESULTS.md, "Peers") are
printed under each shape, without ratios.

    python benchmarks/bench_attention.py [--shapes all|0,4] [--impls cutlass,flex] [--json out.json] [--forward-only]
    python benchmarks/bench_attention.py --baseline REV [--gated] [--rounds 5] [--shapes ...] [--forward-only]

--baseline REV: instead of the implementations, this checkout's cutlass backend against git revision
REV's (benchmarks/baseline.py: its library loaded beside this one) on the same inputs: forward and
forward+backward medians (do_bench, L2 flushed) of --rounds rounds per side, the sides alternating
within each phase, their ratio, and whether one forward+backward of each gives the same output and
gradients bit for bit. --gated times gated_evoformer_attention instead (the attention modules' op:
q, k, v and the gate g as one [B, N, L, 4 * H * D] projection, sigmoid(g) * attention), gradients of
that projection and the pair bias.

one_step.py, profile_kernels.py and host_overhead.py run single implementations on this suite
through attention_step().
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

import harness
from harness import H100_SXM, DeviceLimits, Impl
import evoformer_blocks.ops.cutlass  # noqa: E402,F401  (kernel_family)
from evoformer_blocks import ops  # noqa: E402


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

    def floors_ms(self, limits: DeviceLimits = H100_SXM) -> tuple[float, float]:
        """Forward and forward+backward floors: per score element the forward needs one exp and
        4*D matmul FLOP, the backward one exp and 10*D FLOP (FlashAttention's count); whichever
        unit binds sets the floor (at D = 32 the exp unit forward, the tensor cores backward)."""
        e = self.elements
        fwd = max(e / limits.exp_per_s, 4 * self.head_dim * e / limits.dense_bf16_flops)
        bwd = max(e / limits.exp_per_s, 10 * self.head_dim * e / limits.dense_bf16_flops)
        return fwd * 1e3, (fwd + bwd) * 1e3

    def flops(self) -> tuple[float, float]:
        fwd = 4 * self.head_dim * self.elements
        return fwd, 3.5 * fwd  # backward counted as 2.5x the forward (FlashAttention convention)


# The suite: the six shapes the peers below were measured on. Add shapes, never remove one.
SUITE = [
    Shape("MSA row N512 L256 H8 D32", 512, 256, 8, 32, True),
    Shape("MSA col N256 L512 H8 D32", 256, 512, 8, 32, False),
    Shape("triangle N256 H4 D32", 256, 256, 4, 32, True),
    Shape("triangle N384 H4 D32", 384, 384, 4, 32, True),
    Shape("triangle N768 H4 D32", 768, 768, 4, 32, True),
    Shape("MSA row N128 L384 H8 D64", 128, 384, 8, 64, True),
]

# Peers that do not run in this process, measured side by side on an H100 80GB HBM3, 2026-11-22,
# torch 2.11+cu130, bf16, same inputs: forward ms / forward+backward ms / extra peak MiB. The
# table is RESULTS.md's "Peers" section.
H100_PEERS_DATE = "2026-11-22"
H100_PEERS = {
    "MSA row N512 L256 H8 D32": {"cuEquivariance 0.13": "0.455 / 2.66 / 208", "DeepSpeed": "0.985 / 4.86 / 329"},
    "MSA col N256 L512 H8 D32": {"cuEquivariance 0.13": "0.845 / 4.78 / 216", "DeepSpeed": "1.526 / 4.65 / 328"},
    "triangle N256 H4 D32": {"cuEquivariance 0.13": "0.197 / 1.28 / 52", "trifast 0.1.13": "0.309 / 1.87 / 19",
                             "DeepSpeed": "0.259 / 1.45 / 82"},
    "triangle N384 H4 D32": {"cuEquivariance 0.13": "0.376 / 2.13 / 117", "trifast 0.1.13": "0.287 / 1.55 / 42",
                             "DeepSpeed": "0.807 / 4.28 / 186"},
    "triangle N768 H4 D32": {"cuEquivariance 0.13": "2.770 / 15.6 / 469", "trifast 0.1.13": "1.937 / 10.3 / 167",
                             "DeepSpeed": "6.194 / 33.0 / 742"},
    "MSA row N128 L384 H8 D64": {"cuEquivariance 0.13": "0.328 / 1.92 / 151", "DeepSpeed": "0.601 / 3.15 / 149"},
}


def make_inputs(shape: Shape, dtype=torch.bfloat16, seed=0, device="cuda"):
    """(q, k, v, mask_bias, pair_bias): 10 % of keys masked as 1e9 * (mask - 1); pair_bias None for
    shapes without one."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b, n, l, h, d = shape.batch, shape.rows, shape.length, shape.heads, shape.head_dim
    q, k, v = (torch.randn(b, n, l, h, d, generator=gen, device=device).to(dtype) for _ in range(3))
    keep = torch.rand(b, n, 1, 1, l, generator=gen, device=device) > 0.1
    mask_bias = (1e9 * (keep.to(dtype) - 1)).to(dtype)
    pair_bias = torch.randn(b, 1, h, l, l, generator=gen, device=device).to(dtype) if shape.pair else None
    return q, k, v, mask_bias, pair_bias


def grad_leaves(inputs, pair_grad: bool = True) -> list[torch.Tensor]:
    """The tensors the backward differentiates: q, k, v and (with `pair_grad`) the pair bias."""
    q, k, v, _, p = inputs
    return [q, k, v] + ([p] if p is not None and pair_grad else [])


# ---- implementations: f(q, k, v, mask_bias, pair_bias) -> out [B, N, L, H, D] -------------------
def run_cutlass(q, k, v, m, p):
    return ops.evoformer_attention(q, k, v, m, p, backend="cutlass")


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


IMPLS = {
    "cutlass": Impl("cutlass", run_cutlass),
    # the same op with its portable kernels, forward and backward, also on a Hopper GPU
    "cutlass-sm80": Impl("cutlass-sm80", run_cutlass, env={"EVOFORMER_BLOCKS_KERNELS": "sm80"}),
    "flex": Impl("flex", run_flex, requires=("triton", "torch.nn.attention.flex_attention")),
    "sdpa": Impl("sdpa", run_sdpa),
    "eager": Impl("eager", run_eager),
}


def hopper_kernels() -> bool:
    """Whether the cutlass backend runs its Hopper kernels here (builds the kernels)."""
    try:
        return ops.cutlass.kernel_family() == "sm90"
    except Exception:  # no build: the cutlass rows say why
        return False


def default_impls() -> list[str]:
    """all; cutlass-sm80 only where cutlass runs its Hopper kernels"""
    return [name for name in IMPLS if name != "cutlass-sm80" or hopper_kernels()]


def command_line(doc: str, **options) -> harness.CommandLine:
    """The harness command line over this suite and these implementations (options: see CommandLine)."""
    return harness.CommandLine(doc, shapes=[s.name for s in SUITE], impls=list(IMPLS), **options)


def attention_step(impl: str, shape: Shape, *, backward: bool, pair_grad: bool = True, seed: int = 0):
    """A harness step of one implementation on new inputs of `shape` (for ncu, profilers, host time)."""
    inputs = make_inputs(shape, seed=seed)
    return harness.make_step(lambda: IMPLS[impl].run(*inputs), grad_leaves(inputs, pair_grad), backward=backward,
                             env=IMPLS[impl].env)


def accuracy(inputs) -> float:
    """Relative error of the cutlass output against an fp32 eager reference (NaN if cutlass fails)."""
    q, k, v, m, p = inputs
    try:
        with torch.no_grad():
            out = run_cutlass(q, k, v, m, p).float()
            ref = run_eager(q.float(), k.float(), v.float(), m.float(), None if p is None else p.float())
    except Exception:
        return math.nan
    return ((out - ref).norm() / ref.norm()).item()


# ---- --baseline: this checkout's backend against a git revision's ---------------------------------
def baseline_calls(shape: Shape, revision: str, *, gated: bool, backend: str = "cutlass", device="cuda",
                   dtype=torch.bfloat16, seed: int = 0):
    """The attention of this checkout and of revision ``revision`` (benchmarks/baseline.py) on one
    set of inputs of ``shape``: ({"ours": call, "baseline": call}, leaves), each call running the
    ``backend`` of its library. Plain: evoformer_attention(q, k, v, mask_bias, pair_bias), leaves
    q, k, v and the pair bias. ``gated``: gated_evoformer_attention(qkvg, H, mask_bias, pair_bias),
    qkvg [B, N, L, 4 * H * D] made of q, k, v and a random gate, leaves qkvg and the pair bias."""
    import importlib

    import baseline

    theirs = importlib.import_module(baseline.load(revision).__name__ + ".ops")
    q, k, v, m, p = inputs = make_inputs(shape, dtype, seed, device)
    leaves = grad_leaves(inputs)
    if gated:
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        g = torch.randn(q.shape, generator=gen, device=device).to(dtype)
        qkvg = torch.cat([t.flatten(-2) for t in (q, k, v, g)], dim=-1)  # [B, N, L, 4 H D]
        leaves = [qkvg] + leaves[3:]

    def side(lib):  # the call of one library's op
        if gated:
            return lambda: lib.gated_evoformer_attention(qkvg, shape.heads, m, p, backend=backend)
        return lambda: lib.evoformer_attention(q, k, v, m, p, backend=backend)

    return {"ours": side(ops), "baseline": side(theirs)}, leaves


def baseline_bitwise(calls: dict, leaves: list[torch.Tensor]) -> bool:
    """Whether one forward+backward of each side (the same cotangent) gives the same output and the
    same gradients of ``leaves``, bit for bit."""
    results = []
    for t in leaves:
        t.requires_grad_(True)
    for call in calls.values():
        out = call()
        dout = torch.randn(out.shape, generator=torch.Generator(device=out.device).manual_seed(7),
                           device=out.device).to(out.dtype)
        results.append([out.detach(), *torch.autograd.grad(out, leaves, dout)])
    return all(torch.equal(a, b) for a, b in zip(*results))


def against_baseline(shape: Shape, revision: str, *, gated: bool, rounds: int, forward_only: bool) -> dict:
    """--baseline on one shape (the module docstring says what is reported)."""
    calls, leaves = baseline_calls(shape, revision, gated=gated)
    row = {"shape": shape.name, "revision": revision, "gated": gated,
           "bitwise_equal": baseline_bitwise(calls, leaves)}
    for phase, backward in (("fwd", False), ("fwdbwd", True)):
        if backward and forward_only:
            continue
        steps = {side: harness.make_step(call, leaves, backward=backward) for side, call in calls.items()}
        for side, ms in harness.alternating_rounds(steps, rounds, harness.median_ms).items():
            row[f"{side}_{phase}_ms"], row[f"{side}_{phase}_ms_all"] = statistics.median(ms), ms
        row[f"{phase}_ratio"] = row[f"ours_{phase}_ms"] / row[f"baseline_{phase}_ms"]
    return row


def print_baseline(rows: list[dict]) -> None:
    """The --baseline table: ms ours / the revision's and their ratio, per phase."""
    def cell(row, phase):
        if f"{phase}_ratio" not in row:
            return "–"
        return (f"{harness.fmt(row[f'ours_{phase}_ms'])} / {harness.fmt(row[f'baseline_{phase}_ms'])} "
                f"({row[f'{phase}_ratio']:.4f})")
    revision, op = rows[0]["revision"], "gated_evoformer_attention" if rows[0]["gated"] else "evoformer_attention"
    print(f"\n## {op}, cutlass: this checkout against {revision} (medians of the rounds; ours / {revision} ms)")
    print(harness.markdown_table(["shape", "fwd", "fwd+bwd", "output and gradients bitwise equal"],
                                 [[r["shape"], cell(r, "fwd"), cell(r, "fwdbwd"), r["bitwise_equal"]] for r in rows]))


def print_shape(shape: Shape, row: dict, impls: list[str], on_h100: bool) -> None:
    floor_f, floor_fb = row["floor_ms"]
    flop_f, _ = shape.flops()
    print(f"\n## {shape.name}  (score elements {shape.elements:.3g}; cutlass error vs fp32 {row['error_vs_fp32']:.2e})")
    rows = []
    for name in impls:
        r = harness.Measurement(**row[name])
        if not r.ok:
            rows.append([name, f"fails: {r.error}", "", "", "", "", ""])
            continue
        rows.append([name, harness.fmt(r.fwd_ms), harness.fmt(r.fwdbwd_ms), harness.fmt(r.peak_mib, 0),
                     harness.fmt(flop_f / r.fwd_ms / 1e9, 0), f"{harness.fmt(100 * floor_f / r.fwd_ms, 0)} %",
                     f"{harness.fmt(100 * floor_fb / r.fwdbwd_ms, 0)} %"])
    print(harness.markdown_table(
        ["impl", "fwd ms", "fwd+bwd ms", "peak extra MiB", "fwd TFLOP/s", "fwd % floor", "f+b % floor"], rows))
    ours = harness.Measurement(**row["cutlass"]) if "cutlass" in impls else None
    if ours is not None and ours.ok:
        ratios = []
        for name in impls:
            other = harness.Measurement(**row[name])
            if name != "cutlass" and other.ok:
                ratios.append(f"{name}: fwd {harness.speedup(other.fwd_ms, ours.fwd_ms)}, "
                              f"fwd+bwd {harness.speedup(other.fwdbwd_ms, ours.fwdbwd_ms)}")
        print("speed-up of cutlass over " + "; ".join(ratios))
    if on_h100 and shape.name in H100_PEERS:
        stored = "; ".join(f"{peer} {cell}" for peer, cell in H100_PEERS[shape.name].items())
        print(f"stored H100 peers ({H100_PEERS_DATE}, another process; fwd / fwd+bwd ms / MiB): {stored}")


def main() -> None:
    cli = command_line(__doc__, default_impls=default_impls)
    cli.add_argument("--baseline", default="", metavar="REV",
                     help="time this checkout's cutlass backend against revision REV's instead (see above)")
    cli.add_argument("--gated", action="store_true", help="with --baseline: gated_evoformer_attention")
    cli.add_argument("--rounds", type=int, default=5, help="with --baseline: rounds per side and phase (default 5)")
    args = cli.parse()
    if args.rounds < 1:
        cli.error("--rounds must be at least 1")
    if args.gated and not args.baseline:
        cli.error("--gated goes with --baseline")
    print(harness.run_info_line() + (", cutlass runs its Hopper kernels" if hopper_kernels() else ""), flush=True)
    if args.baseline:
        rows = []
        for index in args.shapes:
            rows.append(against_baseline(SUITE[index], args.baseline, gated=args.gated, rounds=args.rounds,
                                         forward_only=args.forward_only))
            row = rows[-1]
            print(f"{row['shape']}: ours / {args.baseline} forward {row['fwd_ratio']:.4f}"
                  + (f", forward+backward {row['fwdbwd_ratio']:.4f}" if "fwdbwd_ratio" in row else "")
                  + f"; bitwise equal: {row['bitwise_equal']}", flush=True)
        print_baseline(rows)
        if args.json:
            harness.write_json(args.json, rows)
        return
    on_h100 = "H100" in torch.cuda.get_device_name()
    results = []
    for index in args.shapes:
        shape = SUITE[index]
        inputs = make_inputs(shape)
        row = {"shape": shape.name, "elements": shape.elements, "error_vs_fp32": accuracy(inputs),
               "floor_ms": shape.floors_ms()}
        for name in args.impls:
            row[name] = harness.measure(IMPLS[name], inputs, grad_leaves(inputs),
                                        forward_only=args.forward_only).as_dict()
        results.append(row)
        print_shape(shape, row, args.impls, on_h100)
    if args.json:
        harness.write_json(args.json, results)


if __name__ == "__main__":
    main()
