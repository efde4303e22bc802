"""The four op-based attention modules on the cutlass backend against the eager backend (GPU only).

Each module runs in bfloat16 on both backends and in float32 on eager (the reference), with all
weights random (the zero-initialized output and gate layers are re-initialized). The fused run must
be within 2x the error of the eager bfloat16 run, for the output and the input gradients.
"""

from __future__ import annotations

import copy
import os
from functools import partial

import pytest
import torch

# (before the extension loads: outputs filled with NaN before the kernels run, so that an element a
# kernel fails to write fails its test)
os.environ.setdefault("EVOFORMER_BLOCKS_POISON", "1")

import evoformer_blocks as eb  # noqa: E402
from evoformer_blocks.ops import cutlass, module_nodes  # noqa: E402
from gpu import HOPPER, KERNEL_FAMILIES, requires_sm80  # noqa: E402

pytestmark = requires_sm80

RATIO = 2.0
FLOOR = 1e-4
C_M, C_Z, C_HIDDEN = 64, 32, 16
N_SEQ, N_RES = 12, 37


def randomize(module: torch.nn.Module) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return module


MODULES = {
    "msa_row": (lambda: eb.MSARowAttentionWithPairBias(C_M, C_Z, C_HIDDEN, 4), "msa", True),
    "msa_column": (lambda: eb.MSAColumnAttention(C_M, C_HIDDEN, 4), "msa", False),
    "triangle_start": (lambda: eb.TriangleAttentionStartingNode(C_Z, C_HIDDEN, 2), "pair", False),
    "triangle_end": (lambda: eb.TriangleAttentionEndingNode(C_Z, C_HIDDEN, 2), "pair", False),
}


def make_inputs(kind, with_z, gen):
    if kind == "msa":
        x = torch.randn(2, N_SEQ, N_RES, C_M, generator=gen)
        mask = (torch.rand(2, N_SEQ, N_RES, generator=gen) > 0.15).float()
    else:
        x = torch.randn(2, N_RES, N_RES, C_Z, generator=gen)
        mask = (torch.rand(2, N_RES, N_RES, generator=gen) > 0.15).float()
    mask[0, 0] = 0.0  # a fully masked row
    z = torch.randn(2, N_RES, N_RES, C_Z, generator=gen) if with_z else None
    return x, z, mask


def run(module, x, z, mask, dtype, backend):
    mod = copy.deepcopy(module).to(device="cuda", dtype=dtype)
    mod.backend = backend
    x = x.to("cuda", dtype).requires_grad_(True)
    args = [x]
    if z is not None:
        z = z.to("cuda", dtype).requires_grad_(True)
        args.append(z)
    out = mod(*args, mask=mask.to("cuda", dtype))
    out.float().square().sum().backward()
    grads = [a.grad.float() for a in args]
    return out.float(), grads


def rel(x, ref):
    return ((x - ref).norm() / ref.norm()).item()


def assert_within_eager(labels, fused, eager, ref, context=""):
    """Each fused result finite and within RATIO x eager bfloat16's error against the reference."""
    for label, f, e, r in zip(labels, fused, eager, ref):
        assert torch.isfinite(f).all(), f"{context}{label}"
        e_fused, e_eager = rel(f, r), rel(e, r)
        assert e_fused <= RATIO * e_eager + FLOOR, f"{context}{label}: fused {e_fused:.3e} vs eager {e_eager:.3e}"


@pytest.mark.parametrize("name", list(MODULES))
def test_module_cutlass_matches_eager(name):
    make, kind, with_z = MODULES[name]
    module = randomize(make())
    x, z, mask = make_inputs(kind, with_z, torch.Generator().manual_seed(0))
    ref_out, ref_grads = run(module, x, z, mask, torch.float32, "eager")
    eager_out, eager_grads = run(module, x, z, mask, torch.bfloat16, "eager")
    fused_out, fused_grads = run(module, x, z, mask, torch.bfloat16, "cutlass")
    labels = ["out"] + [f"grad[{i}]" for i in range(len(fused_grads))]
    assert_within_eager(labels, [fused_out, *fused_grads], [eager_out, *eager_grads], [ref_out, *ref_grads],
                        context=f"{name} ")


