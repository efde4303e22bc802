"""Per-module autograd nodes: a module's computation after its layer norms as ONE call into the
extension and ONE autograd node whose backward runs in C++ (csrc/modules/modules_bindings.cpp), where the module would
otherwise compose several ops from Python, each with its own validation, backend selection and
autograd node.

Nodes: :func:`gated_attention` (the gated attention modules after their layer norms: stacked q, k,
v, g projection, attention and gate, output layer), :func:`transition` (the AF2 transitions after
their layer norm: two linear layers with a ReLU between), :func:`triangle_multiplication` (the
triangle multiplicative updates with four input projections: their weights stacked in C++, the op's
fused forward and backward; csrc/modules/triangle_node_bindings.cpp) and :func:`outer_product_mean`
(AF2's outer product mean after its layer norm: the two projections as one GEMM, the mask, the
outer product's batched GEMM and the fused ``linear_out`` with the mean's division and the residual
add; csrc/modules/opm_node_bindings.cpp). :func:`evoformer_block` calls the nodes of a whole AF2
Evoformer block from C++ (csrc/modules/block_node_bindings.cpp), where the block found that each of
its modules runs its node (:func:`one_call_allowed`, ``evoformer._MSABlock._update``).

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
from ._inputs import metadata, validate_gated
from .cutlass import GATED_FORWARD_OP, _family_of
from .gating import GATE_OP, LINEAR_OP, column_sum_runs, fused_linear_backward, validate_gate, validate_linear
from . import triangle as _triangle

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


_per_module = 0  # open per_module() blocks


@contextlib.contextmanager
def per_module():
    """Inside the block an Evoformer block calls its modules' nodes one by one from Python instead of
    as one extension call (:func:`evoformer_block`; the same nodes: for A/B timings and the tests that
    compare the two)."""
    global _per_module
    _per_module += 1
    try:
        yield
    finally:
        _per_module -= 1


def one_call_allowed(x: Tensor) -> bool:
    """Whether a block may run its modules' nodes as one extension call on input ``x``: where the
    nodes may run (:func:`_eligible`), outside :func:`per_module`."""
    return not _per_module and _eligible(x)


def _stand_in(like: Tensor, *shape) -> Tensor:
    """A tensor of ``shape`` with ``like``'s dtype and device and no memory of its own (a broadcast
    scalar): what validation and selection read of a tensor the node would make."""
    return like.new_empty(()).expand(*shape)


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
    pair_source: Optional[Tensor] = None,
    transposed: bool = False,
    backend: Optional[str] = None,
    output_bias: bool = True,
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
            attention), transposed over its last two dims with ``transpose_head`` (the ending node);
            or, with ``pair_source``, ``[H, c_z]``: the projection of that instead.
        pair_source: ``[*, L, L, c_z]``, one batch element (the row attention's normalised pair
            representation, whose head-major projection by ``head_weight`` is the pair bias: the
            composed path's ``_head_major``, in the node) or None.
        transposed: attention along dim -3 instead of -2 (column attention, the ending node).
        backend: the module's backend setting (None: the global one).
        output_bias: add the output layer's bias; False: the update without it (a block adds it in
            the residual add that follows, ``ops.add_layer_norm``'s ``residual_bias``).

    Returns:
        ``[*, A, A', c_out]`` or None.
    """
    if not _eligible(x) or _keep.keeps(GATED_FORWARD_OP):
        return None
    q, k, v, g = projections
    if k.bias is not None or v.bias is not None:
        return None
    if pair_source is not None and (head_weight is None or pair_bias is not None or transpose_head
                                    or not _one_pair_source(pair_source, head_weight)):
        return None  # (one batch element: the node replays the composed path's single GEMM)
    if any(getattr(layer, "backend", backend) != backend for layer in (q, k, v, g, output)):
        return None  # (a layer given a backend of its own: the composed path honours it)
    b_o = output.bias if output_bias else None
    tensors = (q.weight, k.weight, v.weight, g.weight, q.bias, g.bias, output.weight, b_o, head_weight,
               pair_bias, pair_source)
    if not _same_kind(x, tensors):
        return None
    # (the name in effect is the same for every op; selection checks that each op has that backend)
    registry = _dispatch.REGISTRY
    key = ("gated_attention", registry.resolve(ATTENTION_OP, backend), metadata(x), heads, transposed,
           metadata(mask_bias), metadata(pair_bias), metadata(pair_source),
           q.bias is not None, g.bias is not None, b_o is not None, head_weight is not None, q.weight.shape,
           output.weight.shape)

    def decide() -> bool:
        pair = pair_bias
        if pair_source is not None:  # (the composed path's pair bias: [1, 1, H, L, L] in the source's dtype)
            length = pair_source.shape[-2]
            pair = _stand_in(pair_source, 1, 1, head_weight.shape[0], length, length)
        return _node_selected(x, heads, mask_bias, pair, q, g, output.weight, b_o, transposed, backend)

    if not registry.decision(key, decide):
        return None
    head_dim = q.weight.shape[0] // heads
    if pair_bias is None:  # (a pair bias made outside the node is not a form the block's one call takes)
        _dispatch.node_ran()
    return _fused.kernels().gated_attention_module(
        x, mask_bias, pair_bias, q.weight, k.weight, v.weight, g.weight, q.bias, g.bias, output.weight, b_o,
        head_weight, pair_source, heads, transposed, transpose_head, 1.0 / math.sqrt(head_dim), _family_of(x),
    )


