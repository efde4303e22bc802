"""Backend selection: the one place where an op decides which implementation runs.

Every op of the package (today ``evoformer_attention``) has backends registered under names such
as ``"eager"`` and ``"cutlass"``; a backend states what it supports as data
(:class:`Capabilities`) plus one hook of its own (:meth:`Backend.extra_reasons`). All ops share ONE
setting, a name: ``"auto"`` or a backend name, taken from (first that is set) the op's
``backend=`` argument, the innermost ``with backend(...)`` block, :func:`set_backend`, the
``EVOFORMER_BLOCKS_BACKEND`` environment variable, else ``"auto"``. ``auto`` takes the op's
backend of lowest ``auto_priority`` that can run the inputs.

The state (backends, priorities, the default, the context stack, what was logged, the selections
remembered per input shapes) lives in one :class:`Registry`, :data:`REGISTRY`; the module-level
functions act on it, and ``REGISTRY.isolated()`` undoes a test's changes. A second op gives its backends
``op = "<its name>"``, registers them with :func:`register` under the shared names, validates its
inputs into an object with ``device``, ``dtype`` and ``tensors()`` (:class:`OpInputs`), and calls
``select("<its name>", inputs, backend)``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Iterator, Optional, Protocol

import torch

from ._inputs import describe

logger = logging.getLogger("evoformer_blocks")

ENV_VAR = "EVOFORMER_BLOCKS_BACKEND"
AUTO = "auto"
ATTENTION_OP = "evoformer_attention"
_MAX_SELECTIONS = 4096  # selections remembered (Registry.select) before the memory starts afresh


class OpInputs(Protocol):
    """What selection reads from an op's validated inputs (e.g. :class:`AttentionInputs`).

    ``head_dim`` is read only by a backend whose :class:`Capabilities` limit it. ``selection_key()``
    (every :class:`~evoformer_blocks.ops._inputs.ValidatedInputs` has it) lets selection remember
    its answer; inputs without it are checked on every call.
    """

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def tensors(self) -> dict[str, Optional[torch.Tensor]]: ...

    def selection_key(self) -> tuple: ...


def constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing ``torch._dynamo`` (about 1.8 s
    of the package's import on a CPU machine): that decorator only sets the attribute below, which
    dynamo reads when it traces a call to ``fn`` (tests/test_ops.py checks that it still does)."""
    fn._dynamo_marked_constant = True
    return fn


_capabilities: dict[int, tuple[int, int]] = {}


@constant_result
def _capability(index: int) -> tuple[int, int]:
    """The compute capability of CUDA device ``index``, asked once per device (every op call
    selects a backend, and the driver query costs tens of microseconds)."""
    capability = _capabilities.get(index)
    if capability is None:
        capability = _capabilities[index] = torch.cuda.get_device_capability(index)
    return capability


@dataclass(frozen=True)
class Capabilities:
    """What a backend can run, as data; :meth:`reasons` checks inputs against it."""

    dtypes: tuple[torch.dtype, ...]
    device_types: tuple[str, ...]  # e.g. ("cuda",); () means any device
    head_dim_multiple: int = 1
    max_head_dim: Optional[int] = None
    min_compute_capability: Optional[tuple[int, int]] = None
    # False: results may differ from run to run (e.g. atomics). Under
    # torch.use_deterministic_algorithms(True) selection skips (auto) or refuses (named) it.
    deterministic: bool = True

    def reasons(self, inputs: OpInputs) -> list[str]:
        """Why this table excludes ``inputs``; empty when it does not."""
        reasons = []
        if self.device_types and inputs.device.type not in self.device_types:
            reasons.append(f"device type {inputs.device.type!r} is not one of {list(self.device_types)}")
        if inputs.dtype not in self.dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in self.dtypes)
            reasons.append(f"dtype {inputs.dtype} is not supported (supported: {names})")
        if self.head_dim_multiple != 1 or self.max_head_dim is not None:
            d = inputs.head_dim
            if d % self.head_dim_multiple:
                reasons.append(f"head dim D={d} is not a multiple of {self.head_dim_multiple}")
            if self.max_head_dim is not None and d > self.max_head_dim:
                reasons.append(f"head dim D={d} exceeds the maximum {self.max_head_dim}")
        if self.min_compute_capability is not None and inputs.device.type == "cuda":
            cc = _capability(inputs.device.index or 0)
            if cc < self.min_compute_capability:
                want = "%d.%d" % self.min_compute_capability
                reasons.append(f"compute capability {cc[0]}.{cc[1]} is below {want}")
        return reasons