def test_module_compiles_fullgraph_on_cutlass():
    module = randomize(eb.MSARowAttentionWithPairBias(C_M, C_Z, C_HIDDEN, 4, backend="cutlass")).cuda().bfloat16()
    x, z, mask = make_inputs("msa", True, torch.Generator().manual_seed(1))
    x, z, mask = (t.cuda().bfloat16() for t in (x, z, mask))
    x.requires_grad_(True)
    compiled = torch.compile(module, fullgraph=True)
    out = compiled(x, z, mask=mask)
    out.float().sum().backward()
    expected = module(x.detach(), z, mask=mask)
    torch.testing.assert_close(out.detach().float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert x.grad is not None and torch.isfinite(x.grad).all()


AF2_BLOCK_SIZES = dict(c_m=32, c_z=16, c_hidden_msa_att=8, c_hidden_opm=8, c_hidden_mul=16, c_hidden_pair_att=8,
                       no_heads_msa=4, no_heads_pair=2)
# name -> (the block's class with its sizes, the first input ("msa": m [6, 21, 32], "single": s [21, 32]),
# the parameter whose gradient is zero in exact arithmetic: the layer norm bias of a pair bias that
# only shifts every logit of a softmax by a constant)
BLOCK_CASES = {
    "EvoformerBlock": (partial(eb.EvoformerBlock, **AF2_BLOCK_SIZES), "msa", "msa_att_row.layer_norm_z.bias"),
    "ExtraMSABlock": (partial(eb.ExtraMSABlock, **AF2_BLOCK_SIZES), "msa", "msa_att_row.layer_norm_z.bias"),
    "EvoformerBlock-multimer": (
        partial(eb.EvoformerBlock, **AF2_BLOCK_SIZES, opm_first=True, fuse_projection_weights=True), "msa",
        "msa_att_row.layer_norm_z.bias",
    ),
    "PairformerBlock": (
        partial(eb.PairformerBlock, c_s=32, c_z=16, c_hidden_pair_bias=8, no_heads_pair_bias=4, c_hidden_mul=16,
                c_hidden_pair_att=8, no_heads_pair=2),
        "single", "attn_pair_bias.layer_norm_z.bias",
    ),
    "MSAModuleBlock": (partial(eb.MSAModuleBlock, **AF2_BLOCK_SIZES), "msa", "pair_weighted_averaging.layer_norm_z.bias"),
}


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_blocks_cutlass_match_eager(case):
    # a whole block (fused residual add + layer norm, attention, triangle multiplication, gates and
    # projections) in bfloat16 on cutlass and on eager against float32 eager: outputs and the
    # gradients of m (or s), z and every parameter within 2x eager bfloat16's error, errors averaged
    # over twelve draws of inputs and weights. Fewer are not enough: some gradients are sums that cancel
    # (the pair-bias projections' weights: their cotangent sums to zero over the keys), so eager
    # bfloat16 is already 2-3 % off there and one draw's ratio swings with the rounding of
    # everything upstream (the ending node's linear_z.weight in ExtraMSABlock: 0.4-1.4 of the bar
    # per draw; averaged over four draws 0.9-1.1, over these twelve 0.70).
    make, first, zero_name = BLOCK_CASES[case]
    errors = {}  # name -> [(fused error, eager error)] over the draws
    for seed in range(4, 16):
        template = randomize(make()).eval()
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(6, 21, 32, generator=gen) if first == "msa" else torch.randn(21, 32, generator=gen)
        z = torch.randn(21, 21, 16, generator=gen)
        x_mask = (torch.rand(x.shape[:-1], generator=gen) > 0.1).float()
        pair_mask = (torch.rand(21, 21, generator=gen) > 0.1).float()

        def grads(backend, dtype):
            block = make(backend=backend).eval()
            block.load_state_dict(template.state_dict())
            block = block.to("cuda", dtype)
            inputs = [t.to("cuda", dtype).requires_grad_(True) for t in (x, z)]
            out_x, out_z = block(*inputs, x_mask.to("cuda", dtype), pair_mask.to("cuda", dtype))
            loss = out_x.float().square().mean() + out_z.float().square().mean()
            return [out_x.float(), out_z.float(),
                    *(g.float() for g in torch.autograd.grad(loss, [*inputs, *block.parameters()]))]

        ref, eager, fused = grads("eager", torch.float32), grads("eager", torch.bfloat16), grads("cutlass", torch.bfloat16)
        names = ["out_x", "out_z", "dx", "dz", *(name for name, _ in template.named_parameters())]
        # That layer norm bias's gradient has no relative error: it must stay at rounding level,
        # measured against its weight's gradient.
        zero = names.index(zero_name)
        scale = ref[names.index(zero_name.replace(".bias", ".weight"))].norm()
        assert ref[zero].norm() <= 1e-5 * scale
        assert torch.isfinite(fused[zero]).all() and fused[zero].norm() <= 2e-2 * scale, fused[zero].norm() / scale
        for i, (name, f, e, r) in enumerate(zip(names, fused, eager, ref)):
            if i != zero:
                assert torch.isfinite(f).all(), f"{name} (seed {seed})"
                errors.setdefault(name, []).append((rel(f, r), rel(e, r)))
    for name, pairs in errors.items():
        e_fused = sum(f for f, _ in pairs) / len(pairs)
        e_eager = sum(e for _, e in pairs) / len(pairs)
        assert e_fused <= RATIO * e_eager + 2e-3, f"{case} {name}: fused {e_fused:.3e} vs eager {e_eager:.3e}"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["EvoformerBlock", "ExtraMSABlock", "PairformerBlock", "MSAModuleBlock"])