def _one_pair_source(source: Tensor, head_weight: Tensor) -> bool:
    """Whether ``source`` is one ``[*, L, L, c_z]`` batch element that ``head_weight [H, c_z]`` projects."""
    return (source.dim() >= 3 and source.shape[-3] == source.shape[-2] and head_weight.dim() == 2
            and source.shape[-1] == head_weight.shape[1] and math.prod(source.shape[:-3]) == 1)


def _node_selected(x, heads, mask_bias, pair_bias, q, g, w_o, b_o, transposed: bool, backend) -> bool:
    """Whether the composed path would run every op the node stands for on the cutlass backend: the
    gated attention fused (attention and gate both cutlass), the stacked projection's bias gradient
    on the column-sum kernel (where it has biases) and the output layer's node (where its bias
    ``b_o`` is added).
    Decided from a stand-in for the stacked projection of x's shape (no memory: a broadcast
    scalar), as the composed path's selections see it."""
    hidden = q.weight.shape[0]
    if heads < 1 or hidden % heads or x.numel() == 0 or x.dim() < 3:
        return False
    batch = math.prod(x.shape[:-3])
    qkvg = _stand_in(x, batch, *x.shape[-3:-1], 4 * hidden)  # [B, A, A', 4 H D]
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
        if b_o is not None:
            linear = _dispatch.select(LINEAR_OP, validate_linear(gate_rows, w_o, b_o), backend)
            if linear.name != _CUTLASS:
                return False
        biased = q if q.bias is not None else g if g.bias is not None else None
        return biased is None or fused_linear_backward(x, biased.weight, biased.bias, backend)
    except ValueError:
        return False


def transition(x: Tensor, linear_1: torch.nn.Linear, linear_2: torch.nn.Linear,
               output_bias: bool = True) -> Optional[Tensor]:
    """The AF2 transition's update before its mask, ``linear_2(relu(linear_1(x)))`` from the normalised
    ``x [*, c]``, as one node, or None where the node cannot stand for the composed ops
    (``ops.linear`` with ``activation="relu"``, then ``ops.linear``; see the module docstring). Both
    layers need biases and one backend setting; ``output_bias=False``: the update without
    ``linear_2``'s bias (a block adds it in the residual add that follows)."""
    if not _eligible(x):
        return None
    b1, b2 = linear_1.bias, linear_2.bias
    if b1 is None or b2 is None or not _same_kind(x, (linear_1.weight, b1, linear_2.weight, b2)):
        return None
    b2 = b2 if output_bias else None
    backend = linear_1.backend
    if linear_2.backend != backend:
        return None
    registry = _dispatch.REGISTRY
    key = ("transition", registry.resolve(LINEAR_OP, backend), metadata(x), linear_1.weight.shape,
           linear_2.weight.shape, output_bias)
    if not registry.decision(key, lambda: _transition_selected(x, linear_1, linear_2.weight, b2, backend)):
        return None
    _dispatch.node_ran()
    return _fused.kernels().transition_module(x, linear_1.weight, b1, linear_2.weight, b2)


def _transition_selected(x: Tensor, linear_1, w2: Tensor, b2: Optional[Tensor], backend) -> bool:
    """Whether both layers' ``ops.linear`` would run their cutlass node (from a stand-in for the hidden
    activation of x's rows: no memory)."""
    if x.numel() == 0:
        return False
    hidden = _stand_in(x, *x.shape[:-1], linear_1.weight.shape[0])  # [*, n c]
    try:
        first = _dispatch.select(LINEAR_OP, validate_linear(x, linear_1.weight, linear_1.bias, "relu"), backend)
        second = _dispatch.select(LINEAR_OP, validate_linear(hidden, w2, b2), backend)
    except ValueError:
        return False
    return first.name == second.name == _CUTLASS


