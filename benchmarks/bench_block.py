"""One Evoformer block as users run it: forward and forward+backward time, peak memory and model
TFLOP/s, with a per-module breakdown and module-level peers, all in one process.

Cases: EvoformerBlock at AF2 sizes (c_m 256, c_z 128, MSA attention 8 x 32, pair attention 4 x 32,
outer product mean 32, triangle multiplication 128, transitions x4) for (N_seq, N_res) = (128, 256),
(512, 384), (128, 768), and ExtraMSABlock (c_e 64, MSA attention 8 x 8, global column attention)
at (1024, 384). bf16 weights and inputs, dropout off (eval mode), masks with 5 % zeros; the loss is
the sum of both outputs (random cotangents).

Implementations of the whole block:
    default     the block as a user builds it (backend auto, no compile)
    compiled    torch.compile(block) (static shapes)
    graphs      torch.compile(block, mode="reduce-overhead") (CUDA graphs)
    graphed     torch.cuda.make_graphed_callables on a copy of the block (CUDA graphs, no compile;
                a forward with nothing requiring grad is one torch.cuda.graph capture)
    eager       the block on the eager backend (no fused kernels at all)
With --breakdown, each of the nine sub-modules alone on inputs of the block's shapes (default
backend), and, where `import cuequivariance_torch` works, its triangle multiplication and triangle
attention as module-level peers of ours on the same weights.

Model FLOPs (multiply-add = 2) come from `block_flops` below: every projection 2 * rows * in * out,
attention cores 4 * rows * H * L^2 * C (q.k and p.v), the outer product 2 * S * R^2 * c^2, the
triangle products 2 * R^3 * c; forward+backward counts 3x the forward for projections and products
(the input and the weight gradient) and 3.5x for the attention cores (recomputation).
`pairformer_block_flops` counts an AF3 Pairformer block the same way (bench_trunk.py's Pairformer
trunk).

With --triangle N[,N...], TriangleMultiplicationOutgoing and TriangleMultiplicationIncoming alone
(c_z = c_hidden = 128, z [N, N, 128], mask with 5 % zeros) at each N_res given, against
cuEquivariance's fused triangle_multiplicative_update on the same weights: time and peak memory
(instead of the block cases unless --shapes is given too).

With --host, the host (CPU) time of the default EvoformerBlock with the GPU idle: AF2 widths at
N_seq 16, N_res 64, where every kernel is short, `time.perf_counter` around the block call and around
`torch.autograd.grad` (no synchronisation inside an iteration), the median over five rounds of 20
iterations after warm-up (instead of the block cases unless --shapes is given too), four times in
one process, rounds alternating: the block's modules and residual adds + layer norms as their
one-node C++ entries called by one extension call (`module_nodes.evoformer_block`, the default), the
same entries called module by module from Python (`module_nodes.per_module()`), the modules
composing their ops (`module_nodes.composed()`), and the one call with the stacked projections'
parameters each in a storage of their own (`primitives.separate_storages`: the nodes then stack them
with a copy per call): the A/B of the one call, of the nodes and of the packed parameters. Host time is
what bounds the block at small sizes without CUDA graphs. It also counts, for the nodes, per forward and per
backward, the host operations behind that time (torch.profiler: ATen calls, nested ones included;
kernel launches; autograd nodes run): exact where the times swing between processes and machine
instances, so that host-side changes can be compared by them; where those ATen calls go (per
call of the block's code in the forward, per autograd node in the backward); and the host µs per
call of the layers beneath (`layer_costs`: torch's own calls, the extension's ops called directly,
the ops package's entries around them). With --baseline REV, a fifth side in the same rounds: revision REV's
EvoformerBlock, its library loaded beside this one under another name (benchmarks/baseline.py; its
extension builds on first use) with the same weights; it prints the one call's forward+backward over
the revision's per round and the ratio of the medians.

With --train, the blocks run in training mode: dropout at the preset's rates (AF2: 0.15 after the MSA
row attention, 0.25 after each pair update), a new mask every step, as a training step runs them
(the block cases only; dropout off otherwise).

With --profile, the CUDA kernels of one forward+backward of the default block (torch.profiler,
gradients by torch.autograd.grad as in the timing, grouped by kernel name); with --triangle too,
those of the outgoing triangle multiplication at each N_res, once per kernel family the GPU runs
(on Hopper: the Hopper kernels and the portable ones).

    python benchmarks/bench_block.py [--shapes all|0,1] [--impls default,compiled,...] [--breakdown] [--profile]
                                     [--train] [--triangle 384,768,1024] [--host [--baseline REV] [--rounds R]]
                                     [--json out.json]
"""

from __future__ import annotations

import contextlib
import inspect
import statistics
import sys
from collections import Counter
import time
from copy import deepcopy
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    H100_SXM, CommandLine, Impl, host_and_gpu_ms, kernel_breakdown, make_step, markdown_table, measure, optional_import,
    run_info_line, speedup, warm_up, write_json, fmt,
)

import baseline  # noqa: E402
import evoformer_blocks as eb  # noqa: E402
from evoformer_blocks import ops  # noqa: E402
from evoformer_blocks.ops import cutlass, module_nodes  # noqa: E402
from evoformer_blocks.config import get_config  # noqa: E402
from evoformer_blocks.primitives import pack_stacked, separate_storages  # noqa: E402

DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Case:
    name: str
    n_seq: int
    n_res: int
    extra: bool = False  # ExtraMSABlock

    def label(self) -> str:
        return f"{self.name} N_seq {self.n_seq}, N_res {self.n_res}"


CASES = [
    Case("EvoformerBlock", 128, 256),
    Case("EvoformerBlock", 512, 384),
    Case("EvoformerBlock", 128, 768),
    Case("ExtraMSABlock", 1024, 384, extra=True),
]


# The keys of a preset's stack section that configure the stack, not its blocks
STACK_KEYS = ("no_blocks", "blocks_per_ckpt", "cuda_graphs", "recompute", "recompute_budget_gib",
              "checkpoint_last_group")


def _block_arguments(section, *stack_keys: str) -> dict:
    """A preset's stack section less its :data:`STACK_KEYS` and ``stack_keys``: one block's
    constructor arguments."""
    return {key: value for key, value in dict(section).items() if key not in STACK_KEYS + stack_keys}


def block_args(extra: bool) -> dict:
    """The constructor arguments of one block of the af2 preset (dropout rates included: they act
    only in training mode)."""
    cfg = get_config("af2")
    return _block_arguments(cfg.extra_msa_stack if extra else cfg.evoformer_stack, "c_s")  # (the stack's s)


def block_flops(args: dict, n_seq: int, n_res: int, extra: bool) -> tuple[float, float]:
    """(forward, forward+backward) model FLOPs of one block (formulas in the module docstring)."""
    s, r = n_seq, n_res
    c_m, c_z, n = args["c_m"], args["c_z"], args["transition_n"]
    hm, cm = args["no_heads_msa"], args["c_hidden_msa_att"]
    hp, cp = args["no_heads_pair"], args["c_hidden_pair_att"]
    c_opm, c_mul = args["c_hidden_opm"], args["c_hidden_mul"]
    msa_rows, pair_rows = s * r, r * r
    proj = 0.0  # projections and products: backward 2x
    core = 0.0  # attention cores: backward 2.5x
    # MSA row attention with pair bias
    proj += 2 * msa_rows * c_m * hm * cm * 5 + 2 * pair_rows * c_z * hm
    core += 4 * s * hm * r * r * cm
    if extra:  # global column attention: per-head queries from the mean, one shared key/value head
        proj += 2 * msa_rows * c_m * (2 * cm + 2 * hm * cm) + 2 * r * c_m * hm * cm
        core += 4 * r * hm * s * cm
    else:
        proj += 2 * msa_rows * c_m * hm * cm * 5
        core += 4 * r * hm * s * s * cm
    proj += 2 * 2 * msa_rows * c_m * n * c_m  # MSA transition
    proj += 2 * 2 * pair_rows * c_z * n * c_z  # pair transition
    proj += 2 * 2 * msa_rows * c_m * c_opm + 2 * s * pair_rows * c_opm**2 + 2 * pair_rows * c_opm**2 * c_z  # OPM
    triangle_proj, triangle_core = triangle_flops(args, r)
    proj, core = proj + triangle_proj, core + triangle_core
    return proj + core, 3 * proj + 3.5 * core


def triangle_flops(args: dict, n_res: int) -> tuple[float, float]:
    """(projections and products, attention cores) forward FLOPs of both triangle multiplications
    and both triangle attentions of a block with ``args``' pair widths (biases are not counted, so
    the AF2 and the bias-free AF3 forms count the same)."""
    r, c_z, c_mul = n_res, args["c_z"], args["c_hidden_mul"]
    hp, cp = args["no_heads_pair"], args["c_hidden_pair_att"]
    pair_rows = r * r
    proj = 2 * (2 * pair_rows * c_z * (4 * c_mul + c_z) + 2 * r**3 * c_mul + 2 * pair_rows * c_mul * c_z)  # tri mul
    proj += 2 * (2 * pair_rows * c_z * hp * cp * 5 + 2 * pair_rows * c_z * hp)  # tri attention projections
    core = 2 * 4 * r * hp * r * r * cp
    return proj, core


def pairformer_block_args() -> dict:
    """The constructor arguments of one PairformerBlock of the af3 preset (its dropout rate
    included: it acts only in training mode)."""
    return _block_arguments(get_config("af3").pairformer_stack)


def pairformer_block_flops(args: dict, n_token: int) -> tuple[float, float]:
    """(forward, forward+backward) model FLOPs of one AF3 Pairformer block at ``n_token`` tokens,
    counted as :func:`block_flops` counts an Evoformer block: the triangle updates as there, each
    SwiGLU transition 3 projections of c x (n c) per row (pair rows N^2, single rows N), the
    attention with pair bias 5 projections of c_s x (H C) per token (q, k, v, gate, output), its
    pair bias 2 N^2 c_z H and its core 4 H N^2 C (one row of N queries); backward 2x the forward
    for projections and products, 2.5x for the attention cores."""
    n, c_s, c_z, t = n_token, args["c_s"], args["c_z"], args["transition_n"]
    hs, cs = args["no_heads_pair_bias"], args["c_hidden_pair_bias"]
    proj, core = triangle_flops(args, n)
    proj += 3 * 2 * n * n * c_z * t * c_z  # pair transition
    proj += 5 * 2 * n * c_s * hs * cs + 2 * n * n * c_z * hs  # attention with pair bias: projections, pair bias
    core += 4 * hs * n * n * cs
    proj += 3 * 2 * n * c_s * t * c_s  # single transition
    return proj + core, 3 * proj + 3.5 * core


