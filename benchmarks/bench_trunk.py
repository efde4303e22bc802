"""One training step of the trunk as users train it, against a peer trunk, all in one process: the
AF2 trunk (the extra-MSA stack then the Evoformer stack; default) or, with ``--trunk pairformer``,
AF3's Pairformer.

AF2 trunk: ExtraMSAStack (4 blocks, c_e 64, N_extra 1024 rows) feeding EvoformerStack (48 blocks)
of the af2 preset, ``blocks_per_ckpt=1`` (each block checkpointed, as AF2 trains), bf16 weights and
activations, batch 1, training mode with the preset's dropout (0.15 after the MSA row attention,
0.25 after each pair update; ``--dropout off`` for eval-mode blocks), masks with 5 % zeros, random
weights (AF2's zero-initialised output layers would make the updates, and many GEMM operands,
zero). One step: both stacks' forwards, the loss (a fixed random projection of m, z and s), its
backward into the inputs m, z, the extra MSA and every parameter (gradients set to None before the
step, as ``optimizer.zero_grad()`` leaves them). Cases (N_seq, N_res): (128, 256) and (512, 384).

Pairformer trunk (``--trunk pairformer``): PairformerStack (48 blocks, c_s 384, c_z 128, attention
with pair bias 16 heads x 24, triangle attention 4 x 32, triangle multiplication 128) of the af3
preset, ``blocks_per_ckpt=1``, bf16, batch 1, training mode with the preset's dropout (0.25 after
each pair update), a single mask and a pair mask with 5 % zeros (drawn independently), random
weights. One step: the stack's forward, the loss (a fixed random projection of s and z), its
backward into s, z and every parameter. Cases N_token 384 and 768. The peer is the Pairformer block
in plain PyTorch on cuEquivariance 0.13's ``triangle_multiplicative_update`` (both triangle
multiplications), ``triangle_attention`` (both triangle attentions) and ``attention_pair_bias`` (the
single representation's attention with pair bias), each block checkpointed and ``torch.compile``d
(``trunk_peer.PeerPairformerStack``); tests/test_bench_trunk.py checks on the CPU that it computes
the library block's function. Columns and measurements as for the AF2 trunk; the model FLOPs come
from bench_block.pairformer_block_flops.

Implementations:
    plain        the stacks as ``from_config`` builds them
    plain-composed  the same with every module and residual add + layer norm composing its ops
                 instead of calling its one-node C++ entry (``evoformer_blocks.ops.module_nodes.composed``:
                 the A/B of those nodes)
    plain-per-module  the same with each Evoformer block calling its modules' nodes one by one from
                 Python instead of as one extension call (``module_nodes.per_module``: the A/B of
                 that call)
    plain-separate  the same with the stacked projections' parameters each in a storage of its own
                 (``evoformer_blocks.primitives.separate_storages``: the nodes then stack them with a
                 copy per call; the A/B of keeping them back to back)
    plain-torch-checkpoint  the same with every checkpointed group under ``torch.utils.checkpoint``
                 (non-reentrant), full recomputation included, instead of the stacks' own node for
                 it (``evoformer_blocks.recompute.through_torch_checkpoint``: the A/B of that node)
    graphs       the same stacks with ``cuda_graphs=True`` (the first step runs plain, the second
                 captures; the warm-up covers both)
    peer         the same trunk in plain PyTorch on cuEquivariance's fused triangle multiplication
                 and triangle attention (AF2: also the MSA row attention, and SDPA for the column
                 attention; Pairformer: its attention_pair_bias) (benchmarks/trunk_peer.py), each
                 block ``torch.compile``d, checkpointed
    peer-graphs  the peer with CUDA graphs: ``torch.compile(mode="reduce-overhead")`` of each
                 checkpointed block (the checkpoint inside the compiled region: CUDA-graph trees
                 under an outer checkpoint fail with torch 2.11), a CUDA-graph step marked before
                 each step; its graphs' pool and last outputs stay for the rest of the process, so
                 the peaks of the cases measured after it include them
    peer-eager   the peer without compile

Per implementation: wall ms per step (CUDA events around the step after a device synchronise, so
host time before the first kernel counts; median of --steps after warm-up), the CUDA time of one
step (torch.profiler: the sum of its kernels, copies and sets), wall over that, the host operations
of that step (ATen calls, nested ones included, and kernel or graph launches) and its CUDA time by
kernel group (KERNEL_GROUPS: the attention's kernels, the triangle multiplication's, GEMMs, ...), peak memory (the
allocator's peak of allocated and of reserved bytes over the timed steps, each implementation
starting from an emptied cache: graph memory pools count in reserved), and model TFLOP/s (forward +
backward FLOPs of the blocks from bench_block.block_flops or pairformer_block_flops, no
recomputation counted, over the wall time).

    python benchmarks/bench_trunk.py [--trunk af2|pairformer] [--shapes all|0,1] [--impls plain,graphs,peer,...]
                                     [--dropout on|off] [--steps 5] [--no-profile] [--no-extra]
                                     [--recompute SPEC] [--backward-thread engine|caller] [--json out.json]
    python benchmarks/bench_trunk.py --baseline REV --dropout off [--blocks 4] [--rounds 5] [--no-extra] ...

--baseline REV: instead of the implementations' columns, the kernel time of this checkout's plain
trunk against revision REV's (benchmarks/baseline.py: its library loaded beside this one under
another name), in one process, so that both sides share the machine instance: the Evoformer or
Pairformer stack shortened to --blocks blocks (default 4; an extra-MSA stack keeps its own), REV's
stacks built from REV's preset with the same block counts and options and given this side's
weights, one set of inputs, two untimed steps each, then --rounds profiled steps of each side
alternating (default 5). Reported: each side's median CUDA time of a step (torch.profiler) and the
ratio of the medians, every round's, launches and memsets, each side's peak memory over one step,
whether both sides' gradients (every parameter and input) are bitwise equal, and each side's median
CUDA time per kernel group (KERNEL_GROUPS). Dropout off: two revisions need not draw the same masks.

--recompute (plain and graphs): what the checkpointed blocks of the trunk's stacks keep instead of
recomputing (evoformer_blocks.recompute): a policy (full, attention, attention+triangle), then
optionally ``,budget=GIB`` (each stack's recompute_budget_gib) and ``,last`` (the last stack's last
block without checkpointing; an extra-MSA stack's stays checkpointed: the Evoformer stack runs
after it), e.g. ``--recompute attention+triangle,budget=8,last``.

--backward-thread caller: every implementation's backward runs on the thread that calls it
(``torch.autograd.set_multithreading_enabled(False)``, a setting of the user's training loop)
instead of autograd's worker thread for the GPU (``engine``, PyTorch's default).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import statistics
from collections import Counter
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_block import DTYPE, block_flops, pairformer_block_flops, pct_of_peak, randomized  # noqa: E402
from harness import (CommandLine, alternating_rounds, failure_reason, fmt, markdown_table, optional_import,  # noqa: E402
                     run_info_line, speedup, write_json)

import evoformer_blocks as eb  # noqa: E402
from evoformer_blocks import recompute  # noqa: E402
from evoformer_blocks.ops import module_nodes  # noqa: E402
from evoformer_blocks.primitives import separate_storages  # noqa: E402

N_EXTRA = 1024


@dataclass(frozen=True)
class Case:
    n_seq: int
    n_res: int

    def label(self) -> str:
        return f"N_seq {self.n_seq}, N_res {self.n_res}, N_extra {N_EXTRA}"


@dataclass(frozen=True)
class TokenCase:
    n_token: int

    def label(self) -> str:
        return f"N_token {self.n_token}"


IMPLS = ["plain", "plain-composed", "plain-per-module", "plain-separate", "plain-torch-checkpoint", "graphs", "peer",
         "peer-graphs", "peer-eager"]
DEFAULT_IMPLS = ["plain", "graphs", "peer", "peer-graphs"]
WARM_UP = {"plain": 2, "plain-composed": 2, "plain-per-module": 2, "plain-separate": 2, "plain-torch-checkpoint": 2,
           "graphs": 3, "peer": 3, "peer-graphs": 4, "peer-eager": 2}
PLAIN = ("plain", "plain-composed", "plain-per-module", "plain-separate", "plain-torch-checkpoint",
         "graphs")  # the library's stacks


def peer_compile_mode(impl: str):
    """The ``torch.compile`` mode of a peer implementation (None: eager), once cuEquivariance imports."""
    if optional_import("cuequivariance_torch") is None:
        raise RuntimeError("cuequivariance_torch is not importable")
    mode = {"peer": "default", "peer-graphs": "reduce-overhead", "peer-eager": None}[impl]
    if mode is not None:
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, name):  # 48 blocks share one compiled graph; never fall back silently
                setattr(torch._dynamo.config, name, 4096)
    return mode


def random_tensors(spec: list[tuple[str, tuple[int, ...], bool]], leaves, device, dtype) -> dict:
    """``{name: tensor}`` for ``spec``'s (name, shape, is_mask) in that order from one generator
    seeded 0: normal values, or 0/1 masks with 5 % zeros; the ``leaves`` require grad."""
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = {}
    for name, shape, is_mask in spec:
        if is_mask:
            tensors[name] = (torch.rand(*shape, generator=gen, device=device) > 0.05).to(dtype)
        else:
            tensors[name] = torch.randn(*shape, generator=gen, device=device).to(dtype)
    for name in leaves:
        tensors[name].requires_grad_(True)
    return tensors


def recompute_options(spec: str) -> tuple[dict, dict]:
    """--recompute as the stacks' keyword arguments: (an earlier stack's, the last stack's)."""
    policy, *items = spec.split(",")
    common, last = {"recompute": policy}, {}
    for item in items:
        if item == "last":
            last["checkpoint_last_group"] = False
        elif item.startswith("budget="):
            common["recompute_budget_gib"] = float(item[len("budget="):])
        else:
            raise ValueError(f"--recompute: unknown item {item!r} (budget=GIB, last)")
    return common, {**common, **last}


