"""AlphaFold 3's Pairformer (AF3 supplement Algorithm 17) and its attention with pair bias on the
single representation (Algorithm 24 without the diffusion conditioning).

Shapes: ``s`` is the single representation ``[*, N_token, c_s]``, ``z`` the pair representation
``[*, N_token, N_token, c_z]``; ``single_mask`` is ``[*, N_token]`` and ``pair_mask``
``[*, N_token, N_token]`` (1 = real, 0 = padding; None = all real). Every ``c_hidden_*`` is per
head. The attention runs through :func:`evoformer_blocks.ops.gated_evoformer_attention` with one row
(N = 1) sharing the pair bias; the pair side is the Evoformer's (the fused triangle
multiplications, triangle attentions and layer norms) in AF3's bias-free form, with SwiGLU
transitions.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ._checks import as_mask, check_mask, check_optional_positive_int, check_positive_int, check_rate, check_tensor
from .attention import _GatedAttention
from .evoformer import OPENFOLD3_IGNORED_KEYS, _openfold_setting, _PairUpdates, _Stack, add_and_norm, keep_and_norm
from .primitives import LayerNorm
from .transitions import SwiGLUTransition

__all__ = ["AttentionPairBias", "PairformerBlock", "PairformerStack"]


def _check_single_and_pair(owner: str, s, z, module: torch.nn.Module) -> None:
    """Shapes (``module.c_s``, ``module.c_z``), and the dtype and device of ``module``'s weights."""
    c_s, c_z, weights = module.c_s, module.c_z, next(module.parameters())
    check_tensor(owner, "s", s, (None, c_s), f"[*, N_token, c_s={c_s}]", weights=weights)
    *batch, n, _ = s.shape
    check_tensor(
        owner, "z", z, (*batch, n, n, c_z), f"[*, N_token={n}, N_token, c_z={c_z}] with s's batch dims", exact=True,
        weights=weights,
    )


class AttentionPairBias(_GatedAttention):
    """Gated self-attention of the single representation with a bias from the pair representation
    (AF3 supplement Algorithm 24 for the trunk: no conditioning, ``beta = 0``)::

        a = LayerNorm(s);  q = Linear(a);  k, v = LinearNoBias(a);  g = sigmoid(LinearNoBias(a))
        b[h, i, j] = LinearNoBias(LayerNorm(z))[i, j, h]
        out[i] = LinearNoBias(concat_h g[i, h] * sum_j softmax_j(q[i, h]·k[j, h] / sqrt(c) + b[h, i, j]) v[j, h])

    The attention is :class:`~evoformer_blocks.MSARowAttentionWithPairBias`'s with one row: the
    op runs on ``[B, N=1, L=N_token, H, c]``. A masked token gets the logit bias ``-inf`` as a key.

    Args:
        c_s: single channels. c_z: pair channels.
        c_hidden: channels PER HEAD (AF3: 24 = c_s / 16). no_heads: heads (AF3: 16).
        inf: mask value. backend: as for every module.

    Parameters: ``layer_norm_s``, ``layer_norm_z``, ``linear_z`` (c_z -> no_heads, no bias),
    ``linear_q`` (with bias), ``linear_k``/``linear_v`` (no bias), ``linear_g`` (no bias, weight 0
    at init: gates at 0.5), ``linear_o`` (no bias, zeros at init). OpenFold3 names the first
    ``layer_norm_a`` and the projections ``mha.linear_*``.
    """

    def __init__(
        self, c_s: int, c_z: int, c_hidden: int, no_heads: int, inf: float = 1e9, backend: Optional[str] = None
    ) -> None:
        super().__init__(c_hidden, no_heads, inf, backend, c_s=c_s, c_z=c_z)
        self.c_s = c_s
        self.layer_norm_s = LayerNorm(c_s, backend=self.backend)
        self._add_pair_bias(c_z)
        self._add_projections(c_s, q_bias=True, bias=False)

    def forward(
        self, s: torch.Tensor, z: torch.Tensor, mask: Optional[torch.Tensor] = None, *, chunk_size: Optional[int] = None
    ) -> torch.Tensor:
        """
        Args:
            s: ``[*, N_token, c_s]``. z: ``[*, N_token, N_token, c_z]`` (s's batch dims).
            mask: ``[*, N_token]`` 0/1 token mask (keys); None = all ones.
            chunk_size: attend this many query tokens at a time (eager backend).

        Returns:
            ``[*, N_token, c_s]``, the update of s.
        """
        name = type(self).__name__
        _check_single_and_pair(name, s, z, self)
        check_optional_positive_int(name, "chunk_size", chunk_size)
        if mask is not None:
            check_mask(name, "mask", mask, s, "[*, N_token]")
        return self._normalized(self.layer_norm_s(s), self.layer_norm_z(z), self._mask_bias(mask, s), chunk_size)

    def _normalized(
        self, s: torch.Tensor, z: torch.Tensor, mask_bias: Optional[torch.Tensor], chunk_size: Optional[int]
    ) -> torch.Tensor:
        """The update from ``s = layer_norm_s(s)``, ``z = layer_norm_z(z)`` and the token mask's bias
        ``mask_to_bias(mask)`` [*, N_token] or None (checked inputs)."""
        pair_bias = self._pair_bias(z)  # [B, 1, H, N, N]
        if mask_bias is not None:
            mask_bias = mask_bias.unsqueeze(-2)  # [*, 1, N]: the one row's keys
        return self._attend(s.unsqueeze(-3), mask_bias, pair_bias, chunk_size).squeeze(-3)  # [*, N, c_s]


