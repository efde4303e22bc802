"""The per-module autograd nodes (evoformer_blocks.ops.module_nodes) against the composed ops they stand
for (GPU only): outputs and every gradient equal bit for bit, for each gated attention module and
variant, dtype, batch shape, with and without a mask, with frozen parameters and without grad, and
for the AF2 transitions; the node runs where it should and the composed path everywhere else
(autocast, the eager backend, a recompute policy keeping the attention); whole blocks equal either
way. The triangle multiplications' node against the op's Python path the same way, for each entry
point the block uses, with and without biases, frozen parameters and grad; the op runs where the
node cannot. The layer norms' C++ nodes (``ops.add_layer_norm``, ``ops.layer_norm_keeping_input``)
against their Python-level nodes the same way, for each dtype, parameter dtype, residual scale and
set of outputs used.
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch

import evoformer_blocks as eb
from evoformer_blocks.ops import _dispatch, _keep, module_nodes
from evoformer_blocks.ops.cutlass import GATED_FORWARD_OP
from evoformer_blocks.ops.triangle import FUSED_OP as TRIANGLE_FUSED_OP
from evoformer_blocks.pairformer import AttentionPairBias
from evoformer_blocks.primitives import separate_storages
from gpu import kernel_family, requires_sm80  # noqa: F401  (kernel_family: a fixture)
from test_modules_cuda import randomize, scale_weights

pytestmark = requires_sm80

C_M, C_Z, C_S, C = 64, 32, 48, 16
N_SEQ, N_RES = 12, 37
NODE = "GatedAttentionNode"

# name -> (the module, its inputs: "msa" m [*, S, R, c_m]; "row" m and z; "pair" z [*, R, R, c_z];
# "single" s [*, R, c_s] and z)
MODULES = {
    "msa_row": (lambda: eb.MSARowAttentionWithPairBias(C_M, C_Z, C, 4), "row"),
    "msa_column": (lambda: eb.MSAColumnAttention(C_M, C, 4), "msa"),
    "triangle_start": (lambda: eb.TriangleAttentionStartingNode(C_Z, C, 2), "pair"),
    "triangle_end": (lambda: eb.TriangleAttentionEndingNode(C_Z, C, 2), "pair"),
    "triangle_start_no_bias": (lambda: eb.TriangleAttentionStartingNode(C_Z, C, 2, bias=False), "pair"),
    "triangle_end_no_bias": (lambda: eb.TriangleAttentionEndingNode(C_Z, C, 2, bias=False), "pair"),
    "triangle_end_bias_ik": (lambda: eb.TriangleAttentionEndingNode(C_Z, C, 2, bias_ik=True), "pair"),
    "attention_pair_bias": (lambda: AttentionPairBias(C_S, C_Z, C, 4), "single"),
}


def inputs(kind: str, batch: tuple, masked: bool, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*batch, *shape, generator=gen).to("cuda", dtype)

    def mask(*shape):
        m = (torch.rand(*batch, *shape, generator=gen) > 0.2).to("cuda", dtype)
        m[(0,) * (len(batch) + 1)] = 0.0  # a fully masked row
        return m

    z = rand(N_RES, N_RES, C_Z)
    if kind == "msa":
        args = [rand(N_SEQ, N_RES, C_M)]
    elif kind == "row":
        args = [rand(N_SEQ, N_RES, C_M), z]
    elif kind == "pair":
        args = [z]
    else:
        args = [rand(N_RES, C_S), z]
    shape = {"msa": (N_SEQ, N_RES), "row": (N_SEQ, N_RES), "pair": (N_RES, N_RES), "single": (N_RES,)}[kind]
    return args, mask(*shape) if masked else None


def step(module, args, mask, *, frozen=(), grad=True):
    """(output, gradients of the inputs and of every parameter requiring grad) of a loss of the output."""
    for name, param in module.named_parameters():
        param.requires_grad_(not any(name.startswith(f) for f in frozen))
    args = [a.detach().clone().requires_grad_(grad) for a in args]
    with torch.set_grad_enabled(grad):
        out = module(*args, mask=mask)
    if not grad:
        return out, [], None
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.device)
    leaves = args + [p for p in module.parameters() if p.requires_grad]
    grads = torch.autograd.grad((out.float() * weight).sum(), leaves)
    return out, list(grads), out.grad_fn


def node_name(grad_fn) -> str:
    return "" if grad_fn is None else grad_fn.name()


def graph_names(grad_fn) -> set:
    """The names of every node of the autograd graph below ``grad_fn``."""
    names, stack, seen = set(), [grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(fn.name())
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return names


def ran(grad_fn, node: str = NODE) -> bool:
    """Whether the autograd graph below ``grad_fn`` holds the node ``node``."""
    return any(node in name for name in graph_names(grad_fn))


def assert_bitwise(a_list, b_list, what):
    assert len(a_list) == len(b_list), what
    for i, (a, b) in enumerate(zip(a_list, b_list)):
        assert torch.isfinite(a.float()).all(), f"{what}: item {i} is not finite"
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), f"{what}: item {i} layout"
        assert torch.equal(a, b), f"{what}: item {i} differs by {(a.float() - b.float()).abs().max().item()}"


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_node_equals_the_composed_ops(name, dtype, kernel_family):
    make, kind = MODULES[name]
    module = randomize(make()).to("cuda", dtype)
    for batch, masked in (((), True), ((1,), True), ((2,), True), ((2,), False)):
        args, mask = inputs(kind, batch, masked, dtype)
        out, grads, grad_fn = step(module, args, mask)
        assert ran(grad_fn), f"{name}: the node did not run ({node_name(grad_fn)})"
        with module_nodes.composed():
            ref_out, ref_grads, ref_fn = step(module, args, mask)
        assert not ran(ref_fn)
        assert_bitwise([out, *grads], [ref_out, *ref_grads], f"{name} batch {batch} mask {masked}")


@pytest.mark.parametrize("name", ["msa_row", "triangle_end", "attention_pair_bias"])
@pytest.mark.parametrize("frozen", [("linear_o",), ("linear_q", "linear_k", "linear_v", "linear_g"),
                                    ("linear_", "layer_norm")], ids=["output", "projections", "all-linears"])
def test_node_with_frozen_parameters(name, frozen):
    make, kind = MODULES[name]
    module = randomize(make()).to("cuda", torch.bfloat16)
    args, mask = inputs(kind, (2,), True, torch.bfloat16, seed=1)
    out, grads, _ = step(module, args, mask, frozen=frozen)
    with module_nodes.composed():
        ref_out, ref_grads, _ = step(module, args, mask, frozen=frozen)
    assert_bitwise([out, *grads], [ref_out, *ref_grads], f"{name} frozen {frozen}")


@pytest.mark.parametrize("batch", [(), (1,), (2,)], ids=["unbatched", "batch1", "batch2"])
@pytest.mark.parametrize("frozen", [(), ("linear_z",), ("layer_norm_z", "linear_z"), ("linear_", "layer_norm_m")],
                         ids=["none", "linear_z", "z-branch", "m-branch"])
def test_row_attention_pair_bias_in_the_node(batch, frozen):
    """The MSA row attention of one batch element projects its pair bias inside the node (no separate
    GEMM node); with more it takes the projected bias: either way equal to the composed ops."""
    make, kind = MODULES["msa_row"]
    module = randomize(make()).to("cuda", torch.bfloat16)
    args, mask = inputs(kind, batch, True, torch.bfloat16, seed=6)
    out, grads, grad_fn = step(module, args, mask, frozen=frozen)
    assert ran(grad_fn)
    assert bool({"MmBackward0", "BmmBackward0"} & graph_names(grad_fn)) == (batch == (2,))
    with module_nodes.composed():
        ref_out, ref_grads, _ = step(module, args, mask, frozen=frozen)
    assert_bitwise([out, *grads], [ref_out, *ref_grads], f"batch {batch} frozen {frozen}")
    m, z = args  # z without grad, m with
    with module_nodes.composed():
        ref = module(m.requires_grad_(True), z, mask=mask)
        (ref_dm,) = torch.autograd.grad(ref.float().sum(), [m])
    out = module(m, z, mask=mask)
    (dm,) = torch.autograd.grad(out.float().sum(), [m])
    assert_bitwise([out, dm], [ref, ref_dm], f"batch {batch} z without grad")


@pytest.mark.parametrize("name", ["msa_row", "triangle_start"])
def test_node_gradient_of_a_soft_mask(name):
    """A float mask that requires grad gets the same gradient through the node."""
    make, kind = MODULES[name]
    module = randomize(make()).to("cuda", torch.bfloat16)
    args, mask = inputs(kind, (2,), True, torch.bfloat16, seed=2)
    results = []
    for composed in (False, True):
        soft = (mask * 0.5 + 0.25).float().requires_grad_(True)
        with module_nodes.composed() if composed else torch.enable_grad():
            out = module(*args, mask=soft)
        (grad,) = torch.autograd.grad(out.float().sum(), [soft])
        results.append([out, grad])
    assert_bitwise(results[0], results[1], f"{name} soft mask")


@pytest.mark.parametrize("name", list(MODULES))
def test_node_without_grad(name):
    make, kind = MODULES[name]
    module = randomize(make()).to("cuda", torch.bfloat16)
    args, mask = inputs(kind, (2,), True, torch.bfloat16, seed=3)
    with torch.inference_mode():
        out = module(*args, mask=mask)
        with module_nodes.composed():
            ref = module(*args, mask=mask)
    assert_bitwise([out], [ref], f"{name} inference")
    out, _, _ = step(module, args, mask, grad=False)
    assert_bitwise([out], [ref], f"{name} no_grad")


def test_the_composed_path_runs_where_the_node_cannot():
    make, kind = MODULES["msa_row"]
    module = randomize(make()).to("cuda", torch.bfloat16)
    args, mask = inputs(kind, (2,), True, torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert not ran(step(module, args, mask)[2])
    with eb.ops.backend("eager"):
        assert not ran(step(module, args, mask)[2])
    kept = _keep.Kept(ops=(GATED_FORWARD_OP,), regions=(), count_only=True)
    with _keep.Keeping(kept):
        assert not ran(step(module, args, mask)[2])
    assert kept.bytes > 0  # the composed op's call site saw the call
    assert ran(step(module, args, mask)[2])


TRANSITIONS = {
    "msa_transition": (lambda: eb.MSATransition(C_M, 4), (N_SEQ, N_RES, C_M)),
    "pair_transition": (lambda: eb.PairTransition(C_Z, 2), (N_RES, N_RES, C_Z)),
}


@pytest.mark.parametrize("name", list(TRANSITIONS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_transition_node_equals_the_composed_ops(name, dtype):
    make, shape = TRANSITIONS[name]
    module = randomize(make()).to("cuda", dtype)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, *shape, generator=gen).to("cuda", dtype)
    mask = (torch.rand(2, *shape[:-1], generator=gen) > 0.2).to("cuda", dtype)
    for frozen in ((), ("linear_1",), ("linear_2",)):
        out, grads, grad_fn = step(module, [x], mask, frozen=frozen)
        assert ran(grad_fn, "TransitionNode"), f"{name}: the node did not run"
        with module_nodes.composed():
            ref_out, ref_grads, ref_fn = step(module, [x], mask, frozen=frozen)
        assert not ran(ref_fn, "TransitionNode")
        assert_bitwise([out, *grads], [ref_out, *ref_grads], f"{name} frozen {frozen}")
    with torch.no_grad():
        out = module(x, mask)
        with module_nodes.composed():
            ref = module(x, mask)
    assert_bitwise([out], [ref], f"{name} no_grad")


BLOCK_SIZES = dict(c_m=32, c_z=16, c_hidden_msa_att=8, c_hidden_opm=8, c_hidden_mul=16, c_hidden_pair_att=8,
                   no_heads_msa=4, no_heads_pair=2, msa_dropout=0.0, pair_dropout=0.0)
# name -> (the block, its first input's width, c_z); "EvoformerBlock_opm" has the sizes the outer product
# mean's node takes (c_hidden_opm 32, c_z 128)
BLOCKS = {
    "EvoformerBlock": (partial(eb.EvoformerBlock, **BLOCK_SIZES), 32, 16),
    "EvoformerBlock_opm": (partial(eb.EvoformerBlock, **{**BLOCK_SIZES, "c_z": 128, "c_hidden_opm": 32}), 32, 128),
    "PairformerBlock": (partial(eb.PairformerBlock, c_s=32, c_z=16, c_hidden_pair_bias=8, no_heads_pair_bias=4,
                                c_hidden_mul=16, c_hidden_pair_att=8, no_heads_pair=2, pair_dropout=0.0), 32, 16),
}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_equals_the_composed_block(name):
    make, width, c_z = BLOCKS[name]
    block = randomize(make()).to("cuda", torch.bfloat16)
    gen = torch.Generator().manual_seed(7)
    first = (torch.randn(6, 21, width, generator=gen) if name.startswith("EvoformerBlock")
             else torch.randn(21, width, generator=gen)).to("cuda", torch.bfloat16)
    z = torch.randn(21, 21, c_z, generator=gen).to("cuda", torch.bfloat16)
    first_mask = (torch.rand(first.shape[:-1], generator=gen) > 0.1).to("cuda", torch.bfloat16)
    pair_mask = (torch.rand(21, 21, generator=gen) > 0.1).to("cuda", torch.bfloat16)

    def run():
        leaves = [first.clone().requires_grad_(True), z.clone().requires_grad_(True)]
        outs = block(*leaves, first_mask, pair_mask)
        loss = sum((o.float() * torch.linspace(-1, 1, o.shape[-1], device="cuda")).sum() for o in outs)
        return [*outs, *torch.autograd.grad(loss, leaves + list(block.parameters()))]

    results = run()
    with module_nodes.composed():
        reference = run()
    assert_bitwise(results, reference, name)
    if name == "EvoformerBlock_opm":
        leaves = [first.clone().requires_grad_(True), z.clone().requires_grad_(True)]
        assert ran(block(*leaves, first_mask, pair_mask)[1].grad_fn, OPM_NODE)


# an Evoformer block whose every module runs its node (the outer product mean's sizes as above), with
# the AF2 dropout rates
ONE_CALL_BLOCK = {**BLOCK_SIZES, "c_z": 128, "c_hidden_opm": 32, "msa_dropout": 0.15, "pair_dropout": 0.25}


def block_run(block, m, z, msa_mask, pair_mask, *, grad: bool = True):
    """(outputs and the gradients of a loss of them by m, z and every parameter; the node ops the call
    made from Python), with the dropout masks drawn from one seed."""
    torch.manual_seed(3)
    leaves = [m.clone().requires_grad_(grad), z.clone().requires_grad_(grad)]
    before = _dispatch.nodes_run()
    with torch.set_grad_enabled(grad):
        outs = block(*leaves, msa_mask, pair_mask)
    nodes = _dispatch.nodes_run() - before
    if not grad:
        return list(outs), nodes
    loss = sum((o.float() * torch.linspace(-1, 1, o.shape[-1], device="cuda")).sum() for o in outs)
    return [*outs, *torch.autograd.grad(loss, leaves + list(block.parameters()))], nodes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch", [(), (1,), (2,)], ids=["unbatched", "batch1", "batch2"])
@pytest.mark.parametrize("mode", ["train", "eval", "no_grad"])
def test_block_as_one_call_equals_its_modules(dtype, batch, mode):
    """The block's update as one extension call (after the first call of a signature, which runs the
    modules and finds that each ran its node) against the modules' nodes called from Python: outputs and
    gradients equal bit for bit, the same dropout masks. With a batch of two the row attention's pair
    bias has no node (one batch element only), so the block keeps calling its modules."""
    block = randomize(eb.EvoformerBlock(**ONE_CALL_BLOCK)).to("cuda", dtype).train(mode == "train")
    gen = torch.Generator().manual_seed(7)
    m = torch.randn(*batch, 6, 21, 32, generator=gen).to("cuda", dtype)
    z = torch.randn(*batch, 21, 21, 128, generator=gen).to("cuda", dtype)
    msa_mask = (torch.rand(*batch, 6, 21, generator=gen) > 0.1).to("cuda", dtype)
    pair_mask = (torch.rand(*batch, 21, 21, generator=gen) > 0.1).to("cuda", dtype)
    grad = mode != "no_grad"
    _, first = block_run(block, m, z, msa_mask, pair_mask, grad=grad)
    results, nodes = block_run(block, m, z, msa_mask, pair_mask, grad=grad)
    with module_nodes.per_module():
        reference, reference_nodes = block_run(block, m, z, msa_mask, pair_mask, grad=grad)
    one_call = batch != (2,)
    assert (first, reference_nodes) == ((17, 17) if one_call else (16, 16))
    assert nodes == (0 if one_call else 16), "the one-call update ran where it should not, or not where it should"
    assert_bitwise(results, reference, f"one call, {mode}")


def test_block_one_call_decision_follows_the_settings():
    """The decision is per signature and setting: a new dtype after block.half() is decided again, the
    eager backend (no nodes) keeps the modules, and so do the forms the op does not cover (the extra-MSA
    block's global column attention, AF2-Multimer's outer product mean first)."""
    block = randomize(eb.EvoformerBlock(**ONE_CALL_BLOCK)).to("cuda", torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(9)
    m, z = torch.randn(6, 21, 32, generator=gen), torch.randn(21, 21, 128, generator=gen)
    msa_mask, pair_mask = torch.ones(6, 21, device="cuda"), torch.ones(21, 21, device="cuda")

    def nodes(module, dtype):
        return [block_run(module, m.to("cuda", dtype), z.to("cuda", dtype), msa_mask, pair_mask)[1]
                for _ in range(2)]

    assert nodes(block, torch.bfloat16) == [17, 0]
    block.half()
    assert nodes(block, torch.float16) == [17, 0]
    with eb.ops.backend("eager"):
        assert nodes(block, torch.float16) == [0, 0]
    assert nodes(block, torch.float16) == [0, 0]
    for other in (eb.ExtraMSABlock(**ONE_CALL_BLOCK), eb.EvoformerBlock(**ONE_CALL_BLOCK, opm_first=True)):
        other = randomize(other).to("cuda", torch.bfloat16).eval()
        counts = nodes(other, torch.bfloat16)
        assert counts[0] == counts[1] > 0


TRIANGLE_NODE = "TriangleNode"


def ran_node(names: set, node: str = TRIANGLE_NODE) -> bool:
    """Whether the autograd node names ``names`` hold ``node``'s (C++ nodes are named by their type)."""
    return any(node in name for name in names)

