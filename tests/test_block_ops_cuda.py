"""The fused (cutlass) layer-norm and triangle-multiplication ops against float64 references, with
the same-dtype eager backend as the bar: error(fused) <= RATIO * error(eager) + FLOOR, errors as
||x - ref|| / ||ref||; NaN never passes. GPU only (skipped without one)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("EVOFORMER_BLOCKS_POISON", "1")

import evoformer_blocks as eb  # noqa: E402
from evoformer_blocks import ops  # noqa: E402
from gpu import requires_sm80  # noqa: E402
from test_block_ops import triangle_weights  # noqa: E402

pytestmark = requires_sm80

RATIO = 2.0
FLOOR = {torch.bfloat16: 2e-4, torch.float16: 5e-5, torch.float32: 1e-6}
DEV = "cuda"


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def check(name: str, fused: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    e_fused, e_eager = rel_error(fused, ref), rel_error(eager, ref)
    assert math.isfinite(e_fused), f"{name}: fused result is not finite"
    assert e_fused <= RATIO * e_eager + FLOOR[dtype], f"{name}: fused error {e_fused:.2e} vs eager {e_eager:.2e}"


def run_with_grads(fn, leaves, dout):
    out = fn()
    return [out.detach()] + [g.detach() for g in torch.autograd.grad(out, leaves, dout.to(out.dtype))]


# ---- layer norm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 8), (7, 64), (3, 37, 128), (1000, 256), (5, 1024)])
@pytest.mark.parametrize("params", ["affine", "none", "float32 affine"])
def test_layer_norm_matches_reference(dtype, shape, params):
    c = shape[-1]
    if c * torch.finfo(dtype).bits // 8 > 2048:
        pytest.skip("wider than the kernel's rows: the op routes it to eager")
    x = (torch.randn(shape, device=DEV) * 2 + 0.5).to(dtype).requires_grad_(True)
    pdtype = torch.float32 if params == "float32 affine" else dtype
    w = b = None
    if params != "none":
        w = (1 + 0.5 * torch.randn(c, device=DEV)).to(pdtype).requires_grad_(True)
        b = torch.randn(c, device=DEV).to(pdtype).requires_grad_(True)
    leaves = [t for t in (x, w, b) if t is not None]
    dout = torch.randn(shape, device=DEV)
    fused = run_with_grads(lambda: ops.layer_norm(x, w, b, backend="cutlass"), leaves, dout)
    eager = run_with_grads(lambda: ops.layer_norm(x, w, b, backend="eager"), leaves, dout)
    x64 = x.double()
    w64, b64 = (None if w is None else w.double()), (None if b is None else b.double())
    ref = run_with_grads(lambda: F.layer_norm(x64, (c,), w64, b64, 1e-5), leaves, dout)
    for name, f, e, r in zip(("out", "dx", "dw", "db"), fused, eager, ref):
        check(name, f, e, r, dtype)


def test_layer_norm_strided_rows_and_determinism():
    base = torch.randn(64, 3, 256, device=DEV, dtype=torch.bfloat16)
    x = base[:, 1, :128].requires_grad_(True)  # [64, 128] with row stride 768
    w = torch.randn(128, device=DEV, requires_grad=True)
    dout = torch.randn(64, 128, device=DEV)
    runs = [run_with_grads(lambda: ops.layer_norm(x, w, None, backend="cutlass"), [x, w], dout) for _ in range(2)]
    ref = F.layer_norm(x.detach().float(), (128,), w.detach(), None).to(torch.bfloat16)
    torch.testing.assert_close(runs[0][0], ref, atol=2e-2, rtol=2e-2)
    for a, b in zip(*runs):
        assert torch.equal(a, b), "the fused layer norm must be bitwise reproducible"


# ---- triangle multiplication ---------------------------------------------------------------------


def _triangle(z, mask, w, direction, backend):
    return ops.triangle_multiplication(z, mask, direction=direction, **w, backend=backend)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
@pytest.mark.parametrize("batch, n, c_z, c", [((), 1, 32, 16), ((), 7, 32, 16), ((2,), 37, 64, 32), ((), 100, 128, 128),
                                              ((), 257, 128, 64)])
def test_triangle_matches_reference(dtype, direction, batch, n, c_z, c):
    z = torch.randn(*batch, n, n, c_z, device=DEV).to(dtype).requires_grad_(True)
    mask = (torch.rand(*batch, n, n, device=DEV) > 0.2).to(dtype)
    if n > 4:
        mask[..., 1, :] = 0  # a fully masked row and column
        mask[..., :, 3] = 0
    w = {k: v.to(DEV).detach().requires_grad_(True) for k, v in triangle_weights(c_z, c, dtype, scale=0.2).items()}
    # float16 gradients of weights summed over N^2 positions overflow with unit cotangents
    dout = torch.randn(*batch, n, n, c_z, device=DEV) * (1e-3 if dtype == torch.float16 else 1.0)
    leaves = [z, *w.values()]
    fused = run_with_grads(lambda: _triangle(z, mask, w, direction, "cutlass"), leaves, dout)
    eager = run_with_grads(lambda: _triangle(z, mask, w, direction, "eager"), leaves, dout)
    w64 = {k: v.double() for k, v in w.items()}
    ref = run_with_grads(lambda: _triangle(z.double(), mask.double(), w64, direction, "eager"), leaves, dout)
    for name, f, e, r in zip(["out", "dz", *w], fused, eager, ref):
        check(name, f, e, r, dtype)


@pytest.mark.slow
def test_triangle_long_crop():
    n, c_z, c = 1000, 128, 128
    z = torch.randn(n, n, c_z, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    mask = (torch.rand(n, n, device=DEV) > 0.05).to(torch.bfloat16)
    w = {k: v.to(DEV).detach().requires_grad_(True) for k, v in triangle_weights(c_z, c, torch.bfloat16, scale=0.2).items()}
    dout = torch.randn(n, n, c_z, device=DEV)
    leaves = [z, *w.values()]
    fused = run_with_grads(lambda: _triangle(z, mask, w, "incoming", "cutlass"), leaves, dout)
    eager = run_with_grads(lambda: _triangle(z, mask, w, "incoming", "eager"), leaves, dout)
    ref = run_with_grads(lambda: _triangle(z.float(), mask.float(), {k: v.float() for k, v in w.items()}, "incoming",
                                           "eager"), leaves, dout)
    for name, f, e, r in zip(["out", "dz", *w], fused, eager, ref):
        check(name, f, e, r, torch.bfloat16)


def test_triangle_gradients_are_deterministic():
    z = torch.randn(2, 33, 33, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = {k: v.to(DEV).detach().requires_grad_(True) for k, v in triangle_weights(64, 32, torch.bfloat16).items()}
    dout = torch.randn_like(z)
    runs = [run_with_grads(lambda: _triangle(z, None, w, "outgoing", "cutlass"), [z, *w.values()], dout)
            for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b), "the fused triangle update must be bitwise reproducible"


def test_triangle_custom_ops_pass_opcheck():
    from evoformer_blocks.ops import triangle as tri

    z = torch.randn(1, 9, 9, 32, device=DEV, dtype=torch.bfloat16)
    mask = (torch.rand(1, 9, 9, device=DEV) > 0.2).to(torch.bfloat16)
    w = triangle_weights(32, 16, torch.bfloat16)
    weights = [w[name].to(DEV) for name in tri._WEIGHTS]
    torch.library.opcheck(tri.triangle_fwd, (z, mask, weights, 1e-5, True), test_utils=("test_schema", "test_faketensor"))
    x = torch.randn(5, 7, 64, device=DEV, dtype=torch.bfloat16)
    from evoformer_blocks.ops import normalization as ln

    torch.library.opcheck(ln.layer_norm_fwd, (x, None, None, 1e-5), test_utils=("test_schema", "test_faketensor"))


def test_block_modules_compile_fullgraph():
    torch._dynamo.reset()
    module = eb.TriangleMultiplicationIncoming(32, 16).to(DEV, torch.bfloat16)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    z = torch.randn(2, 12, 12, 32, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    mask = torch.ones(2, 12, 12, device=DEV)
    expected = module(z, mask)
    (g_expected,) = torch.autograd.grad(expected.float().sum(), z)
    compiled = torch.compile(module, fullgraph=True)
    out = compiled(z, mask)
    (g,) = torch.autograd.grad(out.float().sum(), z)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(g, g_expected, atol=5e-2, rtol=5e-2)
