"""The "cutlass" backend: the fused CUDA kernels of csrc/ behind autograd.

:class:`_CutlassAttentionFunction` calls the extension's ``forward`` (the output, the softmax
statistics of each query row, max score and log2 row sum, and the biases as the kernels read them)
and ``backward`` (recomputes the probabilities from them; the gradients of q, k, v and of each bias
that needs one). :class:`_CutlassGatedAttentionFunction` is the same pair for
``ops.gated_evoformer_attention`` (``gated_attention_fwd`` / ``_bwd``): the attention and its sigmoid
gate on a stacked q/k/v/g projection as one node, whose backward writes every gradient of the
projection into one tensor. The ops have fake implementations (below), so both nodes trace under
torch.compile(fullgraph=True), where the compiled graph calls the same ops.

Kernel families: ``"sm80"``, the portable kernels (any GPU of compute capability >= 8.0), and
``"sm90"``, the Hopper kernels (a 9.0 GPU and a build holding sm_90a code). :func:`kernel_family` is
the one place that chooses; a forward passes its choice to the kernels and saves it for its backward,
so one call's forward and backward always run the same family. float32 inputs run on the TF32
tensor cores, in the sm80 family only (on Hopper too), for head dims up to the table's
``tf32.max_head_dim``.

The biases, from the op to the kernels (prepared once per forward, reused by the backward):

- ``mask_bias`` ``[B|1, N|1, 1, 1, Lk]``, additive, in q's dtype or float32 -> ``mask_prepared``,
  float32 ``[B|1, N|1, Lk_pad]``, divided by ``scale``, zero past Lk (Lk_pad: Lk rounded up to whole
  16-byte rows); ``[0]`` without a mask bias.
- ``pair_bias`` ``[B|1, 1, H|1, Lq, Lk]`` in q's dtype or float32 is read in place when its rows are
  in kernel layout; else the forward makes one zero-padded copy ``pair_prepared``
  ``[B|1, H|1, Lq, Lk_pad]``; ``[0]`` when it made none. The extension decides; :func:`pair_needs_copy`
  applies its rule to the metadata, for the fake implementation.

Limits and instantiation lists come from ``csrc/kernel_table.json``, the table the
kernels' generated sources come from.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from . import _build, _fused, _keep
from ._dispatch import ATTENTION_OP, Backend, Capabilities, constant_result, register
from ._inputs import AttentionInputs, gated_views

Tensor = torch.Tensor

KERNELS_ENV = "EVOFORMER_BLOCKS_KERNELS"
TABLE_PATH = _build.SOURCE_DIR / "kernel_table.json"


def _load_table() -> Optional[dict]:
    """kernel_table.json, or None where the kernel sources are not installed."""
    try:
        return json.loads(TABLE_PATH.read_text())
    except FileNotFoundError:
        return None


TABLE = _load_table()
ROW_ALIGN_BYTES: Optional[int] = TABLE["row_align_bytes"]["value"] if TABLE else None  # None: nothing runs
# The block ops' row kernels: a row of whole ROW_CHUNK_BYTES chunks, at most MAX_ROW_BYTES (None: no sources)
ROW_CHUNK_BYTES: Optional[int] = TABLE["row_kernels"]["chunk_bytes"] if TABLE else None
MAX_ROW_BYTES: Optional[int] = (
    TABLE["row_kernels"]["max_lanes"] * TABLE["row_kernels"]["max_chunks_per_lane"] * ROW_CHUNK_BYTES
    if TABLE else None
)
# float32 on the TF32 tensor cores: its dtype and largest head dim (None: no kernel sources)
TF32_DTYPE: Optional[torch.dtype] = getattr(torch, TABLE["tf32"]["dtype"]["torch"]) if TABLE else None
TF32_MAX_HEAD_DIM: Optional[int] = TABLE["tf32"]["max_head_dim"] if TABLE else None
TF32_FAMILY = "sm80"  # the one family with TF32 kernels (kernel_table.json: tf32.families)
# The outer product mean's fused projection (kernel_table.json: outer_product_mean): its c_hidden,
# output tile (c_z) and most batch indices B * I (None: no kernel sources)
OPM_HIDDEN: Optional[int] = TABLE["outer_product_mean"]["hidden"] if TABLE else None
OPM_TILE: Optional[int] = TABLE["outer_product_mean"]["tile"] if TABLE else None
OPM_MAX_BATCHES: Optional[int] = TABLE["outer_product_mean"]["max_batches"] if TABLE else None


_kernels = _fused.kernels
# The attention forward ops' qualified names (a stack's recompute policy may keep their outputs)
FORWARD_OP = f"{_build.OP_NAMESPACE}::forward"
GATED_FORWARD_OP = f"{_build.OP_NAMESPACE}::gated_attention_fwd"


def _round_up(x, multiple: int):
    return (x + multiple - 1) // multiple * multiple


def pair_needs_copy(pair_bias: Tensor) -> bool:
    """Whether the kernels need a zero-padded copy of ``pair_bias`` [B|1, 1, H|1, Lq, Lk]: they read it
    in place only when its keys are contiguous and every row starts on a 16-byte boundary and is
    readable to a multiple of 16 bytes: the extension's rule, applied to metadata alone (dtype, sizes,
    strides, storage offset) so that the fake implementation's ``pair_prepared`` matches the real
    one; the storage itself is taken to start 16-byte aligned (CUDA allocations do; the extension
    copies a pair bias whose storage does not)."""
    element = pair_bias.element_size()
    per_chunk = ROW_ALIGN_BYTES // element
    batch, _, heads, len_q, len_k = pair_bias.shape
    stride_b, _, stride_h, stride_q, stride_k = pair_bias.stride()
    if stride_k != 1 or len_k % per_chunk or (pair_bias.storage_offset() * element) % ROW_ALIGN_BYTES:
        return True
    return any(size != 1 and stride % per_chunk for size, stride in ((batch, stride_b), (heads, stride_h), (len_q, stride_q)))


def _mask_prepared_like(q: Tensor, mask_bias: Optional[Tensor], len_k) -> Tensor:
    if mask_bias is None:
        return q.new_empty(0, dtype=torch.float32)
    shape = (mask_bias.shape[0], mask_bias.shape[1], _round_up(len_k, ROW_ALIGN_BYTES // 4))
    return mask_bias.new_empty(shape, dtype=torch.float32)


def _pair_prepared_like(q: Tensor, pair_bias: Optional[Tensor]) -> Tensor:
    if pair_bias is None:
        return q.new_empty(0)
    if not pair_needs_copy(pair_bias):
        return pair_bias.new_empty(0)
    batch, _, heads, len_q, len_k = pair_bias.shape
    return pair_bias.new_empty((batch, heads, len_q, _round_up(len_k, ROW_ALIGN_BYTES // pair_bias.element_size())))


def _forward_like(q: Tensor, k: Tensor, mask_bias: Optional[Tensor], pair_bias: Optional[Tensor]):
    """The forward's outputs (out, stats, mask_prepared, pair_prepared) as new empty tensors."""
    batch, rows, len_q, heads, _ = q.shape
    return (
        q.new_empty(q.shape),
        q.new_empty((batch, rows, heads, len_q, 2), dtype=torch.float32),
        _mask_prepared_like(q, mask_bias, k.shape[2]),
        _pair_prepared_like(q, pair_bias),
    )


