"""The triangle multiplicative update op (AF2 supplement Algorithms 11 and 12) and its backends.

Backends: ``"eager"`` (plain PyTorch, the reference) and ``"cutlass"`` (csrc/triangle_multiplication:
triangle_bindings.cpp composes layer-norm and gating kernels with cuBLAS GEMMs and batched triangle
products in a channel-major layout, so no transpose is ever materialised), chosen by the same
backend setting as :func:`evoformer_blocks.ops.evoformer_attention`.

The fused path folds the affine parameters of both layer norms into the projections that follow
them (``LN(x) W^T + c = x_hat (W diag(w))^T + (W b + c)``, with ``x_hat`` the plain normalisation;
in float32, in the extension), so its kernels normalise without parameters; the backward maps the
folded projections' gradients back onto every parameter. One extension call each way, so a call
costs two calls' worth of Python-level work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from . import _dispatch, _fused, _keep
from ._dispatch import Backend, Capabilities
from .cutlass import MAX_ROW_BYTES, ROW_CHUNK_BYTES, kernel_family
from ._inputs import FLOAT_DTYPES, LOW_PRECISION, ValidatedInputs, describe

Tensor = torch.Tensor
OP = "triangle_multiplication"
DIRECTIONS = ("outgoing", "incoming")
_MAX_CHANNELS = (MAX_ROW_BYTES or 0) // 2  # half-precision rows of the layer-norm kernels (0: no sources, no rule)
_CHANNEL_MULTIPLE = (ROW_CHUNK_BYTES or 0) // 2  # whole 16-byte chunks of half-precision values (0: no rule)

_WEIGHTS = (
    "norm_in_weight", "norm_in_bias", "proj_weight", "proj_bias", "gate_weight", "gate_bias",
    "norm_out_weight", "norm_out_bias", "out_weight", "out_bias",
)


@dataclass(frozen=True)
class TriangleInputs(ValidatedInputs):
    """Validated inputs of :func:`triangle_multiplication` (shapes in its docstring)."""

    z: Tensor
    mask: Optional[Tensor]
    weights: dict  # name -> Tensor, the keys of _WEIGHTS
    outgoing: bool
    eps: float

    @property
    def c_z(self) -> int:
        return self.z.shape[-1]

    @property
    def c_hidden(self) -> int:
        return self.weights["proj_weight"].shape[0] // 4

    def tensors(self) -> dict[str, Optional[Tensor]]:
        return {"z": self.z, "mask": self.mask, **self.weights}


def _fail(argument: str, rule: str, tensors: dict) -> None:
    raise ValueError(f"triangle_multiplication: invalid `{argument}`: {rule}\n{describe(tensors)}")


def validate(z, mask, weights: dict, direction, eps) -> TriangleInputs:
    """Checks the arguments of :func:`triangle_multiplication` (``ValueError`` naming the argument)."""
    tensors = {"z": z, "mask": mask, **weights}
    if not isinstance(z, torch.Tensor) or not z.dtype.is_floating_point:
        _fail("z", "must be a floating torch.Tensor [*, N_res, N_res, c_z]", tensors)
    if z.dim() < 3 or z.shape[-2] != z.shape[-3]:
        _fail("z", "must be square in its two residue dims: [*, N_res, N_res, c_z]", tensors)
    if z.shape[-1] < 1:
        _fail("z", "c_z must be at least 1", tensors)
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            _fail("mask", "must be a torch.Tensor [*, N_res, N_res] or None", tensors)
        if tuple(mask.shape) != tuple(z.shape[:-1]):
            _fail("mask", f"must have z's shape without channels, {list(z.shape[:-1])}", tensors)
        if mask.device != z.device:
            _fail("mask", f"must be on z's device ({z.device})", tensors)
    c_z = z.shape[-1]
    proj = weights.get("proj_weight")
    if not isinstance(proj, torch.Tensor) or proj.dim() != 2 or proj.shape[0] % 4 or proj.shape[1] != c_z:
        _fail("proj_weight", f"must be [4 * c_hidden, c_z={c_z}] (a_proj, a_gate, b_proj, b_gate stacked)", tensors)
    c = proj.shape[0] // 4
    expected = {
        "norm_in_weight": (c_z,), "norm_in_bias": (c_z,), "proj_weight": (4 * c, c_z), "proj_bias": (4 * c,),
        "gate_weight": (c_z, c_z), "gate_bias": (c_z,), "norm_out_weight": (c,), "norm_out_bias": (c,),
        "out_weight": (c_z, c), "out_bias": (c_z,),
    }
    for name, shape in expected.items():
        t = weights.get(name)
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            _fail(name, "must be a floating torch.Tensor", tensors)
        if tuple(t.shape) != shape:
            _fail(name, f"must have shape {list(shape)}, got {list(t.shape)}", tensors)
        if t.device != z.device:
            _fail(name, f"must be on z's device ({z.device})", tensors)
    if direction not in DIRECTIONS:
        _fail("direction", f"must be one of {list(DIRECTIONS)}, got {direction!r}", tensors)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 < eps < math.inf):
        _fail("eps", f"must be a positive finite number, got {eps!r}", tensors)
    return TriangleInputs(z, mask, dict(weights), direction == "outgoing", float(eps))


def triangle_multiplication(
    z: Tensor,
    mask: Optional[Tensor] = None,
    *,
    direction: str,
    norm_in_weight: Tensor,
    norm_in_bias: Tensor,
    proj_weight: Tensor,
    proj_bias: Tensor,
    gate_weight: Tensor,
    gate_bias: Tensor,
    norm_out_weight: Tensor,
    norm_out_bias: Tensor,
    out_weight: Tensor,
    out_bias: Tensor,
    eps: float = 1e-5,
    backend: Optional[str] = None,
) -> Tensor:
    """The triangle multiplicative update of a pair representation (AF2 Algorithms 11 and 12).

    Dimensions: ``*`` batch dims, ``N`` residues, ``c_z`` pair channels, ``c`` the hidden width of
    the edges a and b (``c_hidden``).

    Arguments:
        z: ``[*, N, N, c_z]`` pair representation. mask: ``[*, N, N]`` 0/1 (any dtype) or None.
        direction: ``"outgoing"`` (Algorithm 11) or ``"incoming"`` (Algorithm 12).
        norm_in_weight, norm_in_bias: ``[c_z]``, the input layer norm.
        proj_weight: ``[4 c, c_z]``, proj_bias ``[4 c]``: the projections of a, its gate, b and its
            gate, stacked in that order (OpenFold's linear_a_p, linear_a_g, linear_b_p, linear_b_g).
        gate_weight: ``[c_z, c_z]``, gate_bias ``[c_z]``: the output gate (linear_g).
        norm_out_weight, norm_out_bias: ``[c]``, the layer norm of the triangle product.
        out_weight: ``[c_z, c]``, out_bias ``[c_z]``: the output projection (linear_z).
        eps: both layer norms' epsilon.
        backend: ``"auto"``, ``"eager"`` or ``"cutlass"``; None follows the global setting.

    Returns ``[*, N, N, c_z]`` in z's dtype (the update; no residual added)::

        x = layer_norm(z)
        a = mask * sigmoid(x W_ag^T + b_ag) * (x W_ap^T + b_ap)         # [*, N, N, c], b likewise
        outgoing: p[i, j] = sum_k a[i, k] * b[j, k];  incoming: p[i, j] = sum_k a[k, i] * b[k, j]
        out = sigmoid(x W_g^T + b_g) * (layer_norm(p) W_z^T + b_z)

    Parameters are used in z's dtype (float32 parameters of a half-precision z are rounded, as
    autocast would); layer-norm statistics are float32. Gradients flow to z and every parameter.

    Raises:
        ValueError: an argument breaks a rule above, or the requested backend cannot run it.
    """
    weights = dict(
        norm_in_weight=norm_in_weight, norm_in_bias=norm_in_bias, proj_weight=proj_weight, proj_bias=proj_bias,
        gate_weight=gate_weight, gate_bias=gate_bias, norm_out_weight=norm_out_weight,
        norm_out_bias=norm_out_bias, out_weight=out_weight, out_bias=out_bias,
    )
    return _triangle(validate(z, mask, weights, direction, eps), backend)


def _keyword_inputs(op: str, z: Tensor, mask: Optional[Tensor], arguments: dict) -> TriangleInputs:
    """The checked inputs of a variant called with :func:`triangle_multiplication`'s arguments as
    keywords after ``mask``."""
    names = ("direction", *_WEIGHTS)
    missing = [name for name in names if name not in arguments]
    unknown = sorted(set(arguments) - {*names, "eps", "backend"})
    if missing or unknown:
        raise TypeError(f"{op}: missing arguments {missing}, unknown {unknown}")
    weights = {name: arguments[name] for name in _WEIGHTS}
    return validate(z, mask, weights, arguments["direction"], arguments.get("eps", 1e-5))


def triangle_multiplication_keeping_input(z: Tensor, mask: Optional[Tensor] = None, **arguments) -> tuple[Tensor, Tensor]:
    """``(z, triangle_multiplication(z, mask, **arguments))`` for a ``z`` that the caller uses again
    (the residual stream the update is added to). The values are ``z`` itself (a view) and the op's.
    On the cutlass backend, with gradients recorded and ``z`` contiguous, the two are one autograd
    node whose backward adds the gradient of the returned ``z`` to the op's input gradient in its
    last pass (the input layer norm's backward); otherwise autograd adds z's two gradients.
    Arguments as :func:`triangle_multiplication`'s (keywords after ``mask``)."""
    inputs = _keyword_inputs("triangle_multiplication_keeping_input", z, mask, arguments)
    return _triangle(inputs, arguments.get("backend"), mode=_KEEP)


def triangle_multiplication_residual(
    z: Tensor, mask: Optional[Tensor] = None, *, update_scale: Optional[Tensor] = None, **arguments
) -> Tensor:
    """``z + triangle_multiplication(z, mask, **arguments) * update_scale`` (without ``update_scale``:
    ``z + update``): the residual update of the pair stream, as ``z + update`` and ``z + update * keep``
    (a row-wise dropout's keep mask) round it. ``update_scale`` broadcasts to z, e.g. ``[*, 1, N_res,
    c_z]``, in z's dtype, and takes no gradient.

    On the cutlass backend the output kernel adds z (and scales the update) as it writes the result,
    where z is contiguous and the scale is ``[*, 1, N_res, c_z]`` and contiguous, and the node's backward
    adds the gradient of the sum to the op's input gradient in its last pass; otherwise the add is a
    pass of its own. Arguments as :func:`triangle_multiplication`'s (keywords after ``mask``)."""
    inputs = _keyword_inputs("triangle_multiplication_residual", z, mask, arguments)
    if update_scale is not None:
        given = "\n" + describe({"update_scale": update_scale, "z": z})
        if not isinstance(update_scale, Tensor) or update_scale.requires_grad:
            raise ValueError(
                f"triangle_multiplication_residual: `update_scale` must be a tensor that requires no gradient:{given}"
            )
        try:
            fits = torch.broadcast_shapes(update_scale.shape, z.shape) == z.shape
        except RuntimeError:
            fits = False
        if not fits or update_scale.device != z.device:
            raise ValueError(
                f"triangle_multiplication_residual: `update_scale` must broadcast to z's shape, on z's device:{given}"
            )
    return _triangle(inputs, arguments.get("backend"), mode=_ADD, update_scale=update_scale)


_PLAIN, _KEEP, _ADD = "plain", "keep", "add"  # what the op returns: out; (z, out); z + out (* scale)
FUSED_OP = f"{_fused._build.OP_NAMESPACE}::triangle_multiplication_fwd"  # (its qualified name)


def _triangle(inputs: TriangleInputs, backend: Optional[str], mode: str = _PLAIN, update_scale=None):
    """The op on checked inputs: its output (``_PLAIN``), (z, its output) (``_KEEP``) or z plus its
    output times ``update_scale`` (``_ADD``)."""
    if inputs.z.numel() == 0:
        out = eager_triangle_multiplication(inputs)
    else:
        impl = _dispatch.select(OP, inputs, backend)
        if mode != _PLAIN and isinstance(impl, CutlassTriangleMultiplication):
            return fused_triangle_multiplication(inputs, mode, update_scale)
        out = impl.forward(inputs, None)
    return _result(inputs.z, out, mode, update_scale)


def _result(z: Tensor, out: Tensor, mode: str, update_scale: Optional[Tensor]):
    """What the op returns in ``mode`` given its output ``out`` (z's shape), where nothing added z yet."""
    if mode == _KEEP:
        return z, out
    if mode == _ADD:
        return z + (out if update_scale is None else out * update_scale)
    return out


def eager_triangle_multiplication(inputs: TriangleInputs) -> Tensor:
    """The op's formula in PyTorch (the ``eager`` backend and the reference of the fused one)."""
    z, dt = inputs.z, inputs.z.dtype
    w = {name: t.to(dt) for name, t in inputs.weights.items()}
    c = inputs.c_hidden
    x = F.layer_norm(z, (inputs.c_z,), w["norm_in_weight"], w["norm_in_bias"], inputs.eps)  # [*, N, N, c_z]
    proj = F.linear(x, w["proj_weight"], w["proj_bias"])  # [*, N, N, 4 c]
    a_p, a_g, b_p, b_g = proj.split(c, dim=-1)  # each [*, N, N, c]
    a = torch.sigmoid(a_g) * a_p
    b = torch.sigmoid(b_g) * b_p
    if inputs.mask is not None:
        m = inputs.mask.to(dt).unsqueeze(-1)  # [*, N, N, 1]
        a, b = a * m, b * m
    # (_keep.product: a stack's recompute policy may keep the product)
    equation = "...ikc,...jkc->...ijc" if inputs.outgoing else "...kic,...kjc->...ijc"
    p = _keep.product(_keep.TRIANGLE, torch.einsum, equation, a, b)  # [*, N, N, c]
    p = F.layer_norm(p, (c,), w["norm_out_weight"], w["norm_out_bias"], inputs.eps)
    return torch.sigmoid(F.linear(x, w["gate_weight"], w["gate_bias"])) * F.linear(p, w["out_weight"], w["out_bias"])


class EagerTriangleMultiplication(Backend):
    name = "eager"
    op = OP
    capabilities = Capabilities(dtypes=FLOAT_DTYPES, device_types=())

    def forward(self, inputs: TriangleInputs, chunk_size: Optional[int] = None) -> Tensor:
        return eager_triangle_multiplication(inputs)


# ---- the fused path ------------------------------------------------------------------------------


@_fused.fake("triangle_multiplication_fwd")
def _(z, mask, weights, eps, outgoing, family, for_backward=True, add_input=False, update_scale=None):
    """z [B, N, N, c_z], mask [B, N, N] or None, the ten parameters in _WEIGHTS order -> (out, *saved):
    the output (with ``add_input``, z plus the output times ``update_scale`` [B, 1, N, c_z] where
    given), then what the backward reuses: mean_in, rstd_in [M], a, b [c, M], n_hat [M, c] ([0]
    unless ``for_backward``), rstd_out [M], g [M, c_z] and the folded weights w_ab [4 c, c_z], b_ab
    [4 c] (float32), w_g [c_z, c_z], w_z [c_z, c], b_z [c_z]."""
    batch, n, _, c_z = z.shape
    m, c = batch * n * n, weights[2].shape[0] // 4
    stat = z.new_empty(m, dtype=torch.float32)
    n_hat = z.new_empty(m, c) if for_backward else z.new_empty(0)
    return (z.new_empty(z.shape), stat, stat.new_empty(m), z.new_empty(c, m), z.new_empty(c, m), n_hat,
            stat.new_empty(m), z.new_empty(m, c_z),
            z.new_empty(4 * c, c_z), stat.new_empty(4 * c), z.new_empty(c_z, c_z), z.new_empty(c_z, c), z.new_empty(c_z))


@_fused.fake("triangle_multiplication_bwd")
def _(dout, z, mask, weights, saved, eps, outgoing, dz_add=None, family="sm80"):
    """[dz, the gradient of each parameter in its own dtype] (``family``: the forward's kernels')."""
    return [z.new_empty(z.shape)] + [w.new_empty(w.shape) for w in weights]


def _save(ctx, z, mask, weights, eps, outgoing, family, saved, *extra) -> None:
    """Keeps what the backward reads: z, mask, the weights, the forward's saved tensors, then
    ``extra`` (read back by the caller from the end of ``ctx.saved_tensors``); the backward runs
    the forward's kernel family."""
    ctx.save_for_backward(z, mask, *weights, *saved, *extra)
    ctx.eps, ctx.outgoing, ctx.family, ctx.n_weights, ctx.n_saved = eps, outgoing, family, len(weights), len(saved)


def _gradients(ctx, dout, dz_add: Optional[Tensor], tensors: tuple):
    """(dz, d weights) from the output's gradient ``dout`` (None: zero); ``dz_add``, another gradient
    of z, is added to dz in the kernels' last pass; ``tensors``: ctx.saved_tensors."""
    z, mask, *rest = tensors
    weights, saved = rest[: ctx.n_weights], rest[ctx.n_weights : ctx.n_weights + ctx.n_saved]
    dout = torch.zeros_like(z) if dout is None else dout.contiguous()
    dz_add = None if dz_add is None else dz_add.contiguous()
    dz, *dweights = _fused.kernels().triangle_multiplication_bwd(
        dout, z, mask, list(weights), list(saved), ctx.eps, ctx.outgoing, dz_add, ctx.family)
    return dz, dweights


class _FusedTriangleFunction(torch.autograd.Function):
    """The fused forward and backward (``triangle_multiplication_fwd`` / ``_bwd``); weights come as
    separate arguments. ``mode`` _PLAIN returns the update; _KEEP returns ``(z, out)``, z itself (a
    view), and its backward adds z's gradient from that output to dz in the kernels' last pass; _ADD
    returns ``z + out * update_scale``, added by the output kernel, and its backward takes the sum's
    gradient (times the scale) as out's and adds it to dz the same way."""

    @staticmethod
    def forward(ctx, z, mask, eps, outgoing, family, mode, update_scale, *weights):
        # (_keep.call: a checkpointed stack group may keep the outputs, see evoformer_blocks.recompute)
        out, *saved = _keep.call(
            FUSED_OP, _fused.kernels().triangle_multiplication_fwd,
            z, mask, list(weights), eps, outgoing, family, True, mode == _ADD, update_scale)
        ctx.mode, ctx.scaled = mode, update_scale is not None
        _save(ctx, z, mask, weights, eps, outgoing, family, saved, *([update_scale] if ctx.scaled else []))
        return (z.view_as(z), out) if mode == _KEEP else out

    @staticmethod
    def backward(ctx, *grads):
        tensors = ctx.saved_tensors
        if ctx.mode == _KEEP:
            dz_kept, dout = grads
        elif ctx.mode == _ADD:  # d(z + out * scale): dz passes through, out's is scaled
            dz_kept = grads[0]
            dout = dz_kept * tensors[-1] if ctx.scaled else dz_kept
        else:
            dz_kept, dout = None, grads[0]
        dz, dweights = _gradients(ctx, dout, dz_kept, tensors)
        return (dz, None, None, None, None, None, None, *dweights)


def fused_triangle_multiplication(inputs: TriangleInputs, mode: str = _PLAIN, update_scale: Optional[Tensor] = None):
    """The ``cutlass`` backend's computation (differentiable in z and every parameter): its output,
    ``(z, out)`` (``_KEEP``, as :func:`triangle_multiplication_keeping_input` returns them) or ``z + out
    * update_scale`` (``_ADD``, :func:`triangle_multiplication_residual`)."""
    z, n = inputs.z, inputs.z.shape[-2]
    zb = z.reshape(-1, n, n, inputs.c_z)  # [B, N, N, c_z]
    mask = None if inputs.mask is None else inputs.mask.reshape(-1, n, n)  # [B, N, N]
    weights = [_fused.kernel_parameter(inputs.weights[name]) for name in _WEIGHTS]
    family = kernel_family(z.device) if z.is_cuda else "sm80"  # (a meta tensor under tracing: the fakes ignore it)
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in (zb, *weights))
    # with _ADD, the kernels add z (and scale the update) where the scale has the shape they read
    scale = None if mode != _ADD or update_scale is None else _row_scale(update_scale, z)  # [B, 1, N, c_z]
    kernels_add = mode == _ADD and (update_scale is None or scale is not None)
    if (mode == _KEEP or kernels_add) and recording and z.is_contiguous():
        result = _FusedTriangleFunction.apply(zb, mask, inputs.eps, inputs.outgoing, family, mode, scale, *weights)
        if mode == _KEEP:
            kept, out = result
            return kept.view(z.shape), out.reshape(z.shape)  # z itself and the update, [*, N, N, c_z]
        return result.reshape(z.shape)  # z + update (* scale), [*, N, N, c_z]
    if not recording:
        # no backward follows: the kernels skip what only the backward reads (n_hat), and add z where
        # they can
        out = _fused.kernels().triangle_multiplication_fwd(
            zb, mask, weights, inputs.eps, inputs.outgoing, family, False, kernels_add, scale)[0]
        if kernels_add:
            return out.reshape(z.shape)  # z + update (* scale), [*, N, N, c_z]
    else:
        out = _FusedTriangleFunction.apply(zb, mask, inputs.eps, inputs.outgoing, family, _PLAIN, None, *weights)
    return _result(z, out.reshape(z.shape), mode, update_scale)  # [*, N, N, c_z]


