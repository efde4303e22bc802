"""The stacks' recompute options (evoformer_blocks.recompute) on CPU, eager backend: full
recomputation gives the stack without checkpointing (its forward unrecorded, each backward a
recorded rerun, also a second one and one for a few leaves, under DistributedDataParallel), and
every policy, budget and ``checkpoint_last_group`` gives the outputs and gradients of full
recomputation bit for bit (float32 and float64, dropout on and off, all four stacks, autocast); the
kept matrix products are really not recomputed (the ops the backward runs, counted); the budget goes
to the last groups and bounds the memory kept (live bytes of the ops' outputs, tracked); the last
group without checkpointing leaves a stack's own peak as it was but raises a trunk's when another
stack follows; the settings' checks, presets, copies and pickles, and torch.compile."""

from __future__ import annotations

import copy
import gc
import logging
import pickle
import weakref
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from evoformer_blocks import EvoformerStack, ExtraMSAStack, MSAModule, PairformerStack, cuda_graphs, recompute
from evoformer_blocks.config import PRESETS, get_config
from evoformer_blocks.ops import _fused, _keep
from test_af3 import msa_inputs, msa_module, pairformer, single_inputs
from test_evoformer import evoformer_stack, extra_msa_stack, inputs

F64 = torch.float64
KINDS = ["evoformer", "extra_msa", "pairformer", "msa_module"]
MAKERS = {"evoformer": evoformer_stack, "extra_msa": extra_msa_stack, "pairformer": pairformer, "msa_module": msa_module}


def make(kind, no_blocks=4, dtype=F64, **kwargs):
    return MAKERS[kind](no_blocks=no_blocks, **kwargs).to(dtype)


def make_inputs(kind, dtype=F64, seed=0):
    torch.manual_seed(seed)
    if kind == "pairformer":
        tensors = single_inputs()
    elif kind == "msa_module":
        tensors = msa_inputs()
    else:
        tensors = inputs(batch=(2,))
    x, z, x_mask, pair_mask = (t.to(dtype) for t in tensors)
    return x.requires_grad_(True), z.requires_grad_(True), x_mask, pair_mask


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def loss_of(out):
    return sum((o.float() * torch.linspace(-1, 1, o.shape[-1])).sum() for o in as_tuple(out))


def step(stack, kind, dtype=F64, seed=7):
    """Outputs, input gradients and parameter gradients of one call (dropout masks from ``seed``)."""
    x, z, x_mask, pair_mask = make_inputs(kind, dtype)
    torch.manual_seed(seed)
    out = stack(x, z, x_mask, pair_mask)
    stack.zero_grad(set_to_none=True)
    loss_of(out).backward()
    return [o.detach() for o in as_tuple(out)] + [x.grad, z.grad] + [p.grad for p in stack.parameters()]


def assert_bitwise(results, reference, what=""):
    assert len(results) == len(reference)
    for i, (a, b) in enumerate(zip(results, reference)):
        if a is None or b is None:
            assert a is None and b is None, f"{what}: item {i}: one gradient is None"
        else:
            assert torch.equal(a, b), f"{what}: item {i} differs by {(a - b).abs().max().item()}"


def per_block(stack) -> float:
    """The bytes a block keeps, as the stack measured them (one signature measured)."""
    (measured,) = stack._kept_bytes.values()
    return measured


# --------------------------------------------------------------------------------------------
# The same bits


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("dropout", [False, True], ids=["nodropout", "dropout"])
def test_every_setting_gives_the_gradients_of_full_recomputation(kind, dtype, dropout):
    stack = make(kind, dtype=dtype, blocks_per_ckpt=1).train(dropout)
    reference = step(stack, kind, dtype)
    settings = [
        dict(recompute="attention"),
        dict(recompute="attention+triangle"),
        dict(recompute="full", checkpoint_last_group=False),
        dict(recompute="attention+triangle", checkpoint_last_group=False),
        dict(recompute="attention", recompute_budget_gib=0.0),
    ]
    for setting in settings:
        for name, value in dict(dict(recompute_budget_gib=None, checkpoint_last_group=True), **setting).items():
            setattr(stack, name, value)
        assert_bitwise(step(stack, kind, dtype), reference, str(setting))
    # A budget of two blocks' kept outputs: the first call measures, the next ones use it.
    stack.recompute, stack.recompute_budget_gib = "attention+triangle", 2.5 * per_block(stack) / 2**30
    for _ in range(2):
        assert_bitwise(step(stack, kind, dtype), reference, "budget")
    if dropout:  # the masks act: another seed gives other gradients
        other = step(stack, kind, dtype, seed=8)
        assert not all(a is None or torch.equal(a, b) for a, b in zip(other, reference))


