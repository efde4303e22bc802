"""The "cutlass" backend: the fused CUDA kernels of csrc/cutlass_kernels as torch custom ops.

``evoformer_blocks::cutlass_attention_fwd`` returns the output and the softmax statistics of each
query row (max score and log2 row sum);
``evoformer_blocks::cutlass_attention_bwd`` recomputes the probabilities from it and returns the
gradients of q, k, v and of each bias that needs one. Both have fake (meta) implementations, and
autograd connects them, so the op works under torch.compile(fullgraph=True). Outside torch.compile
an autograd.Function calls the same kernels directly, for less host time per call.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _build
from ._dispatch import Backend, Capabilities, register
from ._inputs import LOW_PRECISION, AttentionInputs

Tensor = torch.Tensor


def _kernels():
    _build.load()
    return getattr(torch.ops, _build.OP_NAMESPACE)


@torch.library.custom_op("evoformer_blocks::cutlass_attention_fwd", mutates_args=(), device_types="cuda")
def attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, mask_bias: Optional[Tensor], pair_bias: Optional[Tensor], scale: float
) -> tuple[Tensor, Tensor]:
    """Returns (out [B, N, Lq, H, D], stats [B, N, H, Lq, 2] float32: row max, log2 row sum)."""
    out, stats = _kernels().forward(q, k, v, mask_bias, pair_bias, scale)
    return out, stats


@attention_fwd.register_fake
def _(q, k, v, mask_bias, pair_bias, scale):
    batch, rows, len_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, rows, heads, len_q, 2), dtype=torch.float32)


@torch.library.custom_op("evoformer_blocks::cutlass_attention_bwd", mutates_args=(), device_types="cuda")
def attention_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask_bias: Optional[Tensor],
    pair_bias: Optional[Tensor],
    out: Tensor,
    stats: Tensor,
    scale: float,
    need_dmask: bool,
    need_dpair: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (dq, dk, dv, d mask_bias, d pair_bias); an unwanted bias gradient is an empty tensor."""
    dq, dk, dv, dmask, dpair = _kernels().backward(
        dout, q, k, v, mask_bias, pair_bias, out, stats, scale, need_dmask, need_dpair
    )
    return dq, dk, dv, dmask, dpair


@attention_bwd.register_fake
def _(dout, q, k, v, mask_bias, pair_bias, out, stats, scale, need_dmask, need_dpair):
    dmask = mask_bias.new_empty(mask_bias.shape) if need_dmask and mask_bias is not None else q.new_empty(0)
    dpair = pair_bias.new_empty(pair_bias.shape) if need_dpair and pair_bias is not None else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dmask, dpair


def _save(ctx, q, k, v, mask_bias, pair_bias, scale, out, stats) -> None:
    ctx.save_for_backward(q, k, v, mask_bias, pair_bias, out, stats)
    ctx.scale = scale


def _gradients(ctx, dout, backward):
    """The autograd backward of both paths below; ``backward`` runs the backward kernels."""
    q, k, v, mask_bias, pair_bias, out, stats = ctx.saved_tensors
    need_dmask = mask_bias is not None and ctx.needs_input_grad[3]
    need_dpair = pair_bias is not None and ctx.needs_input_grad[4]
    dq, dk, dv, dmask, dpair = backward(
        dout, q, k, v, mask_bias, pair_bias, out, stats, ctx.scale, need_dmask, need_dpair
    )
    return dq, dk, dv, dmask if need_dmask else None, dpair if need_dpair else None, None


def _setup_context(ctx, inputs, output):
    _save(ctx, *inputs, *output)


attention_fwd.register_autograd(
    lambda ctx, dout, _dstats: _gradients(ctx, dout, attention_bwd), setup_context=_setup_context
)


class _EagerAttention(torch.autograd.Function):
    """The same kernels and autograd as the custom ops, called without the custom-op layers.

    Outside torch.compile this path saves about 0.15 ms of host time per forward+backward
    (benchmarks/host_overhead.py), which decides the speed of small shapes; under torch.compile the
    custom ops above (with their fake implementations) are used instead.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask_bias, pair_bias, scale):
        out, stats = _kernels().forward(q, k, v, mask_bias, pair_bias, scale)
        _save(ctx, q, k, v, mask_bias, pair_bias, scale, out, stats)
        ctx.mark_non_differentiable(stats)
        return out, stats

    @staticmethod
    def backward(ctx, dout, _dstats):
        return _gradients(ctx, dout, _kernels().backward)


def attention(q, k, v, mask_bias, pair_bias, scale: float) -> Tensor:
    """The fused attention output, differentiable in q, k, v and both biases."""
    if torch.compiler.is_compiling():
        out, _ = attention_fwd(q, k, v, mask_bias, pair_bias, scale)
    else:
        out, _ = _EagerAttention.apply(q, k, v, mask_bias, pair_bias, scale)
    return out


@torch.compiler.assume_constant_result
def _extension_error() -> str:
    """'' when the kernels are built (building them on first call), else why not."""
    return _build.load_error() or ""


def kernel_family(device: Optional[torch.device] = None) -> str:
    """The kernels the cutlass backend runs on ``device`` (default: the current CUDA device), forward
    and backward alike: ``"sm90"`` (the Hopper wgmma kernels: a 9.0 GPU and ``EVOFORMER_BLOCKS_KERNELS``
    unset or ``auto``) or ``"sm80"`` (the portable kernels; ``EVOFORMER_BLOCKS_KERNELS=sm80`` forces
    them). The variable is read on every forward and every backward call. Builds the kernels on first
    use."""
    index = torch.device(device if device is not None else "cuda").index
    return _kernels().kernel_family(torch.cuda.current_device() if index is None else index)


class CutlassBackend(Backend):
    name = "cutlass"
    capabilities = Capabilities(
        dtypes=LOW_PRECISION,
        device_types=("cuda",),
        head_dim_multiple=8,
        max_head_dim=128,
        min_compute_capability=(8, 0),
        deterministic=True,
    )

    def extra_reasons(self, inputs: AttentionInputs) -> list[str]:
        reasons = []
        blocks = -(-max(inputs.len_q, inputs.len_k) // 64)
        if inputs.batch * inputs.rows * blocks >= 2**31:
            reasons.append(f"B * N * ceil(L / 64) = {inputs.batch * inputs.rows * blocks} must be below 2^31 (grid size)")
        if inputs.heads > 65535:
            reasons.append(f"H = {inputs.heads} exceeds 65535")
        return reasons

    def not_supported_reasons(self, inputs: AttentionInputs) -> list[str]:
        reasons = super().not_supported_reasons(inputs)
        # Only inputs the kernels could run are worth a (first-use) build of the extension.
        if not reasons:
            error = _extension_error()
            if error:
                reasons.append(error)
        return reasons

    def forward(self, inputs: AttentionInputs, chunk_size: Optional[int]) -> Tensor:
        return attention(inputs.q, inputs.k, inputs.v, inputs.mask_bias, inputs.pair_bias, inputs.scale)


register(CutlassBackend(), auto_priority=10)
