"""Outer product mean (AF2 supplement Algorithm 10): the MSA → pair communication."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from ._checks import (
    as_mask, check_backend, check_bool, check_optional_positive_int, check_positive_int, check_positive_number, check_tensor,
)
from .ops import _fused, module_nodes
from .ops.cutlass import OPM_HIDDEN, OPM_MAX_BATCHES, OPM_TILE, kernel_family
from .ops.gating import bias_gradient, fused_linear_backward, linear, rows_product
from .primitives import LayerNorm, Linear, StackedParameters, stacked_projection


class _SwapMiddle(torch.autograd.Function):
    """``x [*, I, C, J, E] -> [*, I, J, C, E]`` contiguous (and back in the backward), copying whole
    ``E``-rows as 8-byte words. PyTorch's copy of a permuted tensor costs an index computation per
    element, so moving a bfloat16 ``[*, I, C, J, E]`` four elements at a time as int64 cuts its work
    per byte fourfold; the values are moved, never converted, so the result is bit-exact."""

    @staticmethod
    def forward(ctx, x):
        return _swap_middle(x)

    @staticmethod
    def backward(ctx, grad):
        return _swap_middle(grad)


@_fused.fake("opm_project")
def _(outer, weight, bias, denom, residual, family):
    """linear_out on the outer product's GEMM output ``outer [B, I, c, J, c]`` as it lies: ``[B, I, J, Z]``,
    divided by ``denom [B, I, J]`` and added to ``residual [B, I, J, Z]`` where given (in the kernel's
    epilogue), on the tile GEMM of kernel family ``family`` (``"sm90"``: the Hopper one)."""
    return outer.new_empty(outer.shape[0], outer.shape[1], outer.shape[3], weight.shape[0])


@_fused.fake("opm_project_input_grad")
def _(dout, weight, family):
    """The gradient of ``outer`` from ``dout [B, I, J, Z]`` (contiguous): ``[B, I, c, J, c]``."""
    c = math.isqrt(weight.shape[1])  # weight [Z, c²]
    return dout.new_empty(dout.shape[0], dout.shape[1], c, dout.shape[2], c)


@_fused.fake("opm_project_weight_grad")
def _(dout, outer, weight_dtype):
    """The gradient of the weight ``[Z, c²]`` in ``weight_dtype`` (float32 partials added in a fixed order)."""
    return dout.new_empty(dout.shape[-1], outer.shape[2] * outer.shape[4], dtype=weight_dtype)


class _OuterProjection(torch.autograd.Function):
    """linear_out on the outer product's GEMM output as it lies. Its kernels: ``opm_project``
    (forward, with the mean's division and the residual add in its epilogue where given) and
    ``opm_project_input_grad`` (the gradient of o), both one tile GEMM over (c, e) or z that reads
    or writes o's layout directly, and ``opm_project_weight_grad`` (a sum over (b, i, j) that reads o
    as it lies, float32 partials added in a fixed order). The tile GEMMs are those of the device's kernel
    family (``ops.cutlass.kernel_family``), the backward's those of its forward."""

    @staticmethod
    def forward(ctx, outer, weight, bias, denom, residual):
        ctx.save_for_backward(outer, weight, denom)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.family = kernel_family(outer.device) if outer.is_cuda else "sm80"  # (a meta tensor under tracing)
        return _fused.kernels().opm_project(outer, weight, bias, denom, residual, ctx.family)  # [B, I, J, Z]

    @staticmethod
    def backward(ctx, dout):
        """(d outer, d weight, d bias, None, d residual) from the gradient ``dout [B, I, J, Z]``. The
        residual's gradient is dout itself; the projection's is ``dout / denom`` where it was divided
        (one pass, as the division's backward took)."""
        kernels = _fused.kernels()
        outer, weight, denom = ctx.saved_tensors
        need = ctx.needs_input_grad
        d_residual = dout if need[4] else None  # [B, I, J, Z]
        dout = (dout if denom is None else dout / denom.unsqueeze(-1)).contiguous()  # [B, I, J, Z]
        d_outer = kernels.opm_project_input_grad(dout, weight, ctx.family) if need[0] else None  # [B, I, c, J, c]
        dw = kernels.opm_project_weight_grad(dout, outer, weight.dtype) if need[1] else None  # [Z, c²]
        db = None
        if ctx.bias_dtype is not None and need[2]:
            db = bias_gradient(dout, ctx.bias_dtype)  # [Z]
        return d_outer, dw, db, None, d_residual


