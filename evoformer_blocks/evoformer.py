"""Evoformer and extra-MSA blocks and stacks (AF2 supplement Algorithms 6 and 18).

Shapes: ``m`` is the MSA representation ``[*, N_seq, N_res, c_m]``, ``z`` the pair representation
``[*, N_res, N_res, c_z]``; ``msa_mask`` is ``[*, N_seq, N_res]`` and ``pair_mask``
``[*, N_res, N_res]`` (1 = real, 0 = padding; None = all real). Every ``c_hidden_*`` of an
attention is per head. Every attention inside a block or stack runs through
:func:`evoformer_blocks.ops.evoformer_attention`, every layer norm through ``ops.layer_norm`` and
both triangle multiplications through ``ops.triangle_multiplication``, all on the one ``backend``
given to the constructor (None: the ops' default, see :func:`evoformer_blocks.ops.set_backend`).
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from typing import NamedTuple, Optional, Union

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ._checks import as_mask, check_bool, check_optional_positive_int, check_positive_int, check_rate, check_tensor
from .attention import (
    MSAColumnAttention,
    MSAColumnGlobalAttention,
    MSARowAttentionWithPairBias,
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
)
from .dropout import DropoutColumnwise, DropoutRowwise
from .outer_product_mean import OuterProductMean
from .ops import _dispatch, _keep, add_layer_norm, get_default_backend, layer_norm_keeping_input, module_nodes
from .ops import triangle as _triangle_op
from .ops.cutlass import GATED_FORWARD_OP, KERNELS_ENV
from .primitives import LayerNorm, Linear
from .recompute import Plan, check_recompute, recomputed, torch_checkpoint_only
from .transitions import MSATransition, PairTransition, SwiGLUTransition
from .triangle_multiplication import (
    FusedTriangleMultiplicationIncoming,
    FusedTriangleMultiplicationOutgoing,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)


def add_and_norm(x: torch.Tensor, norm: LayerNorm, update: torch.Tensor, scale: Optional[torch.Tensor] = None,
                 bias: Optional[torch.Tensor] = None):
    """(x + update, norm(x + update)) by :func:`ops.add_layer_norm` (one pass each way) where x and
    update share shape and dtype; the sum is what ``x + update`` gives. With ``scale`` (broadcasting
    to x's shape: a row mask ``[*, 1]``, a dropout keep-mask), the update is scaled in the same pass:
    what ``x + update * scale`` gives. With ``bias`` (``[C]``: the bias of the projection that made
    the update, which left it out: a module's ``output_bias=False``), ``x + (update + bias) * scale``,
    the bias added in the same pass and its gradient summed in the same backward pass."""
    if bias is not None and bias.dtype != update.dtype:  # (autocast: the bias as F.linear would have cast it)
        bias = bias.to(update.dtype)
    if update.dtype != x.dtype or update.shape != x.shape:  # (e.g. autocast: the plain adds promote)
        update = update if bias is None else update + bias
        s = x + (update if scale is None else update * scale)
        return s, norm(s)
    return add_layer_norm(x, update, norm.weight, norm.bias, norm.eps, residual_scale=scale, residual_bias=bias,
                          backend=norm.backend)


def keep_and_norm(x: torch.Tensor, norm: LayerNorm):
    """(x, norm(x)) by :func:`ops.layer_norm_keeping_input`, for an x used again later (the residual
    stream): the backward adds the residual's gradient inside the layer norm's backward pass."""
    return layer_norm_keeping_input(x, norm.weight, norm.bias, norm.eps, backend=norm.backend)


def _shared(mask_bias: torch.Tensor, owner: nn.Module, other: nn.Module) -> Optional[torch.Tensor]:
    """``owner``'s mask bias for ``other`` too, where both use the same ``inf`` (else None: ``other``
    computes its own)."""
    return mask_bias if other.inf == owner.inf else None


def _check_inputs(owner: str, m, z, msa_mask, pair_mask, chunk_size, block: nn.Module):
    """Validates the inputs of ``block`` (a stack's: its first block) once per block or stack call:
    shapes (``block.c_m``, ``block.c_z``), and the dtype and device of the block's weights; returns
    the masks as 0/1 tensors of m's / z's dtype."""
    c_m, c_z, weights = block.c_m, block.c_z, next(block.parameters())
    check_tensor(owner, "m", m, (None, None, c_m), f"[*, N_seq, N_res, c_m={c_m}]", weights=weights)
    *batch, _, n_res, _ = m.shape
    check_tensor(
        owner, "z", z, (*batch, n_res, n_res, c_z), f"[*, N_res={n_res}, N_res, c_z={c_z}] with m's batch dims",
        exact=True, weights=weights,
    )
    check_optional_positive_int(owner, "chunk_size", chunk_size)
    msa_mask = as_mask(owner, "msa_mask", msa_mask, m, "[*, N_seq, N_res]")
    pair_mask = as_mask(owner, "pair_mask", pair_mask, z, "[*, N_res, N_res]")
    return msa_mask, pair_mask  # [*, N_seq, N_res], [*, N_res, N_res]


class MaskBiases(NamedTuple):
    """A block's mask biases (``mask_to_bias`` of its masks: what its attentions add to their logits),
    made once per stack call by the first block (:meth:`_PairUpdates._mask_biases`) and passed to
    every block."""

    first: Optional[torch.Tensor]  # of the first representation's mask (m's [*, N_seq, N_res], s's [*, N_token])
    pair: Optional[torch.Tensor]  # of the pair mask [*, N_res, N_res] or None
    infs: tuple  # the infs they were made with (a block with other infs makes its own)


class _PairUpdates(nn.Module):
    """The pair side shared by the blocks (Evoformer, extra-MSA, AF3's Pairformer and MSA module):
    ``tri_mul_out``, ``tri_mul_in``, ``tri_att_start``, ``tri_att_end``, ``pair_transition`` and the
    pair dropouts, run by :meth:`_pair_updates` on checked inputs."""

    # The attention of the first representation whose mask bias the block computes once and shares
    # (None: the block has none; see _mask_biases)
    def _first_bias_owner(self) -> Optional[nn.Module]:
        return None

    def _bias_infs(self) -> tuple:
        owner = self._first_bias_owner()
        return (None if owner is None else owner.inf, self.tri_att_start.inf)

    def _mask_biases(self, first: torch.Tensor, z: torch.Tensor, first_mask, pair_mask) -> MaskBiases:
        """The mask biases this block's update computes from checked masks (0/1 tensors of ``first``'s
        and ``z``'s dtypes), for every block of a stack to share: the masks and the representations'
        dtypes stay the same through a stack, so a stack makes them once per call (and its
        checkpointed groups keep them for the recomputation) instead of once per block."""
        owner = self._first_bias_owner()
        return MaskBiases(
            None if owner is None else owner._mask_bias(first_mask, first),
            self.tri_att_start._mask_bias(pair_mask, z), self._bias_infs(),
        )

    def _given_biases(self, biases: Optional[MaskBiases]) -> tuple:
        """(first, pair) of ``biases`` where they were made with this block's infs, else (None, None):
        the block computes its own."""
        if biases is None or biases.infs != self._bias_infs():
            return None, None
        return biases.first, biases.pair

    def _add_pair_stack(
        self, c_z, c_hidden_mul, c_hidden_pair_att, no_heads_pair, transition_n, pair_dropout, inf, backend,
        fuse_projection_weights: bool = False, af3: bool = False, bias_ik: bool = False,
    ) -> None:
        """The pair updates (both triangle multiplications, with ``fuse_projection_weights`` in
        AF2-Multimer's fused form, both triangle attentions, the pair transition) and the pair
        dropouts. With ``af3``, AlphaFold 3's forms (supplement Algorithms 12-15 and 11): no biases
        in the triangle updates' projections, a SwiGLU pair transition; ``bias_ik``: the ending-node
        attention's bias as OpenFold3's pair block takes it."""
        mul_out, mul_in = (
            (FusedTriangleMultiplicationOutgoing, FusedTriangleMultiplicationIncoming) if fuse_projection_weights
            else (TriangleMultiplicationOutgoing, TriangleMultiplicationIncoming)
        )
        bias = not af3
        self.tri_mul_out = mul_out(c_z, c_hidden_mul, backend=backend, bias=bias)
        self.tri_mul_in = mul_in(c_z, c_hidden_mul, backend=backend, bias=bias)
        self.tri_att_start = TriangleAttentionStartingNode(
            c_z, c_hidden_pair_att, no_heads_pair, inf=inf, backend=backend, bias=bias
        )
        self.tri_att_end = TriangleAttentionEndingNode(
            c_z, c_hidden_pair_att, no_heads_pair, inf=inf, backend=backend, bias=bias, bias_ik=bias_ik
        )
        self.pair_transition = (SwiGLUTransition if af3 else PairTransition)(c_z, transition_n, backend=backend)
        self.pair_dropout_row = DropoutRowwise(pair_dropout)
        self.pair_dropout_col = DropoutColumnwise(pair_dropout)

    def _pair_updates(self, z, pair_mask, chunk_size, keep, pair_bias=None):
        """z after the pair updates (both triangle multiplications, both triangle attentions, the
        pair transition; ``keep``: their four dropout keep-masks, None where off) from checked
        inputs; ``pair_bias``: the pair mask's bias where the caller made it already."""
        keep_out, keep_in, keep_start, keep_end = keep
        z = self.tri_mul_out._adding_to_input(z, pair_mask, keep_out)
        z, update = self.tri_mul_in._keeping_input(z, pair_mask)
        z, z_ln = add_and_norm(z, self.tri_att_start.layer_norm_z, update, keep_in)
        pair_bias = self.tri_att_start._mask_bias(pair_mask, z, pair_bias)  # [*, N_res, N_res]
        # (each attention's output bias added in the residual add after it: output_bias=False)
        update = self.tri_att_start._normalized(z_ln, pair_mask, chunk_size, mask_bias=pair_bias, output_bias=False)
        z, z_ln = add_and_norm(z, self.tri_att_end.layer_norm_z, update, keep_start, self.tri_att_start.linear_o.bias)
        update = self.tri_att_end._normalized(
            z_ln, pair_mask, chunk_size, mask_bias=_shared(pair_bias, self.tri_att_start, self.tri_att_end),
            output_bias=False,
        )
        del pair_bias
        z, z_ln = add_and_norm(z, self.pair_transition.layer_norm, update, keep_end, self.tri_att_end.linear_o.bias)
        return self.pair_transition._normalized(z_ln, pair_mask, chunk_size, residual=z)

    def pair_dropout_masks(self, z: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        """The four pair dropout keep-masks of :meth:`_pair_updates` for z (two draws)."""
        pair_rows = self.pair_dropout_row.keep_masks(z, 3)
        (pair_col,) = self.pair_dropout_col.keep_masks(z, 1)
        return (*pair_rows, pair_col)


def _norm(path: str) -> tuple[str, ...]:
    return f"{path}.weight", f"{path}.bias"


def _gated(path: str) -> tuple[str, ...]:
    """A gated attention's projections in the order its node takes them: q, k, v, g, q's and g's bias,
    the output layer."""
    return (*(f"{path}.linear_{p}.weight" for p in "qkvg"), f"{path}.linear_q.bias", f"{path}.linear_g.bias",
            *_norm(f"{path}.linear_o"))


def _transition(path: str) -> tuple[str, ...]:
    return (*_norm(f"{path}.layer_norm"), *_norm(f"{path}.linear_1"), *_norm(f"{path}.linear_2"))


def _triangle(path: str) -> tuple[str, ...]:
    """A triangle multiplication's parameters in its node's order."""
    projections = [f"{path}.linear_{p}" for p in ("a_p", "a_g", "b_p", "b_g")]
    return (*_norm(f"{path}.layer_norm_in"), *(f"{p}.weight" for p in projections),
            *(f"{p}.bias" for p in projections), *_norm(f"{path}.linear_g"), *_norm(f"{path}.layer_norm_out"),
            *_norm(f"{path}.linear_z"))


# What the block's update as one extension call (_MSABlock._one_call_update; the op
# evoformer_block_module, csrc/modules/block_node_bindings.cpp) takes: the block's parameters in the
# order it reads them (None for an absent bias), the modules whose `eps` it takes (the ten layer
# norms in the order the block runs them, then the outer product mean), and how many node ops the
# update calls from Python where every module runs its node (the two layer norms that keep their
# inputs, six residual adds with layer norms, four gated attentions, two transitions, the outer
# product mean, two triangle multiplications).
_ONE_CALL_PARAMETERS = (
    *_norm("msa_att_row.layer_norm_m"), *_norm("msa_att_row.layer_norm_z"), "msa_att_row.linear_z.weight",
    *_gated("msa_att_row"),
    *_norm("msa_att_col.layer_norm_m"), *_gated("msa_att_col"),
    *_transition("msa_transition"),
    *_norm("outer_product_mean.layer_norm"), *_norm("outer_product_mean.linear_1"),
    *_norm("outer_product_mean.linear_2"), *_norm("outer_product_mean.linear_out"),
    *_triangle("tri_mul_out"), *_triangle("tri_mul_in"),
    *_norm("tri_att_start.layer_norm_z"), "tri_att_start.linear_z.weight", *_gated("tri_att_start"),
    *_norm("tri_att_end.layer_norm_z"), "tri_att_end.linear_z.weight", *_gated("tri_att_end"),
    *_transition("pair_transition"),
)
_ONE_CALL_EPS = (
    "msa_att_row.layer_norm_m", "msa_att_row.layer_norm_z", "msa_att_col.layer_norm_m", "msa_transition.layer_norm",
    "outer_product_mean.layer_norm", "tri_mul_out.layer_norm_in", "tri_mul_in.layer_norm_in",
    "tri_att_start.layer_norm_z", "tri_att_end.layer_norm_z", "pair_transition.layer_norm", "outer_product_mean",
)
_ONE_CALL_NODES = 17
# (the sub-module paths above, each once; each parameter and epsilon as (its module's index, name))
_ONE_CALL_MODULES = tuple(dict.fromkeys(
    [tuple(name.split(".")[:-1]) for name in _ONE_CALL_PARAMETERS] + [tuple(path.split(".")) for path in _ONE_CALL_EPS]
))
_ONE_CALL_PARAMETER_INDEX = tuple(
    (_ONE_CALL_MODULES.index(tuple(name.split(".")[:-1])), name.rsplit(".", 1)[1]) for name in _ONE_CALL_PARAMETERS
)
_ONE_CALL_EPS_INDEX = tuple(_ONE_CALL_MODULES.index(tuple(path.split("."))) for path in _ONE_CALL_EPS)


class _MSABlock(_PairUpdates):
    """The Evoformer block; subclasses choose the MSA column attention (Algorithm 6 or 18).

    Updates, in order (residual adds; dropout only in training mode)::

        m += DropoutRowwise(msa_dropout)(MSARowAttentionWithPairBias(m, z))
        m += MSAColumnAttention(m)            (ExtraMSABlock: MSAColumnGlobalAttention)
        m += MSATransition(m)
        z += OuterProductMean(m)
        z += DropoutRowwise(pair_dropout)(TriangleMultiplicationOutgoing(z))
        z += DropoutRowwise(pair_dropout)(TriangleMultiplicationIncoming(z))
        z += DropoutRowwise(pair_dropout)(TriangleAttentionStartingNode(z))
        z += DropoutColumnwise(pair_dropout)(TriangleAttentionEndingNode(z))
        z += PairTransition(z)

    AF2-Multimer's options (OpenFold's): ``opm_first`` moves ``z += OuterProductMean(m)`` to the
    front, from the block's input MSA; ``fuse_projection_weights`` holds each triangle
    multiplication's four input projections as two (:class:`FusedTriangleMultiplicationOutgoing`,
    ``linear_ab_p`` and ``linear_ab_g``: the same function); :class:`EvoformerBlock`'s
    ``no_column_attention`` leaves the column attention out (``msa_att_col`` is None).

    The block runs the attentions, transitions, outer product mean and triangle multiplications
    through their internal entry points (a residual add fused with the next layer norm or into the
    triangle update's op, mask biases shared), not their ``forward``: forward hooks registered on
    those sub-modules do not fire inside the block. The dropout modules' forwards do not run
    either: the block draws their masks with :meth:`dropout_masks` and each mask scales its update
    inside the residual add (and layer norm) that follows it.
    """

    def __init__(
        self,
        c_m: int,
        c_z: int,
        c_hidden_msa_att: int,
        c_hidden_opm: int,
        c_hidden_mul: int,
        c_hidden_pair_att: int,
        no_heads_msa: int,
        no_heads_pair: int,
        transition_n: int = 4,
        msa_dropout: float = 0.15,
        pair_dropout: float = 0.25,
        *,
        opm_first: bool = False,
        fuse_projection_weights: bool = False,
        inf: float = 1e9,
        eps_opm: float = 1e-3,
        backend: Optional[str] = None,
        **column_attention_kwargs,
    ):
        super().__init__()
        name = type(self).__name__
        check_positive_int(name, c_m=c_m, c_z=c_z)
        self.c_m, self.c_z = c_m, c_z
        check_rate(name, "msa_dropout", msa_dropout)
        check_rate(name, "pair_dropout", pair_dropout)
        self.opm_first = check_bool(name, "opm_first", opm_first)
        self.fuse_projection_weights = check_bool(name, "fuse_projection_weights", fuse_projection_weights)
        self.msa_att_row = MSARowAttentionWithPairBias(
            c_m, c_z, c_hidden_msa_att, no_heads_msa, inf=inf, backend=backend
        )
        self.msa_att_col = self._column_attention(
            c_m, c_hidden_msa_att, no_heads_msa, inf, backend, **column_attention_kwargs
        )
        self.msa_transition = MSATransition(c_m, transition_n, backend=backend)
        self.outer_product_mean = OuterProductMean(c_m, c_z, c_hidden_opm, eps=eps_opm, backend=backend)
        self._add_pair_stack(
            c_z, c_hidden_mul, c_hidden_pair_att, no_heads_pair, transition_n, pair_dropout, inf, backend,
            fuse_projection_weights,
        )
        self.msa_dropout_row = DropoutRowwise(msa_dropout)

    def _column_attention(self, c_m, c_hidden, no_heads, inf, backend, **kwargs) -> nn.Module:
        raise NotImplementedError("subclasses choose the MSA column attention")

    def _first_bias_owner(self) -> nn.Module:
        return self.msa_att_row

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: Optional[torch.Tensor] = None,
        pair_mask: Optional[torch.Tensor] = None,
        *,
        chunk_size: Optional[int] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the updated ``(m [*, N_seq, N_res, c_m], z [*, N_res, N_res, c_z])``.

        ``chunk_size`` bounds the memory of attention, transitions and the outer product mean at
        inference; the result equals the unchunked one up to floating-point rounding.
        """
        msa_mask, pair_mask = _check_inputs(
            type(self).__name__, m, z, msa_mask, pair_mask, chunk_size, self
        )
        return self._update(m, z, msa_mask, pair_mask, chunk_size)

    def dropout_masks(self, m: torch.Tensor, z: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        """The block's five dropout keep-masks for inputs shaped like ``m`` and ``z``, in the order
        the block applies them: the row-wise one after the MSA row attention ``[*, 1, N_res, c_m]``,
        the row-wise ones after the outgoing and the incoming triangle multiplication and the
        starting-node triangle attention ``[*, 1, N_res, c_z]``, the column-wise one after the
        ending-node triangle attention ``[*, N_res, 1, c_z]``. Each value is 0 or ``1 / (1 - p)``;
        None where that dropout is off (eval mode or rate 0). Three draws from the RNG (one per
        dropout module); they depend only on the shapes, dtypes and device of ``m`` and ``z``."""
        (msa_row,) = self.msa_dropout_row.keep_masks(m, 1)
        return (msa_row, *self.pair_dropout_masks(z))

    def _update(self, m, z, msa_mask, pair_mask, chunk_size, keep=None, biases=None):
        # Masks are already checked 0/1 tensors: [*, N_seq, N_res] and [*, N_res, N_res]; `biases`:
        # their MaskBiases where a stack made them (else the block makes them).
        # `keep`: the five dropout masks of dropout_masks (drawn here when None). A checkpointed
        # stack draws them before the group runs and passes them in, so that the recomputation in
        # the backward pass applies the same masks without restoring the RNG state.
        # Where a residual add feeds a module that starts with a layer norm, the two run as one op
        # (add_and_norm) and the module goes on from the normalised rows (its _normalized):
        # `m = m + update; module(m)` becomes `m, m_ln = add_and_norm(m, norm, update);
        # module._normalized(m_ln)`. The triangle multiplications normalise inside their own op.
        # The block's inputs feed the row attention's layer norms and the residual adds after it:
        # keep_and_norm makes each one node, so that their two gradients are added in the layer
        # norm's backward pass and not by autograd in a pass of its own; the triangle
        # multiplications keep their input the same way (_keeping_input), and the outgoing one adds
        # its (dropout-scaled) update to z in its op (_adding_to_input).
        # The mask biases inf * (mask - 1) are computed once per mask and shared by the two attentions
        # over that representation (the second reads the first's as a transposed view).
        # The MSA transition's mask and the dropouts in front of a layer norm scale their update in
        # that residual add and layer norm (add_layer_norm's residual_scale; the dropout masks are
        # drawn up front by dropout_masks), the pair transition's mask in its residual add
        # (torch.addcmul): the values of the multiply then the add.
        keep = self.dropout_masks(m, z) if keep is None else keep
        key = self._one_call_key(m, z, msa_mask, pair_mask, chunk_size, keep, biases)
        one_call = None if key is None else _dispatch.REGISTRY.recalled(key)
        if one_call:
            out = self._one_call_update(m, z, msa_mask, pair_mask, keep, biases)
            if out is not None:
                return out
        nodes = _dispatch.nodes_run()
        m, z = self._module_update(m, z, msa_mask, pair_mask, chunk_size, keep, biases)
        if key is not None and one_call is None:  # (the first call of this signature: did every module run its node?)
            _dispatch.REGISTRY.remember(key, _dispatch.nodes_run() - nodes == _ONE_CALL_NODES)
        return m, z

    def _one_call_key(self, m, z, msa_mask, pair_mask, chunk_size, keep, biases) -> Optional[tuple]:
        """What decides whether the update may run as one extension call (:meth:`_one_call_update`), as a
        key of the registry's decisions (kept with the nodes' own, per block, dropped when the block's
        parameters move: _apply); None where the block's form or the call's settings rule it out (AF2's
        form only, no chunking, no recompute policy that keeps the fused ops, the nodes' conditions:
        CUDA, no autocast, not compiling), or the residual streams are not contiguous."""
        if (chunk_size is not None or self.opm_first or type(self.msa_att_col) is not MSAColumnAttention
                or not module_nodes.one_call_allowed(m)
                or _keep.keeps(GATED_FORWARD_OP) or _keep.keeps(_triangle_op.FUSED_OP)
                or not (m.is_contiguous() and z.is_contiguous())):
            return None
        token = self.__dict__.get("_one_call_token")
        if token is None:
            token = self.__dict__["_one_call_token"] = object()
        tensors = (m, z, msa_mask, pair_mask, *keep, *self._given_biases(biases))
        return ("evoformer_block", token, _dispatch.REGISTRY.default(), torch.is_grad_enabled(),
                tuple(None if t is None else (t.shape, t.dtype, t.device, t.requires_grad) for t in tensors))

    def _apply(self, fn, *args, **kwargs):
        self.__dict__.pop("_one_call_token", None)  # (the parameters may change dtype or device)
        return super()._apply(fn, *args, **kwargs)

    def _one_call_update(self, m, z, msa_mask, pair_mask, keep, biases):
        """:meth:`_module_update`'s result as one call of the extension, which calls the same nodes in
        the same order from C++ (``module_nodes.evoformer_block``), for a signature whose call through
        Python ran every module's node; None where the block's sub-modules are not AF2's classes (then
        the modules run)."""
        top = self._modules
        modules = []
        for path in _ONE_CALL_MODULES:
            module = top[path[0]]
            for name in path[1:]:
                module = module._modules[name]
            modules.append(module)
        row, column, start, end = self.msa_att_row, self.msa_att_col, self.tri_att_start, self.tri_att_end
        if not (type(row) is MSARowAttentionWithPairBias  # (the column attention's class: the key checked it)
                and type(self.msa_transition) is MSATransition and type(self.outer_product_mean) is OuterProductMean
                and type(self.tri_mul_out) is TriangleMultiplicationOutgoing
                and type(self.tri_mul_in) is TriangleMultiplicationIncoming
                and type(start) is TriangleAttentionStartingNode and type(end) is TriangleAttentionEndingNode
                and type(self.pair_transition) is PairTransition
                and column.no_heads == row.no_heads and end.no_heads == start.no_heads):
            return None
        # the mask biases each attention's module would use (shared where the infs agree)
        msa_bias, pair_bias = self._given_biases(biases)
        msa_bias = row._mask_bias(msa_mask, m, msa_bias)  # [*, N_seq, N_res]
        column_bias = column._mask_bias(msa_mask, m, _shared(msa_bias, row, column))
        pair_bias = start._mask_bias(pair_mask, z, pair_bias)  # [*, N_res, N_res]
        end_bias = end._mask_bias(pair_mask, z, _shared(pair_bias, start, end))
        params = [modules[i]._parameters[name] for i, name in _ONE_CALL_PARAMETER_INDEX]
        eps = [float(modules[i].eps) for i in _ONE_CALL_EPS_INDEX]
        return module_nodes.evoformer_block(
            m, z, msa_mask, pair_mask, (msa_bias, column_bias, pair_bias, end_bias), keep, params, eps,
            row.no_heads, start.no_heads, not end.bias_ik,
        )

    def _module_update(self, m, z, msa_mask, pair_mask, chunk_size, keep, biases):
        """:meth:`_update` module by module from Python."""
        keep_msa, keep_out, keep_in, keep_start, keep_end = keep
        opm = self.outer_product_mean
        if self.opm_first:  # AF2-Multimer: the outer product mean of the block's input MSA first
            m, m_ln = keep_and_norm(m, opm.layer_norm)
            z = opm._normalized(m_ln, msa_mask, chunk_size, residual=z)
        msa_bias, pair_bias = self._given_biases(biases)
        msa_bias = self.msa_att_row._mask_bias(msa_mask, m, msa_bias)  # [*, N_seq, N_res]
        m, m_ln = keep_and_norm(m, self.msa_att_row.layer_norm_m)
        z, z_ln = keep_and_norm(z, self.msa_att_row.layer_norm_z)
        # (each update's output bias added in the residual add after it: output_bias=False)
        update = self.msa_att_row._normalized(m_ln, z_ln, msa_bias, chunk_size, output_bias=False)
        scale, bias = keep_msa, self.msa_att_row.linear_o.bias  # the scale and bias of `update` in the next add
        if self.msa_att_col is not None:  # (OpenFold's no_column_attention: none)
            m, m_ln = add_and_norm(m, self.msa_att_col.layer_norm_m, update, scale, bias)
            update = self.msa_att_col._normalized(
                m_ln, msa_mask, chunk_size, mask_bias=_shared(msa_bias, self.msa_att_row, self.msa_att_col),
                output_bias=False,
            )
            scale, bias = None, self.msa_att_col.linear_o.bias
        del msa_bias  # (each bias lives only while its two attentions run)
        m, m_ln = add_and_norm(m, self.msa_transition.layer_norm, update, scale, bias)
        if self.opm_first:  # the transition's update is the block's last MSA update: masked and added
            m = self.msa_transition._normalized(m_ln, msa_mask, chunk_size, residual=m)
        else:
            update = self.msa_transition._normalized_unmasked(m_ln, chunk_size, output_bias=False)
            m, m_ln = add_and_norm(m, opm.layer_norm, update, msa_mask.unsqueeze(-1),
                                   self.msa_transition._output().bias)
            z = opm._normalized(m_ln, msa_mask, chunk_size, residual=z)
        z = self._pair_updates(z, pair_mask, chunk_size, (keep_out, keep_in, keep_start, keep_end), pair_bias)
        return m, z

class EvoformerBlock(_MSABlock):
    """One Evoformer block (AF2 supplement Algorithm 6, lines 2-11), with MSA column attention.

    Args:
        c_m: MSA channels. c_z: pair channels.
        c_hidden_msa_att: per-head width of the MSA row and column attention.
        c_hidden_opm: width of each outer-product-mean projection.
        c_hidden_mul: width of the triangle multiplicative updates.
        c_hidden_pair_att: per-head width of the triangle attention.
        no_heads_msa, no_heads_pair: heads of the MSA and of the triangle attention.
        transition_n: hidden-width factor of the MSA and pair transitions.
        msa_dropout: row-wise dropout rate after the MSA row attention (AF2: 0.15).
        pair_dropout: dropout rate after the triangle updates (AF2: 0.25; row-wise, column-wise
            for the ending-node attention).
        no_column_attention: leave the MSA column attention out (OpenFold's sequence-embedding mode).
        opm_first, fuse_projection_weights: AF2-Multimer's options (see :class:`_MSABlock`).
        inf: the large number of the attention masks. eps_opm: the outer product mean's epsilon.
        backend: the backend of every op in the block (attention, layer norms, triangle
            multiplications: "auto", "eager",
            "cutlass"; None: the op's default).
    """

    def _column_attention(self, c_m, c_hidden, no_heads, inf, backend, no_column_attention: bool = False):
        if check_bool(type(self).__name__, "no_column_attention", no_column_attention):
            return None
        return MSAColumnAttention(c_m, c_hidden, no_heads, inf=inf, backend=backend)


class ExtraMSABlock(_MSABlock):
    """One extra-MSA block (AF2 supplement Algorithm 18, lines 2-11): an Evoformer block whose MSA
    column attention is :class:`MSAColumnGlobalAttention` (``eps`` is its epsilon), for the large,
    narrow extra MSA. Other arguments as :class:`EvoformerBlock`."""

    def _column_attention(self, c_m, c_hidden, no_heads, inf, backend, eps: float = 1e-10) -> nn.Module:
        return MSAColumnGlobalAttention(c_m, c_hidden, no_heads, inf=inf, eps=eps, backend=backend)


# OpenFold3's keys of its stack sections (``architecture.pairformer``, ``architecture.msa.msa_module``)
# that steer only its memory tricks, its checkpointing variant or its initialisation, each with why:
# PairformerStack.from_config and MSAModule.from_config drop them and log the list
OPENFOLD3_IGNORED_KEYS = {
    "clear_cache_between_blocks": "OpenFold3's memory trick (emptying the accelerator's cache between blocks)",
    "tune_chunk_size": "OpenFold3's chunk-size tuner",
    "use_reentrant": "OpenFold3's choice of checkpoint implementation (the stacks here choose their own, "
                     "evoformer_blocks.recompute: the same gradients)",
    "linear_init_params": "OpenFold3's per-layer initialisation settings (the stack initialises its own; loaded "
                          "weights replace them; their bias flags, as OpenFold3 ships them, are AF3's, as here)",
}


def _openfold_setting(owner: str, arguments: dict, key: str, supported, meaning: str) -> None:
    """Removes OpenFold's ``key`` from a config section's ``arguments`` where its value is
    ``supported`` (what the stack computes anyway); any other value changes the function, and
    raises ValueError saying what it would mean (``meaning``)."""
    if key in arguments:
        value = arguments.pop(key)
        if value != supported:
            raise ValueError(
                f"{owner}.from_config: `{key}` {value!r} is not supported ({meaning}); only {key}={supported!r}"
            )


class _Stack(nn.Module):
    """Runs ``blocks`` in order, with activation checkpointing every ``blocks_per_ckpt`` blocks (what
    the backward recomputes: ``recompute``, ``recompute_budget_gib``, ``checkpoint_last_group``, see
    :mod:`evoformer_blocks.recompute`) and, with ``cuda_graphs``, as replays of CUDA graphs captured
    per input signature (:mod:`evoformer_blocks.cuda_graphs`)."""

    config_section: str = ""
    # The name of the OpenFold section that holds the arguments in a bigger config, where it differs
    # from config_section (from_config looks for both)
    openfold_config_section: Optional[str] = None
    # Keys of an OpenFold config section that the stack does not take, each with why:
    # from_config drops them and logs the list
    openfold_ignored_keys: dict[str, str] = {}

    @classmethod
    def _openfold_arguments(cls, arguments: dict) -> dict:
        """A config section's arguments with OpenFold's keys translated to the constructor's (after
        the overrides were applied)."""
        return arguments

    def _init_stack(
        self, block_cls: type, no_blocks: int, blocks_per_ckpt: Optional[int], cuda_graphs,
        recompute: Optional[str] = None, recompute_budget_gib: Optional[float] = None,
        checkpoint_last_group: bool = True, **block_args,
    ) -> None:
        name = type(self).__name__
        check_positive_int(name, no_blocks=no_blocks)
        check_optional_positive_int(name, "blocks_per_ckpt", blocks_per_ckpt)
        self.blocks = nn.ModuleList([block_cls(**block_args) for _ in range(no_blocks)])
        self.blocks_per_ckpt = blocks_per_ckpt
        self.recompute = check_recompute(name, recompute, recompute_budget_gib)
        self.recompute_budget_gib = recompute_budget_gib
        self.checkpoint_last_group = check_bool(name, "checkpoint_last_group", checkpoint_last_group)
        # The bytes a block keeps under `recompute`, measured per input signature (recompute.Plan):
        # host-side figures, not module state
        self.__dict__["_kept_bytes"] = OrderedDict()
        self.cuda_graphs = cuda_graphs  # validated by the property's setter

    @property
    def cuda_graphs(self) -> int:
        """How many input signatures (shapes, dtypes, masks given, train/eval, grad mode, ...) keep
        captured CUDA graphs; 0 when the stack runs without graphs. Set it to True (2 signatures),
        False (off) or a positive int; setting it drops the graphs captured so far."""
        return 0 if self._graphs is None else self._graphs.max_signatures

    @cuda_graphs.setter
    def cuda_graphs(self, value) -> None:
        from .cuda_graphs import StackGraphs, signatures_to_keep  # (imported here: an optional feature)

        n = signatures_to_keep(type(self).__name__, value)
        # Kept out of the module tree (no submodule, no state-dict entries): the graphs hold buffers
        # of this device only and are rebuilt on demand.
        self.__dict__["_graphs"] = None if n == 0 else StackGraphs(self, n)

    # Copies (copy.deepcopy) and pickles carry the setting, not the captured graphs (nor the
    # measured kept bytes, a cache).
    def __getstate__(self):
        state = self.__dict__.copy()
        state["_graphs"] = self.cuda_graphs
        state.pop("_kept_bytes", None)
        return state

    def __setstate__(self, state):
        setting = state.pop("_graphs", 0)
        # (a stack pickled before the recompute options: as it ran then)
        for key, default in (("recompute", "full"), ("recompute_budget_gib", None), ("checkpoint_last_group", True)):
            state.setdefault(key, default)
        super().__setstate__(state)
        self.cuda_graphs = setting
        self.__dict__["_kept_bytes"] = OrderedDict()

    def _apply(self, fn, *args, **kwargs):
        # .to(), .cuda(), .half(), ...: the parameters may move, so captured graphs are dropped.
        if self.__dict__.get("_graphs") is not None:
            self._graphs.clear("the module's parameters were moved or converted")
        return super()._apply(fn, *args, **kwargs)

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: Optional[torch.Tensor] = None,
        pair_mask: Optional[torch.Tensor] = None,
        *,
        chunk_size: Optional[int] = None,
    ):
        """Runs the blocks (see the class docstring for the outputs). ``chunk_size`` bounds the
        memory of attention, transitions and outer product mean at inference."""
        msa_mask, pair_mask = _check_inputs(
            type(self).__name__, m, z, msa_mask, pair_mask, chunk_size, self.blocks[0]
        )
        return self._run_checked(m, z, msa_mask, pair_mask, chunk_size)

    def _run_checked(self, m, z, msa_mask, pair_mask, chunk_size):
        """``forward`` on checked inputs: from CUDA graph replays where they serve, else plain. Every
        stack takes two representations (m or s, and z) and their masks as 0/1 tensors of their
        dtypes, in that order."""
        if self._graphs is not None:
            out = self._graphs.run(m, z, msa_mask, pair_mask, chunk_size)
            if out is not None:
                return out
        return self._forward_checked(m, z, msa_mask, pair_mask, chunk_size)

    def _forward_checked(self, m, z, msa_mask, pair_mask, chunk_size):
        """``forward`` on checked inputs (masks as 0/1 tensors of m's and z's dtype): what the CUDA
        graphs capture."""
        return self._outputs(*self._run_blocks(m, z, msa_mask, pair_mask, chunk_size))

    def _outputs(self, m: torch.Tensor, z: torch.Tensor):
        raise NotImplementedError

    def _run_group(self, start: int, stop: int, m, z, msa_mask, pair_mask, chunk_size, keeps=None, biases=None):
        for i, block in enumerate(self.blocks[start:stop]):
            m, z = block._update(m, z, msa_mask, pair_mask, chunk_size, None if keeps is None else keeps[i], biases)
        return m, z

    def _run_blocks(self, m, z, msa_mask, pair_mask, chunk_size):
        n = len(self.blocks)
        group = self.blocks_per_ckpt if torch.is_grad_enabled() else None
        # the masks' biases, once for every block (MaskBiases)
        biases = self.blocks[0]._mask_biases(m, z, msa_mask, pair_mask)
        if group is None:
            return self._run_group(0, n, m, z, msa_mask, pair_mask, chunk_size, None, biases)
        starts = range(0, n, group)
        sizes = [min(start + group, n) - start for start in starts]
        plan = Plan(self, sizes, lambda: (*self._computation_key(m, z, chunk_size), self.recompute, self.training))
        for index, start in enumerate(starts):
            stop = start + sizes[index]
            # Only the group's inputs and its blocks' dropout masks (drawn here, outside the
            # checkpoint) are kept, and the outputs the recompute policy keeps; its activations are
            # recomputed in the backward pass with the same masks, so the RNG state need not be
            # saved and restored. (m and z keep their shapes through the blocks: the masks can be
            # drawn from the group's inputs.)
            keeps = [block.dropout_masks(m, z) for block in self.blocks[start:stop]]
            if not plan.checkpointed_group(index):  # checkpoint_last_group=False: the last one
                m, z = self._run_group(start, stop, m, z, msa_mask, pair_mask, chunk_size, keeps, biases)
                continue
            kwargs = plan.checkpoint_kwargs(index)
            if kwargs or torch_checkpoint_only():  # a policy keeps outputs; or traced (or an A/B)
                m, z = checkpoint(
                    self._run_group, start, stop, m, z, msa_mask, pair_mask, chunk_size, keeps, biases,
                    use_reentrant=False, preserve_rng_state=False, **kwargs,
                )
            else:  # full recomputation: one node, its forward unrecorded
                m, z = recomputed(
                    functools.partial(self._run_group, start, stop),
                    (m, z, msa_mask, pair_mask, chunk_size, keeps, biases), self.blocks[start:stop],
                )
            plan.ran(index)
        return m, z

    def _computation_key(self, m, z, chunk_size) -> tuple:
        """What the ops a call runs depend on besides the weights: the inputs' shapes, dtypes and
        device, the chunk size, autocast, the backend setting and the kernel family's variable (the
        key of the bytes a block keeps under ``recompute``, and part of a CUDA graph signature)."""
        device = m.device.type
        autocast = None
        if device in ("cpu", "cuda"):
            autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        return (
            tuple(m.shape), tuple(z.shape), m.dtype, z.dtype, m.device, chunk_size, autocast,
            get_default_backend(), os.environ.get(KERNELS_ENV),
        )

    @classmethod
    def from_config(cls, cfg, **overrides):
        """Builds the stack from a config: the constructor's arguments as a mapping
        (``ml_collections.ConfigDict``, ``omegaconf.DictConfig`` or dict), or a whole preset of
        :func:`evoformer_blocks.config.get_config` (then its section named by the class attribute
        ``config_section`` is used: ``evoformer_stack``, ``extra_msa_stack``, ``pairformer_stack`` or
        ``msa_module``). Keyword ``overrides`` (e.g. ``backend="eager"``, ``blocks_per_ckpt=1``) win
        over ``cfg``.

        An OpenFold config section (``config.model.evoformer_stack``,
        ``config.model.extra_msa.extra_msa_stack``) is accepted as it is: the keys that steer only
        OpenFold's own memory tricks (``openfold_ignored_keys``) are dropped, and the list is logged
        (logger ``evoformer_blocks``); ``ckpt`` of the extra-MSA stack becomes ``blocks_per_ckpt``.
        So is an OpenFold3 (0.5.0) section for the AF3 stacks (``architecture.pairformer``, also
        found in ``architecture``; ``architecture.msa.msa_module``, also found in
        ``architecture.msa``): its memory, checkpointing and initialisation keys are dropped and
        logged; ``transition_type`` must be ``"swiglu"`` and the MSA module's ``opm_first`` True (the
        AF3 forms these stacks compute), other values raise ValueError. The stacks then compute the
        supplement's form; ``**compat_af3.openfold3_options(cls)`` as overrides gives OpenFold3's
        (for its weights)."""
        from .config import build_from_config  # imported here: building a module needs no presets

        return build_from_config(cls, cfg, cls.config_section, overrides)


class EvoformerStack(_Stack):
    """The Evoformer trunk (AF2 supplement Algorithm 6): ``no_blocks`` :class:`EvoformerBlock` and a
    final ``Linear(c_m, c_s)`` giving the single representation from the first MSA row.

    ``forward(m, z, msa_mask=None, pair_mask=None, *, chunk_size=None)`` returns
    ``(m [*, N_seq, N_res, c_m], z [*, N_res, N_res, c_z], s [*, N_res, c_s])``.

    Args: as :class:`EvoformerBlock`, plus ``c_s`` (single channels), ``no_blocks`` and
    ``blocks_per_ckpt``: while gradients are enabled, every group of that many blocks runs under
    checkpointing, storing only the group's inputs (see :mod:`evoformer_blocks.recompute`); None: no
    checkpointing; ``recompute`` (``"full"``, the default, ``"attention"`` or
    ``"attention+triangle"``: which op outputs the checkpointed groups keep from their forward
    instead of recomputing them), ``recompute_budget_gib`` (None: every checkpointed group keeps
    them; a number: only the last groups whose kept outputs fit in that many GiB) and
    ``checkpoint_last_group`` (False: the last group runs without checkpointing), all three
    without effect on the results (see :mod:`evoformer_blocks.recompute`: what each policy keeps,
    and the memory they cost); ``cuda_graphs``: run the stack as replays of CUDA graphs captured
    once per input signature, True (keep two signatures' graphs), a positive int (that many) or
    False (see :mod:`evoformer_blocks.cuda_graphs`: training with checkpointing and dropout,
    inference, the fallbacks). Parameter names follow OpenFold's (``blocks.{i}.msa_att_row``, …, ``linear``),
    except that the pair updates sit directly in the block (OpenFold: ``blocks.{i}.pair_stack``);
    :func:`evoformer_blocks.compat.load_openfold_state_dict` converts.
    """

    config_section = "evoformer_stack"
    # OpenFold's evoformer_stack keys this stack does not take (from_config drops them, logged):
    # its own memory and speed tricks, and an epsilon its Evoformer blocks pass to nothing
    openfold_ignored_keys = {
        "clear_cache_between_blocks": "OpenFold's memory trick (emptying the CUDA cache between blocks)",
        "tune_chunk_size": "OpenFold's chunk-size tuner",
        "eps": "not used by OpenFold's Evoformer blocks either",
    }

    def __init__(
        self,
        c_m: int,
        c_z: int,
        c_hidden_msa_att: int,
        c_hidden_opm: int,
        c_hidden_mul: int,
        c_hidden_pair_att: int,
        c_s: int,
        no_heads_msa: int,
        no_heads_pair: int,
        no_blocks: int,
        transition_n: int = 4,
        msa_dropout: float = 0.15,
        pair_dropout: float = 0.25,
        no_column_attention: bool = False,
        opm_first: bool = False,
        fuse_projection_weights: bool = False,
        blocks_per_ckpt: Optional[int] = None,
        inf: float = 1e9,
        *,
        eps_opm: float = 1e-3,
        backend: Optional[str] = None,
        cuda_graphs: Union[bool, int] = False,
        recompute: Optional[str] = None,
        recompute_budget_gib: Optional[float] = None,
        checkpoint_last_group: bool = True,
    ):
        super().__init__()
        check_positive_int(type(self).__name__, c_s=c_s)
        self.c_s = c_s
        self._init_stack(
            EvoformerBlock, no_blocks, blocks_per_ckpt, cuda_graphs,
            recompute, recompute_budget_gib, checkpoint_last_group,
            c_m=c_m, c_z=c_z, c_hidden_msa_att=c_hidden_msa_att, c_hidden_opm=c_hidden_opm,
            c_hidden_mul=c_hidden_mul, c_hidden_pair_att=c_hidden_pair_att, no_heads_msa=no_heads_msa,
            no_heads_pair=no_heads_pair, transition_n=transition_n, msa_dropout=msa_dropout,
            pair_dropout=pair_dropout, no_column_attention=no_column_attention, opm_first=opm_first,
            fuse_projection_weights=fuse_projection_weights, inf=inf, eps_opm=eps_opm, backend=backend,
        )
        self.linear = Linear(c_m, c_s, backend=backend)

    def _outputs(self, m: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.linear(m[..., 0, :, :])  # [*, N_res, c_s]
        return m, z, s


class ExtraMSAStack(_Stack):
    """The extra-MSA stack (AF2 supplement Algorithm 18): ``no_blocks`` :class:`ExtraMSABlock`.

    ``forward(m, z, msa_mask=None, pair_mask=None, *, chunk_size=None)`` takes the extra-MSA
    representation ``m [*, N_extra, N_res, c_m]`` (AF2: c_e = 64) and returns the updated pair
    representation ``z [*, N_res, N_res, c_z]`` (the MSA output is not used by AlphaFold).
    Arguments as :class:`EvoformerStack` without ``c_s``, plus ``eps`` of the global attention.
    (``checkpoint_last_group=False`` keeps the last block's activations while the Evoformer stack
    that follows runs its forward and backward: it adds them to that stack's peak memory.)
    """

    config_section = "extra_msa_stack"
    openfold_ignored_keys = {
        "clear_cache_between_blocks": "OpenFold's memory trick (emptying the CUDA cache between blocks)",
        "tune_chunk_size": "OpenFold's chunk-size tuner",
        "chunk_msa_attn": "OpenFold's chunking of the MSA attention in training (a memory trick)",
    }

    def __init__(
        self,
        c_m: int,
        c_z: int,
        c_hidden_msa_att: int,
        c_hidden_opm: int,
        c_hidden_mul: int,
        c_hidden_pair_att: int,
        no_heads_msa: int,
        no_heads_pair: int,
        no_blocks: int,
        transition_n: int = 4,
        msa_dropout: float = 0.15,
        pair_dropout: float = 0.25,
        opm_first: bool = False,
        fuse_projection_weights: bool = False,
        inf: float = 1e9,
        eps: float = 1e-10,
        *,
        blocks_per_ckpt: Optional[int] = None,
        eps_opm: float = 1e-3,
        backend: Optional[str] = None,
        cuda_graphs: Union[bool, int] = False,
        recompute: Optional[str] = None,
        recompute_budget_gib: Optional[float] = None,
        checkpoint_last_group: bool = True,
    ):
        super().__init__()
        self._init_stack(
            ExtraMSABlock, no_blocks, blocks_per_ckpt, cuda_graphs,
            recompute, recompute_budget_gib, checkpoint_last_group,
            c_m=c_m, c_z=c_z, c_hidden_msa_att=c_hidden_msa_att, c_hidden_opm=c_hidden_opm,
            c_hidden_mul=c_hidden_mul, c_hidden_pair_att=c_hidden_pair_att, no_heads_msa=no_heads_msa,
            no_heads_pair=no_heads_pair, transition_n=transition_n, msa_dropout=msa_dropout,
            pair_dropout=pair_dropout, opm_first=opm_first, fuse_projection_weights=fuse_projection_weights,
            inf=inf, eps_opm=eps_opm, backend=backend, eps=eps,
        )

    @classmethod
    def _openfold_arguments(cls, arguments: dict) -> dict:
        # OpenFold's `ckpt` (checkpoint every block while training) is blocks_per_ckpt 1 here; a
        # blocks_per_ckpt given too wins
        if "ckpt" in arguments:
            ckpt = check_bool(f"{cls.__name__}.from_config", "ckpt", arguments.pop("ckpt"))
            arguments.setdefault("blocks_per_ckpt", 1 if ckpt else None)
        return arguments

    def _outputs(self, m: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return z
