"""Triangle multiplicative updates (AF2 supplement Algorithms 11 and 12)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from einops import rearrange

from ._checks import as_mask, check_positive_int, check_tensor
from .primitives import Linear


class TriangleMultiplicativeUpdate(nn.Module):
    """Pair update through the third edge of every triangle ``(i, j, k)``.

    For ``z [*, N_res, N_res, c_z]`` (mask ``[*, N_res, N_res]``), with ``x = LayerNorm(z)``::

        a = mask * sigmoid(Linear_a_g(x)) * Linear_a_p(x)          # [*, N_res, N_res, c_hidden]
        b = mask * sigmoid(Linear_b_g(x)) * Linear_b_p(x)
        outgoing (Alg. 11): p[i, j] = sum_k a[i, k] * b[j, k]
        incoming (Alg. 12): p[i, j] = sum_k a[k, i] * b[k, j]
        update = sigmoid(Linear_g(x)) * Linear_z(LayerNorm(p))     # [*, N_res, N_res, c_z]

    ``c_hidden`` is the width of ``a`` and ``b``. ``linear_z`` is zero-initialized ("final"), the
    gates start open ("gating"). Parameter names follow OpenFold: ``layer_norm_in``,
    ``linear_a_p``, ``linear_a_g``, ``linear_b_p``, ``linear_b_g``, ``linear_g``, ``linear_z``,
    ``layer_norm_out``. ``chunk_size`` is accepted for a uniform interface; this update is not
    chunked (its intermediates are ``[*, N_res, N_res, c_hidden]``, the size of ``z``).
    """

    outgoing: bool = True

    def __init__(self, c_z: int, c_hidden: int):
        super().__init__()
        check_positive_int(type(self).__name__, c_z=c_z, c_hidden=c_hidden)
        self.c_z, self.c_hidden = c_z, c_hidden
        self.layer_norm_in = nn.LayerNorm(c_z)
        self.linear_a_p = Linear(c_z, c_hidden)
        self.linear_a_g = Linear(c_z, c_hidden, init="gating")
        self.linear_b_p = Linear(c_z, c_hidden)
        self.linear_b_g = Linear(c_z, c_hidden, init="gating")
        self.linear_g = Linear(c_z, c_z, init="gating")
        self.linear_z = Linear(c_hidden, c_z, init="final")
        self.layer_norm_out = nn.LayerNorm(c_hidden)

    def forward(
        self, z: torch.Tensor, mask: Optional[torch.Tensor] = None, *, chunk_size: Optional[int] = None
    ) -> torch.Tensor:
        name = type(self).__name__
        check_tensor(name, "z", z, (None, None, self.c_z), f"[*, N_res, N_res, c_z={self.c_z}]")
        if z.shape[-2] != z.shape[-3]:
            raise ValueError(f"{name}: `z` must be square [*, N_res, N_res, c_z], got {list(z.shape)}")
        mask = as_mask(name, "mask", mask, z, "[*, N_res, N_res]")  # [*, N_res, N_res]
        mask = rearrange(mask, "... i j -> ... i j 1")  # [*, N_res, N_res, 1]
        x = self.layer_norm_in(z)  # [*, N_res, N_res, c_z]
        a = mask * torch.sigmoid(self.linear_a_g(x)) * self.linear_a_p(x)  # [*, N_res, N_res, c_hidden]
        b = mask * torch.sigmoid(self.linear_b_g(x)) * self.linear_b_p(x)  # [*, N_res, N_res, c_hidden]
        if self.outgoing:
            p = torch.einsum("...ikc,...jkc->...ijc", a, b)  # [*, N_res, N_res, c_hidden]
        else:
            p = torch.einsum("...kic,...kjc->...ijc", a, b)  # [*, N_res, N_res, c_hidden]
        update = self.linear_z(self.layer_norm_out(p))  # [*, N_res, N_res, c_z]
        return torch.sigmoid(self.linear_g(x)) * update


class TriangleMultiplicationOutgoing(TriangleMultiplicativeUpdate):
    """Algorithm 11: edges ``(i, k)`` and ``(j, k)`` update ``(i, j)``."""

    outgoing = True


class TriangleMultiplicationIncoming(TriangleMultiplicativeUpdate):
    """Algorithm 12: edges ``(k, i)`` and ``(k, j)`` update ``(i, j)``."""

    outgoing = False