TRIANGLE_MULS = {
    "outgoing": lambda: eb.TriangleMultiplicationOutgoing(C_Z, C),
    "incoming": lambda: eb.TriangleMultiplicationIncoming(C_Z, C),
    "outgoing_no_bias": lambda: eb.TriangleMultiplicationOutgoing(C_Z, C, bias=False),
}
# what the module returns: its forward (the update); the block's entry points (z, update) and z +
# update, the latter also with a dropout keep-mask of one row [*, 1, N_res, c_z] as its scale
TRIANGLE_MODES = ("update", "keeping_input", "adding", "adding_scaled")


def triangle_call(module, z, mask, mode: str, scale=None):
    """The module's result in ``mode`` as a list of tensors."""
    if mode == "update":
        return [module(z, mask)]
    if mode == "keeping_input":
        return list(module._keeping_input(z, mask))
    return [module._adding_to_input(z, mask, scale if mode == "adding_scaled" else None)]


def triangle_step(module, z, mask, mode, scale=None, *, frozen=(), z_grad=True):
    """(the outputs, the gradients of z (where it requires grad) and of the parameters requiring grad
    of a loss of the outputs, the outputs' autograd node names)."""
    for name, param in module.named_parameters():
        param.requires_grad_(not any(name.startswith(f) for f in frozen))
    z = z.detach().clone().requires_grad_(z_grad)
    outs = triangle_call(module, z, mask, mode, scale)
    gen = torch.Generator().manual_seed(6)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen).to("cuda")).sum() for o in outs)
    leaves = ([z] if z_grad else []) + [p for p in module.parameters() if p.requires_grad]
    names = set().union(*(graph_names(o.grad_fn) for o in outs))
    return outs + (list(torch.autograd.grad(loss, leaves)) if leaves else []), names


