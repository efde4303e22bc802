"""evoformer_blocks: AlphaFold-style Evoformer blocks on fused ops (attention, triangle
multiplication, layer norm) with exact eager fallbacks."""

from . import ops
from .ops import evoformer_attention
from .attention import (
    MSAColumnAttention,
    MSAColumnGlobalAttention,
    MSARowAttentionWithPairBias,
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
)
from .dropout import DropoutColumnwise, DropoutRowwise
from .evoformer import EvoformerBlock, EvoformerStack, ExtraMSABlock, ExtraMSAStack
from .outer_product_mean import OuterProductMean
from .primitives import LayerNorm, Linear
from .transitions import MSATransition, PairTransition
from .triangle_multiplication import (
    FusedTriangleMultiplicationIncoming,
    FusedTriangleMultiplicationOutgoing,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)

__version__ = "0.1.0"

__all__ = [
    "ops",
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
]
