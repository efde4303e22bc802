"""Shared test fixtures: per-dtype tolerances, seeding, backend isolation, recording backends, an
independent float64 reference of the attention op and a subprocess beside a baseline revision's
library. Nothing here needs a GPU."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

from evoformer_blocks.ops import _dispatch
from evoformer_blocks.ops.eager import eager_attention

# One tolerance per dtype for comparing a computation against a float64 reference of the same
# inputs. float64 differs only by summation order; float32 by single-precision rounding of O(1)
# values; bfloat16/float16 by rounding q·kᵀ, the probabilities and p·v to 8/11 mantissa bits.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float64: {"atol": 1e-10, "rtol": 1e-8},
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
}


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return dict(TOLERANCES[dtype])


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: Optional[torch.dtype] = None, msg: str = ""):
    """``actual`` (any dtype) against ``expected`` with the tolerance of ``dtype`` (default: actual's)."""
    tol = _tolerance(dtype or actual.dtype)
    torch.testing.assert_close(
        actual.to(torch.float64), expected.to(torch.float64), **tol, msg=lambda m: f"{msg}\n{m}" if msg else m
    )


@pytest.fixture
def tolerance():
    """``tolerance(dtype)`` -> ``{"atol": ..., "rtol": ...}`` from :data:`TOLERANCES`."""
    return _tolerance


@pytest.fixture
def assert_close():
    """``assert_close(actual, expected, dtype=None)``: compare with the dtype's tolerance."""
    return _assert_close


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _isolated_backends():
    """What a test does to the backend registry (backends registered, ``set_backend``, ``with
    ops.backend(...)`` blocks, messages logged once) does not leak into the next test."""
    with _dispatch.REGISTRY.isolated():
        yield


def _reference_attention(q, k, v, mask_bias=None, pair_bias=None, scale=None) -> torch.Tensor:
    """The op's formula in float64 with einsum, written independently of the backends.

    q: [B, N, Lq, H, D]; k, v: [B, N, Lk, H, D]; biases broadcast to [B, N, H, Lq, Lk]. Returns
    [B, N, Lq, H, D] in float64. Finite biases only (a row of -inf gives NaN here).
    """
    q, k, v = (t.detach().to(torch.float64) for t in (q, k, v))
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    logits = torch.einsum("bnihd,bnjhd->bnhij", q, k) * scale
    if mask_bias is not None:
        logits = logits + mask_bias.detach().to(torch.float64).permute(0, 1, 3, 2, 4)  # [B, N, 1, 1, Lk]
    if pair_bias is not None:
        logits = logits + pair_bias.detach().to(torch.float64)  # [B, 1, H, Lq, Lk]
    weights = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return torch.einsum("bnhij,bnjhd->bnihd", weights, v)


@pytest.fixture
def reference_attention():
    """``reference_attention(q, k, v, mask_bias=None, pair_bias=None, scale=None)`` in float64."""
    return _reference_attention


class RecordingBackend(_dispatch.Backend):
    """A test backend of the attention op that computes like eager and records every call; it can
    refuse inputs, and its capabilities can say it is not deterministic."""

    op = _dispatch.ATTENTION_OP

    def __init__(self, name: str, calls: list, refuse: Optional[str] = None, deterministic: bool = True) -> None:
        self.name = name
        self.capabilities = _dispatch.Capabilities(
            dtypes=(torch.float32, torch.float64), device_types=(), deterministic=deterministic
        )
        self.calls = calls
        self.refuse = refuse
        self.seen: list = []  # the AttentionInputs of every call

    def extra_reasons(self, inputs) -> list[str]:
        return [self.refuse] if self.refuse else []

    def forward(self, inputs, chunk_size):
        self.calls.append(self.name)
        self.seen.append(inputs)
        return eager_attention(inputs, chunk_size)


class BlockOpSpy(_dispatch.Backend):
    """A test backend of another op (layer norm, triangle multiplication) under a spy's name: it
    computes like that op's eager backend and appends the op's name to ``calls``, so that modules
    built with a spy backend run every op of theirs."""

    capabilities = _dispatch.Capabilities(dtypes=(torch.float32, torch.float64), device_types=())

    def __init__(self, op: str, name: str, calls: list) -> None:
        self.op, self.name, self.calls = op, name, calls
        self.eager = _dispatch.get_backend("eager", op)

    def forward(self, inputs, chunk_size):
        self.calls.append(self.op)
        return self.eager.forward(inputs, chunk_size)


@pytest.fixture
def recording_backends():
    """Registers backends ``"spy_a"`` and ``"spy_b"`` of the attention op (tried after the real ones
    by ``auto``) for the test's duration, and :class:`BlockOpSpy` under the same names for the
    other ops.

    Yields ``(calls, backends)``: the list of backend names in call order (attention only) and a
    dict name -> :class:`RecordingBackend` (set ``.refuse`` to a reason to make one refuse); the
    other ops' calls are in ``backends["spy_a"].block_calls``, by op name.
    """
    calls: list[str] = []
    backends = {name: RecordingBackend(name, calls) for name in ("spy_a", "spy_b")}
    for priority, impl in enumerate(backends.values(), start=1000):
        _dispatch.register(impl, auto_priority=priority)
        impl.block_calls = []
        for op in _dispatch.REGISTRY.ops():
            if op != _dispatch.ATTENTION_OP:
                _dispatch.register(BlockOpSpy(op, impl.name, impl.block_calls), auto_priority=priority)
    yield calls, backends


@pytest.fixture
def run_beside_baseline(tmp_path):
    """``run(script)``: ``script`` in a new Python process from the repository's root, the folder of
    benchmarks/baseline.py's prepared revisions in ``tmp_path`` (a process holds one baseline
    revision); asserts that it exited cleanly with "ok" as its last output. Skips without a git
    checkout (a revision is made from the repository's history)."""
    repo = Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or not (repo / ".git").exists():
        pytest.skip("needs a git checkout of the repository")
    env = dict(os.environ, EVOFORMER_BLOCKS_BASELINE_DIR=str(tmp_path), PYTHONPATH=str(repo))

    def run(script: str) -> None:
        done = subprocess.run([sys.executable, "-c", script], cwd=repo, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]

    return run
