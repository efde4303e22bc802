"""`python -m evoformer_blocks.info` and the build's prerequisites on a machine that cannot build the
kernels: what is missing is said first, in the order a user would add it (a GPU, nvcc, CUTLASS)."""

from __future__ import annotations

import sys

import pytest
import torch

from evoformer_blocks import info
from evoformer_blocks.ops import _build


def no_cutlass():
    raise FileNotFoundError("CUTLASS headers not found: `pip install nvidia-cutlass` or set CUTLASS_PATH")


@pytest.fixture
def unbuilt(monkeypatch):
    """A process that has not loaded the extension, on a machine without the CUTLASS headers."""
    monkeypatch.setattr(_build, "_loaded", None)
    monkeypatch.setattr(_build, "_load_error", None)
    monkeypatch.setattr(_build, "cutlass_include_dir", no_cutlass)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    return monkeypatch


@pytest.mark.parametrize("cuda_torch", [False, True], ids=["cpu-torch", "cuda-torch"])
def test_info_build_without_a_gpu_says_so_first(unbuilt, capsys, cuda_torch):
    unbuilt.setattr(torch.version, "cuda", "12.8" if cuda_torch else None)
    unbuilt.setattr(torch.cuda, "is_available", lambda: False)
    unbuilt.setattr(sys, "argv", ["evoformer_blocks.info", "--build"])
    info.main()
    lines = capsys.readouterr().out.splitlines()
    keys = [line.split()[0] for line in lines if line and not line[0].isspace()]
    build = next(line for line in lines if line.startswith("build"))
    assert keys.index("build") == keys.index("gpu") + 1  # right after the GPU line
    assert "cannot build the CUDA kernels here: no CUDA GPU" in build and "CUTLASS" not in build, build
    assert keys.count("build") == 1  # not repeated by the status lines


def test_missing_prerequisites_in_order(unbuilt):
    unbuilt.setattr(torch.version, "cuda", "12.8")
    unbuilt.setattr(torch.cuda, "is_available", lambda: False)
    assert _build.missing_prerequisite().startswith("no CUDA GPU is visible")
    unbuilt.setenv("TORCH_CUDA_ARCH_LIST", "9.0")  # builds for a named architecture without a GPU
    unbuilt.setattr(_build, "nvcc", lambda: None)
    assert _build.missing_prerequisite().startswith("nvcc not found")
    assert _build.load_error() == f"cannot build the CUDA kernels here: {_build.missing_prerequisite()}"
    unbuilt.setattr(_build, "nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    assert _build.missing_prerequisite().startswith("CUTLASS headers not found")
    assert _build.status()["build"] == f"cannot build here: {_build.missing_prerequisite()}"