def pct_of_peak(tflops: float) -> float:
    """TFLOP/s as a percentage of the H100's dense bf16 rate."""
    return 100 * tflops * 1e12 / H100_SXM.dense_bf16_flops


def randomized(module: torch.nn.Module) -> torch.nn.Module:
    """Random weights: the zero-initialised output and gate layers would make updates vanish."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 / max(1, p.shape[-1]) ** 0.5) + (p.dim() == 1) * 1.0)
    return module


def build(case: Case, train: bool = False):
    """The case's block (eval mode: dropout off; with `train`, training mode) and its inputs."""
    args = block_args(case.extra)
    cls = eb.ExtraMSABlock if case.extra else eb.EvoformerBlock
    block = randomized(cls(**args)).to("cuda", DTYPE).train(train)
    gen = torch.Generator(device="cuda").manual_seed(0)
    m = torch.randn(case.n_seq, case.n_res, args["c_m"], generator=gen, device="cuda").to(DTYPE)
    z = torch.randn(case.n_res, case.n_res, args["c_z"], generator=gen, device="cuda").to(DTYPE)
    msa_mask = (torch.rand(case.n_seq, case.n_res, generator=gen, device="cuda") > 0.05).to(DTYPE)
    pair_mask = (torch.rand(case.n_res, case.n_res, generator=gen, device="cuda") > 0.05).to(DTYPE)
    return args, block, m, z, msa_mask, pair_mask


_compiled: dict = {}


def compiled(block, mode=None):
    key = (id(block), mode)
    if key not in _compiled:
        # Every case and grad mode compiles the same forward code again: lift dynamo's recompile
        # limit, or later cases silently run uncompiled.
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 4096)
        _compiled[key] = torch.compile(block, mode=mode, dynamic=False)
    return _compiled[key]


def run_default(block, m, z, msa_mask, pair_mask):
    return block(m, z, msa_mask, pair_mask)


def run_compiled(block, m, z, msa_mask, pair_mask):
    return compiled(block)(m, z, msa_mask, pair_mask)


def run_graphs(block, m, z, msa_mask, pair_mask):
    out = compiled(block, "reduce-overhead")(m, z, msa_mask, pair_mask)
    return tuple(t.clone() for t in out)  # graph outputs are overwritten by the next replay


def _forward_graph(fn, args):
    """fn(*args) captured once in a CUDA graph (nothing requires grad); the returned callable copies
    its arguments into the captured inputs and replays."""
    static = [a.clone() for a in args]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph asks
        for _ in range(3):
            fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)

    def replay(*new_args):
        for dst, src in zip(static, new_args):
            dst.copy_(src)
        graph.replay()
        return out

    return replay


def run_graphed(block, m, z, msa_mask, pair_mask):
    # A copy of the block (same weights), so that the other implementations keep the plain module:
    # make_graphed_callables replaces a module's forward. The copy's parameters follow the
    # requires_grad of the block's (the step sets them), and one graph is captured per combination.
    needs_grad = next(block.parameters()).requires_grad
    key = (needs_grad, m.requires_grad, z.requires_grad, block.training)
    _graphed = block.__dict__.setdefault("_bench_graphed", {})  # lives and dies with the block
    if key not in _graphed:
        copy = deepcopy(block)
        for p in copy.parameters():
            p.requires_grad_(needs_grad)
        # fresh leaves as the capture's samples: the callers' m and z may carry autograd state of an
        # earlier implementation in this process (torch.compile's CUDA graphs run their backward on
        # another stream, and the capture then fails on their gradient-accumulation nodes)
        args = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in (m, z, msa_mask, pair_mask))
        if needs_grad or m.requires_grad or z.requires_grad:
            _graphed[key] = torch.cuda.make_graphed_callables(copy, args)
        else:
            _graphed[key] = _forward_graph(copy, args)
    out = _graphed[key](m, z, msa_mask, pair_mask)
    return tuple(t.clone() for t in out)  # graph outputs are overwritten by the next replay


def run_eager(block, m, z, msa_mask, pair_mask):
    with ops.backend("eager"):
        return block(m, z, msa_mask, pair_mask)


IMPLS = {
    "default": Impl("default", run_default),
    "compiled": Impl("compiled", run_compiled),
    "graphs": Impl("graphs", run_graphs),
    "graphed": Impl("graphed", run_graphed),
    "eager": Impl("eager", run_eager),
}