@pytest.mark.parametrize("blocks_per_ckpt", [2, 3])
def test_groups_of_several_blocks(blocks_per_ckpt):
    stack = make("evoformer", no_blocks=5, blocks_per_ckpt=blocks_per_ckpt).train()
    reference = step(stack, "evoformer")
    for policy in ("attention", "attention+triangle"):
        for last in (True, False):
            stack.recompute, stack.checkpoint_last_group = policy, last
            assert_bitwise(step(stack, "evoformer"), reference, f"{policy}, {last}")


def test_autocast_gives_the_gradients_of_full_recomputation():
    stack = make("evoformer", dtype=torch.float32, blocks_per_ckpt=1).train()
    results = []
    for setting in (dict(recompute="full"), dict(recompute="attention+triangle", checkpoint_last_group=False)):
        for name, value in setting.items():
            setattr(stack, name, value)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(step(stack, "evoformer", torch.float32))
    assert results[0][2].dtype == torch.bfloat16  # (autocast acted: s from the final linear)
    assert_bitwise(*results)


@pytest.mark.parametrize("kind", KINDS)
def test_full_recomputation_gives_the_stack_without_checkpointing(kind):
    # A fully recomputed group's forward runs unrecorded and its backward differentiates a recorded
    # rerun: the outputs and gradients of the stack without checkpointing, bit for bit (dropout on;
    # groups of 1, 2 and 3 of 4 blocks)
    stack = make(kind, blocks_per_ckpt=None).train()
    reference = step(stack, kind)
    for group in (1, 2, 3):
        stack.blocks_per_ckpt = group
        assert_bitwise(step(stack, kind), reference, f"blocks_per_ckpt={group}")


def test_a_recomputed_group_records_nothing_until_its_backward():
    # the forward runs the blocks without gradients (no graph, nothing saved but the group's inputs);
    # each backward reruns them with gradients, also a second one (retain_graph) and one asking for a
    # few leaves only
    stack = make("evoformer", no_blocks=2, blocks_per_ckpt=None).train()
    x, z, x_mask, pair_mask = make_inputs("evoformer")
    torch.manual_seed(7)
    reference = torch.autograd.grad(loss_of(stack(x, z, x_mask, pair_mask)), [z, *stack.parameters()])
    stack.blocks_per_ckpt = 1
    seen = []
    stack.blocks[0].outer_product_mean.linear_out.register_forward_hook(
        lambda *args: seen.append(torch.is_grad_enabled()))
    torch.manual_seed(7)
    out = stack(x, z, x_mask, pair_mask)
    assert seen == [False]
    assert all(type(o.grad_fn).__name__ == "_RecomputedGroupBackward" for o in out[:2])
    loss = loss_of(out)
    assert_bitwise(torch.autograd.grad(loss, [z], retain_graph=True), reference[:1], "z only")
    assert seen == [False, True]
    assert_bitwise(torch.autograd.grad(loss, [z, *stack.parameters()]), reference, "second backward")
    assert seen == [False, True, True]


@pytest.mark.parametrize("find_unused", [False, True])
def test_recomputed_groups_under_distributed_data_parallel(tmp_path, find_unused):
    # The parameters are inputs of each group's node: DistributedDataParallel's reducer sees every
    # one of them used, once, and its gradients equal the plain module's (one gloo process)
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    stack = make("evoformer", no_blocks=3, blocks_per_ckpt=1).train()

    def grads(module):
        x, z, x_mask, pair_mask = make_inputs("evoformer")
        torch.manual_seed(7)
        stack.zero_grad(set_to_none=True)
        loss_of(module(x, z, x_mask, pair_mask)).backward()
        return [p.grad.clone() for p in stack.parameters()]

    reference = grads(stack)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    ddp = None
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(stack, find_unused_parameters=find_unused)
        for step in range(2):
            assert_bitwise(grads(ddp), reference, f"step {step}")
    finally:
        # the wrapper (its reducer holds the group) goes before the group: a gloo group destroyed
        # first and released by the reducer afterwards can hang joining its worker thread
        ddp = None
        gc.collect()
        dist.destroy_process_group()


