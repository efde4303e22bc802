"""Access to the compiled CUDA extension shared by every fused ("cutlass") backend."""

from __future__ import annotations

import torch

from . import _build


def kernels():
    """The extension's ops (``torch.ops.evoformer_blocks_cuda``), building it on first use."""
    _build.load()
    return getattr(torch.ops, _build.OP_NAMESPACE)


@torch.compiler.assume_constant_result
def _extension_error() -> str:
    """'' when the kernels are built (building them on first call), else why not."""
    return _build.load_error() or ""


def build_reasons() -> list[str]:
    """[] when the extension is built (or builds now), else the reason it cannot be."""
    error = _extension_error()
    return [error] if error else []


PARAMETER_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kernel_parameter(t: torch.Tensor) -> torch.Tensor:
    """A parameter (weight, bias) as the block-op kernels read it, in its own dtype: contiguous,
    float16, bfloat16 or float32 (float64 is rounded to float32; autograd takes the gradient back)."""
    if t.dtype not in PARAMETER_DTYPES:
        t = t.float()
    return t.contiguous()
