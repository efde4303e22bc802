"""Validation of the attention ops' inputs: the one place where user input is checked.

Every rule raises ``ValueError`` naming the argument, the rule, and the shape, dtype, device and
stride of every tensor involved, so a caller can see at once what was passed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
LOW_PRECISION = (torch.float16, torch.bfloat16)


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: ``t`` itself when it has that dtype already (``Tensor.to`` would return it
    too, after a round trip through the dispatcher that backward passes make about a hundred times)."""
    return t if t.dtype == dtype else t.to(dtype)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of softmax, biases, masks and reductions: float32 for float16/bfloat16, else ``dtype``."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


class ValidatedInputs:
    """Base of an op's validated inputs (a frozen dataclass whose first field is the op's primary
    tensor): ``dtype`` and ``device`` are that tensor's, and ``tensors()`` (what error messages and
    backends read) names every field that holds a tensor or None."""

    @property
    def dtype(self) -> torch.dtype:
        return self._primary().dtype

    @property
    def device(self) -> torch.device:
        return self._primary().device

    def _primary(self) -> torch.Tensor:
        # the first field (read on every op call: the dataclass's field dict, not fields())
        return getattr(self, next(iter(self.__dataclass_fields__)))

    def tensors(self) -> dict[str, Optional[torch.Tensor]]:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: t for name, t in values.items() if t is None or isinstance(t, torch.Tensor)}

    def selection_key(self) -> tuple:
        """Everything backend selection may read: each tensor's shape, dtype and device (also of
        the tensors in a dict field) and every other field's value. Backends decide from these alone
        (:class:`~evoformer_blocks.ops._dispatch.Backend`), so selection keeps its answer per key."""
        return tuple(metadata(getattr(self, name)) for name in self.__dataclass_fields__)


