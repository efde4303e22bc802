"""The Evoformer attention modules of AlphaFold 2 (supplement Algorithms 7, 8, 13, 14 and 19).

Each module returns the *update* of its input (add it to the residual stream yourself), and for
the same weights computes what OpenFold's module of the same name computes (load OpenFold weights
with :func:`evoformer_blocks.compat.load_openfold_state_dict`).

The attention core of the first four modules and its sigmoid gate go through one op,
:func:`evoformer_blocks.ops.gated_evoformer_attention` (:func:`evoformer_blocks.ops.evoformer_attention`
and :func:`evoformer_blocks.ops.sigmoid_gate` on the stacked q/k/v/g projection), so the backend
(``"eager"``, ``"cutlass"`` or ``"auto"``) is chosen in one place;
:class:`MSAColumnGlobalAttention` (Algorithm 19) pools its queries and is written in plain PyTorch.

Shape legend: ``*`` batch dims (any number, including none), ``N_seq`` MSA sequences, ``N_res``
residues, ``H`` heads (``no_heads``), ``C`` = ``c_hidden`` channels PER HEAD, ``B`` all batch dims
flattened into one.

Parameter names are flat, in AlphaFold/OpenFold style:
``layer_norm_m``/``layer_norm_z`` (LayerNorm of the MSA/pair representation), ``linear_z`` (pair
rep -> one bias per head), ``linear_q``/``linear_k``/``linear_v`` (projections, no bias),
``linear_g`` (sigmoid gate) and ``linear_o`` (output). The triangle modules use the same
``layer_norm_z``/``linear_z`` names for their pair-rep LayerNorm and triangle-bias projection
(OpenFold calls them ``layer_norm``/``linear``; :mod:`evoformer_blocks.compat` maps the names).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ._checks import check_backend, check_bool, check_mask, check_positive_int, check_tensor
from .ops import _keep, gated_evoformer_attention, module_nodes
from .ops._inputs import compute_dtype
from .primitives import LayerNorm, Linear, StackedParameters, _head_major, mask_to_bias, stacked_projection

__all__ = [
    "MSARowAttentionWithPairBias",
    "MSAColumnAttention",
    "TriangleAttentionStartingNode",
    "TriangleAttentionEndingNode",
    "MSAColumnGlobalAttention",
]


def _check_config(owner: str, inf: float, backend: Optional[str], **sizes: int) -> None:
    check_positive_int(owner, **sizes)
    if isinstance(inf, bool) or not isinstance(inf, (int, float)) or not (0 < inf < math.inf):
        raise ValueError(f"{owner}: `inf` must be a positive finite number (e.g. 1e9), got {inf!r}")
    check_backend(owner, backend)


def _flatten_batch(t: torch.Tensor, keep: int) -> torch.Tensor:
    """``t [*, d_1..d_keep] -> [B, d_1..d_keep]`` with B the product of the batch dims (1 for none; a
    view wherever the batch dims allow one)."""
    return t.reshape(math.prod(t.shape[:-keep]), *t.shape[-keep:])


class _GatedAttention(StackedParameters, nn.Module):
    """Gated multi-head self-attention along the second-to-last axis of ``[*, N, L, c_in]``.

    Subclasses create their LayerNorms and bias projection, then ``linear_q/k/v/g/o`` with
    :meth:`_add_projections`, and call :meth:`_attend`. The attention core runs through
    :func:`evoformer_attention`.
    """

    def __init__(self, c_hidden: int, no_heads: int, inf: float, backend: Optional[str], **channels: int) -> None:
        _check_config(type(self).__name__, inf, backend, **channels, c_hidden=c_hidden, no_heads=no_heads)
        super().__init__()
        self.c_hidden = c_hidden
        self.no_heads = no_heads
        self.inf = inf
        self.backend = backend

    def _add_pair_bias(self, c_z: int) -> None:
        """``layer_norm_z`` and ``linear_z``: the pair representation -> one logit bias per head."""
        self.c_z = c_z
        self.layer_norm_z = LayerNorm(c_z, backend=self.backend)
        self.linear_z = Linear(c_z, self.no_heads, bias=False, init="normal", backend=self.backend)

    def _pair_bias(self, z: torch.Tensor) -> torch.Tensor:
        """z: [*, L, L, c_z], already normalized. Returns the op's ``pair_bias`` [B, 1, H, L, L],
        contiguous: ``bias[b, 0, h, i, j] = linear_z(z[b, i, j])[h]``, the logit bias of query i
        and key j in head h (head-major as ``W @ z^T``, so no permute or copy follows)."""
        return _head_major(_flatten_batch(z, 3), self.linear_z.weight, self.linear_z)  # [B, 1, H, L, L]

    def _qkvg(self) -> tuple[Linear, Linear, Linear, Linear]:
        return self.linear_q, self.linear_k, self.linear_v, self.linear_g

    def _stacked_groups(self):
        # the q, k, v and g weights, which the attention's node stacks (StackedParameters)
        return ((self.linear_q.weight, self.linear_k.weight, self.linear_v.weight, self.linear_g.weight),)

    def _add_projections(self, c_in: int, q_bias: bool = False, bias: bool = True) -> None:
        """``linear_q/k/v`` (no bias; ``q_bias``: q with one, as AF3's AttentionPairBias), ``linear_g``
        and ``linear_o`` (with biases as in AF2; without where ``bias`` is False, as in AF3)."""
        hidden = self.c_hidden * self.no_heads
        self.linear_q = Linear(c_in, hidden, bias=q_bias, init="glorot", backend=self.backend)
        self.linear_k = Linear(c_in, hidden, bias=False, init="glorot", backend=self.backend)
        self.linear_v = Linear(c_in, hidden, bias=False, init="glorot", backend=self.backend)
        self.linear_g = Linear(c_in, hidden, bias=bias, init="gating", backend=self.backend)
        self.linear_o = Linear(hidden, c_in, bias=bias, init="final", backend=self.backend)
        self._keep_stacked()  # (q, k, v and g weights back to back: their stack is a view)

    def _attend(
        self,
        x: torch.Tensor,
        mask_bias: Optional[torch.Tensor],
        pair_bias: Optional[torch.Tensor],
        chunk_size: Optional[int],
        transposed: bool = False,
        qkvg: Optional[torch.Tensor] = None,
        output_bias: bool = True,
    ) -> torch.Tensor:
        """x: [*, N, L, c_in] (normalized), or with ``transposed`` [*, L, N, c_in]: the rows n along
        dim -2 and the positions they attend over along dim -3 (column attention and the ending node
        run on their input's own layout, so nothing is transposed in memory: the attention op takes
        strided q, k, v). mask_bias: [*, N, L] (``mask_to_bias`` of the mask, any strides) or None,
        in the attention's orientation; pair_bias: [B, 1, H, L, L] (from :meth:`_pair_bias`) or None;
        qkvg: the stacked q, k, v, g projection of x [B, A, B', 4 H C] where the caller made it.
        output_bias: False: ``linear_o`` without its bias (a block adds it in its next residual add).

        Row ``n`` attends over its ``L`` positions; ``pair_bias[b, 0, h, i, j]`` is added to the
        logit of query ``i`` and key ``j`` in head ``h`` of every row. Returns the update in x's
        layout.
        """
        if qkvg is None:  # the whole update as one node where it can run (ops.module_nodes)
            out = self._node(x, mask_bias, pair_bias, transposed, output_bias=output_bias)
            if out is not None:
                return out  # [*, A, B', c_in]
        batch_shape = x.shape[:-3]
        if qkvg is None:
            qkvg = stacked_projection(
                _flatten_batch(x, 3), self._qkvg()
            )  # [B, A, B', 4 * H * C]: q, k, v, g side by side, one GEMM's output

        if mask_bias is not None:
            mask_bias = _flatten_batch(mask_bias, 2)[:, :, None, None, :]  # [B, N, 1, 1, L]

        # sigmoid(g) * attention: q, k, v seen as [B, N, L, H, C] (strided views, N and L swapped
        # with `transposed`), the result in x's layout
        o = gated_evoformer_attention(
            qkvg, self.no_heads, mask_bias, pair_bias, transposed=transposed, backend=self.backend,
            chunk_size=chunk_size,
        )  # [B, A, B', H * C]
        out = self.linear_o(o, output_bias)  # [B, A, B', c_in]
        return out.reshape(*batch_shape, *out.shape[1:])  # [*, A, B', c_in]

    def _node(self, x, mask_bias, pair_bias, transposed: bool, head_major: Optional[Linear] = None,
              transpose_head: bool = False, pair_source: Optional[torch.Tensor] = None,
              output_bias: bool = True) -> Optional[torch.Tensor]:
        """:meth:`_attend`'s result (with ``head_major``, the pair bias from x's own head-major
        projection, transposed with ``transpose_head``, or from ``pair_source``'s) as one autograd
        node, or None where the node cannot stand for the composed ops
        (:func:`evoformer_blocks.ops.module_nodes.gated_attention`)."""
        return module_nodes.gated_attention(
            x, self.no_heads, mask_bias, pair_bias, self._qkvg(), self.linear_o,
            head_weight=None if head_major is None else head_major.weight, transpose_head=transpose_head,
            pair_source=pair_source, transposed=transposed, backend=self.backend, output_bias=output_bias,
        )

    def _mask_bias(
        self, mask: Optional[torch.Tensor], like: torch.Tensor, given: Optional[torch.Tensor] = None
    ) -> Optional[torch.Tensor]:
        """The mask's additive bias ``mask_to_bias(mask)`` [*, N, L] for inputs like ``like``: ``given``
        where the caller computed it already, None for no mask."""
        if given is not None or mask is None:
            return given
        return mask_to_bias(mask, self.inf, like.dtype)


class MSARowAttentionWithPairBias(_GatedAttention):
    """MSA row-wise gated self-attention with pair bias (AF2 supplement Algorithm 7).

    Each MSA sequence attends over its residues; the pair representation adds one bias per head
    and residue pair, shared by all sequences.

    Args:
        c_m: MSA channels.
        c_z: pair channels.
        c_hidden: channels PER HEAD of queries, keys and values (AlphaFold: 32).
        no_heads: number of heads (AlphaFold: 8).
        inf: mask value; a masked key gets the logit bias ``-inf`` (finite, as in AlphaFold).
        backend: attention backend name for :func:`evoformer_attention`
            (``"auto"``, ``"eager"``, ``"cutlass"``); None follows the global default.

    Parameters: ``layer_norm_m``, ``layer_norm_z``, ``linear_z`` (c_z -> no_heads, no bias),
    ``linear_q``/``linear_k``/``linear_v`` (c_m -> no_heads * c_hidden, no bias), ``linear_g``
    (gate, weight 0 / bias 1 at init), ``linear_o`` (no_heads * c_hidden -> c_m, zeros at init).
    """

    def __init__(
        self,
        c_m: int,
        c_z: int,
        c_hidden: int,
        no_heads: int,
        inf: float = 1e9,
        backend: Optional[str] = None,
    ) -> None:
        super().__init__(c_hidden, no_heads, inf, backend, c_m=c_m, c_z=c_z)
        self.c_m = c_m
        self.layer_norm_m = LayerNorm(c_m, backend=self.backend)
        self._add_pair_bias(c_z)
        self._add_projections(c_m)

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        *,
        chunk_size: Optional[int] = None,
    ) -> torch.Tensor:
        """
        Args:
            m: ``[*, N_seq, N_res, c_m]`` MSA representation.
            z: ``[*, N_res, N_res, c_z]`` pair representation (same batch dims as m).
            mask: ``[*, N_seq, N_res]`` 0/1 MSA mask (1 = keep; float, int or bool); None = all ones.
            chunk_size: attend this many query residues at a time (eager backend; bounds the
                logits' memory at inference). None = all at once.

        Returns:
            ``[*, N_seq, N_res, c_m]``, the update of m (no residual added).
        """
        name = type(self).__name__
        weights = self.linear_q.weight
        check_tensor(name, "m", m, (None, None, self.c_m), f"[*, N_seq, N_res, c_m={self.c_m}]", weights=weights)
        *batch, n_seq, n_res, _ = m.shape
        check_tensor(
            name, "z", z, (*batch, n_res, n_res, self.c_z), f"[*, N_res={n_res}, N_res, c_z={self.c_z}] with m's batch dims",
            exact=True, weights=weights,
        )
        if mask is not None:
            check_mask(name, "mask", mask, m, "[*, N_seq, N_res]")

        return self._update(m, z, self._mask_bias(mask, m), chunk_size)

    def _update(
        self, m: torch.Tensor, z: torch.Tensor, mask_bias: Optional[torch.Tensor], chunk_size: Optional[int]
    ) -> torch.Tensor:
        """The update from checked inputs and the MSA mask's bias ``mask_to_bias(mask)``
        [*, N_seq, N_res] or None (the block computes it once for both MSA attentions)."""
        return self._normalized(self.layer_norm_m(m), self.layer_norm_z(z), mask_bias, chunk_size)

    def _normalized(
        self, m: torch.Tensor, z: torch.Tensor, mask_bias: Optional[torch.Tensor], chunk_size: Optional[int],
        output_bias: bool = True,
    ) -> torch.Tensor:
        """The update from ``m = layer_norm_m(m)`` and ``z = layer_norm_z(z)`` (the block normalises
        both with the residual streams kept, :func:`ops.layer_norm_keeping_input`); without
        ``linear_o``'s bias where ``output_bias`` is False (the block adds it in its next residual add)."""
        out = self._node(m, mask_bias, None, False, self.linear_z, pair_source=z,
                         output_bias=output_bias)  # (the pair bias in the node)
        if out is not None:
            return out  # [*, N_seq, N_res, c_m]
        pair_bias = self._pair_bias(z)  # [B, 1, H, N_res, N_res]
        return self._attend(m, mask_bias, pair_bias, chunk_size, output_bias=output_bias)  # [*, N_seq, N_res, c_m]


class MSAColumnAttention(_GatedAttention):
    """MSA column-wise gated self-attention (AF2 supplement Algorithm 8).

    Each residue column attends over the MSA sequences; no pair bias.

    Args:
        c_m: MSA channels.
        c_hidden: channels PER HEAD (AlphaFold: 32).
        no_heads: number of heads (AlphaFold: 8).
        inf: mask value (a masked sequence gets the logit bias ``-inf``).
        backend: attention backend for :func:`evoformer_attention`; None = the global default.

    Parameters: ``layer_norm_m``, ``linear_q``/``linear_k``/``linear_v``, ``linear_g``, ``linear_o``.
    """

    def __init__(
        self,
        c_m: int,
        c_hidden: int,
        no_heads: int,
        inf: float = 1e9,
        backend: Optional[str] = None,
    ) -> None:
        super().__init__(c_hidden, no_heads, inf, backend, c_m=c_m)
        self.c_m = c_m
        self.layer_norm_m = LayerNorm(c_m, backend=self.backend)
        self._add_projections(c_m)

    def forward(
        self,
        m: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        *,
        chunk_size: Optional[int] = None,
    ) -> torch.Tensor:
        """
        Args:
            m: ``[*, N_seq, N_res, c_m]`` MSA representation.
            mask: ``[*, N_seq, N_res]`` 0/1 MSA mask; None = all ones.
            chunk_size: attend this many query sequences at a time (eager backend). None = all.

        Returns:
            ``[*, N_seq, N_res, c_m]``, the update of m.
        """
        name = type(self).__name__
        check_tensor(
            name, "m", m, (None, None, self.c_m), f"[*, N_seq, N_res, c_m={self.c_m}]", weights=self.linear_q.weight
        )
        if mask is not None:
            check_mask(name, "mask", mask, m, "[*, N_seq, N_res]")
        return self._normalized(self.layer_norm_m(m), mask, chunk_size)

    def _normalized(self, m: torch.Tensor, mask, chunk_size: Optional[int], mask_bias=None,
                    output_bias: bool = True) -> torch.Tensor:
        """The update from ``m = layer_norm_m(m)`` (checked inputs; the block passes its fused residual
        add and layer norm's output here, and ``mask_bias = mask_to_bias(mask)`` [*, N_seq, N_res]
        when it has it already); without ``linear_o``'s bias where ``output_bias`` is False."""
        mask_bias = self._mask_bias(mask, m, mask_bias)  # [*, N_seq, N_res] or None
        if mask_bias is not None:
            mask_bias = mask_bias.transpose(-1, -2)  # [*, N_res, N_seq]: row r attends over s
        # each residue column attends over the sequences: rows along dim -2, positions along dim -3
        return self._attend(m, mask_bias, None, chunk_size, transposed=True,
                            output_bias=output_bias)  # [*, N_seq, N_res, c_m]


class _TriangleAttention(_GatedAttention):
    """Triangle self-attention around the starting (rows) or ending (columns) node.

    Ending node = starting node applied to the transposed pair representation, transposed back.
    """

    _starting: bool = True

    def __init__(
        self,
        c_z: int,
        c_hidden: int,
        no_heads: int,
        inf: float = 1e9,
        backend: Optional[str] = None,
        *,
        bias: bool = True,
        bias_ik: bool = False,
    ) -> None:
        super().__init__(c_hidden, no_heads, inf, backend, c_z=c_z)
        name = type(self).__name__
        self.bias = check_bool(name, "bias", bias)
        self.bias_ik = check_bool(name, "bias_ik", bias_ik)
        if bias_ik and self._starting:
            raise ValueError(f"{name}: `bias_ik` is an option of the ending-node attention only")
        self._add_pair_bias(c_z)
        self._add_projections(c_z, bias=bias)

    def forward(
        self,
        z: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        *,
        chunk_size: Optional[int] = None,
    ) -> torch.Tensor:
        """
        Args:
            z: ``[*, N_res, N_res, c_z]`` pair representation.
            mask: ``[*, N_res, N_res]`` 0/1 pair mask; None = all ones.
            chunk_size: attend this many query positions of a row at a time (eager backend).

        Returns:
            ``[*, N_res, N_res, c_z]``, the update of z.
        """
        name = type(self).__name__
        check_tensor(
            name, "z", z, (None, None, self.c_z), f"[*, N_res, N_res, c_z={self.c_z}]", weights=self.linear_q.weight
        )
        if z.shape[-3] != z.shape[-2]:
            raise ValueError(f"{name}: `z` must be square [*, N_res, N_res, c_z], got {list(z.shape)}")
        if mask is not None:
            check_mask(name, "mask", mask, z, "[*, N_res, N_res]")
        return self._normalized(self.layer_norm_z(z), mask, chunk_size)

    def _normalized(self, z: torch.Tensor, mask, chunk_size: Optional[int], mask_bias=None,
                    output_bias: bool = True) -> torch.Tensor:
        """The update from ``z = layer_norm_z(z)`` [*, I, J, c_z] (checked inputs; the block passes its
        fused residual add and layer norm's output here, and ``mask_bias = mask_to_bias(mask)``
        [*, I, J] when it has it already); without ``linear_o``'s bias where ``output_bias`` is False."""
        mask_bias = self._mask_bias(mask, z, mask_bias)  # [*, I, J] or None
        # (the ending node's mask in its attention's orientation: row j attends over i)
        node_mask = mask_bias if self._starting or mask_bias is None else mask_bias.transpose(-1, -2)  # [*, J, I]
        out = self._node(z, node_mask, None, not self._starting, self.linear_z, not self._starting and not self.bias_ik,
                         output_bias=output_bias)
        if out is not None:
            return out  # [*, I, J, c_z]
        # Starting node: row i, query j, key k; the bias comes from the third edge z[j, k], i.e.
        # pair_bias[b, 0, h, j, k] = linear_z(z[j, k])[h], the same for every row i. It comes from the
        # node of the q, k, v, g projection, which adds its gradient of z into theirs.
        qkvg, triangle_bias = stacked_projection(
            _flatten_batch(z, 3), self._qkvg(), head_major=self.linear_z
        )  # [B, I, J, 4 H C], [B, 1, H, I, J]
        if self._starting:
            return self._attend(z, mask_bias, triangle_bias, chunk_size, qkvg=qkvg,
                                output_bias=output_bias)  # [*, I, J, c_z]
        # Ending node = the starting node on z^T, run on z's own layout: row j attends over the
        # edges (k, j) with the bias of the third edge z[k, i], i.e. the starting node's bias of z^T.
        # (the one copy here is of the bias, H * N_res^2 values, instead of z's c_z * N_res^2)
        # With bias_ik (OpenFold3's pair block), the bias of the edge z[i, k]: as computed, no copy.
        if not self.bias_ik:
            triangle_bias = triangle_bias.transpose(-1, -2).contiguous()  # [B, 1, H, J, I]
        if mask_bias is not None:
            mask_bias = mask_bias.transpose(-1, -2)  # [*, J, I]: row j attends over i
        return self._attend(z, mask_bias, triangle_bias, chunk_size, transposed=True, qkvg=qkvg,
                            output_bias=output_bias)  # [*, I, J, c_z]


class TriangleAttentionStartingNode(_TriangleAttention):
    """Triangle self-attention around the starting node (AF2 supplement Algorithm 13).

    Edge (i, j) attends over the edges (i, k) of its row, biased by the third edge (j, k):
    ``a[i, j, k] = softmax_k(q[i, j]·k[i, k] / sqrt(C) + b[j, k] + mask_bias[i, k])``.

    Args:
        c_z: pair channels.
        c_hidden: channels PER HEAD (AlphaFold: 32).
        no_heads: number of heads (AlphaFold: 4).
        inf: mask value (a masked key gets the logit bias ``-inf``).
        backend: attention backend for :func:`evoformer_attention`; None = the global default.

    Parameters: ``layer_norm_z`` (LayerNorm of z), ``linear_z`` (c_z -> no_heads triangle bias, no
    bias term), ``linear_q``/``linear_k``/``linear_v``, ``linear_g``, ``linear_o``. OpenFold names
    the first two ``layer_norm`` and ``linear``. ``bias=False`` gives AlphaFold 3's form (Algorithms
    14 and 15): ``linear_g`` and ``linear_o`` without biases.
    """

    _starting = True


class TriangleAttentionEndingNode(_TriangleAttention):
    """Triangle self-attention around the ending node (AF2 supplement Algorithm 14).

    Edge (i, j) attends over the edges (k, j) of its column, biased by the third edge (k, i):
    ``a[i, j, k] = softmax_k(q[i, j]·k[k, j] / sqrt(C) + b[k, i] + mask_bias[k, j])``. Computed as
    the starting-node attention on the transposed pair representation, transposed back.

    Arguments and parameters as for :class:`TriangleAttentionStartingNode`, plus ``bias_ik``: the
    bias of the edge (i, k) instead of (k, i), ``a[i, j, k] = softmax_k(... + b[i, k] + ...)``, the
    form OpenFold3's pair block computes (its ``transpose_bias``); the supplements (AF2 Algorithm 14,
    AF3 Algorithm 15) and OpenFold's AF2 take (k, i), the default.
    """

    _starting = False


class MSAColumnGlobalAttention(nn.Module):
    """MSA column-wise gated global self-attention (AF2 supplement Algorithm 19, extra-MSA stack).

    For each residue column, one query per head is the mask-weighted mean over sequences; keys and
    values are a single head of ``c_hidden`` channels shared by all heads; the gate is per sequence.
    Written in plain PyTorch (its shapes do not fit :func:`evoformer_attention`); the softmax,
    mask and mean run in float32 for float16/bfloat16 inputs.

    Args:
        c_m: MSA channels (AlphaFold: c_e = 64 in the extra-MSA stack).
        c_hidden: channels PER HEAD (AlphaFold: 8).
        no_heads: number of heads (AlphaFold: 8).
        inf: mask value (a masked sequence gets the logit bias ``-inf``).
        eps: added to the mask count of the mean, so a fully masked column stays finite.
        backend: accepted for a signature uniform with the other modules; not used.

    Parameters: ``layer_norm_m``, ``linear_q`` (c_m -> no_heads * c_hidden, no bias), ``linear_k``
    and ``linear_v`` (c_m -> c_hidden, no bias), ``linear_g`` (c_m -> no_heads * c_hidden, gating
    init), ``linear_o`` (no_heads * c_hidden -> c_m, zeros at init).
    """

    def __init__(
        self,
        c_m: int,
        c_hidden: int,
        no_heads: int,
        inf: float = 1e9,
        eps: float = 1e-10,
        backend: Optional[str] = None,
    ) -> None:
        name = type(self).__name__
        _check_config(name, inf, backend, c_m=c_m, c_hidden=c_hidden, no_heads=no_heads)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 <= eps < math.inf):
            raise ValueError(f"{name}: `eps` must be a non-negative finite number, got {eps!r}")
        super().__init__()
        self.c_m = c_m
        self.c_hidden = c_hidden
        self.no_heads = no_heads
        self.inf = inf
        self.eps = eps
        self.backend = backend
        hidden = c_hidden * no_heads
        self.layer_norm_m = LayerNorm(c_m, backend=self.backend)
        self.linear_q = Linear(c_m, hidden, bias=False, init="glorot", backend=self.backend)
        self.linear_k = Linear(c_m, c_hidden, bias=False, init="glorot", backend=self.backend)
        self.linear_v = Linear(c_m, c_hidden, bias=False, init="glorot", backend=self.backend)
        self.linear_g = Linear(c_m, hidden, init="gating", backend=self.backend)
        self.linear_o = Linear(hidden, c_m, init="final", backend=self.backend)

    def forward(
        self,
        m: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        *,
        chunk_size: Optional[int] = None,
    ) -> torch.Tensor:
        """
        Args:
            m: ``[*, N_seq, N_res, c_m]`` (extra) MSA representation.
            mask: ``[*, N_seq, N_res]`` 0/1 MSA mask; None = all ones.
            chunk_size: process this many residue columns at a time. None = all.

        Returns:
            ``[*, N_seq, N_res, c_m]``, the update of m.
        """
        name = type(self).__name__
        check_tensor(
            name, "m", m, (None, None, self.c_m), f"[*, N_seq, N_res, c_m={self.c_m}]", weights=self.linear_q.weight
        )
        if mask is None:
            mask = m.new_ones(m.shape[:-1])  # [*, N_seq, N_res]
        else:
            check_mask(name, "mask", mask, m, "[*, N_seq, N_res]")
        if chunk_size is not None and (
            not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1
        ):
            raise ValueError(f"{name}: `chunk_size` must be a positive int or None, got {chunk_size!r}")

        return self._update(m, mask, chunk_size, normalized=False)

    def _normalized(self, m: torch.Tensor, mask: torch.Tensor, chunk_size: Optional[int], mask_bias=None,
                    output_bias: bool = True) -> torch.Tensor:
        """The update from ``m = layer_norm_m(m)`` (checked inputs, mask not None; the block passes its
        fused residual add and layer norm's output here); without ``linear_o``'s bias where
        ``output_bias`` is False. ``mask_bias`` is accepted for the block's one call signature and not
        used: the pooled query needs the 0/1 mask itself."""
        return self._update(m, mask, chunk_size, normalized=True, output_bias=output_bias)

    def _update(self, m: torch.Tensor, mask: torch.Tensor, chunk_size: Optional[int], normalized: bool,
                output_bias: bool = True) -> torch.Tensor:
        # in m's own layout [*, N_seq, N_res, c_m]: a column is a residue r, its rows the sequences
        n_res = m.shape[-2]
        if chunk_size is None or chunk_size >= n_res:
            return self._columns(m, mask, normalized, output_bias)  # [*, N_seq, N_res, c_m]
        return torch.cat(
            [
                self._columns(m[..., i : i + chunk_size, :], mask[..., i : i + chunk_size], normalized, output_bias)
                for i in range(0, n_res, chunk_size)
            ],
            dim=-2,
        )  # [*, N_seq, N_res, c_m]

    def _columns(self, m: torch.Tensor, mask: torch.Tensor, normalized: bool, output_bias: bool = True) -> torch.Tensor:
        """m: [*, S, R, c_m] (S sequences, R residue columns; layer-normalised already when
        ``normalized``); mask: [*, S, R]. Returns [*, S, R, c_m] (without ``linear_o``'s bias where
        ``output_bias`` is False). Nothing is transposed in memory:
        the column reductions run over dim -3 and the per-column products are batched over R on
        strided views."""
        heads, c = self.no_heads, self.c_hidden
        m = m if normalized else self.layer_norm_m(m)  # [*, S, R, c_m]
        compute = compute_dtype(m.dtype)
        mask_c = mask.to(compute)  # [*, S, R]

        # Query: the mask-weighted mean of the column's rows, projected to every head. The masked
        # sums are a product batched over residues on m's strided view (no [*, S, R, c_m]
        # temporaries; the 0/1 mask is exact in m's dtype; the GEMM sums in float32 and rounds the
        # sums to m's dtype once, before the division).
        count = mask_c.sum(dim=-2) + self.eps  # [*, R]
        mask_rows = mask.to(m.dtype).movedim(-1, -2).unsqueeze(-2)  # [*, R, 1, S]
        sums = torch.matmul(mask_rows, m.movedim(-3, -2)).squeeze(-2)  # [*, R, 1, S] @ [*, R, S, c_m] -> [*, R, c_m]
        pooled = sums.to(compute) / count.unsqueeze(-1)  # [*, R, c_m]
        q = self.linear_q(pooled.to(m.dtype)).unflatten(-1, (heads, c))  # [*, R, H, C]
        # k, v (one head each) and the gate of every head: one GEMM over m
        kvg = stacked_projection(m, (self.linear_k, self.linear_v, self.linear_g))  # [*, S, R, 2 C + H C]
        k, v, g = kvg.split((c, c, heads * c), dim=-1)  # [*, S, R, C] twice, [*, S, R, H C]

        k_cols = k.movedim(-3, -1)  # [*, R, C, S] (a view)
        # (_keep.product: a stack's recompute policy may keep the attention's products)
        logits = _keep.product(_keep.ATTENTION, torch.matmul, q, k_cols)  # [*, R, H, S]
        logits = logits.to(compute) * (c**-0.5)
        bias = mask_to_bias(mask, self.inf, m.dtype).movedim(-2, -1).unsqueeze(-2)  # [*, R, 1, S] (a view)
        probs = torch.softmax(logits + bias, dim=-1).to(v.dtype)  # [*, R, H, S]
        o = _keep.product(_keep.ATTENTION, torch.matmul, probs, v.movedim(-3, -2))  # [*, R, H, C] (v: [*, R, S, C])

        # each sequence's gate on its column's pooled output: [*, S, R, H C]
        gated = torch.sigmoid(g) * o.flatten(-2).unsqueeze(-3)  # [*, S, R, H * C]
        return self.linear_o(gated, output_bias)  # [*, S, R, c_m]
