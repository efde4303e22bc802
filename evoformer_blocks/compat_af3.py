"""Loading OpenFold3 weights into the AF3 modules (OpenFold3 0.5.0's names).

OpenFold3 is the AF3 implementation whose names map most directly onto ours (it shares
OpenFold's). Its modules compute three things in their own way; build ours in that form to load its
weights (:func:`openfold3_options` gives the arguments):

* its pair block's ending-node triangle attention takes the bias of edge (i, k): ``bias_ik=True``;
* its outer product mean divides ``linear_out``'s bias by the mask count: ``opm_mean_first=False``;
* its MSA module's last block has no pair-weighted averaging and no MSA transition:
  ``last_block_msa_update=False``.

The correspondence, as data in :data:`OPENFOLD3_CONVERTERS` (the converters of
:mod:`evoformer_blocks.compat`, with OpenFold3's names where they differ):

* ``blocks.{i}.pair_stack.<update>`` -> ``blocks.{i}.<update>``;
* triangle attention ``layer_norm`` -> ``layer_norm_z``, ``mha.linear_*`` -> ``linear_*``;
* ``attn_pair_bias.layer_norm_a`` -> ``layer_norm_s``; the MSA module's ``msa_att_row`` (its
  pair-weighted averaging) -> ``pair_weighted_averaging``;
* a transition's ``swiglu.linear_a``/``swiglu.linear_b`` -> ``linear_a``/``linear_b``.

:func:`load_openfold3_state_dict` refuses missing, unexpected and mis-shaped keys, as
:func:`~evoformer_blocks.compat.load_openfold_state_dict` does.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from .attention import TriangleAttentionEndingNode, TriangleAttentionStartingNode
from .compat import CONVERTERS, Converter, LoadResult, _gated_attention, _same, load_openfold_state_dict, to_openfold_state_dict
from .msa_module import MSAModule, MSAModuleBlock, MSAPairWeightedAveraging
from .pairformer import AttentionPairBias, PairformerBlock, PairformerStack
from .transitions import SwiGLUTransition

__all__ = ["OPENFOLD3_CONVERTERS", "openfold3_options", "load_openfold3_state_dict", "to_openfold3_state_dict"]

_LATENT, _LAYERS = "openfold3.core.model.latent", "openfold3.core.model.layers"
_TRIANGLE_ATTENTION = {"layer_norm": "layer_norm_z", "linear_z": "linear_z", **_gated_attention("mha.")}
_PAIR_STACK = {f"pair_stack.{name}": name for name in ("tri_mul_out", "tri_mul_in", "tri_att_start", "tri_att_end", "pair_transition")}

OPENFOLD3_CONVERTERS: dict[type, Converter] = {
    **CONVERTERS,
    TriangleAttentionStartingNode: Converter(f"{_LAYERS}.triangular_attention.TriangleAttention", children=_TRIANGLE_ATTENTION),
    TriangleAttentionEndingNode: Converter(f"{_LAYERS}.triangular_attention.TriangleAttention", children=_TRIANGLE_ATTENTION),
    SwiGLUTransition: Converter(
        f"{_LAYERS}.transition.SwiGLUTransition",
        children={"layer_norm": "layer_norm", "swiglu.linear_a": "linear_a", "swiglu.linear_b": "linear_b",
                  "linear_out": "linear_out"},
    ),
    AttentionPairBias: Converter(
        f"{_LAYERS}.attention_pair_bias.AttentionPairBias",
        children={"layer_norm_a": "layer_norm_s", **_same("layer_norm_z", "linear_z"), **_gated_attention("mha.")},
    ),
    MSAPairWeightedAveraging: Converter(
        f"{_LAYERS}.msa.MSAPairWeightedAveraging",
        children=_same("layer_norm_m", "layer_norm_z", "linear_z", "linear_v", "linear_g", "linear_o"),
    ),
    PairformerBlock: Converter(
        f"{_LATENT}.pairformer.PairFormerBlock",
        children={**_PAIR_STACK, **_same("attn_pair_bias", "single_transition")},
    ),
    MSAModuleBlock: Converter(
        f"{_LATENT}.msa_module.MSAModuleBlock",
        children={**_PAIR_STACK, "msa_att_row": "pair_weighted_averaging", **_same("msa_transition", "outer_product_mean")},
    ),
    PairformerStack: Converter(f"{_LATENT}.pairformer.PairFormerStack", children={"blocks.*": "blocks.*"}),
    MSAModule: Converter(f"{_LATENT}.msa_module.MSAModuleStack", children={"blocks.*": "blocks.*"}),
}


def openfold3_options(cls: type) -> dict:
    """The constructor arguments that make ``cls`` (:class:`PairformerStack`, :class:`MSAModule`
    or their blocks) compute what OpenFold3's module computes, for its weights."""
    if cls in (PairformerStack, PairformerBlock):
        return {"bias_ik": True}
    if cls is MSAModule:
        return {"bias_ik": True, "opm_mean_first": False, "last_block_msa_update": False}
    if cls is MSAModuleBlock:
        return {"bias_ik": True, "opm_mean_first": False}
    raise ValueError(f"openfold3_options: `cls` must be PairformerStack, PairformerBlock, MSAModule or MSAModuleBlock, got {cls!r}")


def load_openfold3_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> LoadResult:
    """Loads the state_dict of the corresponding OpenFold3 module into ``module`` (see
    :func:`evoformer_blocks.compat.load_openfold_state_dict` for the rules)."""
    return load_openfold_state_dict(module, state_dict, strict, converters=OPENFOLD3_CONVERTERS)


def to_openfold3_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` under OpenFold3's names."""
    return to_openfold_state_dict(module, converters=OPENFOLD3_CONVERTERS)
