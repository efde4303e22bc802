"""The functional ops and their backends: ``evoformer_attention`` (the attention core of every
Evoformer attention module; ``gated_evoformer_attention``, the same with its sigmoid gate on one
stacked q/k/v/g projection), ``triangle_multiplication`` (the triangle multiplicative update;
``triangle_multiplication_keeping_input`` and ``triangle_multiplication_residual``: with the input
passed on, or with the update added to it) and
``layer_norm`` (``add_layer_norm``: with the residual add in front of it; ``layer_norm_keeping_input``:
with the input passed on, its two gradients added in one pass), and the two element-wise pieces of the gated modules, ``sigmoid_gate`` and
``linear`` (whose backward sums the bias gradient with a kernel).

Backends, one setting for every op: ``"eager"`` (plain PyTorch, any device and float dtype),
``"cutlass"`` (the fused CUDA kernels of csrc/, compute capability >= 8.0) and
``"auto"`` (cutlass where it can run, else eager). See :func:`evoformer_attention`.
"""

from . import cutlass as _cutlass  # noqa: F401  (registers the cutlass backend)
from . import eager as _eager  # noqa: F401  (registers the eager backend)
from ._dispatch import (
    Backend,
    Capabilities,
    backend,
    backend_names,
    get_backend,
    get_default_backend,
    register,
    set_backend,
)
from ._inputs import AttentionInputs, validate
from .functional import DS4Sci_EvoformerAttention, evoformer_attention, gated_evoformer_attention
from .gating import linear, sigmoid_gate
from .normalization import add_layer_norm, layer_norm, layer_norm_keeping_input
from .triangle import triangle_multiplication, triangle_multiplication_keeping_input, triangle_multiplication_residual

__all__ = [
    "evoformer_attention",
    "gated_evoformer_attention",
    "DS4Sci_EvoformerAttention",
    "triangle_multiplication",
    "triangle_multiplication_keeping_input",
    "triangle_multiplication_residual",
    "layer_norm",
    "add_layer_norm",
    "layer_norm_keeping_input",
    "sigmoid_gate",
    "linear",
    "set_backend",
    "backend",
    "get_default_backend",
    "get_backend",
    "backend_names",
    "Backend",
    "Capabilities",
    "register",
    "AttentionInputs",
    "validate",
]
