"""The public functional attention ops (``evoformer_attention``; ``gated_evoformer_attention``, the
gated attention of a stacked projection) and the DeepSpeed-compatible entry point."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import _dispatch
from ._inputs import AttentionInputs, describe, gated_output_view, validate, validate_gated
from .gating import GATE_OP, GateInputs, sigmoid_gate, validate_gate

OP = _dispatch.ATTENTION_OP


class _NoKeysOrQueries(torch.autograd.Function):
    """The op's result when B, N, Lq or Lk is 0: zeros of q's shape, with zero gradients of each
    input's shape. With Lk = 0 a query has no key, so it gets the output of a query whose keys are
    all masked with -inf: zero."""

    @staticmethod
    def forward(ctx, q, k, v, mask_bias, pair_bias):
        # Shapes only: nothing is read back, so later in-place edits of the inputs are fine.
        ctx.inputs = [None if t is None else (t.shape, t.dtype, t.device) for t in (q, k, v, mask_bias, pair_bias)]
        return q.new_zeros(q.shape)  # [B, N, Lq, H, D], contiguous like every backend's output

    @staticmethod
    def backward(ctx, dout):
        return tuple(
            None if like is None or not needed else torch.zeros(like[0], dtype=like[1], device=like[2])
            for like, needed in zip(ctx.inputs, ctx.needs_input_grad)
        )


def _empty_result(inputs: AttentionInputs) -> torch.Tensor:
    return _NoKeysOrQueries.apply(inputs.q, inputs.k, inputs.v, inputs.mask_bias, inputs.pair_bias)


def evoformer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask_bias: Optional[torch.Tensor] = None,
    pair_bias: Optional[torch.Tensor] = None,
    *,
    scale: Optional[float] = None,
    backend: Optional[str] = None,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """Evoformer attention with a per-key mask bias and a per-head pair bias.

    Dimensions::

        B  batch                      N  rows that share the pair bias (MSA sequences, pair rows)
        Lq query length               Lk key length (Lq == Lk in every Evoformer attention)
        H  heads                      D  head dim (``c_hidden``, per head)

    Arguments:
        q: ``[B, N, Lq, H, D]``; k, v: ``[B, N, Lk, H, D]``.
        mask_bias: ``[B, N, 1, 1, Lk]`` additive bias, broadcast over heads and queries (typically
            ``inf * (mask - 1)``). Size-1 B or N broadcast. Optional.
        pair_bias: ``[B, 1, H, Lq, Lk]`` additive bias, broadcast over N. Size-1 B or H broadcast.
            Optional.
        scale: multiplies q·kᵀ; defaults to ``1 / sqrt(D)``.
        backend: ``"auto"``, ``"eager"`` or ``"cutlass"``; None takes the default
            (:func:`evoformer_blocks.ops.set_backend`, the ``backend(...)`` context manager or the
            ``EVOFORMER_BLOCKS_BACKEND`` environment variable, else ``"auto"``).
        chunk_size: eager backend only: process this many queries at a time to bound memory at
            inference. The fused backend never materializes the logits and ignores it.

    Returns:
        ``[B, N, Lq, H, D]`` in q's dtype::

            o[b, n, i, h] = sum_j softmax_j(scale * q[b, n, i, h]·k[b, n, j, h]
                                            + mask_bias[b, n, 0, 0, j] + pair_bias[b, 0, h, i, j])
                                  * v[b, n, j, h]

    Empty inputs: B, N, Lq and Lk may be 0 (H and D may not). Then no backend runs: the result is
    zeros (with Lk = 0 a query has no keys, as if all were masked with ``-inf``), and the
    gradients of q, k, v and the biases are zeros of their shapes.

    Dtypes: q, k, v share one dtype (float16, bfloat16, float32 or float64; the fused backend takes
    float16, bfloat16 and float32, the last on the TF32 tensor cores); each bias is q's dtype or
    float32. Softmax and bias additions run in float32 for half-precision inputs. A query whose keys
    are all ``-inf`` gets a zero output and zero gradients; with a finite mask value such as ``-1e9``
    it averages v uniformly, as the math says. Gradients flow to q, k, v and to each bias that requires grad.

    Equivalent PyTorch code (what the eager backend computes, up to the -inf rule)::

        logits = torch.einsum("bnihd,bnjhd->bnhij", q, k).float() * scale
        logits = logits + mask_bias.float() + pair_bias.float()    # [B, N, H, Lq, Lk]
        probs = torch.softmax(logits, dim=-1).to(v.dtype)
        out = torch.einsum("bnhij,bnjhd->bnihd", probs, v)

    Raises:
        ValueError: an argument breaks a rule above (the message names it and shows every
            tensor's shape, dtype, device and stride), or the requested backend cannot run the
            inputs (the message lists why).
    """
    inputs = validate(q, k, v, mask_bias, pair_bias, scale)
    _check_chunk_size("evoformer_attention", chunk_size, inputs)
    if inputs.is_empty:
        _dispatch.REGISTRY.resolve(OP, backend)  # an unknown name still raises
        return _empty_result(inputs)
    impl = _dispatch.select(OP, inputs, backend)
    return impl.forward(inputs, chunk_size)


def _check_chunk_size(op: str, chunk_size, inputs: AttentionInputs) -> None:
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
        raise ValueError(
            f"{op}: invalid `chunk_size`: must be a positive int or None, got {chunk_size!r}\n"
            + describe(inputs.tensors())
        )


def gated_evoformer_attention(
    qkvg: torch.Tensor,
    heads: int,
    mask_bias: Optional[torch.Tensor] = None,
    pair_bias: Optional[torch.Tensor] = None,
    *,
    transposed: bool = False,
    scale: Optional[float] = None,
    backend: Optional[str] = None,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """The gated attention of AF2's attention modules from one stacked projection:
    ``sigmoid(g) * evoformer_attention(q, k, v, mask_bias, pair_bias)``.

    Arguments:
        qkvg: ``[B, A, A', 4 * H * D]``, the projections q, k, v and g side by side in the last
            dim (one GEMM's output, as the modules compute it). Row ``a`` of dim 1 attends over its
            ``A'`` positions along dim 2: q, k, v are seen as ``[B, N=A, L=A', H, D]``. With
            ``transposed=True`` attention runs along dim 1 instead (``[B, N=A', L=A, H, D]``: MSA
            column attention and the ending-node triangle attention on their input's own layout).
        heads: H.
        mask_bias, pair_bias, scale, backend, chunk_size: as :func:`evoformer_attention`, in the
            attention's orientation (``mask_bias [B|1, N|1, 1, 1, L]``, ``pair_bias
            [B|1, 1, H|1, L, L]``).

    Returns:
        ``[B, A, A', H * D]`` in qkvg's dtype, contiguous: ``sigmoid(g)`` times the attention output
        seen in qkvg's layout.

    Where the cutlass backend runs both the attention and the gate, they run as one autograd node
    whose backward writes the gradients of q, k, v and g straight into one ``[B, A, A', 4 * H * D]``
    tensor, the gradient of ``qkvg`` (the projection's backward then reads it as one matrix, with no
    concatenation, also under torch.compile); otherwise the attention and :func:`sigmoid_gate` run
    on the views, each on its selected backend. Results are the same either way.

    Raises:
        ValueError: an argument breaks a rule (see :func:`evoformer_attention`; ``qkvg`` must be a
            floating tensor of rank 4 whose last dim is a multiple of ``4 * heads``), or the
            requested backend cannot run the inputs.
    """
    inputs, g = validate_gated(qkvg, heads, mask_bias, pair_bias, scale, transposed)
    _check_chunk_size("gated_evoformer_attention", chunk_size, inputs)
    if inputs.is_empty:
        _dispatch.REGISTRY.resolve(OP, backend)  # an unknown name still raises
        return sigmoid_gate(g, gated_output_view(_empty_result(inputs), transposed), backend=backend)
    impl = _dispatch.select(OP, inputs, backend)
    gate = _dispatch.select(GATE_OP, validate_gate(g, g), backend)  # (selection reads g's shape, dtype, device)
    fused = getattr(impl, "gated_forward", None)
    if fused is not None and gate.name == impl.name:
        return fused(inputs, qkvg, heads, transposed)
    o = impl.forward(inputs, chunk_size)  # [B, N, L, H, D]
    return gate.forward(GateInputs(g, gated_output_view(o, transposed)), None)  # [B, A, A', H * D]


def DS4Sci_EvoformerAttention(
    Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, biases: Sequence[Optional[torch.Tensor]]
) -> torch.Tensor:
    """Drop-in replacement for ``deepspeed.ops.deepspeed4science.DS4Sci_EvoformerAttention``.

    ``Q, K, V``: ``[B, N, L, H, D]``; ``biases``: a list of at most two tensors,
    ``[mask_bias [B, N, 1, 1, L]]`` or ``[mask_bias, pair_bias [B, 1, H, L, L]]`` (or empty).
    Scale is ``1/sqrt(D)``. The caller's list is never modified. Runs on the default backend.
    """
    if not isinstance(biases, (list, tuple)):
        raise ValueError(
            f"DS4Sci_EvoformerAttention: invalid `biases`: must be a list of at most two tensors, "
            f"got {type(biases).__name__}"
        )
    if len(biases) > 2:
        raise ValueError(
            f"DS4Sci_EvoformerAttention: invalid `biases`: at most two biases ([mask_bias, pair_bias]), "
            f"got {len(biases)}"
        )
    mask_bias = biases[0] if len(biases) > 0 else None
    pair_bias = biases[1] if len(biases) > 1 else None
    return evoformer_attention(Q, K, V, mask_bias, pair_bias)
