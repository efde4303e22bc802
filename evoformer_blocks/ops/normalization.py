"""The layer-norm op: ``layer_norm(x, weight, bias, eps)`` over the last dimension.

Backends: ``"eager"`` (``torch.nn.functional.layer_norm``) and ``"cutlass"`` (the fused CUDA kernels
of csrc/cutlass_kernels/layer_norm.cuh: one pass over the rows forward, one backward, float32
statistics, weight and bias gradients summed from per-CTA partials in a fixed order), chosen by the
same backend setting as :func:`evoformer_blocks.ops.evoformer_attention`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from . import _dispatch, _fused
from ._dispatch import Backend, Capabilities
from ._inputs import FLOAT_DTYPES, ValidatedInputs, as_dtype, describe

Tensor = torch.Tensor
OP = "layer_norm"

# The row kernels (layer norm here; the gate and the bias-gradient column sum in gating.py): their
# input dtypes and what their cutlass backends can run.
ROW_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROW_KERNEL_CAPABILITIES = Capabilities(
    dtypes=ROW_KERNEL_DTYPES, device_types=("cuda",), min_compute_capability=(8, 0), deterministic=True
)
MAX_ROW_BYTES = 32 * 4 * 16  # a row spread over one warp, four 16-byte chunks per lane


def row_reasons(width: int, element_size: int, what: str) -> list[str]:
    """Why rows of ``width`` elements do not fit the row kernels (empty when they do)."""
    if (width * element_size) % 16:
        return [f"{what}={width} channels are not a whole number of 16-byte chunks"]
    if width * element_size > MAX_ROW_BYTES:
        return [f"{what}={width} channels exceed the kernel's {MAX_ROW_BYTES // element_size}"]
    return []


@dataclass(frozen=True)
class LayerNormInputs(ValidatedInputs):
    """Validated inputs of :func:`layer_norm`: x ``[*, C]``, weight and bias ``[C]`` or None."""

    x: Tensor
    weight: Optional[Tensor]
    bias: Optional[Tensor]
    eps: float


def _fail(argument: str, rule: str, tensors: dict) -> None:
    raise ValueError(f"layer_norm: invalid `{argument}`: {rule}\n{describe(tensors)}")


def validate(x, weight=None, bias=None, eps=1e-5) -> LayerNormInputs:
    """Checks :func:`layer_norm`'s arguments (``ValueError`` naming the argument and the rule)."""
    tensors = {"x": x, "weight": weight, "bias": bias}
    if not isinstance(x, torch.Tensor):
        _fail("x", "must be a torch.Tensor", tensors)
    if not x.dtype.is_floating_point or x.dim() < 1 or x.shape[-1] < 1:
        _fail("x", "must be a floating tensor [*, C] with C >= 1", tensors)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            _fail(name, "must be a floating torch.Tensor or None", tensors)
        if tuple(t.shape) != (x.shape[-1],):
            _fail(name, f"must have shape [C] = [{x.shape[-1]}], got {list(t.shape)}", tensors)
        if t.device != x.device:
            _fail(name, f"must be on x's device ({x.device}), got {t.device}", tensors)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 < eps < math.inf):
        _fail("eps", f"must be a positive finite number, got {eps!r}", tensors)
    return LayerNormInputs(x, weight, bias, float(eps))


