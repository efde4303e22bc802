"""The functional op `evoformer_attention` on CPU: math, gradients, masking, chunking, broadcasting,
validation, backend selection and the DS4Sci shim."""

from __future__ import annotations

import dataclasses
import logging
import math
import subprocess
import sys

import pytest
import torch

from evoformer_blocks import ops
from evoformer_blocks.ops import _dispatch, _fused, cutlass
from evoformer_blocks.ops._dispatch import constant_result
from evoformer_blocks.ops import DS4Sci_EvoformerAttention, evoformer_attention

F64 = torch.float64


def qkv(b=2, n=3, lq=5, lk=5, h=2, d=4, dtype=torch.float32, requires_grad=False):
    """Random q [B, N, Lq, H, D] and k, v [B, N, Lk, H, D]."""
    make = lambda length: torch.randn(b, n, length, h, d, dtype=dtype, requires_grad=requires_grad)  # noqa: E731
    return make(lq), make(lk), make(lk)


def biases(mask_shape, pair_shape, dtype=torch.float32, requires_grad=False):
    """A random additive mask bias (with some -1e9 keys) and a random pair bias, or None for a shape None."""
    mask_bias = pair_bias = None
    if mask_shape is not None:
        mask_bias = torch.randn(mask_shape, dtype=dtype)
        mask_bias = mask_bias.masked_fill(torch.rand(mask_shape) < 0.25, -1e9).requires_grad_(requires_grad)
    if pair_shape is not None:
        pair_bias = torch.randn(pair_shape, dtype=dtype, requires_grad=requires_grad)
    return mask_bias, pair_bias


# (B, N, Lq, Lk, H, D, mask_bias shape, pair_bias shape): Lq != Lk, size-1 B/N/H broadcasting, no biases.
CASES = [
    (2, 3, 5, 5, 2, 4, (2, 3, 1, 1, 5), (2, 1, 2, 5, 5)),
    (2, 3, 4, 6, 2, 4, (2, 3, 1, 1, 6), (2, 1, 2, 4, 6)),
    (2, 3, 6, 3, 3, 2, (1, 3, 1, 1, 3), (1, 1, 3, 6, 3)),
    (2, 3, 5, 4, 2, 8, (2, 1, 1, 1, 4), (2, 1, 1, 5, 4)),
    (1, 1, 1, 1, 1, 1, (1, 1, 1, 1, 1), (1, 1, 1, 1, 1)),
    (2, 2, 3, 7, 2, 3, None, (1, 1, 1, 3, 7)),
    (2, 2, 7, 3, 2, 3, (1, 1, 1, 1, 3), None),
    (2, 2, 4, 4, 2, 3, None, None),
]
CASE_IDS = [f"B{c[0]}N{c[1]}Lq{c[2]}Lk{c[3]}H{c[4]}D{c[5]}-m{c[6]}-p{c[7]}" for c in CASES]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_matches_float64_reference(case, dtype, reference_attention, assert_close):
    b, n, lq, lk, h, d, mask_shape, pair_shape = case
    q, k, v = qkv(b, n, lq, lk, h, d, dtype)
    mask_bias, pair_bias = biases(mask_shape, pair_shape, dtype)
    out = evoformer_attention(q, k, v, mask_bias, pair_bias, backend="eager")
    assert out.shape == (b, n, lq, h, d) and out.dtype == dtype
    assert_close(out, reference_attention(q, k, v, mask_bias, pair_bias))


def test_custom_scale(reference_attention, assert_close):
    q, k, v = qkv(dtype=F64)
    mask_bias, pair_bias = biases((2, 3, 1, 1, 5), (2, 1, 2, 5, 5), F64)
    out = evoformer_attention(q, k, v, mask_bias, pair_bias, scale=0.3, backend="eager")
    assert_close(out, reference_attention(q, k, v, mask_bias, pair_bias, scale=0.3))
    default = evoformer_attention(q, k, v, mask_bias, pair_bias, backend="eager")
    assert not torch.allclose(out, default)


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize(
    "mask_shape,pair_shape",
    [((2, 2, 1, 1, 4), (2, 1, 2, 3, 4)), ((1, 2, 1, 1, 4), (1, 1, 1, 3, 4)), ((2, 1, 1, 1, 4), (2, 1, 1, 3, 4))],
)
def test_gradcheck_float64(mask_shape, pair_shape, chunk_size):
    q, k, v = qkv(2, 2, 3, 4, 2, 3, F64, requires_grad=True)
    mask_bias = torch.randn(mask_shape, dtype=F64, requires_grad=True)
    pair_bias = torch.randn(pair_shape, dtype=F64, requires_grad=True)

    def fn(q, k, v, mask_bias, pair_bias):
        return evoformer_attention(q, k, v, mask_bias, pair_bias, backend="eager", chunk_size=chunk_size)

    assert torch.autograd.gradcheck(fn, (q, k, v, mask_bias, pair_bias))


