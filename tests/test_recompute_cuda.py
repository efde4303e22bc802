"""The stacks' recompute options on a GPU, on the fused kernels (the "auto" backend, cutlass where
it runs): full recomputation gives the outputs and gradients of the stack without checkpointing, and
every policy and ``checkpoint_last_group`` those of full recomputation, bit for bit, for all four
stacks, with dropout, with both kernel families on Hopper; the kept fused ops do not run in the
backward (counted); the bytes a block keeps, as measured, are the memory the policy holds after the
forward; the last group without checkpointing does not raise the stack's peak; graphed stacks
(``cuda_graphs``) with a policy and a budget equal the plain ones bit for bit; torch.compile of a
stack with a policy. The CPU side (eager backend, the budget's choice of groups, the settings) is
tests/test_recompute.py."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import evoformer_blocks as eb
from evoformer_blocks.ops import module_nodes
import test_af3_cuda as af3
import test_cuda_graphs as af2
from gpu import kernel_family, requires_sm80  # noqa: F401  (kernel_family: a fixture)

pytestmark = requires_sm80

STACKS = [eb.EvoformerStack, eb.ExtraMSAStack, eb.PairformerStack, eb.MSAModule]
NS = "evoformer_blocks_cuda"
ATTENTION_OPS = (f"{NS}::gated_attention_fwd", f"{NS}::forward")
TRIANGLE_OP = f"{NS}::triangle_multiplication_fwd"


def make_stack(cls, no_blocks=3, **kwargs):
    """bf16 on the GPU, random weights, the kernels' widths (the CUDA graph tests' stacks)."""
    if cls in (eb.PairformerStack, eb.MSAModule):
        return af3.make_stack(cls, no_blocks=no_blocks, **kwargs)
    return af2.make_stack(cls, no_blocks=no_blocks, **kwargs).to("cuda", torch.bfloat16)


def training_step(stack, seed):
    """Outputs, input gradients and parameter gradients of one step (dropout masks from seed)."""
    cls = type(stack)
    if cls in (eb.PairformerStack, eb.MSAModule):
        return af3.training_step(stack, cls, seed)
    return af2.training_step(stack, seed, torch.bfloat16)


def inputs(cls, seed):
    if cls in (eb.PairformerStack, eb.MSAModule):
        return af3.make_inputs(cls, seed)
    return af2.make_inputs(seed, "cuda", torch.bfloat16)


def configure(stack, recompute="full", recompute_budget_gib=None, checkpoint_last_group=True):
    stack.recompute, stack.recompute_budget_gib = recompute, recompute_budget_gib
    stack.checkpoint_last_group = checkpoint_last_group
    return stack


SETTINGS = [
    dict(recompute="attention"),
    dict(recompute="attention+triangle"),
    dict(recompute="full", checkpoint_last_group=False),
    dict(recompute="attention+triangle", checkpoint_last_group=False),
]


@pytest.mark.parametrize("cls", STACKS)
@pytest.mark.parametrize("dropout", [False, True], ids=["nodropout", "dropout"])
def test_policies_give_the_gradients_of_full_recomputation(cls, dropout, kernel_family):  # noqa: F811
    stack = make_stack(cls, blocks_per_ckpt=1).train(dropout)
    reference = training_step(stack, 0)
    for setting in SETTINGS:
        af2.assert_bitwise(training_step(configure(stack, **setting), 0), reference)
    # a budget of one block's kept outputs: the first call measures, the next ones keep in the last
    # checkpointed group only
    configure(stack, "attention+triangle", recompute_budget_gib=1.0)
    af2.assert_bitwise(training_step(stack, 0), reference)
    (per_block,) = stack._kept_bytes.values()
    assert per_block > 0
    stack.recompute_budget_gib = 1.5 * per_block / 2**30
    af2.assert_bitwise(training_step(stack, 0), reference)


@pytest.mark.parametrize("cls", STACKS)
@pytest.mark.parametrize("dropout", [False, True], ids=["nodropout", "dropout"])
def test_full_recomputation_gives_the_stack_without_checkpointing(cls, dropout, kernel_family):  # noqa: F811
    # a fully recomputed group's forward runs the fused ops on their inference paths (nothing
    # recorded), its backward a recorded rerun: the outputs and gradients of the stack without
    # checkpointing, bit for bit (groups of 1 and of 2 of 3 blocks)
    stack = make_stack(cls, blocks_per_ckpt=None).train(dropout)
    reference = training_step(stack, 0)
    for group in (1, 2):
        stack.blocks_per_ckpt = group
        af2.assert_bitwise(training_step(stack, 0), reference)


@pytest.mark.parametrize("cls", [eb.EvoformerStack, eb.PairformerStack])
def test_float32_and_autocast_give_the_gradients_of_full_recomputation(cls):
    # float32 weights: the attention on the TF32 kernels, the triangle updates on ATen (their fused
    # op takes 16-bit inputs); then the same under bf16 autocast
    stack = make_stack(cls, blocks_per_ckpt=1).float().train()
    for autocast in (False, True):
        results = []
        for setting in (dict(), dict(recompute="attention+triangle", checkpoint_last_group=False)):
            configure(stack, **setting)
            x, z, x_mask, pair_mask = (t.float() if t.is_floating_point() else t for t in inputs(cls, 0))
            x, z = (t.detach().requires_grad_(True) for t in (x, z))
            stack.zero_grad(set_to_none=True)
            torch.manual_seed(3)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                out = af2.as_tuple(stack(x, z, x_mask, pair_mask))
            af2.loss_of(out).backward()
            results.append([o.detach() for o in out] + [x.grad, z.grad] + [p.grad for p in stack.parameters()])
        af2.assert_bitwise(*results)


class ExecutedOps(TorchDispatchMode):
    """Counts the ops that run, by name. The recomputation's selective checkpointing mode sits above
    this one: an op it serves from the kept outputs never reaches here."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(stack) -> Counter:
    cls = type(stack)
    x, z, x_mask, pair_mask = inputs(cls, 0)
    loss = af2.loss_of(stack(x, z, x_mask, pair_mask))
    with ExecutedOps() as ops:
        loss.backward()
    return ops.counts


