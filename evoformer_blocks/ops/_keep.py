"""What a stack's selective recomputation needs from the ops (private; the policies and the stacks'
side are :mod:`evoformer_blocks.recompute`).

* Regions: names for the matrix products on ATen ops that a policy may keep, each computed through
  :func:`product`: those of the attention cores (the eager backend's, the global column
  attention's, the pair-weighted averaging's), ``"attention"``, and the eager triangle product,
  ``"triangle"``. The region is a thread-local name, set while the product runs (:func:`current`).
* :class:`Kept`: the outputs one checkpointed group keeps. While its forward runs (:class:`Keeping`,
  the checkpoint's forward context) the fused ops of the policy, called through :func:`call`, and
  the ``aten::mm``/``aten::bmm`` of its regions' products keep their outputs; while its
  recomputation runs (:class:`Taking`) the same calls, in the same order, return those outputs
  instead of running. Autograd records them as it did in the forward (the fused ops run inside
  autograd.Functions, and the products' ATen ops under autograd, below which :class:`_Products`
  serves them), so the recomputation saves the same tensors for the backward. Nothing else passes
  through Python: the other ops cost what they cost without a policy. (PyTorch's selective
  checkpointing, which torch.compile traces instead, sends every op of the group through a
  dispatch mode, some microseconds of host time an op.)

Not under torch.compile: a compiled graph does not run this Python, so there :func:`call` and
:func:`product` are the op, and every region is none.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

ATTENTION = "attention"  # an attention's logits and its weighted sum of values
TRIANGLE = "triangle"  # the triangle multiplicative update's product over k
MATRIX_PRODUCTS = ("aten::mm", "aten::bmm")  # what a region keeps (matmul and einsum run on these)

_local = threading.local()  # .region: the region's name; .kept: the Kept of the group running here


class Kept:
    """The outputs one checkpointed group keeps (see the module docstring): those of the fused ops
    named in ``ops`` and of the matrix products inside ``regions``. With ``count_only`` it keeps
    nothing and adds up the bytes it would keep (``bytes``)."""

    def __init__(self, ops: tuple[str, ...], regions: tuple[str, ...], count_only: bool = False) -> None:
        self.ops, self.regions, self.count_only = frozenset(ops), frozenset(regions), count_only
        self.outputs: list = []  # per kept call: its outputs (detached), then None once taken back
        self.versions: list = []  # their version counters when kept
        self.next: Optional[int] = None  # None while the forward keeps; while recomputing, the next to take
        self.bytes = 0

    def run(self, op: Callable, args: tuple, kwargs: dict):
        if self.next is None:  # the forward: run, and keep
            out = op(*args, **kwargs)
            if self.count_only:
                self.bytes += _nbytes(out)
            else:
                # (detached: the recomputation's autograd records them as new outputs)
                self.outputs.append(tree_map(_detached, out))
                self.versions.append([t._version for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
            return out
        index = self.next
        if index >= len(self.outputs) or self.outputs[index] is None:
            raise RuntimeError(
                "recompute: a checkpointed group's recomputation asked for more kept outputs than its forward kept "
                "(a second backward through it, retain_graph=True, is not supported with a recompute policy)"
            )
        out, self.outputs[index] = self.outputs[index], None
        self.next = index + 1
        if [t._version for t in tree_leaves(out) if isinstance(t, torch.Tensor)] != self.versions[index]:
            raise RuntimeError("recompute: a kept output was modified in place after the forward")
        return out


def _detached(t):
    """``t.detach()`` sharing t's version counter, also below autograd (in :class:`_Products`, where
    a plain detach would not: the view tracking that shares it is excluded there)."""
    if not isinstance(t, torch.Tensor):
        return t
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


def _nbytes(out) -> int:
    """The bytes of the storages of ``out``'s tensors (each storage once)."""
    storages = {}
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class Keeping:
    """The forward context of a checkpointed group: ``kept`` keeps (or counts)."""

    def __init__(self, kept: Kept) -> None:
        self.kept = kept

    def __enter__(self):
        self.previous = getattr(_local, "kept", None)
        self.kept.next = None
        _local.kept = self.kept

    def __exit__(self, *exc) -> None:
        _local.kept = self.previous


class Taking(Keeping):
    """The recomputation context of a checkpointed group: the kept outputs come back in order."""

    def __enter__(self):
        super().__enter__()
        self.kept.next = 0


def call(name: str, op: Callable, *args, **kwargs):
    """``op(*args, **kwargs)``, the fused op ``name`` (qualified), where a checkpointed group keeps or
    takes back its outputs."""
    if torch.compiler.is_compiling():
        return op(*args, **kwargs)
    kept = getattr(_local, "kept", None)
    if kept is None or name not in kept.ops:
        return op(*args, **kwargs)
    return kept.run(op, args, kwargs)


class Composing:
    """The recomputation context of a group whose forward only counted the bytes it would keep (a
    stack's meter): nothing comes back, but the ``ops`` run at their call sites, as in that forward,
    so that the recomputation saves what the forward saved (:func:`keeps`)."""

    def __init__(self, ops) -> None:
        self.ops = frozenset(ops)

    def __enter__(self):
        self.previous = getattr(_local, "composing", None)
        _local.composing = self.ops

    def __exit__(self, *exc) -> None:
        _local.composing = self.previous


def keeps(name: str) -> bool:
    """Whether a checkpointed group running on this thread keeps (or takes back, or counts) the fused
    op ``name``'s outputs, or recomputes a group that counted them: then the op must run at its own
    call site (:func:`call`), not inside a module's node (``ops.module_nodes``)."""
    kept = getattr(_local, "kept", None)
    if kept is not None and name in kept.ops:
        return True
    composing = getattr(_local, "composing", None)
    return composing is not None and name in composing


class _Products(TorchDispatchMode):
    """Inside a kept region: the matrix products through ``kept`` (below autograd, which records
    them as usual)."""

    def __init__(self, kept: Kept) -> None:
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in MATRIX_PRODUCTS:
            return self.kept.run(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


def current() -> Optional[str]:
    """The region the calling thread runs in (None outside every region)."""
    return getattr(_local, "region", None)


def product(region: str, fn: Callable, *args):
    """``fn(*args)``, a matrix product of ``region`` (``torch.matmul``, ``torch.einsum``, ...): where
    a checkpointed group keeps that region's products, its forward keeps the ``aten::mm`` and
    ``aten::bmm`` results and its recomputation takes them back."""
    if torch.compiler.is_compiling():
        return fn(*args)
    previous = getattr(_local, "region", None)
    _local.region = region
    kept = getattr(_local, "kept", None)
    mode = _Products(kept) if kept is not None and region in kept.regions else None
    try:
        if mode is None:
            return fn(*args)
        with mode:
            return fn(*args)
    finally:
        _local.region = previous