@_fused.fake("forward")
def _(q, k, v, mask_bias, pair_bias, scale, family):
    return _forward_like(q, k, mask_bias, pair_bias)


def memory_order(t: Tensor) -> list[int]:
    """The physical order of a new gradient of ``t [B, N, L, H, D]``: (b, n, l, h) by ``t``'s strides,
    largest first (ties in dim order), then D. The backward kernels write dq, dk, dv so (the
    extension orders them the same way), so that the gradient of a permuted view is a permuted
    dense tensor: column attention's projection backward reads it without a copy."""
    return sorted(range(4), key=lambda d: -t.stride(d)) + [4]


def empty_in_memory_order(t: Tensor) -> Tensor:
    return torch.empty_permuted(t.shape, memory_order(t), dtype=t.dtype, device=t.device)


def _bias_grads_like(q, k, mask_prepared, pair_bias, dmask_dtype, need_dpair) -> tuple[Tensor, Tensor]:
    """The backward's bias gradients (an empty tensor where not wanted) as new empty tensors."""
    if dmask_dtype is not None and mask_prepared.numel() > 0:
        dmask = q.new_empty((mask_prepared.shape[0], mask_prepared.shape[1], 1, 1, k.shape[2]), dtype=dmask_dtype)
    else:
        dmask = q.new_empty(0)
    dpair = pair_bias.new_empty(pair_bias.shape) if need_dpair and pair_bias is not None else q.new_empty(0)
    return dmask, dpair