def triangle_multiplication(
    z: Tensor,
    mask: Optional[Tensor],
    projections: Sequence[torch.nn.Linear],
    gate: torch.nn.Linear,
    output: torch.nn.Linear,
    norm_in: torch.nn.LayerNorm,
    norm_out: torch.nn.LayerNorm,
    *,
    outgoing: bool,
    backend: Optional[str] = None,
    keep_input: bool = False,
    add_input: bool = False,
    update_scale: Optional[Tensor] = None,
):
    """The triangle multiplicative update as one node, or None where the node cannot stand for the op
    (see the module docstring; also where z is not contiguous).

    Arguments (those the module passes the op, evoformer_blocks.triangle_multiplication):
        z: ``[*, N, N, c_z]``. mask: ``[*, N, N]`` or None.
        projections: the linear layers a_p, a_g, b_p, b_g (``[c, c_z]``; biases all four or none).
        gate: linear_g ``[c_z, c_z]``. output: linear_z ``[c_z, c]``.
        norm_in, norm_out: the layer norms of z and of the triangle product (``norm_in.eps`` is both
            norms' epsilon, as the op takes one).
        outgoing: Algorithm 11 (else 12). backend: the module's backend setting (None: the global one).
        keep_input: return ``(z, update)`` (``ops.triangle_multiplication_keeping_input``).
        add_input: return ``z + update`` (times ``update_scale``, ``[*, 1, N, c_z]``, where given;
            ``ops.triangle_multiplication_residual``).

    Returns:
        the update ``[*, N, N, c_z]``, ``(z, update)`` or ``z + update (* update_scale)``; or None.
    """
    if not _eligible(z) or _keep.keeps(_triangle.FUSED_OP) or not z.is_contiguous():
        return None
    if update_scale is not None and (not add_input or update_scale.requires_grad):
        return None  # (the composed path raises or adds it in a pass of its own)
    a_p, a_g, b_p, b_g = projections
    tensors = (norm_in.weight, norm_in.bias, a_p.weight, a_g.weight, b_p.weight, b_g.weight, a_p.bias, a_g.bias,
               b_p.bias, b_g.bias, gate.weight, gate.bias, norm_out.weight, norm_out.bias, output.weight, output.bias)
    eps = norm_in.eps
    registry = _dispatch.REGISTRY
    key = ("triangle_multiplication", registry.resolve(_triangle.OP, backend), metadata(z), metadata(mask),
           metadata(update_scale), outgoing, keep_input, add_input, eps, tuple(map(metadata, tensors)))
    if not registry.decision(key, lambda: _triangle_selected(z, mask, tensors, eps, outgoing, update_scale, backend)):
        return None
    kernels, family = _fused.kernels(), _triangle.kernel_family(z.device)
    _dispatch.node_ran()
    if keep_input:
        return tuple(kernels.triangle_multiplication_keeping_input_module(z, mask, *tensors, eps, outgoing, family))
    return kernels.triangle_multiplication_module(z, mask, *tensors, eps, outgoing, family, add_input, update_scale)


def _triangle_selected(z: Tensor, mask: Optional[Tensor], tensors: tuple, eps, outgoing: bool,
                       update_scale: Optional[Tensor], backend) -> bool:
    """Whether the op, given these parameters as the module passes them (the input projections and
    their biases stacked, absent biases as zeros), runs its cutlass path, and the node computes what it
    would: parameters the kernels read as they are (float16, bfloat16 or float32), the four input
    projections of one dtype, their biases all four or none, a scale the kernels take. Decided on
    stand-ins of the stacked weights' shapes and dtypes (no memory), as the op's validation sees them."""
    norm_in_w, norm_in_b, w_ap, w_ag, w_bp, w_bg, b_ap, b_ag, b_bp, b_bg, w_g, b_g, norm_out_w, norm_out_b, w_z, b_z = \
        tensors
    biases = (b_ap, b_ag, b_bp, b_bg)
    if any(b is None for b in biases) != all(b is None for b in biases):
        return False
    if any(t is not None and (not isinstance(t, Tensor) or t.dtype not in _fused.PARAMETER_DTYPES) for t in tensors):
        return False
    if len({w.dtype for w in (w_ap, w_ag, w_bp, w_bg)}) != 1 or len({b.dtype for b in biases if b is not None}) > 1:
        return False
    if any(w.dim() != 2 or w.shape != w_ap.shape for w in (w_ap, w_ag, w_bp, w_bg)):
        return False  # (the op's validation sees the stack)

    c, c_z = w_ap.shape
    weights = dict(
        norm_in_weight=norm_in_w, norm_in_bias=norm_in_b, proj_weight=_stand_in(w_ap, 4 * c, c_z),
        proj_bias=_stand_in(b_ap if b_ap is not None else w_ap, 4 * c), gate_weight=w_g,
        gate_bias=b_g if b_g is not None else _stand_in(w_g, w_g.shape[0]), norm_out_weight=norm_out_w,
        norm_out_bias=norm_out_b, out_weight=w_z, out_bias=b_z if b_z is not None else _stand_in(w_z, w_z.shape[0]),
    )
    try:
        inputs = _triangle.validate(z, mask, weights, "outgoing" if outgoing else "incoming", eps)
        if z.numel() == 0 or not isinstance(_dispatch.select(_triangle.OP, inputs, backend),
                                            _triangle.CutlassTriangleMultiplication):
            return False
    except ValueError:
        return False  # (the composed path raises it)
    return update_scale is None or _triangle.row_shaped(update_scale, z)


