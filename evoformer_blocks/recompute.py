"""What a stack's checkpointed blocks recompute: the ``recompute``, ``recompute_budget_gib`` and
``checkpoint_last_group`` options of every stack (:class:`~evoformer_blocks.EvoformerStack`,
:class:`~evoformer_blocks.ExtraMSAStack`, :class:`~evoformer_blocks.PairformerStack`,
:class:`~evoformer_blocks.MSAModule`).

With ``blocks_per_ckpt`` a stack checkpoints each group of that many blocks: the forward keeps the
group's inputs only, and the backward runs the group's forward again for the tensors its gradients
need. A group that recomputes in full is one autograd node (:func:`recomputed`): its forward runs
the blocks without recording a graph (the ops take their inference paths: no autograd nodes, no
tensors saved, no pack hooks), and its backward runs them again with gradients recorded and
differentiates that run, returning the gradients of the group's inputs and of the parameters. A
group under a policy other than ``"full"``, and every group under torch.compile, runs under
``torch.utils.checkpoint`` (non-reentrant), which the policies hook into: they keep some of the
forward's op outputs, and the recomputation takes those from the forward instead of running the ops
again, and recomputes the rest (selective activation checkpointing; the checkpoint's
``context_fn``). Uncompiled, only the kept ops' call sites take part
(:mod:`evoformer_blocks.ops._keep`): the other ops run as under full recomputation, with no
per-op host work added. Under torch.compile the same policy goes to PyTorch's
``torch.utils.checkpoint.create_selective_checkpoint_contexts`` (:attr:`Policy.keeps`), which
torch.compile traces. :data:`POLICIES` lists what each keeps:

* ``"full"`` (the default): nothing; every op runs again.
* ``"attention"``: each attention's outputs. On the fused path, every output of the attention
  forward ops (the gated output, the attention output, its per-row softmax statistics, the biases
  as the kernels read them); their backward kernels recompute the probabilities from those, so the
  attention core does not run again. On ATen ops (the eager backend; the extra-MSA stack's global
  column attention and the MSA module's pair-weighted averaging on every backend) the matrix
  products inside the attention cores: the logits and the weighted sums of the values (their
  softmax and masking run again).
* ``"attention+triangle"``: that, and the triangle multiplicative updates: every output of the
  fused op (the update and what its backward reads: the gated projections a and b, the normalised
  product, the output gate, the layer norms' statistics, the folded weights); on the eager backend
  the triangle product (its einsum's matrix product).

Everything else is recomputed: the layer norms, the projections, the gates, the transitions, the
outer product mean, the residual adds. The kept outputs come from the ops with the most work per
element they output: each attention output sums over every key of its row, each triangle product
over every k of its row.

Memory. A checkpointed group holds its inputs (m, z and its dropout masks) from its forward to its
backward; a policy adds its kept outputs over the same span. The stack's peak is usually the
backward of its last block, when every other block's inputs and kept outputs are still held: each
byte kept outside the last group adds to it (and to whatever the model allocates between the
stack's forward and its backward). With ``recompute_budget_gib`` the policy goes to the last
groups, from the last backwards, while their kept bytes together fit the budget (the earlier
groups recompute in full): the last group's kept outputs cost (nearly) nothing at the stack's peak
(its recomputation would rebuild the same tensors right before its backward), and the backward
frees the last groups' first. The bytes a block keeps are measured, not estimated: in the first training
call of a stack at given shapes (dtype, autocast, chunk size and backend setting) its first group
recomputes in full while the policy's call sites add up the bytes of the outputs they would keep,
and later groups and calls use that figure (logged on the ``evoformer_blocks`` logger). Under
torch.compile nothing is measured: a budget needs one uncompiled training call at those shapes
first, else every group recomputes in full. (Under torch.compile the regions' products are not kept
either: the compiled graph does not run the Python that marks them; the fused ops are kept.)

``checkpoint_last_group=False`` runs the last group without checkpointing: its activations stay
from its forward to its backward, which is the first backward to run. Its recomputation would
rebuild the same activations right before that backward, so for a stack whose outputs go almost
straight to the loss the stack's peak is unchanged and the recomputation is saved. Whatever runs
between the stack's forward and its backward (another stack, a structure module, the loss) runs
with those activations resident, though: the extra-MSA stack, followed by the whole Evoformer
stack, would add them to the Evoformer stack's peak. Hence the default, True: each stack as before.

Gradients. A group that recomputes in full gives, in its forward, the outputs the recorded run gives
(every op's inference path computes what its training path computes, bit for bit), and its gradients
are those of the recorded run. (Its backward holds the gradients of the group's outputs through the
rerun: one m and one z more than torch.utils.checkpoint holds.) Kept outputs are the forward's own
tensors, and recomputed ones equal them bit for bit (the ops are deterministic and the dropout masks
are drawn before the group and passed in), so every policy, budget and ``checkpoint_last_group``
gives the outputs and gradients of full recomputation, bit for bit. With a policy, a second backward
through one call of the stack (``retain_graph=True``) raises: the recomputation hands the kept
outputs over once (so that they are freed with the group's backward), as PyTorch's selective
checkpointing does. A group that recomputes in full reruns its blocks again for a second backward."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import Callable, NamedTuple, Optional

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .ops import _keep
from .ops.cutlass import FORWARD_OP, GATED_FORWARD_OP
from .ops.triangle import FUSED_OP as TRIANGLE_OP

logger = logging.getLogger("evoformer_blocks")

# The fused ops whose every output a policy keeps; their call sites pass these names to
# ops._keep.call. (The extension's `gated_forward`, which writes its gated output into a tensor it
# is given, is not called by the modules; an op that writes into an argument cannot be replaced by
# its kept outputs.)
ATTENTION_OPS = (GATED_FORWARD_OP, FORWARD_OP)  # evoformer_blocks_cuda::gated_attention_fwd, ::forward
TRIANGLE_OPS = (TRIANGLE_OP,)  # evoformer_blocks_cuda::triangle_multiplication_fwd
# The ATen ops kept inside a region of a policy: the matrix products (matmul and einsum run on these)
MATRIX_PRODUCTS = _keep.MATRIX_PRODUCTS


class Policy:
    """What the blocks of a checkpointed group keep from their forward: every output of the fused
    ``ops`` (qualified names), and the :data:`MATRIX_PRODUCTS` computed inside the ``regions`` of the
    code on ATen ops (``"attention"``: the attention cores; ``"triangle"``: the eager triangle
    product)."""

    def __init__(self, ops: tuple[str, ...], regions: tuple[str, ...]) -> None:
        self.ops, self.regions = ops, regions

        def policy_fn(ctx, func, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if self.keeps(func) else CheckpointPolicy.PREFER_RECOMPUTE

        # The ``context_fn`` of torch.utils.checkpoint.checkpoint under torch.compile: PyTorch's
        # selective checkpointing, new contexts (and storage) per call. (Made here, once: torch.compile
        # traces a partial.)
        self.compiled_context_fn: Callable = functools.partial(create_selective_checkpoint_contexts, policy_fn)

    def context_fn(self):
        """The ``context_fn`` of torch.utils.checkpoint.checkpoint otherwise: the forward keeps, the
        recomputation takes back (:mod:`evoformer_blocks.ops._keep`), in a new store per call."""
        kept = _keep.Kept(self.ops, self.regions)
        return _keep.Keeping(kept), _keep.Taking(kept)

    def keeps(self, func) -> bool:
        """Whether an op call (an ``OpOverload``, in the forward) is kept (PyTorch's selective
        checkpointing asks, under torch.compile)."""
        schema = getattr(func, "_schema", None)
        if schema is None:
            return False
        name = schema.name
        return name in self.ops or (name in MATRIX_PRODUCTS and _keep.current() in self.regions)

    def __repr__(self) -> str:
        return f"Policy(ops={self.ops}, regions={self.regions})"


POLICIES: dict[str, Policy] = {
    "full": Policy(ops=(), regions=()),
    "attention": Policy(ops=ATTENTION_OPS, regions=(_keep.ATTENTION,)),
    "attention+triangle": Policy(ops=ATTENTION_OPS + TRIANGLE_OPS, regions=(_keep.ATTENTION, _keep.TRIANGLE)),
}


def check_recompute(owner: str, recompute, budget_gib) -> str:
    """The policy's name (None is ``"full"``); ``ValueError`` naming ``owner`` for an unknown policy
    or a budget that is not None or a non-negative finite number."""
    name = "full" if recompute is None else recompute
    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(f"{owner}: `recompute` must be one of {list(POLICIES)} or None, got {recompute!r}")
    if budget_gib is not None and (
        isinstance(budget_gib, bool) or not isinstance(budget_gib, (int, float)) or not 0 <= budget_gib < math.inf
    ):
        raise ValueError(
            f"{owner}: `recompute_budget_gib` must be None or a non-negative finite number, got {budget_gib!r}"
        )
    return name


_MEASURED_KEPT = 16  # (stack, shapes) entries of measured kept bytes per stack


class Plan:
    """How each checkpoint group of one stack call runs (``sizes``: the groups' block counts):
    :meth:`checkpointed_group` and :meth:`checkpoint_kwargs` before a group runs, :meth:`ran` after."""

    def __init__(self, stack, sizes: list[int], signature: Callable[[], tuple]) -> None:
        self.policy = POLICIES[check_recompute(type(stack).__name__, stack.recompute, stack.recompute_budget_gib)]
        self.stack, self.sizes, self.key = stack, sizes, None
        self.checkpointed = len(sizes) if stack.checkpoint_last_group else len(sizes) - 1
        self.first = self.checkpointed  # the first group that takes the policy
        self.meter: Optional[_keep.Kept] = None
        budget = stack.recompute_budget_gib
        if not self.policy.ops and not self.policy.regions:
            return
        if budget is None:
            self.first = 0
            return
        self.key = signature()  # what the kept bytes depend on
        per_block = stack._kept_bytes.get(self.key)
        if per_block is not None:
            self.first = self._first_fitting(per_block)
        elif not torch.compiler.is_compiling() and self.checkpointed > 0:
            # (a compiled graph cannot measure, nor log that it did not: there every group
            # recomputes in full, as the module docstring says)
            self.meter = _keep.Kept(self.policy.ops, self.policy.regions, count_only=True)

    def _first_fitting(self, per_block: float) -> int:
        """The first of the last groups whose kept bytes together fit the budget."""
        budget, spent, first = self.stack.recompute_budget_gib * 2**30, 0.0, self.checkpointed
        for index in range(self.checkpointed - 1, -1, -1):
            spent += self.sizes[index] * per_block
            if spent > budget:
                break
            first = index
        return first

    def checkpointed_group(self, index: int) -> bool:
        return index < self.checkpointed

    def checkpoint_kwargs(self, index: int) -> dict:
        """The ``context_fn`` argument of the checkpoint of group ``index`` (a checkpointed one),
        none for full recomputation (torch.compile traces only a context_fn it can read)."""
        if index == 0 and self.meter is not None:
            # the meter's forward runs the policy's ops at their call sites (not inside a module's
            # node), and so must its recomputation, which saves what the forward saved
            meter = self.meter
            return {"context_fn": lambda: (_keep.Keeping(meter), _keep.Composing(meter.ops))}
        if index < self.first:
            return {}
        if torch.compiler.is_compiling():
            return {"context_fn": self.policy.compiled_context_fn}
        return {"context_fn": self.policy.context_fn}

    def ran(self, index: int) -> None:
        if index != 0 or self.meter is None:
            return
        per_block = self.meter.bytes / self.sizes[0]  # (what group 0 would have kept)
        measured = self.stack._kept_bytes
        measured[self.key] = per_block
        while len(measured) > _MEASURED_KEPT:
            measured.pop(next(iter(measured)))
        first = self._first_fitting(per_block)
        self.first = max(1, first)  # (group 0 ran in full)
        stack = self.stack
        logger.info(
            "%s: recompute=%r keeps %.1f MiB per block at these shapes; with recompute_budget_gib=%s the "
            "last %d of %d checkpointed blocks keep it (from the next call on where that includes the first)",
            type(stack).__name__, stack.recompute, per_block / 2**20, stack.recompute_budget_gib,
            sum(self.sizes[first:self.checkpointed]), sum(self.sizes[:self.checkpointed]),
        )


# ---- full recomputation: one autograd node per group -----------------------------------------------


_through_torch = 0  # open through_torch_checkpoint() blocks


@contextlib.contextmanager
def through_torch_checkpoint():
    """Inside the block every checkpointed group runs under ``torch.utils.checkpoint``
    (non-reentrant), full recomputation included, instead of :func:`recomputed` (the same results
    and memory; for A/B timings)."""
    global _through_torch
    _through_torch += 1
    try:
        yield
    finally:
        _through_torch -= 1


def torch_checkpoint_only() -> bool:
    """Whether a checkpointed group must run under ``torch.utils.checkpoint``: inside
    :func:`through_torch_checkpoint` or while torch.compile traces."""
    return bool(_through_torch) or torch.compiler.is_compiling()


def recomputed(run: Callable, args: tuple, modules: list[torch.nn.Module]):
    """``run(*args)`` (a checkpointed group's blocks; returns a tuple of tensors) as one autograd node
    that keeps ``args``' tensors only: the forward runs ``run`` without recording, the backward runs
    it again with gradients recorded and differentiates that run with respect to ``args``' tensors
    and the parameters of ``modules`` (the blocks ``run`` reads). ``args`` may nest tensors in tuples
    and lists (the dropout masks); its other leaves are passed as they are. The recomputation runs
    under the call's autocast state, on the parameter tensors the forward read (a CUDA graph capture
    binds views of the parameters in their modules while it runs the forward)."""
    leaves, spec = tree_flatten(args)
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[i] for i in where]
    device = next((t.device.type for t in tensors if t.device.type != "cpu"), "cpu")
    autocast = {
        kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        for kind in dict.fromkeys((device, "cpu"))
    }
    # Each parameter slot (module, name) and the index of its tensor among the parameters
    parameters, index, slots = [], {}, []
    for block in modules:
        for module in block.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    if id(p) not in index:
                        index[id(p)] = len(parameters)
                        parameters.append(p)
                    slots.append((module, name, index[id(p)]))
    # (the layout holds no tensor: the group's inputs go with its saved tensors, freed by its backward)
    template = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    layout = _Layout(run, spec, template, where, autocast, torch.is_autocast_cache_enabled(), slots)
    return _RecomputedGroup.apply(layout, len(tensors), *tensors, *parameters)


class _Layout(NamedTuple):
    """What a recomputed group's node keeps besides tensors."""

    run: Callable  # the group's blocks
    spec: TreeSpec  # the structure of its arguments
    template: list  # their leaves, None in the places of tensors
    where: list[int]  # the places of the tensors among the leaves
    autocast: dict  # device type -> (enabled, dtype) at the call
    autocast_cache: bool
    slots: list  # (module, name, index among the parameters) per parameter slot

    def arguments(self, tensors) -> tuple:
        """The group's arguments with ``tensors`` in the places of the call's tensors."""
        leaves = list(self.template)
        for i, t in zip(self.where, tensors):
            leaves[i] = t
        return tree_unflatten(leaves, self.spec)


@contextlib.contextmanager
def parameters_bound(bindings):
    """Inside the block each slot (module, name, tensor) of ``bindings`` holds its tensor as the
    module's parameter ``name`` (the tensors the modules held are put back after)."""
    swapped = []
    for module, name, tensor in bindings:
        held = module._parameters[name]
        if held is not tensor:
            swapped.append((module, name, held))
            module._parameters[name] = tensor
    try:
        yield
    finally:
        for module, name, held in swapped:
            module._parameters[name] = held


class _RecomputedGroup(torch.autograd.Function):
    """See :func:`recomputed`. Inputs: the layout (the group's function, where its tensors go, the
    autocast state), how many of the tensors that follow are the group's arguments, those tensors,
    then the parameters."""

    @staticmethod
    def forward(ctx, layout, n_args, *tensors):
        ctx.layout, ctx.parameters = layout, tensors[n_args:]
        ctx.save_for_backward(*tensors[:n_args])
        ctx.set_materialize_grads(False)  # (an output without a gradient is skipped, not zero-filled)
        return tuple(layout.run(*layout.arguments(tensors[:n_args])))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad[2:]
        args = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, needs)]
        layout = ctx.layout
        bindings = [(module, name, ctx.parameters[i]) for module, name, i in layout.slots]
        with torch.enable_grad(), parameters_bound(bindings), contextlib.ExitStack() as states:
            for kind, (enabled, dtype) in layout.autocast.items():
                states.enter_context(
                    torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=layout.autocast_cache))
            outputs = layout.run(*layout.arguments(args))
        # The outputs' graph edges, not the outputs: their memory goes now (unless the graph saved
        # them), as it would had the rerun stopped at the last tensor the backward reads.
        pairs = [(get_gradient_edge(o), g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        del outputs
        wrt = [t for t, need in zip((*args, *ctx.parameters), needs) if need]
        if pairs and wrt:
            edges, grad_outs = zip(*pairs)
            found = iter(torch.autograd.grad(edges, wrt, grad_outs, allow_unused=True))
        else:
            found = iter([None] * len(wrt))
        return (None, None, *(next(found) if need else None for need in needs))