# ---- per-module breakdown and module-level peers --------------------------------------------------
def submodules(block, m, z, msa_mask, pair_mask):
    """(name, module, args, leaves) of the nine sub-modules on inputs of the block's shapes."""
    mm, zz = m.detach().clone(), z.detach().clone()
    def leaves(mod, *xs):
        return [*xs, *mod.parameters()]
    col = block.msa_att_col
    return [
        ("msa_att_row", block.msa_att_row, (mm, zz, msa_mask), leaves(block.msa_att_row, mm, zz)),
        ("msa_att_col", col, (mm, msa_mask), leaves(col, mm)),
        ("msa_transition", block.msa_transition, (mm, msa_mask), leaves(block.msa_transition, mm)),
        ("outer_product_mean", block.outer_product_mean, (mm, msa_mask), leaves(block.outer_product_mean, mm)),
        ("tri_mul_out", block.tri_mul_out, (zz, pair_mask), leaves(block.tri_mul_out, zz)),
        ("tri_mul_in", block.tri_mul_in, (zz, pair_mask), leaves(block.tri_mul_in, zz)),
        ("tri_att_start", block.tri_att_start, (zz, pair_mask), leaves(block.tri_att_start, zz)),
        ("tri_att_end", block.tri_att_end, (zz, pair_mask), leaves(block.tri_att_end, zz)),
        ("pair_transition", block.pair_transition, (zz, pair_mask), leaves(block.pair_transition, zz)),
    ]


def cueq_triangle_multiplication(module, z, mask):
    """cuEquivariance's fused triangle multiplicative update on our module's weights."""
    cueq = optional_import("cuequivariance_torch")
    return cueq.triangle_multiplicative_update(
        z[None], "outgoing" if module.outgoing else "incoming", mask[None],
        norm_in_weight=module.layer_norm_in.weight, norm_in_bias=module.layer_norm_in.bias,
        p_in_weight=torch.cat([module.linear_a_p.weight, module.linear_b_p.weight]),
        p_in_bias=torch.cat([module.linear_a_p.bias, module.linear_b_p.bias]),
        g_in_weight=torch.cat([module.linear_a_g.weight, module.linear_b_g.weight]),
        g_in_bias=torch.cat([module.linear_a_g.bias, module.linear_b_g.bias]),
        norm_out_weight=module.layer_norm_out.weight, norm_out_bias=module.layer_norm_out.bias,
        p_out_weight=module.linear_z.weight, p_out_bias=module.linear_z.bias,
        g_out_weight=module.linear_g.weight, g_out_bias=module.linear_g.bias,
    )[0]


def cueq_triangle_attention(module, z, mask):
    """Our TriangleAttentionStartingNode with its attention core replaced by cuEquivariance's
    triangle_attention (same layer norm, projections, gating and output)."""
    cueq = optional_import("cuequivariance_torch")
    h, c = module.no_heads, module.c_hidden
    n = z.shape[0]
    x = module.layer_norm_z(z)  # [I, J, c_z]
    bias = torch.einsum("ijc,hc->hij", x, module.linear_z.weight).float()[None, None]  # [1, 1, H, J, K]
    q, k, v = (lin(x).view(n, n, h, c).permute(0, 2, 1, 3)[None] for lin in (module.linear_q, module.linear_k, module.linear_v))
    o = cueq.triangle_attention(q, k, v, bias, mask.bool()[None, :, None, None, :])  # [1, I, H, J, C]
    o = o[0].permute(0, 2, 1, 3).reshape(n, n, h * c)  # [I, J, H * C]
    return module.linear_o(torch.sigmoid(module.linear_g(x)) * o)


def breakdown(block, m, z, msa_mask, pair_mask, args) -> list[dict]:
    rows = []
    for name, module, inputs, leaves in submodules(block, m, z, msa_mask, pair_mask):
        ours = measure(Impl(name, lambda mod=module: mod(*inputs)), (), leaves, forward_only=args.forward_only)
        row = {"module": name, "ours": ours.as_dict(), "cell": ours.cell()}
        peer = None
        if name.startswith("tri_mul"):
            peer = Impl("cueq", lambda mod=module: cueq_triangle_multiplication(mod, inputs[0], inputs[1]),
                        requires=("cuequivariance_torch",))
        elif name == "tri_att_start":
            peer = Impl("cueq", lambda mod=module: cueq_triangle_attention(mod, inputs[0], inputs[1]),
                        requires=("cuequivariance_torch",))
        if peer is not None:
            theirs = measure(peer, (), leaves, forward_only=args.forward_only)
            row.update(peer=theirs.as_dict(), peer_cell=theirs.cell(),
                       ratio=f"fwd {speedup(theirs.fwd_ms, ours.fwd_ms)}, f+b {speedup(theirs.fwdbwd_ms, ours.fwdbwd_ms)}")
        rows.append(row)
        print(f"  {name}: {row['cell']}" + (f" | cuEquivariance {row['peer_cell']} ({row['ratio']})" if peer else ""),
              flush=True)
    return rows


def triangle_inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The triangle sweep's inputs at N_res n: z [n, n, 128] and a mask [n, n] with 5 % zeros (seeded by n)."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    z = torch.randn(n, n, 128, generator=gen, device="cuda").to(DTYPE)
    mask = (torch.rand(n, n, generator=gen, device="cuda") > 0.05).to(DTYPE)
    return z, mask


