"""JIT build of the CUDA kernels in csrc/ with torch.utils.cpp_extension and ninja.

- Sources: every ``.cpp`` (one bindings file per kernel family) and ``.cu`` under the source
  directory, by family folder: ``attention/`` (with ``attention/instantiations/``, one file per
  kernel instantiation), ``layer_norm/``, ``triangle_multiplication/``, ``outer_product_mean/``,
  ``gating/``, ``modules/`` (the per-module autograd nodes, one bindings file per node family);
  ``common/`` holds headers only. An
  installed package (``pip install .`` or a wheel) carries them as package data, ``evoformer_blocks/_csrc`` (pyproject.toml maps the repository's
  ``csrc/`` there); a checkout or an editable install has no such directory and reads the
  checkout's ``csrc/``, so edits there rebuild. Headers include each other by their path from there.
- CUTLASS headers: ``$CUTLASS_PATH`` (its ``include/``) or the ``nvidia-cutlass`` wheel's
  ``cutlass_library/source/include``, found without importing the package.
- Architectures: ``TORCH_CUDA_ARCH_LIST`` if set, else the visible GPU's compute capability.
- Two libraries where every architecture is 9.0a (an H100/H200 build): 16-bit attention runs on the
  Hopper kernels there, so the portable 16-bit attention instantiations (36 translation units, about
  a fifth of the compile work) are left out of the core library and built into a second one, with
  ``attention/portable_kernels.cu`` and ``attention/attention.cu``, the first time the sm80 family is
  chosen for 16-bit inputs (``EVOFORMER_BLOCKS_KERNELS=sm80``; :func:`load_portable`). Every other
  build is one library holding everything (``portable_kernels.cu`` left out).
- Cache: the extension name carries a hash of torch/CUDA versions, the architectures, the CUTLASS
  version and every source and header, so a stale build is never reused; builds live in torch's
  extension directory (``TORCH_EXTENSIONS_DIR``) and are shared across processes.
- A file lock (fcntl, released if the process dies) makes parallel processes build once.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # evoformer_blocks/
INSTALLED_SOURCE_DIR = _PACKAGE_DIR / "_csrc"  # package data of an installed package
CHECKOUT_SOURCE_DIR = _PACKAGE_DIR.parent / "csrc"  # a checkout, an editable install
SOURCE_DIR = INSTALLED_SOURCE_DIR if INSTALLED_SOURCE_DIR.is_dir() else CHECKOUT_SOURCE_DIR
# What a build reads, and what the package data carries (pyproject.toml lists the same patterns).
SOURCE_SUFFIXES = (".cpp", ".cu", ".cuh", ".h", ".json")
OP_NAMESPACE = "evoformer_blocks_cuda"

CUDA_FLAGS = [
    "-O3",
    "-std=c++17",
    "--expt-relaxed-constexpr",
    "-lineinfo",
    "-DNDEBUG",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
]
CXX_FLAGS = ["-O3", "-std=c++17"]


def cuda_flags() -> list[str]:
    """CUDA_FLAGS plus EVOFORMER_BLOCKS_EXTRA_CUDA_FLAGS (tuning experiments; part of the cache key)."""
    return CUDA_FLAGS + os.environ.get("EVOFORMER_BLOCKS_EXTRA_CUDA_FLAGS", "").split()


_loaded: Optional[str] = None  # name of the loaded extension
_load_error: Optional[str] = None
_loaded_arch: Optional[str] = None  # the architectures it was built for
# the attached portable kernels' library's name, "" where the core library holds them; None: not asked yet
_portable_loaded: Optional[str] = None

# The portable 16-bit attention instantiations (generate.py's file names) and the entry point of their
# library: what a Hopper-only build keeps apart (module docstring).
PORTABLE_16BIT_UNIT = re.compile(r"^(forward|backward)_sm80_(fp16|bf16)_")
PORTABLE_ENTRY_UNIT = "portable_kernels"
PORTABLE_SHARED_UNITS = ("attention",)  # attention.cu: the delta pass and mask preparation they launch


def cutlass_include_dir() -> Path:
    """The directory that holds ``cutlass/cutlass.h`` and ``cute/``."""
    env = os.environ.get("CUTLASS_PATH")
    if env:
        for candidate in (Path(env) / "include", Path(env)):
            if (candidate / "cutlass" / "cutlass.h").is_file():
                return candidate
        raise FileNotFoundError(f"CUTLASS_PATH={env} holds no include/cutlass/cutlass.h")
    spec = importlib.util.find_spec("cutlass_library")  # locates the wheel without importing it
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "source" / "include"
            if (candidate / "cutlass" / "cutlass.h").is_file():
                return candidate
    raise FileNotFoundError(
        "CUTLASS headers not found: `pip install nvidia-cutlass` or set CUTLASS_PATH to a CUTLASS checkout"
    )


def cutlass_version(include_dir: Path) -> str:
    text = (include_dir / "cutlass" / "version.h").read_text()
    parts = [re.search(rf"#define CUTLASS_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) if m else "?" for m in parts)


def sources() -> list[Path]:
    """Every translation unit under SOURCE_DIR: each family's bindings (``*.cpp``), its launchers and
    the attention's instantiations (``*.cu``), in path order. Their names are unique (ninja names an
    object after its source's file name)."""
    if not SOURCE_DIR.is_dir() or not (SOURCE_DIR / "kernel_table.json").is_file():
        raise FileNotFoundError(
            f"kernel sources not found at {INSTALLED_SOURCE_DIR} (installed package) "
            f"nor at {CHECKOUT_SOURCE_DIR} (checkout); reinstall the package"
        )
    found = sorted(p for p in SOURCE_DIR.rglob("*") if p.suffix in (".cpp", ".cu") and p.is_file())
    names = [p.stem for p in found]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise RuntimeError(f"kernel sources under {SOURCE_DIR} share file names {clashes}: their objects would clash")
    return found