def metadata(value):
    """What selection may read of an argument, as a key: a tensor's shape, dtype and device (those of
    each tensor in a dict), any other value itself."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.device)
    if isinstance(value, dict):
        return tuple((name, metadata(v)) for name, v in value.items())
    return value


@dataclass(frozen=True)
class AttentionInputs(ValidatedInputs):
    """Validated inputs of ``evoformer_attention``.

    Dimension legend: B batch, N rows sharing the pair bias (MSA sequences or pair rows), Lq/Lk
    query/key length, H heads, D head dim (``c_hidden``).
    """

    q: torch.Tensor  # [B, N, Lq, H, D]
    k: torch.Tensor  # [B, N, Lk, H, D]
    v: torch.Tensor  # [B, N, Lk, H, D]
    mask_bias: Optional[torch.Tensor]  # [B|1, N|1, 1, 1, Lk]
    pair_bias: Optional[torch.Tensor]  # [B|1, 1, H|1, Lq, Lk]
    scale: float

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def rows(self) -> int:
        return self.q.shape[1]

    @property
    def len_q(self) -> int:
        return self.q.shape[2]

    @property
    def len_k(self) -> int:
        return self.k.shape[2]

    @property
    def heads(self) -> int:
        return self.q.shape[3]

    @property
    def head_dim(self) -> int:
        return self.q.shape[4]

    @property
    def is_empty(self) -> bool:
        """B, N, Lq or Lk is 0: the output is all zeros and no backend runs."""
        return min(self.batch, self.rows, self.len_q, self.len_k) == 0


def describe(tensors: dict[str, Optional[torch.Tensor]]) -> str:
    """One line per argument: shape, dtype, device and stride (or what it is if not a tensor)."""
    lines = []
    for name, t in tensors.items():
        if t is None:
            lines.append(f"  {name}: None")
        elif isinstance(t, torch.Tensor):
            lines.append(
                f"  {name}: shape={tuple(t.shape)} dtype={t.dtype} device={t.device} stride={tuple(t.stride())}"
            )
        else:
            lines.append(f"  {name}: {type(t).__name__} (not a torch.Tensor)")
    return "\n".join(lines)


def _fail(argument: str, rule: str, tensors: dict) -> None:
    raise ValueError(f"evoformer_attention: invalid `{argument}`: {rule}\n{describe(tensors)}")


def _key_value_shape_error(q: torch.Size, k: torch.Size, v: torch.Size) -> tuple[str, str]:
    """(argument, rule) for k and v whose shapes do not fit q's: q is the reference, so k (then v) is
    named for a B, N, H or D other than q's, and v for a key length other than k's."""
    for name, shape in (("k", k), ("v", v)):
        wrong = [f"{dim}={shape[i]} (q's {dim}={q[i]})" for dim, i in zip("BNHD", (0, 1, 3, 4)) if shape[i] != q[i]]
        if wrong:
            return name, f"must be [B, N, Lk, H, D] with q's B, N, H and D, got {', '.join(wrong)}"
    return "v", f"must have k's key length Lk={k[2]}, got Lk={v[2]}"


def validate(q, k, v, mask_bias=None, pair_bias=None, scale=None) -> AttentionInputs:
    """Checks the op's arguments and returns them as :class:`AttentionInputs`.

    Rules: q, k, v are floating tensors of rank 5 on one device with one dtype; q is
    ``[B, N, Lq, H, D]`` and k, v are ``[B, N, Lk, H, D]`` with H, D >= 1 (B, N, Lq and Lk may be
    0); ``mask_bias`` is ``[B|1, N|1, 1, 1, Lk]``
    and ``pair_bias`` is ``[B|1, 1, H|1, Lq, Lk]`` (size-1 dimensions broadcast); each bias is a
    floating tensor of q's dtype or float32 on q's device; ``scale`` is a positive finite number.
    """
    tensors = {"q": q, "k": k, "v": v, "mask_bias": mask_bias, "pair_bias": pair_bias}
    for name in ("q", "k", "v"):
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            _fail(name, "must be a torch.Tensor", tensors)
        if t.dim() != 5:
            _fail(name, f"must have rank 5 [B, N, L, H, D], got rank {t.dim()}", tensors)
        if t.dtype not in FLOAT_DTYPES:
            _fail(name, f"must be float16, bfloat16, float32 or float64, got {t.dtype}", tensors)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        _fail("k" if k.dtype != q.dtype else "v", "q, k and v must share one dtype", tensors)
    if k.device != q.device or v.device != q.device:
        _fail("k" if k.device != q.device else "v", "q, k and v must be on one device", tensors)
    batch, rows, len_q, heads, head_dim = q.shape
    if k.shape != v.shape or (k.shape[0], k.shape[1], k.shape[3], k.shape[4]) != (batch, rows, heads, head_dim):
        _fail(*_key_value_shape_error(q.shape, k.shape, v.shape), tensors)
    len_k = k.shape[2]
    if heads < 1 or head_dim < 1:
        _fail("q", "H and D must be at least 1 (B, N, Lq and Lk may be 0)", tensors)

    def check_bias(name: str, t, expected: tuple, broadcastable: tuple) -> None:
        if t is None:
            return
        if not isinstance(t, torch.Tensor):
            _fail(name, "must be a torch.Tensor or None", tensors)
        if t.dtype == torch.bool or not t.dtype.is_floating_point:
            _fail(
                name,
                f"must be an additive floating-point bias, got {t.dtype}; convert a 0/1 mask with "
                "`inf * (mask.to(q.dtype) - 1)`",
                tensors,
            )
        if t.dtype not in (q.dtype, torch.float32):
            _fail(name, f"dtype must be q's dtype ({q.dtype}) or torch.float32, got {t.dtype}", tensors)
        if t.device != q.device:
            _fail(name, f"must be on q's device ({q.device}), got {t.device}", tensors)
        shape = tuple(t.shape)
        ok = len(shape) == 5 and all(
            s == e or (s == 1 and b) for s, e, b in zip(shape, expected, broadcastable)
        )
        if not ok:
            pretty = ", ".join(
                f"{e}|1" if b and e != 1 else str(e) for e, b in zip(expected, broadcastable)
            )
            _fail(name, f"must have shape [{pretty}] (size-1 dimensions broadcast), got {list(shape)}", tensors)

    # mask bias [B|1, N|1, 1, 1, Lk]: one value per key, broadcast over heads and queries.
    check_bias("mask_bias", mask_bias, (batch, rows, 1, 1, len_k), (True, True, False, False, False))
    # pair bias [B|1, 1, H|1, Lq, Lk]: one value per (head, query, key), broadcast over N.
    check_bias("pair_bias", pair_bias, (batch, 1, heads, len_q, len_k), (True, False, True, False, False))

    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(scale, torch.Tensor) or not isinstance(scale, (int, float)) or isinstance(scale, bool):
        _fail("scale", f"must be a Python number or None, got {type(scale).__name__}", tensors)
    elif not (math.isfinite(scale) and scale > 0):
        _fail("scale", f"must be positive and finite, got {scale}", tensors)
    return AttentionInputs(q, k, v, mask_bias, pair_bias, float(scale))


def gated_views(qkvg: torch.Tensor, heads: int, transposed: bool):
    """The four column blocks of a stacked projection ``qkvg [B, A, A', 4 * H * D]`` as views:
    q, k, v ``[B, N, L, H, D]`` in the attention's orientation (N = A, L = A'; with ``transposed``
    N = A', L = A, so attention runs along dim 1) and the gate g ``[B, A, A', H * D]``."""
    *lead, width = qkvg.shape
    head_dim = width // (4 * heads)
    # Few view ops (each op call costs host time on every module call, forward and backward): one
    # view splitting the last dim, one transpose of all four blocks at once, one unbind.
    blocks = qkvg.view(*lead, 4, heads, head_dim)  # [B, A, A', 4, H, D]
    if transposed:
        blocks = blocks.transpose(1, 2)  # [B, A', A, 4, H, D]
    q, k, v, _ = blocks.unbind(3)  # [B, N, L, H, D] each
    g = qkvg[..., 3 * heads * head_dim :]  # [B, A, A', H * D]
    return q, k, v, g


def gated_output_view(out: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The attention output ``[B, N, L, H, D]`` seen in the stacked projection's layout
    ``[B, A, A', H * D]`` (a view; the inverse orientation of :func:`gated_views`)."""
    return (out.transpose(1, 2) if transposed else out).flatten(-2)


