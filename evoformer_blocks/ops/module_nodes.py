"""Per-module autograd nodes: a module's computation after its layer norms as ONE call into the
extension and ONE autograd node whose backward runs in C++ (csrc/modules/modules_bindings.cpp), where the module would
otherwise compose several ops from Python, each with its own validation, backend selection and
autograd node.

Nodes: :func:`gated_attention` (the gated attention modules after their layer norms: stacked q, k,
v, g projection, attention and gate, output layer) and :func:`transition` (the AF2 transitions after
their layer norm: two linear layers with a ReLU between).

A node stands for ops the module composes; it runs only where those ops would all run their cutlass
backend and compute what the node computes, so that results and gradients are the same bit for bit
either way. A node function returns None where that does not hold, and the module then composes the
ops as before:

* under torch.compile (the compiled graph traces the composed ops), on a CPU tensor, under autocast
  (the composed ops cast per op), with parameters of another dtype or device than the input;
* while a checkpointed group keeps the attention's outputs (a recompute policy,
  :mod:`evoformer_blocks.recompute`, takes them back at the composed op's call site);
* where backend selection picks another backend for any of the ops (the eager backend, a named
  backend that refuses, inputs the kernels cannot run), or the inputs are empty;
* inside :func:`composed` (A/B comparisons).

Whether the selections allow the node is decided once per input signature and backend setting
(:meth:`~evoformer_blocks.ops._dispatch.Registry.decision`); a call then pays a few attribute reads
and one dictionary lookup before the op.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Sequence

import torch

from . import _dispatch, _fused, _keep
from ._dispatch import ATTENTION_OP
from ._inputs import validate_gated
from .cutlass import GATED_FORWARD_OP, _family_of
from .gating import GATE_OP, LINEAR_OP, fused_bias_gradient, validate_gate, validate_linear

Tensor = torch.Tensor
_CUTLASS = "cutlass"  # the backend whose kernels the nodes call


@contextlib.contextmanager
def composed():
    """Inside the block the modules compose their ops instead of calling the nodes, and the layer
    norms behind a residual add (``ops.add_layer_norm``, ``ops.layer_norm_keeping_input``) record
    their Python-level nodes instead of their C++ ones (the same results: for A/B timings and the
    tests that compare the two)."""
    _dispatch._composing += 1
    try:
        yield
    finally:
        _dispatch._composing -= 1


def _meta(t: Optional[Tensor]):
    return None if t is None else (t.shape, t.dtype, t.device)


def _eligible(x: Tensor) -> bool:
    """Whether a node may run on input ``x`` at all: outside :func:`composed`, not compiling, on a
    CUDA tensor, autocast off."""
    return _dispatch.nodes_allowed() and x.is_cuda and not torch.is_autocast_enabled(x.device.type)


def _same_kind(x: Tensor, tensors) -> bool:
    """Every tensor given (None skipped) has x's dtype and device."""
    dtype, device = x.dtype, x.device
    return all(t is None or (t.dtype == dtype and t.device == device) for t in tensors)


def gated_attention(
    x: Tensor,
    heads: int,
    mask_bias: Optional[Tensor],
    pair_bias: Optional[Tensor],
    projections: Sequence[torch.nn.Linear],
    output: torch.nn.Linear,
    *,
    head_weight: Optional[Tensor] = None,
    transpose_head: bool = False,
    transposed: bool = False,
    backend: Optional[str] = None,
) -> Optional[Tensor]:
    """The gated attention module's update from its normalised input, as one node, or None where the
    node cannot stand for the composed ops (see the module docstring).

    Arguments (those of the composed path, evoformer_blocks.attention._GatedAttention):
        x: ``[*, A, A', c_in]``, normalised.
        heads: H.
        mask_bias: ``[*, N, L]`` (``mask_to_bias`` of the mask, in the attention's orientation, any
            strides) or None.
        pair_bias: ``[B, 1, H, L, L]`` or None (the row attention's, from the pair representation).
        projections: the linear layers q, k, v, g (``[H D, c_in]`` each; k and v without bias).
        output: the output layer ``[c_out, H D]``.
        head_weight: ``[H, c_in]``: the pair bias is x's own head-major projection (triangle
            attention), transposed over its last two dims with ``transpose_head`` (the ending node).
        transposed: attention along dim -3 instead of -2 (column attention, the ending node).
        backend: the module's backend setting (None: the global one).

    Returns:
        ``[*, A, A', c_out]`` or None.
    """
    if not _eligible(x) or _keep.keeps(GATED_FORWARD_OP):
        return None
    q, k, v, g = projections
    if k.bias is not None or v.bias is not None:
        return None
    if any(getattr(layer, "backend", backend) != backend for layer in (q, k, v, g, output)):
        return None  # (a layer given a backend of its own: the composed path honours it)
    tensors = (q.weight, k.weight, v.weight, g.weight, q.bias, g.bias, output.weight, output.bias, head_weight,
               pair_bias)
    if not _same_kind(x, tensors):
        return None
    # (the name in effect is the same for every op; selection checks that each op has that backend)
    registry = _dispatch.REGISTRY
    key = ("gated_attention", registry.resolve(ATTENTION_OP, backend), _meta(x), heads, transposed, _meta(mask_bias),
           _meta(pair_bias),
           q.bias is not None, g.bias is not None, output.bias is not None, head_weight is not None, q.weight.shape,
           output.weight.shape)
    if not registry.decision(key, lambda: _node_selected(x, heads, mask_bias, pair_bias, q, g, output, transposed,
                                                          backend)):
        return None
    head_dim = q.weight.shape[0] // heads
    return _fused.kernels().gated_attention_module(
        x, mask_bias, pair_bias, q.weight, k.weight, v.weight, g.weight, q.bias, g.bias, output.weight, output.bias,
        head_weight, heads, transposed, transpose_head, 1.0 / math.sqrt(head_dim), _family_of(x),
    )


