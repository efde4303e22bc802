"""Markers and settings shared by the GPU test modules: they need a CUDA GPU of compute capability
>= 8.0; on a Hopper GPU the kernel tests run with both kernel families."""

import pytest
import torch

requires_sm80 = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
        reason="needs a CUDA GPU of compute capability >= 8.0",
    ),
]

# On a Hopper GPU (compute capability 9.0) the kernel tests run twice: with the Hopper kernels
# (EVOFORMER_BLOCKS_KERNELS=auto) and with the portable sm80 ones, which must keep passing there too.
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
KERNEL_FAMILIES = ["auto", "sm80"] if HOPPER else ["auto"]


@pytest.fixture(params=KERNEL_FAMILIES)
def kernel_family(request, monkeypatch):
    """The kernel family a test runs (EVOFORMER_BLOCKS_KERNELS, forward and backward): each of
    KERNEL_FAMILIES in turn. A test module imports it to use it."""
    monkeypatch.setenv("EVOFORMER_BLOCKS_KERNELS", request.param)
    return request.param