def row_shaped(update_scale: Tensor, z: Tensor) -> bool:
    """Whether the kernels can take ``update_scale``: ``[*, 1, N, c_z]`` (at most z's dims: one row
    shared by all rows i) in z's dtype, on z's device."""
    if update_scale.dim() > z.dim() or update_scale.dtype != z.dtype or update_scale.device != z.device:
        return False
    shape = (1,) * (z.dim() - update_scale.dim()) + tuple(update_scale.shape)
    return shape[-3] == 1 and shape[-2:] == z.shape[-2:]


def _row_scale(update_scale: Tensor, z: Tensor) -> Optional[Tensor]:
    """``update_scale`` as the kernels take it, ``[B, 1, N, c_z]`` contiguous in z's dtype (B the product
    of z's batch dims), or None where it is not :func:`row_shaped`. (The triangle node,
    csrc/modules/triangle_node_bindings.cpp, makes it with the same calls.)"""
    if not row_shaped(update_scale, z):
        return None
    *batch, n, _, c_z = z.shape
    shape = (1,) * (z.dim() - update_scale.dim()) + tuple(update_scale.shape)
    return update_scale.reshape(shape).expand(*batch, 1, n, c_z).reshape(-1, 1, n, c_z).contiguous()


class CutlassTriangleMultiplication(Backend):
    name = "cutlass"
    op = OP
    capabilities = Capabilities(
        dtypes=LOW_PRECISION, device_types=("cuda",), min_compute_capability=(8, 0), deterministic=True
    )

    def extra_reasons(self, inputs: TriangleInputs) -> list[str]:
        reasons = []
        if _CHANNEL_MULTIPLE and (inputs.c_z % _CHANNEL_MULTIPLE or inputs.c_hidden % _CHANNEL_MULTIPLE):
            reasons.append(
                f"c_z={inputs.c_z} and c_hidden={inputs.c_hidden} must be multiples of {_CHANNEL_MULTIPLE}"
            )
        if _MAX_CHANNELS and max(inputs.c_z, inputs.c_hidden) > _MAX_CHANNELS:
            reasons.append(f"c_z={inputs.c_z} and c_hidden={inputs.c_hidden} must be at most {_MAX_CHANNELS}")
        return reasons + _fused.build_reasons()

    def forward(self, inputs: TriangleInputs, chunk_size: Optional[int] = None) -> Tensor:
        return fused_triangle_multiplication(inputs)


_dispatch.register(CutlassTriangleMultiplication(), auto_priority=10)
_dispatch.register(EagerTriangleMultiplication(), auto_priority=100)