def layer_norm(
    x: Tensor,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    *,
    backend: Optional[str] = None,
) -> Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension of ``x [*, C]``.

    The statistics are float32 for every input dtype; the result has x's dtype. ``weight`` and
    ``bias`` (``[C]``, optional) may be x's dtype or float32; their gradients come back in their own
    dtype. Equivalent PyTorch code: ``torch.nn.functional.layer_norm(x, (C,), weight, bias, eps)``.

    Raises:
        ValueError: an argument breaks a rule above, or the requested backend cannot run it.
    """
    inputs = validate(x, weight, bias, eps)
    if x.numel() == 0:
        return _eager(inputs)
    return _dispatch.select(OP, inputs, backend).forward(inputs, None)


def _eager(inputs: LayerNormInputs) -> Tensor:
    x = inputs.x
    weight = None if inputs.weight is None else inputs.weight.to(x.dtype)
    bias = None if inputs.bias is None else inputs.bias.to(x.dtype)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, inputs.eps)


class EagerLayerNorm(Backend):
    name = "eager"
    op = OP
    capabilities = Capabilities(dtypes=FLOAT_DTYPES, device_types=())

    def forward(self, inputs: LayerNormInputs, chunk_size: Optional[int] = None) -> Tensor:
        return _eager(inputs)


# ---- the fused kernels as custom ops ------------------------------------------------------------


@torch.library.custom_op("evoformer_blocks::fused_layer_norm_fwd", mutates_args=(), device_types="cuda")
def layer_norm_fwd(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (y [*, C], mean [M], rstd [M]) with M = x.numel() / C (float32 statistics)."""
    y, mean, rstd = _fused.kernels().layer_norm_fwd(x, weight, bias, eps)
    return y, mean, rstd


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    rows = x.numel() // x.shape[-1]
    return x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("evoformer_blocks::fused_layer_norm_bwd", mutates_args=(), device_types="cuda")
def layer_norm_bwd(
    dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor, need_affine: bool,
    affine_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """Returns (dx, affine): affine [2, C] holds the gradients of weight and bias, summed in float32
    and rounded to affine_dtype (empty, float32, unless need_affine)."""
    dx, affine = _fused.kernels().layer_norm_bwd(dy, x, weight, mean, rstd, need_affine, affine_dtype)
    return dx, affine


@layer_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, need_affine, affine_dtype):
    shape, dtype = ((2, x.shape[-1]), affine_dtype) if need_affine else ((0,), torch.float32)
    return x.new_empty(x.shape), x.new_empty(shape, dtype=dtype)


def _save(ctx, x, weight, bias, eps, mean, rstd) -> None:
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.has_bias = bias is not None
    ctx.bias_dtype = None if bias is None else bias.dtype


def _gradients(ctx, dy, backward):
    x, weight, mean, rstd = ctx.saved_tensors
    want_w = weight is not None and ctx.needs_input_grad[1]
    want_b = ctx.has_bias and ctx.needs_input_grad[2]
    # the kernel rounds both rows to one dtype: the parameters' when they share it (or one is wanted)
    dtypes = {weight.dtype} if want_w else set()
    dtypes |= {ctx.bias_dtype} if want_b else set()
    affine_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    dx, affine = backward(dy.contiguous(), x, weight, mean, rstd, want_w or want_b, affine_dtype)
    dw = as_dtype(affine[0], weight.dtype) if want_w else None
    db = as_dtype(affine[1], ctx.bias_dtype) if want_b else None
    return dx, dw, db, None


def _setup_context(ctx, inputs, output):
    x, weight, bias, eps = inputs
    _save(ctx, x, weight, bias, eps, output[1], output[2])


layer_norm_fwd.register_autograd(
    lambda ctx, dy, _dmean, _drstd: _gradients(ctx, dy, layer_norm_bwd), setup_context=_setup_context
)


class _FusedLayerNormFunction(torch.autograd.Function):
    """The fused kernels with the custom ops' autograd, called without the custom-op layers (less host
    time per call outside torch.compile)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = _fused.kernels().layer_norm_fwd(x, weight, bias, eps)
        _save(ctx, x, weight, bias, eps, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        return _gradients(ctx, dy, _fused.kernels().layer_norm_bwd)


class CutlassLayerNorm(Backend):
    name = "cutlass"
    op = OP
    capabilities = ROW_KERNEL_CAPABILITIES

    def extra_reasons(self, inputs: LayerNormInputs) -> list[str]:
        return row_reasons(inputs.x.shape[-1], inputs.x.element_size(), "C") + _fused.build_reasons()

    def forward(self, inputs: LayerNormInputs, chunk_size: Optional[int] = None) -> Tensor:
        x, eps = inputs.x, inputs.eps
        weight, bias = (None if t is None else _fused.kernel_parameter(t) for t in (inputs.weight, inputs.bias))
        if torch.compiler.is_compiling():
            return layer_norm_fwd(x, weight, bias, eps)[0]
        return _FusedLayerNormFunction.apply(x, weight, bias, eps)


_dispatch.register(CutlassLayerNorm(), auto_priority=10)
_dispatch.register(EagerLayerNorm(), auto_priority=100)
