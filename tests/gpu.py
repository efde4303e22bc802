"""Markers shared by the GPU test modules: they need a CUDA GPU of compute capability >= 8.0."""

import pytest
import torch

requires_sm80 = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
        reason="needs a CUDA GPU of compute capability >= 8.0",
    ),
]
