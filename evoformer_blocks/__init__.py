"""evoformer_blocks: AlphaFold-style Evoformer attention blocks on a fused attention op."""

from . import ops
from .ops import evoformer_attention

__version__ = "0.1.0"

__all__ = ["ops", "evoformer_attention"]