def test_blocks_compile_fullgraph_on_cutlass(case):
    # every fused op of a block (attention, layer norm, triangle multiplication, gate, linear) in
    # one graph, forward and backward, matching the uncompiled block
    torch._dynamo.reset()
    make, first, _ = BLOCK_CASES[case]
    block = randomize(make(backend="cutlass")).cuda().bfloat16().eval()
    gen = torch.Generator().manual_seed(2)
    m = torch.randn(*((6,) if first == "msa" else ()), 21, 32, generator=gen).cuda().bfloat16().requires_grad_(True)
    z = torch.randn(21, 21, 16, generator=gen).cuda().bfloat16().requires_grad_(True)
    msa_mask = (torch.rand(m.shape[:-1], generator=gen) > 0.1).cuda().bfloat16()
    pair_mask = (torch.rand(21, 21, generator=gen) > 0.1).cuda().bfloat16()

    def loss_and_grads(fn):
        out_m, out_z = fn(m, z, msa_mask, pair_mask)
        loss = out_m.float().square().mean() + out_z.float().square().mean()
        return [loss.detach(), *torch.autograd.grad(loss, (m, z))]

    expected = loss_and_grads(block)
    got = loss_and_grads(torch.compile(block, fullgraph=True))
    for a, e in zip(got, expected):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.float(), e.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("block_cls", [eb.EvoformerBlock, eb.ExtraMSABlock])
def test_blocks_replay_in_cuda_graphs(block_cls):
    # torch.cuda.make_graphed_callables (CUDA graphs without torch.compile): the fused ops capture
    # (no host synchronisation, the current stream, memory from the graph's pool) and every replay
    # computes the block of that call's inputs, outputs and gradients, as the plain block does
    sizes = dict(c_m=32, c_z=16, c_hidden_msa_att=8, c_hidden_opm=8, c_hidden_mul=16, c_hidden_pair_att=8,
                 no_heads_msa=4, no_heads_pair=2, backend="cutlass")
    block = randomize(block_cls(**sizes)).cuda().bfloat16().eval()
    gen = torch.Generator().manual_seed(5)

    def draw():
        m = torch.randn(6, 21, 32, generator=gen).cuda().bfloat16().requires_grad_(True)
        z = torch.randn(21, 21, 16, generator=gen).cuda().bfloat16().requires_grad_(True)
        msa_mask = (torch.rand(6, 21, generator=gen) > 0.1).cuda().bfloat16()
        pair_mask = (torch.rand(21, 21, generator=gen) > 0.1).cuda().bfloat16()
        return m, z, msa_mask, pair_mask

    def loss_and_grads(fn, module, args):
        out_m, out_z = fn(*args)
        loss = out_m.float().square().mean() + out_z.float().square().mean()
        return [out_m, out_z, *torch.autograd.grad(loss, (*args[:2], *module.parameters()))]

    graphed_block = copy.deepcopy(block)
    graphed = torch.cuda.make_graphed_callables(graphed_block, draw())
    for _ in range(2):  # replays on new inputs, not the captured ones
        args = draw()
        expected = loss_and_grads(block, block, args)
        got = loss_and_grads(graphed, graphed_block, args)
        for a, e in zip(got, expected):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a.float(), e.float(), atol=2e-2, rtol=2e-2)

    # training mode: every replay draws new dropout masks
    train_block = torch.cuda.make_graphed_callables(copy.deepcopy(block).train(), draw())
    args = draw()
    first = [t.detach().clone() for t in train_block(*args)]
    second = train_block(*args)
    assert not torch.equal(first[1], second[1])


