"""The attention modules against straightforward float64 implementations of AF2 supplement
Algorithms 7, 8, 13, 14 and 19, written here with einsum and explicit indices."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from evoformer_blocks import (
    MSAColumnAttention,
    MSAColumnGlobalAttention,
    MSARowAttentionWithPairBias,
    MSATransition,
    SwiGLUTransition,
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
    ops,
)
from evoformer_blocks.primitives import Linear, mask_to_bias

F64 = torch.float64
N_SEQ, N_RES, C_M, C_Z, C_HIDDEN, HEADS = 3, 5, 6, 4, 3, 2


# ---------------------------------------------------------------- float64 references


def ln(x, layer_norm: nn.LayerNorm):
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + layer_norm.eps) * layer_norm.weight + layer_norm.bias


def lin(x, linear: nn.Linear):
    out = torch.einsum("...i,oi->...o", x, linear.weight)
    return out if linear.bias is None else out + linear.bias


def heads(x):
    return x.unflatten(-1, (HEADS, C_HIDDEN))  # [..., H * C] -> [..., H, C]


def additive(mask, inf):
    return inf * (mask - 1.0)


def ref_msa_row(mod, m, z, mask):
    """Algorithm 7: o[s, i] = g[s, i] * sum_j softmax_j(q[s, i]·k[s, j] / sqrt(c) + b[i, j] + mask) v[s, j]."""
    m = ln(m, mod.layer_norm_m)
    q, k, v = (heads(lin(m, layer)) for layer in (mod.linear_q, mod.linear_k, mod.linear_v))  # [*, s, i, h, c]
    b = lin(ln(z, mod.layer_norm_z), mod.linear_z)  # [*, i, j, h]
    logits = torch.einsum("...sihc,...sjhc->...sihj", q, k) / math.sqrt(C_HIDDEN)
    logits = logits + torch.einsum("...ijh->...ihj", b).unsqueeze(-4)  # same for every s
    logits = logits + additive(mask, mod.inf)[..., :, None, None, :]  # key j of sequence s
    o = torch.einsum("...sihj,...sjhc->...sihc", logits.softmax(-1), v)
    g = torch.sigmoid(heads(lin(m, mod.linear_g)))
    return lin((g * o).flatten(-2), mod.linear_o)


def ref_msa_column(mod, m, mask):
    """Algorithm 8: o[s, i] = g[s, i] * sum_t softmax_t(q[s, i]·k[t, i] / sqrt(c) + mask[t, i]) v[t, i]."""
    m = ln(m, mod.layer_norm_m)
    q, k, v = (heads(lin(m, layer)) for layer in (mod.linear_q, mod.linear_k, mod.linear_v))
    logits = torch.einsum("...sihc,...tihc->...siht", q, k) / math.sqrt(C_HIDDEN)
    logits = logits + torch.einsum("...ti->...it", additive(mask, mod.inf))[..., None, :, None, :]
    o = torch.einsum("...siht,...tihc->...sihc", logits.softmax(-1), v)
    g = torch.sigmoid(heads(lin(m, mod.linear_g)))
    return lin((g * o).flatten(-2), mod.linear_o)


def ref_triangle_start(mod, z, mask):
    """Algorithm 13: o[i, j] = g[i, j] * sum_k softmax_k(q[i, j]·k[i, k] / sqrt(c) + b[j, k] + mask[i, k]) v[i, k]."""
    z = ln(z, mod.layer_norm_z)
    q, k, v = (heads(lin(z, layer)) for layer in (mod.linear_q, mod.linear_k, mod.linear_v))
    b = lin(z, mod.linear_z)  # [*, j, k, h]
    logits = torch.einsum("...ijhc,...ikhc->...ijhk", q, k) / math.sqrt(C_HIDDEN)
    logits = logits + torch.einsum("...jkh->...jhk", b)[..., None, :, :, :]
    logits = logits + additive(mask, mod.inf)[..., :, None, None, :]
    o = torch.einsum("...ijhk,...ikhc->...ijhc", logits.softmax(-1), v)
    g = torch.sigmoid(heads(lin(z, mod.linear_g)))
    return lin((g * o).flatten(-2), mod.linear_o)


def ref_triangle_end(mod, z, mask):
    """Algorithm 14: o[i, j] = g[i, j] * sum_k softmax_k(q[i, j]·k[k, j] / sqrt(c) + b[k, i] + mask[k, j]) v[k, j]."""
    z = ln(z, mod.layer_norm_z)
    q, k, v = (heads(lin(z, layer)) for layer in (mod.linear_q, mod.linear_k, mod.linear_v))
    b = lin(z, mod.linear_z)  # [*, k, i, h]
    logits = torch.einsum("...ijhc,...kjhc->...ijhk", q, k) / math.sqrt(C_HIDDEN)
    logits = logits + torch.einsum("...kih->...ihk", b)[..., :, None, :, :]
    logits = logits + torch.einsum("...kj->...jk", additive(mask, mod.inf))[..., None, :, None, :]
    o = torch.einsum("...ijhk,...kjhc->...ijhc", logits.softmax(-1), v)
    g = torch.sigmoid(heads(lin(z, mod.linear_g)))
    return lin((g * o).flatten(-2), mod.linear_o)


def ref_global_column(mod, m, mask):
    """Algorithm 19: one query per column, the masked mean over sequences of q[s, i]; one key/value head."""
    m = ln(m, mod.layer_norm_m)
    q = heads(lin(m, mod.linear_q))  # [*, s, i, h, c]
    q = torch.einsum("...si,...sihc->...ihc", mask, q) / (mask.sum(dim=-2)[..., None, None] + mod.eps)
    k, v = lin(m, mod.linear_k), lin(m, mod.linear_v)  # [*, t, i, c]
    logits = torch.einsum("...ihc,...tic->...iht", q, k) / math.sqrt(C_HIDDEN)
    logits = logits + torch.einsum("...ti->...it", additive(mask, mod.inf))[..., :, None, :]
    o = torch.einsum("...iht,...tic->...ihc", logits.softmax(-1), v)  # [*, i, h, c]
    g = torch.sigmoid(heads(lin(m, mod.linear_g)))  # [*, s, i, h, c]
    return lin((g * o.unsqueeze(-4)).flatten(-2), mod.linear_o)


# ---------------------------------------------------------------- the modules under test


@dataclass(frozen=True)
class Spec:
    make: Callable[..., nn.Module]
    inputs: Callable[[tuple, torch.dtype], tuple]  # (batch shape, dtype) -> positional inputs
    mask_dims: tuple  # the mask's shape after the batch dims
    reference: Callable


def msa(batch, dtype):
    return (torch.randn(*batch, N_SEQ, N_RES, C_M, dtype=dtype),)


def pair(batch, dtype):
    return (torch.randn(*batch, N_RES, N_RES, C_Z, dtype=dtype),)


SPECS = {
    "msa_row": Spec(
        lambda **kw: MSARowAttentionWithPairBias(C_M, C_Z, C_HIDDEN, HEADS, **kw),
        lambda batch, dtype: msa(batch, dtype) + pair(batch, dtype),
        (N_SEQ, N_RES),
        ref_msa_row,
    ),
    "msa_column": Spec(
        lambda **kw: MSAColumnAttention(C_M, C_HIDDEN, HEADS, **kw), msa, (N_SEQ, N_RES), ref_msa_column
    ),
    "triangle_start": Spec(
        lambda **kw: TriangleAttentionStartingNode(C_Z, C_HIDDEN, HEADS, **kw), pair, (N_RES, N_RES), ref_triangle_start
    ),
    "triangle_end": Spec(
        lambda **kw: TriangleAttentionEndingNode(C_Z, C_HIDDEN, HEADS, **kw), pair, (N_RES, N_RES), ref_triangle_end
    ),
    "msa_column_global": Spec(
        lambda **kw: MSAColumnGlobalAttention(C_M, C_HIDDEN, HEADS, **kw), msa, (N_SEQ, N_RES), ref_global_column
    ),
}
OP_SPECS = [name for name in SPECS if name != "msa_column_global"]


def randomized(spec: Spec, dtype=F64, **kwargs) -> nn.Module:
    """The module with every parameter random, including the zero-initialized output and gate."""
    module = spec.make(**kwargs).to(dtype)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.startswith("layer_norm") and name.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.5 * torch.randn_like(p))
    return module


def random_mask(batch, dims, dtype):
    """A 0/1 mask with about a third masked; the first row and column stay unmasked, so every
    attention row (along either axis) keeps at least one key."""
    mask = (torch.rand(*batch, *dims) > 0.35).to(dtype)
    mask[..., 0, :] = 1
    mask[..., :, 0] = 1
    return mask


def random_case(name: str) -> tuple:
    """(module, inputs, mask) of SPECS[name]: random float64 parameters and inputs of batch (2,), a
    random mask."""
    spec = SPECS[name]
    return randomized(spec), spec.inputs((2,), F64), random_mask((2,), spec.mask_dims, F64)


def double_reference(spec, module, inputs, mask):
    """The float64 reference with the module's own weights."""
    ref_module = spec.make(inf=module.inf).to(F64)
    ref_module.load_state_dict({k: v.to(F64) for k, v in module.state_dict().items()})
    if mask is None:
        mask = torch.ones(*inputs[0].shape[:-3], *spec.mask_dims, dtype=F64)
    with torch.no_grad():
        return spec.reference(ref_module, *(t.to(F64) for t in inputs), mask.to(F64))