class Backend:
    """Base class of the backends of every op.

    A subclass sets ``op`` (the op it implements; the default is the attention op, for which
    backends were written before there were several ops), ``name`` (``"eager"``, ``"cutlass"``,
    ...) and ``capabilities``, implements :meth:`forward`, and may add :meth:`extra_reasons`.
    Selection calls :meth:`not_supported_reasons`, which subclasses leave as it is. Its answer may
    depend only on the inputs' ``selection_key()`` (shapes, dtypes, devices, non-tensor arguments)
    and on the device and the build, never on tensor values: selection remembers it per key.
    """

    op: str = ATTENTION_OP
    name: str = ""
    capabilities: Capabilities

    def not_supported_reasons(self, inputs: OpInputs) -> list[str]:
        """Reasons this backend cannot run ``inputs``; empty when it can.

        The capability table first; only inputs it accepts reach :meth:`extra_reasons`, so that
        hook may do costly work (such as a first-use build).
        """
        return self.capabilities.reasons(inputs) or self.extra_reasons(inputs)

    def extra_reasons(self, inputs: OpInputs) -> list[str]:
        """The backend's own reasons beyond the capability table (e.g. its kernels failed to build)."""
        return []

    def forward(self, inputs: OpInputs, chunk_size: Optional[int]) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} implements no forward")


@dataclass
class _State:
    backends: dict[str, dict[str, Backend]] = field(default_factory=dict)  # op -> name -> backend
    priorities: dict[tuple[str, str], int] = field(default_factory=dict)  # (op, name) -> auto priority
    order: dict[str, list[str]] = field(default_factory=dict)  # op -> backend names, auto's order
    default: Optional[str] = None  # set_backend
    context: list[str] = field(default_factory=list)  # `with backend(...)` blocks, innermost last
    logged: set[str] = field(default_factory=set)
    # (op, name in effect, deterministic mode, the inputs' selection_key()) -> the backend selected
    selected: dict[tuple, "Backend"] = field(default_factory=dict)
    # (deterministic mode, a caller's key) -> what the caller decided from selections (Registry.decision)
    decisions: dict[tuple, object] = field(default_factory=dict)

    def copy(self) -> "_State":
        return _State(
            backends={op: dict(named) for op, named in self.backends.items()},
            priorities=dict(self.priorities),
            order={op: list(names) for op, names in self.order.items()},
            default=self.default,
            context=list(self.context),
            logged=set(self.logged),
        )


