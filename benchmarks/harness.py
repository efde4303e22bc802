"""The harness every benchmark in this folder runs on: timing, peak memory, forward(+backward)
steps, implementations and optional peers, tables, JSON and one command line.

A benchmark is a list of cases (its shapes) and a dict of implementations (``Impl``). For each case
it builds the inputs once, calls ``measure`` for every implementation on them, and prints one
Markdown table per case; ``write_json`` keeps every number. Ratios are only ever taken between
implementations measured in the same process.

Device limits
    DeviceLimits(name, sms, clock_hz, exp_per_clock_per_sm, dense_bf16_flops, hbm_bytes_per_s)
                                           one GPU's physical limits; .exp_per_s: exps per second
    H100_SXM                               the H100 SXM numbers the benchmarks' floors use

Implementations
    Impl(name, run, env={}, requires=())   ``run(*args)`` is the forward; ``env`` is set around
                                           forward and backward; ``requires`` names modules that
                                           must import first (an optional peer)
    Impl.unavailable() -> str | None       why it cannot run here (a failed import), else None
    optional_import(name) -> module        imports a peer, raising PeerUnavailable with the reason
    PeerUnavailable                        the exception optional_import raises
    failure_reason(exc) -> str             "TypeName: first line of the message"

Steps and measurements
    environment(variables)                 context manager: sets environment variables, restores them
    make_step(forward, leaves, *, backward, env=None, seed=0) -> step
                                           step() runs forward() and, with backward, the gradients
                                           of `leaves` for fixed random cotangents (drawn on the
                                           first call, seeded); sets leaves' requires_grad to
                                           `backward`
    warm_up(step, iters=3)                 runs step() `iters` times and synchronizes
    median_ms(step, *, warmup_ms=50, rep_ms=300) -> float
                                           triton.testing.do_bench median (L2 flushed before each run)
    peak_mib(step) -> float                CUDA-allocator peak during one step() above what was
                                           allocated before it (the inputs)
    host_and_gpu_ms(step, iters=50) -> (host_ms, gpu_ms)
                                           CPU time to enqueue one step and its GPU time (CUDA
                                           events), with the GPU queue kept full
    Measurement(fwd_ms, fwdbwd_ms, fwd_peak_mib, peak_mib, error)
                                           one implementation on one case; .ok, .cell() ("fwd / f+b"
                                           or "fails: reason"), .as_dict()
    measure(impl, args, leaves, *, forward_only=False, warmup_ms=50, rep_ms=300) -> Measurement
                                           warm-up, peak memory and median time of the forward and
                                           the forward+backward; an implementation that cannot
                                           import or that raises gives Measurement(error=...), never
                                           an exception

Output
    run_info() -> dict                     date, device, capability, torch, CUDA, git commit
    run_info_line() -> str                 the same in one line, printed first by every benchmark
    fmt(x, digits=3) -> str                a number, or "–" for None / NaN
    speedup(other_ms, ours_ms) -> str      "1.23x" (other / ours), "–" when either is missing
    markdown_table(header, rows) -> str
    write_json(path, results, **extra)     {"run": run_info(), "results": results, **extra}

Command line
    CommandLine(doc, *, shapes, impls, default_shapes="all", default_impls=None, positional=False,
                json_output=True, needs_cuda=True)
                                           an ArgumentParser with --shapes (all, or indices into
                                           `shapes`), --impls (names from `impls`), --forward-only
                                           and (json_output) --json; default_impls may be a callable
                                           (its docstring's first line is the help text), called
                                           only when --impls is not given; with positional=True the
                                           first two positional arguments may give shapes and impls
                                           (the older form of some scripts). Add options with
                                           add_argument as usual.
    CommandLine.parse(argv=None) -> Namespace
                                           .shapes (list of indices), .impls (list of names), .json,
                                           .forward_only, and whatever was added; after --help, and
                                           before a default_impls callable runs, exits when
                                           needs_cuda and there is no CUDA GPU
    require_cuda()                         exits with a message when there is no CUDA GPU

A block benchmark on top of this, in outline:

    SIZES = [(128, 256), (512, 384)]                  # (N_seq, N_res)
    IMPLS = {"default": Impl("default", run_block),
             "cueq": Impl("cueq", run_cueq_trimul, requires=("cuequivariance_torch",))}
    cli = CommandLine(__doc__, shapes=[f"{s} x {r}" for s, r in SIZES], impls=list(IMPLS))
    args = cli.parse(); print(run_info_line())
    for i in args.shapes:
        block, m, z, masks = build(*SIZES[i])
        leaves = [m, z, *block.parameters()]
        rows = [[name, measure(IMPLS[name], (block, m, z, masks), leaves,
                               forward_only=args.forward_only).cell()] for name in args.impls]
        print(markdown_table(["impl", "fwd / fwd+bwd ms"], rows))

A per-module breakdown is a second dict of Impls, each running one submodule of the block on the
same inputs (its leaves: that submodule's parameters and inputs), measured the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the checkout's evoformer_blocks, installed or not


# ---- device limits -------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceLimits:
    name: str
    sms: int
    clock_hz: float
    exp_per_clock_per_sm: int  # MUFU.EX2 results per clock per SM
    dense_bf16_flops: float  # tensor cores, dense bf16, FLOP/s
    hbm_bytes_per_s: float

    @property
    def exp_per_s(self) -> float:
        return self.sms * self.exp_per_clock_per_sm * self.clock_hz


# H100 SXM (compute capability 9.0): 16 exps per clock per SM, 989 TFLOP/s dense bf16 (about 800
# reached on a large GEMM), HBM about 3.0 TB/s on a measured copy.
H100_SXM = DeviceLimits("H100 SXM", sms=132, clock_hz=1.83e9, exp_per_clock_per_sm=16,
                        dense_bf16_flops=989e12, hbm_bytes_per_s=3.0e12)


# ---- implementations and optional peers -------------------------------------------------------------
class PeerUnavailable(RuntimeError):
    """An optional peer that cannot be imported here."""


def failure_reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:120] if lines else ''}".rstrip(": ")


def optional_import(name: str):
    """The module `name`, or PeerUnavailable saying why it does not import."""
    try:
        return importlib.import_module(name)
    except Exception as exc:  # ImportError, or whatever a broken install raises
        raise PeerUnavailable(f"{name} does not import ({failure_reason(exc)})") from exc


@dataclass(frozen=True)
class Impl:
    name: str
    run: Callable[..., Any]  # the forward: run(*args) -> output tensor(s)
    env: Mapping[str, str] = field(default_factory=dict)  # set around forward and backward
    requires: tuple[str, ...] = ()  # modules that must import before it can run

    def unavailable(self) -> Optional[str]:
        for name in self.requires:
            try:
                optional_import(name)
            except PeerUnavailable as exc:
                return str(exc)
        return None


# ---- steps and measurements ----------------------------------------------------------------------
@contextlib.contextmanager
def environment(variables: Mapping[str, str]) -> Iterator[None]:
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


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


def make_step(forward: Callable[[], Any], leaves: Sequence[torch.Tensor], *, backward: bool,
              env: Optional[Mapping[str, str]] = None, seed: int = 0) -> Callable[[], Any]:
    """step() runs forward() and, with `backward`, the gradients of `leaves` for fixed random
    cotangents of the outputs that require grad (drawn on the first call from `seed`). The
    leaves' requires_grad is set to `backward`; `env` is set around forward and backward."""
    for t in leaves:
        t.requires_grad_(backward)
    variables = dict(env or {})
    cotangents: list[torch.Tensor] = []

    def step():
        with environment(variables):
            out = forward()
            if backward:
                outs = [t for t in _tensors(out) if t.requires_grad]
                if not outs:
                    raise RuntimeError("backward step: no output of the forward requires grad")
                if not cotangents:
                    gen = torch.Generator(device=outs[0].device).manual_seed(seed)
                    cotangents.extend(torch.randn(t.shape, generator=gen, device=t.device).to(t.dtype) for t in outs)
                torch.autograd.grad(outs, list(leaves), cotangents, allow_unused=True)
        return out

    return step