@_fused.fake("backward")
def _(dout, q, k, v, out, stats, mask_prepared, pair_bias, pair_prepared, scale, family, dmask_dtype, need_dpair):
    dmask, dpair = _bias_grads_like(q, k, mask_prepared, pair_bias, dmask_dtype, need_dpair)
    return empty_in_memory_order(q), empty_in_memory_order(k), empty_in_memory_order(v), dmask, dpair


def _save(ctx, inputs, outputs, operands: int) -> None:
    """What every cutlass attention node keeps for its backward: the forward's first ``operands``
    inputs (q, k, v, or the stacked qkvg), its pair bias and its trailing arguments (scale, family,
    or heads, transposed, scale, family), less the caller's mask bias (its prepared form and dtype
    stand in for it), and the attention's outputs (out, stats, mask_prepared, pair_prepared: the
    last four of ``outputs``)."""
    mask_bias, pair_bias = inputs[operands : operands + 2]
    ctx.save_for_backward(*inputs[:operands], pair_bias, *outputs[-4:])
    ctx.operands = operands
    ctx.options = tuple(inputs[operands + 2 :])
    ctx.family = inputs[-1]  # (every node's last argument: the family its backward runs)
    ctx.mask_dtype = None if mask_bias is None else mask_bias.dtype


def _gradients(ctx, dout, backward):
    """The autograd backward of every node saved by :func:`_save`. ``backward(dout, *operands, out,
    stats, mask_prepared, pair_bias, pair_prepared, *options, dmask_dtype, need_dpair)`` runs the
    kernels and returns the operands' gradients, then the two bias gradients."""
    n = ctx.operands
    saved = ctx.saved_tensors
    operands, pair_bias, (out, stats, mask_prepared, pair_prepared) = saved[:n], saved[n], saved[n + 1 :]
    need_dmask = ctx.mask_dtype is not None and ctx.needs_input_grad[n]
    need_dpair = pair_bias is not None and ctx.needs_input_grad[n + 1]
    *d_operands, dmask, dpair = backward(
        dout, *operands, out, stats, mask_prepared, pair_bias, pair_prepared, *ctx.options,
        ctx.mask_dtype if need_dmask else None, need_dpair,
    )
    # one gradient per forward input: the operands, mask_bias, pair_bias, none for the options
    return (*d_operands, dmask if need_dmask else None, dpair if need_dpair else None, *([None] * len(ctx.options)))


class _CutlassAttentionFunction(torch.autograd.Function):
    """The attention node: the extension's ``forward`` and ``backward`` (arguments after q, k, v and
    the biases: scale, family)."""

    @staticmethod
    def forward(ctx, q, k, v, mask_bias, pair_bias, scale, family):
        # (_keep.call: a checkpointed stack group may keep the outputs, see evoformer_blocks.recompute)
        outputs = _keep.call(FORWARD_OP, _kernels().forward, q, k, v, mask_bias, pair_bias, scale, family)
        _save(ctx, (q, k, v, mask_bias, pair_bias, scale, family), outputs, operands=3)
        # Only the output leaves the Function: the statistics and prepared biases are saved
        # intermediates, so autograd has no gradients of them to materialize as zeros.
        return outputs[0]

    @staticmethod
    def backward(ctx, dout):
        return _gradients(ctx, dout, _kernels().backward)


def _family_of(t: Tensor) -> str:
    return TF32_FAMILY if t.dtype == TF32_DTYPE else _family(t.device.index)


def attention(q, k, v, mask_bias, pair_bias, scale: float) -> Tensor:
    """The fused attention output, differentiable in q, k, v and both biases."""
    return _CutlassAttentionFunction.apply(q, k, v, mask_bias, pair_bias, scale, _family_of(q))


# ---- gated attention of a stacked projection (ops.gated_evoformer_attention) -------------------
# One node for the attention and its sigmoid gate (the extension's gated_attention_fwd / _bwd):
# forward, the attention kernels on the q, k, v views of qkvg [B, A, A', 4 H D] and the gated output
# y = sigmoid(g) * O (the sm90 family writes it in the forward's epilogue, the sm80 family runs the
# gate kernel on O after it); backward, the gate's backward writes dg into qkvg's gradient and dO,
# and the attention's backward writes dq, dk, dv into the same tensor, so the gradient of qkvg
# leaves as one dense tensor.