class PairformerBlock(_PairUpdates):
    """One Pairformer block (AF3 supplement Algorithm 17, lines 2-8)::

        z += DropoutRowwise(pair_dropout)(TriangleMultiplicationOutgoing(z))
        z += DropoutRowwise(pair_dropout)(TriangleMultiplicationIncoming(z))
        z += DropoutRowwise(pair_dropout)(TriangleAttentionStartingNode(z))
        z += DropoutColumnwise(pair_dropout)(TriangleAttentionEndingNode(z))
        z += SwiGLUTransition(z)
        s += AttentionPairBias(s, z)
        s += SwiGLUTransition(s)

    The triangle updates in AF3's form (no projection biases). The block chains its updates as the
    Evoformer block does (residual adds fused with the next layer norm, dropout masks drawn up front
    by :meth:`dropout_masks`); the transitions' updates are masked (as OpenFold3 masks them).

    Args:
        c_s, c_z: single and pair channels.
        c_hidden_pair_bias, no_heads_pair_bias: per-head width and heads of the single attention.
        c_hidden_mul: width of the triangle multiplications.
        c_hidden_pair_att, no_heads_pair: per-head width and heads of the triangle attentions.
        transition_n: hidden-width factor of both transitions (AF3: 4).
        pair_dropout: rate of the pair dropouts (AF3: 0.25).
        fuse_projection_weights: the triangle multiplications' input projections as two
            (``linear_ab_p``, ``linear_ab_g``).
        inf: the masks' large number.
        bias_ik: the ending-node attention's bias as OpenFold3's pair block takes it (b_ik; the
            supplement's b_ki is the default).
        backend: the backend of every op.
    """

    def __init__(
        self,
        c_s: int,
        c_z: int,
        c_hidden_pair_bias: int,
        no_heads_pair_bias: int,
        c_hidden_mul: int,
        c_hidden_pair_att: int,
        no_heads_pair: int,
        transition_n: int = 4,
        pair_dropout: float = 0.25,
        *,
        fuse_projection_weights: bool = False,
        inf: float = 1e9,
        bias_ik: bool = False,
        backend: Optional[str] = None,
    ):
        super().__init__()
        name = type(self).__name__
        check_positive_int(name, c_s=c_s, c_z=c_z)
        check_rate(name, "pair_dropout", pair_dropout)
        self.c_s, self.c_z = c_s, c_z
        self._add_pair_stack(
            c_z, c_hidden_mul, c_hidden_pair_att, no_heads_pair, transition_n, pair_dropout, inf, backend,
            fuse_projection_weights, af3=True, bias_ik=bias_ik,
        )
        self.attn_pair_bias = AttentionPairBias(c_s, c_z, c_hidden_pair_bias, no_heads_pair_bias, inf=inf, backend=backend)
        self.single_transition = SwiGLUTransition(c_s, transition_n, backend=backend)

    def forward(
        self,
        s: torch.Tensor,
        z: torch.Tensor,
        single_mask: Optional[torch.Tensor] = None,
        pair_mask: Optional[torch.Tensor] = None,
        *,
        chunk_size: Optional[int] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the updated ``(s [*, N_token, c_s], z [*, N_token, N_token, c_z])``."""
        single_mask, pair_mask = _check_inputs(type(self).__name__, s, z, single_mask, pair_mask, chunk_size, self)
        return self._update(s, z, single_mask, pair_mask, chunk_size)

    def dropout_masks(self, s: torch.Tensor, z: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        """The block's four pair dropout keep-masks (see :meth:`_PairUpdates.pair_dropout_masks`);
        the single representation has no dropout."""
        return self.pair_dropout_masks(z)

    def _first_bias_owner(self) -> torch.nn.Module:
        return self.attn_pair_bias

    def _update(self, s, z, single_mask, pair_mask, chunk_size, keep=None, biases=None):
        # masks already checked 0/1 tensors [*, N] and [*, N, N]; `keep` and `biases` as for the
        # Evoformer block
        single_bias, pair_bias = self._given_biases(biases)
        z = self._pair_updates(z, pair_mask, chunk_size, self.dropout_masks(s, z) if keep is None else keep, pair_bias)
        attention = self.attn_pair_bias
        s, s_ln = keep_and_norm(s, attention.layer_norm_s)
        z, z_ln = keep_and_norm(z, attention.layer_norm_z)
        update = attention._normalized(s_ln, z_ln, attention._mask_bias(single_mask, s, single_bias), chunk_size)
        s, s_ln = add_and_norm(s, self.single_transition.layer_norm, update)
        s = self.single_transition._normalized(s_ln, single_mask, chunk_size, residual=s)
        return s, z


def _check_inputs(owner: str, s, z, single_mask, pair_mask, chunk_size, block: torch.nn.Module):
    """Validates a Pairformer block's (a stack's: its first block's) inputs; returns the masks as 0/1
    tensors of s's / z's dtype."""
    _check_single_and_pair(owner, s, z, block)
    check_optional_positive_int(owner, "chunk_size", chunk_size)
    single_mask = as_mask(owner, "single_mask", single_mask, s, "[*, N_token]")
    pair_mask = as_mask(owner, "pair_mask", pair_mask, z, "[*, N_token, N_token]")
    return single_mask, pair_mask


class PairformerStack(_Stack):
    """The Pairformer (AF3 supplement Algorithm 17): ``no_blocks`` :class:`PairformerBlock`.

    ``forward(s, z, single_mask=None, pair_mask=None, *, chunk_size=None)`` returns
    ``(s [*, N_token, c_s], z [*, N_token, N_token, c_z])``.

    Args: as :class:`PairformerBlock`, plus ``no_blocks`` (AF3: 48), ``blocks_per_ckpt``
    (activation checkpointing of groups of that many blocks while gradients are enabled),
    ``recompute``, ``recompute_budget_gib`` and ``checkpoint_last_group`` (what the checkpointed
    groups recompute: :mod:`evoformer_blocks.recompute`) and ``cuda_graphs`` (replays of CUDA graphs
    per input signature), as the Evoformer stack takes them.
    Parameter names follow OpenFold3's, except that the pair updates sit directly in the block
    (OpenFold3: ``blocks.{i}.pair_stack``); :mod:`evoformer_blocks.compat_af3` converts.
    ``from_config`` also takes OpenFold3's section (``architecture.pairformer``; see
    :meth:`from_config`).
    """

    config_section = "pairformer_stack"
    openfold_config_section = "pairformer"
    openfold_ignored_keys = OPENFOLD3_IGNORED_KEYS

    @classmethod
    def _openfold_arguments(cls, arguments: dict) -> dict:
        _openfold_setting(
            f"{cls.__name__}", arguments, "transition_type", "swiglu",
            "OpenFold3's ReLU transitions; the Pairformer's are SwiGLU, AF3 Algorithm 11",
        )
        return arguments

    def __init__(
        self,
        c_s: int,
        c_z: int,
        c_hidden_pair_bias: int,
        no_heads_pair_bias: int,
        c_hidden_mul: int,
        c_hidden_pair_att: int,
        no_heads_pair: int,
        no_blocks: int,
        transition_n: int = 4,
        pair_dropout: float = 0.25,
        fuse_projection_weights: bool = False,
        blocks_per_ckpt: Optional[int] = None,
        inf: float = 1e9,
        *,
        bias_ik: bool = False,
        backend: Optional[str] = None,
        cuda_graphs: Union[bool, int] = False,
        recompute: Optional[str] = None,
        recompute_budget_gib: Optional[float] = None,
        checkpoint_last_group: bool = True,
    ):
        super().__init__()
        self._init_stack(
            PairformerBlock, no_blocks, blocks_per_ckpt, cuda_graphs,
            recompute, recompute_budget_gib, checkpoint_last_group,
            c_s=c_s, c_z=c_z, c_hidden_pair_bias=c_hidden_pair_bias, no_heads_pair_bias=no_heads_pair_bias,
            c_hidden_mul=c_hidden_mul, c_hidden_pair_att=c_hidden_pair_att, no_heads_pair=no_heads_pair,
            transition_n=transition_n, pair_dropout=pair_dropout, fuse_projection_weights=fuse_projection_weights,
            inf=inf, bias_ik=bias_ik, backend=backend,
        )

    def forward(
        self,
        s: torch.Tensor,
        z: torch.Tensor,
        single_mask: Optional[torch.Tensor] = None,
        pair_mask: Optional[torch.Tensor] = None,
        *,
        chunk_size: Optional[int] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        single_mask, pair_mask = _check_inputs(
            type(self).__name__, s, z, single_mask, pair_mask, chunk_size, self.blocks[0]
        )
        return self._run_checked(s, z, single_mask, pair_mask, chunk_size)

    def _outputs(self, s: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return s, z