def test_through_torch_checkpoint_gives_the_same_bits():
    # the A/B switch: full recomputation under torch.utils.checkpoint (its forward recorded)
    stack = make("evoformer", blocks_per_ckpt=1).train()
    reference = step(stack, "evoformer")
    seen = []
    stack.blocks[0].outer_product_mean.linear_out.register_forward_hook(
        lambda *args: seen.append(torch.is_grad_enabled()))
    with recompute.through_torch_checkpoint():
        assert_bitwise(step(stack, "evoformer"), reference, "torch.utils.checkpoint")
    assert seen == [True, True]


def test_a_recomputed_group_reruns_on_the_parameters_its_forward_read():
    # (a CUDA graph capture runs the forward with views of the parameters bound in their modules and
    # differentiates with respect to those views, after putting the parameters back)
    stack = make("evoformer", no_blocks=2, blocks_per_ckpt=None).train()
    results = []
    for group in (None, 1):
        stack.blocks_per_ckpt = group
        x, z, x_mask, pair_mask = make_inputs("evoformer")
        torch.manual_seed(7)
        with cuda_graphs._parameters_as_views(stack, list(stack.parameters())) as views:
            out = stack(x, z, x_mask, pair_mask)
        results.append(torch.autograd.grad(loss_of(out), [z, *views], allow_unused=True))
    assert all(g is not None for g in results[0])
    assert_bitwise(results[1], results[0], "views")


# --------------------------------------------------------------------------------------------
# What the backward recomputes