def _node_selected(x, heads, mask_bias, pair_bias, q, g, output, transposed: bool, backend) -> bool:
    """Whether the composed path would run every op the node stands for on the cutlass backend: the
    gated attention fused (attention and gate both cutlass), the stacked projection's bias gradient
    on the column-sum kernel (where it has biases) and the output layer's node (where it has a bias).
    Decided from a stand-in for the stacked projection of x's shape (no memory: a broadcast
    scalar), as the composed path's selections see it."""
    hidden = q.weight.shape[0]
    if heads < 1 or hidden % heads or x.numel() == 0 or x.dim() < 3:
        return False
    batch = math.prod(x.shape[:-3])
    qkvg = x.new_empty(()).expand(batch, *x.shape[-3:-1], 4 * hidden)  # [B, A, A', 4 H D]
    mask = None if mask_bias is None else mask_bias.reshape(-1, *mask_bias.shape[-2:])[:, :, None, None, :]
    try:
        inputs, gate_rows = validate_gated(qkvg, heads, mask, pair_bias, None, transposed)
    except ValueError:
        return False  # (the composed path raises it)
    if inputs.is_empty:
        return False
    try:  # (a named backend that refuses raises: the composed path raises it with the real tensors)
        attention = _dispatch.select(ATTENTION_OP, inputs, backend)
        gate = _dispatch.select(GATE_OP, validate_gate(gate_rows, gate_rows), backend)
        if getattr(attention, "gated_forward", None) is None or not attention.name == gate.name == _CUTLASS:
            return False
        if output.bias is not None:
            linear = _dispatch.select(LINEAR_OP, validate_linear(gate_rows, output.weight, output.bias), backend)
            if linear.name != _CUTLASS:
                return False
        biased = q if q.bias is not None else g if g.bias is not None else None
        return biased is None or fused_bias_gradient(x, biased.weight, biased.bias, backend)
    except ValueError:
        return False


def transition(x: Tensor, linear_1: torch.nn.Linear, linear_2: torch.nn.Linear) -> Optional[Tensor]:
    """The AF2 transition's update before its mask, ``linear_2(relu(linear_1(x)))`` from the normalised
    ``x [*, c]``, as one node, or None where the node cannot stand for the composed ops
    (``ops.linear`` with ``activation="relu"``, then ``ops.linear``; see the module docstring). Both
    layers need biases and one backend setting."""
    if not _eligible(x):
        return None
    b1, b2 = linear_1.bias, linear_2.bias
    if b1 is None or b2 is None or not _same_kind(x, (linear_1.weight, b1, linear_2.weight, b2)):
        return None
    backend = linear_1.backend
    if linear_2.backend != backend:
        return None
    registry = _dispatch.REGISTRY
    key = ("transition", registry.resolve(LINEAR_OP, backend), _meta(x), linear_1.weight.shape, linear_2.weight.shape)
    if not registry.decision(key, lambda: _transition_selected(x, linear_1, linear_2, backend)):
        return None
    return _fused.kernels().transition_module(x, linear_1.weight, b1, linear_2.weight, b2)


def _transition_selected(x: Tensor, linear_1, linear_2, backend) -> bool:
    """Whether both layers' ``ops.linear`` would run their cutlass node (from a stand-in for the hidden
    activation of x's rows: no memory)."""
    if x.numel() == 0:
        return False
    hidden = x.new_empty(()).expand(*x.shape[:-1], linear_1.weight.shape[0])  # [*, n c]
    try:
        first = _dispatch.select(LINEAR_OP, validate_linear(x, linear_1.weight, linear_1.bias, "relu"), backend)
        second = _dispatch.select(LINEAR_OP, validate_linear(hidden, linear_2.weight, linear_2.bias), backend)
    except ValueError:
        return False
    return first.name == second.name == _CUTLASS