class _OuterProduct(torch.autograd.Function):
    """``a [B, S, I C], b [B, S, J E] -> a^T b [B, I C, J E]``: the sum over the S sequences of the outer
    products, one batched GEMM. Its backward is two batched GEMMs that write contiguous gradients,
    ``da = b (d o)^T`` and ``db = a (d o)``. With ``fused`` (the fused projection follows) each GEMM is
    the extension's batched ``rows_product``, which sums a batch of one in slices where cuBLAS 13.0
    would drop terms of it, else runs the same batched GEMM; the module's C++ node,
    ``outer_product_mean_module``, makes the same calls, so the two paths agree bit for bit."""

    @staticmethod
    def forward(ctx, a, b, fused: bool = False):
        ctx.fused = fused
        product = rows_product if fused else torch.bmm
        outer = product(a.transpose(1, 2), b)  # [B, I C, J E]
        # (under autocast the GEMM ran on its operands cast to outer's dtype: the backward's GEMMs take those)
        ctx.save_for_backward(a.to(outer.dtype), b.to(outer.dtype))
        return outer

    @staticmethod
    def backward(ctx, d_outer):
        a, b = ctx.saved_tensors
        need_a, need_b, _ = ctx.needs_input_grad
        product = rows_product if ctx.fused else torch.bmm
        da = product(b, d_outer.transpose(1, 2)) if need_a else None  # [B, S, I C]
        db = product(a, d_outer) if need_b else None  # [B, S, J E]
        return da, db, None


def _pair_counts(mask: torch.Tensor, extension: bool) -> torch.Tensor:
    """``mask^T mask [*, N_res, N_res]`` of ``mask [*, N_seq, N_res]``: per residue pair, the sequences
    in which both are unmasked (a GEMM over the sequences; with ``extension`` the extension's batched
    ``rows_product``, which counts every sequence where cuBLAS 13.0 would drop some, as the module's
    node does)."""
    if not extension:
        return torch.matmul(mask.transpose(-1, -2), mask)
    n_seq, n_res = mask.shape[-2:]
    rows = mask.reshape(-1, n_seq, n_res)  # [B, N_seq, N_res]
    return rows_product(rows.transpose(1, 2), rows).view(*mask.shape[:-2], n_res, n_res)


def _epilogue_fits(outer: torch.Tensor, denom: torch.Tensor, residual: Optional[torch.Tensor]) -> bool:
    """Whether the fused projection of ``outer [B, I, c, J, c]`` can divide by ``denom [*, I, J, 1]`` and
    add ``residual [*, I, J, Z]`` in its epilogue: both contiguous, in outer's dtype and on its device."""
    tensors = (denom,) if residual is None else (denom, residual)
    return all(t.dtype == outer.dtype and t.device == outer.device and t.is_contiguous() for t in tensors)


def _swap_middle(x: torch.Tensor) -> torch.Tensor:
    """``x [*, A, B, D, E] -> [*, A, D, B, E]`` contiguous, as int64 words where E's rows allow (not
    under torch.compile, whose generated copy kernels move whole vectors anyway)."""
    x = x.contiguous()
    if torch.compiler.is_compiling() or (x.shape[-1] * x.element_size()) % 8 or (
        x.storage_offset() * x.element_size()
    ) % 8:
        return x.transpose(-3, -2).contiguous()
    words = x.view(torch.int64)  # [*, A, B, D, E * element size / 8]
    return words.transpose(-3, -2).contiguous().view(x.dtype)  # [*, A, D, B, E]