def validate_gated(qkvg, heads, mask_bias=None, pair_bias=None, scale=None, transposed=False):
    """Checks ``gated_evoformer_attention``'s arguments; returns the attention's validated inputs
    (q, k, v as views of ``qkvg``, see :func:`gated_views`) and the gate g.

    Rules: ``qkvg`` is a float16, bfloat16, float32 or float64 tensor ``[B, A, A', 4 * H * D]``
    with D >= 1 for H = ``heads`` (a positive int); ``transposed`` is a bool; the biases and
    ``scale`` as :func:`validate` says, in the attention's orientation.
    """
    tensors = {"qkvg": qkvg, "mask_bias": mask_bias, "pair_bias": pair_bias}

    def fail(argument: str, rule: str) -> None:
        raise ValueError(f"gated_evoformer_attention: invalid `{argument}`: {rule}\n{describe(tensors)}")

    if not isinstance(qkvg, torch.Tensor) or qkvg.dtype not in FLOAT_DTYPES:
        fail("qkvg", "must be a float16, bfloat16, float32 or float64 torch.Tensor [B, A, A', 4 * H * D]")
    if qkvg.dim() != 4:
        fail("qkvg", f"must have rank 4 [B, A, A', 4 * H * D], got rank {qkvg.dim()}")
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        fail("heads", f"must be a positive int, got {heads!r}")
    if qkvg.shape[-1] == 0 or qkvg.shape[-1] % (4 * heads):
        fail("qkvg", f"its last dim must be 4 * H * D with H = heads = {heads} and D >= 1, got {qkvg.shape[-1]}")
    if not isinstance(transposed, bool):
        fail("transposed", f"must be a bool, got {type(transposed).__name__}")
    q, k, v, g = gated_views(qkvg, heads, transposed)
    return validate(q, k, v, mask_bias, pair_bias, scale), g
