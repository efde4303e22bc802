"""Triangle multiplicative updates (AF2 supplement Algorithms 11 and 12)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ._checks import check_backend, check_bool, check_mask, check_positive_int, check_tensor
from .ops import (
    module_nodes, triangle_multiplication, triangle_multiplication_keeping_input, triangle_multiplication_residual,
)
from .primitives import LayerNorm, Linear, StackedParameters, bias_or_zeros


class TriangleMultiplicativeUpdate(StackedParameters, nn.Module):
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

    ``bias=False`` gives AlphaFold 3's form (supplement Algorithms 12 and 13): every projection
    without a bias (the layer norms keep theirs).

    The update runs through :func:`evoformer_blocks.ops.triangle_multiplication` (``backend``: None
    follows the global setting; ``cutlass`` is the fused CUDA path), with ``layer_norm_in.eps`` as
    both layer norms' epsilon.
    """

    outgoing: bool = True

    def __init__(self, c_z: int, c_hidden: int, backend: Optional[str] = None, *, bias: bool = True):
        super().__init__()
        check_positive_int(type(self).__name__, c_z=c_z, c_hidden=c_hidden)
        check_backend(type(self).__name__, backend)
        self.c_z, self.c_hidden, self.backend = c_z, c_hidden, backend
        self.bias = check_bool(type(self).__name__, "bias", bias)
        self.layer_norm_in = LayerNorm(c_z, backend=backend)
        self._add_input_projections(c_z, c_hidden, backend)
        self.linear_g = Linear(c_z, c_z, bias=bias, init="gating", backend=backend)
        self.linear_z = Linear(c_hidden, c_z, bias=bias, init="final", backend=backend)
        self.layer_norm_out = LayerNorm(c_hidden, backend=backend)
        self._keep_stacked()  # (the four input projections back to back: their stack is a view)

    def _add_input_projections(self, c_z: int, c_hidden: int, backend: Optional[str]) -> None:
        self.linear_a_p = Linear(c_z, c_hidden, bias=self.bias, backend=backend)
        self.linear_a_g = Linear(c_z, c_hidden, bias=self.bias, init="gating", backend=backend)
        self.linear_b_p = Linear(c_z, c_hidden, bias=self.bias, backend=backend)
        self.linear_b_g = Linear(c_z, c_hidden, bias=self.bias, init="gating", backend=backend)

    def _input_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The op's ``proj_weight [4 * c_hidden, c_z]`` and ``proj_bias [4 * c_hidden]``: the
        projections of a, its gate, b and its gate, stacked in that order (zeros without biases)."""
        projections = self._projection_layers()
        weight = torch.cat([lin.weight for lin in projections])
        return weight, bias_or_zeros(weight, *(lin.bias for lin in projections))

    def _stacked_groups(self):
        # the four input projections' weights and their biases, which the op takes stacked
        layers = self._projection_layers()
        if layers is None:
            return ()
        return tuple(lin.weight for lin in layers), tuple(lin.bias for lin in layers)

    def _projection_layers(self) -> Optional[tuple[Linear, ...]]:
        """The four input projections (a, its gate, b, its gate), which the op takes stacked; None where
        the module holds them otherwise."""
        return self.linear_a_p, self.linear_a_g, self.linear_b_p, self.linear_b_g

    def _node(self, z: torch.Tensor, mask: Optional[torch.Tensor], **mode):
        """The op's result as one node (:func:`ops.module_nodes.triangle_multiplication`; ``mode``: its
        keep_input, add_input, update_scale), or None where the node cannot stand for the op."""
        projections = self._projection_layers()
        if projections is None:
            return None
        return module_nodes.triangle_multiplication(
            z, mask, projections, self.linear_g, self.linear_z, self.layer_norm_in, self.layer_norm_out,
            outgoing=self.outgoing, backend=self.backend, **mode,
        )

    def forward(
        self, z: torch.Tensor, mask: Optional[torch.Tensor] = None, *, chunk_size: Optional[int] = None
    ) -> torch.Tensor:
        name = type(self).__name__
        check_tensor(
            name, "z", z, (None, None, self.c_z), f"[*, N_res, N_res, c_z={self.c_z}]", weights=self.linear_g.weight
        )
        if z.shape[-2] != z.shape[-3]:
            raise ValueError(f"{name}: `z` must be square [*, N_res, N_res, c_z], got {list(z.shape)}")
        if mask is not None:
            check_mask(name, "mask", mask, z, "[*, N_res, N_res]")
        out = self._node(z, mask)
        if out is not None:
            return out  # [*, N_res, N_res, c_z]
        return triangle_multiplication(z, mask, **self._op_arguments())  # [*, N_res, N_res, c_z]

    def _op_arguments(self) -> dict:
        """The op's keyword arguments from this module's parameters."""
        proj_weight, proj_bias = self._input_projections()  # [4 * c_hidden, c_z], [4 * c_hidden]
        return dict(
            direction="outgoing" if self.outgoing else "incoming",
            norm_in_weight=self.layer_norm_in.weight,
            norm_in_bias=self.layer_norm_in.bias,
            proj_weight=proj_weight,
            proj_bias=proj_bias,
            gate_weight=self.linear_g.weight,
            gate_bias=bias_or_zeros(self.linear_g.weight, self.linear_g.bias),
            norm_out_weight=self.layer_norm_out.weight,
            norm_out_bias=self.layer_norm_out.bias,
            out_weight=self.linear_z.weight,
            out_bias=bias_or_zeros(self.linear_z.weight, self.linear_z.bias),
            eps=self.layer_norm_in.eps,
            backend=self.backend,
        )

    def _keeping_input(self, z: torch.Tensor, mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(z, self(z, mask))`` from checked inputs, as one node where the op allows
        (:func:`ops.triangle_multiplication_keeping_input`: the block adds the update to z)."""
        kept = self._node(z, mask, keep_input=True)
        if kept is not None:
            return kept
        return triangle_multiplication_keeping_input(z, mask, **self._op_arguments())

    def _adding_to_input(
        self, z: torch.Tensor, mask: Optional[torch.Tensor], update_scale: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``z + self(z, mask) * update_scale`` (``z + self(z, mask)`` without a scale) from checked
        inputs: :func:`ops.triangle_multiplication_residual`, whose fused path adds z as it writes."""
        out = self._node(z, mask, add_input=True, update_scale=update_scale)
        if out is not None:
            return out
        return triangle_multiplication_residual(z, mask, update_scale=update_scale, **self._op_arguments())


class TriangleMultiplicationOutgoing(TriangleMultiplicativeUpdate):
    """Algorithm 11: edges ``(i, k)`` and ``(j, k)`` update ``(i, j)``."""

    outgoing = True


class TriangleMultiplicationIncoming(TriangleMultiplicativeUpdate):
    """Algorithm 12: edges ``(k, i)`` and ``(k, j)`` update ``(i, j)``."""

    outgoing = False


class _FusedProjections:
    """The input projections as AF2-Multimer holds them (OpenFold's ``fuse_projection_weights``):
    ``linear_ab_p`` (c_z -> 2 c_hidden: a's projection then b's) and ``linear_ab_g`` (their gates,
    "gating" init), in place of the four ``linear_a_p/a_g/b_p/b_g``. The same function: for weights
    ``linear_ab_p = [W_a_p; W_b_p]`` and ``linear_ab_g = [W_a_g; W_b_g]`` (biases alike) the update is
    that of :class:`TriangleMultiplicativeUpdate` with the four."""

    def _add_input_projections(self, c_z: int, c_hidden: int, backend: Optional[str]) -> None:
        self.linear_ab_p = Linear(c_z, 2 * c_hidden, bias=self.bias, backend=backend)
        self.linear_ab_g = Linear(c_z, 2 * c_hidden, bias=self.bias, init="gating", backend=backend)

    def _projection_layers(self) -> None:
        return None  # (the op takes the stack made below: no node)

    def _input_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        # [a_p; b_p] and [a_g; b_g] interleaved into the op's [a_p; a_g; b_p; b_g]: one stack
        c, c_z = self.c_hidden, self.c_z
        p, g = self.linear_ab_p, self.linear_ab_g
        weight = torch.stack((p.weight.view(2, c, c_z), g.weight.view(2, c, c_z)), dim=1).view(4 * c, c_z)
        if p.bias is None:
            return weight, bias_or_zeros(weight, None)
        bias = torch.stack((p.bias.view(2, c), g.bias.view(2, c)), dim=1)  # [2, 2, c]
        return weight, bias.view(4 * c)


class FusedTriangleMultiplicationOutgoing(_FusedProjections, TriangleMultiplicationOutgoing):
    """Algorithm 11 with AF2-Multimer's fused input projections (``linear_ab_p``, ``linear_ab_g``;
    OpenFold's class of the same name)."""


class FusedTriangleMultiplicationIncoming(_FusedProjections, TriangleMultiplicationIncoming):
    """Algorithm 12 with AF2-Multimer's fused input projections (``linear_ab_p``, ``linear_ab_g``;
    OpenFold's class of the same name)."""
