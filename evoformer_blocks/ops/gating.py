"""The two element-wise pieces around every gated attention and projection of a block:

* ``sigmoid_gate(g, y) = sigmoid(g) * y``, the gate of an attention output (AF2 Algorithms 7, 8, 13,
  14);
* ``linear(x, weight, bias) = x @ weight.T + bias``, ``torch.nn.functional.linear``, optionally
  followed by a ReLU.

Backends, chosen by the same setting as every op (:func:`evoformer_blocks.ops.set_backend`):

* ``"eager"``: the PyTorch expressions above;
* ``"cutlass"`` (CUDA, float16/bfloat16/float32): ``sigmoid_gate`` runs one fused kernel forward and
  one backward (dg and dy from one read of g, y and the output gradient). ``y`` may be a permuted
  view (the attention output in the op's ``[B, N, L, H, C]`` layout seen in the module's
  ``[B, L, N, H * C]`` order): the kernels follow its rows where they lie, and dy comes back in y's
  layout, so nothing is transposed in memory either way. ``linear`` computes the forward and the
  input gradient with the same cuBLAS calls as PyTorch, the weight gradient with :func:`rows_product`
  (PyTorch's product where the row count is a multiple of 256), and sums the bias gradient with a
  column-sum kernel (float32 per-CTA partials added in a fixed order) in place of PyTorch's
  reduction, which reads a tall ``[rows, out]`` gradient at a fraction of the memory bandwidth; a
  ReLU after it runs in the GEMM's epilogue (the transitions' first layer), and its backward in the
  column-sum pass.

Both backends give the same results up to floating-point rounding (the bias gradient sums in float32
in another order), except where cuBLAS leaves rows out of a weight gradient (:func:`rows_product`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from . import _dispatch, _fused
from ._dispatch import Backend, Capabilities
from ._inputs import FLOAT_DTYPES, ValidatedInputs, as_dtype, describe
from .normalization import ROW_KERNEL_CAPABILITIES, ROW_KERNEL_DTYPES, row_reasons

Tensor = torch.Tensor
GATE_OP = "sigmoid_gate"
LINEAR_OP = "linear"


# ---- sigmoid_gate -----------------------------------------------------------------------------


@dataclass(frozen=True)
class GateInputs(ValidatedInputs):
    g: Tensor
    y: Tensor


def validate_gate(g, y) -> GateInputs:
    tensors = {"g": g, "y": y}

    def fail(argument: str, rule: str) -> None:
        raise ValueError(f"sigmoid_gate: invalid `{argument}`: {rule}\n{describe(tensors)}")

    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES or t.dim() < 1:
            fail(name, "must be a floating torch.Tensor [*, C]")
    if y.shape != g.shape or y.dtype != g.dtype or y.device != g.device:
        fail("y", f"must have g's shape, dtype and device ({list(g.shape)}, {g.dtype}, {g.device})")
    return GateInputs(g, y)


def sigmoid_gate(g: Tensor, y: Tensor, *, backend: Optional[str] = None) -> Tensor:
    """``torch.sigmoid(g) * y`` for ``g`` and ``y`` of one shape ``[*, C]``, dtype and device; the
    result is contiguous. ``y`` may be any strided view.

    Raises:
        ValueError: the arguments differ in shape, dtype or device, or the requested backend cannot
            run them.
    """
    inputs = validate_gate(g, y)
    if g.numel() == 0:
        return _eager_gate(inputs)
    return _dispatch.select(GATE_OP, inputs, backend).forward(inputs, None)


def _eager_gate(inputs: GateInputs) -> Tensor:
    return torch.sigmoid(inputs.g) * inputs.y


@_fused.fake("sigmoid_gate_fwd")
def _(g, y):
    return g.new_empty(g.shape)


@_fused.fake("sigmoid_gate_bwd")
def _(dout, g, y):
    """(dg contiguous, dy as ``torch.empty_like(y)``: y's layout where y is dense, else contiguous)."""
    return g.new_empty(g.shape), torch.empty_like(y)


class _FusedGateFunction(torch.autograd.Function):
    """The fused gate: forward ``sigmoid_gate_fwd``, backward ``sigmoid_gate_bwd``."""

    @staticmethod
    def forward(ctx, g, y):
        ctx.save_for_backward(g, y)
        return _fused.kernels().sigmoid_gate_fwd(g, y)

    @staticmethod
    def backward(ctx, dout):
        return tuple(_fused.kernels().sigmoid_gate_bwd(dout, *ctx.saved_tensors))


class EagerSigmoidGate(Backend):
    name = "eager"
    op = GATE_OP
    capabilities = Capabilities(dtypes=FLOAT_DTYPES, device_types=())

    def forward(self, inputs: GateInputs, chunk_size: Optional[int] = None) -> Tensor:
        return _eager_gate(inputs)


class CutlassSigmoidGate(Backend):
    name = "cutlass"
    op = GATE_OP
    capabilities = ROW_KERNEL_CAPABILITIES

    def extra_reasons(self, inputs: GateInputs) -> list[str]:
        return row_reasons(inputs.g.shape[-1], inputs.g.element_size(), "C") + _fused.build_reasons()

    def forward(self, inputs: GateInputs, chunk_size: Optional[int] = None) -> Tensor:
        return _FusedGateFunction.apply(inputs.g, inputs.y)


# ---- linear -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearInputs(ValidatedInputs):
    x: Tensor
    weight: Tensor
    bias: Optional[Tensor]
    relu: bool = False


ACTIVATIONS = (None, "relu")


def validate_linear(x, weight, bias=None, activation=None) -> LinearInputs:
    tensors = {"x": x, "weight": weight, "bias": bias}

    def fail(argument: str, rule: str) -> None:
        raise ValueError(f"linear: invalid `{argument}`: {rule}\n{describe(tensors)}")

    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dim() < 1:
        fail("x", "must be a floating torch.Tensor [*, in]")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        fail("weight", f"must be a torch.Tensor [out, in] with in = x.shape[-1] = {x.shape[-1]}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        fail("bias", f"must be None or a torch.Tensor [out] = [{weight.shape[0]}]")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            fail(name, f"must be on x's device ({x.device})")
    if activation not in ACTIVATIONS:
        fail("activation", f"must be one of {list(ACTIVATIONS)}, got {activation!r}")
    return LinearInputs(x, weight, bias, activation == "relu")


def linear(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    *,
    activation: Optional[str] = None,
    backend: Optional[str] = None,
) -> Tensor:
    """``torch.nn.functional.linear(x, weight, bias)``: ``[*, in] -> [*, out]`` (autocast applies as
    to ``F.linear``), followed by ``torch.relu`` when ``activation="relu"``.

    The backends compute the same function. ``cutlass`` (with or without a bias) sums the bias
    gradient with a kernel and the weight gradient by :func:`rows_product`, and with
    ``activation="relu"`` and a bias it applies the ReLU in the GEMM's epilogue (cuBLASLt, where x,
    weight and bias share one dtype and autocast is off), so the pre-activation tensor is never
    written; the backward recovers the ReLU's mask from the output.

    Raises:
        ValueError: the shapes do not fit, ``activation`` is not None or ``"relu"``, or the
            requested backend cannot run the inputs.
    """
    inputs = validate_linear(x, weight, bias, activation)
    if x.numel() == 0:
        return _eager_linear(inputs)
    return _dispatch.select(LINEAR_OP, inputs, backend).forward(inputs, None)


def _eager_linear(inputs: LinearInputs) -> Tensor:
    y = F.linear(inputs.x, inputs.weight, inputs.bias)
    return torch.relu(y) if inputs.relu else y


def _linear_relu(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """relu(x @ weight.T + bias), in the GEMM's epilogue where it can be (a bias, one dtype, no autocast)."""
    if bias is not None and x.dtype == weight.dtype == bias.dtype and not torch.is_autocast_enabled(x.device.type):
        y = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t())  # [rows, out]
        return y.view(*x.shape[:-1], weight.shape[0])
    return torch.relu(F.linear(x, weight, bias))


@_fused.fake("column_sum")
def _(x, dtype):
    """The sum over the rows of ``x [*, C]`` in float32 (fixed order), rounded to ``dtype``."""
    return x.new_empty(x.shape[-1], dtype=dtype)


@_fused.fake("row_scale")
def _(x, s, residual, divide):
    """``x * s``, ``x / s`` or ``residual + x * s`` with ``s [*]`` broadcast over ``x [*, C]``'s last dim,
    contiguous, in the dtype ATen's broadcast op would give (the kernel takes one dtype; other mixes run
    on ATen)."""
    dtype = torch.promote_types(x.dtype, s.dtype)
    if residual is not None:
        dtype = torch.promote_types(dtype, residual.dtype)
    return x.new_empty(x.shape, dtype=dtype)


def bias_gradient(dy: Tensor, dtype: torch.dtype) -> Tensor:
    """The gradient of a projection's bias from its output gradient ``dy [*, out]``: the column-sum
    kernel where its rows fit, else PyTorch's sum (both in float32), in ``dtype``."""
    if column_sum_runs(dy, dtype):
        return _fused.kernels().column_sum(dy, dtype)
    return dy.reshape(-1, dy.shape[-1]).sum(0, dtype=torch.float32).to(dtype)


def column_sum_runs(dy: Tensor, dtype: torch.dtype) -> bool:
    """Whether :func:`bias_gradient` sums ``dy`` into ``dtype`` on the column-sum kernel (from dy's shape,
    dtype and device alone)."""
    return (dy.is_cuda and dy.dtype in ROW_KERNEL_DTYPES and dtype in ROW_KERNEL_DTYPES
            and not row_reasons(dy.shape[-1], dy.element_size(), "out"))


def fused_linear_backward(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, backend: Optional[str] = None) -> bool:
    """Whether ``linear(x, weight, bias, backend=backend)``'s backward is :func:`linear_grads` (the bias
    gradient on the column-sum kernel, the weight gradient by :func:`rows_product`), for modules that
    compute a projection in a function of their own."""
    return _dispatch.select(LINEAR_OP, validate_linear(x, weight, bias), backend).name == CutlassLinear.name


@_fused.fake("rows_product")
def _(a, b):
    """``a [m, K] @ b [K, n]`` (or ``[B, m, K] @ [B, K, n]``) in a's dtype."""
    return a.new_empty(*a.shape[:-1], b.shape[-1])


def rows_product(a: Tensor, b: Tensor) -> Tensor:
    """``a [m, K] @ b [K, n]`` where K counts positions (a weight's gradient, ``dy^T @ x``), by the
    extension: PyTorch's product where K is a multiple of 256 or at most 1,024, else float32 products of
    slices of K summed in a fixed order and rounded once. cuBLAS 13.0 leaves the last rows out of some
    such products (a K that is not a multiple of 256, outputs up to a few hundred wide); the
    extension's helper says which were measured. Batched, ``a [B, m, K] @ b [B, K, n]`` (the outer
    product mean's GEMMs): ``torch.bmm``'s product, except a batch of one whose K is such a K and whose
    output holds at most 2^20 values, summed in slices as above. CUDA tensors of one dtype."""
    return _fused.kernels().rows_product(a, b)


@_fused.fake("linear_bwd")
def _(dy, x, weight, relu_out, need_dx, need_dw, need_db, bias_dtype, bias_from=0):
    """(dx [..., in] in x's dtype, dweight [out, in] in weight's dtype, dbias [out - bias_from] in
    bias_dtype), each a new [0] tensor (dy's dtype) unless wanted."""
    return (x.new_empty(x.shape) if need_dx else dy.new_empty(0),
            weight.new_empty(weight.shape) if need_dw else dy.new_empty(0),
            dy.new_empty(dy.shape[-1] - bias_from, dtype=bias_dtype) if need_db else dy.new_empty(0))


def linear_grads(dy, x, weight, relu_out, need_dx: bool, need_dw: bool, need_db: bool, bias_dtype, bias_from: int = 0):
    """The gradients of ``x . weight^T + bias`` (then ReLU, ``relu_out`` its output) from ``dy``, by the
    extension's ``linear_bwd``: the ReLU's backward and the bias gradient (over the columns from
    ``bias_from`` on) in one pass over dy, then the two GEMMs, in the output gradient's dtype (so that
    autocast training works: weights and inputs may be float32 under a bfloat16 output). None for a
    gradient not wanted."""
    dx, dw, db = _fused.kernels().linear_bwd(dy, x, weight, relu_out, need_dx, need_dw, need_db, bias_dtype, bias_from)
    return dx if need_dx else None, dw if need_dw else None, db if need_db else None


class _FusedBiasLinear(torch.autograd.Function):
    """``F.linear`` (with ``relu``: then ReLU, fused into the GEMM by :func:`_linear_relu`) whose
    backward is :func:`linear_grads` (the bias gradient on the column-sum kernel)."""

    @staticmethod
    def forward(ctx, x, weight, bias, relu):
        y = _linear_relu(x, weight, bias) if relu else F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight, y if relu else None)
        ctx.bias_dtype = weight.dtype if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, y = ctx.saved_tensors
        return (*linear_grads(dy, x, weight, y, *ctx.needs_input_grad[:3], ctx.bias_dtype), None)


class EagerLinear(Backend):
    name = "eager"
    op = LINEAR_OP
    capabilities = Capabilities(dtypes=FLOAT_DTYPES, device_types=())

    def forward(self, inputs: LinearInputs, chunk_size: Optional[int] = None) -> Tensor:
        return _eager_linear(inputs)


class CutlassLinear(Backend):
    name = "cutlass"
    op = LINEAR_OP
    capabilities = ROW_KERNEL_CAPABILITIES

    def extra_reasons(self, inputs: LinearInputs) -> list[str]:
        return _fused.build_reasons()

    def forward(self, inputs: LinearInputs, chunk_size: Optional[int] = None) -> Tensor:
        if not torch.is_grad_enabled():
            return _linear_relu(inputs.x, inputs.weight, inputs.bias) if inputs.relu else _eager_linear(inputs)
        return _FusedBiasLinear.apply(inputs.x, inputs.weight, inputs.bias, inputs.relu)


_dispatch.register(CutlassSigmoidGate(), auto_priority=10)
_dispatch.register(EagerSigmoidGate(), auto_priority=100)
_dispatch.register(CutlassLinear(), auto_priority=10)
_dispatch.register(EagerLinear(), auto_priority=100)