STACK_SECTIONS = ("extra_msa_stack", "evoformer_stack", "pairformer_stack")


def preset_config(library, preset: str, like=None):
    """``library``'s preset ``preset`` (its ``config.get_config``); with ``like`` (another
    library's config), each stack section's block count taken from it."""
    cfg = importlib.import_module(library.__name__ + ".config").get_config(preset)
    for section in STACK_SECTIONS if like is not None else ():
        if section in cfg and section in like:
            cfg[section].no_blocks = like[section].no_blocks
    return cfg


class AF2Trunk:
    """The AF2 trunk: ExtraMSAStack (unless ``extra`` is False) then EvoformerStack of ``preset``.
    A trunk gives its cases, model FLOPs, stacks per implementation, inputs, the leaves among them
    and the step's loss; the timing, profiling and report are shared."""

    name = "af2"
    cases = [Case(128, 256), Case(512, 384)]

    def __init__(self, extra: bool = True, preset: str = "af2", recompute: str = "full", blocks: int = 0):
        self.extra, self.preset, self.recompute = extra, preset, recompute
        self.cfg = preset_config(eb, preset)
        if blocks:
            self.cfg.evoformer_stack.no_blocks = blocks
        self.title = "extra-MSA and Evoformer stacks" if extra else "Evoformer stack alone"
        self.leaves = ("m", "z", "m_extra") if extra else ("m", "z")

    def flops(self, case: Case) -> float:
        """Model FLOPs of one forward+backward of the trunk's blocks."""
        cfg = self.cfg
        evo = block_flops(dict(cfg.evoformer_stack), case.n_seq, case.n_res, False)[1]
        extra = block_flops(dict(cfg.extra_msa_stack), N_EXTRA, case.n_res, True)[1]
        return cfg.evoformer_stack.no_blocks * evo + self.extra * cfg.extra_msa_stack.no_blocks * extra

    def stacks(self, impl: str, library=eb) -> list[torch.nn.Module]:
        """[extra-MSA stack (with ``extra``), Evoformer stack] of the implementation, as built (the
        plain stacks from ``library``: this checkout's, or a baseline revision's, from its own preset
        with this trunk's block counts)."""
        cfg = self.cfg if library is eb else preset_config(library, self.preset, like=self.cfg)
        if impl in PLAIN:
            earlier, last = recompute_options(self.recompute)
            extra = library.ExtraMSAStack.from_config(cfg, blocks_per_ckpt=1, cuda_graphs=impl == "graphs", **earlier)
            evo = library.EvoformerStack.from_config(cfg, blocks_per_ckpt=1, cuda_graphs=impl == "graphs", **last)
        else:
            mode = peer_compile_mode(impl)
            import trunk_peer

            extra = trunk_peer.PeerStack(compile_mode=mode, extra=True, **cfg.extra_msa_stack.to_dict())
            evo = trunk_peer.PeerStack(compile_mode=mode, **cfg.evoformer_stack.to_dict())
        return [extra, evo] if self.extra else [evo]

    def inputs(self, case: Case, device="cuda", dtype=DTYPE) -> dict:
        cfg, s, r = self.cfg, case.n_seq, case.n_res
        spec = [
            ("m", (1, s, r, cfg.c_m), False), ("z", (1, r, r, cfg.c_z), False),
            ("m_extra", (1, N_EXTRA, r, cfg.c_e), False),
            ("msa_mask", (1, s, r), True), ("extra_mask", (1, N_EXTRA, r), True), ("pair_mask", (1, r, r), True),
            # the loss's fixed projections of m, z and s
            ("cm", (1, s, r, cfg.c_m), False), ("cz", (1, r, r, cfg.c_z), False), ("cs", (1, r, cfg.c_s), False),
        ]
        return random_tensors(spec, ("m", "z", "m_extra"), device, dtype)

    def loss(self, stacks, t) -> torch.Tensor:
        *extra, evo = stacks
        z = extra[0](t["m_extra"], t["z"], t["extra_mask"], t["pair_mask"]) if extra else t["z"]
        m, z, s = evo(t["m"], z, t["msa_mask"], t["pair_mask"])
        return (m * t["cm"]).float().sum() + (z * t["cz"]).float().sum() + (s * t["cs"]).float().sum()

    def report(self) -> dict:
        return {"trunk": self.name, "extra_msa_stack": self.extra, "recompute": self.recompute}


