"""One AF2 training step of the trunk as users train it: the extra-MSA stack then the Evoformer
stack, against a peer trunk, all in one process.

Trunk: ExtraMSAStack (4 blocks, c_e 64, N_extra 1024 rows) feeding EvoformerStack (48 blocks) of the
af2 preset, ``blocks_per_ckpt=1`` (each block checkpointed, as AF2 trains), bf16 weights and
activations, batch 1, training mode with the preset's dropout (0.15 after the MSA row attention,
0.25 after each pair update; ``--dropout off`` for eval-mode blocks), masks with 5 % zeros, random
weights (AF2's zero-initialised output layers would make the updates, and many GEMM operands,
zero). One step: both stacks' forwards, the loss (a fixed random projection of m, z and s), its
backward into the inputs m, z, the extra MSA and every parameter (gradients set to None before the
step, as ``optimizer.zero_grad()`` leaves them).

Cases (N_seq, N_res): (128, 256) and (512, 384).

Implementations:
    plain        the stacks as ``from_config`` builds them
    graphs       the same stacks with ``cuda_graphs=True`` (the first step runs plain, the second
                 captures; the warm-up covers both)
    peer         the same trunk in plain PyTorch on cuEquivariance's fused triangle multiplication
                 and triangle attention (also the MSA row attention) and SDPA for the column
                 attention (benchmarks/trunk_peer.py), each block ``torch.compile``d, checkpointed
    peer-graphs  the peer with ``torch.compile(mode="reduce-overhead")`` (CUDA graphs) per block
    peer-eager   the peer without compile

Per implementation: wall ms per step (CUDA events around the step after a device synchronise, so
host time before the first kernel counts; median of --steps after warm-up), the CUDA time of one
step (torch.profiler: the sum of its kernels, copies and sets), wall over that, the host operations
of that step (ATen calls, nested ones included, and kernel or graph launches), peak memory (the
allocator's peak of allocated and of reserved bytes over the timed steps, each implementation
starting from an emptied cache: graph memory pools count in reserved), and model TFLOP/s (forward +
backward FLOPs of the blocks from bench_block.block_flops, no recomputation counted, over the
wall time).

    python benchmarks/bench_trunk.py [--shapes all|0,1] [--impls plain,graphs,peer,...] [--dropout on|off]
                                     [--steps 5] [--no-profile] [--recompute SPEC] [--json out.json]

--recompute (plain and graphs): what the checkpointed blocks of both stacks keep instead of
recomputing (evoformer_blocks.recompute): a policy (full, attention, attention+triangle), then
optionally ``,budget=GIB`` (each stack's recompute_budget_gib) and ``,last`` (the Evoformer stack's
last block without checkpointing; the extra-MSA stack's stays checkpointed: the Evoformer stack
runs after it), e.g. ``--recompute attention+triangle,budget=8,last``.
"""

from __future__ import annotations

import gc
import statistics
from collections import Counter
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_block import DTYPE, block_args, block_flops, pct_of_peak, randomized  # noqa: E402
from harness import CommandLine, failure_reason, fmt, markdown_table, optional_import, run_info_line, speedup, write_json  # noqa: E402

import evoformer_blocks as eb  # noqa: E402
from evoformer_blocks.config import get_config  # noqa: E402

N_EXTRA = 1024


@dataclass(frozen=True)
class Case:
    n_seq: int
    n_res: int

    def label(self) -> str:
        return f"N_seq {self.n_seq}, N_res {self.n_res}, N_extra {N_EXTRA}"


CASES = [Case(128, 256), Case(512, 384)]
IMPLS = ["plain", "graphs", "peer", "peer-graphs", "peer-eager"]
DEFAULT_IMPLS = ["plain", "graphs", "peer", "peer-graphs"]
WARM_UP = {"plain": 2, "graphs": 3, "peer": 3, "peer-graphs": 4, "peer-eager": 2}


def trunk_flops(case: Case, with_extra: bool) -> float:
    """Model FLOPs of one forward+backward of the trunk's blocks."""
    evo = block_flops(block_args(False), case.n_seq, case.n_res, False)[1]
    extra = block_flops(block_args(True), N_EXTRA, case.n_res, True)[1]
    cfg = get_config("af2")
    return cfg.evoformer_stack.no_blocks * evo + with_extra * cfg.extra_msa_stack.no_blocks * extra


