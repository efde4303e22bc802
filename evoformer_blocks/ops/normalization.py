"""The layer-norm ops: ``layer_norm(x, weight, bias, eps)`` over the last dimension, and
``add_layer_norm(x, residual, weight, bias, eps)``, the residual add in front of it in one pass.

Backends: ``"eager"`` (``torch.nn.functional.layer_norm``) and ``"cutlass"`` (the fused CUDA kernels
of csrc/layer_norm/layer_norm.cuh: one pass over the rows forward, one backward, float32
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
from ._inputs import FLOAT_DTYPES, ValidatedInputs, as_dtype, describe, metadata
from .cutlass import MAX_ROW_BYTES, ROW_CHUNK_BYTES

Tensor = torch.Tensor
OP = "layer_norm"
ADD_OP = "add_layer_norm"

# The row kernels (layer norm here; the gate and the bias-gradient column sum in gating.py): their
# input dtypes and what their cutlass backends can run.
ROW_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROW_KERNEL_CAPABILITIES = Capabilities(
    dtypes=ROW_KERNEL_DTYPES, device_types=("cuda",), min_compute_capability=(8, 0), deterministic=True
)


def row_reasons(width: int, element_size: int, what: str) -> list[str]:
    """Why rows of ``width`` elements do not fit the row kernels (empty when they do): the rule of
    kernel_table.json's ``row_kernels`` (the C++ side's ``row_fits``). Without kernel sources there
    is no rule to apply; the build reasons say why nothing runs."""
    if MAX_ROW_BYTES is None:
        return []
    if (width * element_size) % ROW_CHUNK_BYTES:
        return [f"{what}={width} channels are not a whole number of {ROW_CHUNK_BYTES}-byte chunks"]
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


# ---- the fused kernels' autograd (eager and under torch.compile) ----------------------------------


@_fused.fake("layer_norm_fwd")
def _(x, weight, bias, eps):
    """(y [*, C], mean [M], rstd [M]) with M = x.numel() / C (float32 statistics)."""
    rows = x.numel() // x.shape[-1]
    return x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32)


def _affine_like(x: Tensor, need_affine: bool, affine_dtype: torch.dtype) -> Tensor:
    """The backward's ``affine`` [2, C]: the gradients of weight and bias, summed in float32 and
    rounded to affine_dtype (empty, float32, unless need_affine)."""
    shape, dtype = ((2, x.shape[-1]), affine_dtype) if need_affine else ((0,), torch.float32)
    return x.new_empty(shape, dtype=dtype)


@_fused.fake("layer_norm_bwd")
def _(dy, x, weight, mean, rstd, need_affine, affine_dtype):
    """(dx, affine)."""
    return x.new_empty(x.shape), _affine_like(x, need_affine, affine_dtype)


def _save(ctx, x, weight, bias, eps, mean, rstd) -> None:
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.has_bias = bias is not None
    ctx.bias_dtype = None if bias is None else bias.dtype


def _affine_request(ctx, weight, first: int) -> tuple[bool, bool, torch.dtype]:
    """(weight gradient wanted, bias gradient wanted, the dtype the kernel rounds both to: the
    parameters' when they share it or one is wanted, else float32); weight and bias are the
    inputs ``first`` and ``first + 1`` of the op."""
    want_w = weight is not None and ctx.needs_input_grad[first]
    want_b = ctx.has_bias and ctx.needs_input_grad[first + 1]
    dtypes = {weight.dtype} if want_w else set()
    dtypes |= {ctx.bias_dtype} if want_b else set()
    return want_w, want_b, dtypes.pop() if len(dtypes) == 1 else torch.float32


def _affine_grads(ctx, weight, affine, want_w: bool, want_b: bool) -> tuple[Optional[Tensor], Optional[Tensor]]:
    dw = as_dtype(affine[0], weight.dtype) if want_w else None
    db = as_dtype(affine[1], ctx.bias_dtype) if want_b else None
    return dw, db


class _FusedLayerNormFunction(torch.autograd.Function):
    """The fused layer norm: forward ``layer_norm_fwd``, backward ``layer_norm_bwd`` (float32 sums
    of the affine gradients, rounded to the parameters' dtype)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = _fused.kernels().layer_norm_fwd(x, weight, bias, eps)
        _save(ctx, x, weight, bias, eps, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        want_w, want_b, affine_dtype = _affine_request(ctx, weight, 1)
        dx, affine = _fused.kernels().layer_norm_bwd(
            dy.contiguous(), x, weight, mean, rstd, want_w or want_b, affine_dtype)
        return (dx, *_affine_grads(ctx, weight, affine, want_w, want_b), None)


class _CutlassRowNorm(Backend):
    """What the cutlass layer norms (alone and behind a residual add) share: the row kernels'
    capabilities and fit rule for x's rows, and the affine parameters as the kernels read them."""

    name = "cutlass"
    capabilities = ROW_KERNEL_CAPABILITIES

    def extra_reasons(self, inputs) -> list[str]:
        return row_reasons(inputs.x.shape[-1], inputs.x.element_size(), "C") + _fused.build_reasons()

    @staticmethod
    def kernel_parameters(inputs) -> tuple[Optional[Tensor], Optional[Tensor]]:
        return _kernel_parameters(inputs.weight, inputs.bias)


def _kernel_parameters(weight: Optional[Tensor], bias: Optional[Tensor]) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The affine parameters as the row kernels read them (``_fused.kernel_parameter``; None stays None)."""
    return tuple(None if t is None else _fused.kernel_parameter(t) for t in (weight, bias))


class CutlassLayerNorm(_CutlassRowNorm):
    op = OP

    def forward(self, inputs: LayerNormInputs, chunk_size: Optional[int] = None) -> Tensor:
        x, eps = inputs.x, inputs.eps
        weight, bias = self.kernel_parameters(inputs)
        return _FusedLayerNormFunction.apply(x, weight, bias, eps)


class _LayerNormKeepingInputFunction(torch.autograd.Function):
    """``(x, layer_norm(x))`` as one node, for an x that the caller uses again (a residual stream):
    the backward adds the gradient of the passed-on x to the layer norm's input gradient in the
    kernel's one pass (the add + layer norm backward, with the passed-on gradient as the sum's),
    where autograd would add the two gradients of x in a pass of its own."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = _fused.kernels().layer_norm_fwd(x, weight, bias, eps)
        _save_add(ctx, x, weight, bias, mean, rstd, None, None)  # x as the sum of an add without a residual
        return x.view_as(x), y

    @staticmethod
    def backward(ctx, dx_kept, dy):
        dx, _, dw, db, _, _, _ = _add_gradients(ctx, dx_kept, dy, first_param=1)
        return dx, dw, db, None


def layer_norm_keeping_input(
    x: Tensor,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    *,
    backend: Optional[str] = None,
) -> tuple[Tensor, Tensor]:
    """``(x, layer_norm(x, weight, bias, eps))`` for an ``x`` that the caller uses again (the residual
    stream in front of a module that starts with a layer norm). The values are ``x`` itself (a view)
    and :func:`layer_norm`'s. On the cutlass backend, with gradients recorded and ``x`` contiguous,
    the two are one autograd node whose backward adds the gradient of the returned ``x`` to the
    layer norm's input gradient in the same pass (under torch.compile too); otherwise ``x`` is
    returned as it is and autograd adds the two gradients."""
    if torch.is_grad_enabled() and isinstance(x, Tensor) and x.is_contiguous() and _node_decided(
        OP, backend, (x, weight, bias), eps, lambda: validate(x, weight, bias, eps), CutlassLayerNorm
    ):
        weight, bias = _kernel_parameters(weight, bias)
        _dispatch.node_ran()
        return tuple(_fused.kernels().layer_norm_keeping_input_node(x, weight, bias, float(eps)))
    inputs = validate(x, weight, bias, eps)
    if x.numel() == 0:
        return x, _eager(inputs)
    impl = _dispatch.select(OP, inputs, backend)
    if (
        not isinstance(impl, CutlassLayerNorm) or not torch.is_grad_enabled() or not x.is_contiguous()
    ):
        if isinstance(impl, CutlassLayerNorm) and not torch.is_grad_enabled():
            _dispatch.node_ran()  # (what the node's C++ callers run without gradients: the forward kernel)
        return x, impl.forward(inputs, None)
    weight, bias = impl.kernel_parameters(inputs)
    if _dispatch.nodes_allowed():  # one C++ node (csrc/modules), the same calls as the Function's
        _dispatch.node_ran()
        return tuple(_fused.kernels().layer_norm_keeping_input_node(x, weight, bias, eps))
    return _LayerNormKeepingInputFunction.apply(x, weight, bias, eps)


_dispatch.register(CutlassLayerNorm(), auto_priority=10)
_dispatch.register(EagerLayerNorm(), auto_priority=100)


# ---- residual add + layer norm --------------------------------------------------------------------


@dataclass(frozen=True)
class AddLayerNormInputs(ValidatedInputs):
    """Validated inputs of :func:`add_layer_norm`: x and residual ``[*, C]``, weight and bias ``[C]``
    or None, residual_scale (broadcasting to x's shape) or None, residual_bias ``[C]`` (x's dtype) or
    None."""

    x: Tensor
    residual: Tensor
    weight: Optional[Tensor]
    bias: Optional[Tensor]
    eps: float
    residual_scale: Optional[Tensor] = None
    residual_bias: Optional[Tensor] = None

    def norm_inputs(self, s: Tensor) -> LayerNormInputs:
        return LayerNormInputs(s, self.weight, self.bias, self.eps)


def validate_add(x, residual, weight=None, bias=None, eps=1e-5, residual_scale=None,
                 residual_bias=None) -> AddLayerNormInputs:
    """Checks :func:`add_layer_norm`'s arguments (``ValueError`` naming the argument and the rule)."""
    inputs = validate(x, weight, bias, eps)
    tensors = {"x": x, "residual": residual, "weight": weight, "bias": bias, "residual_scale": residual_scale,
               "residual_bias": residual_bias}
    if not isinstance(residual, torch.Tensor):
        raise ValueError(f"add_layer_norm: invalid `residual`: must be a torch.Tensor\n{describe(tensors)}")
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            "add_layer_norm: invalid `residual`: must have x's shape, dtype and device "
            f"({list(x.shape)}, {x.dtype}, {x.device})\n{describe(tensors)}"
        )
    if residual_scale is not None and (
        not isinstance(residual_scale, torch.Tensor)
        or not _broadcasts_to(residual_scale.shape, x.shape)
        or residual_scale.dtype != x.dtype
        or residual_scale.device != x.device
    ):
        raise ValueError(
            "add_layer_norm: invalid `residual_scale`: must be a tensor that broadcasts to x's shape, in "
            f"x's dtype and device ({list(x.shape)}, {x.dtype}, {x.device}), or None\n{describe(tensors)}"
        )
    if residual_bias is not None and (
        not isinstance(residual_bias, torch.Tensor)
        or residual_bias.shape != x.shape[-1:]
        or residual_bias.dtype != x.dtype
        or residual_bias.device != x.device
    ):
        raise ValueError(
            "add_layer_norm: invalid `residual_bias`: must be a [C] tensor in x's dtype and device "
            f"([{x.shape[-1]}], {x.dtype}, {x.device}), or None\n{describe(tensors)}"
        )
    return AddLayerNormInputs(x, residual, inputs.weight, inputs.bias, inputs.eps, residual_scale, residual_bias)


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``target`` (torch's rules) without growing it."""
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def add_layer_norm(
    x: Tensor,
    residual: Tensor,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    *,
    residual_scale: Optional[Tensor] = None,
    residual_bias: Optional[Tensor] = None,
    backend: Optional[str] = None,
) -> tuple[Tensor, Tensor]:
    """``s = x + residual`` and ``layer_norm(s, weight, bias, eps)``: a block's residual add and the
    layer norm of the module after it, in one pass over the rows (and one backward: the gradient of
    ``s`` from later in the block is added to the layer norm's input gradient in the same kernel).

    Returns ``(s, y)``, both x's shape and dtype; ``s`` is rounded to x's dtype before it is
    normalised, as the PyTorch code ``s = x + residual; y = F.layer_norm(s, (C,), weight, bias, eps)``
    does. x and residual must share shape, dtype and device; weight and bias as :func:`layer_norm`.

    ``residual_scale`` (any shape that broadcasts to x's, x's dtype: a module's 0/1 row mask
    ``[*, 1]``, a dropout keep-mask shared along a dimension such as ``[*, 1, N, C]``) multiplies
    ``residual`` first: ``s = x + residual * residual_scale``, rounded as that PyTorch code rounds it,
    so a masked or dropped-out update and its residual add take no pass of their own (the residual's
    gradient is written in the same backward pass).

    ``residual_bias`` (``[C]``, x's dtype and device: the bias of the projection that made
    ``residual``, left out of that projection) is added to ``residual`` first: ``s = x + (residual +
    residual_bias) * residual_scale``, rounded as that PyTorch code rounds it. Its gradient, the
    residual's summed over rows, comes from the same backward pass, so the projection needs neither
    a bias epilogue nor a pass summing its bias gradient.

    Raises:
        ValueError: an argument breaks a rule above, or the requested backend cannot run it.
    """
    if isinstance(x, Tensor) and _node_decided(
        ADD_OP, backend, (x, residual, weight, bias, residual_scale, residual_bias), eps,
        lambda: validate_add(x, residual, weight, bias, eps, residual_scale, residual_bias), CutlassAddLayerNorm,
    ):
        weight, bias = _kernel_parameters(weight, bias)
        _dispatch.node_ran()
        return tuple(_fused.kernels().add_layer_norm_node(
            x, residual, weight, bias, float(eps), residual_scale, residual_bias))
    inputs = validate_add(x, residual, weight, bias, eps, residual_scale, residual_bias)
    if x.numel() == 0:
        return _eager_add(inputs)
    return _dispatch.select(ADD_OP, inputs, backend).forward(inputs, None)


def _node_decided(op: str, backend: Optional[str], tensors: tuple, eps, validated, cutlass: type) -> bool:
    """Whether ``op`` (the layer norm of :func:`layer_norm_keeping_input`, or :func:`add_layer_norm`) may
    call its C++ node at once, skipping validation and selection: where nodes are allowed, on CUDA, and
    the arguments' shapes, dtypes and devices (``tensors``), ``eps`` and the backend setting are those
    of a call that validated (``validated()``, which raises ``ValueError`` otherwise) and selected the
    ``cutlass`` backend class; decided once per such signature (``Registry.decision``)."""
    if not (_dispatch.nodes_allowed() and tensors[0].is_cuda and isinstance(eps, (int, float))
            and all(t is None or isinstance(t, Tensor) for t in tensors)):
        return False  # (the path that validates says what is wrong)
    registry = _dispatch.REGISTRY

    def decide() -> bool:
        try:
            inputs = validated()
            return inputs.x.numel() > 0 and isinstance(_dispatch.select(op, inputs, backend), cutlass)
        except ValueError:
            return False  # (the call raises it on the path that validates)

    key = ("layer_norm_node", op, registry.resolve(op, backend), tuple(map(metadata, tensors)), type(eps), eps)
    return registry.decision(key, decide)


def _eager_add(inputs: AddLayerNormInputs) -> tuple[Tensor, Tensor]:
    residual, scale = inputs.residual, inputs.residual_scale
    if inputs.residual_bias is not None:
        residual = residual + inputs.residual_bias
    s = inputs.x + (residual if scale is None else residual * scale)
    return s, _eager(inputs.norm_inputs(s))


class EagerAddLayerNorm(Backend):
    name = "eager"
    op = ADD_OP
    capabilities = Capabilities(dtypes=FLOAT_DTYPES, device_types=())

    def forward(self, inputs: AddLayerNormInputs, chunk_size: Optional[int] = None) -> tuple[Tensor, Tensor]:
        return _eager_add(inputs)


@_fused.fake("add_layer_norm_fwd")
def _(x, residual, weight, bias, eps, residual_scale=None, residual_bias=None):
    """(s = x + (residual + residual_bias) (* residual_scale), y = layer_norm(s), mean [M], rstd [M])."""
    rows = x.numel() // x.shape[-1]
    stats = (x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32))
    return x.new_empty(x.shape), x.new_empty(x.shape), *stats


@_fused.fake("add_layer_norm_bwd")
def _(ds, dy, s, weight, mean, rstd, need_affine, affine_dtype, residual_scale=None, residual_bias_dtype=None):
    """(dx = ds + the layer norm's input gradient: the gradient of x, and of the residual without a
    scale; affine as layer_norm_bwd's; with residual_scale, dresidual = dx * residual_scale, else
    empty; with residual_bias_dtype, the residual's gradient summed over rows [C] in that dtype, else
    empty)."""
    dresidual = s.new_empty(s.shape if residual_scale is not None else (0,))
    dbias = s.new_empty((0,)) if residual_bias_dtype is None else s.new_empty(s.shape[-1], dtype=residual_bias_dtype)
    return s.new_empty(s.shape), _affine_like(s, need_affine, affine_dtype), dresidual, dbias


def _save_add(ctx, s, weight, bias, mean, rstd, residual, residual_scale, residual_bias=None) -> None:
    # the residual is kept only for the gradient of a residual_scale that requires one (that gradient
    # is taken with the residual as the product saw it: its bias added)
    ctx.scale_grad = residual_scale is not None and residual_scale.requires_grad
    if ctx.scale_grad and residual_bias is not None:
        residual = residual + residual_bias
    ctx.save_for_backward(s, weight, mean, rstd, residual_scale, residual if ctx.scale_grad else None)
    ctx.has_bias = bias is not None
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.residual_bias_dtype = None if residual_bias is None else residual_bias.dtype


def _add_gradients(ctx, ds, dy, first_param: int = 2):
    """(dx, dresidual, dweight, dbias, None, dresidual_scale, dresidual_bias): without a residual_scale
    dx and dresidual are one tensor (the add passes the gradient through to both). ``first_param``:
    the index of the weight among the node's inputs (the bias follows it)."""
    s, weight, mean, rstd, scale, residual = ctx.saved_tensors
    ds = torch.zeros_like(s) if ds is None else ds.contiguous()
    dy = torch.zeros_like(s) if dy is None else dy.contiguous()
    want_w, want_b, affine_dtype = _affine_request(ctx, weight, first_param)
    bias_dtype = ctx.residual_bias_dtype if ctx.residual_bias_dtype is not None and ctx.needs_input_grad[6] else None
    dx, affine, dresidual, dresidual_bias = _fused.kernels().add_layer_norm_bwd(
        ds, dy, s, weight, mean, rstd, want_w or want_b, affine_dtype, scale, bias_dtype)
    dscale = None
    if scale is None:
        dresidual = dx
    elif ctx.scale_grad and ctx.needs_input_grad[5]:
        # d(residual * scale) / d scale in float32, summed over the dims the scale broadcasts along (the
        # gradient of the product is dx)
        dscale = (dx.float() * residual.float()).sum_to_size(scale.shape).to(scale.dtype)
    return (dx, dresidual, *_affine_grads(ctx, weight, affine, want_w, want_b), None, dscale,
            dresidual_bias if bias_dtype is not None else None)


class _FusedAddLayerNormFunction(torch.autograd.Function):
    """The fused residual add + layer norm: forward ``add_layer_norm_fwd``, backward
    ``add_layer_norm_bwd``."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, residual_scale, residual_bias):
        s, y, mean, rstd = _fused.kernels().add_layer_norm_fwd(
            x, residual, weight, bias, eps, residual_scale, residual_bias)
        _save_add(ctx, s, weight, bias, mean, rstd, residual, residual_scale, residual_bias)
        return s, y

    @staticmethod
    def backward(ctx, ds, dy):
        return _add_gradients(ctx, ds, dy)


class CutlassAddLayerNorm(_CutlassRowNorm):
    op = ADD_OP

    def forward(self, inputs: AddLayerNormInputs, chunk_size: Optional[int] = None) -> tuple[Tensor, Tensor]:
        weight, bias = self.kernel_parameters(inputs)
        if _dispatch.nodes_allowed():  # one C++ node (csrc/modules), the same calls as the Function's
            _dispatch.node_ran()
            return tuple(_fused.kernels().add_layer_norm_node(
                inputs.x, inputs.residual, weight, bias, inputs.eps, inputs.residual_scale, inputs.residual_bias))
        return _FusedAddLayerNormFunction.apply(
            inputs.x, inputs.residual, weight, bias, inputs.eps, inputs.residual_scale, inputs.residual_bias)


_dispatch.register(CutlassAddLayerNorm(), auto_priority=10)
_dispatch.register(EagerAddLayerNorm(), auto_priority=100)