class PairformerTrunk:
    """AF3's Pairformer: PairformerStack of ``preset`` (as :class:`AF2Trunk` for the rest)."""

    name = "pairformer"
    cases = [TokenCase(384), TokenCase(768)]
    title = "Pairformer stack"
    leaves = ("s", "z")

    def __init__(self, preset: str = "af3", recompute: str = "full", blocks: int = 0):
        self.preset, self.recompute = preset, recompute
        self.cfg = preset_config(eb, preset)
        if blocks:
            self.cfg.pairformer_stack.no_blocks = blocks

    def flops(self, case: TokenCase) -> float:
        section = self.cfg.pairformer_stack
        return section.no_blocks * pairformer_block_flops(dict(section), case.n_token)[1]

    def stacks(self, impl: str, library=eb) -> list[torch.nn.Module]:
        if impl in PLAIN:
            cfg = self.cfg if library is eb else preset_config(library, self.preset, like=self.cfg)
            _, last = recompute_options(self.recompute)
            return [library.PairformerStack.from_config(cfg, blocks_per_ckpt=1, cuda_graphs=impl == "graphs", **last)]
        mode = peer_compile_mode(impl)
        import trunk_peer

        return [trunk_peer.PeerPairformerStack(compile_mode=mode, **self.cfg.pairformer_stack.to_dict())]

    def inputs(self, case: TokenCase, device="cuda", dtype=DTYPE) -> dict:
        n, c_s, c_z = case.n_token, self.cfg.pairformer_stack.c_s, self.cfg.pairformer_stack.c_z
        spec = [
            ("s", (1, n, c_s), False), ("z", (1, n, n, c_z), False),
            ("single_mask", (1, n), True), ("pair_mask", (1, n, n), True),
            # the loss's fixed projections of s and z
            ("cs", (1, n, c_s), False), ("cz", (1, n, n, c_z), False),
        ]
        return random_tensors(spec, self.leaves, device, dtype)

    def loss(self, stacks, t) -> torch.Tensor:
        (stack,) = stacks
        s, z = stack(t["s"], t["z"], t["single_mask"], t["pair_mask"])
        return (s * t["cs"]).float().sum() + (z * t["cz"]).float().sum()

    def report(self) -> dict:
        return {"trunk": self.name, "recompute": self.recompute}