# With every key masked, -1e9 + logit keeps the logit only in float64 (float32 averages uniformly).
@pytest.mark.parametrize("batch", [(), (2,), (2, 1)], ids=["batch()", "batch(2)", "batch(2,1)"])
@pytest.mark.parametrize(
    "dtype,mask_kind",
    [(F64, "none"), (F64, "random"), (F64, "all_masked"), (torch.float32, "none"), (torch.float32, "random")],
)
@pytest.mark.parametrize("name", list(SPECS))
def test_matches_reference(name, dtype, mask_kind, batch, assert_close):
    spec = SPECS[name]
    module = randomized(spec, dtype)
    inputs = spec.inputs(batch, dtype)
    mask = {
        "none": None,
        "random": random_mask(batch, spec.mask_dims, dtype),
        "all_masked": torch.zeros(*batch, *spec.mask_dims, dtype=dtype),
    }[mask_kind]
    out = module(*inputs, mask)
    expected = double_reference(spec, module, inputs, mask)
    assert out.shape == inputs[0].shape and out.dtype == dtype
    assert expected.abs().max() > 0.1  # the comparison is not between zeros
    # Logits of -1e9 keep only ~1e-7 of absolute precision even in float64.
    assert_close(out, expected, torch.float32 if mask_kind == "all_masked" else dtype)