def recompute_options(spec: str) -> tuple[dict, dict]:
    """--recompute as the stacks' keyword arguments: (extra-MSA stack's, Evoformer stack's)."""
    policy, *items = spec.split(",")
    common, evo = {"recompute": policy}, {}
    for item in items:
        if item == "last":
            evo["checkpoint_last_group"] = False
        elif item.startswith("budget="):
            common["recompute_budget_gib"] = float(item[len("budget="):])
        else:
            raise ValueError(f"--recompute: unknown item {item!r} (budget=GIB, last)")
    return common, {**common, **evo}


def build_trunk(impl: str, train: bool, recompute: str = "full"):
    """(extra-MSA stack, Evoformer stack) of the implementation, on the GPU in bf16; see make_step
    for the trunk without the extra-MSA stack."""
    cfg = get_config("af2")
    if impl in ("plain", "graphs"):
        extra_options, evo_options = recompute_options(recompute)
        extra = eb.ExtraMSAStack.from_config(cfg, blocks_per_ckpt=1, cuda_graphs=impl == "graphs", **extra_options)
        evo = eb.EvoformerStack.from_config(cfg, blocks_per_ckpt=1, cuda_graphs=impl == "graphs", **evo_options)
    else:
        if optional_import("cuequivariance_torch") is None:
            raise RuntimeError("cuequivariance_torch is not importable")
        import trunk_peer

        mode = {"peer": "default", "peer-graphs": "reduce-overhead", "peer-eager": None}[impl]
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, name):  # 48 blocks share one compiled graph; never fall back silently
                setattr(torch._dynamo.config, name, 4096)
        extra = trunk_peer.PeerStack(compile_mode=mode, extra=True, **cfg.extra_msa_stack.to_dict())
        evo = trunk_peer.PeerStack(compile_mode=mode, **cfg.evoformer_stack.to_dict())
    return tuple(randomized(s).to("cuda", DTYPE).train(train) for s in (extra, evo))


def inputs(case: Case):
    cfg = get_config("af2")
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(DTYPE)

    def mask(*shape):
        return (torch.rand(*shape, generator=gen, device="cuda") > 0.05).to(DTYPE)

    s, r = case.n_seq, case.n_res
    tensors = dict(
        m=rand(1, s, r, cfg.c_m), z=rand(1, r, r, cfg.c_z), m_extra=rand(1, N_EXTRA, r, cfg.c_e),
        msa_mask=mask(1, s, r), extra_mask=mask(1, N_EXTRA, r), pair_mask=mask(1, r, r),
        # the loss's fixed projections of m, z and s
        cm=rand(1, s, r, cfg.c_m), cz=rand(1, r, r, cfg.c_z), cs=rand(1, r, cfg.c_s),
    )
    for name in ("m", "z", "m_extra"):
        tensors[name].requires_grad_(True)
    return tensors


def make_step(extra, evo, t):
    """One training step; ``extra`` None: the Evoformer stack alone (z from the inputs)."""
    stacks = [evo] if extra is None else [extra, evo]
    leaves = [t["m"], t["z"]] + ([] if extra is None else [t["m_extra"]])
    params = [p for stack in stacks for p in stack.parameters()]

    def step():
        for x in leaves + params:
            x.grad = None
        z = t["z"] if extra is None else extra(t["m_extra"], t["z"], t["extra_mask"], t["pair_mask"])
        m, z, s = evo(t["m"], z, t["msa_mask"], t["pair_mask"])
        loss = (m * t["cm"]).float().sum() + (z * t["cz"]).float().sum() + (s * t["cs"]).float().sum()
        loss.backward()

    return step