def warm_up(step: Callable[[], Any], iters: int = 3) -> None:
    for _ in range(iters):
        step()
    torch.cuda.synchronize()


def kernel_breakdown(step: Callable[[], Any], iters: int = 3, top: int = 25) -> tuple[float, int, list[list[Any]]]:
    """The CUDA kernels of `step` (torch.profiler, after warm-up), grouped by kernel name: (total ms
    per iteration, launches per iteration, rows [ms per iteration, launches per iteration, name] of
    the `top` costliest)."""
    from torch.profiler import ProfilerActivity, profile

    warm_up(step)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        warm_up(step, iters)
    groups: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            group = groups.setdefault(event.name, [0.0, 0])
            group[0] += event.device_time_total / 1e3 / iters
            group[1] += 1
    total = sum(g[0] for g in groups.values())
    launches = sum(g[1] for g in groups.values()) // iters
    rows = sorted(([ms, count // iters, name[:100]] for name, (ms, count) in groups.items()), key=lambda r: -r[0])
    return total, launches, rows[:top]


def median_ms(step: Callable[[], Any], *, warmup_ms: int = 50, rep_ms: int = 300) -> float:
    from triton.testing import do_bench

    return do_bench(step, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def alternating_rounds(steps: Mapping[str, Callable[[], Any]], rounds: int,
                       measure: Callable[[Callable[[], Any]], Any]) -> dict[str, list[Any]]:
    """``{side: [measure(step) of each round]}`` for the ``steps`` of an A/B in one process: each
    round measures every side once, in reverse order every second round, so that no side always
    runs right after the same other one."""
    results: dict[str, list[Any]] = {side: [] for side in steps}
    for index in range(rounds):
        for side in steps if index % 2 == 0 else reversed(list(steps)):
            results[side].append(measure(steps[side]))
    return results


def peak_mib(step: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def host_and_gpu_ms(step: Callable[[], Any], iters: int = 50) -> tuple[float, float]:
    """(host ms, GPU ms) per step: the CPU time to enqueue it and its GPU time from CUDA events, with
    the GPU kept busy behind a sleep kernel so that the queue never runs dry. A step whose host
    time exceeds its GPU time is host-bound when nothing is queued ahead of it. The device's launch
    queue holds on the order of a thousand launches: beyond that the host waits for the sleep, so
    keep iters x launches per step below it (an Evoformer block's forward+backward, about 430
    launches, reads as 29 ms of "host time" at iters=20)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~0.2 s at H100 clocks
    start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    host_ms = (time.perf_counter() - t0) * 1e3 / iters
    end.record()
    torch.cuda.synchronize()
    return host_ms, start.elapsed_time(end) / iters


@dataclass
class Measurement:
    fwd_ms: float = math.nan
    fwdbwd_ms: float = math.nan
    fwd_peak_mib: float = math.nan  # allocator peak above the inputs during one forward
    peak_mib: float = math.nan  # ... during one forward+backward
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def cell(self) -> str:
        return f"fails: {self.error}" if self.error else f"{fmt(self.fwd_ms)} / {fmt(self.fwdbwd_ms)}"

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def measure(impl: Impl, args: Sequence[Any], leaves: Sequence[torch.Tensor], *, forward_only: bool = False,
            warmup_ms: int = 50, rep_ms: int = 300) -> Measurement:
    """Forward and (unless forward_only) forward+backward of impl.run(*args): one call to compile /
    build / warm up, one for the peak memory, then the median time. The leaves' requires_grad is
    restored afterwards. Failures are results: Measurement(error=reason)."""
    reason = impl.unavailable()
    if reason is not None:
        return Measurement(error=reason)
    flags = [t.requires_grad for t in leaves]
    result = Measurement()
    try:
        for backward in (False,) if forward_only else (False, True):
            step = make_step(lambda: impl.run(*args), leaves, backward=backward, env=impl.env)
            step()
            peak, ms = peak_mib(step), median_ms(step, warmup_ms=warmup_ms, rep_ms=rep_ms)
            if backward:
                result.fwdbwd_ms, result.peak_mib = ms, peak
            else:
                result.fwd_ms, result.fwd_peak_mib = ms, peak
    except Exception as exc:  # a peer failing on a case is a result, not a crash
        result.error = failure_reason(exc)
    finally:
        for t, flag in zip(leaves, flags):
            t.requires_grad_(flag)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return result


# ---- output ----------------------------------------------------------------------------------------
def _git_commit() -> Optional[str]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+changes" if dirty else "")


def run_info() -> dict:
    info = {"date": datetime.now(timezone.utc).date().isoformat(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "commit": _git_commit()}
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        info.update(device=torch.cuda.get_device_name(), capability=f"{major}.{minor}")
    return info


def run_info_line() -> str:
    i = run_info()
    device = f"{i['device']} ({i['capability']})" if "device" in i else "no CUDA device"
    return f"device: {device}, torch {i['torch']}, CUDA {i['cuda']}, commit {i['commit']}, {i['date']}"


def fmt(x: Optional[float], digits: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def speedup(other_ms: Optional[float], ours_ms: Optional[float]) -> str:
    """How many times faster `ours` is than `other` (other / ours)."""
    if other_ms is None or ours_ms is None or math.isnan(other_ms) or math.isnan(ours_ms) or ours_ms <= 0:
        return "–"
    return f"{other_ms / ours_ms:.2f}x"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Union[str, Path], results: Any, **extra: Any) -> None:
    with open(path, "w") as fh:
        json.dump({"run": run_info(), "results": results, **extra}, fh, indent=1)


# ---- command line ---------------------------------------------------------------------------------
class CommandLine(argparse.ArgumentParser):
    """The options every benchmark takes: --shapes, --impls, --json, --forward-only."""

    def __init__(self, doc: Optional[str], *, shapes: Sequence[str], impls: Sequence[str],
                 default_shapes: str = "all",
                 default_impls: Union[Sequence[str], Callable[[], Sequence[str]], None] = None,
                 positional: bool = False, json_output: bool = True, needs_cuda: bool = True):
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        self.shape_names, self.impl_names = list(shapes), list(impls)
        self.default_shapes, self.default_impls = default_shapes, default_impls
        self.needs_cuda = needs_cuda
        listing = "; ".join(f"{i}: {name}" for i, name in enumerate(self.shape_names))
        self.add_argument("--shapes", default=None,
                          help=f"'all', or comma-separated indices (default {default_shapes}): {listing}")
        if callable(default_impls):  # its docstring says what it picks
            impls_default = (default_impls.__doc__ or "chosen at run time").strip().splitlines()[0]
        else:
            impls_default = ",".join(default_impls) if default_impls else "all"
        self.add_argument("--impls", default=None,
                          help=f"comma-separated, from {', '.join(self.impl_names)} (default: {impls_default})")
        if json_output:
            self.add_argument("--json", default=None, metavar="PATH", help="write every number here")
        self.add_argument("--forward-only", action="store_true", help="skip forward+backward")
        if positional:
            self.add_argument("shapes_pos", nargs="?", metavar="SHAPES", help="the same as --shapes")
            self.add_argument("impls_pos", nargs="?", metavar="IMPLS", help="the same as --impls")

    def parse(self, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
        args = self.parse_args(argv)  # --help ends here, with or without a GPU
        shapes = args.shapes or getattr(args, "shapes_pos", None) or self.default_shapes
        impls = args.impls or getattr(args, "impls_pos", None)
        if shapes == "all":
            args.shapes = list(range(len(self.shape_names)))
        else:
            try:
                args.shapes = [int(s) for s in shapes.split(",")]
            except ValueError:
                self.error(f"--shapes: '{shapes}' is not 'all' or comma-separated indices")
            if any(not 0 <= i < len(self.shape_names) for i in args.shapes):
                self.error(f"--shapes: indices go from 0 to {len(self.shape_names) - 1}")
        if impls is not None:
            args.impls = impls.split(",")
            unknown = [i for i in args.impls if i not in self.impl_names]
            if unknown:
                self.error(f"--impls: unknown {', '.join(unknown)}; known: {', '.join(self.impl_names)}")
        if self.needs_cuda:
            require_cuda()
        if impls is None:
            default = self.default_impls() if callable(self.default_impls) else self.default_impls
            args.impls = list(default or self.impl_names)
        return args


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU (none is visible)")
