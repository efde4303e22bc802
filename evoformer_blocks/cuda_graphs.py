"""CUDA graphs for the stacks: a training step or an inference forward replayed from graphs.

A 48-block trunk launches tens of thousands of kernels per training step; at AF2's training sizes
each is short, and the host, not the GPU, sets the step's pace. With ``cuda_graphs`` set
(``EvoformerStack(..., cuda_graphs=True)``, or ``stack.cuda_graphs = True`` on a built stack), the
stack captures its whole forward, and in training its whole backward (the checkpointed blocks'
recomputation included), into CUDA graphs once per input signature and replays them afterwards:
one launch each way instead of one per kernel.

Training (gradients enabled, and the inputs or the parameters require them): the forward graph
runs the stack as the plain module does, with ``blocks_per_ckpt`` checkpointing (and what
``recompute`` keeps from the forward, see :mod:`evoformer_blocks.recompute`) and dropout. The
dropout masks are drawn in the forward from the CUDA generator (replays draw new masks, and draw
what the plain stack would draw from the same generator state) and handed to the checkpointed
groups, so the recomputation inside the backward graph applies the forward's masks. The backward
graph computes the gradients of the inputs and of every parameter that requires one; they reach
``.grad`` through autograd as usual (accumulation, hooks, DistributedDataParallel). With the same
generator state, outputs and gradients are bitwise those of the plain stack.

Inference (no gradients needed): one forward graph, captured without autograd.

Rules, all handled here and logged on the ``evoformer_blocks`` logger, never silently:

* A signature (shapes, dtypes, device, train/eval, grad mode, which inputs and parameters require
  gradients, autocast, chunk size, the backend setting, the checkpointing and recompute options)
  is captured the second time it is seen; its first call runs the plain stack, which warms up what
  a capture cannot do (the kernels' build and load, library handles). At most ``cuda_graphs``
  signatures keep their graphs (each holds its own memory pool, about the memory of the plain
  step); the least recently used is dropped for a new one.
* Where graphs cannot serve, the call runs the plain stack and the reason is logged once: inputs
  not on a CUDA device, the eager backend or float64 (no fused kernels to replay), shapes that
  change on every call (pad to fixed sizes, as a fixed training crop does, to use graphs), more
  signatures in use than are kept, a capture that failed (its error is logged), a call made while
  the previous call of that signature still awaits its backward (its activations live in the
  graph's memory), and calls inside another capture or a ``torch.compile`` trace.
* The graphs read the parameters where they were at capture: moving or converting the stack
  (``.to``, ``.cuda``, ``.half``) or rebinding a parameter's storage drops them (in-place updates
  such as an optimizer step or ``load_state_dict`` are seen by the replays).
* A training replay's outputs must be differentiated once: a second backward through the same call
  (``retain_graph=True``) raises. An output that receives no gradient counts as a zero gradient.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
import weakref
from collections import OrderedDict
from typing import Iterator, Optional

import torch

from .ops import get_default_backend
from .recompute import parameters_bound

logger = logging.getLogger("evoformer_blocks")

DEFAULT_SIGNATURES = 2  # cuda_graphs=True: a training and an evaluation signature, say
_SEEN_KEPT = 64  # signatures remembered as seen once (waiting for a second call)
_NEW_IN_A_ROW = 8  # calls in a row with unseen signatures before the "shapes change" log


def signatures_to_keep(owner: str, value) -> int:
    """How many signatures keep graphs for a ``cuda_graphs`` setting: True → 2, False/None/0 → 0
    (off), a positive int → itself; anything else raises ``ValueError`` naming ``owner``."""
    if value is True:
        return DEFAULT_SIGNATURES
    if value is None or value is False:
        return 0
    if isinstance(value, int) and value >= 0:
        return value
    raise ValueError(
        f"{owner}: `cuda_graphs` must be True, False or a non-negative int (the number of input "
        f"signatures that keep captured graphs), got {value!r}"
    )


class _Pending:
    """Held by one training replay's autograd node until its backward ran; the signature's entry
    holds only a weak reference, so a call whose outputs were dropped frees the entry."""


class _Captured:
    """One signature's graphs and the static tensors they read and write."""

    def __init__(self) -> None:
        self.forward_graph: Optional[torch.cuda.CUDAGraph] = None
        self.backward_graph: Optional[torch.cuda.CUDAGraph] = None
        self.inputs: tuple[torch.Tensor, ...] = ()  # m, z, msa_mask, pair_mask as the graphs read them
        self.outputs: tuple[torch.Tensor, ...] = ()  # what the forward graph writes
        self.single = False  # the stack returns one tensor (ExtraMSAStack), not a tuple
        self.differentiable: tuple[bool, ...] = ()  # per output: requires grad
        self.grad_outputs: list[torch.Tensor] = []  # per differentiable output: the backward graph reads it
        self.input_grads: list[Optional[torch.Tensor]] = []  # per input requiring grad (m, z)
        self.params: list[torch.nn.Parameter] = []  # the parameters requiring grad, in order
        # Parameter gradients as the backward graph writes them, per dtype: the tensors, the indices
        # of their parameters in `params` (parameters without gradient are absent) and their sizes.
        self.param_grads: list[tuple[list[torch.Tensor], list[int], list[int]]] = []
        self.param_ptrs: tuple[int, ...] = ()
        self.pending: Optional[weakref.ref] = None

    def busy(self) -> bool:
        return self.pending is not None and self.pending() is not None

    def load(self, tensors) -> None:
        for static, t in zip(self.inputs, tensors):
            static.copy_(t)

    def results(self):
        outs = tuple(o.clone() for o in self.outputs)
        return outs[0] if self.single else outs

    def gradients(self) -> tuple[list[Optional[torch.Tensor]], list[Optional[torch.Tensor]]]:
        """Fresh copies of the last backward replay's gradients: (inputs', parameters')."""
        inputs = [None if g is None else g.clone() for g in self.input_grads]
        params: list[Optional[torch.Tensor]] = [None] * len(self.params)
        for grads, indices, sizes in self.param_grads:
            # One new buffer per dtype, cut into the parameters' shapes and filled by one multi-tensor
            # copy: autograd then takes each piece as the parameter's .grad without another copy.
            flat = torch.empty(sum(sizes), dtype=grads[0].dtype, device=grads[0].device)
            pieces = [c.view(g.shape) for c, g in zip(flat.split(sizes), grads)]
            torch._foreach_copy_(pieces, grads)
            for index, piece in zip(indices, pieces):
                params[index] = piece
        return inputs, params