@pytest.mark.parametrize("cls", STACKS)
def test_the_kept_fused_ops_do_not_run_in_the_backward(cls):
    stack = make_stack(cls, blocks_per_ckpt=1).eval()

    def attention(counts):
        return sum(counts[name] for name in ATTENTION_OPS)

    full = backward_ops(configure(stack))
    assert attention(full) > 0 and full[TRIANGLE_OP] > 0  # the fused ops ran, and full recomputation runs them again
    kept = backward_ops(configure(stack, "attention"))
    assert attention(kept) == 0 and kept[TRIANGLE_OP] == full[TRIANGLE_OP]
    kept = backward_ops(configure(stack, "attention+triangle"))
    assert attention(kept) == 0 and kept[TRIANGLE_OP] == 0
    # (a policy's groups run the kept ops at their own call sites, composed: fewer ops run than where
    # full recomputation composes them too; the modules' nodes hide their inner calls from the count,
    # and the detaches of torch.utils.checkpoint's hooks, which only the policies run under, are not
    # counted)
    with module_nodes.composed():
        full_composed = backward_ops(configure(stack))
    assert sum(kept.values()) - kept["aten::detach"] < sum(full_composed.values()) - full_composed["aten::detach"]
    # the last of the three groups without checkpointing: it does not run again at all
    last = backward_ops(configure(stack, checkpoint_last_group=False))
    assert 3 * attention(last) == 2 * attention(full) and 3 * last[TRIANGLE_OP] == 2 * full[TRIANGLE_OP]