def triangle_inputs(batch: tuple, masked: bool, dtype, seed: int = 8):
    """z [*, N_res, N_res, c_z], its mask or None, a row dropout keep-mask [*, 1, N_res, c_z]."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(*batch, N_RES, N_RES, C_Z, generator=gen).to("cuda", dtype)
    mask = (torch.rand(*batch, N_RES, N_RES, generator=gen) > 0.2).to("cuda", dtype) if masked else None
    keep = ((torch.rand(*batch, 1, N_RES, C_Z, generator=gen) > 0.25).float() / 0.75).to("cuda", dtype)
    return z, mask, keep


@pytest.mark.parametrize("name", list(TRIANGLE_MULS))
@pytest.mark.parametrize("mode", TRIANGLE_MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triangle_node_equals_the_op(name, mode, dtype, kernel_family):
    # the C++ node (weights stacked in C++) against the op's Python path: outputs and every gradient
    # bitwise, for batch shapes, masks, frozen parameters
    module = randomize(TRIANGLE_MULS[name]()).to("cuda", dtype)
    for batch, masked, frozen in (((), True, ()), ((2,), True, ()), ((2,), False, ()),
                                  ((), True, ("linear_a_p", "linear_b_g", "layer_norm_out")),
                                  ((), True, ("linear_", "layer_norm"))):
        z, mask, keep = triangle_inputs(batch, masked, dtype)
        results, names = triangle_step(module, z, mask, mode, keep, frozen=frozen)
        assert ran_node(names), f"{name} {mode}: the node did not run ({names})"
        with module_nodes.composed():
            reference, ref_names = triangle_step(module, z, mask, mode, keep, frozen=frozen)
        assert not ran_node(ref_names)
        assert_bitwise(results, reference, f"{name} {mode} batch {batch} mask {masked} frozen {frozen}")


@pytest.mark.parametrize("mode", TRIANGLE_MODES)
def test_triangle_node_without_grad(mode):
    module = randomize(TRIANGLE_MULS["incoming"]()).to("cuda", torch.bfloat16)
    z, mask, keep = triangle_inputs((2,), True, torch.bfloat16, seed=9)
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            out = triangle_call(module, z, mask, mode, keep)
            with module_nodes.composed():
                ref = triangle_call(module, z, mask, mode, keep)
        assert_bitwise(out, ref, f"{mode} {context.__name__}")
        if mode == "keeping_input":
            assert out[0] is z
    # z without grad and every parameter frozen: nothing to record, the forward without a backward
    results, names = triangle_step(module, z, mask, mode, keep, frozen=("linear_", "layer_norm"), z_grad=False)
    assert not names and all(r.grad_fn is None for r in results)
    with module_nodes.composed():
        reference, _ = triangle_step(module, z, mask, mode, keep, frozen=("linear_", "layer_norm"), z_grad=False)
    assert_bitwise(results, reference, f"{mode} nothing recorded")


def test_triangle_op_runs_where_the_node_cannot():
    # the same results through the op's Python path: fused input projections (AF2-Multimer), a scale
    # that is not one row, a z that is not contiguous, autocast, the eager backend, a recompute policy
    # keeping the op's outputs
    module = randomize(TRIANGLE_MULS["outgoing"]()).to("cuda", torch.bfloat16)
    z, mask, keep = triangle_inputs((), True, torch.bfloat16, seed=10)
    assert ran_node(triangle_step(module, z, mask, "adding_scaled", keep)[1])
    fused = eb.FusedTriangleMultiplicationOutgoing(C_Z, C).to("cuda", torch.bfloat16)
    assert not ran_node(triangle_step(fused, z, mask, "keeping_input")[1])
    column_keep = keep.transpose(-2, -3).contiguous()  # [N_res, 1, c_z]: not one row shared by all rows i
    results, names = triangle_step(module, z, mask, "adding_scaled", column_keep)
    assert not ran_node(names)
    with module_nodes.composed():
        reference, _ = triangle_step(module, z, mask, "adding_scaled", column_keep)
    assert_bitwise(results, reference, "column scale")
    z_t = z.transpose(0, 1)  # not contiguous
    out = module._keeping_input(z_t, mask)
    assert not ran_node(graph_names(out[1].grad_fn))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert not ran_node(triangle_step(module, z, mask, "update")[1])
    with eb.ops.backend("eager"):
        assert not ran_node(triangle_step(module, z, mask, "update")[1])
    kept = _keep.Kept(ops=(TRIANGLE_FUSED_OP,), regions=(), count_only=True)
    with _keep.Keeping(kept):
        assert not ran_node(triangle_step(module, z, mask, "adding")[1])
    assert kept.bytes > 0  # the op's call site saw the call


NORM_NODE = "AddLayerNormNode"  # (the C++ node of ops.add_layer_norm and ops.layer_norm_keeping_input)


def _norm_parameters(kind: str, width: int, dtype, gen):
    """(weight, bias) of a layer norm: in x's dtype, in float32, weight only, none."""
    if kind == "none":
        return None, None
    pdtype = torch.float32 if kind == "float32" else dtype
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to("cuda", pdtype)
    bias = None if kind == "weight_only" else (0.1 * torch.randn(width, generator=gen)).to("cuda", pdtype)
    return weight, bias


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("params", ["same", "float32", "weight_only", "none"])
@pytest.mark.parametrize("scale", [None, "row_mask", "dropout", "scale_grad"])
@pytest.mark.parametrize("outputs", ["both", "y_only"])
@pytest.mark.parametrize("residual_bias", [False, True], ids=["", "residual_bias"])
def test_add_layer_norm_node_equals_the_function(dtype, params, scale, outputs, residual_bias):
    # ops.add_layer_norm on the cutlass backend: the C++ node against the Python Function (inside
    # module_nodes.composed()), sum, y and every gradient bitwise (with the residual's bias: its too)
    if residual_bias and params in ("float32", "none"):
        pytest.skip("the residual bias does not depend on the layer norm's parameters")
    gen = torch.Generator().manual_seed(11)
    shape = (2, 9, 24, 64)
    x, residual = (torch.randn(shape, generator=gen).to("cuda", dtype) for _ in range(2))
    weight, bias = _norm_parameters(params, shape[-1], dtype, gen)
    residual_scale = {
        None: None,
        "row_mask": (torch.rand(*shape[:-1], 1, generator=gen) > 0.3).to("cuda", dtype),
        "dropout": ((torch.rand(shape[0], 1, *shape[2:], generator=gen) > 0.25).float() / 0.75).to("cuda", dtype),
        "scale_grad": torch.rand(*shape[:-1], 1, generator=gen).to("cuda", dtype),
    }[scale]
    weights = [torch.randn(shape, generator=gen).to("cuda") for _ in range(2)]
    bias_of_residual = (0.5 * torch.randn(shape[-1], generator=gen)).to("cuda", dtype) if residual_bias else None

    def run():
        leaves = [x.clone().requires_grad_(True), residual.clone().requires_grad_(True)]
        leaves += [p.clone().requires_grad_(True) for p in (weight, bias) if p is not None]
        w_in, b_in = (leaves[2] if weight is not None else None,
                      leaves[3] if bias is not None else None)
        scale_in = residual_scale
        if scale == "scale_grad":
            scale_in = residual_scale.clone().requires_grad_(True)
            leaves.append(scale_in)
        rb_in = None
        if residual_bias:
            rb_in = bias_of_residual.clone().requires_grad_(True)
            leaves.append(rb_in)
        s, y = eb.ops.add_layer_norm(leaves[0], leaves[1], w_in, b_in, 1e-5, residual_scale=scale_in,
                                     residual_bias=rb_in, backend="cutlass")
        loss = (y.float() * weights[1]).sum()
        if outputs == "both":
            loss = loss + (s.float() * weights[0]).sum()
        return [s, y, *torch.autograd.grad(loss, leaves)], y.grad_fn

    results, grad_fn = run()
    assert ran(grad_fn, NORM_NODE), "the node did not run"
    with module_nodes.composed():
        reference, ref_fn = run()
    assert not ran(ref_fn, NORM_NODE)
    assert_bitwise(results, reference, f"add_layer_norm {params} {scale} {outputs}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("params", ["same", "float32", "none"])
@pytest.mark.parametrize("outputs", ["both", "y_only", "x_only"])
def test_layer_norm_keeping_input_node_equals_the_function(dtype, params, outputs):
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, 17, 128, generator=gen).to("cuda", dtype)
    weight, bias = _norm_parameters(params, 128, dtype, gen)
    weights = [torch.randn(x.shape, generator=gen).to("cuda") for _ in range(2)]

    def run():
        leaves = [x.clone().requires_grad_(True)] + [p.clone().requires_grad_(True) for p in (weight, bias)
                                                     if p is not None]
        kept, y = eb.ops.layer_norm_keeping_input(leaves[0], *(leaves[1:] or (None, None)), backend="cutlass")
        assert kept.data_ptr() == leaves[0].data_ptr() and torch.equal(kept, leaves[0])
        loss = {"both": lambda: (kept.float() * weights[0]).sum() + (y.float() * weights[1]).sum(),
                "y_only": lambda: (y.float() * weights[1]).sum(),
                "x_only": lambda: (kept.float() * weights[0]).sum() + 0 * y.float().sum()}[outputs]()
        return [kept, y, *torch.autograd.grad(loss, leaves)], y.grad_fn

    results, grad_fn = run()
    assert ran(grad_fn, NORM_NODE)
    with module_nodes.composed():
        reference, ref_fn = run()
    assert not ran(ref_fn, NORM_NODE)
    assert_bitwise(results, reference, f"layer_norm_keeping_input {params} {outputs}")