def test_stack_replays_in_cuda_graphs():
    # a whole EvoformerStack (blocks run through _update, no checkpointing) in one pair of graphs
    stack = randomize(eb.EvoformerStack(
        c_m=32, c_z=16, c_s=24, c_hidden_msa_att=8, c_hidden_opm=8, c_hidden_mul=16, c_hidden_pair_att=8,
        no_heads_msa=4, no_heads_pair=2, no_blocks=2, backend="cutlass",
    )).cuda().bfloat16().eval()
    gen = torch.Generator().manual_seed(6)

    def draw():
        return (torch.randn(5, 19, 32, generator=gen).cuda().bfloat16().requires_grad_(True),
                torch.randn(19, 19, 16, generator=gen).cuda().bfloat16().requires_grad_(True),
                (torch.rand(5, 19, generator=gen) > 0.1).cuda().bfloat16(),
                (torch.rand(19, 19, generator=gen) > 0.1).cuda().bfloat16())

    graphed_stack = copy.deepcopy(stack)
    graphed = torch.cuda.make_graphed_callables(graphed_stack, draw())
    args = draw()
    results = []
    for fn, module in ((stack, stack), (graphed, graphed_stack)):
        outs = fn(*args)
        loss = sum(o.float().square().mean() for o in outs)
        results.append([*outs, *torch.autograd.grad(loss, (*args[:2], *module.parameters()))])
    for a, e in zip(results[1], results[0]):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.float(), e.float(), atol=2e-2, rtol=2e-2)


def _gated_inputs(transposed, dtype, heads=4, c=32, a=24, a2=40):
    qkvg = torch.randn(1, a, a2, 4 * heads * c, device="cuda").to(dtype).requires_grad_(True)
    n, length = (a2, a) if transposed else (a, a2)
    mask = torch.where(torch.rand(1, n, 1, 1, length, device="cuda") > 0.1, 0.0, -1e9).to(dtype)
    pair = torch.randn(1, 1, heads, length, length, device="cuda").to(dtype).requires_grad_(True)
    return qkvg, heads, mask, pair


@pytest.mark.parametrize("family", KERNEL_FAMILIES)
@pytest.mark.parametrize("head_dim", [32, 24])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("transposed", [False, True])
def test_gated_attention_is_the_composed_ops(transposed, dtype, head_dim, family, monkeypatch):
    # the one-node path (the attention kernels' epilogue writing the gated output, the gradients
    # written into one tensor) against the attention op and the gate op on the views, both on the
    # cutlass kernels of either family: the same output bits; the same gradients up to the
    # attention's delta, which the gate kernel sums per head in another order where a head is a
    # power-of-two number of 16-byte chunks (D = 32), and the delta pass sums otherwise (bfloat16
    # D = 24: three chunks; the same bits then)
    from evoformer_blocks import ops
    from evoformer_blocks.ops._inputs import gated_output_view, gated_views

    monkeypatch.setenv("EVOFORMER_BLOCKS_KERNELS", family)
    qkvg, heads, mask, pair = _gated_inputs(transposed, dtype, c=head_dim)
    out = ops.gated_evoformer_attention(qkvg, heads, mask, pair, transposed=transposed, backend="cutlass")
    q, k, v, g = gated_views(qkvg, heads, transposed)
    o = ops.evoformer_attention(q, k, v, mask, pair, backend="cutlass")
    ref = ops.sigmoid_gate(g, gated_output_view(o, transposed), backend="cutlass")
    assert out.is_contiguous() and torch.equal(out, ref)
    cot = torch.randn_like(out)
    grads = torch.autograd.grad(out, (qkvg, pair), cot)
    ref_grads = torch.autograd.grad(ref, (qkvg, pair), cot)
    assert grads[0].is_contiguous()
    fused_delta = head_dim * qkvg.element_size() // 16 in (1, 2, 4, 8, 16, 32)
    for a, b in zip(grads, ref_grads):
        assert torch.isfinite(a).all()
        if fused_delta:  # within one rounding of the dtype at the largest gradient
            ulp = 2.0 ** -(8 if dtype == torch.bfloat16 else 10)  # (float32: TF32 products)
            assert (a.float() - b.float()).abs().max() <= ulp * b.float().abs().max()
        else:
            assert torch.equal(a, b)


