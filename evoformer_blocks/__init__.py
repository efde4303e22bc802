"""evoformer_blocks: AlphaFold-style Evoformer blocks (AF2, AF2-Multimer) and AlphaFold 3's
Pairformer and MSA module on fused ops (attention, triangle multiplication, layer norm) with exact
eager fallbacks."""

from . import ops
from .ops import evoformer_attention
from . import recompute  # (the stacks' recompute options: evoformer_blocks.recompute)
from .attention import (
    MSAColumnAttention,
    MSAColumnGlobalAttention,
    MSARowAttentionWithPairBias,
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
)
from .dropout import DropoutColumnwise, DropoutRowwise
from .evoformer import EvoformerBlock, EvoformerStack, ExtraMSABlock, ExtraMSAStack
from .msa_module import MSAModule, MSAModuleBlock, MSAPairWeightedAveraging
from .outer_product_mean import OuterProductMean
from .pairformer import AttentionPairBias, PairformerBlock, PairformerStack
from .primitives import LayerNorm, Linear
from .transitions import MSATransition, PairTransition, SwiGLUTransition
from .triangle_multiplication import (
    FusedTriangleMultiplicationIncoming,
    FusedTriangleMultiplicationOutgoing,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)

__version__ = "0.1.0"

__all__ = [
    "ops",
    "recompute",
    "evoformer_attention",
    "MSARowAttentionWithPairBias",
    "MSAColumnAttention",
    "TriangleAttentionStartingNode",
    "TriangleAttentionEndingNode",
    "MSAColumnGlobalAttention",
    "MSATransition",
    "PairTransition",
    "OuterProductMean",
    "TriangleMultiplicationOutgoing",
    "TriangleMultiplicationIncoming",
    "FusedTriangleMultiplicationOutgoing",
    "FusedTriangleMultiplicationIncoming",
    "DropoutRowwise",
    "DropoutColumnwise",
    "LayerNorm",
    "Linear",
    "EvoformerBlock",
    "ExtraMSABlock",
    "EvoformerStack",
    "ExtraMSAStack",
    "AttentionPairBias",
    "MSAPairWeightedAveraging",
    "SwiGLUTransition",
    "PairformerBlock",
    "PairformerStack",
    "MSAModuleBlock",
    "MSAModule",
]