OPM_NODE = "OuterProductMeanNode"
OPM_C_M, OPM_HIDDEN, OPM_C_Z = 48, 32, 128  # (the node runs where linear_out is the fused projection)


def opm_inputs(batch: tuple, dtype, seed: int = 11):
    """(m [*, S, R, c_m], mask [*, S, R] with a fully masked sequence and residue, residual [*, R, R, c_z])."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(*batch, N_SEQ, N_RES, OPM_C_M, generator=gen).to("cuda", dtype)
    mask = (torch.rand(*batch, N_SEQ, N_RES, generator=gen) > 0.2).to("cuda", dtype)
    mask[..., 0, :] = 0.0
    mask[..., :, 1] = 0.0
    residual = torch.randn(*batch, N_RES, N_RES, OPM_C_Z, generator=gen).to("cuda", dtype)
    return m, mask, residual


def opm_parameters(module) -> list:
    """The parameters _normalized uses (not the layer norm's) that require grad."""
    return [p for name, p in module.named_parameters() if p.requires_grad and not name.startswith("layer_norm")]


def opm_step(module, m, mask, residual, *, frozen=(), grad=True):
    """(output, gradients of m, the residual and every parameter requiring grad, grad_fn) of the
    block's call (``_normalized`` from the normalised m, with or without the residual)."""
    for name, param in module.named_parameters():
        param.requires_grad_(not any(name.startswith(f) for f in frozen))
    m = m.detach().clone().requires_grad_(grad)
    residual = None if residual is None else residual.detach().clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out = module._normalized(m, mask, None, residual)
    if not grad:
        return out, [], None
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.device)
    leaves = [m] + ([] if residual is None else [residual]) + opm_parameters(module)
    return out, list(torch.autograd.grad((out.float() * weight).sum(), leaves)), out.grad_fn