@pytest.mark.parametrize("head_dim", [32, 24])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("transposed", [False, True])
def test_gate_backward_sums_the_attention_delta_per_head(transposed, dtype, head_dim):
    # the gate kernel's delta [B, N, H, L] = rowsum(dO * O) per head against the same sum in float64
    # of what it stored (dO) and read (O); empty where a head is not a power-of-two number of chunks
    from evoformer_blocks.ops import cutlass
    from evoformer_blocks.ops._inputs import gated_output_view, gated_views

    qkvg, heads, mask, pair = _gated_inputs(transposed, dtype, c=head_dim)
    family = cutlass.kernel_family(qkvg.device, qkvg.dtype)
    y, out, *_ = cutlass._kernels().gated_attention_fwd(qkvg.detach(), mask, pair.detach(), heads, transposed, 0.25, family)
    g = gated_views(qkvg.detach(), heads, transposed)[3]
    dg = torch.full_like(g, float("nan")).contiguous()
    o = gated_output_view(out, transposed)  # [B, A, A', H D]
    batch, rows, length = out.shape[:3]  # out [B, N, L, H, D]
    do, delta = cutlass._kernels().sigmoid_gate_bwd_into(torch.randn_like(y), g, o, dg, heads, length)
    if head_dim * qkvg.element_size() // 16 not in (1, 2, 4, 8):
        assert delta.numel() == 0
        return
    assert delta.shape == (batch * rows * heads * length,) and delta.dtype == torch.float32
    do_rows = do.unflatten(-1, (heads, -1))
    do_rows = do_rows.transpose(1, 2) if transposed else do_rows  # [B, N, L, H, D], as out
    products = do_rows.double() * out.double()
    expected = products.sum(-1).permute(0, 1, 3, 2)  # [B, N, H, L]
    bound = products.abs().sum(-1).permute(0, 1, 3, 2) * 2.0 ** -(10 if dtype == torch.float32 else 20)
    assert ((delta.view(expected.shape).double() - expected).abs() <= bound + 1e-6).all()


