"""The argument checks of the Evoformer modules (private): the one place where they live.

Every check raises ``ValueError`` naming the module, the argument and the rule it breaks, so a
wrong call says what was wrong. (The attention op checks its own inputs in ``ops/_inputs.py``.)
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .ops._dispatch import backend_names


def check_backend(owner: str, backend) -> None:
    """``backend`` must be None (the global setting) or a backend name of the ops."""
    if backend is not None and (not isinstance(backend, str) or backend not in backend_names()):
        raise ValueError(f"{owner}: unknown `backend` {backend!r}; choose one of {backend_names()} or None")


def check_positive_int(owner: str, **values) -> None:
    """Raises ``ValueError`` naming the first keyword argument that is not a positive int."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}: `{name}` must be a positive int, got {value!r}")


def check_optional_positive_int(owner: str, name: str, value) -> None:
    if value is not None:
        check_positive_int(owner, **{name: value})


def check_bool(owner: str, name: str, value) -> bool:
    """``value`` if it is a bool; else ``ValueError`` naming ``name`` (a flag of a module's structure:
    a 0 or a string would be read as one silently)."""
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: `{name}` must be a bool, got {value!r}")
    return value


def check_rate(owner: str, name: str, value) -> float:
    """A dropout rate: a number in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{owner}: `{name}` must be a number in [0, 1), got {value!r}")
    return float(value)


def check_positive_number(owner: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < float("inf"):
        raise ValueError(f"{owner}: `{name}` must be a positive finite number, got {value!r}")
    return float(value)


def check_tensor(
    owner: str,
    argument: str,
    value,
    shape: Sequence[Optional[int]],
    legend: str,
    exact: bool = False,
    weights: Optional[torch.Tensor] = None,
) -> None:
    """Raises ``ValueError`` unless ``value`` is a floating tensor whose shape ends with ``shape``
    (and, given the module's ``weights``, is like them: :func:`check_like_weights`).

    ``shape`` lists the trailing dimensions, ``None`` where any size is fine; with ``exact`` it is
    the whole shape (batch dims included). ``legend`` spells the expected shape for the message,
    e.g. ``"[*, N_seq, N_res, c_m=64]"``.
    """
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{owner}: `{argument}` must be a torch.Tensor {legend}, got {type(value).__name__}")
    if not value.dtype.is_floating_point:
        raise ValueError(f"{owner}: `{argument}` must be a floating-point tensor, got {value.dtype}")
    ok = (value.dim() == len(shape) if exact else value.dim() >= len(shape)) and all(
        want is None or got == want for got, want in zip(value.shape[value.dim() - len(shape):], shape)
    )
    if not ok:
        raise ValueError(f"{owner}: `{argument}` must have shape {legend}, got {list(value.shape)}")
    if weights is not None:
        check_like_weights(owner, argument, value, weights)


# What torch.autocast casts (its matmuls take these in any mix); float64 it leaves as it is.
AUTOCAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_like_weights(owner: str, argument: str, value: torch.Tensor, weight: torch.Tensor) -> None:
    """Raises ``ValueError`` unless the checked tensor ``value`` is on the device of the module's
    weights (``weight``: a projection weight, whose dtype the module's matmuls need) and has their
    dtype. Under ``torch.autocast`` for ``value``'s device float16, bfloat16 and float32 mix freely
    (autocast casts them); float64 must still match. Reads metadata only: no tensor op, no sync."""
    if value.device == weight.device and (
        value.dtype == weight.dtype
        or (value.dtype in AUTOCAST_DTYPES and weight.dtype in AUTOCAST_DTYPES
            and torch.is_autocast_enabled(value.device.type))
    ):
        return
    if value.device != weight.device:
        rule = (
            f"inputs must be on the device of the module's weights; move one, e.g. "
            f"`{argument}.to('{weight.device}')` or module.to('{value.device}')"
        )
    else:
        when = "under torch.autocast, which casts float16, bfloat16 and float32 but not float64," if (
            torch.is_autocast_enabled(value.device.type)
        ) else "outside torch.autocast"
        rule = (
            f"{when} inputs must have the dtype of the module's weights; convert one, e.g. "
            f"`{argument}.to({weight.dtype})` or module.to({value.dtype})"
        )
    raise ValueError(
        f"{owner}: `{argument}` is {value.dtype} on {value.device}, the module's weights are {weight.dtype} on "
        f"{weight.device}: {rule}"
    )


def _check_mask_shape(owner: str, argument: str, mask, like: torch.Tensor, legend: str) -> None:
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{owner}: `{argument}` must be a torch.Tensor {legend} or None, got {type(mask).__name__}")
    expected = list(like.shape[:-1])
    if list(mask.shape) != expected:
        raise ValueError(f"{owner}: `{argument}` must have shape {legend} = {expected}, got {list(mask.shape)}")


def check_mask(owner: str, argument: str, mask, like: torch.Tensor, legend: str) -> None:
    """Raises ``ValueError`` unless ``mask`` is a tensor of shape ``like.shape[:-1]`` on ``like``'s
    device (any dtype: float, int or bool 0/1)."""
    _check_mask_shape(owner, argument, mask, like, legend)
    if mask.device != like.device:
        raise ValueError(f"{owner}: `{argument}` must be on the input's device {like.device}, got {mask.device}")


def as_mask(owner: str, argument: str, mask, like: torch.Tensor, legend: str) -> torch.Tensor:
    """``mask`` (None: all ones) of shape ``like.shape[:-1]`` as a 0/1 tensor of ``like``'s dtype
    and device (a float, int or bool mask on any device is accepted)."""
    if mask is None:
        return like.new_ones(like.shape[:-1])
    _check_mask_shape(owner, argument, mask, like, legend)
    return mask.to(dtype=like.dtype, device=like.device)