def opm_module(**kwargs):
    """An OuterProductMean of the node's sizes with random weights scaled to keep float16 finite."""
    module = randomize(eb.OuterProductMean(OPM_C_M, OPM_C_Z, OPM_HIDDEN, **kwargs))
    return scale_weights(module, module.linear_1, module.linear_2, module.linear_out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch", [(), (1,), (2,)], ids=["unbatched", "batch1", "batch2"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
def test_opm_node_equals_the_composed_ops(dtype, batch, with_residual):
    module = opm_module().to("cuda", dtype)
    m, mask, residual = opm_inputs(batch, dtype)
    residual = residual if with_residual else None
    for frozen in ((), ("linear_out",), ("linear_1", "linear_2"), ("linear_1.bias",), ("linear_1.weight",)):
        out, grads, grad_fn = opm_step(module, m, mask, residual, frozen=frozen)
        assert ran(grad_fn, OPM_NODE), f"frozen {frozen}: the node did not run"
        with module_nodes.composed():
            ref_out, ref_grads, ref_fn = opm_step(module, m, mask, residual, frozen=frozen)
        assert not ran(ref_fn, OPM_NODE)
        assert_bitwise([out, *grads], [ref_out, *ref_grads], f"frozen {frozen}")
    # m without grad (only the parameters' gradients)
    module.requires_grad_(True)
    out = module._normalized(m, mask, None, residual)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.device)
    grads = torch.autograd.grad((out.float() * weight).sum(), opm_parameters(module))
    with module_nodes.composed():
        ref_out = module._normalized(m, mask, None, residual)
        ref_grads = torch.autograd.grad((ref_out.float() * weight).sum(), opm_parameters(module))
    assert_bitwise([out, *grads], [ref_out, *ref_grads], "m without grad")
    # the module's own forward (its layer norm, then the node) and no grad at all
    with torch.no_grad():
        out = module(m, mask)
        with module_nodes.composed():
            ref = module(m, mask)
    assert_bitwise([out], [ref], "no_grad")