def wall_ms(step, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def profile_step(step) -> dict:
    """The CUDA time and the host operations of one step (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    cuda_us, aten, launches, spans = 0.0, Counter(), 0, []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            cuda_us += event.device_time_total
            spans.append((event.time_range.start, event.time_range.end))
        elif event.name.startswith("aten::"):
            aten[event.name] += 1
        elif event.name.startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cuGraphLaunch")):
            launches += 1
    # Where the GPU idled between its operations: gaps under 10 us (one operation waiting for the
    # next, as inside a CUDA graph), 10-100 us, and longer (the GPU waiting for the host).
    spans.sort()
    gaps = {"under_10us": 0.0, "10_100us": 0.0, "over_100us": 0.0}
    end = spans[0][1] if spans else 0.0
    for start, stop in spans[1:]:
        gap = start - end
        if gap > 0:
            gaps["under_10us" if gap < 10 else "10_100us" if gap < 100 else "over_100us"] += gap / 1e3
        end = max(end, stop)
    return {"kernels_ms": cuda_us / 1e3, "gpu_ops": len(spans), "aten": sum(aten.values()), "launches": launches,
            "idle_ms": gaps, "span_ms": (end - spans[0][0]) / 1e3 if spans else 0.0,
            "aten_top": aten.most_common(30)}


def measure(impl: str, case: Case, args) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    extra, evo = build_trunk(impl, train=args.dropout == "on", recompute=args.recompute)
    if args.no_extra:
        extra = None
    t = inputs(case)
    step = make_step(extra, evo, t)
    for _ in range(WARM_UP[impl]):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = wall_ms(step, args.steps)
    row = {
        "wall_ms": statistics.median(times), "wall_ms_all": times,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
    }
    if impl == "graphs":
        row["replays"] = sum(stack._graphs.replays for stack in (extra, evo) if stack is not None)
    if not args.no_profile:
        row.update(profile_step(step))
    return row


def main() -> None:
    cli = CommandLine(__doc__, shapes=[c.label() for c in CASES], impls=IMPLS, default_impls=DEFAULT_IMPLS)
    cli.add_argument("--dropout", choices=("on", "off"), default="on", help="training-mode dropout (default on)")
    cli.add_argument("--steps", type=int, default=5, help="timed steps per implementation (median)")
    cli.add_argument("--no-profile", action="store_true", help="skip the profiled step (CUDA time, host operations)")
    cli.add_argument("--no-extra", action="store_true", help="the Evoformer stack alone (no extra-MSA stack)")
    cli.add_argument("--recompute", default="full", metavar="SPEC",
                     help="POLICY[,budget=GIB][,last]: what checkpointed blocks keep (see above; default full)")
    args = cli.parse()
    if args.forward_only:
        cli.error("--forward-only: a training step is a forward and a backward")
    print(run_info_line(), flush=True)
    results = []
    for index in args.shapes:
        case = CASES[index]
        flops = trunk_flops(case, not args.no_extra)
        what = "Evoformer stack alone" if args.no_extra else "extra-MSA and Evoformer stacks"
        print(f"\n## trunk step ({what}), {case.label()}, dropout {args.dropout}, recompute {args.recompute} "
              f"({flops / 1e12:.1f} TFLOP model "
              "forward+backward)", flush=True)
        rows = {}
        for impl in args.impls:
            try:
                rows[impl] = measure(impl, case, args)
            except Exception as exc:  # a peer that cannot run here is reported, not fatal
                rows[impl] = {"error": failure_reason(exc)}
            print(f"  {impl}: " + str({k: v for k, v in rows[impl].items() if k != "aten_top"}), flush=True)
        table = []
        for impl, r in rows.items():
            if "error" in r:
                table.append([impl, f"fails: {r['error']}"] + ["–"] * 7)
                continue
            tflops = flops / r["wall_ms"] / 1e9
            kernels = r.get("kernels_ms")
            table.append([
                impl, fmt(r["wall_ms"], 1), fmt(kernels, 1),
                fmt(r["wall_ms"] / kernels, 2) if kernels else "–",
                r.get("aten", "–"), r.get("launches", "–"),
                f"{r['peak_allocated_gib']:.2f} / {r['peak_reserved_gib']:.2f}",
                f"{tflops:.0f} ({pct_of_peak(tflops):.0f} %)",
                speedup(rows.get("plain", {}).get("wall_ms"), r["wall_ms"]) if impl != "plain" else "1.00x",
            ])
        for impl, r in rows.items():
            if "idle_ms" in r:
                idle = ", ".join(f"{k} {v:.1f}" for k, v in r["idle_ms"].items())
                print(f"  {impl}: GPU idle between operations (ms): {idle}; busy span {r['span_ms']:.1f} ms", flush=True)
        print(markdown_table(["impl", "wall ms", "CUDA ms", "wall / CUDA", "ATen calls", "launches",
                              "peak GiB alloc / reserved", "model TFLOP/s", "plain wall / this wall"], table), flush=True)
        results.append({"case": case.label(), "dropout": args.dropout, "recompute": args.recompute,
                        "extra_msa_stack": not args.no_extra,
                        "flops": flops, "impls": rows})
        torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
