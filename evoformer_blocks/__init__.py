"""evoformer_blocks: AlphaFold-style Evoformer attention blocks on a fused attention op."""

from . import ops
from .ops import evoformer_attention
from .attention import (
    MSAColumnAttention,
    MSAColumnGlobalAttention,
    MSARowAttentionWithPairBias,
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
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
]