@contextlib.contextmanager
def _parameters_as_views(stack: torch.nn.Module, params: list) -> Iterator[list]:
    """Inside the block, each parameter of ``stack`` that requires grad is replaced in its module by
    a view of itself (the same memory, so the captured kernels read the parameter). The capture
    differentiates with respect to the views: a parameter's own gradient accumulator may still be
    alive from an earlier step (a caller's `loss` keeps that step's graph), bound to the stream it
    was made on, and the backward capture would then synchronise with that stream and fail."""
    views = {id(p): p.view_as(p) for p in params if p.requires_grad}
    bindings = [(module, name, views[id(p)]) for module in stack.modules()
                for name, p in module._parameters.items() if p is not None and id(p) in views]
    with parameters_bound(bindings):
        yield [views[id(p)] for p in params if p.requires_grad]


class _Replay(torch.autograd.Function):
    """A training call: the forward graph's replay, and the backward graph's in the backward."""

    @staticmethod
    def forward(ctx, entry: _Captured, m, z, msa_mask, pair_mask, *params):
        entry.load((m, z, msa_mask, pair_mask))
        entry.forward_graph.replay()
        ctx.entry, ctx.pending = entry, _Pending()
        entry.pending = weakref.ref(ctx.pending)
        outs = tuple(o.clone() for o in entry.outputs)
        ctx.mark_non_differentiable(*(o for o, d in zip(outs, entry.differentiable) if not d))
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        entry = ctx.entry
        if ctx.pending is None:
            raise RuntimeError(
                "cuda_graphs: the backward of a graphed stack call ran a second time (retain_graph=True); "
                "its graph keeps one backward per forward. Run that step with cuda_graphs=False."
            )
        for static, g in zip(entry.grad_outputs, [g for g, d in zip(grads, entry.differentiable) if d]):
            static.copy_(g)
        entry.backward_graph.replay()
        ctx.pending = None
        entry.pending = None
        input_grads, param_grads = entry.gradients()
        it = iter(input_grads)
        m_grad = next(it) if entry.inputs[0].requires_grad else None
        z_grad = next(it) if entry.inputs[1].requires_grad else None
        return (None, m_grad, z_grad, None, None, *param_grads)