@_fused.fake("gated_attention_fwd")
def _(qkvg, mask_bias, pair_bias, heads, transposed, scale, family):
    q, k, _, g = gated_views(qkvg, heads, transposed)
    return (g.new_empty(g.shape), *_forward_like(q, k, mask_bias, pair_bias))


@_fused.fake("gated_attention_bwd")
def _(dy, qkvg, out, stats, mask_prepared, pair_bias, pair_prepared, heads, transposed, scale, family, dmask_dtype,
      need_dpair):
    q, k, _, _ = gated_views(qkvg, heads, transposed)
    return (qkvg.new_empty(qkvg.shape), *_bias_grads_like(q, k, mask_prepared, pair_bias, dmask_dtype, need_dpair))


class _CutlassGatedAttentionFunction(torch.autograd.Function):
    """The gated attention's node (arguments after qkvg and the biases: heads, transposed, scale,
    family); saves and gradients as :class:`_CutlassAttentionFunction`'s."""

    @staticmethod
    def forward(ctx, qkvg, mask_bias, pair_bias, heads, transposed, scale, family):
        outputs = _keep.call(
            GATED_FORWARD_OP, _kernels().gated_attention_fwd, qkvg, mask_bias, pair_bias, heads, transposed, scale,
            family,
        )
        _save(ctx, (qkvg, mask_bias, pair_bias, heads, transposed, scale, family), outputs, operands=1)
        return outputs[0]

    @staticmethod
    def backward(ctx, dy):
        return _gradients(ctx, dy, _kernels().gated_attention_bwd)


def gated_attention(qkvg, mask_bias, pair_bias, heads: int, transposed: bool, scale: float) -> Tensor:
    """sigmoid(g) * attention(q, k, v) of the stacked projection qkvg (ops.gated_evoformer_attention),
    differentiable in qkvg and both biases."""
    return _CutlassGatedAttentionFunction.apply(qkvg, mask_bias, pair_bias, heads, transposed, scale, _family_of(qkvg))


_available: dict[int, tuple[str, ...]] = {}


def available_kernel_families(index: int) -> tuple[str, ...]:
    """The kernel families this build can run on CUDA device ``index`` (asked from the extension once
    per device; builds the kernels on first use)."""
    families = _available.get(index)
    if families is None:
        families = _available[index] = tuple(_kernels().available_kernel_families(index))
    return families


@constant_result
def _family(index: int) -> str:
    """kernel_family of CUDA device ``index`` (a constant to torch.compile: the choice made when a
    graph is traced stays with that graph)."""
    choice = os.environ.get(KERNELS_ENV, "") or "auto"
    if choice not in ("auto", "sm80"):
        raise ValueError(f"environment variable {KERNELS_ENV} must be unset, `auto` or `sm80`, got {choice!r}")
    if choice == "auto" and "sm90" in available_kernel_families(index):
        return "sm90"
    if _build.load_error() is None:  # (where the kernels build: tracing the fakes needs no build)
        _build.load_portable()  # a Hopper-only build keeps the portable 16-bit kernels apart: builds them once
    return "sm80"