def test_opm_node_sums_every_sequence():
    # 4,994 sequences (not a multiple of 256) and 12 residues: the outer product [384, 384] is a GEMM of
    # batch one that cuBLAS 13.0 computed without its last sequences (torch.bmm, float16, H200). The
    # node and the composed ops sum every sequence (the extension's batched rows_product), equal bit
    # for bit, within float16 rounding of the float32 module on the eager backend.
    dtype, seqs, res = torch.float16, 4994, 12
    module = opm_module().to("cuda", dtype)
    gen = torch.Generator().manual_seed(3)
    m = torch.randn(seqs, res, OPM_C_M, generator=gen)
    m[-256:] *= 4  # (the last sequences carry much of the sum)
    m = m.to("cuda", dtype)
    mask = (torch.rand(seqs, res, generator=gen) > 0.1).to("cuda", dtype)
    out, grads, grad_fn = opm_step(module, m, mask, None)
    assert ran(grad_fn, OPM_NODE)
    with module_nodes.composed():
        ref_out, ref_grads, _ = opm_step(module, m, mask, None)
    assert_bitwise([out, *grads], [ref_out, *ref_grads], "node against composed")
    reference = copy.deepcopy(module).float()
    with eb.ops.backend("eager"):
        expected = reference._normalized(m.float(), mask.float(), None)
    error = ((out.float() - expected).norm() / expected.norm()).item()
    assert error < 1e-2, f"output error {error:.2e} against the float32 module"