class StackGraphs:
    """The CUDA graphs of one stack, per input signature (see the module docstring)."""

    def __init__(self, stack: torch.nn.Module, max_signatures: int):
        # A weak reference: the stack holds its graphs, the graphs do not hold the stack (no
        # reference cycle, whose collection could otherwise land inside a later capture).
        self._stack = weakref.ref(stack)
        self.max_signatures = max_signatures
        self._captured: OrderedDict[tuple, _Captured] = OrderedDict()
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._failed: set[tuple] = set()
        self._new_in_a_row = 0
        self._evictions = 0
        self._stopped: Optional[str] = None  # why no new signature is captured any more
        self._params: Optional[list[torch.nn.Parameter]] = None
        self._backends: Optional[set] = None  # the backend arguments of the stack's modules
        self._stream: Optional[torch.cuda.Stream] = None
        self._logged: set[str] = set()
        self.replays = 0  # calls served by graph replays

    @property
    def stack(self) -> torch.nn.Module:
        return self._stack()

    # A stack is copied (copy.deepcopy) and pickled with its setting, not with its graphs: the
    # stack's __deepcopy__/__reduce__ see a plain number (see _Stack.__getstate__).

    def clear(self, why: str) -> None:
        """Drops every captured graph (their memory pools go with them)."""
        if self._captured:
            logger.info("cuda_graphs: %s: dropped the graphs of %d signature(s): %s",
                        type(self.stack).__name__, len(self._captured), why)
        self._captured.clear()
        self._seen.clear()
        self._failed.clear()
        self._params = self._backends = None

    def _log_once(self, message: str, level: int = logging.WARNING) -> None:
        if message not in self._logged:
            self._logged.add(message)
            logger.log(level, "cuda_graphs: %s: %s", type(self.stack).__name__, message)

    # ------------------------------------------------------------------ calls

    def run(self, m, z, msa_mask, pair_mask, chunk_size):
        """The stack's outputs from graph replays, or None where the plain stack must run (the
        reason logged once)."""
        if torch.compiler.is_compiling():
            return None  # torch.compile traces the plain stack
        reason = self._unsupported(m)
        if reason is not None:
            self._log_once(f"running without graphs: {reason}")
            return None
        if torch.cuda.is_current_stream_capturing():
            return None  # another capture records the plain stack
        params = self._parameters()
        requires = bytes(p.requires_grad for p in params)  # one pass over the parameters per call
        training = torch.is_grad_enabled() and (m.requires_grad or z.requires_grad or any(requires))
        key = self._signature(m, z, chunk_size, training, requires)
        entry = self._captured.get(key)
        if entry is not None and entry.param_ptrs != tuple(p.data_ptr() for p in params):
            self.clear("a parameter's storage changed since the capture")
            entry = None
        if entry is None:
            entry = self._maybe_capture(key, m, z, msa_mask, pair_mask, chunk_size, training, params)
            if entry is None:
                return None
        self._captured.move_to_end(key)
        if not training:
            self.replays += 1
            entry.load((m, z, msa_mask, pair_mask))
            entry.forward_graph.replay()
            return entry.results()
        if entry.busy():
            self._log_once(
                "a call came while the previous call of its signature still awaited its backward (its "
                "activations live in the graph's memory); such calls run without graphs", logging.INFO,
            )
            return None
        self.replays += 1
        outs = _Replay.apply(entry, m, z, msa_mask, pair_mask, *entry.params)
        return outs[0] if entry.single else outs

    def _unsupported(self, m: torch.Tensor) -> Optional[str]:
        if m.device.type != "cuda":
            return f"the inputs are on {m.device}; CUDA graphs need CUDA tensors"
        if m.dtype == torch.float64:
            return "float64 runs on the eager backend; CUDA graphs serve the fused kernels"
        if self._backends is None:
            self._backends = {module.backend for module in self.stack.modules() if hasattr(module, "backend")}
        names = {get_default_backend() if name is None else name for name in self._backends}
        if "eager" in names:
            return "the eager backend is selected; CUDA graphs serve the fused kernels"
        return None

    def _parameters(self) -> list[torch.nn.Parameter]:
        if self._params is None:
            self._params = list(self.stack.parameters())
        return self._params

    def _signature(self, m, z, chunk_size, training: bool, requires: bytes) -> tuple:
        return (
            *self.stack._computation_key(m, z, chunk_size), training,
            torch.is_grad_enabled(), torch.is_inference_mode_enabled(), self.stack.training,
            self.stack.blocks_per_ckpt, self.stack.recompute, self.stack.recompute_budget_gib,
            self.stack.checkpoint_last_group, m.requires_grad, z.requires_grad,
            requires if training else b"",
            torch.are_deterministic_algorithms_enabled(),
        )

    # ------------------------------------------------------------------ capture

    def _maybe_capture(self, key, m, z, msa_mask, pair_mask, chunk_size, training, params) -> Optional[_Captured]:
        if key in self._failed or self._stopped is not None:
            if self._stopped is not None:
                self._log_once(f"running without graphs: {self._stopped}")
            return None
        if key not in self._seen:  # first sighting: the plain stack runs (and warms up)
            self._seen[key] = None
            if len(self._seen) > _SEEN_KEPT:
                self._seen.popitem(last=False)
            self._new_in_a_row += 1
            if self._new_in_a_row >= _NEW_IN_A_ROW:
                self._log_once(
                    f"the input signature was new on {_NEW_IN_A_ROW} calls in a row (shapes that change on "
                    "every call): those calls run without graphs; pad the inputs to fixed sizes to use them"
                )
            return None
        self._new_in_a_row = 0
        if len(self._captured) >= self.max_signatures:
            self._captured.popitem(last=False)
            self._evictions += 1
            logger.info("cuda_graphs: %s: dropped the least recently used signature's graphs for a new one",
                        type(self.stack).__name__)
            if self._evictions > 2 * self.max_signatures:
                self._stopped = (
                    f"more input signatures are in use than the {self.max_signatures} that keep graphs "
                    "(each new one costs a capture); set cuda_graphs to a larger number"
                )
        start = time.perf_counter()
        collecting = gc.isenabled()
        gc.disable()  # an object freed by the collector mid-capture (a graph, say) would break the capture
        try:
            entry = self._capture(m, z, msa_mask, pair_mask, chunk_size, training, params)
        except Exception as exc:  # the plain stack still runs this signature
            self._failed.add(key)
            self._log_once(f"capture failed, this signature runs without graphs: {type(exc).__name__}: {exc}")
            return None
        finally:
            if collecting:
                gc.enable()
        self._captured[key] = entry
        logger.info("cuda_graphs: %s: captured the %s of [%s] / [%s] in %.1f s", type(self.stack).__name__,
                    "training step" if training else "forward", ", ".join(map(str, m.shape)),
                    ", ".join(map(str, z.shape)), time.perf_counter() - start)
        return entry

    def _capture(self, m, z, msa_mask, pair_mask, chunk_size, training, params) -> _Captured:
        entry = _Captured()
        entry.inputs = (
            m.detach().clone().requires_grad_(training and m.requires_grad),
            z.detach().clone().requires_grad_(training and z.requires_grad),
            msa_mask.detach().clone(),
            pair_mask.detach().clone(),
        )
        if self._stream is None or self._stream.device != m.device:
            self._stream = torch.cuda.Stream(device=m.device)
        pool = torch.cuda.graph_pool_handle()
        autocast = torch.is_autocast_enabled("cuda")
        dtype = torch.get_autocast_dtype("cuda")

        def graph_context(graph):
            return torch.cuda.graph(graph, pool=pool, stream=self._stream)

        def autocast_context():
            # Autocast's cache of cast weights would keep tensors of the capture: off while capturing.
            return torch.autocast("cuda", dtype=dtype, enabled=autocast, cache_enabled=False)

        entry.forward_graph = torch.cuda.CUDAGraph()
        with torch.set_grad_enabled(training), autocast_context(), graph_context(entry.forward_graph), \
                _parameters_as_views(self.stack, params if training else []) as views:
            outs = self.stack._forward_checked(*entry.inputs, chunk_size)
        entry.single = isinstance(outs, torch.Tensor)
        entry.outputs = (outs,) if entry.single else tuple(outs)
        entry.differentiable = tuple(o.requires_grad for o in entry.outputs)
        entry.param_ptrs = tuple(p.data_ptr() for p in params)
        if not training:
            return entry

        entry.params = [p for p in params if p.requires_grad]
        wrt = [t for t in entry.inputs[:2] if t.requires_grad] + views
        differentiable = [o for o in entry.outputs if o.requires_grad]
        entry.grad_outputs = [torch.empty_like(o) for o in differentiable]  # each replay copies them in
        entry.backward_graph = torch.cuda.CUDAGraph()
        with autocast_context(), graph_context(entry.backward_graph):
            grads = torch.autograd.grad(differentiable, wrt, grad_outputs=entry.grad_outputs, allow_unused=True)
            n_inputs = len(wrt) - len(entry.params)
            entry.input_grads = list(grads[:n_inputs])
        # The outputs as plain tensors: kept with their autograd graph they would keep that graph's
        # nodes alive, among them the parameters' gradient accumulators, created on the capture
        # stream, and every replay's backward would then synchronise that stream per parameter.
        entry.outputs = tuple(o.detach() for o in entry.outputs)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(grads[n_inputs:]):
            if g is not None:
                by_dtype.setdefault(g.dtype, []).append(i)
        for indices in by_dtype.values():
            group = [grads[n_inputs + i] for i in indices]
            entry.param_grads.append((group, indices, [g.numel() for g in group]))
        return entry