def kernel_family(device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> str:
    """The kernels the cutlass backend runs on ``device`` (default: the current CUDA device) for inputs
    of ``dtype`` (default: 16-bit), forward and backward alike: ``"sm90"`` (the Hopper kernels) where
    the device has compute capability 9.0, the build holds sm_90a code and ``EVOFORMER_BLOCKS_KERNELS``
    is unset or ``auto``, else ``"sm80"`` (the portable kernels; ``EVOFORMER_BLOCKS_KERNELS=sm80``
    forces them); float32 (TF32 tensor cores) always ``"sm80"``. Any other value of the variable
    raises ValueError. The variable is read at every forward (a backward runs the family of its
    forward). Builds the kernels on first use; on a Hopper-only build the portable 16-bit kernels are
    a library of their own, built the first time ``"sm80"`` is chosen there."""
    if dtype is not None and dtype == TF32_DTYPE:
        return TF32_FAMILY
    index = torch.device(device if device is not None else "cuda").index
    return _family(torch.cuda.current_device() if index is None else index)


_smem_needed: dict[tuple, int] = {}
_smem_allowed: dict[int, int] = {}


@constant_result
def smem_needed(family: str, dtype: torch.dtype, head_dim: int, pair_dtype: Optional[torch.dtype]) -> int:
    """The most shared memory per block (bytes) that the kernels of ``family`` take, forward or backward,
    for q of ``dtype`` with head dim ``head_dim`` and a pair bias of ``pair_dtype`` (None: none); asked
    from the extension once per combination."""
    key = (family, dtype, head_dim, pair_dtype)
    needed = _smem_needed.get(key)
    if needed is None:
        if family == "sm80":
            _build.load_portable()  # (a Hopper-only build answers for these from their own library)
        needed = _smem_needed[key] = _kernels().kernel_smem_bytes(family, dtype, head_dim, pair_dtype)
    return needed


@constant_result
def smem_allowed(index: int) -> int:
    """The most shared memory one block may take on CUDA device ``index`` (its opt-in limit), asked once
    per device."""
    allowed = _smem_allowed.get(index)
    if allowed is None:
        allowed = _smem_allowed[index] = torch.cuda.get_device_properties(index).shared_memory_per_block_optin
    return allowed


def _capabilities(table: Optional[dict]) -> Capabilities:
    if table is None:  # no kernel sources: nothing to run (extra_reasons says why)
        return Capabilities(dtypes=(), device_types=("cuda",))
    head_dim = table["head_dim"]
    return Capabilities(
        dtypes=tuple(getattr(torch, dtype["torch"]) for dtype in table["dtypes"] + [table["tf32"]["dtype"]]),
        device_types=("cuda",),
        head_dim_multiple=head_dim["multiple"],
        max_head_dim=head_dim["max"],
        min_compute_capability=tuple(table["min_compute_capability"]),
        deterministic=True,
    )


class CutlassBackend(Backend):
    op = ATTENTION_OP
    name = "cutlass"
    capabilities = _capabilities(TABLE)

    def extra_reasons(self, inputs: AttentionInputs) -> list[str]:
        if TABLE is None:
            return [f"the kernel sources are not installed ({TABLE_PATH} not found)"]
        grid = TABLE["grid"]
        reasons = []
        tiles = -(-max(inputs.len_q, inputs.len_k) // grid["row_tile"])
        if inputs.batch * inputs.rows * tiles >= 2 ** grid["max_x_log2"]:
            reasons.append(
                f"B * N * ceil(L / {grid['row_tile']}) = {inputs.batch * inputs.rows * tiles} must be below "
                f"2^{grid['max_x_log2']} (grid size)"
            )
        if inputs.heads > grid["max_heads"]:
            reasons.append(f"H = {inputs.heads} exceeds {grid['max_heads']}")
        if inputs.dtype == TF32_DTYPE and inputs.head_dim > TF32_MAX_HEAD_DIM:
            reasons.append(
                f"`q` is float32 with head dim D={inputs.head_dim}: the float32 (TF32) kernels take D <= {TF32_MAX_HEAD_DIM}"
            )
        # Only inputs the kernels could run are worth a (first-use) build of the extension.
        reasons = reasons or _fused.build_reasons()
        if not reasons:
            reasons = self._smem_reasons(inputs)
        return reasons

    @staticmethod
    def _smem_reasons(inputs: AttentionInputs) -> list[str]:
        """Why the device cannot run the kernels: their shared memory per block above its limit (GPUs
        of compute capability 8.6 and 8.9 allow 99 KB; the portable kernels take up to 156 KB)."""
        q, pair = inputs.q, inputs.pair_bias
        family = kernel_family(q.device, q.dtype)
        needed = smem_needed(family, q.dtype, inputs.head_dim, None if pair is None else pair.dtype)
        allowed = smem_allowed(q.device.index)
        if needed <= allowed:
            return []
        pair_text = "" if pair is None else f" and a {str(pair.dtype).removeprefix('torch.')} pair bias"
        return [
            f"the {family} kernels for {str(q.dtype).removeprefix('torch.')} q with head dim D={inputs.head_dim}"
            f"{pair_text} take {needed} bytes of shared memory per block; {q.device} allows {allowed}"
        ]

    def forward(self, inputs: AttentionInputs, chunk_size: Optional[int]) -> Tensor:
        return attention(inputs.q, inputs.k, inputs.v, inputs.mask_bias, inputs.pair_bias, inputs.scale)

    def gated_forward(self, inputs: AttentionInputs, qkvg: Tensor, heads: int, transposed: bool) -> Tensor:
        """ops.gated_evoformer_attention where this backend runs the attention and the gate
        (``inputs``: the attention's, q, k, v being views of ``qkvg``)."""
        return gated_attention(qkvg, inputs.mask_bias, inputs.pair_bias, heads, transposed, inputs.scale)


register(CutlassBackend(), auto_priority=10)