def test_opm_composed_path_runs_where_the_node_cannot():
    module = opm_module().to("cuda", torch.bfloat16)
    m, mask, residual = opm_inputs((1,), torch.bfloat16)
    assert ran(opm_step(module, m, mask, residual)[2], OPM_NODE)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert not ran(opm_step(module, m, mask, residual)[2], OPM_NODE)
    with eb.ops.backend("eager"):
        assert not ran(opm_step(module, m, mask, residual)[2], OPM_NODE)
    # a residual that is not contiguous, a mask requiring grad
    assert not ran(opm_step(module, m, mask, residual.transpose(-2, -3))[2], OPM_NODE)
    assert not ran(opm_step(module, m, mask.clone().requires_grad_(True), residual)[2], OPM_NODE)
    # chunked: the composed path (its GEMMs over fewer rows: equal up to rounding)
    chunked = module._normalized(m, mask, 5, residual)
    assert not ran(chunked.grad_fn, OPM_NODE)
    torch.testing.assert_close(chunked.float(), module._normalized(m, mask, None, residual).float(), rtol=2e-2,
                               atol=2e-2)
    # AF3's form and sizes the fused projection does not take
    af3 = opm_module(projection_bias=False, mean_first=True)
    assert not ran(opm_step(af3.to("cuda", torch.bfloat16), m, mask, residual)[2], OPM_NODE)
    narrow = randomize(eb.OuterProductMean(OPM_C_M, 64, 16)).to("cuda", torch.bfloat16)
    assert not ran(opm_step(narrow, m, mask, residual[..., :64].contiguous())[2], OPM_NODE)
    fp32 = opm_module().to("cuda")
    assert not ran(opm_step(fp32, m.float(), mask.float(), residual.float())[2], OPM_NODE)