def triangle_kernels(n: int, z: torch.Tensor, mask: torch.Tensor, args) -> None:
    """The CUDA kernels of the outgoing triangle multiplication at N_res n (torch.profiler), once per
    kernel family this GPU runs (EVOFORMER_BLOCKS_KERNELS), forward and, unless --forward-only,
    forward+backward."""
    module = randomized(eb.TriangleMultiplicationOutgoing(128, 128)).to("cuda", DTYPE)
    leaves = [z, *module.parameters()]
    for family in cutlass.available_kernel_families(torch.cuda.current_device()):
        for backward in (False,) if args.forward_only else (False, True):
            setting = "auto" if family == "sm90" else "sm80"  # (the sm80 setting forces the portable kernels)
            step = make_step(lambda: module(z, mask), leaves, backward=backward, env={cutlass.KERNELS_ENV: setting})
            total, launches, kernels = kernel_breakdown(step, top=12)
            print(f"  kernels, outgoing N_res {n}, family {family}, {'forward+backward' if backward else 'forward'}: "
                  f"{total:.3f} ms in {launches} launches", flush=True)
            for ms, count, name in kernels:
                print(f"    {ms:7.3f} ms {count:3d}x {name[:100]}", flush=True)


def triangle_sweep(sizes: list[int], args) -> list[dict]:
    """Both triangle multiplications alone at c_z = c_hidden = 128 against cuEquivariance's."""
    rows, table = [], []
    for n in sizes:
        z, mask = triangle_inputs(n)
        for cls in (eb.TriangleMultiplicationOutgoing, eb.TriangleMultiplicationIncoming):
            module = randomized(cls(128, 128)).to("cuda", DTYPE)
            leaves = [z, *module.parameters()]
            ours = measure(Impl("ours", lambda mod=module, z=z, mask=mask: mod(z, mask)), (), leaves,
                           forward_only=args.forward_only)
            peer = Impl("cueq", lambda mod=module, z=z, mask=mask: cueq_triangle_multiplication(mod, z, mask),
                        requires=("cuequivariance_torch",))
            theirs = measure(peer, (), leaves, forward_only=args.forward_only)
            ratio = (speedup(theirs.fwd_ms, ours.fwd_ms), speedup(theirs.fwdbwd_ms, ours.fwdbwd_ms))
            peaks = [fmt(r.peak_mib if r.ok else None, 0) for r in (ours, theirs)]
            table.append([f"{cls.__name__} N_res {n}", ours.cell(), theirs.cell(), f"{ratio[0]} ; {ratio[1]}",
                          f"{peaks[0]} ({peaks[1]})"])
            rows.append({"module": cls.__name__, "n_res": n, "ours": ours.as_dict(), "peer": theirs.as_dict()})
            print(f"  {table[-1][0]}: {ours.cell()} | cuEquivariance {theirs.cell()} ({ratio[0]} ; {ratio[1]})", flush=True)
            del module
        if args.profile:
            triangle_kernels(n, z, mask, args)
        del z, mask
        torch.cuda.empty_cache()
    print(markdown_table(["triangle multiplication", "ours fwd / fwd+bwd ms", "cuEquivariance",
                          "cuEquivariance / ours (fwd ; f+b)", "peak MiB f+b ours (cuEquivariance)"], table), flush=True)
    return rows


HOST_CASE = Case("EvoformerBlock", 16, 64)


