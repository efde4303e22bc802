"""benchmarks/bench_attention.py's --baseline pairing on the CPU (eager backend on both sides): this
checkout's attention against a revision's on the same inputs gives the same output and gradients bit
for bit, plain and gated, and the comparison reports a difference where there is one."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_attention  # noqa: E402

BASELINE_SCRIPT = r"""
import sys
sys.path.insert(0, "benchmarks")
import torch
import bench_attention as ba
for pair in (True, False):
    shape = ba.Shape("tiny", rows=3, length=8, heads=2, head_dim=8, pair=pair)
    for gated in (False, True):
        calls, leaves = ba.baseline_calls(shape, "HEAD", gated=gated, backend="eager", device="cpu",
                                          dtype=torch.float32)
        assert len(leaves) == (1 if gated else 3) + pair, (gated, pair, len(leaves))
        if gated:
            assert leaves[0].shape == (1, 3, 8, 4 * 2 * 8), leaves[0].shape
        assert ba.baseline_bitwise(calls, leaves), (gated, pair)
print("ok")
"""


def test_baseline_calls_give_the_same_results(run_beside_baseline):
    """Both sides of --baseline against this checkout's own commit (eager on the CPU): the revision's
    op on the same inputs, plain and gated, with and without a pair bias, bitwise equal."""
    run_beside_baseline(BASELINE_SCRIPT)


def test_baseline_bitwise_reports_a_difference():
    """The check compares the output and every gradient: a side that differs in the output's last
    bits, or only in a gradient, is reported."""
    x = torch.randn(4, 5, dtype=torch.float64)
    same = {"ours": lambda: x * 2, "baseline": lambda: x + x}
    assert bench_attention.baseline_bitwise(same, [x])
    nudged = {"ours": lambda: x * 2, "baseline": lambda: x * 2 * (1 + 2**-40)}
    assert not bench_attention.baseline_bitwise(nudged, [x])
    # equal outputs, different gradients: x * 2 against (2 x) with a detached half
    grads_differ = {"ours": lambda: x * 2, "baseline": lambda: x + x.detach()}
    assert not bench_attention.baseline_bitwise(grads_differ, [x])