@pytest.mark.parametrize("recompute", ["attention", "attention+triangle"])
def test_the_measured_bytes_are_what_the_forward_keeps(recompute):
    stack = make_stack(eb.EvoformerStack, no_blocks=4, blocks_per_ckpt=1).train()

    def held_after_forward():
        """The memory the stack holds from its forward to its backward (its outputs included)."""
        x, z, x_mask, pair_mask = inputs(eb.EvoformerStack, 1)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = stack(x, z, x_mask, pair_mask)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        af2.loss_of(out).backward()
        return held

    held_after_forward()  # warm-up: what the first call allocates for good (library workspaces, ...)
    full = held_after_forward()
    configure(stack, recompute, recompute_budget_gib=1000.0)
    held_after_forward()  # measures (group 0 recomputes in full)
    (per_block,) = stack._kept_bytes.values()
    extra = held_after_forward() - full  # every group keeps
    expected = 4 * per_block
    # (the allocator rounds each tensor up to 512 bytes: some 50 kept tensors per block)
    assert abs(extra - expected) <= 0.01 * expected + 4 * 64 * 512, (extra, expected)


@pytest.mark.parametrize("setting", ["last_group_kept", "last_group_selective"])
def test_the_last_group_kept_leaves_the_stacks_peak(setting):
    # the stack alone, its outputs into a loss: what the last group keeps from its forward (all of
    # it without checkpointing, or a policy's outputs within a budget of one block) is what its
    # recomputation would rebuild right before the same backward
    stack = make_stack(eb.EvoformerStack, no_blocks=4, blocks_per_ckpt=1).train()

    def peak():
        af2.training_step(stack, 0, torch.bfloat16, n_seq=16, n_res=48)  # warm-up (and the measurement)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        af2.training_step(stack, 0, torch.bfloat16, n_seq=16, n_res=48)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    full = peak()
    if setting == "last_group_kept":
        configure(stack, checkpoint_last_group=False)
    else:
        configure(stack, "attention+triangle", recompute_budget_gib=1000.0)
        peak()
        (per_block,) = stack._kept_bytes.values()
        stack.recompute_budget_gib = 1.5 * per_block / 2**30  # the last group only
    assert peak() <= full * 1.02, (setting, full)


@pytest.mark.parametrize("cls", STACKS)
def test_graphed_stacks_with_a_policy_equal_the_plain_stack(cls):
    """The recomputation with kept outputs inside the backward graph: every step (the first plain,
    measuring the kept bytes; the second captured; then replays) equals the plain stack's bit for
    bit, with dropout, a budget of one block and the last group without checkpointing."""
    plain = make_stack(cls, blocks_per_ckpt=1).train()
    configure(plain, "attention+triangle", recompute_budget_gib=1.0, checkpoint_last_group=False)
    training_step(plain, 0)
    (per_block,) = plain._kept_bytes.values()
    plain.recompute_budget_gib = 1.5 * per_block / 2**30
    graphed = copy.deepcopy(plain)
    graphed.cuda_graphs = True
    for step in range(4):
        af2.assert_bitwise(training_step(graphed, step), training_step(plain, step))
    assert graphed._graphs.replays >= 2
    reference = configure(copy.deepcopy(plain))  # full recomputation, every group checkpointed
    af2.assert_bitwise(training_step(graphed, 7), training_step(reference, 7))


def test_compiled_stack_with_a_policy():
    # PyTorch's selective checkpointing of the fused ops, traced and partitioned by torch.compile
    # (aot_eager: the same kernels run, so the results are the uncompiled ones up to the traced
    # graph's ATen decompositions; the fused ops under inductor are test_modules_cuda's
    # test_blocks_compile_fullgraph_on_cutlass)
    torch._dynamo.reset()
    stack = make_stack(eb.EvoformerStack, no_blocks=2, blocks_per_ckpt=1).eval()
    configure(stack, "attention+triangle", checkpoint_last_group=False)
    expected = training_step(stack, 0)
    got = training_step(torch.compile(stack, backend="aot_eager", fullgraph=True), 0)
    for a, e in zip(got, expected):
        assert torch.isfinite(a.float()).all()
        torch.testing.assert_close(a.float(), e.float(), rtol=2**-7, atol=2**-7 * e.float().abs().max().item())