@pytest.mark.parametrize("name", list(SPECS))
def test_gradients_match_reference(name, assert_close):
    spec = SPECS[name]
    module = randomized(spec)
    inputs = tuple(t.requires_grad_(True) for t in spec.inputs((2,), F64))
    mask = random_mask((2,), spec.mask_dims, F64)
    cotangent = torch.randn(inputs[0].shape, dtype=F64)
    params = list(module.parameters())

    grads = torch.autograd.grad((module(*inputs, mask) * cotangent).sum(), [*inputs, *params])
    expected = torch.autograd.grad((spec.reference(module, *inputs, mask) * cotangent).sum(), [*inputs, *params])
    names = [f"input{i}" for i in range(len(inputs))] + [n for n, _ in module.named_parameters()]
    for n, got, want in zip(names, grads, expected):
        assert want.abs().max() > 0, n
        assert_close(got, want, msg=n)


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("name", list(SPECS))
def test_update_without_output_bias_is_the_update_less_that_bias(name, chunk_size):
    # the entry the blocks call with output_bias=False (they add linear_o's bias in the residual add after
    # the module, ops.add_layer_norm's residual_bias): the update as with it, less the bias
    module, inputs, mask = random_case(name)

    def update(output_bias):
        if name == "msa_row":
            m, z = inputs
            return module._normalized(module.layer_norm_m(m), module.layer_norm_z(z), module._mask_bias(mask, m),
                                      chunk_size, output_bias=output_bias)
        norm = module.layer_norm_m if hasattr(module, "layer_norm_m") else module.layer_norm_z
        return module._normalized(norm(inputs[0]), mask, chunk_size, output_bias=output_bias)

    with_bias = update(True)
    torch.testing.assert_close(with_bias, module(*inputs, mask), rtol=0, atol=1e-12)
    torch.testing.assert_close(update(False) + module.linear_o.bias, with_bias, rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("make", [lambda: MSATransition(C_M, 2), lambda: SwiGLUTransition(C_M, 2)],
                         ids=["MSATransition", "SwiGLUTransition"])
def test_transition_update_without_output_bias_is_the_update_less_that_bias(make, chunk_size):
    module = make().to(F64)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.5 * torch.randn_like(p))
    x = module.layer_norm(torch.randn(2, N_SEQ, N_RES, C_M, dtype=F64))
    with_bias = module._normalized_unmasked(x, chunk_size)
    without = module._normalized_unmasked(x, chunk_size, output_bias=False)
    bias = module._output().bias
    torch.testing.assert_close(without + (0 if bias is None else bias), with_bias, rtol=0, atol=1e-12)
    assert (bias is None) == isinstance(module, SwiGLUTransition)


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 64])
@pytest.mark.parametrize("name", list(SPECS))
def test_chunk_size_gives_the_same_result(name, chunk_size):
    module, inputs, mask = random_case(name)
    full = module(*inputs, mask)
    torch.testing.assert_close(module(*inputs, mask, chunk_size=chunk_size), full, rtol=0, atol=1e-12)


@pytest.mark.parametrize("batch", [(0,), (2, 0)])
@pytest.mark.parametrize("name", list(SPECS))
def test_empty_batch(name, batch):
    spec = SPECS[name]
    module = randomized(spec)
    inputs = tuple(t.requires_grad_(True) for t in spec.inputs(batch, F64))
    out = module(*inputs, torch.ones(*batch, *spec.mask_dims, dtype=F64))
    assert out.shape == inputs[0].shape
    out.sum().backward()
    assert inputs[0].grad.shape == inputs[0].shape


def shaped_inputs(spec: Spec, n_seq: int, n_res: int, dtype=F64) -> tuple:
    """The spec's inputs with batch (2,) and the given MSA depth and residue count."""
    m = torch.randn(2, n_seq, n_res, C_M, dtype=dtype)
    z = torch.randn(2, n_res, n_res, C_Z, dtype=dtype)
    if spec.mask_dims == (N_RES, N_RES):
        return (z,)
    return (m, z) if spec is SPECS["msa_row"] else (m,)