class Registry:
    """The backends of every op, their ``auto`` priorities, and the one backend setting."""

    def __init__(self) -> None:
        self._state = _State()

    # ------------------------------------------------------------------ backends

    def register(self, backend_impl: Backend, auto_priority: int) -> None:
        """Adds ``backend_impl`` under ``(backend_impl.op, backend_impl.name)``; ``auto`` tries an
        op's backends in increasing ``auto_priority``. Registering the same object again only
        changes its priority; another object under a taken name raises ``ValueError``."""
        op, name = backend_impl.op, backend_impl.name
        if not isinstance(backend_impl, Backend) or not op or not name or name == AUTO:
            raise ValueError(
                f"register: `backend_impl` must be a Backend with an `op` and a `name` other than {AUTO!r}, "
                f"got {type(backend_impl).__name__} (op={op!r}, name={name!r})"
            )
        if isinstance(auto_priority, bool) or not isinstance(auto_priority, int):
            raise ValueError(f"register: `auto_priority` must be an int, got {auto_priority!r}")
        backends = self._state.backends.setdefault(op, {})
        present = backends.get(name)
        if present is not None and present is not backend_impl:
            raise ValueError(
                f"register: op {op!r} already has a backend {name!r} ({type(present).__name__}); "
                f"got another ({type(backend_impl).__name__})"
            )
        backends[name] = backend_impl
        self._state.priorities[(op, name)] = auto_priority
        self._state.order[op] = sorted(backends, key=lambda n: self._state.priorities[(op, n)])
        self._state.selected.clear()
        self._state.decisions.clear()

    def ops(self) -> list[str]:
        return list(self._state.backends)

    def names(self, op: Optional[str] = None) -> list[str]:
        """``"auto"`` then the backend names of ``op`` in ``auto`` order (``None``: of every op)."""
        if op is not None:
            return [AUTO] + self._state.order[self._check_op(op)]
        names = [AUTO]
        for order in self._state.order.values():
            names += [n for n in order if n not in names]
        return names

    def get(self, name: str, op: str = ATTENTION_OP) -> Backend:
        """The backend ``name`` of ``op``."""
        self._check_op(op)
        if name == AUTO:
            raise ValueError(f"name: {AUTO!r} is a selection rule, not a backend; choose one of {self.names(op)[1:]}")
        if not isinstance(name, str) or name not in self._state.backends[op]:
            raise ValueError(f"name: unknown backend {name!r} of op {op!r}; choose one of {self.names(op)[1:]}")
        return self._state.backends[op][name]

    def _check_op(self, op: str) -> str:
        if op not in self._state.backends:
            raise ValueError(f"op: unknown op {op!r}; registered: {self.ops()}")
        return op

    # ------------------------------------------------------------------ the setting

    def check_name(self, name, argument: str, op: Optional[str] = None) -> str:
        """``name`` if it is ``"auto"`` or a backend (of ``op``, or of any op); else ``ValueError``
        naming ``argument``."""
        if not isinstance(name, str) or name not in self.names(op):
            where = "" if op is None else f" for op {op!r}"
            raise ValueError(f"{argument}: unknown backend {name!r}{where}; choose one of {self.names(op)}")
        return name

    def set_default(self, name: Optional[str]) -> None:
        """Sets the process-wide default (``None`` returns to the environment/auto default)."""
        self._state.default = None if name is None else self.check_name(name, "set_backend")

    def default(self) -> str:
        """The name in effect when an op's ``backend=`` argument is None."""
        if self._state.context:
            return self._state.context[-1]
        if self._state.default is not None:
            return self._state.default
        env = os.environ.get(ENV_VAR)
        if env:
            return self.check_name(env.strip().lower(), f"environment variable {ENV_VAR}")
        return AUTO

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[None]:
        """``with registry.use("eager"): ...`` selects a backend for the calls inside the block."""
        state = self._state  # the block's own, should isolated() swap the state meanwhile
        state.context.append(self.check_name(name, "backend"))
        try:
            yield
        finally:
            state.context.pop()

    def resolve(self, op: str, requested: Optional[str]) -> str:
        """The name that applies to a call of ``op`` whose ``backend=`` argument is ``requested``:
        ``"auto"`` or a backend of ``op`` (else ``ValueError``)."""
        name = self.default() if requested is None else self.check_name(requested, "backend")
        if name != AUTO and name not in self._state.backends[self._check_op(op)]:
            raise ValueError(f"{op}: backend {name!r} has no implementation of this op; choose one of {self.names(op)}")
        return name

    # ------------------------------------------------------------------ selection

    def select(self, op: str, inputs: OpInputs, requested: Optional[str]) -> Backend:
        """Returns the backend of ``op`` that will run ``inputs``.

        A named backend that cannot run them raises ``ValueError`` with its reasons; ``auto``
        takes the first backend with no reasons and logs once why the ones before it were skipped.
        Under ``torch.use_deterministic_algorithms(True)`` a backend whose capabilities say
        ``deterministic=False`` cannot run (with ``warn_only=True``: a named one runs and warns).

        The answer is kept per (op, name in effect, deterministic mode, ``inputs.selection_key()``)
        until a backend is registered, so that a module called again with inputs of the same
        shapes pays a dictionary lookup, not the checks (an op call's selection otherwise costs
        host time comparable to a kernel launch). Failures and warnings are not kept; under
        torch.compile nothing is (the graph keeps its choice).
        """
        name = self.resolve(op, requested)
        key = None
        selection_key = getattr(inputs, "selection_key", None)  # (an OpInputs may lack it: no memory)
        if selection_key is not None and not torch.compiler.is_compiling():
            key = (op, name, torch.are_deterministic_algorithms_enabled(), selection_key())
            impl = self._state.selected.get(key)
            if impl is not None:
                return impl
        impl = self._select(op, name, inputs)
        if key is not None and (impl.capabilities.deterministic or not key[2]):
            if len(self._state.selected) >= _MAX_SELECTIONS:  # e.g. a new shape on every call
                self._state.selected.clear()
            self._state.selected[key] = impl
        return impl

    def decision(self, key: tuple, decide):
        """``decide()``, a caller's answer that follows from selections alone (e.g. whether every op a
        module node stands for selects the backend the node runs), kept per ``key`` and deterministic
        mode as :meth:`select` keeps its answers: the key must hold everything the selections read
        (the names in effect, the inputs' shapes, dtypes and devices). Not kept under torch.compile."""
        if torch.compiler.is_compiling():
            return decide()
        full = (torch.are_deterministic_algorithms_enabled(), key)
        decisions = self._state.decisions
        if full in decisions:
            return decisions[full]
        answer = decide()
        if len(decisions) >= _MAX_SELECTIONS:
            decisions.clear()
        decisions[full] = answer
        return answer

    def recalled(self, key: tuple) -> Optional[bool]:
        """The answer :meth:`remember` kept for ``key`` in this deterministic mode, or None: for an answer
        that a call finds out by running (not from selections alone), kept and dropped with
        :meth:`decision`'s."""
        return self._state.decisions.get((torch.are_deterministic_algorithms_enabled(), key))

    def remember(self, key: tuple, answer: bool) -> None:
        """Keeps ``answer`` for ``key`` (see :meth:`recalled`)."""
        decisions = self._state.decisions
        if len(decisions) >= _MAX_SELECTIONS:
            decisions.clear()
        decisions[(torch.are_deterministic_algorithms_enabled(), key)] = answer

    def _select(self, op: str, name: str, inputs: OpInputs) -> Backend:
        if name != AUTO:
            impl = self._state.backends[op][name]
            reasons = self._reasons(impl, inputs, named=True)
            if reasons:
                raise ValueError(
                    f"{op}: backend {name!r} cannot run these inputs:\n  - "
                    + "\n  - ".join(reasons)
                    + f"\n{describe(inputs.tensors())}\nUse backend='auto' to fall back to another backend."
                )
            return impl
        skipped = []
        for candidate in self._state.order[op]:
            impl = self._state.backends[op][candidate]
            reasons = self._reasons(impl, inputs, named=False)
            if not reasons:
                if skipped:
                    on_gpu = inputs.device.type == "cuda"
                    self._log_once(
                        f"{op}(auto): using {candidate!r}; skipped " + "; ".join(skipped),
                        logging.WARNING if on_gpu else logging.INFO,
                    )
                return impl
            skipped.append(f"{candidate!r} because " + ", ".join(reasons))
        raise ValueError(f"{op}: no backend can run these inputs: " + "; ".join(skipped))

    def _reasons(self, impl: Backend, inputs: OpInputs, named: bool) -> list[str]:
        """The backend's reasons, plus the determinism rule: with ``warn_only=True`` a named
        backend still runs, with a warning; ``auto`` always passes over it."""
        reasons = list(impl.not_supported_reasons(inputs))
        if impl.capabilities.deterministic or not torch.are_deterministic_algorithms_enabled():
            return reasons
        rule = "it is not deterministic and torch.use_deterministic_algorithms(True) is set"
        if named and torch.is_deterministic_algorithms_warn_only_enabled():
            if not torch.compiler.is_compiling():
                warnings.warn(f"{impl.op}: backend {impl.name!r} runs although {rule}", UserWarning, stacklevel=4)
            return reasons
        return reasons + [rule]

    def _log_once(self, message: str, level: int) -> None:
        # Logging is skipped while torch.compile traces, so selection never breaks a graph.
        if message in self._state.logged or torch.compiler.is_compiling():
            return
        self._state.logged.add(message)
        logger.log(level, message)

    # ------------------------------------------------------------------ tests

    @contextlib.contextmanager
    def isolated(self) -> Iterator["Registry"]:
        """Inside the block, changes to the registry (backends registered, ``set_backend``, open
        ``with backend(...)`` blocks, what was logged) are undone on exit; the log starts empty."""
        saved = self._state
        self._state = saved.copy()
        self._state.logged = set()
        try:
            yield self
        finally:
            self._state = saved


