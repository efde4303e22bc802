"""The layer-norm and triangle-multiplication ops: their semantics (eager backend against independent
float64 references), validation and dispatch. Nothing here needs a GPU; test_block_ops_cuda.py
checks the fused backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import evoformer_blocks as eb
from evoformer_blocks import ops


def triangle_weights(c_z: int, c: int, dtype=torch.float64, scale: float = 0.3, requires_grad: bool = False) -> dict:
    """Random parameters of the triangle op (fresh draws: never zeros)."""
    def draw(*shape):
        return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype).requires_grad_(requires_grad)

    w = dict(
        norm_in_weight=draw(c_z), norm_in_bias=draw(c_z), proj_weight=draw(4 * c, c_z), proj_bias=draw(4 * c),
        gate_weight=draw(c_z, c_z), gate_bias=draw(c_z), norm_out_weight=draw(c), norm_out_bias=draw(c),
        out_weight=draw(c_z, c), out_bias=draw(c_z),
    )
    with torch.no_grad():
        w["norm_in_weight"] += 1
        w["norm_out_weight"] += 1
    return w


def reference_triangle(z, mask, w, outgoing: bool, eps: float = 1e-5) -> torch.Tensor:
    """AF2 Algorithms 11/12 in float64 with explicit per-projection linears and index loops over k,
    written independently of the backends."""
    z = z.double()
    w = {k: v.double() for k, v in w.items()}
    c = w["proj_weight"].shape[0] // 4
    mean = z.mean(-1, keepdim=True)
    x = (z - mean) / torch.sqrt(z.var(-1, unbiased=False, keepdim=True) + eps) * w["norm_in_weight"] + w["norm_in_bias"]
    lin = lambda t, i: t @ w["proj_weight"][i * c:(i + 1) * c].T + w["proj_bias"][i * c:(i + 1) * c]
    m = torch.ones(z.shape[:-1], dtype=torch.float64) if mask is None else mask.double()
    a = m[..., None] * torch.sigmoid(lin(x, 1)) * lin(x, 0)  # [*, N, N, c]
    b = m[..., None] * torch.sigmoid(lin(x, 3)) * lin(x, 2)
    n = z.shape[-2]
    p = torch.zeros(*z.shape[:-1], c, dtype=torch.float64)
    for k in range(n):
        if outgoing:  # p[i, j] += a[i, k] * b[j, k]
            p += a[..., :, k, None, :] * b[..., None, :, k, :]
        else:  # p[i, j] += a[k, i] * b[k, j]
            p += a[..., k, :, None, :] * b[..., k, None, :, :]
    pm = p.mean(-1, keepdim=True)
    pn = (p - pm) / torch.sqrt(p.var(-1, unbiased=False, keepdim=True) + eps) * w["norm_out_weight"] + w["norm_out_bias"]
    gate = torch.sigmoid(x @ w["gate_weight"].T + w["gate_bias"])
    return gate * (pn @ w["out_weight"].T + w["out_bias"])


def call_triangle(z, mask, w, direction, **kwargs):
    return ops.triangle_multiplication(z, mask, direction=direction, **w, **kwargs)


@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
@pytest.mark.parametrize("batch, n", [((), 1), ((), 7), ((2,), 5), ((2, 3), 4)])
def test_triangle_eager_matches_reference(direction, batch, n):
    z = torch.randn(*batch, n, n, 16, dtype=torch.float64)
    mask = (torch.rand(*batch, n, n) > 0.3).double()
    w = triangle_weights(16, 8)
    out = call_triangle(z, mask, w, direction, backend="eager")
    torch.testing.assert_close(out, reference_triangle(z, mask, w, direction == "outgoing"), atol=1e-10, rtol=1e-8)


def test_triangle_fully_masked_rows_and_columns_and_no_mask():
    n = 6
    z = torch.randn(n, n, 8, dtype=torch.float64)
    mask = torch.ones(n, n, dtype=torch.bool)
    mask[2, :] = False
    mask[:, 4] = False
    w = triangle_weights(8, 8)
    for direction in ("outgoing", "incoming"):
        out = call_triangle(z, mask, w, direction, backend="eager")
        torch.testing.assert_close(out, reference_triangle(z, mask, w, direction == "outgoing"))
        assert torch.isfinite(out).all()
    torch.testing.assert_close(call_triangle(z, None, w, "outgoing"), reference_triangle(z, None, w, True))


def test_triangle_gradients_float64():
    z = torch.randn(4, 4, 8, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(4, 4) > 0.2).double()
    w = triangle_weights(8, 8, requires_grad=True)
    leaves = (z, *w.values())
    torch.autograd.gradcheck(
        lambda z, *ws: call_triangle(z, mask, dict(zip(w, ws)), "incoming", backend="eager"), leaves
    )


def test_triangle_module_routes_through_the_op():
    module = eb.TriangleMultiplicationOutgoing(16, 8).double()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    z = torch.randn(5, 5, 16, dtype=torch.float64)
    mask = (torch.rand(5, 5) > 0.2).double()
    w = dict(
        norm_in_weight=module.layer_norm_in.weight, norm_in_bias=module.layer_norm_in.bias,
        proj_weight=torch.cat([module.linear_a_p.weight, module.linear_a_g.weight, module.linear_b_p.weight,
                               module.linear_b_g.weight]),
        proj_bias=torch.cat([module.linear_a_p.bias, module.linear_a_g.bias, module.linear_b_p.bias,
                             module.linear_b_g.bias]),
        gate_weight=module.linear_g.weight, gate_bias=module.linear_g.bias,
        norm_out_weight=module.layer_norm_out.weight, norm_out_bias=module.layer_norm_out.bias,
        out_weight=module.linear_z.weight, out_bias=module.linear_z.bias,
    )
    with torch.no_grad():
        torch.testing.assert_close(module(z, mask), reference_triangle(z, mask, w, True))


def test_triangle_empty_input():
    z = torch.randn(0, 3, 3, 8, requires_grad=True)
    w = triangle_weights(8, 8, dtype=torch.float32)
    out = call_triangle(z, None, w, "outgoing")
    assert out.shape == z.shape
    out.sum().backward()
    assert z.grad.shape == z.shape


@pytest.mark.parametrize(
    "change, argument",
    [
        (lambda a: a.update(z=torch.randn(3, 4, 8)), "z"),
        (lambda a: a.update(mask=torch.ones(4, 4)), "mask"),
        (lambda a: a["w"].update(proj_weight=torch.randn(30, 8)), "proj_weight"),
        (lambda a: a["w"].update(out_weight=torch.randn(8, 3)), "out_weight"),
        (lambda a: a["w"].update(gate_bias=torch.randn(7)), "gate_bias"),
        (lambda a: a.update(direction="sideways"), "direction"),
        (lambda a: a.update(eps=0.0), "eps"),
    ],
)
def test_triangle_invalid_arguments_raise_value_error_naming_them(change, argument):
    args = dict(z=torch.randn(3, 3, 8), mask=torch.ones(3, 3), w=triangle_weights(8, 8, dtype=torch.float32),
                direction="outgoing", eps=1e-5)
    change(args)
    with pytest.raises(ValueError, match=f"`{argument}`"):
        ops.triangle_multiplication(args["z"], args["mask"], direction=args["direction"], eps=args["eps"], **args["w"])


def test_triangle_cutlass_on_cpu_lists_reasons():
    with pytest.raises(ValueError, match="device type"):
        call_triangle(torch.randn(3, 3, 8), None, triangle_weights(8, 8, dtype=torch.float32), "outgoing",
                      backend="cutlass")


@pytest.mark.parametrize("shape", [(5, 16), (2, 3, 7, 24), (1, 1)])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_eager_matches_functional(shape, affine):
    x = torch.randn(shape, dtype=torch.float64) * 3 + 1
    c = shape[-1]
    w, b = (torch.randn(c, dtype=torch.float64), torch.randn(c, dtype=torch.float64)) if affine else (None, None)
    torch.testing.assert_close(ops.layer_norm(x, w, b, 1e-5), F.layer_norm(x, (c,), w, b, 1e-5))


def test_layer_norm_module_is_a_drop_in_for_nn_layer_norm():
    ours, theirs = eb.LayerNorm(12), torch.nn.LayerNorm(12)
    assert set(ours.state_dict()) == set(theirs.state_dict())
    with torch.no_grad():
        ours.weight.normal_(), ours.bias.normal_()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(4, 12)
    torch.testing.assert_close(ours(x), theirs(x))


@pytest.mark.parametrize(
    "args, argument",
    [
        (dict(x=torch.randn(3, 4), weight=torch.randn(5)), "weight"),
        (dict(x=torch.randn(3, 4), bias=torch.randn(4, 1)), "bias"),
        (dict(x=torch.randint(0, 3, (3, 4))), "x"),
        (dict(x=torch.randn(3, 4), eps=-1.0), "eps"),
    ],
)
def test_layer_norm_invalid_arguments(args, argument):
    with pytest.raises(ValueError, match=f"`{argument}`"):
        ops.layer_norm(**args)


def test_layer_norm_cutlass_on_cpu_lists_reasons():
    with pytest.raises(ValueError, match="device type"):
        ops.layer_norm(torch.randn(3, 8), backend="cutlass")


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("biased", [False, True])
def test_add_layer_norm_eager_is_the_add_then_the_norm(affine, scaled, biased):
    x = (torch.randn(2, 5, 16, dtype=torch.float64) * 3 + 1).requires_grad_(True)
    r = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    w, b = ((torch.randn(16, dtype=torch.float64, requires_grad=True),
             torch.randn(16, dtype=torch.float64, requires_grad=True)) if affine else (None, None))
    scale = torch.randn(1, 5, 16, dtype=torch.float64, requires_grad=True) if scaled else None  # broadcast over dim 0
    rb = torch.randn(16, dtype=torch.float64, requires_grad=True) if biased else None  # the residual's bias
    s, y = ops.add_layer_norm(x, r, w, b, 1e-5, residual_scale=scale, residual_bias=rb)
    update = r if rb is None else r + rb
    s_ref = x + (update if scale is None else update * scale)
    y_ref = F.layer_norm(s_ref, (16,), w, b, 1e-5)
    torch.testing.assert_close(s, s_ref)
    torch.testing.assert_close(y, y_ref)
    ds, dy = torch.randn_like(s), torch.randn_like(y)
    leaves = [t for t in (x, r, w, b, scale, rb) if t is not None]
    got = torch.autograd.grad((s, y), leaves, (ds, dy))
    want = torch.autograd.grad((s_ref, y_ref), leaves, (ds, dy))
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize(
    "bias",
    [torch.randn(5), torch.randn(4, dtype=torch.float64), torch.randn(1, 4), torch.randn(3, 4), "not a tensor"],
)
def test_add_layer_norm_invalid_residual_bias(bias):
    with pytest.raises(ValueError, match="`residual_bias`"):
        ops.add_layer_norm(torch.randn(3, 4), torch.randn(3, 4), residual_bias=bias)


@pytest.mark.parametrize(
    "residual",
    [torch.randn(3, 5), torch.randn(3, 4, dtype=torch.float64), torch.randn(4), "not a tensor"],
)
def test_add_layer_norm_invalid_residual(residual):
    with pytest.raises(ValueError, match="`residual`"):
        ops.add_layer_norm(torch.randn(3, 4), residual)


@pytest.mark.parametrize(
    "scale",
    [torch.randn(3), torch.randn(3, 1, dtype=torch.float64), torch.randn(2, 4), torch.randn(2, 3, 4), "not a tensor"],
)
def test_add_layer_norm_invalid_residual_scale(scale):
    with pytest.raises(ValueError, match="`residual_scale`"):
        ops.add_layer_norm(torch.randn(3, 4), torch.randn(3, 4), residual_scale=scale)


def test_add_layer_norm_cutlass_on_cpu_lists_reasons():
    with pytest.raises(ValueError, match="device type"):
        ops.add_layer_norm(torch.randn(3, 8), torch.randn(3, 8), backend="cutlass")


def test_layer_norm_keeping_input_is_the_input_and_its_norm():
    x = (torch.randn(2, 5, 16, dtype=torch.float64) * 3 + 1).requires_grad_(True)
    w, b = torch.randn(16, dtype=torch.float64, requires_grad=True), torch.randn(16, dtype=torch.float64, requires_grad=True)
    kept, y = ops.layer_norm_keeping_input(x, w, b, 1e-5)
    assert kept is x
    torch.testing.assert_close(y, F.layer_norm(x, (16,), w, b, 1e-5))
    with pytest.raises(ValueError, match="`weight`"):
        ops.layer_norm_keeping_input(x, torch.randn(5))
    with pytest.raises(ValueError, match="device type"):
        ops.layer_norm_keeping_input(torch.randn(3, 8), backend="cutlass")
    empty = torch.randn(0, 8)
    kept, y = ops.layer_norm_keeping_input(empty)
    assert kept is empty and y.shape == (0, 8)


# ---- the fused ops' fake implementations (meta tensors: no GPU) ---------------------------------


def _meta_leaf(*shape, dtype=torch.bfloat16):
    return torch.randn(shape, dtype=torch.float32).to(dtype).to("meta").requires_grad_(True)


def _check_compiled_gradients(run, leaves, like):
    """``torch.compile(run, fullgraph=True)`` on meta ``leaves``: the output has ``like``'s shape and
    dtype, and every leaf gets a gradient of its own shape and dtype."""
    out = torch.compile(run, fullgraph=True, backend="aot_eager")(*leaves)
    out.float().sum().backward()
    assert out.shape == like.shape and out.dtype == like.dtype
    for t in leaves:
        assert t.grad.shape == t.shape and t.grad.dtype == t.dtype


@pytest.mark.parametrize("norm_dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("with_mask", [False, True])
def test_triangle_compile_fullgraph_traces_the_fakes(norm_dtype, with_mask):
    # The extension ops' fakes carry torch.compile through the fused forward and backward: the output
    # and every gradient get their input's shape and dtype (layer-norm parameters in another dtype
    # than z included; float64 ones reach the kernels as float32 and autograd takes them back).
    from evoformer_blocks.ops import triangle

    c_z, c = 16, 8
    z = _meta_leaf(2, 6, 6, c_z)
    mask = torch.ones(2, 6, 6, dtype=torch.bfloat16, device="meta") if with_mask else None
    w = {name: _meta_leaf(*t.shape, dtype=norm_dtype if name.startswith("norm") else torch.bfloat16)
         for name, t in triangle_weights(c_z, c).items()}

    def run(z, *params):
        inputs = triangle.validate(z, mask, dict(zip(w, params)), "incoming", 1e-5)
        return triangle.fused_triangle_multiplication(inputs) * 2

    _check_compiled_gradients(run, [z, *w.values()], z)


def test_triangle_keeping_input_compile_fullgraph_traces_the_fakes():
    # the node that returns z itself beside the update traces with the extension ops' fakes, and z's
    # gradient arrives from both outputs
    from evoformer_blocks.ops import triangle

    z = _meta_leaf(2, 6, 6, 16)
    w = {name: _meta_leaf(*t.shape) for name, t in triangle_weights(16, 8).items()}

    def run(z, *params):
        inputs = triangle.validate(z, None, dict(zip(w, params)), "outgoing", 1e-5)
        kept, out = triangle.fused_triangle_multiplication(inputs, triangle._KEEP)
        return kept * 3 + out * 2

    _check_compiled_gradients(run, [z, *w.values()], z)


@pytest.mark.parametrize("scaled", [False, True])
def test_triangle_residual_compile_fullgraph_traces_the_fakes(scaled):
    # the node that returns z + update (* a row-wise scale) traces with the extension ops' fakes
    from evoformer_blocks.ops import triangle

    z = _meta_leaf(2, 6, 6, 16)
    w = {name: _meta_leaf(*t.shape) for name, t in triangle_weights(16, 8).items()}
    scale = torch.ones(2, 1, 6, 16, dtype=torch.bfloat16, device="meta") if scaled else None

    def run(z, *params):
        inputs = triangle.validate(z, None, dict(zip(w, params)), "outgoing", 1e-5)
        return triangle.fused_triangle_multiplication(inputs, triangle._ADD, scale) * 2

    _check_compiled_gradients(run, [z, *w.values()], z)


def test_triangle_residual_is_the_input_plus_the_scaled_update():
    # z + update * scale, as `z + update * keep` rounds it; gradients of z and the weights as the
    # separate op and add give them; bad scales rejected
    z = torch.randn(2, 5, 5, 16, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(2, 5, 5) > 0.3).double()
    w = {name: t.requires_grad_(True) for name, t in triangle_weights(16, 8).items()}
    keep = (torch.rand(2, 1, 5, 16) > 0.25).double() / 0.75
    for scale in (None, keep):
        got = ops.triangle_multiplication_residual(z, mask, update_scale=scale, direction="outgoing", **w)
        update = call_triangle(z, mask, w, "outgoing")
        want = z + (update if scale is None else update * scale)
        torch.testing.assert_close(got, want)
        cot = torch.randn_like(got)
        leaves = [z, *w.values()]
        for a, b in zip(torch.autograd.grad(got, leaves, cot), torch.autograd.grad(want, leaves, cot)):
            torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="`update_scale`.*requires no gradient"):
        ops.triangle_multiplication_residual(z, mask, update_scale=keep.clone().requires_grad_(True),
                                             direction="outgoing", **w)
    for bad in (keep[..., :3], keep.expand(3, 2, 1, 5, 16)):  # no broadcast, or one past z's shape
        with pytest.raises(ValueError, match="`update_scale` must broadcast"):
            ops.triangle_multiplication_residual(z, mask, update_scale=bad, direction="outgoing", **w)
    with pytest.raises(TypeError, match="missing arguments \\['direction'\\]"):
        ops.triangle_multiplication_residual(z, mask, **w)


def test_triangle_keeping_input_is_the_input_and_the_update():
    z = torch.randn(2, 5, 5, 16, dtype=torch.float64)
    mask = (torch.rand(2, 5, 5) > 0.3).double()
    w = triangle_weights(16, 8)
    kept, out = ops.triangle_multiplication_keeping_input(z, mask, direction="incoming", **w)
    assert kept is z
    torch.testing.assert_close(out, call_triangle(z, mask, w, "incoming"))
    with pytest.raises(TypeError, match="missing arguments \\['direction'\\]"):
        ops.triangle_multiplication_keeping_input(z, mask, **w)
    with pytest.raises(TypeError, match="unknown \\['chunk'\\]"):
        ops.triangle_multiplication_keeping_input(z, mask, direction="incoming", chunk=2, **w)
    with pytest.raises(ValueError, match="`direction`"):
        ops.triangle_multiplication_keeping_input(z, mask, direction="sideways", **w)
    empty = torch.randn(0, 5, 5, 16, dtype=torch.float64)
    kept, out = ops.triangle_multiplication_keeping_input(empty, direction="outgoing", **w)
    assert kept is empty and out.shape == empty.shape


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_layer_norm_compile_fullgraph_traces_the_fakes(param_dtype):
    from evoformer_blocks.ops import normalization

    x, weight, bias = _meta_leaf(3, 5, 32), _meta_leaf(32, dtype=param_dtype), _meta_leaf(32, dtype=param_dtype)

    def run(x, weight, bias):
        return normalization.CutlassLayerNorm().forward(normalization.validate(x, weight, bias, 1e-5)) * 2

    _check_compiled_gradients(run, [x, weight, bias], x)


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_layer_norm_keeping_input_compile_fullgraph_traces_the_fakes(param_dtype):
    # the node that returns x itself (a view) beside its layer norm traces with the extension ops'
    # fakes, and x's gradient arrives from both outputs
    from evoformer_blocks.ops import normalization

    x, weight, bias = _meta_leaf(3, 5, 32), _meta_leaf(32, dtype=param_dtype), _meta_leaf(32, dtype=param_dtype)

    def run(x, weight, bias):
        kept, y = normalization._LayerNormKeepingInputFunction.apply(x, weight, bias, 1e-5)
        return kept * 3 + y * 2

    _check_compiled_gradients(run, [x, weight, bias], x)


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("residual_bias", [False, True])
def test_add_layer_norm_compile_fullgraph_traces_the_fakes(param_dtype, scaled, residual_bias):
    from evoformer_blocks.ops import normalization

    x, r = _meta_leaf(3, 5, 32), _meta_leaf(3, 5, 32)
    weight, bias = _meta_leaf(32, dtype=param_dtype), _meta_leaf(32, dtype=param_dtype)
    scale = _meta_leaf(3, 1, 32) if scaled else None
    leaves = [x, r, weight, bias] + ([scale] if scaled else []) + ([_meta_leaf(32)] if residual_bias else [])

    def run(x, r, weight, bias, *rest):
        scale = rest[0] if scaled else None
        rb = rest[-1] if residual_bias else None
        inputs = normalization.validate_add(x, r, weight, bias, 1e-5, scale, rb)
        s, y = normalization.CutlassAddLayerNorm().forward(inputs)
        return s * 3 + y * 2

    _check_compiled_gradients(run, leaves, x)


# ---- sigmoid gate and linear ----------------------------------------------------------------------


def test_sigmoid_gate_and_linear_eager_are_the_pytorch_expressions():
    g, y = torch.randn(3, 5, 8), torch.randn(3, 8, 5).transpose(1, 2)  # y a strided view
    assert torch.equal(ops.sigmoid_gate(g, y), torch.sigmoid(g) * y)
    x, w, b = torch.randn(2, 4, 6, requires_grad=True), torch.randn(3, 6), torch.randn(3, requires_grad=True)
    out = ops.linear(x, w, b)
    assert torch.equal(out, torch.nn.functional.linear(x, w, b))
    out.sum().backward()
    assert torch.equal(b.grad, torch.full((3,), 8.0))
    assert torch.equal(ops.linear(x, w, b, activation="relu"), torch.relu(torch.nn.functional.linear(x, w, b)))


@pytest.mark.parametrize(
    "make, argument",
    [
        (lambda: ops.sigmoid_gate(torch.randn(3, 8), torch.randn(3, 4)), "y"),
        (lambda: ops.sigmoid_gate(torch.randn(3, 8), torch.randn(3, 8).double()), "y"),
        (lambda: ops.sigmoid_gate(torch.ones(3, 8, dtype=torch.int32), torch.ones(3, 8, dtype=torch.int32)), "g"),
        (lambda: ops.linear(torch.randn(3, 8), torch.randn(4, 5)), "weight"),
        (lambda: ops.linear(torch.randn(3, 8), torch.randn(4, 8), torch.randn(5)), "bias"),
        (lambda: ops.linear(torch.ones(3, 8, dtype=torch.int64), torch.randn(4, 8)), "x"),
        (lambda: ops.linear(torch.randn(3, 8), torch.randn(4, 8), activation="gelu"), "activation"),
    ],
)
def test_gate_and_linear_invalid_arguments(make, argument):
    with pytest.raises(ValueError, match=f"invalid `{argument}`"):
        make()


def test_gate_and_linear_cutlass_on_cpu_lists_reasons():
    with pytest.raises(ValueError, match="device type 'cpu'"):
        ops.sigmoid_gate(torch.randn(3, 8), torch.randn(3, 8), backend="cutlass")
    with pytest.raises(ValueError, match="device type 'cpu'"):
        ops.linear(torch.randn(3, 8, requires_grad=True), torch.randn(4, 8), torch.randn(4), backend="cutlass")


def test_linear_compile_fullgraph_traces_the_fakes():
    # the fused linear's backward (one linear_bwd call: the bias sum, then the GEMMs) traces with its
    # fake (the ReLU form asks autocast about the device, which meta tensors cannot answer)
    from evoformer_blocks.ops import gating

    x, weight, bias = _meta_leaf(3, 5, 32), _meta_leaf(48, 32), _meta_leaf(48)

    def run(x, weight, bias):
        return gating._FusedBiasLinear.apply(x, weight, bias, False) * 2

    _check_compiled_gradients(run, [x, weight, bias], torch.empty(3, 5, 48, dtype=torch.bfloat16))


def test_stacked_projection_compile_fullgraph_traces_the_fakes():
    # the stacked projection's fused backward (linear_bwd with the bias sums from the first biased
    # projection's column on) traces with its fake
    from evoformer_blocks.primitives import _StackedProjection

    x = _meta_leaf(3, 5, 32)
    weights = [_meta_leaf(16, 32) for _ in range(3)]
    biases = [None, _meta_leaf(16), _meta_leaf(16)]

    def run(x, w0, w1, w2, b1, b2):
        return _StackedProjection.apply(x, True, 3, None, w0, w1, w2, None, b1, b2) * 2

    _check_compiled_gradients(run, [x, *weights, *biases[1:]], torch.empty(3, 5, 48, dtype=torch.bfloat16))


def test_bias_free_linear_compile_fullgraph_traces_the_fakes():
    # without a bias the fused linear's backward is linear_bwd too (its weight gradient by
    # rows_product): it traces with its fake, and no bias gradient is asked for
    from evoformer_blocks.ops import gating

    x, weight = _meta_leaf(3, 5, 32), _meta_leaf(48, 32)

    def run(x, weight):
        return gating._FusedBiasLinear.apply(x, weight, None, False) * 2

    _check_compiled_gradients(run, [x, weight], torch.empty(3, 5, 48, dtype=torch.bfloat16))


def test_head_major_projections_compile_fullgraph_trace_the_fakes():
    # one batch element's head-major projection: alone (_HeadMajor) and as the stacked projection's
    # second output without biases, the weight gradients by the rows_product op, traced with its fake
    from evoformer_blocks.primitives import _HeadMajor, _StackedProjection

    x, head = _meta_leaf(1, 6, 6, 32), _meta_leaf(4, 32)

    def alone(x, head):
        return _HeadMajor.apply(x, head) * 2

    _check_compiled_gradients(alone, [x, head], torch.empty(1, 1, 4, 6, 6, dtype=torch.bfloat16))
    x, head = _meta_leaf(1, 6, 6, 32), _meta_leaf(4, 32)
    w0, w1 = _meta_leaf(16, 32), _meta_leaf(16, 32)

    def stacked(x, head, w0, w1):
        out, bias = _StackedProjection.apply(x, True, 2, head, w0, w1, None, None)
        return out.sum() + bias.sum()

    _check_compiled_gradients(stacked, [x, head, w0, w1], torch.empty((), dtype=torch.bfloat16))


def test_sigmoid_gate_compile_fullgraph_traces_the_fakes():
    from evoformer_blocks.ops import gating

    g, base = _meta_leaf(2, 3, 16), _meta_leaf(2, 16, 3)

    def run(g, base):
        y = base.transpose(1, 2)  # [2, 3, 16], a permuted view
        return gating.CutlassSigmoidGate().forward(gating.validate_gate(g, y)) * 2

    out = torch.compile(run, fullgraph=True, backend="aot_eager")(g, base)
    out.float().sum().backward()
    assert out.shape == g.shape and out.dtype == g.dtype
    assert g.grad.shape == g.shape and base.grad.shape == base.shape and base.grad.dtype == base.dtype