EMPTY_LENGTHS = [
    pytest.param(name, n_seq, n_res, id=f"{name}-{label}")
    for name, spec in SPECS.items()
    for label, n_seq, n_res in [("no_sequences", 0, N_RES), ("no_residues", N_SEQ, 0)]
    if label == "no_residues" or spec.mask_dims == (N_SEQ, N_RES)  # the pair modules have no sequences
]


@pytest.mark.parametrize("name,n_seq,n_res", EMPTY_LENGTHS)
def test_empty_sequences_or_residues(name, n_seq, n_res):
    spec = SPECS[name]
    module = randomized(spec)
    inputs = tuple(t.requires_grad_(True) for t in shaped_inputs(spec, n_seq, n_res))
    mask_dims = (n_res, n_res) if spec.mask_dims == (N_RES, N_RES) else (n_seq, n_res)
    out = module(*inputs, torch.ones(2, *mask_dims, dtype=F64))
    assert out.shape == inputs[0].shape
    out.sum().backward()
    for t in inputs:  # e.g. z of the MSA row attention without sequences: connected, gradient zero
        assert t.grad.shape == t.shape and torch.equal(t.grad, torch.zeros_like(t))


# What reaches the op: the pair bias [B, 1, H, L, L] head-major and contiguous, the mask as the
# float32 additive bias [B, N, 1, 1, L]. Expected values from the float64 helpers above; rows/keys
# of the op are (sequence, residue) for MSA row, (residue, sequence) for MSA column, (i, k) for
# the starting and (j, k) for the ending triangle.
OP_VIEW = {
    "msa_row": (lambda mask: mask, lambda b: b),
    "msa_column": (lambda mask: mask.transpose(-1, -2), None),
    "triangle_start": (lambda mask: mask, lambda b: b),
    "triangle_end": (lambda mask: mask.transpose(-1, -2), lambda b: b.transpose(-2, -3)),
}


@pytest.mark.parametrize("name", list(OP_VIEW))
def test_biases_reach_the_op_in_its_layout(name, recording_backends):
    _, backends = recording_backends
    spec = SPECS[name]
    module = randomized(spec, torch.float32, backend="spy_a")
    inputs = spec.inputs((2,), torch.float32)
    mask = random_mask((2,), spec.mask_dims, torch.float32)
    module(*inputs, mask.bool())
    [seen] = backends["spy_a"].seen
    rows_of_mask, rows_of_bias = OP_VIEW[name]

    expected_mask = additive(rows_of_mask(mask).double(), module.inf)[:, :, None, None, :]  # [B, N, 1, 1, L]
    assert seen.mask_bias.dtype == torch.float32 and seen.mask_bias.shape == expected_mask.shape
    assert torch.equal(seen.mask_bias.double(), expected_mask)

    if rows_of_bias is None:
        assert seen.pair_bias is None
        return
    z = inputs[-1].double()
    b = rows_of_bias(lin(ln(z, module.layer_norm_z.double()), module.linear_z.double()))  # [B, q, k, H]
    expected_pair = torch.einsum("bqkh->bhqk", b)[:, None]  # [B, 1, H, L, L]
    assert seen.pair_bias.is_contiguous() and seen.pair_bias.dtype == torch.float32
    assert seen.pair_bias.shape == expected_pair.shape
    torch.testing.assert_close(seen.pair_bias.double(), expected_pair, rtol=1e-5, atol=1e-5)


