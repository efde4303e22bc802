"""Backend selection: the one place where the op decides which implementation runs.

A backend states what it supports as data (:class:`Capabilities`) and answers
``not_supported_reasons(inputs)``. The setting is one name: ``"auto"``, ``"eager"`` or
``"cutlass"``, taken from (first that is set) the op's ``backend=`` argument, the innermost
``with backend(...)`` block, :func:`set_backend`, the ``EVOFORMER_BLOCKS_BACKEND`` environment
variable, else ``"auto"``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from ._inputs import AttentionInputs, describe

logger = logging.getLogger("evoformer_blocks")

ENV_VAR = "EVOFORMER_BLOCKS_BACKEND"
AUTO = "auto"


@dataclass(frozen=True)
class Capabilities:
    """What a backend can run, as data."""

    dtypes: tuple[torch.dtype, ...]
    device_types: tuple[str, ...]  # e.g. ("cuda",); () means any device
    head_dim_multiple: int = 1
    max_head_dim: Optional[int] = None
    min_compute_capability: Optional[tuple[int, int]] = None
    deterministic: bool = True


@torch.compiler.assume_constant_result
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


class Backend:
    """Base class of the attention backends."""

    name: str = ""
    capabilities: Capabilities

    def not_supported_reasons(self, inputs: AttentionInputs) -> list[str]:
        """Reasons this backend cannot run ``inputs``; empty when it can."""
        caps = self.capabilities
        reasons = []
        if caps.device_types and inputs.device.type not in caps.device_types:
            reasons.append(f"device type {inputs.device.type!r} is not one of {list(caps.device_types)}")
        if inputs.dtype not in caps.dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in caps.dtypes)
            reasons.append(f"dtype {inputs.dtype} is not supported (supported: {names})")
        d = inputs.head_dim
        if d % caps.head_dim_multiple:
            reasons.append(f"head dim D={d} is not a multiple of {caps.head_dim_multiple}")
        if caps.max_head_dim is not None and d > caps.max_head_dim:
            reasons.append(f"head dim D={d} exceeds the maximum {caps.max_head_dim}")
        if caps.min_compute_capability is not None and inputs.device.type == "cuda":
            cc = _capability(inputs.device.index or 0)
            if cc < caps.min_compute_capability:
                want = "%d.%d" % caps.min_compute_capability
                reasons.append(f"compute capability {cc[0]}.{cc[1]} is below {want}")
        return reasons + self.extra_reasons(inputs)

    def extra_reasons(self, inputs: AttentionInputs) -> list[str]:
        """Backend-specific reasons beyond the capability table (e.g. the build failed)."""
        return []

    def forward(self, inputs: AttentionInputs, chunk_size: Optional[int]) -> torch.Tensor:
        raise NotImplementedError


_REGISTRY: dict[str, Backend] = {}
_AUTO_ORDER: list[str] = []  # most preferred first
_default: Optional[str] = None
_context_stack: list[str] = []
_logged: set[str] = set()


_PRIORITY: dict[str, int] = {}


def register(backend_impl: Backend, auto_priority: int) -> None:
    """Adds a backend; ``auto`` tries backends in increasing ``auto_priority``."""
    _REGISTRY[backend_impl.name] = backend_impl
    _PRIORITY[backend_impl.name] = auto_priority
    _AUTO_ORDER[:] = sorted(_REGISTRY, key=_PRIORITY.__getitem__)


def backend_names() -> list[str]:
    return [AUTO] + list(_AUTO_ORDER)


def get_backend(name: str) -> Backend:
    _check_name(name, "name")
    if name == AUTO:
        raise ValueError(f"name: {AUTO!r} is a selection rule, not a backend; choose one of {list(_AUTO_ORDER)}")
    return _REGISTRY[name]


def _check_name(name, argument: str) -> str:
    if not isinstance(name, str) or (name != AUTO and name not in _REGISTRY):
        raise ValueError(f"{argument}: unknown backend {name!r}; choose one of {backend_names()}")
    return name


def set_backend(name: Optional[str]) -> None:
    """Sets the process-wide default backend (``None`` returns to the environment/auto default)."""
    global _default
    _default = None if name is None else _check_name(name, "set_backend")


def get_default_backend() -> str:
    """The backend name in effect when the op's ``backend=`` argument is None."""
    if _context_stack:
        return _context_stack[-1]
    if _default is not None:
        return _default
    env = os.environ.get(ENV_VAR)
    if env:
        return _check_name(env.strip().lower(), f"environment variable {ENV_VAR}")
    return AUTO


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """``with backend("eager"): ...`` selects a backend for the calls inside the block."""
    _context_stack.append(_check_name(name, "backend"))
    try:
        yield
    finally:
        _context_stack.pop()


def _log_once(message: str, level: int) -> None:
    # Logging is skipped while torch.compile traces, so selection never breaks a graph.
    if message in _logged or torch.compiler.is_compiling():
        return
    _logged.add(message)
    logger.log(level, message)


def select(inputs: AttentionInputs, requested: Optional[str]) -> Backend:
    """Returns the backend that will run ``inputs``.

    A named backend that cannot run raises ``ValueError`` with its reasons; ``auto`` takes the first
    backend with no reasons and logs once why the ones before it were skipped.
    """
    name = get_default_backend() if requested is None else _check_name(requested, "backend")
    if name != AUTO:
        impl = _REGISTRY[name]
        reasons = impl.not_supported_reasons(inputs)
        if reasons:
            raise ValueError(
                f"evoformer_attention: backend {name!r} cannot run these inputs:\n  - "
                + "\n  - ".join(reasons)
                + f"\n{describe(inputs.tensors())}\nUse backend='auto' to fall back to 'eager'."
            )
        return impl
    skipped = []
    for candidate in _AUTO_ORDER:
        impl = _REGISTRY[candidate]
        reasons = impl.not_supported_reasons(inputs)
        if not reasons:
            if skipped:
                on_gpu = inputs.device.type == "cuda"
                _log_once(
                    f"evoformer_attention(auto): using {candidate!r}; skipped " + "; ".join(skipped),
                    logging.WARNING if on_gpu else logging.INFO,
                )
            return impl
        skipped.append(f"{candidate!r} because " + ", ".join(reasons))
    raise ValueError("evoformer_attention: no backend can run these inputs: " + "; ".join(skipped))
