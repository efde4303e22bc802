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
from evoformer_blocks.ops import _fused, cutlass  # noqa: E402
from gpu import kernel_family, requires_sm80  # noqa: E402,F401 (kernel_family: a fixture)
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
@pytest.mark.parametrize("params", ["affine", "none", "float32 affine", "float32 weight"])
def test_layer_norm_matches_reference(dtype, shape, params):
    c = shape[-1]
    if c * torch.finfo(dtype).bits // 8 > 2048:
        pytest.skip("wider than the kernel's rows: the op routes it to eager")
    x = (torch.randn(shape, device=DEV) * 2 + 0.5).to(dtype).requires_grad_(True)
    pdtype = torch.float32 if params == "float32 affine" else dtype
    w = b = None
    if params != "none":  # "float32 weight": the weight float32, the bias in x's dtype
        w = (1 + 0.5 * torch.randn(c, device=DEV)).to(pdtype if params != "float32 weight" else torch.float32)
        w.requires_grad_(True)
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 8), (3, 37, 128), (1000, 256)])
@pytest.mark.parametrize("params", ["affine", "none", "float32 weight"])
def test_layer_norm_keeping_input_matches_reference(dtype, shape, params):
    # x used twice (passed on and normalised): one node whose backward adds the passed-on gradient in
    # the layer norm's pass; x's gradient (the sum of both) and every other one against float64 with
    # the 2x rule, the outputs x itself (a view of it) and the layer norm op's bits
    c = shape[-1]
    x = (torch.randn(shape, device=DEV) * 2 + 0.5).to(dtype).requires_grad_(True)
    w = b = None
    if params != "none":
        w = (1 + 0.5 * torch.randn(c, device=DEV)).to(torch.float32 if params == "float32 weight" else dtype)
        b = torch.randn(c, device=DEV).to(dtype)
        w.requires_grad_(params != "frozen")
        b.requires_grad_(params != "frozen")
    leaves = [t for t in (x, w, b) if t is not None]
    d_kept, dy = torch.randn(shape, device=DEV).to(dtype), torch.randn(shape, device=DEV).to(dtype)

    def run(backend):
        kept, y = ops.layer_norm_keeping_input(x, w, b, backend=backend)
        return [kept.detach(), y.detach(), *torch.autograd.grad((kept, y), leaves, (d_kept, dy))]

    fused, eager = run("cutlass"), run("eager")
    assert fused[0].data_ptr() == x.data_ptr() and torch.equal(fused[0], x)
    assert torch.equal(fused[1], ops.layer_norm(x, w, b, backend="cutlass"))
    x64 = x.detach().double().requires_grad_(True)
    ref_leaves = [x64] + [t.detach().double().requires_grad_(True) for t in leaves[1:]]
    w64, b64 = (ref_leaves[1], ref_leaves[2]) if w is not None else (None, None)
    y64 = F.layer_norm(x64, (c,), w64, b64, 1e-5)
    ref = [x64.detach(), y64.detach(), *torch.autograd.grad((x64, y64), ref_leaves, (d_kept.double(), dy.double()))]
    for name, f, e, r in zip(("kept", "y", "dx", "dw", "db"), fused, eager, ref):
        check(name, f, e, r, dtype)
    # only the layer norm's gradient (the passed-on x unused) and only the passed-on one
    for outputs, grads in (((1,), (dy,)), ((0,), (d_kept,))):
        kept, y = ops.layer_norm_keeping_input(x, w, b, backend="cutlass")
        got = torch.autograd.grad([(kept, y)[i] for i in outputs], x, grads)[0]
        kept, y = ops.layer_norm_keeping_input(x, w, b, backend="eager")
        want = torch.autograd.grad([(kept, y)[i] for i in outputs], x, grads)[0]
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 8), (7, 64), (3, 37, 128), (1000, 256), (5, 1024)])
@pytest.mark.parametrize("params", ["affine", "none", "float32 weight"])
@pytest.mark.parametrize("scale", ["none", "mask", "random", "dropout rows", "dropout columns", "strided"])
def test_add_layer_norm_matches_reference(dtype, shape, params, scale):
    # the residual add in the layer norm's kernel: s is x + residual (* residual_scale) as torch
    # rounds it, bit for bit; y and every gradient (x and an unscaled residual share theirs; a random
    # scale gets its own) against float64 with the 2x rule. Scales: a 0/1 row mask [*, 1], random
    # values per row (requiring grad), dropout keep-masks shared along the rows ([1, *, C] broadcast
    # over dim 0) or along dim -2 ([*, 1, C]), and a per-element scale read through a strided view.
    _check_add_layer_norm(dtype, shape, params, scale, residual_bias=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(7, 64), (3, 37, 128), (1000, 256), (5, 1024)])
@pytest.mark.parametrize("scale", ["none", "mask", "random", "dropout columns"])
@pytest.mark.parametrize("params", ["affine", "frozen"])
def test_add_layer_norm_residual_bias_matches_reference(dtype, shape, scale, params):
    # the residual's bias added in the same pass: s = x + (residual + residual_bias) (* scale) as torch
    # rounds it, bit for bit; the bias's gradient (the residual's summed over rows, in the backward's
    # pass) with the others against float64 with the 2x rule; "frozen": the layer norm's weight and
    # bias want no gradient, the residual's bias still does (its sums alone)
    _check_add_layer_norm(dtype, shape, params, scale, residual_bias=True)


