"""`python -m evoformer_blocks.info`: the environment, the kernel build, and what each backend can run.

Prints the package's version and location, torch / CUDA / GPU, where the kernel sources are (the
installed package's data, or the checkout), where CUTLASS was found and its version, whether the
CUDA extension is built (it is built on first use), and for each backend whether it can run a
representative input on this machine, with the reasons when it cannot. Pass --build to build the
kernels now.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch

from . import __version__
from .ops import _build, backend_names, get_backend, validate
from .ops._dispatch import ATTENTION_OP


def _smem_summary(family: str) -> str:
    """The attention kernels' shared memory per block against this GPU's limit, per head-dim bucket and
    pair bias (16-bit q): where a kernel takes more, the cutlass backend cannot run and `auto` runs eager."""
    from .ops.cutlass import smem_allowed, smem_needed

    allowed = smem_allowed(torch.cuda.current_device())
    dtype = torch.bfloat16
    cells = []
    for head_dim in (32, 64, 128):
        sizes = [smem_needed(family, dtype, head_dim, pair) for pair in (None, dtype, torch.float32)]
        cells.append(f"D {head_dim} " + " / ".join(f"{n}{'' if n <= allowed else ' (over)'}" for n in sizes))
    return (f"shared memory per block: this GPU allows {allowed} bytes; 16-bit kernels ({family}) take "
            f"{', '.join(cells)} bytes (no pair bias / a 16-bit one / a float32 one); over the limit `auto` runs eager")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--build", action="store_true", help="build (or load) the CUDA kernels now")
    args = parser.parse_args()
    print(f"package    evoformer_blocks {__version__} at {Path(__file__).resolve().parent}")
    print(f"python     {platform.python_version()}")
    print(f"torch      {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        print(f"gpu        {torch.cuda.get_device_name()} (compute capability {major}.{minor})")
    else:
        print("gpu        none visible")
    error = None
    if args.build:  # the build's outcome first: where it cannot run here, the first missing piece
        error = _build.load_error()
        print(f"build      {'ok' if error is None else error}")
        if error is None and torch.cuda.is_available():
            from .ops.cutlass import kernel_family

            print(f"kernels    {kernel_family()} (EVOFORMER_BLOCKS_KERNELS=sm80 forces the portable ones)")
            print(f"attention  {_smem_summary(kernel_family())}")
    status = _build.status()
    if error is not None:
        status.pop("build", None)  # said above
    for key, value in status.items():
        print(f"{key:<10} {value}")
    built = status.get("build", "").startswith("built")  # checking cutlass then loads it without compiling
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.zeros(1, 1, 8, 1, 32, device=device, dtype=dtype)  # representative [B, N, L, H, D]
    inputs = validate(q, q, q)
    print(f"backends (for {dtype} inputs of head dim 32 on {device}):")
    for name in backend_names(ATTENTION_OP)[1:]:
        impl = get_backend(name, ATTENTION_OP)
        if name == "cutlass" and not args.build and device == "cuda":
            reasons = impl.not_supported_reasons(inputs) if built else ["not built yet (run with --build)"]
        else:
            reasons = impl.not_supported_reasons(inputs)
        caps = impl.capabilities
        dtypes = ", ".join(str(d).replace("torch.", "") for d in caps.dtypes)
        print(f"  {name:<8} {'can run' if not reasons else 'cannot run: ' + '; '.join(reasons)}")
        print(f"           dtypes {dtypes}; head dim multiple of {caps.head_dim_multiple}"
              f"{'' if caps.max_head_dim is None else f' up to {caps.max_head_dim}'}; "
              f"devices {list(caps.device_types) or 'any'}; deterministic {caps.deterministic}")


if __name__ == "__main__":
    main()
