"""AlphaFold 3's MSA module (AF3 supplement Algorithm 8, lines 5-14: the blocks, after the MSA
embedding) and its MSA pair-weighted averaging (Algorithm 10).

Shapes as in :mod:`evoformer_blocks.evoformer`: ``m [*, N_msa, N_token, c_m]``,
``z [*, N_token, N_token, c_z]``, ``msa_mask [*, N_msa, N_token]``, ``pair_mask
[*, N_token, N_token]``.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from ._checks import check_bool, check_mask, check_optional_positive_int, check_positive_int, check_rate, check_tensor
from .attention import _check_config, _flatten_batch
from .dropout import DropoutRowwise
from .evoformer import (
    OPENFOLD3_IGNORED_KEYS, _check_inputs, _openfold_setting, _PairUpdates, _Stack, add_and_norm, keep_and_norm,
)
from .ops import _keep, sigmoid_gate
from .ops._inputs import compute_dtype
from .outer_product_mean import OuterProductMean
from .primitives import LayerNorm, Linear, _head_major, mask_to_bias, stacked_projection
from .transitions import SwiGLUTransition

__all__ = ["MSAPairWeightedAveraging", "MSAModuleBlock", "MSAModule"]


class MSAPairWeightedAveraging(nn.Module):
    """MSA pair-weighted averaging (AF3 supplement Algorithm 10): every MSA row averages its values
    over the tokens with weights from the pair representation alone::

        m = LayerNorm(m);  v = LinearNoBias(m);  g = sigmoid(LinearNoBias(m))
        w[h, i, j] = softmax_j(LinearNoBias(LayerNorm(z))[i, j, h] + inf * (pair_mask[i, j] - 1))
        out[s, i] = LinearNoBias(concat_h g[s, i, h] * sum_j w[h, i, j] v[s, j, h])

    The pair mask in the logits is OpenFold3's (the supplement has none; all ones changes nothing).

    This is attention with no q·k term: ``evoformer_attention`` with q = 0 and the pair bias as the
    only score computes it exactly, but its kernels evaluate the softmax once per MSA row (N_msa
    times the exponentials, and a q·kᵀ product of zeros), while the weights are the same for every
    row. The module computes them once ``[B, H, N, N]`` (softmax in float32 for half inputs, as the
    op does) and applies them to all rows as one GEMM per head, ``[N, N] @ [N, N_msa · c]``; v and g
    come from one stacked projection, and the gate runs on :func:`ops.sigmoid_gate`. ``chunk_size``
    processes that many MSA rows at a time (the weights computed once).

    Args:
        c_m: MSA channels. c_z: pair channels.
        c_hidden: channels PER HEAD (AF3: 8). no_heads: heads (AF3: 8).
        inf: mask value. backend: as for every module.

    Parameters: ``layer_norm_m``, ``layer_norm_z``, ``linear_z`` (c_z -> no_heads), ``linear_v``,
    ``linear_g`` (weight 0 at init: gates at 0.5), ``linear_o`` (zeros at init); none has a bias.
    """

    def __init__(
        self, c_m: int, c_z: int, c_hidden: int, no_heads: int, inf: float = 1e9, backend: Optional[str] = None
    ) -> None:
        _check_config(type(self).__name__, inf, backend, c_m=c_m, c_z=c_z, c_hidden=c_hidden, no_heads=no_heads)
        super().__init__()
        self.c_m, self.c_z, self.c_hidden, self.no_heads, self.inf, self.backend = c_m, c_z, c_hidden, no_heads, inf, backend
        hidden = c_hidden * no_heads
        self.layer_norm_m = LayerNorm(c_m, backend=backend)
        self.layer_norm_z = LayerNorm(c_z, backend=backend)
        self.linear_z = Linear(c_z, no_heads, bias=False, init="normal", backend=backend)
        self.linear_v = Linear(c_m, hidden, bias=False, init="glorot", backend=backend)
        self.linear_g = Linear(c_m, hidden, bias=False, init="gating", backend=backend)
        self.linear_o = Linear(hidden, c_m, bias=False, init="final", backend=backend)

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        pair_mask: Optional[torch.Tensor] = None,
        *,
        chunk_size: Optional[int] = None,
    ) -> torch.Tensor:
        """
        Args:
            m: ``[*, N_msa, N_token, c_m]``. z: ``[*, N_token, N_token, c_z]`` (m's batch dims).
            pair_mask: ``[*, N_token, N_token]`` 0/1; None = all ones.
            chunk_size: this many MSA rows at a time. None = all.

        Returns:
            ``[*, N_msa, N_token, c_m]``, the update of m.
        """
        name = type(self).__name__
        check_tensor(name, "m", m, (None, None, self.c_m), f"[*, N_msa, N_token, c_m={self.c_m}]")
        *batch, _, n, _ = m.shape
        check_tensor(
            name, "z", z, (*batch, n, n, self.c_z), f"[*, N_token={n}, N_token, c_z={self.c_z}] with m's batch dims",
            exact=True,
        )
        check_optional_positive_int(name, "chunk_size", chunk_size)
        if pair_mask is not None:
            check_mask(name, "pair_mask", pair_mask, z, "[*, N_token, N_token]")
        return self._normalized(self.layer_norm_m(m), self.layer_norm_z(z), pair_mask, chunk_size)

    def _normalized(
        self, m: torch.Tensor, z: torch.Tensor, pair_mask: Optional[torch.Tensor], chunk_size: Optional[int]
    ) -> torch.Tensor:
        """The update from ``m = layer_norm_m(m)`` and ``z = layer_norm_z(z)`` (checked inputs)."""
        *batch, n_msa, n, c_m = m.shape
        # (_keep.product: a stack's recompute policy may keep the logits and the weighted sums)
        logits = _keep.product(_keep.ATTENTION, _head_major, _flatten_batch(z, 3), self.linear_z.weight,
                               self.linear_z)
        logits = logits[:, 0]  # [B, H, N, N]
        logits = logits.to(compute_dtype(m.dtype))
        if pair_mask is not None:
            bias = mask_to_bias(pair_mask, self.inf, m.dtype)  # [*, N, N]
            logits = logits + bias.reshape(-1, 1, n, n)  # [B, H, N, N]
        weights = torch.softmax(logits, dim=-1).to(m.dtype)  # [B, H, N_i, N_j]
        m = _flatten_batch(m, 3)  # [B, N_msa, N, c_m]
        if chunk_size is None or chunk_size >= n_msa:
            out = self._average(weights, m)
        else:
            out = torch.cat(
                [self._average(weights, m[:, i : i + chunk_size]) for i in range(0, n_msa, chunk_size)], dim=1
            )
        return out.view(*batch, n_msa, n, c_m)  # [*, N_msa, N, c_m]

    def _average(self, weights: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """weights [B, H, N_i, N_j], m [B, S, N, c_m] (normalized) -> the update [B, S, N, c_m]."""
        heads, c = self.no_heads, self.c_hidden
        batch, rows, n, _ = m.shape
        vg = stacked_projection(m, (self.linear_v, self.linear_g))  # [B, S, N, 2 H c]
        v, g = vg.split(heads * c, dim=-1)  # [B, S, N, H c] each (views)
        # every row's values of head h side by side: [B, H, N_j, S c], one GEMM per (b, h)
        v = v.unflatten(-1, (heads, c)).permute(0, 3, 2, 1, 4).reshape(batch, heads, n, rows * c)
        o = _keep.product(_keep.ATTENTION, torch.matmul, weights, v)  # [B, H, N_i, S c]
        o = o.view(batch, heads, n, rows, c).permute(0, 3, 2, 1, 4).reshape(batch, rows, n, heads * c)  # [B, S, N, H c]
        return self.linear_o(sigmoid_gate(g, o, backend=self.backend))  # [B, S, N, c_m]


class MSAModuleBlock(_PairUpdates):
    """One block of AF3's MSA module (AF3 supplement Algorithm 8, lines 6-13)::

        z += OuterProductMean(m)                                   (AF3's form, Algorithm 9)
        m += DropoutRowwise(msa_dropout)(MSAPairWeightedAveraging(m, z))
        m += SwiGLUTransition(m)
        z += DropoutRowwise(pair_dropout)(TriangleMultiplicationOutgoing(z))
        z += DropoutRowwise(pair_dropout)(TriangleMultiplicationIncoming(z))
        z += DropoutRowwise(pair_dropout)(TriangleAttentionStartingNode(z))
        z += DropoutColumnwise(pair_dropout)(TriangleAttentionEndingNode(z))
        z += SwiGLUTransition(z)

    Args:
        c_m, c_z: MSA and pair channels (AF3: 64, 128).
        c_hidden_msa_att, no_heads_msa: per-head width and heads of the pair-weighted averaging
            (AF3: 8, 8).
        c_hidden_opm: the outer product mean's width (AF3: 32).
        c_hidden_mul, c_hidden_pair_att, no_heads_pair: the pair updates' (AF3: 128, 32, 4).
        transition_n: both transitions' hidden-width factor (AF3: 4).
        msa_dropout, pair_dropout: AF3: 0.15, 0.25.
        fuse_projection_weights, inf, bias_ik, backend: as :class:`PairformerBlock`.
        eps_opm: the outer product mean's epsilon.
        opm_mean_first: the outer product mean as the supplement computes it (the mean, then
            ``linear_out``; default), or False: its bias divided by the counts too (OpenFold3's form).
        msa_update: False leaves the pair-weighted averaging and the MSA transition out (their
            update of m; ``pair_weighted_averaging`` and ``msa_transition`` are None): OpenFold3's
            last block.
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
        fuse_projection_weights: bool = False,
        inf: float = 1e9,
        eps_opm: float = 1e-3,
        opm_mean_first: bool = True,
        bias_ik: bool = False,
        msa_update: bool = True,
        backend: Optional[str] = None,
    ):
        super().__init__()
        name = type(self).__name__
        check_positive_int(name, c_m=c_m, c_z=c_z)
        check_rate(name, "msa_dropout", msa_dropout)
        check_rate(name, "pair_dropout", pair_dropout)
        self.c_m, self.c_z = c_m, c_z
        self.outer_product_mean = OuterProductMean(
            c_m, c_z, c_hidden_opm, eps=eps_opm, backend=backend, projection_bias=False, mean_first=opm_mean_first
        )
        self.pair_weighted_averaging = self.msa_transition = None
        if check_bool(name, "msa_update", msa_update):
            self.pair_weighted_averaging = MSAPairWeightedAveraging(
                c_m, c_z, c_hidden_msa_att, no_heads_msa, inf=inf, backend=backend
            )
            self.msa_transition = SwiGLUTransition(c_m, transition_n, backend=backend)
        self.msa_dropout_row = DropoutRowwise(msa_dropout)
        self._add_pair_stack(
            c_z, c_hidden_mul, c_hidden_pair_att, no_heads_pair, transition_n, pair_dropout, inf, backend,
            fuse_projection_weights, af3=True, bias_ik=bias_ik,
        )
        # The MSA module returns z: in its last block the update of m reaches no output, and the
        # module turns this off there (the parameters stay; nothing changes but the work).
        self.msa_output_used = True

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: Optional[torch.Tensor] = None,
        pair_mask: Optional[torch.Tensor] = None,
        *,
        chunk_size: Optional[int] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the updated ``(m, z)``."""
        msa_mask, pair_mask = _check_inputs(type(self).__name__, m, z, msa_mask, pair_mask, chunk_size, self)
        return self._update(m, z, msa_mask, pair_mask, chunk_size)

    def dropout_masks(self, m: torch.Tensor, z: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        """The MSA dropout's keep-mask ``[*, 1, N_token, c_m]`` and the four pair ones (three draws)."""
        (msa_row,) = self.msa_dropout_row.keep_masks(m, 1)
        return (msa_row, *self.pair_dropout_masks(z))

    def _update(self, m, z, msa_mask, pair_mask, chunk_size, keep=None, biases=None):
        # `keep` and `biases` as for the Evoformer block (the pair mask's bias only)
        keep_msa, *keep_pair = self.dropout_masks(m, z) if keep is None else keep
        opm = self.outer_product_mean
        update_msa = self.pair_weighted_averaging is not None and self.msa_output_used
        if update_msa:
            m, m_ln = keep_and_norm(m, opm.layer_norm)
        else:
            m_ln = opm.layer_norm(m)
        z = opm._normalized(m_ln, msa_mask, chunk_size, residual=z)
        if update_msa:
            averaging = self.pair_weighted_averaging
            m, m_ln = keep_and_norm(m, averaging.layer_norm_m)
            z, z_ln = keep_and_norm(z, averaging.layer_norm_z)
            update = averaging._normalized(m_ln, z_ln, pair_mask, chunk_size)
            m, m_ln = add_and_norm(m, self.msa_transition.layer_norm, update, keep_msa)
            m = self.msa_transition._normalized(m_ln, msa_mask, chunk_size, residual=m)
        z = self._pair_updates(z, pair_mask, chunk_size, keep_pair, self._given_biases(biases)[1])
        return m, z


class MSAModule(_Stack):
    """AF3's MSA module (supplement Algorithm 8, lines 5-14): ``no_blocks`` :class:`MSAModuleBlock`
    on an embedded MSA ``m [*, N_msa, N_token, c_m]`` (the module's input embedding, lines 1-3, is
    the caller's: ``LinearNoBias`` of the MSA features plus one of the single inputs).

    ``forward(m, z, msa_mask=None, pair_mask=None, *, chunk_size=None)`` returns the updated pair
    representation ``z [*, N_token, N_token, c_z]``. The last block's update of m reaches no output
    and is not computed. With ``last_block_msa_update=False`` the last block holds no pair-weighted
    averaging and MSA transition at all (OpenFold3's form, whose state dict lacks them).

    Args: as :class:`MSAModuleBlock`, plus ``no_blocks`` (AF3: 4), ``blocks_per_ckpt``,
    ``recompute``, ``recompute_budget_gib``, ``checkpoint_last_group`` and ``cuda_graphs`` as the
    Evoformer stack takes them (``checkpoint_last_group=False`` keeps the last block's activations
    while the Pairformer that follows runs: it adds them to the Pairformer's peak memory).
    ``from_config`` also takes OpenFold3's section (``architecture.msa.msa_module``; see
    :meth:`from_config`).
    """

    config_section = "msa_module"
    openfold_ignored_keys = {
        **OPENFOLD3_IGNORED_KEYS,
        "eps": "not used by OpenFold3's MSA-module blocks either (their outer product mean keeps its own "
               "epsilon, 1e-3: eps_opm here)",
    }

    @classmethod
    def _openfold_arguments(cls, arguments: dict) -> dict:
        owner = cls.__name__
        _openfold_setting(
            owner, arguments, "transition_type", "swiglu", "OpenFold3's ReLU transitions; the MSA module's are SwiGLU"
        )
        _openfold_setting(
            owner, arguments, "opm_first", True,
            "the outer product mean after the MSA updates; the MSA module runs it first, AF3 Algorithm 8",
        )
        return arguments

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
        fuse_projection_weights: bool = False,
        blocks_per_ckpt: Optional[int] = None,
        inf: float = 1e9,
        *,
        eps_opm: float = 1e-3,
        opm_mean_first: bool = True,
        bias_ik: bool = False,
        last_block_msa_update: bool = True,
        backend: Optional[str] = None,
        cuda_graphs: Union[bool, int] = False,
        recompute: Optional[str] = None,
        recompute_budget_gib: Optional[float] = None,
        checkpoint_last_group: bool = True,
    ):
        super().__init__()
        check_bool(type(self).__name__, "last_block_msa_update", last_block_msa_update)
        args = dict(
            c_m=c_m, c_z=c_z, c_hidden_msa_att=c_hidden_msa_att, c_hidden_opm=c_hidden_opm,
            c_hidden_mul=c_hidden_mul, c_hidden_pair_att=c_hidden_pair_att, no_heads_msa=no_heads_msa,
            no_heads_pair=no_heads_pair, transition_n=transition_n, msa_dropout=msa_dropout,
            pair_dropout=pair_dropout, fuse_projection_weights=fuse_projection_weights, inf=inf, eps_opm=eps_opm,
            opm_mean_first=opm_mean_first, bias_ik=bias_ik, backend=backend,
        )
        self._init_stack(
            MSAModuleBlock, no_blocks, blocks_per_ckpt, cuda_graphs, recompute, recompute_budget_gib,
            checkpoint_last_group, **args,
        )
        if not last_block_msa_update:
            self.blocks[-1] = MSAModuleBlock(**args, msa_update=False)
        self.blocks[-1].msa_output_used = False

    def _outputs(self, m: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return z