def _check_add_layer_norm(dtype, shape, params, scale, residual_bias):
    c = shape[-1]
    if c * torch.finfo(dtype).bits // 8 > 2048:
        pytest.skip("wider than the kernel's rows: the op routes it to eager")
    x = (torch.randn(shape, device=DEV) * 2 + 0.5).to(dtype).requires_grad_(True)
    r = torch.randn(shape, device=DEV).to(dtype).requires_grad_(True)
    w = b = sc = rb = None
    if params != "none":
        w = (1 + 0.5 * torch.randn(c, device=DEV)).to(torch.float32 if params == "float32 weight" else dtype)
        b = torch.randn(c, device=DEV).to(dtype)
        w.requires_grad_(params != "frozen")
        b.requires_grad_(params != "frozen")
    if residual_bias:
        rb = (torch.randn(c, device=DEV) * 0.5).to(dtype).requires_grad_(True)
    if scale == "mask":  # a 0/1 row mask with a fully masked row
        sc = (torch.rand(*shape[:-1], 1, device=DEV) > 0.3).to(dtype)
        sc.view(-1)[0] = 0
    elif scale == "random":
        sc = (torch.randn(*shape[:-1], 1, device=DEV) * 1.5).to(dtype).requires_grad_(True)
    elif scale.startswith("dropout"):  # 0 or 1 / (1 - p), as SharedDropout draws it
        keep_shape = [1, *shape[1:]] if scale == "dropout rows" else [*shape[:-2], 1, c] if len(shape) > 2 else [1, c]
        sc = torch.nn.functional.dropout(torch.ones(keep_shape, device=DEV, dtype=dtype), p=0.25, training=True)
    elif scale == "strided":  # every value its own, read from a view with padded rows
        sc = (torch.randn(*shape[:-1], c + 8, device=DEV) + 1).to(dtype)[..., :c]
    leaves = ([t for t in (x, r, w, b) if t is not None and t.requires_grad] + ([sc] if scale == "random" else [])
              + ([rb] if residual_bias else []))
    ds, dy = torch.randn(shape, device=DEV), torch.randn(shape, device=DEV)

    def run(fn, leaves):
        s, y = fn()
        return [s.detach(), y.detach(), *torch.autograd.grad((s, y), leaves, (ds.to(s.dtype), dy.to(y.dtype)))]

    def op(backend):
        return lambda: ops.add_layer_norm(x, r, w, b, residual_scale=sc, residual_bias=rb, backend=backend)

    fused, eager = run(op("cutlass"), leaves), run(op("eager"), leaves)
    assert torch.equal(fused[0], eager[0]), "s must be x + (residual + bias) (* scale) as torch rounds it"
    if scale == "mask":  # a masked row's residual gets no gradient, as from the multiply
        assert not fused[3].view(-1, c)[0].any()
    l64 = [t.detach().double().requires_grad_(True) for t in leaves]
    x64, r64 = l64[0], l64[1]
    w64, b64 = (l64[2], l64[3]) if w is not None and w.requires_grad else (None, None)
    if w is not None and not w.requires_grad:
        w64, b64 = w.double(), b.double()

    def update64():  # the residual as the op rounds it: with its bias added (rounded) first
        return r64 if rb is None else (r64 + l64[-1]).to(dtype).double()

    if scale == "none":
        s64 = lambda: x64 + update64()  # noqa: E731
    elif scale == "random":
        s64 = lambda: x64 + (update64() * l64[len(leaves) - 1 - residual_bias]).to(dtype).double()  # noqa: E731
    else:
        s64 = lambda: x64 + (update64() * sc.double()).to(dtype).double()  # noqa: E731
    # the reference normalises the rounded sum, as both backends do
    ref = run(lambda: (s64(), F.layer_norm(s64().to(dtype).double(), (c,), w64, b64, 1e-5)), l64)
    names = (["y", "dx", "dresidual"] + (["dw", "db"] if w is not None and w.requires_grad else [])
             + (["dscale"] if scale == "random" else [])
             + (["dresidual_bias"] if residual_bias else []))
    assert len(names) == len(fused) - 1
    for name, f, e, rf in zip(names, fused[1:], eager[1:], ref[1:]):
        check(name, f, e, rf, dtype)
    runs = [run(op("cutlass"), leaves) for _ in range(2)]
    for a, b_ in zip(*runs):
        assert torch.equal(a, b_), "the fused add + layer norm must be bitwise reproducible"


# ---- triangle multiplication ---------------------------------------------------------------------


def _triangle(z, mask, w, direction, backend):
    return ops.triangle_multiplication(z, mask, direction=direction, **w, backend=backend)


def _kernel_names(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA}


# On Hopper, c_z = c = 128 with N_res^2 % 8 == 0 runs the kernel with the weights resident on a
# persistent grid; other widths, or rows that cannot be stored 16 bytes at a time, the tiled one.
@pytest.mark.parametrize("n, c_z, c, hopper_kernel", [(20, 64, 32, "triangle_input_sm90_kernel"),
                                                      (24, 128, 128, "triangle_input_sm90_resident_kernel"),
                                                      (21, 128, 128, "triangle_input_sm90_kernel"),
                                                      (24, 128, 64, "triangle_input_sm90_kernel")])
def test_triangle_runs_the_input_kernel_of_its_family(n, c_z, c, hopper_kernel, kernel_family):
    z = torch.randn(n, n, c_z, device=DEV, dtype=torch.bfloat16)
    w = {k: v.to(DEV) for k, v in triangle_weights(c_z, c, torch.bfloat16).items()}
    names = _kernel_names(lambda: _triangle(z, None, w, "outgoing", "cutlass"))
    hopper = [name for name in names if "triangle_input_sm90" in name]
    portable = [name for name in names if "triangle_input_kernel" in name]
    if cutlass.kernel_family() == "sm90":
        assert hopper and not portable, names
        assert all(f"{hopper_kernel}<" in name for name in hopper), names
    else:
        assert portable and not hopper, names