TRUNKS = {"af2": AF2Trunk, "pairformer": PairformerTrunk}


def build_stacks(trunk, impl: str, train: bool, device="cuda", dtype=DTYPE) -> list[torch.nn.Module]:
    """The trunk's stacks of the implementation with random weights, on ``device`` in ``dtype``,
    in training (``train``) or eval mode."""
    stacks = [randomized(stack).to(device, dtype).train(train) for stack in trunk.stacks(impl)]
    if impl == "plain-separate":  # (packing happens in the move above)
        for stack in stacks:
            separate_storages(stack)
    return stacks


def make_step(trunk, stacks, t):
    """One training step: the gradients of the trunk's input leaves and every parameter set to None,
    the loss's forward and backward."""
    leaves = [t[name] for name in trunk.leaves]
    params = [p for stack in stacks for p in stack.parameters()]
    cuda_graph_steps = any(getattr(stack, "cuda_graph_steps", False) for stack in stacks)  # (peer-graphs)

    def step():
        for x in leaves + params:
            x.grad = None
        if cuda_graph_steps:  # a new step: the CUDA-graph trees may reuse the last step's outputs' memory
            torch.compiler.cudagraph_mark_step_begin()
        trunk.loss(stacks, t).backward()

    return step


def baseline_pair(trunk, case, revision: str, train: bool = False, device="cuda", dtype=DTYPE):
    """This checkout's plain stacks and revision ``revision``'s (benchmarks/baseline.py) with the
    same weights, one set of inputs: (our step, the baseline's step, whether one step of each gives
    every gradient, of the parameters (by name) and of the inputs, bitwise equal). Each step has run
    twice (warm-up: a block decides its one-call path in its first call). Exits where the
    revision's stacks do not take this checkout's weights."""
    import baseline

    library = baseline.load(revision)
    ours = build_stacks(trunk, "plain", train, device, dtype)
    theirs = [stack.to(device, dtype).train(train) for stack in trunk.stacks("plain", library)]
    for mine, other in zip(ours, theirs):
        mismatch = other.load_state_dict(mine.state_dict(), strict=False)
        if mismatch.missing_keys or mismatch.unexpected_keys:
            raise SystemExit(f"--baseline {revision}: its {type(other).__name__} does not take this one's weights: "
                             f"{mismatch}")
    t = trunk.inputs(case, device, dtype)
    steps, grads = [], []
    for stacks in (ours, theirs):
        steps.append(make_step(trunk, stacks, t))
        for _ in range(2):
            steps[-1]()
        named = {f"{i}.{name}": p.grad for i, stack in enumerate(stacks) for name, p in stack.named_parameters()}
        grads.append(({name: g.clone() for name, g in named.items()}, [t[name].grad.clone() for name in trunk.leaves]))
    (mine, mine_in), (other, other_in) = grads
    same = mine.keys() == other.keys() and all(torch.equal(g, other[name]) for name, g in mine.items()) and all(
        torch.equal(a, b) for a, b in zip(mine_in, other_in))
    return steps[0], steps[1], same