class ExecutedOps(TorchDispatchMode):
    """Counts the ops that run, by (name, region). The recomputation's selective checkpointing mode
    sits above this one: an op it serves from the kept outputs never reaches here."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[(func._schema.name, _keep.current())] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(stack, kind) -> Counter:
    x, z, x_mask, pair_mask = make_inputs(kind)
    loss = loss_of(stack(x, z, x_mask, pair_mask))
    with ExecutedOps() as ops:
        loss.backward()
    return ops.counts


def products(counts: Counter, region: str) -> int:
    """Matrix products run in ``region``."""
    return sum(n for (name, where), n in counts.items() if where == region and name in recompute.MATRIX_PRODUCTS)


@pytest.mark.parametrize("kind", KINDS)
def test_the_kept_products_are_not_recomputed(kind):
    stack = make(kind, no_blocks=3, blocks_per_ckpt=1).eval()
    counts = {}
    for policy in ("full", "attention", "attention+triangle"):
        stack.recompute = policy
        counts[policy] = backward_ops(stack, kind)
    attention, triangle = _keep.ATTENTION, _keep.TRIANGLE
    # full recomputation runs the attention cores and the triangle products again in the backward
    assert products(counts["full"], attention) > 0 and products(counts["full"], triangle) > 0
    # "attention" keeps the attention cores' products, not the triangle products
    assert products(counts["attention"], attention) == 0
    assert products(counts["attention"], triangle) == products(counts["full"], triangle)
    # "attention+triangle" keeps both
    assert products(counts["attention+triangle"], attention) == 0 == products(counts["attention+triangle"], triangle)
    # (full recomputation differentiates a recorded rerun of the group, the policies run under
    # torch.utils.checkpoint, whose hooks add detaches: their totals compare among themselves, and
    # every policy runs fewer matrix products than full recomputation)
    totals = {policy: sum(c.values()) for policy, c in counts.items()}
    assert totals["attention"] > totals["attention+triangle"]
    matrix = {policy: products(c, None) + products(c, attention) + products(c, triangle) for policy, c in counts.items()}
    assert matrix["full"] > matrix["attention"] > matrix["attention+triangle"]
    # Without checkpointing the last group, its block is not recomputed at all: a third less (the
    # MSA module's last block does less than the others: less)
    stack.recompute, stack.checkpoint_last_group = "full", False
    last_kept = backward_ops(stack, kind)
    for region in (attention, triangle):
        if kind == "msa_module":
            assert 0 < products(last_kept, region) < products(counts["full"], region)
        else:
            assert 3 * products(last_kept, region) == 2 * products(counts["full"], region)


def test_the_last_group_runs_once():
    stack = make("evoformer", no_blocks=3, blocks_per_ckpt=1, checkpoint_last_group=False).train()
    calls = Counter()
    for i, block in enumerate(stack.blocks):
        block.outer_product_mean.linear_out.register_forward_hook(lambda *args, i=i: calls.update([i]))
    step(stack, "evoformer")
    assert calls == {0: 2, 1: 2, 2: 1}  # the forward, and the recomputation of the checkpointed ones


def test_the_budget_goes_to_the_last_groups(monkeypatch, caplog):
    stack = make("evoformer", no_blocks=7, blocks_per_ckpt=2, recompute="attention").train()
    stack.recompute_budget_gib = 1.0
    kept = []  # per call: the indices of the groups that took the policy
    original = recompute.Plan.checkpoint_kwargs

    def spy(plan, index):
        kwargs = original(plan, index)
        if kwargs.get("context_fn") == plan.policy.context_fn:
            kept[-1].append(index)
        return kwargs

    monkeypatch.setattr(recompute.Plan, "checkpoint_kwargs", spy)
    kept.append([])
    with caplog.at_level(logging.INFO, logger="evoformer_blocks"):
        step(stack, "evoformer")  # measures on group 0 (which recomputes in full), then decides
    assert "keeps" in caplog.text and "per block" in caplog.text
    assert kept[-1] == [1, 2, 3]  # groups of 2, 2, 2, 1 blocks: all fit but the measured one
    # Groups of 2, 2, 2, 1 blocks from the last: 1 + 2 fit in 3.5 blocks' kept outputs, 1 + 2 + 2 do not.
    stack.recompute_budget_gib = 3.5 * per_block(stack) / 2**30
    kept.append([])
    step(stack, "evoformer")
    assert kept[-1] == [2, 3]
    stack.recompute_budget_gib = 0.99 * per_block(stack) / 2**30  # not even the last group's one block
    kept.append([])
    step(stack, "evoformer")
    assert kept[-1] == []
    stack.recompute_budget_gib = None  # every group
    kept.append([])
    step(stack, "evoformer")
    assert kept[-1] == [0, 1, 2, 3]


def test_a_second_backward_or_a_kept_output_changed_in_place_raises():
    stack = make("evoformer", no_blocks=2, blocks_per_ckpt=1, recompute="attention")
    x, z, x_mask, pair_mask = make_inputs("evoformer")
    loss = loss_of(stack(x, z, x_mask, pair_mask))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()
    # the mechanism alone: a kept product changed in place after the forward
    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(4, 5, requires_grad=True)

    def fn(a, b):
        y = _keep.product(_keep.ATTENTION, torch.matmul, a, b)
        y.mul_(2)  # (allowed by autograd: the product's backward reads a and b)
        return y.sin()

    out = torch.utils.checkpoint.checkpoint(
        fn, a, b, use_reentrant=False, context_fn=recompute.POLICIES["attention"].context_fn
    )
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()


# --------------------------------------------------------------------------------------------
# Memory: the live bytes of the ops' outputs


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages that ops made and that are still alive, and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.alive: dict[int, int] = {}

    def _freed(self, key: int) -> None:
        self.live -= self.alive.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if id(storage) not in self.alive and storage.nbytes():
                    self.alive[id(storage)] = storage.nbytes()
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._freed, id(storage))
        self.peak = max(self.peak, self.live)
        return out


def peak_bytes(*stacks, n_seq=8, n_res=12) -> int:
    """The peak of one training step of ``stacks`` run in a chain (z through all of them, the same
    m into each), the loss from the last one's outputs."""
    torch.manual_seed(0)
    m, z, msa_mask, pair_mask = inputs(batch=(1,), n_seq=n_seq, n_res=n_res)
    m.requires_grad_(True)
    z.requires_grad_(True)
    with LiveBytes() as tracker:
        for stack in stacks[:-1]:
            z = stack(m, z, msa_mask, pair_mask)
        loss_of(stacks[-1](m, z, msa_mask, pair_mask)).backward()
    return tracker.peak