class OuterProductMean(StackedParameters, nn.Module):
    """Pair update from the mean over MSA sequences of the outer product of two projections.

    For ``m [*, N_seq, N_res, c_m]`` (mask ``[*, N_seq, N_res]``)::

        a, b     = Linear(LayerNorm(m)) * mask                      # [*, N_seq, N_res, c_hidden]
        o[i, j]  = Linear_out(flatten(sum_s a[s, i] ⊗ b[s, j]))     # [*, N_res, N_res, c_z]
        out[i, j] = o[i, j] / (eps + #sequences with both i and j unmasked)

    As in AF2 and OpenFold (OpenFold3 too) the division comes after ``linear_out`` (its bias is
    divided too). AlphaFold 3's form (AF3 supplement Algorithm 9): ``projection_bias=False`` (a and b
    by LinearNoBias) and ``mean_first=True``, ``out = linear_out(sum_s a ⊗ b / (eps + count))``: the
    mean, then the projection, whose bias is not divided. The
    flattened outer product puts ``a``'s channel first (index ``c * c_hidden + e``).
    ``linear_out`` is zero-initialized ("final"). ``chunk_size`` computes at most that many
    residues ``i`` at a time, bounding the ``[*, N_res, N_res, c_hidden²]`` intermediate.
    Parameter names follow OpenFold: ``layer_norm``, ``linear_1``, ``linear_2``, ``linear_out``.
    """

    def __init__(
        self, c_m: int, c_z: int, c_hidden: int, eps: float = 1e-3, backend: Optional[str] = None, *,
        projection_bias: bool = True, mean_first: bool = False,
    ):
        super().__init__()
        name = type(self).__name__
        check_positive_int(name, c_m=c_m, c_z=c_z, c_hidden=c_hidden)
        self.c_m, self.c_z, self.c_hidden = c_m, c_z, c_hidden
        self.eps = check_positive_number(name, "eps", eps)
        check_backend(name, backend)
        self.mean_first = check_bool(name, "mean_first", mean_first)
        check_bool(name, "projection_bias", projection_bias)
        self.layer_norm = LayerNorm(c_m, backend=backend)
        self.linear_1 = Linear(c_m, c_hidden, bias=projection_bias, backend=backend)
        self.linear_2 = Linear(c_m, c_hidden, bias=projection_bias, backend=backend)
        self.linear_out = Linear(c_hidden * c_hidden, c_z, init="final", backend=backend)
        self._keep_stacked()  # (linear_1 and linear_2 back to back: their stack is a view)

    def _stacked_groups(self):
        # the two projections' weights and biases, which the node stacks
        return (self.linear_1.weight, self.linear_2.weight), (self.linear_1.bias, self.linear_2.bias)

    def _outer(
        self, a: torch.Tensor, b: torch.Tensor, denom: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """The update ``linear_out(outer) / denom`` from a: [*, N_seq, N_i, c_hidden] and b: [*, N_seq,
        N_j, c_hidden] (denom [*, N_i, N_j, 1]: eps + the counts), or ``residual + update`` with
        residual [*, N_i, N_j, c_z]: in the fused projection's epilogue where it runs and the
        tensors' dtypes and layouts fit, else by one elementwise pass after it."""
        if self.mean_first:  # the projection without its bias, divided; then the bias, undivided
            return self._divided(a, b, denom, residual, None) + self.linear_out.bias  # [*, N_i, N_j, c_z]
        return self._divided(a, b, denom, residual, self.linear_out.bias)

    def _divided(self, a, b, denom, residual, bias):
        """``(outer · linear_out.weight^T + bias) / denom`` (``+ residual`` where given)."""
        c, n_seq, n_i, n_j = a.shape[-1], a.shape[-3], a.shape[-2], b.shape[-2]
        lead = a.shape[:-3]
        a3 = a.reshape(-1, n_seq, n_i * c)  # [B, N_seq, N_i * c_hidden]
        b3 = b.reshape(-1, n_seq, n_j * c)  # [B, N_seq, N_j * c_hidden]
        # one GEMM over the sequences; its output is [i, c, j, e] in memory and linear_out wants
        # [i, j, (c e)]: the fused projection reads that layout as it is (the GEMM's output is
        # contiguous), else the swap moves whole e-rows. Where the fused projection runs on the
        # operands' dtype, so do the extension's GEMMs (not under autocast, which casts torch.bmm's)
        extension = self._extension_products(a3, b3, a3.shape[0], n_i, n_j)
        outer = _OuterProduct.apply(a3, b3, extension).view(-1, n_i, c, n_j, c)  # [B, N_i, c, N_j, c]
        if self._fused_projection(outer):
            weight = self.linear_out.weight
            if _epilogue_fits(outer, denom, residual):
                d = denom.reshape(-1, n_i, n_j)  # [B, N_i, N_j]
                r = None if residual is None else residual.reshape(-1, n_i, n_j, self.c_z)  # [B, N_i, N_j, c_z]
                return _OuterProjection.apply(outer, weight, bias, d, r).view(*lead, n_i, n_j, -1)  # [*, N_i, N_j, c_z]
            out = _OuterProjection.apply(outer, weight, bias, None, None)  # [B, N_i, N_j, c_z]
        else:
            outer = _SwapMiddle.apply(outer)  # [B, N_i, N_j, c_hidden, c_hidden]
            outer = outer.flatten(-2)  # [B, N_i, N_j, c_hidden²]
            if bias is None:  # (mean_first: the bias is added after the division)
                out = linear(outer, self.linear_out.weight, None, backend=self.linear_out.backend)  # [B, N_i, N_j, c_z]
            else:
                out = self.linear_out(outer)  # [B, N_i, N_j, c_z]
        out = out.view(*lead, n_i, n_j, -1)  # [*, N_i, N_j, c_z]
        if residual is not None:
            return torch.addcdiv(residual, out, denom)  # [*, N_i, N_j, c_z]
        return out / denom  # [*, N_i, N_j, c_z]

    def _extension_products(self, a: torch.Tensor, b: torch.Tensor, batch: int, n_i: int, n_j: int) -> bool:
        """Whether the GEMMs over the sequences of ``a`` and ``b`` (``batch`` elements) run as the
        extension's ``rows_product`` (:class:`_OuterProduct`, :func:`_pair_counts`): where the fused
        projection runs on an outer product of ``n_i`` by ``n_j`` residues in their dtype, outside
        autocast (which casts torch.bmm's operands), as the module's node does."""
        if a.dtype != b.dtype or torch.is_autocast_enabled(a.device.type):
            return False
        rows = module_nodes._stand_in(a, batch * n_i * n_j, self.c_hidden ** 2)  # [B N_i N_j, c²] (no memory)
        return self._projection_fuses(rows, batch * n_i)

    def _fused_projection(self, outer: torch.Tensor) -> bool:
        """Whether linear_out runs as the fused projection on ``outer [B, N_i, c, N_j, c]``: contiguous
        and :meth:`_projection_fuses` on its rows."""
        return outer.is_contiguous() and self._projection_fuses(
            outer.view(-1, self.c_hidden * self.c_hidden), outer.shape[0] * outer.shape[1]
        )

    def _projection_fuses(self, rows: torch.Tensor, groups: int) -> bool:
        """Whether linear_out runs as the fused projection on the rows ``[B N_i N_j, c_hidden²]`` of a
        contiguous outer product (or a stand-in with their shape, dtype and device: the backend's choice
        reads no more), ``groups`` = B N_i: CUDA, float16 or bfloat16, c_hidden and c_z those of
        kernel_table.json's ``outer_product_mean`` (c_hidden its ``hidden``; c_z one ``tile``: the
        forward takes whole tiles, the weight gradient at most one), the linear's fused backend in
        effect."""
        weight, bias = self.linear_out.weight, self.linear_out.bias
        if OPM_HIDDEN is None or not (rows.is_cuda and rows.dtype in (torch.float16, torch.bfloat16)
                                      and self.c_hidden == OPM_HIDDEN and self.c_z == OPM_TILE):
            return False
        if groups > OPM_MAX_BATCHES:  # the kernels' grid: one z index per (batch, i)
            return False
        return fused_linear_backward(rows, weight, bias, self.linear_out.backend)

    def forward(
        self, m: torch.Tensor, mask: Optional[torch.Tensor] = None, *, chunk_size: Optional[int] = None
    ) -> torch.Tensor:
        name = type(self).__name__
        check_tensor(
            name, "m", m, (None, None, self.c_m), f"[*, N_seq, N_res, c_m={self.c_m}]", weights=self.linear_1.weight
        )
        check_optional_positive_int(name, "chunk_size", chunk_size)
        mask = as_mask(name, "mask", mask, m, "[*, N_seq, N_res]")  # [*, N_seq, N_res]
        return self._normalized(self.layer_norm(m), mask, chunk_size)

    def _normalized(
        self, m: torch.Tensor, mask: torch.Tensor, chunk_size: Optional[int], residual: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """The update from ``m = layer_norm(m)`` (checked inputs, mask [*, N_seq, N_res]; the block
        passes its fused residual add and layer norm's output here), or with ``residual`` ([*, N_res,
        N_res, c_z]) ``residual + update`` in one elementwise pass."""
        n_res = m.shape[-2]
        if chunk_size is None or chunk_size >= n_res:  # the whole update as one node where it can run
            out = module_nodes.outer_product_mean(self, m, mask, residual)
            if out is not None:
                return out  # [*, N_res, N_res, c_z]
        mask_c = mask.unsqueeze(-1)  # [*, N_seq, N_res, 1]
        # linear_1 and linear_2 as one GEMM (m read once, one dm), each half masked into a
        # contiguous tensor (unbind's backward stacks the halves' gradients into one)
        ab = stacked_projection(m, (self.linear_1, self.linear_2))  # [*, N_seq, N_res, 2 c_hidden]
        a, b = ab.unflatten(-1, (2, self.c_hidden)).unbind(-2)  # 2 x [*, N_seq, N_res, c_hidden], strided
        a, b = a * mask_c, b * mask_c  # [*, N_seq, N_res, c_hidden] each, contiguous
        extension = self._extension_products(m, mask, math.prod(m.shape[:-3]), n_res, n_res)
        norm = _pair_counts(mask, extension).unsqueeze(-1)  # [*, N_res, N_res, 1]
        denom = self.eps + norm  # [*, N_res, N_res, 1]
        if chunk_size is None or chunk_size >= n_res:
            return self._outer(a, b, denom, residual)  # [*, N_res, N_res, c_z]
        parts = [
            self._outer(
                a[..., i : i + chunk_size, :], b, denom[..., i : i + chunk_size, :, :],
                None if residual is None else residual[..., i : i + chunk_size, :, :],
            )
            for i in range(0, n_res, chunk_size)
        ]
        return torch.cat(parts, dim=-3)  # [*, N_res, N_res, c_z]