# The backward's edge gates run a group of channels at a time (all of them while the group's
# temporaries stay small, else half): on Hopper a group of 32 or 64 at c_z = 128 with 16-byte rows
# (N_res 300 at c = 128 or 32) runs triangle_gate_backward_sm90_kernel, a persistent grid with one
# bias_part row per CTA; c = 128 at N_res 100 (one group of 128) and N_res 257 (rows not a multiple of
# 8 positions) the portable kernel. Its gradients are bitwise repeatable.
@pytest.mark.parametrize("n, c, hopper", [(300, 128, True), (300, 32, True), (100, 128, False), (257, 64, False)])
def test_triangle_backward_runs_the_gate_kernel_of_its_family(n, c, hopper, kernel_family):
    z = torch.randn(n, n, 128, device=DEV, dtype=torch.bfloat16).requires_grad_(True)
    mask = (torch.rand(n, n, device=DEV) > 0.2).to(torch.bfloat16)
    w = {k: v.to(DEV).detach().requires_grad_(True)
         for k, v in triangle_weights(128, c, torch.bfloat16, scale=0.2).items()}
    dout = torch.randn(n, n, 128, device=DEV, dtype=torch.bfloat16)
    leaves = [z, *w.values()]
    grads = []

    def step():
        out = _triangle(z, mask, w, "incoming", "cutlass")
        grads.append(torch.autograd.grad(out, leaves, dout))

    names = _kernel_names(step)
    step()
    sm90 = [name for name in names if "triangle_gate_backward_sm90_kernel" in name]
    portable = [name for name in names if "triangle_gate_backward_kernel" in name]
    if cutlass.kernel_family() == "sm90" and hopper:
        assert sm90 and not portable, names
    else:
        assert portable and not sm90, names
    for a, b in zip(*grads):
        assert torch.equal(a, b), "the fused backward must be bitwise reproducible"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
# The fused kernels have a variant without bounds checks where channels and columns fill their
# tiles and N_res^2 % 8 == 0 (the Hopper input kernel: c % 32 == 0, c_z in {64, 128, 256}; the output
# kernel, both families: c in {64, 128}, c_z == 128): N_res 100, 300, 48 and 40 run it (48: the c_z
# 64 bucket of the input kernel; 40: the c 64 bucket of the output kernel), the others the checked
# kernels. On Hopper N_res 100 and 300 run the input kernel with resident weights (c_z = c = 128), the
# last of their 64-position tiles partial, 300 with more tiles than its persistent grid's warpgroups;
# 300 (c 128 and 32) also runs the Hopper gate backward (groups of 64 and 32 channels).
@pytest.mark.parametrize("batch, n, c_z, c", [((), 1, 32, 16), ((), 7, 32, 16), ((2,), 37, 64, 32), ((), 100, 128, 128),
                                              ((), 257, 128, 64), ((), 19, 136, 72), ((), 9, 264, 24),
                                              ((2,), 23, 48, 40), ((), 300, 128, 128), ((), 48, 64, 32),
                                              ((), 40, 128, 64), ((), 300, 128, 32)])
def test_triangle_matches_reference(dtype, direction, batch, n, c_z, c, kernel_family):
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
@pytest.mark.parametrize("batch, n, c_z, c", [((), 7, 32, 16), ((2,), 37, 64, 32), ((), 100, 128, 128)])
def test_triangle_keeping_input_adds_the_kept_gradient(dtype, direction, batch, n, c_z, c, kernel_family):
    # z used twice (kept and updated): the fused node adds the kept z's gradient in its last pass;
    # the update is the op's bit for bit, the kept z is z's memory, and dz and every weight's
    # gradient pass the 2x rule against float64 (the eager op with z used twice as the bar)
    z = torch.randn(*batch, n, n, c_z, device=DEV).to(dtype).requires_grad_(True)
    mask = (torch.rand(*batch, n, n, device=DEV) > 0.2).to(dtype)
    w = {k: v.to(DEV).detach().requires_grad_(True) for k, v in triangle_weights(c_z, c, dtype, scale=0.2).items()}
    scale = 1e-3 if dtype == torch.float16 else 1.0
    d_kept, dout = (torch.randn(*batch, n, n, c_z, device=DEV) * scale for _ in range(2))
    leaves = [z, *w.values()]

    def run(z_in, weights, backend):
        kept, out = ops.triangle_multiplication_keeping_input(z_in, mask.to(z_in.dtype), direction=direction,
                                                              backend=backend, **weights)
        grads = torch.autograd.grad((kept, out), [z_in, *weights.values()], (d_kept.to(z_in.dtype), dout.to(z_in.dtype)))
        return kept, [out.detach(), *grads]

    kept, fused = run(z, w, "cutlass")
    assert kept.data_ptr() == z.data_ptr() and torch.equal(kept, z)
    assert torch.equal(fused[0], _triangle(z, mask, w, direction, "cutlass"))
    _, eager = run(z, w, "eager")
    z64 = z.detach().double().requires_grad_(True)
    _, ref = run(z64, {k: v.detach().double().requires_grad_(True) for k, v in w.items()}, "eager")
    for name, f, e, r in zip(["out", "dz", *w], fused, eager, ref):
        check(name, f, e, r, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch, n, c_z, c, scaled", [((), 7, 32, 16, False), ((2,), 37, 64, 32, True),
                                                      ((), 100, 128, 128, True), ((), 19, 136, 72, True),
                                                      ((), 130, 128, 128, False)])