def test_gradcheck_without_biases():
    q, k, v = qkv(1, 2, 4, 3, 2, 3, F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: evoformer_attention(q, k, v, backend="eager"), (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_partial_mask_ignores_masked_keys(dtype, assert_close):
    q, k, v = qkv(2, 3, 4, 6, 2, 3, dtype)
    keep = torch.rand(2, 3, 6) < 0.6
    keep[..., 0] = True  # every row keeps at least one key
    mask_bias = (1e9 * (keep.to(dtype) - 1))[:, :, None, None, :]  # [B, N, 1, 1, Lk]
    out = evoformer_attention(q, k, v, mask_bias, backend="eager")
    for bi in range(2):
        for ni in range(3):
            kept = keep[bi, ni]
            # Attention over the kept keys only, computed from scratch per row.
            logits = torch.einsum("ihd,jhd->hij", q[bi, ni].double(), k[bi, ni, kept].double()) / math.sqrt(3)
            expected = torch.einsum("hij,jhd->ihd", logits.softmax(-1), v[bi, ni, kept].double())
            assert_close(out[bi, ni], expected, dtype)


def test_fully_masked_rows_with_finite_inf_average_uniformly(assert_close):
    # -1e9 swamps O(1) float32 logits, so a row whose keys are all masked averages v uniformly.
    q, k, v = qkv(2, 3, 4, 5, 2, 3, torch.float32)
    mask_bias = torch.zeros(2, 3, 1, 1, 5)
    mask_bias[0, 1] = -1e9
    out = evoformer_attention(q, k, v, mask_bias, backend="eager")
    expected = v[0, 1].mean(dim=0, keepdim=True).expand(4, -1, -1)  # [Lq, H, D]
    assert_close(out[0, 1], expected)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_minus_inf_mask_gives_zeros_and_finite_zero_gradients(dtype, reference_attention, assert_close):
    q, k, v = qkv(2, 3, 4, 5, 2, 3, dtype, requires_grad=True)
    mask_bias = torch.zeros(2, 3, 1, 1, 5, dtype=dtype)
    mask_bias[0, 1] = -math.inf  # row (0, 1): every key masked
    mask_bias[1, 2, ..., 1:3] = -math.inf  # row (1, 2): two keys masked
    pair_bias = torch.randn(2, 1, 2, 4, 5, dtype=dtype)
    mask_bias.requires_grad_(True)
    pair_bias.requires_grad_(True)
    out = evoformer_attention(q, k, v, mask_bias, pair_bias, backend="eager")
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))
    # Partially masked rows are exact attention over the remaining keys.
    finite = mask_bias.detach().clamp_min(-1e4)
    expected = reference_attention(q, k, v, finite, pair_bias)
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[0, 1] = False
    assert_close(out[keep], expected[keep], dtype)

    out.float().square().sum().backward()
    for name, t in {"q": q, "k": k, "v": v, "mask_bias": mask_bias, "pair_bias": pair_bias}.items():
        assert torch.isfinite(t.grad).all(), name
    assert torch.equal(q.grad[0, 1], torch.zeros_like(q.grad[0, 1]))
    assert torch.equal(k.grad[0, 1], torch.zeros_like(k.grad[0, 1]))
    assert torch.equal(mask_bias.grad[0, 1], torch.zeros_like(mask_bias.grad[0, 1]))
    assert torch.equal(mask_bias.grad[1, 2, ..., 1:3], torch.zeros_like(mask_bias.grad[1, 2, ..., 1:3]))
    assert q.grad.abs().sum() > 0


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("pair_shape", [(2, 1, 2, 5, 4), (1, 1, 1, 5, 4)])
def test_chunked_equals_unchunked(chunk_size, pair_shape):
    q, k, v = qkv(2, 3, 5, 4, 2, 3, F64, requires_grad=True)
    mask_bias, pair_bias = biases((2, 3, 1, 1, 4), pair_shape, F64, requires_grad=True)
    inputs = (q, k, v, mask_bias, pair_bias)
    full = evoformer_attention(*inputs, backend="eager")
    chunked = evoformer_attention(*inputs, backend="eager", chunk_size=chunk_size)
    torch.testing.assert_close(chunked, full, rtol=0, atol=1e-12)
    cotangent = torch.randn_like(full)
    grads_full = torch.autograd.grad(full, inputs, cotangent)
    grads_chunked = torch.autograd.grad(chunked, inputs, cotangent)
    for name, a, b in zip(("q", "k", "v", "mask_bias", "pair_bias"), grads_chunked, grads_full):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)


