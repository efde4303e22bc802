"""MSA and pair transitions (AF2 supplement Algorithms 9 and 15) and AF3's SwiGLU transition
(AF3 supplement Algorithm 11)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ._checks import as_mask, check_backend, check_optional_positive_int, check_positive_int, check_tensor
from ._chunking import chunked
from .ops import linear, module_nodes
from .primitives import LayerNorm, Linear, stacked_projection


class Transition(nn.Module):
    """Two-layer feed-forward update: LayerNorm → Linear(c, n·c) → ReLU → Linear(n·c, c).

    ``forward(x [*, N_a, N_b, c], mask [*, N_a, N_b])`` returns the update ``[*, N_a, N_b, c]``,
    zero where ``mask`` is 0 (OpenFold masks here; AF2 does not, which only matters at padding).
    The output layer is zero-initialized ("final"), so a fresh module returns zeros.
    ``chunk_size`` processes that many ``N_a`` rows (over the flattened ``[*, N_a]``) at a time.
    Parameter names follow OpenFold: ``layer_norm``, ``linear_1``, ``linear_2``.
    """

    def __init__(self, c: int, n: int = 4, backend: Optional[str] = None):
        super().__init__()
        check_backend(type(self).__name__, backend)
        check_positive_int(type(self).__name__, c=c, n=n)
        self.c, self.n = c, n
        self.layer_norm = LayerNorm(c, backend=backend)
        self._add_layers(c, n, backend)

    def _add_layers(self, c: int, n: int, backend: Optional[str]) -> None:
        self.linear_1 = Linear(c, n * c, init="relu", backend=backend)
        self.linear_2 = Linear(n * c, c, init="final", backend=backend)

    def _update(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self._after_norm(self.layer_norm(x), mask)  # [*, N_b, c]

    def _output(self) -> Linear:
        """The output layer (whose bias a block may add in its next residual add instead)."""
        return self.linear_2

    def _unmasked_update(self, x: torch.Tensor, output_bias: bool = True) -> torch.Tensor:
        # x = layer_norm(x) [*, N_b, c]; relu(linear_1(x)), the ReLU in the GEMM's epilogue where the
        # backend can, then linear_2 (without its bias where output_bias is False): the update before
        # its mask [*, N_b, c]; as one node where it can run (ops.module_nodes)
        update = module_nodes.transition(x, self.linear_1, self.linear_2, output_bias)
        if update is not None:
            return update
        x = linear(x, self.linear_1.weight, self.linear_1.bias, activation="relu", backend=self.linear_1.backend)
        return self.linear_2(x, output_bias)

    def _after_norm(self, x: torch.Tensor, mask: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        # x = layer_norm(x) [*, N_b, c], mask [*, N_b, 1]
        if residual is not None:
            return torch.addcmul(residual, self._unmasked_update(x), mask)  # residual + update, one pass [*, N_b, c]
        return self._unmasked_update(x) * mask  # [*, N_b, c]

    def forward(
        self, x: torch.Tensor, mask: Optional[torch.Tensor] = None, *, chunk_size: Optional[int] = None
    ) -> torch.Tensor:
        name = type(self).__name__
        check_tensor(name, "x", x, (None, None, self.c), f"[*, N_a, N_b, {self.c}]", weights=self.layer_norm.weight)
        check_optional_positive_int(name, "chunk_size", chunk_size)
        mask = as_mask(name, "mask", mask, x, "[*, N_a, N_b]")  # [*, N_a, N_b]
        return self._run(self._update, x, mask, chunk_size)

    def _normalized(
        self, x: torch.Tensor, mask: torch.Tensor, chunk_size: Optional[int], residual: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """The update from ``x = layer_norm(x)`` (checked inputs, mask [*, N_a, N_b]; the block passes
        its fused residual add and layer norm's output here). With ``residual`` (``x``'s shape):
        ``residual + update``, added in the pass that masks the update (after it when chunked)."""
        if residual is not None and chunk_size is None:
            return self._after_norm(x, mask.unsqueeze(-1), residual)  # [*, N_a, N_b, c]
        update = self._run(self._after_norm, x, mask, chunk_size)
        return update if residual is None else residual + update

    def _normalized_unmasked(self, x: torch.Tensor, chunk_size: Optional[int], output_bias: bool = True) -> torch.Tensor:
        """The update from ``x = layer_norm(x)`` before its mask (checked inputs): the block masks it in
        the residual add that follows (``ops.add_layer_norm``'s ``residual_scale``), and with
        ``output_bias=False`` adds the output layer's bias there too (``residual_bias``)."""
        return chunked(lambda x: self._unmasked_update(x, output_bias), {"x": x}, no_batch_dims=x.dim() - 2,
                       chunk_size=chunk_size)

    def _run(self, update, x: torch.Tensor, mask: torch.Tensor, chunk_size: Optional[int]) -> torch.Tensor:
        mask = mask.unsqueeze(-1)  # [*, N_a, N_b, 1]
        return chunked(update, {"x": x, "mask": mask}, no_batch_dims=x.dim() - 2, chunk_size=chunk_size)


class MSATransition(Transition):
    """Algorithm 9: the MSA transition, ``x`` is the MSA representation ``[*, N_seq, N_res, c_m]``."""

    def __init__(self, c_m: int, n: int = 4, backend: Optional[str] = None):
        super().__init__(c_m, n, backend)


class PairTransition(Transition):
    """Algorithm 15: the pair transition, ``x`` is the pair representation ``[*, N_res, N_res, c_z]``."""

    def __init__(self, c_z: int, n: int = 4, backend: Optional[str] = None):
        super().__init__(c_z, n, backend)


class SwiGLUTransition(Transition):
    """AlphaFold 3's transition (AF3 supplement Algorithm 11): LayerNorm, then ``a`` and ``b`` =
    LinearNoBias(c, n·c) each, then LinearNoBias(n·c, c) of ``swish(a) ⊙ b``::

        x = LayerNorm(x);  update = linear_out(silu(linear_a(x)) * linear_b(x))

    ``linear_a`` and ``linear_b`` run as one GEMM (one read of x, one weight-gradient GEMM in the
    backward). Masking, chunking and the internal entry points are :class:`Transition`'s
    (``forward(x [*, N_a, N_b, c], mask [*, N_a, N_b])``: the update, zero where ``mask`` is 0, as
    OpenFold3 masks it). ``linear_out`` is zero-initialized ("final"). Parameters: ``layer_norm``,
    ``linear_a``, ``linear_b``, ``linear_out`` (OpenFold3: ``swiglu.linear_a``, ``swiglu.linear_b``).
    """

    def _add_layers(self, c: int, n: int, backend: Optional[str]) -> None:
        self.linear_a = Linear(c, n * c, bias=False, init="relu", backend=backend)
        self.linear_b = Linear(c, n * c, bias=False, init="relu", backend=backend)
        self.linear_out = Linear(n * c, c, bias=False, init="final", backend=backend)

    def _output(self) -> Linear:
        return self.linear_out

    def _unmasked_update(self, x: torch.Tensor, output_bias: bool = True) -> torch.Tensor:
        # x = layer_norm(x) [*, N_b, c]
        ab = stacked_projection(x, (self.linear_a, self.linear_b))  # [*, N_b, 2 n c]
        a, b = ab.chunk(2, dim=-1)  # [*, N_b, n c] each (views)
        return self.linear_out(torch.nn.functional.silu(a) * b, output_bias)  # [*, N_b, c]
