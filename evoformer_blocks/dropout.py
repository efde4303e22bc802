"""Dropout whose mask is shared along one dimension (AF2 supplement 1.11.6)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._checks import check_rate


class SharedDropout(nn.Module):
    """Dropout with one mask shared by every index of dimension ``shared_dim``.

    In training mode an element is zeroed with probability ``p`` and the rest are scaled by
    ``1 / (1 - p)``; in eval mode (or with ``p == 0``) this is the identity.
    """

    def __init__(self, p: float, shared_dim: int):
        super().__init__()
        self.p = check_rate(type(self).__name__, "p", p)
        self.shared_dim = shared_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = self.keep_mask(x)
        return x if keep is None else x * keep

    def keep_mask(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The mask ``forward(x)`` multiplies ``x`` by (``[*, 1 at shared_dim, *]``: 0, or ``1 / (1 - p)``
        in x's dtype; one draw from the RNG, as ``forward`` makes), or None where dropout is off
        (eval mode or ``p == 0``)."""
        return self.keep_masks(x, 1)[0]

    def keep_masks(self, x: torch.Tensor, count: int) -> tuple[Optional[torch.Tensor], ...]:
        """``count`` independent masks as :meth:`keep_mask` gives them, drawn from the RNG in one
        call (each a contiguous ``[*, 1 at shared_dim, *]`` slice of one ``[count, ...]`` draw), or
        ``count`` Nones where dropout is off. The blocks draw their masks this way before a
        checkpointed group runs and pass them to the residual adds, so that the group's
        recomputation uses the same masks without replaying the RNG."""
        if not self.training or self.p == 0.0:
            return (None,) * count
        shape = list(x.shape)
        shape[self.shared_dim] = 1
        keep = F.dropout(x.new_ones([count] + shape), p=self.p, training=True)  # [count, *, 1 at shared_dim, *]
        return tuple(keep.unbind(0))

    def extra_repr(self) -> str:
        return f"p={self.p}, shared_dim={self.shared_dim}"


class DropoutRowwise(SharedDropout):
    """Row-wise dropout: for ``x`` of shape ``[*, N_rows, N_cols, C]`` one mask ``[*, 1, N_cols, C]``
    is shared by all rows (dimension -3)."""

    def __init__(self, p: float):
        super().__init__(p, shared_dim=-3)


class DropoutColumnwise(SharedDropout):
    """Column-wise dropout: for ``x`` of shape ``[*, N_rows, N_cols, C]`` one mask ``[*, N_rows, 1, C]``
    is shared by all columns (dimension -2)."""

    def __init__(self, p: float):
        super().__init__(p, shared_dim=-2)