def test_triangle_residual_adds_the_update_to_z(dtype, batch, n, c_z, c, scaled, kernel_family):
    # z + update * scale (a row-wise dropout mask [*, 1, N, c_z]) from the op: the fused output kernel
    # adds z as it writes where c, c_z <= 128 (c_z 136: the unfused output half, then the add), with
    # and without gradients; the result and the gradients of z and every weight pass the 2x rule
    # against float64 (the eager op followed by the add as the bar)
    z = torch.randn(*batch, n, n, c_z, device=DEV).to(dtype).requires_grad_(True)
    mask = (torch.rand(*batch, n, n, device=DEV) > 0.2).to(dtype)
    w = {k: v.to(DEV).detach().requires_grad_(True) for k, v in triangle_weights(c_z, c, dtype, scale=0.2).items()}
    keep = ((torch.rand(*batch, 1, n, c_z, device=DEV) > 0.25).float() / 0.75).to(dtype) if scaled else None
    dout = torch.randn(*batch, n, n, c_z, device=DEV) * (1e-3 if dtype == torch.float16 else 1.0)
    leaves = [z, *w.values()]

    def run(z_in, weights, backend):
        scale = None if keep is None else keep.to(z_in.dtype)
        out = ops.triangle_multiplication_residual(z_in, mask.to(z_in.dtype), update_scale=scale,
                                                   direction="outgoing", backend=backend, **weights)
        return [out.detach(), *torch.autograd.grad(out, [z_in, *weights.values()], dout.to(z_in.dtype))]

    fused = run(z, w, "cutlass")
    with torch.no_grad():  # the forward without a backward adds z in the same kernel
        no_grad = ops.triangle_multiplication_residual(z, mask, update_scale=keep, direction="outgoing",
                                                       backend="cutlass", **w)
    assert torch.equal(no_grad, fused[0])
    eager = run(z, w, "eager")
    z64 = z.detach().double().requires_grad_(True)
    ref = run(z64, {k: v.detach().double().requires_grad_(True) for k, v in w.items()}, "eager")
    for name, f, e, r in zip(["out", "dz", *w], fused, eager, ref):
        check(name, f, e, r, dtype)