def test_the_last_group_without_checkpointing_leaves_the_stacks_peak():
    stack = make("evoformer", no_blocks=6, blocks_per_ckpt=1).train()
    checkpointed = peak_bytes(stack)
    stack.checkpoint_last_group = False
    assert peak_bytes(stack) <= checkpointed


def test_the_last_group_without_checkpointing_before_another_stack_raises_the_peak():
    # Why checkpoint_last_group is True by default: the extra-MSA stack's last block keeps its
    # activations through the whole Evoformer stack that follows.
    extra = make("extra_msa", no_blocks=4, blocks_per_ckpt=1).train()
    evoformer = make("evoformer", no_blocks=6, blocks_per_ckpt=1).train()
    checkpointed = peak_bytes(extra, evoformer)
    extra.checkpoint_last_group = False
    assert peak_bytes(extra, evoformer) > checkpointed


SIZES = dict(n_seq=24, n_res=32)


def test_the_budget_bounds_the_memory_kept():
    stack = make("evoformer", no_blocks=6, blocks_per_ckpt=1).train()
    # (sizes where the activations, not the parameters' gradients, set the peak: at the first
    # backward, not the last)
    full = peak_bytes(stack, **SIZES)
    stack.recompute = "attention+triangle"
    stack.recompute_budget_gib = 1.0
    peak_bytes(stack, **SIZES)  # measures
    budget = 2.5 * per_block(stack)  # two blocks' kept outputs
    stack.recompute_budget_gib = budget / 2**30
    within_budget = peak_bytes(stack, **SIZES)
    stack.recompute_budget_gib = None
    every_block = peak_bytes(stack, **SIZES)
    assert 0 < within_budget - full <= budget
    assert every_block - full > within_budget - full
    assert every_block - full <= 6 * per_block(stack)
    # The last group's kept outputs cost nothing at the peak: its recomputation would rebuild them
    # right before its backward.
    stack.recompute_budget_gib = 1.5 * per_block(stack) / 2**30  # the last group only
    assert peak_bytes(stack, **SIZES) <= full


# --------------------------------------------------------------------------------------------
# The settings


def test_the_policies_name_the_extensions_ops():
    from evoformer_blocks.ops import cutlass, triangle

    # the names the call sites pass (ops._keep.call) are the policies'
    assert set(recompute.ATTENTION_OPS) == {cutlass.FORWARD_OP, cutlass.GATED_FORWARD_OP}
    assert recompute.TRIANGLE_OPS == (triangle.FUSED_OP,)
    declared = {schema.split("(")[0]: schema for schema in _fused.SCHEMAS}
    for name, policy in recompute.POLICIES.items():
        for qualified in policy.ops:
            namespace, op = qualified.split("::")
            assert namespace == "evoformer_blocks_cuda" and op in declared, qualified
            overload = getattr(torch.ops.evoformer_blocks_cuda, op).default
            assert policy.keeps(overload)
            # an op that writes into an argument cannot be served from its kept outputs
            assert not any(a.alias_info is not None and a.alias_info.is_write for a in overload._schema.arguments)
    attention, both = recompute.POLICIES["attention"], recompute.POLICIES["attention+triangle"]
    triangle = torch.ops.evoformer_blocks_cuda.triangle_multiplication_fwd.default
    assert not attention.keeps(triangle) and both.keeps(triangle)
    assert not both.keeps(torch.ops.evoformer_blocks_cuda.layer_norm_fwd.default)
    assert not both.keeps(torch.ops.aten.bmm.default)  # outside every region
    assert recompute.POLICIES["full"].ops == () and recompute.POLICIES["full"].regions == ()