# ---------------------------------------------------------------- stacked parameters read as views

def packed_case(name: str):
    """(the module on the GPU in bfloat16, its forward on fixed inputs as a closure, the stacks it reads
    as views where packed, the copies of its parameters it makes per forward all the same) for the
    nodes that stack parameters: a gated attention (q, k, v, g weights as a view; its [0, b_g] bias
    stack is a copy either way), a triangle multiplication (weights and biases), the outer product
    mean (weights and biases)."""
    if name == "msa_column":
        module = randomize(eb.MSAColumnAttention(C_M, C, 4)).to("cuda", torch.bfloat16)
        (m,), mask = inputs("msa", (), True, torch.bfloat16)
        return module, lambda: module(m.requires_grad_(True), mask=mask), 1, 1
    if name == "triangle_out":
        module = randomize(eb.TriangleMultiplicationOutgoing(C_Z, C)).to("cuda", torch.bfloat16)
        z, mask, _ = triangle_inputs((), True, torch.bfloat16)
        return module, lambda: module(z.requires_grad_(True), mask), 2, 0
    module = opm_module().to("cuda", torch.bfloat16)
    m, mask, residual = opm_inputs((), torch.bfloat16)
    return module, lambda: module._normalized(m.requires_grad_(True), mask, None, residual), 2, 0


def cat_calls(fn) -> tuple[int, torch.Tensor]:
    """(aten::cat calls of one call of ``fn``, its result) (torch.profiler, CPU events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return sum(1 for event in prof.events() if event.name == "aten::cat"), out


@pytest.mark.parametrize("name", ["msa_column", "triangle_out", "opm"])
def test_node_reads_packed_parameters_as_views(name):
    # the modules keep each stacked projection's parameters back to back (primitives.pack_rows): the
    # node stacks them as a view, no copy per call; parameters each in a storage of their own take
    # aten::cat as before. Outputs and every gradient are equal bit for bit either way.
    module, call, views, copies = packed_case(name)
    params = opm_parameters(module) if name == "opm" else list(module.parameters())  # (those the call uses)
    results = []
    for packed in (True, False):
        if not packed:
            separate_storages(module)  # (each parameter its own storage: the nodes stack them with aten::cat)
        cats, out = cat_calls(call)
        assert cats == copies + (0 if packed else views), f"{name}, packed {packed}: {cats} aten::cat calls"
        loss = (out.float() * torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).cuda()).sum()
        results.append([out, *torch.autograd.grad(loss, params)])
    assert_bitwise(results[0], results[1], name)


@pytest.mark.parametrize("name", ["msa_column", "triangle_out", "opm"])
def test_in_place_change_of_a_stacked_parameter_before_backward_raises(name):
    # the node saves the parameters behind a stack it read as a view, so that autograd's version check
    # catches a change between forward and backward (as for torch's own linear layers' saved weights)
    module, call, _, _ = packed_case(name)
    out = call()
    with torch.no_grad():
        module._stacked_groups()[0][1].mul_(2.0)  # (k's weight; a_g's; linear_2's)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()