REGISTRY = Registry()


def register(backend_impl: Backend, auto_priority: int) -> None:
    """Adds a backend of ``backend_impl.op``; ``auto`` tries backends in increasing ``auto_priority``."""
    REGISTRY.register(backend_impl, auto_priority)


def backend_names(op: Optional[str] = None) -> list[str]:
    """``"auto"`` and the backend names of ``op`` (``None``: of every op), in ``auto`` order."""
    return REGISTRY.names(op)


def get_backend(name: str, op: str = ATTENTION_OP) -> Backend:
    """The backend ``name`` of ``op`` (``"auto"`` is a rule, not a backend, and raises)."""
    return REGISTRY.get(name, op)


def set_backend(name: Optional[str]) -> None:
    """Sets the process-wide default backend of every op (``None``: back to the environment/auto)."""
    REGISTRY.set_default(name)


def get_default_backend() -> str:
    """The backend name in effect when an op's ``backend=`` argument is None."""
    return REGISTRY.default()


def backend(name: str) -> contextlib.AbstractContextManager:
    """``with backend("eager"): ...`` selects a backend for every op called inside the block."""
    return REGISTRY.use(name)


_composing = 0  # open evoformer_blocks.ops.module_nodes.composed() blocks


def nodes_allowed() -> bool:
    """Whether an op may record one of the extension's C++ autograd nodes (the modules' and the layer
    norms', csrc/modules) instead of composing its Python-level nodes: not under torch.compile (the
    compiled graph traces the composed ops, whose fakes it knows) and not inside
    :func:`~evoformer_blocks.ops.module_nodes.composed` (A/B comparisons)."""
    return not (_composing or torch.compiler.is_compiling())


_nodes = threading.local()  # .count: the C++ node ops called on this thread (node_ran)


def node_ran() -> None:
    """Counts one call of a module's or a layer norm's C++ node op (csrc/modules) on this thread, in a
    form that a block's update as one C++ call also takes: the block decides from the count of a call
    through Python that every module ran its node that way
    (:meth:`evoformer_blocks.evoformer._MSABlock._update`)."""
    _nodes.count = getattr(_nodes, "count", 0) + 1


def nodes_run() -> int:
    """How many node ops this thread has called (:func:`node_ran`)."""
    return getattr(_nodes, "count", 0)


def select(op: str, inputs: OpInputs, requested: Optional[str]) -> Backend:
    """The backend of ``op`` that runs ``inputs`` (see :meth:`Registry.select`)."""
    return REGISTRY.select(op, inputs, requested)