def against_baseline(trunk, case, revision: str, rounds: int) -> dict:
    """--baseline: this checkout's plain trunk and revision ``revision``'s, profiled steps alternating
    (the module docstring says what is reported)."""
    gc.collect()
    torch.cuda.empty_cache()
    ours, theirs, same = baseline_pair(trunk, case, revision)
    steps = {"ours": ours, "baseline": theirs}
    runs = alternating_rounds(steps, rounds, profile_step)
    result = {"revision": revision, "gradients_bitwise_equal": same}
    for side, step in steps.items():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        kernels = [run["kernels_ms"] for run in runs[side]]
        groups = {group for run in runs[side] for group in run["kernel_groups"]}
        result[side] = {
            "kernels_ms": statistics.median(kernels), "kernels_ms_all": kernels,
            "groups_ms": {group: statistics.median(run["kernel_groups"].get(group, [0.0])[0] for run in runs[side])
                          for group in groups},
            "launches": runs[side][-1]["launches"],
            "memsets": runs[side][-1]["kernel_groups"].get("memsets", [0.0, 0])[1],
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
    result["ratio"] = result["ours"]["kernels_ms"] / result["baseline"]["kernels_ms"]
    return result


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


# Kernel groups of the profiled step: (group, substrings of kernel names), the first match wins; the
# library's kernels by name, cuBLAS's (nvjet, xmma, cutlass, split-K reductions, gemv) as GEMMs, the
# rest (PyTorch's elementwise kernels, copies, concatenations) as other.
KERNEL_GROUPS = (
    ("attention forward", ("forward_sm80_kernel", "forward_sm90_kernel")),
    ("attention dK/dV", ("_dkdv_kernel",)),
    ("attention dQ", ("_dq_kernel",)),
    ("attention pair-bias gradient", ("_dpair_kernel",)),
    ("attention delta, mask", ("backward_delta_kernel", "prepare_mask_kernel")),
    ("triangle multiplication", ("triangle_", "fold_affine_kernel", "unfold_affine_grads_kernel")),
    ("outer product mean tile GEMMs", ("opm_gemm_kernel", "opm_gemm_sm90_kernel", "opm_weight_grad_kernel")),
    ("layer norm backward", ("layer_norm_rows_backward_kernel", "layer_norm_channels_backward_kernel")),
    ("layer norm forward", ("layer_norm_rows_kernel", "layer_norm_channels_kernel")),
    ("column sums", ("column_sum_kernel",)),
    ("gates", ("gate_pack", "sigmoid_gate")),
    ("cuBLAS GEMMs", ("nvjet", "xmma", "gemm", "cutlass", "splitKreduce", "gemv")),
    ("memsets", ("Memset",)),
)


def kernel_group(name: str) -> str:
    """The KERNEL_GROUPS group of a CUDA kernel (or copy / set) name."""
    return next((group for group, keys in KERNEL_GROUPS if any(key in name for key in keys)), "other")


def profile_step(step) -> dict:
    """The CUDA time and the host operations of one step (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    cuda_us, aten, launches, spans, groups = 0.0, Counter(), 0, [], {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            cuda_us += event.device_time_total
            spans.append((event.time_range.start, event.time_range.end))
            group = groups.setdefault(kernel_group(event.name), [0.0, 0])  # [ms, launches]
            group[0] += event.device_time_total / 1e3
            group[1] += 1
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
            "aten_top": aten.most_common(30),
            "kernel_groups": dict(sorted(groups.items(), key=lambda kv: -kv[1][0]))}


def measure(trunk, impl: str, case, args) -> dict:
    if impl == "plain-composed":  # the modules compose their ops instead of calling their nodes
        with module_nodes.composed():
            return _measure(trunk, impl, case, args)
    if impl == "plain-per-module":  # the blocks call their modules' nodes from Python
        with module_nodes.per_module():
            return _measure(trunk, impl, case, args)
    if impl == "plain-torch-checkpoint":  # full recomputation under torch.utils.checkpoint
        with recompute.through_torch_checkpoint():
            return _measure(trunk, impl, case, args)
    return _measure(trunk, impl, case, args)


def _measure(trunk, impl: str, case, args) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    stacks = build_stacks(trunk, impl, train=args.dropout == "on")
    step = make_step(trunk, stacks, trunk.inputs(case))
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
        row["replays"] = sum(stack._graphs.replays for stack in stacks)
    if not args.no_profile:
        row.update(profile_step(step))
    return row


def main() -> None:
    # The trunk decides the cases (--shapes indexes them): read --trunk first.
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--trunk", choices=list(TRUNKS), default="af2")
    trunk_name = first.parse_known_args()[0].trunk
    cli = CommandLine(__doc__, shapes=[c.label() for c in TRUNKS[trunk_name].cases], impls=IMPLS,
                      default_impls=DEFAULT_IMPLS)
    cli.add_argument("--trunk", choices=list(TRUNKS), default="af2",
                     help="af2: extra-MSA and Evoformer stacks (default); pairformer: AF3's Pairformer stack "
                          "(--shapes then indexes its cases)")
    cli.add_argument("--dropout", choices=("on", "off"), default="on", help="training-mode dropout (default on)")
    cli.add_argument("--steps", type=int, default=5, help="timed steps per implementation (median)")
    cli.add_argument("--no-profile", action="store_true", help="skip the profiled step (CUDA time, host operations)")
    cli.add_argument("--no-extra", action="store_true", help="the Evoformer stack alone (no extra-MSA stack; af2 trunk)")
    cli.add_argument("--recompute", default="full", metavar="SPEC",
                     help="POLICY[,budget=GIB][,last]: what checkpointed blocks keep (see above; default full)")
    cli.add_argument("--backward-thread", choices=("engine", "caller"), default="engine",
                     help="caller: torch.autograd.set_multithreading_enabled(False) for the whole run")
    cli.add_argument("--baseline", default="", metavar="REV",
                     help="the plain trunk's kernel time against revision REV's in one process (see above)")
    cli.add_argument("--blocks", type=int, default=4,
                     help="with --baseline: blocks of the Evoformer or Pairformer stack (default 4)")
    cli.add_argument("--rounds", type=int, default=5, help="with --baseline: profiled steps of each side (default 5)")
    args = cli.parse()
    if args.forward_only:
        cli.error("--forward-only: a training step is a forward and a backward")
    if args.no_extra and args.trunk != "af2":
        cli.error("--no-extra: only the af2 trunk has an extra-MSA stack")
    if args.baseline and args.dropout != "off":
        cli.error("--baseline needs --dropout off (two revisions need not draw the same dropout masks)")
    if args.baseline and (args.blocks < 1 or args.rounds < 1):
        cli.error("--blocks and --rounds must be at least 1")
    blocks = args.blocks if args.baseline else 0
    if args.trunk == "af2":
        trunk = AF2Trunk(extra=not args.no_extra, recompute=args.recompute, blocks=blocks)
    else:
        trunk = PairformerTrunk(recompute=args.recompute, blocks=blocks)
    torch.autograd.set_multithreading_enabled(args.backward_thread == "engine")
    print(run_info_line(), flush=True)
    if args.baseline:
        results = []
        for index in args.shapes:
            case = trunk.cases[index]
            r = against_baseline(trunk, case, args.baseline, args.rounds)
            print(f"\n## trunk step ({trunk.title}, {args.blocks} blocks), {case.label()}, dropout off, recompute "
                  f"{args.recompute}: this checkout against {args.baseline}, {args.rounds} profiled steps each, "
                  "alternating", flush=True)
            print(markdown_table(
                ["side", "CUDA ms (median)", "rounds", "launches", "memsets", "peak GiB allocated"],
                [[side, fmt(r[side]["kernels_ms"], 2), ", ".join(fmt(x, 2) for x in r[side]["kernels_ms_all"]),
                  r[side]["launches"], r[side]["memsets"], f"{r[side]['peak_allocated_gib']:.2f}"]
                 for side in ("ours", "baseline")]), flush=True)
            print(f"ours / baseline {r['ratio']:.4f}; gradients bitwise equal: {r['gradients_bitwise_equal']}",
                  flush=True)
            ours_groups, their_groups = r["ours"]["groups_ms"], r["baseline"]["groups_ms"]
            names = sorted(set(ours_groups) | set(their_groups), key=lambda g: -their_groups.get(g, 0.0))
            print("\nby kernel group (KERNEL_GROUPS; medians over the rounds, ms):", flush=True)
            print(markdown_table(
                ["group", "ours", "baseline", "difference"],
                [[g, fmt(ours_groups.get(g, 0.0), 3), fmt(their_groups.get(g, 0.0), 3),
                  f"{ours_groups.get(g, 0.0) - their_groups.get(g, 0.0):+.3f}"] for g in names]), flush=True)
            results.append({"case": case.label(), "blocks": args.blocks, **trunk.report(), **r})
            torch.cuda.empty_cache()
        if args.json:
            write_json(args.json, results)
        return
    results = []
    for index in args.shapes:
        case = trunk.cases[index]
        flops = trunk.flops(case)
        print(f"\n## trunk step ({trunk.title}), {case.label()}, dropout {args.dropout}, recompute {args.recompute}, "
              f"backward thread {args.backward_thread} "
              f"({flops / 1e12:.1f} TFLOP model "
              "forward+backward)", flush=True)
        rows = {}
        for impl in args.impls:
            try:
                rows[impl] = measure(trunk, impl, case, args)
            except Exception as exc:  # a peer that cannot run here is reported, not fatal
                rows[impl] = {"error": failure_reason(exc)}
            print(f"  {impl}: " + str({k: v for k, v in rows[impl].items() if k not in ("aten_top", "kernel_groups")}),
                  flush=True)
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
        for impl, r in rows.items():
            if r.get("kernel_groups"):
                total = sum(ms for ms, _ in r["kernel_groups"].values())
                print(f"\n{impl}: the profiled step's CUDA time by kernel group (KERNEL_GROUPS)")
                print(markdown_table(["group", "ms", "share", "launches"],
                                     [[g, fmt(ms, 1), f"{100 * ms / total:.1f} %", n]
                                      for g, (ms, n) in r["kernel_groups"].items()]), flush=True)
        results.append({"case": case.label(), "dropout": args.dropout, **trunk.report(),
                        "backward_thread": args.backward_thread, "flops": flops, "impls": rows})
        torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