def _peak_bytes(fn):
    """(fn()'s result, the allocator's peak above what was allocated before the call)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
@pytest.mark.parametrize("batch, n, c_z, c", [((2,), 37, 128, 128), ((), 100, 128, 32), ((), 9, 48, 40),
                                              ((), 1, 32, 16), ((), 19, 136, 72)])
def test_triangle_forward_without_backward_equals_the_training_forward(dtype, direction, batch, n, c_z, c,
                                                                       kernel_family):
    # A forward no backward follows (its output kernel writes no n_hat where c, c_z <= 128; c_z 136
    # runs the unfused output half) gives the forward with autograd's output bit for bit, at M a
    # multiple of 128 or of 8 or neither, both buckets of c, c_z below 128, fully masked rows.
    z = torch.randn(*batch, n, n, c_z, device=DEV).to(dtype)
    mask = (torch.rand(*batch, n, n, device=DEV) > 0.2).to(dtype)
    if n > 4:
        mask[..., 1, :] = 0
    w = {k: v.to(DEV) for k, v in triangle_weights(c_z, c, dtype, scale=0.2).items()}
    with_grad = _triangle(z.clone().requires_grad_(True), mask, w, direction, "cutlass").detach()
    with torch.no_grad():
        out = _triangle(z, mask, w, direction, "cutlass")
    assert not out.isnan().any()
    assert torch.equal(out, with_grad)


@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
def test_triangle_forward_without_backward_skips_what_only_the_backward_reads(direction, kernel_family):
    # A forward no backward follows (no_grad, or nothing requiring grad) gives the output of the
    # forward with autograd bit for bit, and never allocates n_hat [M, c] (only the backward reads it).
    n, c_z, c = 256, 64, 64
    z = torch.randn(1, n, n, c_z, device=DEV, dtype=torch.bfloat16)
    mask = (torch.rand(1, n, n, device=DEV) > 0.2).to(torch.bfloat16)
    w = {k: v.to(DEV) for k, v in triangle_weights(c_z, c, torch.bfloat16, scale=0.2).items()}
    with_grad = _triangle(z.clone().requires_grad_(True), mask, w, direction, "cutlass").detach()
    with torch.no_grad():
        out, peak = _peak_bytes(lambda: _triangle(z, mask, w, direction, "cutlass"))
    assert torch.equal(out, with_grad)
    assert torch.equal(_triangle(z, mask, w, direction, "cutlass"), with_grad)  # nothing requires grad
    from evoformer_blocks.ops import triangle as tri

    weights = [w[name] for name in tri._WEIGHTS]
    family = cutlass.kernel_family(z.device)
    kernels = tri._fused.kernels()
    _, peak_kept = _peak_bytes(lambda: kernels.triangle_multiplication_fwd(z, mask, weights, 1e-5, direction == "outgoing",
                                                                          family)[0])
    _, peak_skipped = _peak_bytes(lambda: kernels.triangle_multiplication_fwd(z, mask, weights, 1e-5,
                                                                             direction == "outgoing", family, False)[0])
    n_hat_bytes = n * n * c * 2
    assert peak_kept - peak_skipped >= 0.9 * n_hat_bytes, (peak_kept, peak_skipped)
    assert peak <= peak_skipped + n_hat_bytes // 2, (peak, peak_skipped)


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


def test_triangle_gradients_are_deterministic(kernel_family):
    z = torch.randn(2, 33, 33, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = {k: v.to(DEV).detach().requires_grad_(True) for k, v in triangle_weights(64, 32, torch.bfloat16).items()}
    dout = torch.randn_like(z)
    runs = [run_with_grads(lambda: _triangle(z, None, w, "outgoing", "cutlass"), [z, *w.values()], dout)
            for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b), "the fused triangle update must be bitwise reproducible"


def test_block_ops_pass_opcheck():
    # the extension's triangle and layer-norm ops against their schemas and fake implementations
    # (shapes, strides and dtypes of the real outputs), traced as torch.compile traces them
    from evoformer_blocks.ops import triangle as tri

    kernels = _fused.kernels()
    z = torch.randn(1, 9, 9, 32, device=DEV, dtype=torch.bfloat16)
    mask = (torch.rand(1, 9, 9, device=DEV) > 0.2).to(torch.bfloat16)
    w = triangle_weights(32, 16, torch.bfloat16)
    weights = [w[name].to(DEV) for name in tri._WEIGHTS]
    scale = torch.rand(1, 1, 9, 32, device=DEV).to(z.dtype)
    for family in cutlass.available_kernel_families(torch.cuda.current_device()):
        for for_backward, add_input, update_scale in ((True, False, None), (False, False, None), (True, True, scale)):
            args = (z, mask, weights, 1e-5, True, family, for_backward, add_input, update_scale)
            torch.library.opcheck(kernels.triangle_multiplication_fwd.default, args)
        out, *saved = kernels.triangle_multiplication_fwd(z, mask, weights, 1e-5, False, family)
        for dz_add in (None, torch.randn_like(z)):
            torch.library.opcheck(kernels.triangle_multiplication_bwd.default,
                                  (torch.randn_like(out), z, mask, weights, saved, 1e-5, False, dz_add, family))
    with pytest.raises(RuntimeError, match="family"):
        kernels.triangle_multiplication_fwd(z, mask, weights, 1e-5, True, "sm70")
    with pytest.raises(RuntimeError, match="family"):
        kernels.triangle_multiplication_bwd(torch.randn_like(out), z, mask, weights, saved, 1e-5, False, None, "sm70")
    x = torch.randn(5, 7, 64, device=DEV, dtype=torch.bfloat16)
    weight, bias = torch.randn(64, device=DEV), torch.randn(64, device=DEV)
    torch.library.opcheck(kernels.layer_norm_fwd.default, (x, None, None, 1e-5))
    y, mean, rstd = kernels.layer_norm_fwd(x, weight, bias, 1e-5)
    for need_affine in (False, True):
        torch.library.opcheck(kernels.layer_norm_bwd.default,
                              (torch.randn_like(y), x, weight, mean, rstd, need_affine, torch.float32))
    for scale in (None, (torch.rand(5, 7, 1, device=DEV) > 0.5).to(x.dtype), torch.rand(7, 64, device=DEV).to(x.dtype)):
        torch.library.opcheck(kernels.add_layer_norm_fwd.default, (x, torch.randn_like(x), None, None, 1e-5, scale))
        s, y, mean, rstd = kernels.add_layer_norm_fwd(x, torch.randn_like(x), weight, bias, 1e-5, scale)
        torch.library.opcheck(kernels.add_layer_norm_bwd.default, (
            torch.randn_like(s), torch.randn_like(y), s, weight, mean, rstd, True, torch.float32, scale))
    # with the residual's bias: forward, and its gradient with and without the affine ones
    residual_bias = torch.randn(64, device=DEV).to(x.dtype)
    for scale in (None, (torch.rand(5, 7, 1, device=DEV) > 0.5).to(x.dtype)):
        args = (x, torch.randn_like(x), weight, bias, 1e-5, scale, residual_bias)
        torch.library.opcheck(kernels.add_layer_norm_fwd.default, args)
        s, y, mean, rstd = kernels.add_layer_norm_fwd(*args)
        for need_affine in (False, True):
            torch.library.opcheck(kernels.add_layer_norm_bwd.default, (
                torch.randn_like(s), torch.randn_like(y), s, weight, mean, rstd, need_affine, torch.float32, scale,
                torch.bfloat16))
    # the linear backward: with a ReLU's output, a stacked projection's bias from a column on, no bias
    x = torch.randn(6, 5, 32, device=DEV, dtype=torch.bfloat16)
    weight = torch.randn(64, 32, device=DEV)  # a float32 weight under bfloat16 activations
    relu_out = torch.relu(torch.randn(6, 5, 64, device=DEV, dtype=torch.bfloat16))
    for relu, wanted, bias_from in ((relu_out, (True, True, True), 0), (None, (True, False, True), 16),
                                    (None, (False, True, False), 0)):
        torch.library.opcheck(kernels.linear_bwd.default,
                              (torch.randn_like(relu_out), x, weight, relu, *wanted, torch.float32, bias_from))


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


# ---- sigmoid gate and linear ----------------------------------------------------------------------


def _gate_operands(layout: str, dtype, c: int):
    """(g, y) as the attention modules pass them: g a slice of a wider projection output; y the
    attention output [B, N, L, H, C'] seen as [B, A, B', H * C'] ('rows': A = N; 'transposed': A = L,
    a permuted view; 'copy': a contiguous tensor)."""
    b, n, length, heads = 2, 5, 7, 2
    wide = torch.randn(b, n, length, 4 * c, device=DEV).to(dtype)
    o = torch.randn(b, n, length, heads, c // heads, device=DEV).to(dtype)
    if layout == "transposed":
        wide = torch.randn(b, length, n, 4 * c, device=DEV).to(dtype)
        y = o.permute(0, 2, 1, 3, 4).flatten(-2)  # [B, L, N, H * C'], rows not in memory order
    elif layout == "rows":
        y = o.flatten(-2)
    else:
        y = o.flatten(-2).clone()
    g = wide[..., 3 * c:]
    return g.requires_grad_(False), y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["rows", "transposed", "copy"])
@pytest.mark.parametrize("c", [8, 64, 256])
def test_sigmoid_gate_matches_reference(dtype, layout, c):
    if c * torch.finfo(dtype).bits // 8 % 16:
        pytest.skip("not a whole number of 16-byte chunks: the op routes it to eager")
    g0, y0 = _gate_operands(layout, dtype, c)
    base = y0._base if y0._base is not None else y0
    g = g0.detach().requires_grad_(True)
    y_leaf = base.detach().requires_grad_(True)
    view = (lambda t: t.permute(0, 2, 1, 3, 4).flatten(-2)) if layout == "transposed" else (lambda t: t.flatten(-2) if t.dim() == 5 else t)
    dout = torch.randn(g.shape, device=DEV)
    results = {}
    for backend in ("cutlass", "eager"):
        out = ops.sigmoid_gate(g, view(y_leaf), backend=backend)
        assert out.is_contiguous()
        results[backend] = [out.detach(), *[t.detach() for t in torch.autograd.grad(out, (g, y_leaf), dout.to(dtype))]]
    g64, y64 = g.detach().double().requires_grad_(True), y_leaf.detach().double().requires_grad_(True)
    ref_out = torch.sigmoid(g64) * view(y64)
    ref = [ref_out.detach(), *torch.autograd.grad(ref_out, (g64, y64), dout.double())]
    for name, fused, eager, r in zip(("out", "dg", "dy"), results["cutlass"], results["eager"], ref):
        check(f"{name} {layout}", fused, eager, r, dtype)


def test_sigmoid_gate_returns_dy_in_the_layout_of_y():
    g, y = _gate_operands("transposed", torch.bfloat16, 64)
    dout = torch.randn_like(g)
    dg, dy = _fused.kernels().sigmoid_gate_bwd(dout, g, y)
    assert dg.is_contiguous() and dy.stride() == y.stride()
    # the attention output's gradient comes back contiguous in the op's [B, N, L, H, C'] layout
    assert dy.unflatten(-1, (2, 32)).permute(0, 2, 1, 3, 4).is_contiguous()
    kernels = _fused.kernels()
    torch.library.opcheck(kernels.sigmoid_gate_fwd.default, (g, y))
    torch.library.opcheck(kernels.sigmoid_gate_bwd.default, (dout, g, y))
    for dtype in (torch.float32, torch.bfloat16):
        torch.library.opcheck(kernels.column_sum.default, (dout, dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, c", [(1, 8), (5, 24), (4097, 128), (300_000, 64), (20_000, 1024)])
def test_column_sum_adds_every_cta_in_a_fixed_order(dtype, out_dtype, rows, c):
    # the kernel's last CTA adds the per-CTA partials (hundreds of CTAs at 300k rows): against float64,
    # no worse than torch's float32 sum rounded the same way, and bitwise equal run to run
    from evoformer_blocks.ops import _fused

    if c * torch.finfo(dtype).bits // 8 > 2048:
        pytest.skip("wider than the kernel's rows: the op routes it to eager")
    x = torch.randn(rows, c, device=DEV).to(dtype)
    kernels = _fused.kernels()
    total, again = kernels.column_sum(x, out_dtype), kernels.column_sum(x, out_dtype)
    assert total.dtype == out_dtype and total.shape == (c,) and torch.equal(total, again)
    ref = x.double().sum(0)
    eager = x.sum(0, dtype=torch.float32).to(out_dtype)
    e_fused, e_eager = (total.double() - ref).abs().max().item(), (eager.double() - ref).abs().max().item()
    floor = 1e-6 * x.double().abs().sum(0).max().item()
    assert math.isfinite(e_fused) and e_fused <= RATIO * e_eager + floor, f"{e_fused:.3e} vs torch {e_eager:.3e}"


def test_column_sums_reuse_their_tickets_without_a_memset():
    # the kernels' last CTAs set their ticket counters back to zero, so the next launch on a stream
    # counts on the same counters: sums of different sizes in a row, on two streams, and from a
    # CUDA graph replayed between eager calls all equal a fresh process's, and no memset is queued
    from torch.profiler import ProfilerActivity, profile

    kernels = _fused.kernels()
    xs = [torch.randn(rows, 128, device=DEV, dtype=torch.bfloat16) for rows in (300_000, 4097, 150_000, 1)]
    expected = [x.double().sum(0) for x in xs]

    def sums():
        return [kernels.column_sum(x, torch.float32) for x in xs]

    first = sums()
    for total, ref in zip(first, expected):
        assert torch.allclose(total.double(), ref, rtol=1e-4, atol=1e-3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = sums()
    torch.cuda.current_stream().wait_stream(side)
    graph_out = None
    graph = torch.cuda.CUDAGraph()
    sums()  # (warm-up outside the capture)
    with torch.cuda.graph(graph):
        graph_out = sums()
    for _ in range(3):
        graph.replay()
        eager = sums()
        torch.cuda.synchronize()
        for a, b, c, d in zip(first, on_side, graph_out, eager):
            assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sums()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("column_sum_kernel" in n for n in names) and not any("Memset" in n for n in names), names


def _row_scale_cases(dtype):
    """(name, x, s, residual) cases for the row kernel: fractional scales (never only 0/1, so that a
    product or sum rounded differently shows), views, and layouts the kernel leaves to ATen."""
    def rand(*shape):
        return (torch.randn(*shape, device=DEV) * 3).to(dtype)

    scale = lambda *shape: (torch.rand(*shape, device=DEV) * 2 + 0.05).to(dtype)  # noqa: E731
    wide = rand(2, 37, 29, 64)
    yield "contiguous", rand(2, 37, 29, 32), scale(2, 37, 29), rand(2, 37, 29, 32)
    yield "narrowed halves", wide[..., 32:], scale(2, 37, 29), wide[..., :32]
    yield "odd channels", rand(5, 11, 13), scale(5, 11), rand(5, 11, 13)
    yield "size-1 dims", rand(1, 300, 1, 128), scale(1, 300, 1), rand(1, 300, 1, 128)
    yield "one row", rand(1, 1, 24), scale(1, 1), rand(1, 1, 24)
    yield "transposed rows (ATen)", rand(16, 24, 40).transpose(0, 1), scale(24, 16), rand(24, 16, 40)
    yield "strided scale (ATen)", rand(9, 64), scale(9, 2)[:, 1], rand(9, 64)
    yield "empty", rand(0, 3, 16), scale(0, 3), rand(0, 3, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_row_scale_gives_atens_values(dtype):
    # the row kernel (the outer product mean's masks and mean, the pair transition's masked residual
    # add in the block's node) against the ATen calls it replaces, bit for bit, on every layout
    kernels = _fused.kernels()
    for name, x, s, residual in _row_scale_cases(dtype):
        s_c = s.unsqueeze(-1)
        for mode, want in (("mul", x * s_c), ("div", x / s_c), ("addcmul", torch.addcmul(residual, x, s_c))):
            got = kernels.row_scale(x, s, residual if mode == "addcmul" else None, mode == "div")
            assert got.is_contiguous() and got.dtype == want.dtype and got.shape == want.shape, (name, mode)
            assert torch.equal(got, want), f"{name} {mode}: max diff {(got.float() - want.float()).abs().max()}"
    x, s = torch.randn(64, 32, device=DEV).to(dtype), torch.rand(64, device=DEV).to(dtype)
    torch.library.opcheck(kernels.row_scale.default, (x, s, torch.randn_like(x), False))
    torch.library.opcheck(kernels.row_scale.default, (x, s + 0.5, None, True))
    with pytest.raises(RuntimeError, match="row scale"):
        kernels.row_scale(x, s[:-1], None, False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows, c_in, c_out", [(1, 16, 8), (7, 32, 64), (1000, 64, 128), (3000, 128, 512), (513, 64, 1024)])
@pytest.mark.parametrize("activation", [None, "relu"])
def test_linear_matches_reference(dtype, rows, c_in, c_out, activation):
    x = torch.randn(3, rows, c_in, device=DEV).to(dtype)[1].requires_grad_(True)
    w = (torch.randn(c_out, c_in, device=DEV) / c_in**0.5).to(dtype).requires_grad_(True)
    b = torch.randn(c_out, device=DEV).to(dtype).requires_grad_(True)
    dout = torch.randn(rows, c_out, device=DEV)
    fused = run_with_grads(lambda: ops.linear(x, w, b, activation=activation, backend="cutlass"), [x, w, b], dout)
    eager = run_with_grads(lambda: ops.linear(x, w, b, activation=activation, backend="eager"), [x, w, b], dout)
    leaves = [t.detach().double().requires_grad_(True) for t in (x, w, b)]
    act = torch.relu if activation == "relu" else (lambda t: t)
    ref = run_with_grads(lambda: act(F.linear(*leaves)), leaves, dout.double())
    for name, a, e, r in zip(("out", "dx", "dw", "db"), fused, eager, ref):
        check(f"{name} ({activation})", a, e, r, dtype)
    again = run_with_grads(lambda: ops.linear(x, w, b, activation=activation, backend="cutlass"), [x, w, b], dout)
    assert torch.equal(again[3], fused[3]), "the bias gradient must be bitwise reproducible"
    with torch.no_grad():
        assert torch.equal(ops.linear(x, w, b, activation=activation, backend="cutlass"), fused[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "layers",
    [
        ((64, False), (64, False), (64, False), (64, True)),  # the attention's q, k, v, g: biases from an aligned column
        ((4, False), (20, True)),  # biases from column 4: the sum falls back to PyTorch's
        ((32, True), (32, False), (64, True)),  # biases from column 0, one projection without
    ],
)
def test_stacked_projection_matches_reference(dtype, layers):
    c_in, rows = 64, 300
    linears = [eb.primitives.Linear(c_in, width, bias=biased).to(DEV, dtype) for width, biased in layers]
    params = [p for lin in linears for p in lin.parameters()]
    with torch.no_grad():
        for p in params:
            p.normal_(std=0.3)
    x = torch.randn(2, rows, c_in, device=DEV).to(dtype).requires_grad_(True)
    dout = torch.randn(2, rows, sum(width for width, _ in layers), device=DEV)
    leaves = [x, *params]

    def stacked(backend):
        for lin in linears:
            lin.backend = backend
        return run_with_grads(lambda: eb.primitives.stacked_projection(x, linears), leaves, dout)

    fused, eager = stacked("cutlass"), stacked("eager")
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    ref_params = iter(ref_leaves[1:])  # each Linear's weight, then its bias where it has one
    ref_linears = [(next(ref_params), next(ref_params) if biased else None) for _, biased in layers]
    ref = run_with_grads(
        lambda: torch.cat([F.linear(ref_leaves[0], w, b) for w, b in ref_linears], dim=-1), ref_leaves, dout.double()
    )
    names = ["out", "dx"] + [f"d{name} of {i}" for i, lin in enumerate(linears) for name, _ in lin.named_parameters()]
    for name, a, e, r in zip(names, fused, eager, ref):
        check(name, a, e, r, dtype)
    assert all(torch.equal(a, b) for a, b in zip(stacked("cutlass"), fused)), "gradients must be bitwise reproducible"
    # gradients of x and the weights only (no bias gradient wanted): the same values
    out = eb.primitives.stacked_projection(x, linears)  # (on the cutlass backend, as last set)
    partial = torch.autograd.grad(out, [x, *(lin.weight for lin in linears)], dout.to(out.dtype))
    is_weight = [name == "weight" for lin in linears for name, _ in lin.named_parameters()]
    wanted = [fused[1]] + [g for g, weight in zip(fused[2:], is_weight) if weight]  # dx, then each dW
    assert len(partial) == len(wanted) and all(torch.equal(a, b) for a, b in zip(partial, wanted))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, c_in, c_out", [(16900, 128, 128), (16641, 64, 128), (36865, 256, 128), (4100, 128, 4),
                                               (16901, 128, 128), (16896, 128, 128)])
def test_weight_gradient_sums_every_row(dtype, rows, c_in, c_out):
    # A weight's gradient is a sum over every row (position) of x. The last 256 rows carry most of it
    # here, so a row left out of the sum shows far above the rounding: at least 6e-2 relative, against
    # the one rounding of the result to 16 bits (float32 accumulation). Row counts that are not
    # multiples of 256 (slices that divide them; 16,901, a prime: equal slices and the rows left
    # over) and one that is. (The bar is float64 on the same rounded inputs, not eager: cuBLAS
    # 13.0's own product leaves rows out at some of these counts.)
    x = torch.randn(rows, c_in, device=DEV)
    x[-256:] *= 30
    x = x.to(dtype).requires_grad_(True)
    w = (torch.randn(c_out, c_in, device=DEV) * 0.1).to(dtype).requires_grad_(True)
    b = torch.randn(c_out, device=DEV).to(dtype).requires_grad_(True)
    dy = torch.randn(rows, c_out, device=DEV).to(dtype)
    ops.linear(x, w, b, backend="cutlass").backward(dy)
    ref = dy.double().t() @ x.detach().double()  # [c_out, c_in]
    error = rel_error(w.grad, ref)
    assert error < (4e-3 if dtype == torch.bfloat16 else 5e-4), f"weight gradient error {error:.2e}"
    assert rel_error(b.grad, dy.double().sum(0)) < (4e-3 if dtype == torch.bfloat16 else 5e-4)


@pytest.mark.parametrize("batch, m, k, n, dtype", [
    (1, 384, 4994, 384, torch.float16), (1, 512, 33793, 512, torch.float16), (1, 768, 11713, 768, torch.bfloat16),
    (1, 512, 4096, 512, torch.bfloat16), (2, 384, 4994, 384, torch.float16), (1, 64, 3001, 4160, torch.bfloat16)])
@pytest.mark.parametrize("a_layout", ["transposed", "rows"])
def test_batched_rows_product_sums_every_row(batch, m, k, n, dtype, a_layout):
    # The outer product mean's GEMMs, a [B, m, K] @ b [B, K, n] with K counting sequences (or residues
    # times channels): batches of one at K not a multiple of 256 where cuBLAS 13.0 dropped terms of
    # torch.bmm (the first three), a multiple of 256, a batch of two and a wide output (torch.bmm's
    # product). a as the forward passes it (a transposed view) and as the backward does (rows of K
    # contiguous); the last 256 positions of K carry most of the sum, so a dropped one shows far above
    # the rounding. The bar is float64 on the same inputs.
    scale = torch.ones(k, 1, device=DEV)
    scale[-256:] = 30
    a = torch.randn(batch, k, m, device=DEV) * scale
    a = a.to(dtype).transpose(1, 2) if a_layout == "transposed" else a.transpose(1, 2).contiguous().to(dtype)
    b = torch.randn(batch, k, n, device=DEV).to(dtype)
    out = ops.gating.rows_product(a, b)
    assert out.shape == (batch, m, n) and out.dtype == dtype
    error = rel_error(out, a.double() @ b.double())
    assert error < (4e-3 if dtype == torch.bfloat16 else 5e-4), f"product error {error:.2e}"
    with pytest.raises(RuntimeError, match="rows_product"):  # (an internal op: the extension's guard)
        ops.gating.rows_product(a, b[:, :-1])


def test_linear_under_autocast_keeps_parameter_dtypes():
    x = torch.randn(300, 64, device=DEV, requires_grad=True)
    layer = eb.primitives.Linear(64, 128).to(DEV)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    dx, dw, db = torch.autograd.grad(out.float().square().sum(), (x, layer.weight, layer.bias))
    assert (dx.dtype, dw.dtype, db.dtype) == (torch.float32,) * 3
    with torch.autocast("cuda", dtype=torch.bfloat16), ops.backend("eager"):
        out_e = layer(x)
    ref = torch.autograd.grad(out_e.float().square().sum(), (x, layer.weight, layer.bias))
    for a, r in zip((dx, dw, db), ref):
        torch.testing.assert_close(a, r, atol=3e-2, rtol=3e-2)


def test_gate_and_linear_that_do_not_fit_the_kernels():
    g = torch.randn(4, 12, device=DEV, dtype=torch.bfloat16)  # 24 bytes: not whole 16-byte chunks
    with pytest.raises(ValueError, match="16-byte chunks"):
        ops.sigmoid_gate(g, g, backend="cutlass")
    torch.testing.assert_close(ops.sigmoid_gate(g, g), torch.sigmoid(g) * g)
    # a bias wider than the column-sum kernel's rows: the bias gradient falls back to PyTorch's sum
    x = torch.randn(9, 16, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(2048, 16, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(2048, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(9, 2048, device=DEV, dtype=torch.bfloat16)
    (db,) = torch.autograd.grad(ops.linear(x, w, b, backend="cutlass"), (b,), dout)
    torch.testing.assert_close(db, dout.float().sum(0).to(db.dtype))
    # the same with a ReLU: its backward falls back to PyTorch's too
    y = ops.linear(x, w, b, activation="relu", backend="cutlass")
    dx, db = torch.autograd.grad(y, (x, b), dout)
    masked = torch.where(y > 0, dout, torch.zeros_like(dout))
    torch.testing.assert_close(db, masked.float().sum(0).to(db.dtype))
    torch.testing.assert_close(dx, (masked.float() @ w.float()).to(dx.dtype), atol=0.25, rtol=2e-2)