@pytest.mark.skipif(not HOPPER, reason="the gated forward is the sm90 family's")
def test_gated_forward_guards_its_output():
    # the extension's gated forward writes `gated` at its strides: a tensor of another shape, odd
    # strides or storage shared with its inputs is refused before any launch
    from evoformer_blocks.ops import cutlass
    from evoformer_blocks.ops._inputs import gated_views

    qkvg, heads, mask, pair = _gated_inputs(False, torch.bfloat16)
    q, k, v, g = gated_views(qkvg.detach(), heads, False)
    gate = g.unflatten(-1, (heads, -1))  # [B, A, A', H, D]: the attention's orientation, untransposed

    def run(gated):
        return cutlass._kernels().gated_forward(q, k, v, mask, pair, 0.25, "sm90", gate, gated)

    y = torch.empty_like(g)
    run(y.unflatten(-1, (heads, -1)))
    assert torch.isfinite(y).all()
    with pytest.raises(RuntimeError, match=r"`gated` must match .*gated: shape=\[1, 2, 3, 4, 32\] dtype=BFloat16 "
                                           r"device=cuda:\d+ stride=\[768, 384, 128, 32, 1\]"):
        run(torch.empty(1, 2, 3, heads, 32, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="`gated` must not share storage"):
        run(q)
    before = qkvg.detach().clone()
    with pytest.raises(RuntimeError, match="`gated` must not share storage"):
        run(gate)
    assert torch.equal(qkvg.detach(), before)
    with pytest.raises(RuntimeError, match="sm90 kernel family only"):  # the portable family has no gated epilogue
        cutlass._kernels().gated_forward(q, k, v, mask, pair, 0.25, "sm80", gate, y.unflatten(-1, (heads, -1)))


def test_gated_attention_ops_pass_opcheck():
    # the extension's gated attention ops against their schemas and fake implementations, traced as
    # torch.compile traces them
    from evoformer_blocks.ops import cutlass

    kernels = cutlass._kernels()
    for transposed in (False, True):
        qkvg, heads, mask, pair = _gated_inputs(transposed, torch.bfloat16, heads=2, c=16, a=6, a2=20)
        qkvg, pair = qkvg.detach(), pair.detach()
        family = cutlass.kernel_family(qkvg.device, qkvg.dtype)
        args = (qkvg, mask, pair, heads, transposed, 0.25, family)
        torch.library.opcheck(kernels.gated_attention_fwd.default, args)
        y, out, stats, mask_prepared, pair_prepared = kernels.gated_attention_fwd(*args)
        bwd_args = (torch.randn_like(y), qkvg, out, stats, mask_prepared, pair, pair_prepared,
                    heads, transposed, 0.25, family, None, True)
        torch.library.opcheck(kernels.gated_attention_bwd.default, bwd_args)


def run_with_grads(make, module, x, mask, dout, dtype, backend, device, **kwargs):
    """[output, x's gradient, every parameter's gradient] (float64, CPU) of a copy of `module`
    (make(backend) with its weights) on x and mask in dtype on device, with cotangent dout."""
    mod = make(backend)
    mod.load_state_dict(module.state_dict())
    mod = mod.to(device=device, dtype=dtype)
    xi = x.to(device, dtype).requires_grad_(True)
    out = mod(xi, mask.to(device, dtype), **kwargs)
    out.backward(dout.to(device, dtype))
    return [t.double().cpu() for t in (out, xi.grad, *(p.grad for p in mod.parameters()))]


def check_fused_path(monkeypatch, function, run, labels, dtype=torch.bfloat16):
    """run(dtype, backend, device) (run_with_grads of a module) goes through the autograd Function
    `function` in `dtype` on the default backend (counted) and not on eager; its results are within
    2x eager's error in the same dtype against float64 and bitwise repeatable."""
    calls = []
    apply = function.apply
    monkeypatch.setattr(function, "apply", lambda *a: calls.append(1) or apply(*a))
    ref = run(torch.float64, "eager", "cpu")
    eager = run(dtype, "eager", "cuda")
    assert not calls
    fused = run(dtype, None, "cuda")
    assert calls, f"{function.__name__} did not run"
    again = run(dtype, None, "cuda")
    assert all(torch.equal(f, a) for f, a in zip(fused, again)), "the fused path is not bitwise repeatable"
    assert_within_eager(labels, fused, eager, ref)


def scale_weights(module, *linears):
    with torch.no_grad():
        for lin in linears:
            lin.weight.mul_(lin.weight.shape[1] ** -0.5)
    return module


@pytest.mark.parametrize("n_res, chunk_size, batched, dtype", [
    (37, None, True, torch.bfloat16), (130, None, False, torch.bfloat16), (130, 48, True, torch.bfloat16),
    (37, None, False, torch.float16), (1, None, True, torch.bfloat16)])
def test_outer_product_mean_fused_projection(monkeypatch, n_res, chunk_size, batched, dtype):
    # linear_out on the outer product's [i, c, j, e] layout (c_hidden 32, c_z 128: the projection,
    # its input and weight gradients, no swap) against the eager backend's swap and linear in the same
    # dtype, both against float64: outputs and the gradients of m and every parameter within 2x
    # eager's error; rows past a 128-row tile (N_res 130), chunks (N_i != N_j), a single residue
    from evoformer_blocks import outer_product_mean as opm_module

    def make(backend=None):
        return eb.OuterProductMean(C_M, 128, 32, backend=backend)

    module = randomize(make())
    scale_weights(module, module.linear_1, module.linear_2, module.linear_out)
    gen = torch.Generator().manual_seed(5)
    shape = (2, N_SEQ, n_res) if batched else (N_SEQ, n_res)
    m = torch.randn(*shape, C_M, generator=gen)
    mask = (torch.rand(*shape, generator=gen) > 0.15).float()
    mask[..., 0, :] = 0.0  # a masked sequence
    dout = torch.randn(*shape[:-2], n_res, n_res, 128, generator=gen)
    run = partial(run_with_grads, make, module, m, mask, dout, chunk_size=chunk_size)
    labels = ["out", "dm"] + [name for name, _ in module.named_parameters()]
    check_composed_and_node(monkeypatch, opm_module._OuterProjection, run, labels, dtype)


def check_composed_and_node(monkeypatch, function, run, labels, dtype):
    """check_fused_path of the outer product mean's composed path (`function` its projection), and the
    module's node (ops.module_nodes, where it runs) bitwise equal to it."""

    def composed(dtype, backend, device):
        with module_nodes.composed():
            return run(dtype, backend, device)

    check_fused_path(monkeypatch, function, composed, labels, dtype)
    node, reference = run(dtype, None, "cuda"), composed(dtype, None, "cuda")
    assert all(torch.equal(a, b) for a, b in zip(node, reference)), "the node differs from the composed path"


@pytest.mark.parametrize("n_res, dtype", [(37, torch.bfloat16), (130, torch.float16)])
def test_outer_product_mean_residual_in_the_projection_epilogue(monkeypatch, n_res, dtype):
    # the block's path (residual + update): the projection's epilogue divides by the counts and adds
    # the residual; the output and the gradients of m, the residual and every parameter within 2x the
    # eager backend's error in the same dtype, against float64
    from evoformer_blocks import outer_product_mean as opm_module

    def make(backend=None):
        return eb.OuterProductMean(C_M, 128, 32, backend=backend)

    module = randomize(make())
    scale_weights(module, module.linear_1, module.linear_2, module.linear_out)
    gen = torch.Generator().manual_seed(11)
    m = torch.randn(2, N_SEQ, n_res, C_M, generator=gen)
    z = torch.randn(2, n_res, n_res, 128, generator=gen)
    mask = (torch.rand(2, N_SEQ, n_res, generator=gen) > 0.15).float()
    dout = torch.randn(2, n_res, n_res, 128, generator=gen)

    def run(dtype, backend, device):
        mod = make(backend)
        mod.load_state_dict(module.state_dict())
        mod = mod.to(device=device, dtype=dtype)
        mi, zi = (t.to(device, dtype).requires_grad_(True) for t in (m, z))
        out = mod._normalized(mod.layer_norm(mi), mask.to(device, dtype), None, residual=zi)
        out.backward(dout.to(device, dtype))
        return [t.double().cpu() for t in (out, mi.grad, zi.grad, *(p.grad for p in mod.parameters()))]

    epilogue = []
    apply = opm_module._OuterProjection.apply
    monkeypatch.setattr(opm_module._OuterProjection, "apply",
                        lambda *a: epilogue.append(a[3] is not None and a[4] is not None) or apply(*a))
    labels = ["out", "dm", "dz"] + [name for name, _ in module.named_parameters()]
    check_composed_and_node(monkeypatch, opm_module._OuterProjection, run, labels, dtype)
    assert epilogue and all(epilogue), "the projection did not take the division and the residual"


def opm_operands(gen, batch, n_res):
    """Float32 CUDA operands of the outer product mean's tile GEMMs: outer [*batch, 32, n_res, 32],
    weight [128, 1024], bias [128] and the output gradient dout [*batch, n_res, 128]."""
    outer = torch.randn(*batch, 32, n_res, 32, generator=gen).cuda()
    weight = (torch.randn(128, 1024, generator=gen) * 0.03).cuda()
    bias = torch.randn(128, generator=gen).cuda()
    dout = torch.randn(*batch, n_res, 128, generator=gen).cuda()
    return outer, weight, bias, dout


OPM_FAMILIES = ["sm80", "sm90"] if HOPPER else ["sm80"]


@pytest.mark.parametrize("family", OPM_FAMILIES)
@pytest.mark.parametrize("n_res", [37, 520, 700])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_outer_product_mean_tile_gemms(n_res, dtype, family):
    # the three tile GEMMs against float32 einsums, within 2x the error of the same products done by
    # PyTorch in the same dtype; partial last row tiles (37, 520, 700) and several of them; the
    # projection and its input gradient on each kernel family's tile GEMM, outputs poisoned first
    from evoformer_blocks.ops import _fused

    gen = torch.Generator().manual_seed(9)
    outer, weight, bias, dout = opm_operands(gen, (1, 2), n_res)
    # the epilogue's operands: denominators eps + a count of sequences, a residual
    denom = (torch.randint(1, 40, (1, 2, n_res), generator=gen) + 1e-3).cuda()
    residual = torch.randn(1, 2, n_res, 128, generator=gen).cuda()
    w3 = weight.view(128, 32, 32)  # [z, c, e]
    project = torch.einsum("bicje,zce->bijz", outer, w3) + bias
    refs = [project, torch.einsum("bijz,zce->bicje", dout, w3),
            torch.einsum("bijz,bicje->zce", dout, outer).reshape(128, 1024), residual + project / denom[..., None]]
    o, w, b, d, dn, r = (t.to(dtype) for t in (outer, weight, bias, dout, denom, residual))
    kernels = _fused.kernels()
    ours = [kernels.opm_project(o, w, b, None, None, family), kernels.opm_project_input_grad(d, w, family),
            kernels.opm_project_weight_grad(d, o, torch.float32), kernels.opm_project(o, w, b, dn, r, family)]
    again = kernels.opm_project(o, w, b, dn, r, family), kernels.opm_project_input_grad(d, w, family)
    assert torch.equal(again[0], ours[3]) and torch.equal(again[1], ours[1])  # (run to run)
    swapped = o.transpose(2, 3).reshape(1, 2, n_res, 1024)  # [b, i, j, (c e)]
    linear = torch.nn.functional.linear(swapped, w, b)
    torch_ = [linear, (d @ w).view(1, 2, n_res, 32, 32).transpose(2, 3),
              (d.reshape(-1, 128).t() @ swapped.reshape(-1, 1024)).float(), torch.addcdiv(r, linear, dn[..., None])]
    assert_within_eager(["project", "input grad", "weight grad", "project + epilogue"],
                        [t.double().cpu() for t in ours], [t.double().cpu() for t in torch_],
                        [t.double().cpu() for t in refs])


def test_outer_product_mean_projection_ops_pass_opcheck():
    # the projection's three ops against their schemas and fake implementations, traced as
    # torch.compile traces them
    from evoformer_blocks.ops import _fused

    kernels = _fused.kernels()
    outer, weight, bias, dout = (t.bfloat16() for t in opm_operands(torch.Generator().manual_seed(6), (2, 3), 37))
    denom = torch.rand(2, 3, 37, device="cuda").add(1.0).bfloat16()
    residual = torch.randn(2, 3, 37, 128, device="cuda").bfloat16()
    for family in OPM_FAMILIES:
        torch.library.opcheck(kernels.opm_project.default, (outer, weight, bias, None, None, family))
        torch.library.opcheck(kernels.opm_project.default, (outer, weight, None, None, None, family))
        torch.library.opcheck(kernels.opm_project.default, (outer, weight, bias, denom, residual, family))
        torch.library.opcheck(kernels.opm_project_input_grad.default, (dout, weight, family))
    torch.library.opcheck(kernels.opm_project_weight_grad.default, (dout, outer, torch.float32))


@pytest.mark.slow
def test_outer_product_mean_compiles_with_fused_projection():
    # torch.compile(fullgraph=True) runs the projection's tile GEMMs (the extension's ops) forward and
    # backward and matches the uncompiled module's output and gradients
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    module = randomize(eb.OuterProductMean(C_M, 128, 32))
    scale_weights(module, module.linear_1, module.linear_2, module.linear_out).cuda().bfloat16()
    gen = torch.Generator().manual_seed(8)
    m = torch.randn(2, N_SEQ, 45, C_M, generator=gen).cuda().bfloat16().requires_grad_(True)
    mask = (torch.rand(2, N_SEQ, 45, generator=gen) > 0.15).cuda().bfloat16()
    dout = torch.randn(2, 45, 45, 128, generator=gen).cuda().bfloat16()

    def out_and_grads(fn):
        out = fn(m, mask)
        return [out, *torch.autograd.grad(out, (m, *module.parameters()), dout)]

    expected = out_and_grads(module)
    compiled = torch.compile(module, fullgraph=True)
    out_and_grads(compiled)  # compile outside the profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = out_and_grads(compiled)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    tile_gemm = "opm_gemm_sm90_kernel" if cutlass.kernel_family() == "sm90" else "opm_gemm_kernel"
    assert any(tile_gemm in n for n in names) and any("opm_weight_grad_kernel" in n for n in names), names
    for a, e in zip(got, expected):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.float(), e.float(), atol=2e-2, rtol=2e-2)