def test_pair_bias_dtype_follows_autocast(recording_backends):
    # As linear_z(z) would: bfloat16 under autocast, whatever the parameters' dtype.
    _, backends = recording_backends
    spec = SPECS["triangle_start"]
    module = randomized(spec, torch.float32, backend="spy_a")
    bias = module._pair_bias(module.layer_norm_z(spec.inputs((2,), torch.float32)[0]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bias_bf16 = module._pair_bias(module.layer_norm_z(spec.inputs((2,), torch.float32)[0]))
    assert bias.dtype == torch.float32 and bias_bf16.dtype == torch.bfloat16 and bias_bf16.is_contiguous()


@pytest.mark.parametrize("name", list(SPECS))
def test_mask_none_bool_and_float_agree(name):
    spec = SPECS[name]
    module = randomized(spec)
    inputs = spec.inputs((2,), F64)
    ones = torch.ones(2, *spec.mask_dims, dtype=F64)
    torch.testing.assert_close(module(*inputs), module(*inputs, ones), rtol=0, atol=1e-12)
    mask = random_mask((2,), spec.mask_dims, F64)
    torch.testing.assert_close(module(*inputs, mask.bool()), module(*inputs, mask), rtol=0, atol=0)
    assert not torch.allclose(module(*inputs, mask), module(*inputs))


@pytest.mark.parametrize("name", list(SPECS))
def test_fresh_module_outputs_zero_update(name):
    # linear_o starts at zero, so a fresh module leaves the residual stream unchanged.
    spec = SPECS[name]
    module = spec.make()
    out = module(*spec.inputs((2,), torch.float32))
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(module.linear_g.weight, torch.zeros_like(module.linear_g.weight))
    assert torch.equal(module.linear_g.bias, torch.ones_like(module.linear_g.bias))
    assert module.linear_q.bias is None and module.linear_k.bias is None and module.linear_v.bias is None


PARAMETER_NAMES = {
    "msa_row": ["layer_norm_m", "layer_norm_z", "linear_z", "linear_q", "linear_k", "linear_v", "linear_g", "linear_o"],
    "msa_column": ["layer_norm_m", "linear_q", "linear_k", "linear_v", "linear_g", "linear_o"],
    "triangle_start": ["layer_norm_z", "linear_z", "linear_q", "linear_k", "linear_v", "linear_g", "linear_o"],
    "triangle_end": ["layer_norm_z", "linear_z", "linear_q", "linear_k", "linear_v", "linear_g", "linear_o"],
    "msa_column_global": ["layer_norm_m", "linear_q", "linear_k", "linear_v", "linear_g", "linear_o"],
}


@pytest.mark.parametrize("name", list(SPECS))
def test_parameter_names_and_shapes(name):
    module = SPECS[name].make()
    assert sorted(n for n, _ in module.named_children()) == sorted(PARAMETER_NAMES[name])
    hidden = HEADS * C_HIDDEN
    c_in = C_Z if name.startswith("triangle") else C_M
    kv = C_HIDDEN if name == "msa_column_global" else hidden
    assert module.linear_q.weight.shape == (hidden, c_in)
    assert module.linear_k.weight.shape == (kv, c_in) and module.linear_v.weight.shape == (kv, c_in)
    assert module.linear_g.weight.shape == (hidden, c_in)
    assert module.linear_o.weight.shape == (c_in, hidden)
    if hasattr(module, "linear_z"):
        assert module.linear_z.weight.shape == (HEADS, C_Z) and module.linear_z.bias is None


# ---------------------------------------------------------------- backends


@pytest.mark.parametrize("name", list(SPECS))
def test_backend_argument_reaches_the_op(name, recording_backends):
    calls, _ = recording_backends
    spec = SPECS[name]
    inputs = spec.inputs((2,), torch.float32)
    spec.make(backend="spy_a")(*inputs)
    with ops.backend("spy_b"):
        spec.make()(*inputs)  # None follows the global default
        spec.make(backend="spy_a")(*inputs, chunk_size=2)
    expected = [] if name == "msa_column_global" else ["spy_a", "spy_b", "spy_a"]
    assert calls == expected


@pytest.mark.parametrize("name", OP_SPECS)
def test_chunk_size_validated_by_the_op(name):
    spec = SPECS[name]
    with pytest.raises(ValueError, match="`chunk_size`"):
        spec.make()(*spec.inputs((), torch.float32), chunk_size=0)


def test_global_attention_validates_chunk_size():
    spec = SPECS["msa_column_global"]
    with pytest.raises(ValueError, match="`chunk_size`"):
        spec.make()(*spec.inputs((), torch.float32), chunk_size=0)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "make,argument",
    [
        (lambda: MSARowAttentionWithPairBias(0, C_Z, C_HIDDEN, HEADS), "c_m"),
        (lambda: MSARowAttentionWithPairBias(C_M, 2.0, C_HIDDEN, HEADS), "c_z"),
        (lambda: MSAColumnAttention(C_M, -1, HEADS), "c_hidden"),
        (lambda: TriangleAttentionStartingNode(C_Z, C_HIDDEN, True), "no_heads"),
        (lambda: TriangleAttentionEndingNode(C_Z, C_HIDDEN, HEADS, inf=-1.0), "inf"),
        (lambda: MSAColumnAttention(C_M, C_HIDDEN, HEADS, inf=math.inf), "inf"),
        (lambda: MSAColumnGlobalAttention(C_M, C_HIDDEN, HEADS, eps=-1e-3), "eps"),
        (lambda: MSAColumnGlobalAttention(C_M, C_HIDDEN, HEADS, backend="nope"), "backend"),
        (lambda: MSARowAttentionWithPairBias(C_M, C_Z, C_HIDDEN, HEADS, backend="nope"), "backend"),
    ],
)
def test_constructor_validation(make, argument):
    with pytest.raises(ValueError, match=f"`{argument}`"):
        make()


def _bad_calls():
    m = torch.randn(2, N_SEQ, N_RES, C_M)
    z = torch.randn(2, N_RES, N_RES, C_Z)
    row, col = SPECS["msa_row"].make(), SPECS["msa_column"].make()
    tri, glob = SPECS["triangle_end"].make(), SPECS["msa_column_global"].make()
    return {
        "row: m wrong c_m": (lambda: row(m[..., :4], z), "m"),
        "row: m rank 2": (lambda: row(m[0, 0], z), "m"),
        "row: m int": (lambda: row(m.long(), z), "m"),
        "row: z wrong c_z": (lambda: row(m, z[..., :3]), "z"),
        "row: z wrong N_res": (lambda: row(m, z[:, :4, :4]), "z"),
        "row: z other batch": (lambda: row(m, z[:1]), "z"),
        "row: z extra batch dim": (lambda: row(m, z[None]), "z"),
        "row: mask transposed": (lambda: row(m, z, torch.ones(2, N_RES, N_SEQ)), "mask"),
        "row: mask not a tensor": (lambda: row(m, z, 1.0), "mask"),
        "column: m wrong c_m": (lambda: col(m[..., :5]), "m"),
        "column: mask without batch": (lambda: col(m, torch.ones(N_SEQ, N_RES)), "mask"),
        "triangle: z not square": (lambda: tri(z[:, :4]), "z"),
        "triangle: z is m": (lambda: tri(m), "z"),
        "triangle: mask wrong shape": (lambda: tri(z, torch.ones(2, N_RES, N_RES - 1)), "mask"),
        "global: m list": (lambda: glob(m.tolist()), "m"),
        "global: mask wrong shape": (lambda: glob(m, torch.ones(2, N_SEQ)), "mask"),
        "row: mask on meta": (lambda: row(m, z, torch.ones(2, N_SEQ, N_RES, device="meta")), "mask"),
        "triangle: mask on meta": (lambda: tri(z, torch.ones(2, N_RES, N_RES, device="meta")), "mask"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_forward_validation(case):
    call, argument = _bad_calls()[case]
    with pytest.raises(ValueError, match=f"`{argument}`"):
        call()


@pytest.mark.parametrize("name", list(SPECS))
def test_inputs_must_match_the_weights_outside_autocast(name):
    # float32 weights: a float64 or bfloat16 input is refused by name (not a matmul's RuntimeError),
    # an input on another device too; under autocast the ops cast, so bfloat16 inputs run
    spec = SPECS[name]
    module = spec.make(backend="eager")
    inputs = spec.inputs((2,), torch.float32)
    first = "z" if name.startswith("triangle") else "m"
    for dtype in (F64, torch.bfloat16):
        with pytest.raises(ValueError, match=rf"`{first}` is {dtype} on cpu, the module's weights are torch.float32"):
            module(inputs[0].to(dtype), *inputs[1:])
    with pytest.raises(ValueError, match=rf"`{first}` is torch.float32 on meta, .* on cpu: .* device"):
        module(inputs[0].to("meta"), *inputs[1:])
    if name == "msa_row":
        with pytest.raises(ValueError, match=r"`z` is torch.float64 on cpu"):
            module(inputs[0], inputs[1].double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(module(*(t.bfloat16() for t in inputs))).all()


# ---------------------------------------------------------------- half precision, torch.compile


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(SPECS))
def test_half_precision_masks_stay_finite(name, dtype):
    # 1e9 does not fit in float16: the mask bias is built in float32, never as inf * 0 = nan.
    spec = SPECS[name]
    module = randomized(spec, torch.float32)
    inputs = spec.inputs((2,), torch.float32)
    mask = random_mask((2,), spec.mask_dims, torch.float32)
    mask[0] = 0  # also rows with every key masked
    expected = module(*inputs, mask)
    out = module.to(dtype)(*(t.to(dtype) for t in inputs), mask.to(dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()
    # Loose: errors of 8-11 mantissa bits through LayerNorm, five projections and the softmax.
    assert (out.float() - expected).abs().max() < 0.05 * expected.abs().max()


def test_mask_to_bias():
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    for dtype, want in [(torch.float64, torch.float64), (torch.float32, torch.float32), (torch.float16, torch.float32)]:
        bias = mask_to_bias(mask.to(dtype), 1e9, dtype)
        assert bias.dtype == want
        assert torch.equal(bias, torch.tensor([[0.0, -1e9, 0.0]], dtype=want))
    assert torch.equal(mask_to_bias(mask.bool(), 5.0, torch.float32), torch.tensor([[0.0, -5.0, 0.0]]))


@pytest.mark.parametrize(
    "compile_backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]
)
def test_torch_compile_fullgraph_msa_row(compile_backend):
    spec = SPECS["msa_row"]
    module = randomized(spec, torch.float32, backend="eager")
    compiled = torch.compile(module, fullgraph=True, backend=compile_backend)
    m, z = (t.requires_grad_(True) for t in spec.inputs((2,), torch.float32))
    mask = random_mask((2,), spec.mask_dims, torch.float32)
    out = compiled(m, z, mask)
    expected = module(m, z, mask)
    torch.testing.assert_close(out, expected)
    if compile_backend == "aot_eager":
        grads = torch.autograd.grad(out.sum(), (m, z))
        expected_grads = torch.autograd.grad(expected.sum(), (m, z))
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- Linear initializers


def test_linear_init_schemes():
    fan_in, fan_out = 400, 300
    std = lambda init: Linear(fan_in, fan_out, init=init).weight.std().item()  # noqa: E731
    # LeCun / He: truncated normal whose std after truncation is sqrt(scale / fan_in).
    assert std("default") == pytest.approx(math.sqrt(1 / fan_in), rel=0.03)
    assert std("relu") == pytest.approx(math.sqrt(2 / fan_in), rel=0.03)
    w = Linear(fan_in, fan_out, init="default").weight
    untruncated = math.sqrt(1 / fan_in) / 0.87962566103423978  # std of N(0, 1) truncated to [-2, 2]
    assert w.abs().max() <= 2 * untruncated + 1e-7 and w.abs().max() > 1.8 * untruncated
    # Glorot uniform: U(-a, a) with a = sqrt(6 / (fan_in + fan_out)).
    bound = math.sqrt(6 / (fan_in + fan_out))
    w = Linear(fan_in, fan_out, init="glorot").weight
    assert w.abs().max() <= bound and w.abs().max() > 0.99 * bound
    assert std("glorot") == pytest.approx(bound / math.sqrt(3), rel=0.03)
    assert std("normal") == pytest.approx(math.sqrt(1 / fan_in), rel=0.03)
    for init in ("default", "relu", "glorot", "normal", "final"):
        layer = Linear(fan_in, fan_out, init=init)
        assert torch.equal(layer.bias, torch.zeros(fan_out)), init
    gating = Linear(fan_in, fan_out, init="gating")
    assert torch.equal(gating.weight, torch.zeros(fan_out, fan_in)) and torch.equal(gating.bias, torch.ones(fan_out))
    final = Linear(fan_in, fan_out, init="final")
    assert torch.equal(final.weight, torch.zeros(fan_out, fan_in))
    assert Linear(3, 2, bias=False, init="gating").bias is None
    assert Linear(3, 2, dtype=F64).weight.dtype == F64


def test_linear_rejects_unknown_init():
    with pytest.raises(ValueError, match="`init`"):
        Linear(3, 2, init="lecun")


# ---- the stacked q/k/v/g projection and the gated attention on it -----------------------------------


def _to_heads(block, heads, transposed):
    """A column block of the projection, ``[B, N, L, H·C]`` (``[B, L, N, H·C]`` transposed), as the
    attention's ``[B, N, L, H, C]``."""
    per_head = block.unflatten(-1, (heads, -1))  # [B, A, A', H, C]
    return per_head.transpose(1, 2) if transposed else per_head


def _from_heads(out, transposed):
    """``[B, N, L, H, C]`` back to the projection's layout, ``[B, N, L, H·C]`` (``[B, L, N, H·C]``
    transposed); a view wherever the strides allow one."""
    return (out.transpose(1, 2) if transposed else out).flatten(-2)


@pytest.mark.parametrize("transposed", [False, True])
def test_gated_views_follow_the_projection_layout(transposed):
    from evoformer_blocks.ops._inputs import gated_output_view, gated_views

    heads, c = 2, 8
    y = torch.randn(2, 5, 7, 4 * heads * c, dtype=torch.float64)
    q, k, v, g = gated_views(y, heads, transposed)
    for view, block in zip((q, k, v), y.split(heads * c, dim=-1)):
        assert view.data_ptr() >= y.data_ptr()  # a view, no copy
        assert torch.equal(view, _to_heads(block, heads, transposed))
    assert torch.equal(g, y[..., 3 * heads * c:])
    out = torch.randn_like(q)  # [B, N, L, H, C]
    assert torch.equal(gated_output_view(out, transposed), _from_heads(out, transposed))


@pytest.mark.parametrize("transposed", [False, True])
def test_gated_attention_is_the_gate_times_the_attention(transposed):
    from evoformer_blocks.ops import evoformer_attention, gated_evoformer_attention, sigmoid_gate
    from evoformer_blocks.ops._inputs import gated_output_view, gated_views

    heads, c = 2, 8
    qkvg = torch.randn(2, 5, 7, 4 * heads * c, dtype=torch.float64, requires_grad=True)
    n, length = (7, 5) if transposed else (5, 7)
    mask_bias = (1e9 * (torch.rand(2, n, 1, 1, length, dtype=torch.float64) > 0.2) - 1e9).requires_grad_(True)
    pair_bias = torch.randn(2, 1, heads, length, length, dtype=torch.float64, requires_grad=True)
    out = gated_evoformer_attention(qkvg, heads, mask_bias, pair_bias, transposed=transposed, backend="eager")
    q, k, v, g = gated_views(qkvg, heads, transposed)
    o = evoformer_attention(q, k, v, mask_bias, pair_bias, backend="eager")
    ref = sigmoid_gate(g, gated_output_view(o, transposed), backend="eager")
    assert out.shape == (2, 5, 7, heads * c)
    torch.testing.assert_close(out, ref)
    cot = torch.randn_like(out)
    grads = torch.autograd.grad(out, (qkvg, pair_bias), cot)
    ref_grads = torch.autograd.grad(ref, (qkvg, pair_bias), cot)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "qkvg, heads, match",
    [
        (torch.randn(2, 5, 64), 2, "rank 4"),
        (torch.randn(1, 2, 5, 60), 2, "4 \\* H \\* D"),
        (torch.randn(1, 2, 5, 64), True, "`heads`"),
        (torch.randn(1, 2, 5, 64), 0, "`heads`"),
        (torch.randn(1, 2, 5, 64).int(), 2, "`qkvg`"),
    ],
)
def test_gated_attention_rejects_bad_inputs(qkvg, heads, match):
    from evoformer_blocks.ops import gated_evoformer_attention

    with pytest.raises(ValueError, match=match):
        gated_evoformer_attention(qkvg, heads)


@pytest.mark.parametrize("shape", [(0, 3, 5, 32), (2, 0, 5, 32), (2, 3, 0, 32)])
def test_gated_attention_of_empty_inputs(shape):
    from evoformer_blocks.ops import gated_evoformer_attention

    qkvg = torch.randn(shape, requires_grad=True)
    out = gated_evoformer_attention(qkvg, 2)
    assert out.shape == (*shape[:3], 8) and not out.any()
    (grad,) = torch.autograd.grad(out.sum(), qkvg)
    assert grad.shape == qkvg.shape


def test_gated_attention_rejects_a_bad_mask_bias():
    from evoformer_blocks.ops import gated_evoformer_attention

    with pytest.raises(ValueError, match="`mask_bias`"):
        gated_evoformer_attention(torch.randn(1, 2, 5, 64), 2, torch.zeros(1, 2, 1, 1, 4))


@pytest.mark.parametrize(
    "biased, widths",
    [((False, False, False, True), (12,) * 4), ((True, True), (12, 12)), ((False, True, False), (12,) * 3),
     ((False, False), (12, 12)), ((False, False, True), (8, 8, 24))],
)
def test_stacked_projection_is_the_separate_linears(biased, widths):
    from evoformer_blocks.primitives import Linear, stacked_projection

    x = torch.randn(3, 4, 6, 16, dtype=torch.float64, requires_grad=True)
    linears = [Linear(16, w, bias=b, dtype=torch.float64) for b, w in zip(biased, widths)]
    for lin in linears:  # weights and biases away from their initialization (zero biases, "final" weights)
        with torch.no_grad():
            for p in lin.parameters():
                p.normal_()
    y = stacked_projection(x, linears)  # [3, 4, 6, sum of widths]
    ref = torch.cat([F.linear(x, lin.weight, lin.bias) for lin in linears], dim=-1)
    torch.testing.assert_close(y, ref)
    cot = torch.randn_like(y)
    leaves = (x, *[p for lin in linears for p in lin.parameters()])
    for a, b in zip(torch.autograd.grad(y, leaves, cot), torch.autograd.grad(ref, leaves, cot)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("batch", [1, 3, 0])
def test_stacked_projection_with_a_head_major_output(batch):
    # a triangle attention's q, k, v, g and pair bias from one node: the same values and gradients
    # as the separate projections, the bias head-major [B, 1, H, L, L]
    from evoformer_blocks.primitives import Linear, stacked_projection

    length, c, heads = 6, 16, 3
    x = torch.randn(batch, length, length, c, dtype=torch.float64, requires_grad=True)
    linears = [Linear(c, 8, bias=b, dtype=torch.float64) for b in (False, True)]
    head = Linear(c, heads, bias=False, dtype=torch.float64)
    for lin in (*linears, head):
        with torch.no_grad():
            for p in lin.parameters():
                p.normal_()
    y, h = stacked_projection(x, linears, head_major=head)  # [B, L, L, 16], [B, 1, H, L, L]
    ref_y = torch.cat([F.linear(x, lin.weight, lin.bias) for lin in linears], dim=-1)
    ref_h = F.linear(x, head.weight).permute(0, 3, 1, 2).unsqueeze(1)
    assert h.shape == (batch, 1, heads, length, length) and h.is_contiguous()
    torch.testing.assert_close(y, ref_y)
    torch.testing.assert_close(h, ref_h)
    cots = torch.randn_like(y), torch.randn_like(h)
    leaves = (x, head.weight, *[p for lin in linears for p in lin.parameters()])
    got = torch.autograd.grad((y, h), leaves, cots)
    want = torch.autograd.grad((ref_y, ref_h), leaves, cots)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("transposed", [False, True])
def test_separate_gradients_follow_the_input_layout(transposed):
    # dq, dk, dv as the backward allocates them when they are not stacked (torch.compile's path):
    # dense, in q's memory order, so that the projection's backward views them without a copy
    from evoformer_blocks.ops.cutlass import empty_in_memory_order, memory_order

    heads, c = 2, 8
    y = torch.randn(2, 5, 7, 4 * heads * c, dtype=torch.float64)
    q = _to_heads(y.split(heads * c, dim=-1)[0], heads, transposed)
    assert memory_order(q) == ([0, 2, 1, 3, 4] if transposed else [0, 1, 2, 3, 4])
    dq = empty_in_memory_order(q)
    assert dq.shape == q.shape and dq.stride(-1) == 1 and dq.untyped_storage().nbytes() == dq.numel() * 8  # dense
    rows = _from_heads(dq, transposed)  # what the projection's backward receives
    assert rows.is_contiguous() and rows.view(-1, heads * c).data_ptr() == dq.data_ptr()