def test_a_kept_fused_call_does_not_run_again():
    # The call-site mechanism of the fused ops (ops._keep.call inside an autograd.Function), on CPU
    # with a stand-in kernel: kept, it runs in the forward only; the gradients are the same.
    calls = []

    def kernel(x):
        calls.append(1)
        return x.exp(), x.sum(-1)

    class Node(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            out, total = _keep.call(recompute.ATTENTION_OPS[0], kernel, x)
            ctx.save_for_backward(out, total)
            return out

        @staticmethod
        def backward(ctx, grad):
            out, total = ctx.saved_tensors
            return grad * out

    x = torch.randn(5, requires_grad=True)
    grads = []
    for policy, runs in (("full", 2), ("attention", 1)):
        calls.clear()
        y = torch.utils.checkpoint.checkpoint(
            lambda x: Node.apply(x.sin()).cos(), x, use_reentrant=False, context_fn=recompute.POLICIES[policy].context_fn
        )
        grads.append(torch.autograd.grad(y.sum(), x)[0])
        assert len(calls) == runs, policy
    assert torch.equal(*grads)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(recompute="some"), "`recompute` must be one of"),
        (dict(recompute="attention", recompute_budget_gib=-1.0), "`recompute_budget_gib`"),
        (dict(recompute="attention", recompute_budget_gib=True), "`recompute_budget_gib`"),
        (dict(recompute="attention", recompute_budget_gib=float("inf")), "`recompute_budget_gib`"),
        (dict(checkpoint_last_group=1), "`checkpoint_last_group` must be a bool"),
    ],
)
def test_bad_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make("evoformer", no_blocks=1, **kwargs)
    stack = make("evoformer", no_blocks=2, blocks_per_ckpt=1)
    if "recompute" in kwargs:  # set on a built stack: the next training call says so
        for name, value in kwargs.items():
            setattr(stack, name, value)
        with pytest.raises(ValueError, match=match):
            step(stack, "evoformer")


def test_presets_copies_and_pickles():
    for name in PRESETS:
        cfg = get_config(name)
        for section in ("evoformer_stack", "extra_msa_stack", "pairformer_stack", "msa_module"):
            if section in cfg:
                assert cfg[section].recompute is None and cfg[section].recompute_budget_gib is None
                assert cfg[section].checkpoint_last_group is True
    cfg = get_config("small")
    cfg.evoformer_stack.recompute = "attention"
    cfg.evoformer_stack.recompute_budget_gib = 2.0
    stack = EvoformerStack.from_config(cfg, backend="eager")
    assert (stack.recompute, stack.recompute_budget_gib, stack.checkpoint_last_group) == ("attention", 2.0, True)
    assert ExtraMSAStack.from_config(get_config("small"), checkpoint_last_group=False).checkpoint_last_group is False
    assert PairformerStack.from_config(get_config("af3_small")).recompute == "full"
    assert MSAModule.from_config(get_config("af3_small"), recompute="attention+triangle").recompute == "attention+triangle"
    assert EvoformerStack.from_config(get_config("small"), recompute=None).recompute == "full"
    # copies and pickles carry the settings, not the measured bytes (a cache)
    stack = make("evoformer", no_blocks=2, blocks_per_ckpt=1, recompute="attention", recompute_budget_gib=1.0)
    step(stack, "evoformer")
    assert len(stack._kept_bytes) == 1
    for clone in (copy.deepcopy(stack), pickle.loads(pickle.dumps(stack))):
        assert (clone.recompute, clone.recompute_budget_gib, clone.checkpoint_last_group) == ("attention", 1.0, True)
        assert len(clone._kept_bytes) == 0
        assert_bitwise(step(clone, "evoformer"), step(stack, "evoformer"))
    # a stack pickled before the options: full recomputation, every group checkpointed
    state = stack.__getstate__()
    for key in ("recompute", "recompute_budget_gib", "checkpoint_last_group"):
        del state[key]
    old = EvoformerStack.__new__(EvoformerStack)
    old.__setstate__(state)
    assert (old.recompute, old.recompute_budget_gib, old.checkpoint_last_group) == ("full", None, True)


def test_torch_compile():
    # A policy and the last group without checkpointing, compiled (the selective checkpointing
    # contexts traced by torch.compile): the eager results.
    stack = make(
        "evoformer", no_blocks=2, dtype=torch.float32, blocks_per_ckpt=1, msa_dropout=0.0, pair_dropout=0.0,
        recompute="attention+triangle", checkpoint_last_group=False,
    ).train()
    compiled = torch.compile(stack, backend="aot_eager", fullgraph=True)
    for a, b in zip(step(compiled, "evoformer", torch.float32), step(stack, "evoformer", torch.float32)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