def test_broadcast_biases_equal_explicit_expansion():
    q, k, v = qkv(2, 3, 4, 5, 2, 3, F64)
    mask_small = torch.randn(1, 3, 1, 1, 5, dtype=F64, requires_grad=True)
    pair_small = torch.randn(2, 1, 1, 4, 5, dtype=F64, requires_grad=True)
    mask_full = mask_small.detach().expand(2, 3, 1, 1, 5).clone().requires_grad_(True)
    pair_full = pair_small.detach().expand(2, 1, 2, 4, 5).clone().requires_grad_(True)
    out_small = evoformer_attention(q, k, v, mask_small, pair_small, backend="eager")
    out_full = evoformer_attention(q, k, v, mask_full, pair_full, backend="eager")
    torch.testing.assert_close(out_small, out_full, rtol=0, atol=1e-12)
    cotangent = torch.randn_like(out_full)
    out_small.backward(cotangent)
    out_full.backward(cotangent)
    # A broadcast bias receives the sum of the gradients of its copies.
    torch.testing.assert_close(mask_small.grad, mask_full.grad.sum(dim=0, keepdim=True))
    torch.testing.assert_close(pair_small.grad, pair_full.grad.sum(dim=2, keepdim=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias_dtype", ["same", "float32"])
def test_half_precision_close_to_reference(dtype, bias_dtype, reference_attention, assert_close):
    q, k, v = (t.to(dtype) for t in qkv(2, 3, 16, 16, 2, 16, torch.float32))
    mask_bias, pair_bias = biases((2, 3, 1, 1, 16), (2, 1, 2, 16, 16), torch.float32)
    if bias_dtype == "same":
        mask_bias, pair_bias = mask_bias.to(dtype), pair_bias.to(dtype)
    out = evoformer_attention(q, k, v, mask_bias, pair_bias, backend="eager")
    assert out.dtype == dtype
    # The reference sees the same rounded inputs, so only the op's arithmetic error is measured.
    assert_close(out, reference_attention(q, k, v, mask_bias, pair_bias), dtype)


# ---------------------------------------------------------------- empty inputs

# (B, N, Lq, Lk): each of the four may be 0.
EMPTY = {"B0": (0, 3, 4, 5), "N0": (2, 0, 4, 5), "Lq0": (2, 3, 0, 5), "Lk0": (2, 3, 4, 0), "all0": (0, 0, 0, 0)}


@pytest.mark.parametrize("backend", ["auto", "eager", "cutlass", "spy_a"])
@pytest.mark.parametrize("dims", EMPTY.values(), ids=list(EMPTY))
def test_empty_inputs_give_zeros_and_zero_gradients_without_a_backend(dims, backend, recording_backends):
    calls, _ = recording_backends
    b, n, lq, lk = dims
    q, k, v = qkv(b, n, lq, lk, 2, 3, F64, requires_grad=True)
    mask_bias = torch.randn(b, n, 1, 1, lk, dtype=F64, requires_grad=True)
    pair_bias = torch.randn(b, 1, 2, lq, lk, dtype=F64, requires_grad=True)
    leaves = (q, k, v, mask_bias, pair_bias)
    out = evoformer_attention(*leaves, backend=backend, chunk_size=2)
    assert out.shape == (b, n, lq, 2, 3) and out.dtype == F64
    assert torch.equal(out, torch.zeros_like(out))
    assert calls == []  # no backend ran, so even one that cannot run these inputs (cutlass on CPU) is fine
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    for name, leaf, grad in zip(("q", "k", "v", "mask_bias", "pair_bias"), leaves, grads):
        assert grad.shape == leaf.shape and torch.equal(grad, torch.zeros_like(leaf)), name


def test_no_keys_gives_zeros_for_every_query_and_broadcast_bias():
    # Lk = 0 with queries present: like a query whose keys are all masked with -inf. q is a view
    # of a [B, N, H, Lq, D] tensor; the result is contiguous as every backend's.
    q = torch.randn(2, 3, 2, 4, 3).transpose(2, 3).requires_grad_(True)  # [B, N, Lq, H, D]
    k, v = (torch.randn(2, 3, 0, 2, 3, requires_grad=True) for _ in range(2))
    pair_bias = torch.zeros(1, 1, 1, 4, 0, requires_grad=True)  # B and H broadcast
    out = evoformer_attention(q, k, v, None, pair_bias)
    assert out.shape == q.shape and torch.equal(out, torch.zeros_like(q)) and q.numel() > 0
    with torch.no_grad():
        q.mul_(2)  # the result keeps no reference to its inputs
    assert out.is_contiguous()
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and pair_bias.grad.shape == pair_bias.shape


def test_empty_inputs_still_check_the_backend_name_and_arguments():
    q, k, v = qkv(0, 3, 4, 5, 2, 3)
    with pytest.raises(ValueError, match="backend.*'nope'"):
        evoformer_attention(q, k, v, backend="nope")
    with pytest.raises(ValueError, match="`chunk_size`"):
        evoformer_attention(q, k, v, chunk_size=0)
    with pytest.raises(ValueError, match="`mask_bias`"):
        evoformer_attention(q, k, v, torch.zeros(0, 3, 1, 1, 4))


def test_empty_inputs_under_torch_compile():
    q, k, v = qkv(2, 3, 4, 0, 2, 3, torch.float32, requires_grad=True)
    compiled = torch.compile(lambda q, k, v: evoformer_attention(q, k, v) + 1, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    assert torch.equal(out, torch.ones_like(q))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


# ---------------------------------------------------------------- DS4Sci shim


@pytest.mark.parametrize("count", [0, 1, 2])
def test_ds4sci_shim_matches_op(count):
    q, k, v = qkv(dtype=F64)
    mask_bias, pair_bias = biases((2, 3, 1, 1, 5), (2, 1, 2, 5, 5), F64)
    given = [mask_bias, pair_bias][:count]
    before = list(given)
    out = DS4Sci_EvoformerAttention(q, k, v, given)
    expected = evoformer_attention(q, k, v, *([mask_bias, pair_bias][:count]))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert len(given) == count and all(a is b for a, b in zip(given, before))
    torch.testing.assert_close(DS4Sci_EvoformerAttention(q, k, v, tuple(before)), expected, rtol=0, atol=0)


def test_ds4sci_shim_pair_bias_without_mask():
    q, k, v = qkv(dtype=F64)
    _, pair_bias = biases(None, (2, 1, 2, 5, 5), F64)
    out = DS4Sci_EvoformerAttention(q, k, v, [None, pair_bias])
    torch.testing.assert_close(out, evoformer_attention(q, k, v, None, pair_bias), rtol=0, atol=0)


def test_ds4sci_shim_rejects_bad_biases():
    q, k, v = qkv()
    mask_bias, pair_bias = biases((2, 3, 1, 1, 5), (2, 1, 2, 5, 5))
    with pytest.raises(ValueError, match="`biases`.*at most two"):
        DS4Sci_EvoformerAttention(q, k, v, [mask_bias, pair_bias, pair_bias])
    with pytest.raises(ValueError, match="`biases`"):
        DS4Sci_EvoformerAttention(q, k, v, mask_bias)


# ---------------------------------------------------------------- validation

META = torch.device("meta")


def _valid():
    q, k, v = qkv(2, 3, 4, 5, 2, 3)
    mask_bias, pair_bias = biases((2, 3, 1, 1, 5), (2, 1, 2, 4, 5))
    return dict(q=q, k=k, v=v, mask_bias=mask_bias, pair_bias=pair_bias)


# name -> (changes to the valid arguments, the argument the message must name)
INVALID = {
    "q rank 4": (lambda a: {"q": a["q"][0]}, "q"),
    "k rank 6": (lambda a: {"k": a["k"][None]}, "k"),
    "v not a tensor": (lambda a: {"v": a["v"].tolist()}, "v"),
    "q int": (lambda a: {"q": a["q"].long()}, "q"),
    "q bool": (lambda a: {"q": a["q"] > 0}, "q"),
    "k other dtype": (lambda a: {"k": a["k"].double()}, "k"),
    "v other dtype": (lambda a: {"v": a["v"].half()}, "v"),
    "v other length": (lambda a: {"v": a["v"][:, :, :4]}, "v"),
    "k other heads": (lambda a: {"k": a["k"][:, :, :, :1], "v": a["v"][:, :, :, :1]}, "k"),
    "k other batch": (lambda a: {"k": a["k"][:1], "v": a["v"][:1]}, "k"),
    "k other head dim": (lambda a: {"k": a["k"][..., :2], "v": a["v"][..., :2]}, "k"),
    # one of k and v off q's shape: that one is named, not the other
    "k alone other head dim": (lambda a: {"k": a["k"][..., :2]}, "k"),
    "k alone other heads": (lambda a: {"k": a["k"][:, :, :, :1]}, "k"),
    "k alone other batch": (lambda a: {"k": a["k"][:1]}, "k"),
    "v alone other head dim": (lambda a: {"v": a["v"][..., :2]}, "v"),
    "v alone other rows": (lambda a: {"v": a["v"][:, :2]}, "v"),
    "k alone other length": (lambda a: {"k": a["k"][:, :, :4]}, "v"),
    "zero heads": (lambda a: {"q": a["q"][..., :0, :], "k": a["k"][..., :0, :], "v": a["v"][..., :0, :]}, "q"),
    "zero head dim": (lambda a: {"q": a["q"][..., :0], "k": a["k"][..., :0], "v": a["v"][..., :0]}, "q"),
    "k on meta": (lambda a: {"k": a["k"].to(META)}, "k"),
    "v on meta": (lambda a: {"v": a["v"].to(META)}, "v"),
    "mask_bias on meta": (lambda a: {"mask_bias": a["mask_bias"].to(META)}, "mask_bias"),
    "pair_bias on meta": (lambda a: {"pair_bias": a["pair_bias"].to(META)}, "pair_bias"),
    "mask_bias per query": (lambda a: {"mask_bias": torch.zeros(2, 3, 1, 4, 5)}, "mask_bias"),
    "mask_bias per head": (lambda a: {"mask_bias": torch.zeros(2, 3, 2, 1, 5)}, "mask_bias"),
    "mask_bias batch 3": (lambda a: {"mask_bias": torch.zeros(3, 3, 1, 1, 5)}, "mask_bias"),
    "mask_bias rank 4": (lambda a: {"mask_bias": torch.zeros(2, 3, 1, 5)}, "mask_bias"),
    "mask_bias wrong Lk": (lambda a: {"mask_bias": torch.zeros(2, 3, 1, 1, 4)}, "mask_bias"),
    "pair_bias per row": (lambda a: {"pair_bias": torch.zeros(2, 3, 2, 4, 5)}, "pair_bias"),
    "pair_bias wrong Lq": (lambda a: {"pair_bias": torch.zeros(2, 1, 2, 5, 5)}, "pair_bias"),
    "pair_bias heads 3": (lambda a: {"pair_bias": torch.zeros(2, 1, 3, 4, 5)}, "pair_bias"),
    "pair_bias not a tensor": (lambda a: {"pair_bias": 0.0}, "pair_bias"),
    "mask_bias bool mask": (lambda a: {"mask_bias": torch.ones(2, 3, 1, 1, 5, dtype=torch.bool)}, "mask_bias"),
    "mask_bias int mask": (lambda a: {"mask_bias": torch.ones(2, 3, 1, 1, 5, dtype=torch.int64)}, "mask_bias"),
    "pair_bias float64 for float32 q": (lambda a: {"pair_bias": a["pair_bias"].double()}, "pair_bias"),
    "mask_bias float16 for float32 q": (lambda a: {"mask_bias": a["mask_bias"].half()}, "mask_bias"),
    "scale zero": (lambda a: {"scale": 0.0}, "scale"),
    "scale negative": (lambda a: {"scale": -1.0}, "scale"),
    "scale nan": (lambda a: {"scale": math.nan}, "scale"),
    "scale inf": (lambda a: {"scale": math.inf}, "scale"),
    "scale string": (lambda a: {"scale": "0.5"}, "scale"),
    "scale tensor": (lambda a: {"scale": torch.tensor(0.5)}, "scale"),
    "scale bool": (lambda a: {"scale": True}, "scale"),
    "chunk_size zero": (lambda a: {"chunk_size": 0}, "chunk_size"),
    "chunk_size negative": (lambda a: {"chunk_size": -2}, "chunk_size"),
    "chunk_size float": (lambda a: {"chunk_size": 1.5}, "chunk_size"),
    "chunk_size bool": (lambda a: {"chunk_size": True}, "chunk_size"),
}


@pytest.mark.parametrize("change,argument", INVALID.values(), ids=list(INVALID))
def test_invalid_arguments_raise_value_error_naming_them(change, argument):
    arguments = _valid()
    arguments.update(change(arguments))
    with pytest.raises(ValueError, match=f"`{argument}`"):
        evoformer_attention(**arguments, backend="eager")


def test_validation_message_shows_every_tensor():
    arguments = _valid()
    arguments["pair_bias"] = torch.zeros(2, 3, 2, 4, 5)
    with pytest.raises(ValueError) as info:
        evoformer_attention(**arguments)
    message = str(info.value)
    for name in ("q", "k", "v", "mask_bias", "pair_bias"):
        assert f"{name}: shape=" in message
    assert "stride=" in message and "dtype=torch.float32" in message


def test_the_valid_arguments_are_valid():
    # Guards the table above: each case fails because of its one change.
    out = evoformer_attention(**_valid(), backend="eager", chunk_size=2, scale=0.5)
    assert out.shape == (2, 3, 4, 2, 3)


# ---------------------------------------------------------------- backend selection


def test_unknown_backend_name_raises():
    with pytest.raises(ValueError, match="backend.*'nope'"):
        evoformer_attention(*qkv(), backend="nope")
    with pytest.raises(ValueError, match="set_backend.*'nope'"):
        ops.set_backend("nope")
    with pytest.raises(ValueError, match="backend.*'nope'"):
        with ops.backend("nope"):
            pass


def test_get_backend():
    assert ops.get_backend("eager").name == "eager"
    assert "eager" in ops.backend_names() and ops.backend_names()[0] == "auto"
    for name in ("auto", "nope"):
        with pytest.raises(ValueError, match=f"name.*'{name}'"):
            ops.get_backend(name)


def test_environment_variable_unknown_name_raises(monkeypatch):
    monkeypatch.setenv(ops._dispatch.ENV_VAR, "nope")
    with pytest.raises(ValueError, match="EVOFORMER_BLOCKS_BACKEND.*'nope'"):
        evoformer_attention(*qkv())


def test_backend_precedence(monkeypatch, recording_backends):
    calls, _ = recording_backends
    q, k, v = qkv()

    def used(**kwargs):
        calls.clear()
        evoformer_attention(q, k, v, **kwargs)
        return calls[-1] if calls else "eager"

    monkeypatch.delenv(ops._dispatch.ENV_VAR, raising=False)
    assert ops.get_default_backend() == "auto"
    assert used() == "eager"  # auto: the real backends come first on CPU

    monkeypatch.setenv(ops._dispatch.ENV_VAR, " SPY_A ")
    assert ops.get_default_backend() == "spy_a"
    assert used() == "spy_a"

    ops.set_backend("spy_b")  # set_backend beats the environment
    assert used() == "spy_b"

    with ops.backend("spy_a"):  # a context beats set_backend
        assert used() == "spy_a"
        assert used(backend="spy_b") == "spy_b"  # the argument beats everything
        with ops.backend("eager"):
            assert used() == "eager"
        assert used() == "spy_a"
    assert used() == "spy_b"

    with pytest.raises(RuntimeError):
        with ops.backend("spy_a"):
            raise RuntimeError("leaves the block")
    assert ops.get_default_backend() == "spy_b"

    ops.set_backend(None)  # back to the environment
    assert used() == "spy_a"
    monkeypatch.delenv(ops._dispatch.ENV_VAR)
    assert used() == "eager"


def test_auto_skips_backends_that_refuse(recording_backends):
    calls, backends = recording_backends
    q, k, v = qkv()
    # Put the spies first for auto, then make the first refuse.
    ops._dispatch.register(backends["spy_a"], auto_priority=-2)
    ops._dispatch.register(backends["spy_b"], auto_priority=-1)
    backends["spy_a"].refuse = "spy_a refuses for the test"
    evoformer_attention(q, k, v, backend="auto")
    assert calls == ["spy_b"]
    with pytest.raises(ValueError, match="spy_a refuses for the test"):
        evoformer_attention(q, k, v, backend="spy_a")
    # A dtype outside a backend's capability table is a reason too.
    calls.clear()
    evoformer_attention(*(t.half() for t in (q, k, v)), backend="auto")
    assert calls == []


class _CountingBackend(ops.Backend):
    """An attention backend that refuses keys longer than ``max_keys`` and counts its checks."""

    op = _dispatch.ATTENTION_OP

    def __init__(self, name: str, max_keys: int, deterministic: bool = True) -> None:
        self.name, self.max_keys, self.checks = name, max_keys, 0
        self.capabilities = ops.Capabilities(dtypes=(torch.float32,), device_types=(), deterministic=deterministic)

    def extra_reasons(self, inputs) -> list[str]:
        self.checks += 1
        return [f"Lk = {inputs.len_k} > {self.max_keys}"] if inputs.len_k > self.max_keys else []


def test_selection_is_remembered_per_input_shapes_and_setting(monkeypatch):
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    short = _CountingBackend("short_keys", max_keys=6)
    ops.register(short, auto_priority=-1)
    eager = ops.get_backend("eager")
    small, large = ops.validate(*qkv(lk=5)), ops.validate(*qkv(lk=9))
    assert _dispatch.select(_dispatch.ATTENTION_OP, small, None) is short
    assert _dispatch.select(_dispatch.ATTENTION_OP, ops.validate(*qkv(lk=5)), None) is short
    assert short.checks == 1  # the same shapes again: remembered
    assert _dispatch.select(_dispatch.ATTENTION_OP, large, None) is eager  # new shapes: checked, refused
    assert _dispatch.select(_dispatch.ATTENTION_OP, large, None) is eager and short.checks == 2
    assert _dispatch.select(_dispatch.ATTENTION_OP, ops.validate(*qkv(lk=5, dtype=F64)), None) is eager
    # the setting in effect is part of what is remembered
    with ops.backend("eager"):
        assert _dispatch.select(_dispatch.ATTENTION_OP, small, None) is eager
    assert _dispatch.select(_dispatch.ATTENTION_OP, small, "short_keys") is short
    with pytest.raises(ValueError, match="Lk = 9 > 6"):  # refusals are never remembered
        _dispatch.select(_dispatch.ATTENTION_OP, large, "short_keys")
    with pytest.raises(ValueError, match="Lk = 9 > 6"):
        _dispatch.select(_dispatch.ATTENTION_OP, large, "short_keys")
    # registering a backend starts afresh
    checks = short.checks
    ops.register(short, auto_priority=-1)
    assert _dispatch.select(_dispatch.ATTENTION_OP, small, None) is short and short.checks == checks + 1


def test_remembered_selection_follows_deterministic_mode():
    fast = _CountingBackend("fast_atomics", max_keys=100, deterministic=False)
    ops.register(fast, auto_priority=-1)
    inputs = ops.validate(*qkv())
    assert _dispatch.select(_dispatch.ATTENTION_OP, inputs, None) is fast
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert _dispatch.select(_dispatch.ATTENTION_OP, inputs, None) is ops.get_backend("eager")
    finally:
        torch.use_deterministic_algorithms(previous)
    assert _dispatch.select(_dispatch.ATTENTION_OP, inputs, None) is fast


def test_cutlass_on_cpu_lists_reasons():
    if "cutlass" not in ops.backend_names():
        pytest.skip("no 'cutlass' backend registered")
    q, k, v = (t.half() for t in qkv(d=8))
    with pytest.raises(ValueError, match="'cutlass' cannot run") as info:
        evoformer_attention(q, k, v, backend="cutlass")
    assert "device type 'cpu'" in str(info.value)
    # auto falls back to eager on CPU.
    torch.testing.assert_close(
        evoformer_attention(q, k, v, backend="auto"), evoformer_attention(q, k, v, backend="eager"), rtol=0, atol=0
    )


@pytest.fixture
def deterministic_mode():
    """``deterministic_mode(warn_only)`` turns torch.use_deterministic_algorithms on; restored after."""
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield lambda warn_only=False: torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def test_deterministic_algorithms_pass_over_nondeterministic_backends(recording_backends, deterministic_mode, caplog):
    calls, backends = recording_backends
    q, k, v = qkv()
    spy = backends["spy_a"]
    spy.capabilities = dataclasses.replace(spy.capabilities, deterministic=False)
    ops.register(spy, auto_priority=-1)  # auto tries spy_a first
    evoformer_attention(q, k, v)
    assert calls == ["spy_a"]  # without deterministic mode it runs

    deterministic_mode()
    calls.clear()
    with caplog.at_level(logging.INFO, logger="evoformer_blocks"):
        out = evoformer_attention(q, k, v)
    assert calls == []  # auto went on to eager
    torch.testing.assert_close(out, evoformer_attention(q, k, v, backend="eager"), rtol=0, atol=0)
    assert "using 'eager'; skipped 'spy_a' because it is not deterministic" in caplog.text
    with pytest.raises(ValueError, match="backend 'spy_a' cannot run.*\n.*not deterministic"):
        evoformer_attention(q, k, v, backend="spy_a")
    assert calls == []

    deterministic_mode(warn_only=True)  # as torch does: a named backend runs, with a warning
    with pytest.warns(UserWarning, match="'spy_a' runs although it is not deterministic"):
        evoformer_attention(q, k, v, backend="spy_a")
    assert calls == ["spy_a"]
    evoformer_attention(q, k, v)  # auto still prefers a deterministic backend
    assert calls == ["spy_a"]


def test_deterministic_backends_run_in_deterministic_mode(recording_backends, deterministic_mode):
    calls, _ = recording_backends
    deterministic_mode()
    evoformer_attention(*qkv(), backend="spy_b")
    assert calls == ["spy_b"]


# ---------------------------------------------------------------- the registry


def test_capability_table_then_one_backend_hook(recording_backends):
    _, backends = recording_backends
    spy = backends["spy_a"]
    asked = []
    spy.extra_reasons = lambda inputs: asked.append(inputs) or ["its own reason"]
    half = ops.validate(*(t.half() for t in qkv()))
    assert spy.not_supported_reasons(half) == ["dtype torch.float16 is not supported (supported: float32, float64)"]
    assert asked == []  # the hook only sees inputs the table accepts: it may build kernels
    assert spy.not_supported_reasons(ops.validate(*qkv())) == ["its own reason"]
    assert len(asked) == 1


def test_register_refuses_a_second_backend_under_a_taken_name(recording_backends):
    calls, backends = recording_backends
    impostor = type(backends["spy_a"])("spy_a", calls)
    with pytest.raises(ValueError, match="op 'evoformer_attention' already has a backend 'spy_a'"):
        ops.register(impostor, auto_priority=1)
    ops.register(backends["spy_a"], auto_priority=1)  # the same object again: a new priority
    assert ops.backend_names()[:3] == ["auto", "spy_a", "cutlass"]
    with pytest.raises(ValueError, match="`auto_priority`"):
        ops.register(backends["spy_b"], auto_priority="first")


class _SecondOpBackend(ops.Backend):
    """A backend of another op that returns q as it is and records its calls."""

    op = "second_op"

    def __init__(self, name: str, calls: list) -> None:
        self.name = name
        self.capabilities = ops.Capabilities(dtypes=(torch.float32,), device_types=())
        self.calls = calls

    def forward(self, inputs, chunk_size):
        self.calls.append(f"second_op:{self.name}")
        return inputs.q


def test_a_second_op_shares_the_one_setting(recording_backends, monkeypatch):
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    calls, _ = recording_backends
    second_eager, second_spy = _SecondOpBackend("eager", calls), _SecondOpBackend("spy_b", calls)
    ops.register(second_eager, auto_priority=100)
    ops.register(second_spy, auto_priority=5)
    assert ops.backend_names("second_op") == ["auto", "spy_b", "eager"]
    assert ops.backend_names("evoformer_attention") == ["auto", "cutlass", "eager", "spy_a", "spy_b"]
    assert ops.get_backend("eager", "second_op") is second_eager
    inputs = ops.validate(*qkv())
    assert _dispatch.select("second_op", inputs, None) is second_spy  # auto, in the op's own order
    with ops.backend("eager"):  # one setting for both ops
        assert _dispatch.select("second_op", inputs, None) is second_eager
        assert _dispatch.select("evoformer_attention", inputs, None) is ops.get_backend("eager")
    ops.set_backend("spy_a")  # a name the second op has no backend for
    assert _dispatch.select("evoformer_attention", inputs, None) is not None
    with pytest.raises(ValueError, match="second_op: backend 'spy_a' has no implementation of this op"):
        _dispatch.select("second_op", inputs, None)
    monkeypatch.setenv(_dispatch.ENV_VAR, "spy_b")
    ops.set_backend(None)
    assert _dispatch.select("second_op", inputs, None) is second_spy
    # Refusals name the op.
    doubles = ops.validate(*qkv(dtype=F64))
    with pytest.raises(ValueError, match="second_op: backend 'eager' cannot run these inputs"):
        _dispatch.select("second_op", doubles, "eager")
    with pytest.raises(ValueError, match="second_op: no backend can run these inputs"):
        _dispatch.select("second_op", doubles, "auto")
    with pytest.raises(ValueError, match="op: unknown op 'third_op'"):
        _dispatch.select("third_op", inputs, None)
    assert calls == []  # selection alone runs nothing


def test_isolated_registry_undoes_every_change(recording_backends, monkeypatch):
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    calls, _ = recording_backends
    registry = _dispatch.REGISTRY
    names = ops.backend_names()
    with registry.isolated():
        ops.register(_SecondOpBackend("spy_c", calls), auto_priority=1)
        ops.set_backend("spy_c")
        left_open = registry.use("eager")
        left_open.__enter__()
        assert ops.get_default_backend() == "eager" and "spy_c" in ops.backend_names()
    assert ops.backend_names() == names and ops.get_default_backend() == "auto"
    assert sorted(registry.ops()) == [
        "add_layer_norm", "evoformer_attention", "layer_norm", "linear", "sigmoid_gate", "triangle_multiplication"
    ]
    left_open.__exit__(None, None, None)  # closes on the state it was opened on
    assert ops.get_default_backend() == "auto"


def test_constant_result_marks_as_torch_compiler_does():
    # _dispatch.constant_result sets the one attribute torch.compiler.assume_constant_result sets (it
    # skips importing torch._dynamo); if torch changes how it marks a function, this fails.
    def theirs():
        return 1

    def ours():
        return 1

    before = set(vars(theirs))
    torch.compiler.assume_constant_result(theirs)
    marks = {k: v for k, v in vars(theirs).items() if k not in before}
    constant_result(ours)
    assert marks and vars(ours) == marks
    for fn in (_dispatch._capability, cutlass._family, _fused._extension_error):
        assert all(getattr(fn, k, None) == v for k, v in marks.items()), fn.__qualname__


def test_import_leaves_torch_dynamo_unimported():
    code = "import sys, evoformer_blocks; print('torch._dynamo' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stdout + result.stderr
