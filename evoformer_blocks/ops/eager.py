"""The eager backend: exact attention in plain PyTorch, on any device and any float dtype."""

from __future__ import annotations

from typing import Optional

import torch

from . import _keep
from ._dispatch import ATTENTION_OP, Backend, Capabilities, register
from ._inputs import FLOAT_DTYPES, AttentionInputs, compute_dtype


def safe_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim in which a row whose entries are all -inf gives zeros, not NaN.

    For every other row this is the ordinary softmax: the row maximum contributes exp(0) = 1 to
    the denominator, so clamping the denominator at 1 changes nothing there.
    """
    row_max = logits.detach().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(logits.dtype).min)
    e = torch.exp(logits - row_max)
    return e / e.sum(dim=-1, keepdim=True).clamp_min(1.0)


def _attend(qh, kh, vh, mask_bias, pair_bias, scale: float, compute: torch.dtype) -> torch.Tensor:
    # qh: [B, N, H, Lq, D]; kh, vh: [B, N, H, Lk, D]. (_keep.product: a stack's recompute policy
    # may keep the two products.)
    logits = _keep.product(_keep.ATTENTION, torch.matmul, qh, kh.transpose(-1, -2))  # [B, N, H, Lq, Lk]
    logits = logits.to(compute) * scale
    if mask_bias is not None:
        logits = logits + mask_bias.to(compute)  # + [B|1, N|1, 1, 1, Lk]
    if pair_bias is not None:
        logits = logits + pair_bias.to(compute)  # + [B|1, 1, H|1, Lq, Lk]
    probs = safe_softmax(logits)  # [B, N, H, Lq, Lk]
    return _keep.product(_keep.ATTENTION, torch.matmul, probs.to(vh.dtype), vh)  # [B, N, H, Lq, D]


def eager_attention(inputs: AttentionInputs, chunk_size: Optional[int] = None) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask_bias + pair_bias)·v; returns [B, N, Lq, H, D] in q's dtype.

    The products q·kᵀ and p·v run in the input dtype; scaling, biases and softmax run in float32
    for float16/bfloat16 inputs (in the input dtype otherwise). With ``chunk_size`` the queries are
    processed ``chunk_size`` at a time, so at most [B, N, H, chunk_size, Lk] logits exist at once.
    """
    compute = compute_dtype(inputs.dtype)
    qh = inputs.q.transpose(-2, -3)  # [B, N, H, Lq, D]
    kh = inputs.k.transpose(-2, -3)  # [B, N, H, Lk, D]
    vh = inputs.v.transpose(-2, -3)  # [B, N, H, Lk, D]
    mask_bias, pair_bias = inputs.mask_bias, inputs.pair_bias
    if chunk_size is None or chunk_size >= inputs.len_q:
        out = _attend(qh, kh, vh, mask_bias, pair_bias, inputs.scale, compute)
    else:
        parts = []
        for start in range(0, inputs.len_q, chunk_size):
            stop = min(start + chunk_size, inputs.len_q)
            pair_chunk = None if pair_bias is None else pair_bias[..., start:stop, :]  # [B|1, 1, H|1, c, Lk]
            parts.append(_attend(qh[..., start:stop, :], kh, vh, mask_bias, pair_chunk, inputs.scale, compute))
        out = torch.cat(parts, dim=-2)  # [B, N, H, Lq, D]
    return out.transpose(-2, -3).contiguous()  # [B, N, Lq, H, D]


class EagerBackend(Backend):
    op = ATTENTION_OP
    name = "eager"
    capabilities = Capabilities(dtypes=FLOAT_DTYPES, device_types=(), deterministic=True)

    def forward(self, inputs: AttentionInputs, chunk_size: Optional[int]) -> torch.Tensor:
        return eager_attention(inputs, chunk_size)


register(EagerBackend(), auto_priority=100)