def host_ms(rounds: int = 5, iters: int = 20, revision: str = "") -> dict:
    """Median host ms of the forward and of the backward of the default block at HOST_CASE, and every
    round's (forward, backward) pair (see the module docstring), with the block's nodes as one call
    and, under ``"per_module"``, ``"composed"`` and ``"separate"``, called module by module
    (``ops.module_nodes.per_module``), with the modules composing their ops
    (``ops.module_nodes.composed``) and as one call with the stacked parameters each in a storage of
    its own (``primitives.separate_storages``); with ``revision`` (a git revision), under
    ``"baseline"`` the same block of that revision's library (benchmarks/baseline.py: loaded beside
    this one, the same weights): the rounds alternate between them all, so that all see the same
    machine."""
    cfg, block, m, z, msa_mask, pair_mask = build(HOST_CASE)
    m.requires_grad_(True)
    z.requires_grad_(True)
    @contextlib.contextmanager
    def separate():  # (the stacked projections' parameters each in a storage of its own)
        separate_storages(block)
        try:
            yield
        finally:
            pack_stacked(block)

    modes = {"nodes": contextlib.nullcontext, "per_module": module_nodes.per_module, "composed": module_nodes.composed,
             "separate": separate}
    blocks = dict.fromkeys(modes, block)
    if revision:
        modes["baseline"] = contextlib.nullcontext
        blocks["baseline"] = baseline_block(revision, cfg, block)
    leaves = {name: [m, z, *b.parameters()] for name, b in blocks.items()}

    def forward(name):
        return sum(o.float().sum() for o in blocks[name](m, z, msa_mask, pair_mask))

    for name, mode in modes.items():
        with mode():
            for _ in range(5):
                torch.autograd.grad(forward(name), leaves[name])
    torch.cuda.synchronize()
    per_round = {name: [] for name in modes}
    for _ in range(rounds):
        for name, mode in modes.items():
            fwd = bwd = 0.0
            with mode():
                for _ in range(iters):
                    t0 = time.perf_counter()
                    loss = forward(name)
                    t1 = time.perf_counter()
                    torch.autograd.grad(loss, leaves[name])
                    fwd, bwd = fwd + t1 - t0, bwd + time.perf_counter() - t1
            torch.cuda.synchronize()
            per_round[name].append((fwd / iters * 1e3, bwd / iters * 1e3))
    results = {}
    for name, mode in modes.items():
        ordered = sorted(per_round[name], key=sum)
        median = ordered[len(ordered) // 2]
        with mode():
            loss = forward(name)
            counts = {"fwd": host_operations(partial(forward, name)),
                      "bwd": host_operations(lambda: torch.autograd.grad(loss, leaves[name]))}
        parts = {direction: ops.pop("parts") for direction, ops in counts.items()}
        results[name] = {"case": HOST_CASE.label(), "fwd_ms": median[0], "bwd_ms": median[1],
                         "rounds": per_round[name], "operations": counts, "parts": parts}
    if revision:
        # the one call's forward+backward over the baseline's, per round and of the medians
        ratios = [sum(ours) / sum(base) for ours, base in zip(per_round["nodes"], per_round["baseline"])]
        results["baseline"].update(revision=revision, ratios=ratios, ratio_of_medians=(
            (results["nodes"]["fwd_ms"] + results["nodes"]["bwd_ms"])
            / (results["baseline"]["fwd_ms"] + results["baseline"]["bwd_ms"])))
    return {**results["nodes"], **{name: results[name] for name in results if name != "nodes"}}


def baseline_block(revision: str, cfg: dict, block: torch.nn.Module) -> torch.nn.Module:
    """`block`'s class from revision `revision`'s library (baseline.load), with block's arguments
    that its constructor takes, block's weights, dtype, device and mode; exits where the weights do
    not fit (the revision's block is not the same module)."""
    library = baseline.load(revision)
    cls = getattr(library, type(block).__name__)
    accepted = inspect.signature(cls.__init__).parameters
    other = cls(**{k: v for k, v in cfg.items() if k in accepted})
    other = other.to(next(block.parameters()).device, DTYPE).train(block.training)
    mismatch = other.load_state_dict(block.state_dict(), strict=False)
    if mismatch.missing_keys or mismatch.unexpected_keys:
        raise SystemExit(f"--baseline {revision}: its {cls.__name__} does not take this one's weights: {mismatch}")
    return other


def _host_us_per_call(fn, iters: int = 100) -> float:
    """Host µs per call of ``fn``: harness.host_and_gpu_ms's enqueue time after warm-up (a call here
    launches at most a few kernels, so 100 calls stay within the launch queue)."""
    warm_up(fn, iters=30)
    return host_and_gpu_ms(fn, iters)[0] * 1e3


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def layer_costs() -> list[tuple[str, str, float]]:
    """Host µs per call (enqueue time) of the layers a plain block's host time is made of, at
    HOST_CASE's sizes (rows of 256 channels, 1,024 rows; the row attention's [1, 16, 64, 8 x 32]):
    torch's own calls (floors), the extension's ops called directly, and the ops package's
    entries that wrap them (validation, backend selection, the autograd node; inputs requiring
    grad). Each row: (layer, call, µs)."""
    kernels = cutlass._kernels()
    kw = dict(device="cuda", dtype=DTYPE)
    x, w = torch.randn(1024, 256, **kw), torch.randn(256, 256, **kw)
    b, ln_w = torch.randn(256, **kw), torch.randn(256, **kw)
    xg = x.clone().requires_grad_(True)
    qkvg = torch.randn(1, 16, 64, 4 * 8 * 32, **kw)
    qkvg_g = qkvg.clone().requires_grad_(True)
    mask_bias = torch.zeros(1, 16, 1, 1, 64, device="cuda")  # [B, N, 1, 1, L] float32
    pair_bias = torch.randn(1, 1, 8, 64, 64, **kw)  # [B, 1, H, L, L]
    family, scale = cutlass.kernel_family(), 32 ** -0.5
    y, out, stats, mask_prepared, pair_prepared = kernels.gated_attention_fwd(
        qkvg, mask_bias, pair_bias, 8, False, scale, family)
    calls = [
        ("torch", "torch.add", lambda: torch.add(x, x)),
        ("torch", "torch.empty", lambda: torch.empty(1024, 256, **kw)),
        ("torch", "autograd.Function.apply, identity", lambda: _Identity.apply(xg)),
        ("torch", "F.linear with bias", lambda: torch.nn.functional.linear(xg, w, b)),
        ("torch", "F.layer_norm", lambda: torch.nn.functional.layer_norm(xg, (256,), ln_w, b)),
        ("extension", "layer_norm_fwd", lambda: kernels.layer_norm_fwd(x, ln_w, b, 1e-5)),
        ("extension", "add_layer_norm_fwd", lambda: kernels.add_layer_norm_fwd(x, x, ln_w, b, 1e-5, None)),
        ("extension", "linear_bwd (dx, dw, db)", lambda: kernels.linear_bwd(x, x, w, None, True, True, True, DTYPE, 0)),
        ("extension", "gated_attention_fwd",
         lambda: kernels.gated_attention_fwd(qkvg, mask_bias, pair_bias, 8, False, scale, family)),
        ("extension", "gated_attention_bwd", lambda: kernels.gated_attention_bwd(
            y, qkvg, out, stats, mask_prepared, pair_bias, pair_prepared, 8, False, scale, family, None, True)),
        ("ops", "layer_norm", lambda: ops.layer_norm(xg, ln_w, b)),
        ("ops", "add_layer_norm", lambda: ops.add_layer_norm(xg, x, ln_w, b)),
        ("ops", "linear with bias", lambda: ops.linear(xg, w, b)),
        ("ops", "gated_evoformer_attention", lambda: ops.gated_evoformer_attention(qkvg_g, 8, mask_bias, pair_bias)),
    ]
    return [(layer, name, _host_us_per_call(fn)) for layer, name, fn in calls]


_CONTAINERS = (": _update", ": _pair_updates")  # the block's code whose calls are the forward's parts
_AUTOGRAD_NODE = "autograd::engine::evaluate_function: "


def host_operations(fn, top: int = 4) -> dict:
    """The host operations of one call of ``fn`` (torch.profiler, CPU events, one profile): ATen
    calls (nested ones included), kernel launches and autograd nodes run, and ``parts``: where the
    ATen calls go. In a forward a part is a call the block's ``_update`` or ``_pair_updates`` makes
    (``file(line): function`` of the callee, from the Python frames the profiler keeps as the
    events' ancestors; the block runs its sub-modules through internal entry points, so module
    hooks would not see them; a profiler that keeps no Python frames, as torch 2.11's did, puts
    the whole forward in one part); in a backward, an autograd node type. Each part: its name, its
    ATen calls, kernel launches and its ``top`` most frequent ATen operations, largest part first."""
    from torch.profiler import ProfilerActivity, profile

    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    synchronize()
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        fn()
        synchronize()
    totals = {"aten": 0, "launches": 0, "autograd_nodes": 0}
    parts: dict[str, dict] = {}
    for event in prof.events():
        name = event.name
        if name.startswith(_AUTOGRAD_NODE):
            totals["autograd_nodes"] += 1
        is_aten = name.startswith("aten::")
        is_launch = name.startswith(("cudaLaunchKernel", "cuLaunchKernel"))
        if not (is_aten or is_launch):
            continue
        # The outermost enclosing autograd node (backward), else the callee of the block's _update
        # (forward).
        part, callee, parent = None, None, event.cpu_parent
        while parent is not None:
            if parent.name.startswith(_AUTOGRAD_NODE):
                part = parent.name[len(_AUTOGRAD_NODE):]
            elif parent.name.endswith(_CONTAINERS) and "evoformer_blocks" in parent.name:
                part = part or callee
            elif "evoformer_blocks" in parent.name and "(" in parent.name:
                callee = parent.name[parent.name.rindex("evoformer_blocks"):]
            parent = parent.cpu_parent
        part = part or "(outside the block's calls)"
        entry = parts.setdefault(part, {"part": part, "aten": 0, "launches": 0, "ops": Counter()})
        kind = "aten" if is_aten else "launches"
        totals[kind] += 1
        entry[kind] += 1
        if is_aten:
            entry["ops"][name[len("aten::"):]] += 1
    ordered = sorted(parts.values(), key=lambda p: -p["aten"])
    for entry in ordered:
        entry["ops"] = dict(entry["ops"].most_common(top))
    return {**totals, "parts": ordered}


def main() -> None:
    cli = CommandLine(__doc__, shapes=[c.label() for c in CASES], impls=list(IMPLS))
    cli.add_argument("--breakdown", action="store_true", help="time the nine sub-modules and the module-level peers")
    cli.add_argument("--profile", action="store_true",
                     help="list the CUDA kernels of one forward+backward of the default block (torch.profiler); "
                          "with --triangle, those of the outgoing triangle multiplication per kernel family")
    cli.add_argument("--triangle", default="", help="N_res list for the triangle multiplication sweep, e.g. 384,768,1024")
    cli.add_argument("--host", action="store_true", help="host time of the default block with the GPU idle")
    cli.add_argument("--baseline", default="",
                     help="with --host: a git revision whose block is timed in the same rounds (benchmarks/baseline.py)")
    cli.add_argument("--rounds", type=int, default=5, help="with --host: alternating rounds (median over them)")
    cli.add_argument("--train", action="store_true", help="the blocks in training mode (dropout at the preset's rates)")
    args = cli.parse()
    if (args.triangle or args.host) and not any(a.startswith("--shapes") for a in sys.argv[1:]):
        args.shapes = []  # the sweep or the host timing alone
    print(run_info_line(), flush=True)
    results = []
    if args.baseline and not args.host:
        cli.error("--baseline goes with --host")
    if args.host:
        host = host_ms(rounds=args.rounds, revision=args.baseline)
        shown = [("the C++ nodes as one call", host), ("the C++ nodes module by module", host["per_module"]),
                 ("composing the ops", host["composed"]),
                 ("the one call, stacked parameters each in a storage of its own", host["separate"])]
        if args.baseline:
            shown.append((f"revision {args.baseline}'s block", host["baseline"]))
        for what, h in shown:
            rounds = ", ".join(f"{f:.2f} / {b:.2f}" for f, b in h["rounds"])
            print(f"\n## host time, {h['case']}, GPU idle, {what}: forward {h['fwd_ms']:.2f} ms, backward "
                  f"{h['bwd_ms']:.2f} ms (median round; rounds forward / backward: {rounds}); ATen calls "
                  f"{h['operations']['fwd']['aten']} / {h['operations']['bwd']['aten']}, autograd nodes "
                  f"{h['operations']['bwd']['autograd_nodes']}", flush=True)
        if args.baseline:
            ratios = host["baseline"]["ratios"]
            print(f"\nthe one call's forward+backward over revision {args.baseline}'s, per round: "
                  f"{', '.join(f'{r:.3f}' for r in ratios)} (median {statistics.median(ratios):.3f}, "
                  f"{sum(r <= 0.5 for r in ratios)} of {len(ratios)} at or below half); ratio of the medians "
                  f"{host['baseline']['ratio_of_medians']:.3f}", flush=True)
        for part, ops in host["operations"].items():
            print(f"{part}: {ops['aten']} ATen calls, {ops['launches']} kernel launches, "
                  f"{ops['autograd_nodes']} autograd nodes", flush=True)
        for direction, parts in host["parts"].items():
            print(f"\n{direction}, ATen calls by part:", flush=True)
            print(markdown_table(["part", "ATen calls", "launches", "most frequent"],
                                 [[p["part"], p["aten"], p["launches"],
                                   ", ".join(f"{op} {n}" for op, n in p["ops"].items())] for p in parts]), flush=True)
        costs = layer_costs()
        print("\nhost µs per call, enqueue time (torch's calls, the extension's ops, the ops package's entries):",
              flush=True)
        print(markdown_table(["layer", "call", "µs"], [[layer, name, f"{us:.1f}"] for layer, name, us in costs]),
              flush=True)
        host["layer_costs"] = [{"layer": layer, "call": name, "us": us} for layer, name, us in costs]
        results.append({"host": host})
    if args.triangle:
        print("\n## triangle multiplication, c_z = c_hidden = 128", flush=True)
        results.append({"triangle": triangle_sweep([int(n) for n in args.triangle.split(",")], args)})
    for index in args.shapes:
        case = CASES[index]
        cfg, block, m, z, msa_mask, pair_mask = build(case, train=args.train)
        flops_f, flops_fb = block_flops(cfg, case.n_seq, case.n_res, case.extra)
        leaves = [m, z, *block.parameters()]
        mode = ", training mode (dropout on)" if args.train else ""
        print(f"\n## {case.label()}{mode} (model {flops_f / 1e12:.2f} TFLOP forward, {flops_fb / 1e12:.2f} forward+backward)",
              flush=True)
        row = {"case": case.label(), "train": args.train, "flops": [flops_f, flops_fb], "impls": {}}
        table = []
        for name in args.impls:
            result = measure(IMPLS[name], (block, m, z, msa_mask, pair_mask), leaves,
                             forward_only=args.forward_only)
            row["impls"][name] = cells = result.as_dict()
            if name == "graphed":  # no peak per step: a graph's activations live in its pool, allocated at capture
                for key in ("peak_mib", "fwd_peak_mib"):
                    cells.pop(key, None)
            tf = flops_f / result.fwd_ms / 1e9 if result.ok else float("nan")
            tfb = flops_fb / result.fwdbwd_ms / 1e9 if result.ok else float("nan")
            peak = cells.get("peak_mib")
            table.append([name, result.cell(), fmt(peak / 1024 if peak is not None else None, 2),
                          f"{fmt(tf, 0)} / {fmt(tfb, 0)}",
                          f"{fmt(pct_of_peak(tf), 1)} / {fmt(pct_of_peak(tfb), 1)}"])
            print(f"  {name}: {result.cell()}", flush=True)
        print(markdown_table(["impl", "fwd / fwd+bwd ms", "peak GiB (f+b)", "TFLOP/s fwd / f+b",
                              "% of dense bf16 fwd / f+b"], table), flush=True)
        if "default" in row["impls"] and "compiled" in row["impls"]:
            d, c = row["impls"]["default"], row["impls"]["compiled"]
            print(f"compiled over default: fwd {speedup(d.get('fwd_ms'), c.get('fwd_ms'))}, "
                  f"f+b {speedup(d.get('fwdbwd_ms'), c.get('fwdbwd_ms'))}", flush=True)
        if args.profile:
            step = make_step(partial(run_default, block, m, z, msa_mask, pair_mask), leaves, backward=not args.forward_only)
            total, launches, kernels = kernel_breakdown(step)
            print(f"CUDA kernels of one {'forward' if args.forward_only else 'forward+backward'} (default): "
                  f"{total:.2f} ms in {launches} launches", flush=True)
            print(markdown_table(["ms", "launches", "kernel"], [[f"{k[0]:.3f}", k[1], k[2]] for k in kernels]), flush=True)
            row["kernels"] = {"total_ms": total, "launches": launches, "top": kernels}
        if args.breakdown:
            print("per module (default backend), fwd / fwd+bwd ms:", flush=True)
            row["breakdown"] = breakdown(block, m, z, msa_mask, pair_mask, args)
        results.append(row)
        del block, m, z
        torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
