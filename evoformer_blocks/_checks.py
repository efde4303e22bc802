"""Small argument checks and helpers shared by the Evoformer modules (private).

Every check raises ``ValueError`` naming the argument, so a wrong call says what was wrong.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch

from .primitives import check_positive_int


def check_rate(owner: str, name: str, value) -> float:
    """A dropout rate: a number in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{owner}: `{name}` must be a number in [0, 1), got {value!r}")
    return float(value)


def check_positive_number(owner: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < float("inf"):
        raise ValueError(f"{owner}: `{name}` must be a positive finite number, got {value!r}")
    return float(value)


def check_optional_positive_int(owner: str, name: str, value) -> None:
    if value is not None:
        check_positive_int(owner, **{name: value})


def as_mask(owner: str, argument: str, mask, like: torch.Tensor, legend: str) -> torch.Tensor:
    """``mask`` (None: all ones) of shape ``like.shape[:-1]`` as a 0/1 tensor of ``like``'s dtype
    and device (a float, int or bool mask is accepted)."""
    expected = tuple(like.shape[:-1])
    if mask is None:
        return like.new_ones(expected)
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{owner}: `{argument}` must be a torch.Tensor {legend} or None, got {type(mask).__name__}")
    if tuple(mask.shape) != expected:
        raise ValueError(f"{owner}: `{argument}` must have shape {legend} = {list(expected)}, got {list(mask.shape)}")
    return mask.to(dtype=like.dtype, device=like.device)


def chunked(fn: Callable[..., torch.Tensor], inputs: dict, no_batch_dims: int, chunk_size: Optional[int]):
    """Runs ``fn(**inputs)`` on at most ``chunk_size`` rows at a time and concatenates the results.

    The first ``no_batch_dims`` dims of every input (broadcast to one shape) are flattened into rows;
    ``fn`` must treat rows independently. The output keeps the inputs' leading dims.
    """
    lead = torch.broadcast_shapes(*(t.shape[:no_batch_dims] for t in inputs.values()))
    rows = 1
    for size in lead:
        rows *= size
    if chunk_size is None or chunk_size >= rows:
        return fn(**inputs)
    flat = {
        k: t.expand(*lead, *t.shape[no_batch_dims:]).reshape(rows, *t.shape[no_batch_dims:])  # [rows, ...]
        for k, t in inputs.items()
    }
    parts = [
        fn(**{k: t[start : start + chunk_size] for k, t in flat.items()}) for start in range(0, rows, chunk_size)
    ]
    out = torch.cat(parts, dim=0)  # [rows, ...]
    return out.reshape(*lead, *out.shape[1:])  # [*lead, ...]


def _as_dict(owner: str, cfg: Any) -> dict:
    import ml_collections  # imported here: only configs need them, not the modules
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, ml_collections.ConfigDict):
        return cfg.to_dict()
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    if isinstance(cfg, Mapping):
        return dict(cfg)
    raise ValueError(f"{owner}.from_config: `cfg` must be a ConfigDict, DictConfig or mapping, got {type(cfg).__name__}")


def build_from_config(cls, cfg: Any, section: str, overrides: dict):
    """``cls(**arguments)`` from a config: a mapping (``ConfigDict``, ``DictConfig``, dict) of the
    constructor's arguments, or a whole preset that holds them under ``section``; ``overrides``
    win over the config. Unknown or missing arguments raise ``ValueError`` naming them."""
    owner = cls.__name__
    arguments = _as_dict(owner, cfg)
    if section in arguments:
        arguments = _as_dict(owner, arguments[section])
    arguments.update(overrides)
    params = inspect.signature(cls.__init__).parameters
    accepted = [p for p in params if p != "self"]
    unknown = sorted(set(arguments) - set(accepted))
    if unknown:
        raise ValueError(f"{owner}.from_config: `cfg` has unknown keys {unknown}; accepted: {accepted}")
    missing = [p for p in accepted if params[p].default is inspect.Parameter.empty and p not in arguments]
    if missing:
        raise ValueError(f"{owner}.from_config: `cfg` lacks the required keys {missing}")
    return cls(**arguments)
