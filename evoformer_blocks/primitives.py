"""Small building blocks shared by the attention modules.

* :class:`Linear`: ``nn.Linear`` with the AlphaFold initialization schemes (AF2 supplement 1.11.4),
  computed by :func:`evoformer_blocks.ops.linear`.
* :class:`LayerNorm`: ``nn.LayerNorm`` over the last dim computed by :func:`evoformer_blocks.ops.layer_norm`.
* :func:`stacked_projection`: several :class:`Linear` of one input as one GEMM, side by side.
* :func:`pack_rows` and :class:`StackedParameters`: the parameters of such a stack kept back to back
  in one buffer, so that the extension's nodes read the stack as a view (:func:`separate_storages`
  undoes it, for A/B comparisons).
* :func:`mask_to_bias`: a 0/1 mask turned into the additive bias ``inf * (mask - 1)``.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .ops._inputs import as_dtype, compute_dtype
from .ops.gating import fused_linear_backward, linear, linear_grads, rows_product
from .ops.normalization import layer_norm

# Standard deviation of a unit normal truncated to [-2, 2]. A truncated-normal initializer divides
# the target std by it, so the samples keep the intended spread after truncation.
# For symmetric truncation at +-t: var = 1 - 2 t phi(t) / (Phi(t) - Phi(-t)).
_TRUNCATION = 2.0
_TRUNCATED_UNIT_STD = math.sqrt(
    1.0
    - 2.0 * _TRUNCATION * math.exp(-0.5 * _TRUNCATION**2) / math.sqrt(2.0 * math.pi)
    / math.erf(_TRUNCATION / math.sqrt(2.0))
)


def _truncated_normal_fan_in(weight: torch.Tensor, scale: float) -> None:
    # Variance scale / fan_in, sampled from a normal truncated at two standard deviations.
    fan_in = weight.shape[1]
    std = math.sqrt(scale / max(1, fan_in)) / _TRUNCATED_UNIT_STD
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-_TRUNCATION * std, b=_TRUNCATION * std)


def _init_default(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    _truncated_normal_fan_in(weight, scale=1.0)  # LeCun normal


def _init_relu(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    _truncated_normal_fan_in(weight, scale=2.0)  # He normal


def _init_glorot(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    nn.init.xavier_uniform_(weight, gain=1.0)


def _init_gating(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    # A gate sigmoid(0 * x + 1) is almost open at initialization.
    nn.init.zeros_(weight)
    if bias is not None:
        nn.init.ones_(bias)


def _init_final(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    # A residual branch that starts as the identity map: its last layer outputs zeros.
    nn.init.zeros_(weight)


def _init_normal(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    nn.init.kaiming_normal_(weight, mode="fan_in", nonlinearity="linear")  # std 1/sqrt(fan_in)


_INITS: dict[str, Callable[[torch.Tensor, Optional[torch.Tensor]], None]] = {
    "default": _init_default,
    "relu": _init_relu,
    "glorot": _init_glorot,
    "gating": _init_gating,
    "final": _init_final,
    "normal": _init_normal,
}


class Linear(nn.Linear):
    """``nn.Linear`` initialized the AlphaFold way. Called like ``nn.Linear``: ``[*, in] -> [*, out]``,
    computed by :func:`evoformer_blocks.ops.linear` (on the ``cutlass`` backend its backward sums the
    bias gradient with a kernel).

    Args:
        in_dim: size of the last input dimension.
        out_dim: size of the last output dimension.
        bias: learn an additive bias (initialized to 0, except ``"gating"``).
        init: one of

            * ``"default"``: LeCun normal, a normal truncated at two standard deviations with
              variance ``1 / fan_in`` after truncation;
            * ``"relu"``: He normal, the same with variance ``2 / fan_in``;
            * ``"glorot"``: Glorot (Xavier) uniform, fan average;
            * ``"gating"``: weight 0, bias 1 (a gate that starts nearly open);
            * ``"final"``: weight 0, bias 0 (a residual update that starts at zero);
            * ``"normal"``: normal with std ``1 / sqrt(fan_in)`` (Kaiming normal, linear gain).
        backend: the op's backend (None: the global setting).
        device, dtype: as for ``nn.Linear``.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        bias: bool = True,
        init: str = "default",
        *,
        backend: Optional[str] = None,
        device=None,
        dtype=None,
    ) -> None:
        if init not in _INITS:
            raise ValueError(f"Linear: invalid `init` {init!r}; choose one of {sorted(_INITS)}")
        super().__init__(in_dim, out_dim, bias=bias, device=device, dtype=dtype)
        self.init = init
        self.backend = backend
        with torch.no_grad():
            if self.bias is not None:
                self.bias.zero_()
            _INITS[init](self.weight, self.bias)

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        """``x W^T + b``; with ``with_bias=False``, ``x W^T`` (a caller adding the bias later, as the
        blocks do in the residual add after an update)."""
        return linear(x, self.weight, self.bias if with_bias else None, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, init={self.init!r}"


_ZEROS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _zeros(n: int, like: torch.Tensor) -> torch.Tensor:
    """A zero bias ``[n]`` of ``like``'s dtype and device, made once per (n, dtype, device) and then
    reused (only ever read: torch.cat copies it), instead of two tensor ops on every forward. A new
    one under torch.compile, whose graphs keep no tensors made while tracing."""
    if torch.compiler.is_compiling():
        return like.new_zeros(n)
    key = (n, like.dtype, like.device)
    zeros = _ZEROS.get(key)
    if zeros is None:
        zeros = _ZEROS[key] = like.new_zeros(n)
    return zeros


def bias_or_zeros(weight: torch.Tensor, *biases: Optional[torch.Tensor]) -> torch.Tensor:
    """The biases of projections whose weights are stacked in ``weight`` ``[out, in]``, concatenated
    (one bias: itself); zeros ``[out]`` of weight's dtype where there are none (layers without bias,
    for an op that takes one), made once per size, dtype and device."""
    if all(b is None for b in biases):
        return _zeros(weight.shape[0], weight)
    return biases[0] if len(biases) == 1 else torch.cat(biases)


def back_to_back(params: Sequence[Optional[torch.Tensor]]) -> bool:
    """Whether ``params`` lie back to back in one storage, in order, each contiguous, with one dtype
    and the same sizes past dim 0: their stack along dim 0 is then a view of that storage (the rule
    of the extension's nodes, ``back_to_back`` in csrc/modules/nodes.h)."""
    if not params or any(p is None for p in params):
        return False
    first = params[0]
    if first.dim() < 1 or first.device.type == "meta":
        return False
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for p in params:
        if (p.untyped_storage().data_ptr() != storage or p.storage_offset() != offset or p.dtype != first.dtype
                or p.shape[1:] != first.shape[1:] or not p.is_contiguous()):
            return False
        offset += p.numel()
    return True


def pack_rows(params: Sequence[Optional[torch.Tensor]]) -> bool:
    """Moves ``params`` (one dtype and device, the same sizes past dim 0) into one new buffer, back to
    back in order, unless they lie so already (:func:`back_to_back`). Each keeps its values and stays
    the same object (a Parameter's ``data`` becomes a view of the buffer: its name, state-dict entry,
    gradient and optimizer state are untouched), so that the stack of a projection's weights is a
    view, not a copy made per call (the nodes' ``stacked_rows``). Returns whether they lie back to
    back afterwards (False, leaving them as they are, where any is None or they differ in dtype,
    device or trailing sizes)."""
    if not params or any(p is None for p in params):
        return False
    first = params[0]
    if any(p.dtype != first.dtype or p.device != first.device or p.dim() < 1 or p.shape[1:] != first.shape[1:]
           for p in params):
        return False
    if back_to_back(params):
        return True
    with torch.no_grad():
        buffer = torch.cat([p.detach() for p in params])  # [sum of the rows, *trailing]
        start = 0
        for p in params:
            p.data = buffer[start:start + p.shape[0]]
            start += p.shape[0]
    return first.device.type != "meta"


def pack_stacked(module: nn.Module) -> None:
    """Packs the stacked parameters of every :class:`StackedParameters` in ``module`` (itself
    included): what construction, moves and loads do; undoes :func:`separate_storages`."""
    for sub in module.modules():
        if isinstance(sub, StackedParameters):
            sub._pack_stacked()


def separate_storages(module: nn.Module) -> None:
    """Gives every stacked parameter in ``module`` a storage of its own, as before packing: the nodes
    then stack them with a copy per call (for A/B timings and tests; :func:`pack_stacked`, a move or a
    load packs them again)."""
    for sub in module.modules():
        if isinstance(sub, StackedParameters):
            for group in sub._stacked_groups():
                for p in group:
                    if p is not None:
                        p.data = p.data.clone()


def _repack_after_load(module: nn.Module, incompatible_keys) -> None:
    module._pack_stacked()  # (load_state_dict(assign=True) puts new tensors in place of the parameters)


class StackedParameters:
    """For a module whose forward stacks groups of its parameters along dim 0 (the groups of
    :meth:`_stacked_groups`, e.g. the q, k, v and g projections' weights): keeps each group back to
    back (:func:`pack_rows`) once :meth:`_keep_stacked` is called (at the end of construction), again
    after ``.to()``, ``.cuda()``, ``.half()`` and the like (``_apply``), after ``load_state_dict``
    (which with ``assign=True`` puts new tensors in place) and in a copy (``copy.deepcopy`` clones
    each parameter on its own) or an unpickled module. Parameter names, values and the state dict
    are those of the unpacked module."""

    def _stacked_groups(self) -> Sequence[Sequence[Optional[torch.Tensor]]]:
        return ()

    def _pack_stacked(self) -> None:
        for group in self._stacked_groups():
            pack_rows(group)

    def _keep_stacked(self) -> None:
        self._pack_stacked()
        if _repack_after_load not in self._load_state_dict_post_hooks.values():
            self.register_load_state_dict_post_hook(_repack_after_load)

    def _apply(self, fn, *args, **kwargs):
        result = super()._apply(fn, *args, **kwargs)
        self._pack_stacked()
        return result

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._keep_stacked()  # (a module pickled without the load hook gets it here)


def _head_major(x: torch.Tensor, weight: torch.Tensor, linear: Optional["Linear"] = None) -> torch.Tensor:
    """``x [B, L, L, c] -> [B, 1, H, L, L]`` with ``[b, 0, h, i, j] = x[b, i, j] . weight[h]``
    (weight ``[H, c]``): computed head-major as ``weight @ x^T``, so no permute or copy follows; the
    dtype is what ``F.linear(x, weight)`` would give (autocast included). ``linear``: the
    :class:`Linear` whose weight it is; where its backward would be the extension's
    (:func:`fused_linear_backward`), one batch element's weight gradient is :func:`rows_product`'s
    (:class:`_HeadMajor`)."""
    batch, length, c = x.shape[0], x.shape[-2], x.shape[-1]
    if (linear is not None and batch == 1 and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            and x.dtype == weight.dtype and not torch.is_autocast_enabled(x.device.type)
            and fused_linear_backward(x, weight, None, linear.backend)):
        return _HeadMajor.apply(x, weight)
    if batch == 1:  # one GEMM call, without matmul's broadcast of the weight over a batch
        out = torch.mm(weight, x.reshape(length * length, c).t())  # [H, L * L]
    else:
        out = torch.matmul(weight, x.reshape(batch, length * length, c).transpose(1, 2))  # [B, H, L * L]
    return out.view(batch, 1, weight.shape[0], length, length)  # [B, 1, H, L, L]


class _HeadMajor(torch.autograd.Function):
    """:func:`_head_major` of one batch element (x ``[1, L, L, c]``, weight ``[H, c]``, one dtype) whose
    backward takes the weight's gradient ``dh . x`` by :func:`rows_product` (a sum over the L * L
    positions that leaves none out) and x's by one GEMM, as the gated-attention node does."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _head_major(x, weight)  # [1, 1, H, L, L]

    @staticmethod
    def backward(ctx, dh):
        x, weight = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:  # (a GEMM of its own, as the node's: not added into another gradient)
            dh2 = dh.reshape(weight.shape[0], x.shape[-3] * x.shape[-2])  # [H, L * L]
            dx = torch.mm(dh2.t(), weight).view(x.shape)  # [1, L, L, c]
        _, dw = _head_major_grads(None, dh, x, weight, False, ctx.needs_input_grad[1], fused=True)  # [H, c]
        return dx, dw


def _head_major_grads(dx, dh, x, weight, need_dx: bool, need_dw: bool, fused: bool = False):
    """The head-major projection's share of the input gradient, added into ``dx [B, L, L, c]`` in place
    (``dx += dh^T . weight``: one GEMM that reads and writes dx instead of a GEMM of its own and an
    addition of the two gradients), and its weight's gradient ``dh . x`` (summed over B; one batch
    element's by :func:`rows_product` where ``fused``). ``dh``: ``[B, 1, H, L, L]``."""
    batch, heads, c, positions = x.shape[0], weight.shape[0], x.shape[-1], x.shape[-3] * x.shape[-2]
    dh3 = dh.reshape(batch, heads, positions)  # [B, H, L * L]
    if need_dx:
        dx3 = dx.view(batch, positions, c)  # [B, L * L, c]
        w = as_dtype(weight, dx.dtype)  # [H, c]
        if batch == 1:
            dx3[0].addmm_(as_dtype(dh3[0], dx.dtype).t(), w)
        else:
            dx3.baddbmm_(as_dtype(dh3, dx.dtype).transpose(1, 2), w.expand(batch, heads, c))
    dw = None
    if need_dw:
        x3 = as_dtype(x.reshape(batch, positions, c), dh3.dtype)  # [B, L * L, c]
        if batch == 1:
            dw = rows_product(dh3[0], x3[0]) if fused else torch.mm(dh3[0], x3[0])  # [H, c]
        else:
            dw = torch.bmm(dh3, x3).sum(0)  # [H, c]
        dw = as_dtype(dw, weight.dtype)
    return dx, dw


class _StackedProjection(torch.autograd.Function):
    """``x [..., c_in] -> [x W_1^T + b_1, ..., x W_k^T + b_k]`` side by side in one ``[..., width_1 + ...
    + width_k]`` tensor, each bias optional: several projections of one input as ONE GEMM (x is read once). The
    gradient arrives as one dense tensor (ops.gated_evoformer_attention writes the gradients of q,
    k, v and g so, or autograd gathers those of views of the output), so the backward takes one GEMM
    for dx, one for every weight, and one column sum for the biases (over the columns from the first
    biased projection on): one extension call (``linear_bwd`` from that column, its weight gradient
    by ``rows_product``) where ``fused`` (the projections' backend is the extension's), else PyTorch's.
    Inputs: ``x, fused, k, head_weight, W_1..W_k, b_1..b_k``.

    With ``head_weight`` ``[H, c_in]`` (x then ``[B, L, L, c_in]``), a second output: the head-major
    projection ``[B, 1, H, L, L]`` of :func:`_head_major` (a triangle attention's pair bias). Its
    input gradient is added into dx by the GEMM that computes it, in this node: as a separate node
    its gradient of x and the stacked one were added by autograd, a pass over two ``[B, L, L, c_in]``
    tensors."""

    @staticmethod
    def forward(ctx, x, fused, count, head_weight, *params):
        weights, biases = params[:count], params[count:]
        stacked = torch.cat(weights)  # [sum of widths, c_in]
        biased = [b is not None for b in biases]
        stacked_bias = None
        if any(biased):
            some = biases[biased.index(True)]
            stacked_bias = torch.cat(
                [b if b is not None else _zeros(w.shape[0], some) for w, b in zip(weights, biases)]
            )  # [sum of widths]
        ctx.save_for_backward(x, stacked, head_weight)
        ctx.weight_dtypes = [w.dtype for w in weights]
        ctx.widths = [w.shape[0] for w in weights]
        ctx.bias_dtypes = [b.dtype if b is not None else None for b in biases]
        ctx.fused = fused
        out = F.linear(x, stacked, stacked_bias)  # [..., sum of widths]
        if head_weight is None:
            return out
        return out, _head_major(x, head_weight)  # [B, L, L, sum of widths], [B, 1, H, L, L]

    @staticmethod
    def backward(ctx, dy, dh=None):
        x, stacked, head_weight = ctx.saved_tensors
        count = len(ctx.weight_dtypes)
        need_weights, need_biases = ctx.needs_input_grad[4 : 4 + count], ctx.needs_input_grad[4 + count :]
        need_dx, need_dw, need_db = ctx.needs_input_grad[0], any(need_weights), any(need_biases)
        widths = ctx.widths
        first = need_biases.index(True) if need_db else 0  # the first projection whose bias is wanted
        bias_from = sum(widths[:first])  # its first column
        dtypes = {ctx.bias_dtypes[i] for i in range(first, count) if need_biases[i]}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32  # the bias sums' dtype
        if ctx.fused:
            # one extension call: the column sums from bias_from on, then the two GEMMs
            dx, dw, sums = linear_grads(
                dy, x, stacked, None, need_dx, need_dw, need_db, dtype, bias_from
            )  # [..., c_in], [sum of widths, c_in], [sum of widths from bias_from on]
        else:
            dy2 = dy.reshape(-1, dy.shape[-1])  # [rows, sum of widths]
            dx = dw = sums = None
            if need_dx:
                dx = as_dtype(torch.mm(dy2, as_dtype(stacked, dy2.dtype)).view(x.shape), x.dtype)  # [..., c_in]
            if need_dw:
                x2 = as_dtype(x.reshape(-1, x.shape[-1]), dy2.dtype)  # [rows, c_in]
                dw = torch.mm(dy2.t(), x2)  # [sum of widths, c_in]
            if need_db:
                tail = dy2[:, bias_from:]  # [rows, ...]: the columns from the first wanted bias on
                sums = as_dtype(tail.sum(0), dtype)
        d_head = None
        if head_weight is not None and dh is not None:
            dx, d_head = _head_major_grads(dx, dh, x, head_weight, need_dx, ctx.needs_input_grad[3],
                                           ctx.fused)
        dweights = [None] * count
        if need_dw:
            dweights = [
                as_dtype(d, weight_dtype) if need else None
                for d, weight_dtype, need in zip(dw.split(widths), ctx.weight_dtypes, need_weights)
            ]  # [width_i, c_in] each
        dbiases = [None] * count
        if need_db:
            for i, db in enumerate(sums.split(widths[first:]), start=first):
                dbiases[i] = as_dtype(db, ctx.bias_dtypes[i]) if need_biases[i] else None
        return (dx, None, None, d_head, *dweights, *dbiases)


def stacked_projection(x: torch.Tensor, linears: Sequence[Linear], head_major: Optional[Linear] = None):
    """``x [..., c_in] -> [..., sum of out_dims]``: the k :class:`Linear` (biases optional) side by
    side, as one GEMM and one autograd node (:class:`_StackedProjection`). The backward is the
    extension's (the bias gradients on the column-sum kernel, the weight gradients by ``rows_product``)
    where the first biased projection's :func:`ops.linear` would run it (the first projection's where
    none has a bias).

    With ``head_major`` (a :class:`Linear` ``c_in -> H`` without bias; x ``[B, L, L, c_in]``), returns
    ``(stacked, head)`` where ``head [B, 1, H, L, L]`` is that projection, head-major
    (``head[b, 0, h, i, j] = head_major(x[b, i, j])[h]``), from the same node."""
    first = next((lin for lin in linears if lin.bias is not None), linears[0])
    fused = fused_linear_backward(x, first.weight, first.bias, first.backend)
    head_weight = None if head_major is None else head_major.weight
    return _StackedProjection.apply(
        x, fused, len(linears), head_weight, *[lin.weight for lin in linears], *[lin.bias for lin in linears]
    )


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm(c)`` (same parameters, state dict and initialization) whose forward runs
    :func:`evoformer_blocks.ops.layer_norm`: the fused kernel on the ``cutlass`` backend, torch's
    layer norm on ``eager``. ``backend`` None follows the global setting. ``[*, c] -> [*, c]``."""

    def __init__(self, c: int, eps: float = 1e-5, *, backend: Optional[str] = None, device=None, dtype=None) -> None:
        super().__init__(c, eps=eps, device=device, dtype=dtype)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, backend=self.backend)


def mask_to_bias(mask: torch.Tensor, inf: float, dtype: torch.dtype) -> torch.Tensor:
    """Turns a 0/1 mask (float, int or bool) into the additive attention bias ``inf * (mask - 1)``.

    Positions with mask 1 get 0 and positions with mask 0 get ``-inf`` (a large finite number such
    as 1e9, as in AlphaFold). The result has the shape of ``mask`` and the compute dtype of
    ``dtype``: float32 for float16, bfloat16 and float32 inputs (``-1e9`` does not fit in float16,
    and the attention op accepts float32 biases for any input), float64 for float64.

    This is the one form in which a mask travels from a module to the attention op, converted once
    per call: a module turns its ``[*, N, L]`` mask (N rows that attend, L keys) into this bias and
    passes it, batch dims flattened, as the op's ``mask_bias`` ``[B, N, 1, 1, L]``, broadcast by the
    op over heads and queries; the op adds it to the logits as it is.
    :class:`~evoformer_blocks.MSAColumnGlobalAttention` adds it to its own logits ``[*, R, 1, S]``.
    """
    return inf * (mask.to(compute_dtype(dtype)) - 1.0)