def portable_apart(arch: str) -> bool:
    """Whether a build for ``arch`` keeps the portable 16-bit attention kernels in a library of their
    own: every architecture is 9.0a, where 16-bit attention runs on the Hopper kernels."""
    return all(entry.startswith("9.0a") for entry in arch.split(";"))


def core_sources(arch: str) -> list[Path]:
    """The core library's translation units for ``arch``: :func:`sources` less the portable
    kernels' entry point, and less the portable 16-bit instantiations where :func:`portable_apart`."""
    apart = portable_apart(arch)
    return [s for s in sources()
            if s.stem != PORTABLE_ENTRY_UNIT and not (apart and PORTABLE_16BIT_UNIT.match(s.stem))]


def portable_sources() -> list[Path]:
    """The portable kernels' library: the portable 16-bit instantiations, their entry point and the
    host code they launch (attention.cu)."""
    return [s for s in sources() if PORTABLE_16BIT_UNIT.match(s.stem) or s.stem == PORTABLE_ENTRY_UNIT
            or (s.parent.name == "attention" and s.stem in PORTABLE_SHARED_UNITS)]


# The bindings and launchers that take longest to compile (18-23 s each on an H200 machine's 16 cores,
# 2026-11-30 build log; the others 5-13 s), longest first: started with the first bindings, not after
# them by path, so that none of them starts in the build's last seconds.
SLOW_HOST_UNITS = ("modules_bindings", "triangle_output", "triangle_node_bindings", "opm_node_bindings", "gating",
                   "layer_norm")
# The block ops' Hopper units, longest first (the triangle input 27-40 s, its gate backward 20-23 s).
HOPPER_BLOCK_UNITS = ("triangle_input_sm90", "triangle_gate_backward_sm90")


def compile_order(paths: list[Path]) -> list[Path]:
    """``paths`` with the longest compiles first (ninja starts a fresh build's jobs in the order
    given, so a long unit started in the last wave sets the build's end): the Hopper units (the
    triangle multiplication's in HOPPER_BLOCK_UNITS order, then the attention backward's and
    forward's, 18-40 s each on the build machine's 16 cores), then the bindings and the block ops'
    launchers (SLOW_HOST_UNITS first, 18-23 s, then the rest, 5-13 s), then the portable attention
    instantiations (backward, then forward: 5-11 s), larger head dims first within each group.
    Replayed on the unit times of one H200 build of the core library (65 sources, 975 s of compile
    work: 60.9 s if perfectly packed on 16 cores), the path order ends at 81.2 s, this order at
    64.1 s (69.0 with the bindings and launchers in path order; that build's ninja ended at 69.5 s)."""

    def cost_rank(path: Path) -> tuple:
        stem = path.stem
        head_dim = re.search(r"_d(\d+)", stem)
        if "_sm90" in stem:
            tier = 0 if not stem.startswith(("forward", "backward")) else 1 if stem.startswith("backward") else 2
        elif "_sm80" in stem:
            tier = 4 if stem.startswith("backward") else 5
        else:
            tier = 3
        if tier == 3 and stem in SLOW_HOST_UNITS:
            slow = SLOW_HOST_UNITS.index(stem)
        elif tier == 0 and stem in HOPPER_BLOCK_UNITS:
            slow = HOPPER_BLOCK_UNITS.index(stem)
        else:
            slow = len(SLOW_HOST_UNITS)
        return tier, slow, -int(head_dim.group(1)) if head_dim else 0, str(path)

    return sorted(paths, key=cost_rank)


def arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST if set, else the visible GPU's compute capability (e.g. "9.0a").

    Compute capability 9.0 is always built as 9.0a (sm_90a code runs on every 9.0 device and is what
    the Hopper kernels' wgmma instructions need); other entries are passed through.
    """
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        entries = env.replace(";", " ").split()
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device is visible and TORCH_CUDA_ARCH_LIST is not set")
        major, minor = torch.cuda.get_device_capability()
        entries = [f"{major}.{minor}"]
    return ";".join(re.sub(r"^9\.0(?=$|\+)", "9.0a", entry) for entry in entries)


def has_sm90a(arch: str) -> bool:
    """Whether a build for ``arch`` holds the Hopper (sm_90a) kernels."""
    return any(entry.startswith("9.0a") for entry in arch.split(";"))


def _flags(arch: str) -> tuple[list[str], list[str]]:
    """(CUDA flags, C++ flags) of a build for ``arch``."""
    define = ["-DEVOFORMER_SM90A"] if has_sm90a(arch) else []
    if portable_apart(arch):
        define.append("-DEVOFORMER_PORTABLE_APART")
    return cuda_flags() + define, CXX_FLAGS + define


def build_key(arch: str, include_dir: Path) -> str:
    h = hashlib.sha256()
    for item in (torch.__version__, str(torch.version.cuda), arch, cutlass_version(include_dir), str(include_dir),
                 " ".join(_flags(arch)[0]), " ".join(_flags(arch)[1]), sys.version.split()[0]):
        h.update(item.encode() + b"\0")
    for path in sorted(SOURCE_DIR.rglob("*")):
        if path.suffix in SOURCE_SUFFIXES:
            h.update(str(path.relative_to(SOURCE_DIR)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _target(arch: str, include_dir: Path, library: str = "cuda") -> tuple[str, Path, Path]:
    """(extension name, build directory, library path) of the build for these inputs: the core
    library (``library="cuda"``) or the portable kernels' (``"portable"``)."""
    from torch.utils import cpp_extension

    name = f"evoformer_blocks_{library}_{build_key(arch, include_dir)}"
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    return name, build_dir, build_dir / f"{name}.so"


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class CannotBuildHere(RuntimeError):
    """A prerequisite of the build is missing on this machine (:func:`missing_prerequisite`)."""


def nvcc() -> Optional[Path]:
    """The nvcc a build would run (``bin/nvcc`` of torch's CUDA_HOME), or None where there is none."""
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    path = None if home is None else Path(home) / "bin" / "nvcc"
    return path if path is not None and path.is_file() else None


def missing_prerequisite() -> Optional[str]:
    """Why the kernels cannot be built on this machine, the first missing piece in the order a user
    would add them (a CUDA build of torch and a GPU, then nvcc, then the CUTLASS headers); None
    when nothing is missing. A machine without a GPU builds only where TORCH_CUDA_ARCH_LIST names
    the architectures (and torch is a CUDA build)."""
    if torch.version.cuda is None:
        return (
            f"no CUDA GPU (this torch, {torch.__version__}, is a CPU-only build); the kernels need an NVIDIA "
            "GPU and a CUDA build of torch (the eager backend runs here)"
        )
    if not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return (
            "no CUDA GPU is visible; the kernels need an NVIDIA GPU, or TORCH_CUDA_ARCH_LIST naming the "
            "architectures to build for (the eager backend runs here)"
        )
    if nvcc() is None:
        return "nvcc not found: install the CUDA toolkit (nvcc) or set CUDA_HOME to it"
    try:
        cutlass_include_dir()
    except FileNotFoundError as exc:
        return str(exc)
    return None


def _build_and_load(library_kind: str, what: str, srcs: list[Path], arch: str, include_dir: Path) -> tuple[str, Path]:
    """Builds (once, under a lock) and loads one library of ``srcs`` for ``arch``; returns its name
    and path."""
    from torch.utils import cpp_extension

    srcs = compile_order(srcs)
    name, build_dir, library = _target(arch, include_dir, library_kind)
    verbose = os.environ.get("EVOFORMER_BLOCKS_VERBOSE_BUILD", "0") not in ("", "0")
    previous_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    with _file_lock(build_dir.parent / f"{name}.lock"):
        fresh = not library.exists()
        if fresh:
            print(
                f"evoformer_blocks: compiling {len(srcs)} CUDA/C++ sources ({what}) for compute capability {arch} "
                f"(CUTLASS {cutlass_version(include_dir)}, MAX_JOBS={os.environ.get('MAX_JOBS', 'auto')}) ...",
                file=sys.stderr,
                flush=True,
            )
        start = time.perf_counter()
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch
        try:
            cpp_extension.load(
                name=name,
                sources=[str(s) for s in srcs],
                extra_include_paths=[str(include_dir), str(SOURCE_DIR)],
                extra_cflags=_flags(arch)[1],
                extra_cuda_cflags=_flags(arch)[0],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=verbose,
            )
        finally:
            if previous_arch is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = previous_arch
        if fresh:
            print(
                f"evoformer_blocks: built {what} in {time.perf_counter() - start:.1f} s ({build_dir})",
                file=sys.stderr,
                flush=True,
            )
    return name, library


def load() -> str:
    """Builds (once, under a lock) and loads the extension; returns its name. Raises on failure
    (:class:`CannotBuildHere` where a prerequisite is missing)."""
    global _loaded, _loaded_arch
    if _loaded is not None:
        return _loaded
    missing = missing_prerequisite()
    if missing is not None:
        raise CannotBuildHere(missing)
    include_dir = cutlass_include_dir()
    arch = arch_list()
    _loaded, _ = _build_and_load("cuda", "the CUDA kernels", core_sources(arch), arch, include_dir)
    _loaded_arch = arch
    return _loaded


def load_portable() -> Optional[str]:
    """Where the core library keeps the portable 16-bit attention kernels apart (:func:`portable_apart`),
    builds (once, under a lock) their library and attaches it to the core library, so that the sm80
    family runs 16-bit inputs; returns its name, or None where the core library holds them itself.
    Loads the core library first. Raises as :func:`load` does. Answered once per process (the
    cutlass backend asks at every forward that chooses sm80)."""
    global _portable_loaded
    if _portable_loaded is None:
        load()
        if not portable_apart(_loaded_arch):
            _portable_loaded = ""
        else:
            name, library = _build_and_load("portable", "the portable 16-bit attention kernels", portable_sources(),
                                            _loaded_arch, cutlass_include_dir())
            getattr(torch.ops, OP_NAMESPACE).attach_portable_kernels(str(library))
            _portable_loaded = name
    return _portable_loaded or None


def load_error() -> Optional[str]:
    """None when the extension is (or could be) loaded; else why not. Tried once per process."""
    global _load_error
    if _loaded is None and _load_error is None:
        try:
            load()
        except CannotBuildHere as exc:
            _load_error = f"cannot build the CUDA kernels here: {exc}"
        except Exception as exc:  # any build failure becomes a reason, never a crash of `auto`
            first = str(exc).strip().splitlines()
            _load_error = f"the CUDA extension failed to build or load: {type(exc).__name__}: " + (
                first[0] if first else ""
            )
    return _load_error


def status() -> dict[str, str]:
    """What `python -m evoformer_blocks.info` prints about the build."""
    origin = "installed package data" if SOURCE_DIR == INSTALLED_SOURCE_DIR else "checkout"
    try:
        info = {"sources": f"{SOURCE_DIR} ({origin}, {len(sources())} files to compile)"}
    except FileNotFoundError as exc:
        info = {"sources": f"missing ({exc})"}
    try:
        include_dir = cutlass_include_dir()
        info["cutlass"] = f"{cutlass_version(include_dir)} at {include_dir}"
    except FileNotFoundError as exc:
        info["cutlass"] = f"not found ({exc})"
    missing = missing_prerequisite()
    if missing is not None:
        info["build"] = f"cannot build here: {missing}"
        return info
    arch = arch_list()
    _, build_dir, library = _target(arch, include_dir)
    built = library.exists()
    info["arch"] = arch
    info["build"] = f"{'built' if built else 'not built yet (builds on first use)'}: {build_dir}"
    if portable_apart(arch):
        _, portable_dir, portable = _target(arch, include_dir, "portable")
        state = "built" if portable.exists() else "not built yet (builds when the sm80 family runs 16-bit inputs)"
        info["portable"] = f"the portable 16-bit attention kernels apart, {len(portable_sources())} files: {state}: {portable_dir}"
    return info