def outer_product_mean(module, m: Tensor, mask: Tensor, residual: Optional[Tensor]) -> Optional[Tensor]:
    """AF2's outer product mean from its normalised input as one node, or None where the node cannot
    stand for the composed ops (see the module docstring; also AF3's form, ``mean_first`` or
    projections without biases, and a residual that is not contiguous).

    Arguments (those of the composed path, evoformer_blocks.outer_product_mean.OuterProductMean._normalized
    without chunking): module: the OuterProductMean. m: ``[*, N_seq, N_res, c_m]``, normalised. mask:
    ``[*, N_seq, N_res]``, 0/1 in m's dtype. residual: ``[*, N_res, N_res, c_z]`` or None.

    Returns:
        ``residual + update`` (the update without a residual), ``[*, N_res, N_res, c_z]``; or None.
    """
    if not _eligible(m) or module.mean_first or mask.requires_grad:
        return None
    first, second, out = module.linear_1, module.linear_2, module.linear_out
    params = (first.weight, first.bias, second.weight, second.bias, out.weight, out.bias)
    backend = first.backend
    if first.bias is None or second.bias is None or second.backend != backend or out.backend != backend:
        return None
    if not _same_kind(m, (mask, residual, *params)) or (residual is not None and not residual.is_contiguous()):
        return None
    registry = _dispatch.REGISTRY
    key = ("outer_product_mean", registry.resolve(LINEAR_OP, backend), metadata(m), metadata(mask),
           metadata(residual), module.eps, tuple(map(metadata, params)))
    if not registry.decision(key, lambda: _outer_product_mean_selected(module, m, mask, residual, backend)):
        return None
    _dispatch.node_ran()
    return _fused.kernels().outer_product_mean_module(m, mask, residual, *params, module.eps,
                                                      _triangle.kernel_family(m.device))


def _outer_product_mean_selected(module, m: Tensor, mask: Tensor, residual: Optional[Tensor], backend) -> bool:
    """Whether the composed path would take the steps the node takes: the two projections' stacked
    node with the column-sum kernel for their biases, linear_out as the fused projection with the
    division (and the residual add) in its epilogue, and linear_out's bias gradient on the column-sum
    kernel (from stand-ins: no memory)."""
    if m.dim() < 3:
        return False
    n_res = m.shape[-2]
    if m.numel() == 0 or mask.shape != m.shape[:-1] or (
            residual is not None and residual.shape != (*m.shape[:-3], n_res, n_res, module.c_z)):
        return False  # (the composed path raises or broadcasts)
    batch = math.prod(m.shape[:-3])
    try:
        if not fused_linear_backward(m, module.linear_1.weight, module.linear_1.bias, backend):
            return False
        if not module._projection_fuses(_stand_in(m, batch * n_res * n_res, module.c_hidden ** 2), batch * n_res):
            return False
    except ValueError:
        return False  # (the composed path raises it)
    # (the mean's denominator, mask^T mask, is a new contiguous tensor: the composed path divides in
    # the fused projection's epilogue as the node does)
    bias = module.linear_out.bias
    return bias is None or column_sum_runs(_stand_in(m, batch * n_res * n_res, module.c_z), bias.dtype)


def evoformer_block(m: Tensor, z: Tensor, msa_mask: Tensor, pair_mask: Tensor, mask_biases: Sequence[Tensor],
                    keeps: Sequence[Optional[Tensor]], params: Sequence[Optional[Tensor]], eps: Sequence[float],
                    msa_heads: int, pair_heads: int, end_transpose_head: bool) -> tuple[Tensor, Tensor]:
    """AF2's Evoformer block update ``(m, z)`` as one call of the extension, which calls the nodes its
    modules call from Python (the function's, below), in their order, from C++
    (csrc/modules/block_node_bindings.cpp): the same autograd nodes, so the same results and
    gradients, without the Python between them. The caller decided that every module runs its node
    (``evoformer._MSABlock._update``) and passes what the modules would: the masks (0/1 in m's and
    z's dtypes), the four attentions' mask biases in their modules' orientation (row, column,
    starting node, ending node), the five dropout keep-masks (None where off), the parameters and
    layer-norm epsilons in the op's order, the heads, and whether the ending node transposes its
    triangle bias."""
    return tuple(_fused.kernels().evoformer_block_module(
        m, z, msa_mask, pair_mask, *mask_biases, keeps, params, eps, msa_heads, pair_heads, end_transpose_head,
        _family_of(m), _family_of(z), _triangle.kernel_family(z.device),
    ))
