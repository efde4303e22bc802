"""AlphaFold 3's modules on CPU in float64 against references written from the AF3 supplement
(Algorithms 8-15, 17 and 24 without conditioning): the attention with pair bias, the MSA
pair-weighted averaging, the SwiGLU transition, the outer product mean, the bias-free triangle
updates, the Pairformer and MSA-module blocks (forward and gradients, dropout), the stacks
(checkpointing, chunking, padding, torch.compile, autocast, input checks) and the af3 preset."""

from __future__ import annotations

import itertools
import logging
import math

import pytest
import torch
import torch.nn.functional as F

from evoformer_blocks import (
    AttentionPairBias,
    MSAModule,
    MSAModuleBlock,
    MSAPairWeightedAveraging,
    OuterProductMean,
    PairformerBlock,
    PairformerStack,
    SwiGLUTransition,
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)
from evoformer_blocks.compat_af3 import openfold3_options
from evoformer_blocks.config import get_config
from test_evoformer import assert_block_is_written, pair_updates_as_written, randomize_

F64 = torch.float64
# Every width distinct, so that a mixed-up dimension cannot pass.
PAIRFORMER = dict(c_s=10, c_z=6, c_hidden_pair_bias=3, no_heads_pair_bias=2, c_hidden_mul=4, c_hidden_pair_att=5,
                  no_heads_pair=3, transition_n=2, pair_dropout=0.25)
MSA_MODULE = dict(c_m=7, c_z=6, c_hidden_msa_att=3, c_hidden_opm=2, c_hidden_mul=4, c_hidden_pair_att=5,
                  no_heads_msa=2, no_heads_pair=3, transition_n=2, msa_dropout=0.15, pair_dropout=0.25)


def lin(layer, x):
    """The layer as the supplement writes it: x W^T (+ b where the layer has one)."""
    out = x @ layer.weight.T
    return out if layer.bias is None else out + layer.bias


def ln(norm, x):
    return F.layer_norm(x, x.shape[-1:], norm.weight, norm.bias)


def heads(x, h):
    return x.unflatten(-1, (h, -1))  # [..., H, c]


def single_inputs(batch=2, n=7, c_s=10, c_z=6, padded=True):
    s = torch.randn(batch, n, c_s, dtype=F64)
    z = torch.randn(batch, n, n, c_z, dtype=F64)
    mask = torch.ones(batch, n, dtype=F64)
    if padded:
        mask[-1, -2:] = 0
    return s, z, mask, mask[:, :, None] * mask[:, None, :]


def msa_inputs(batch=2, n_msa=4, n=7, c_m=7, c_z=6, padded=True):
    m = torch.randn(batch, n_msa, n, c_m, dtype=F64)
    z = torch.randn(batch, n, n, c_z, dtype=F64)
    msa_mask = torch.ones(batch, n_msa, n, dtype=F64)
    if padded:
        msa_mask[-1, :, -2:] = 0
        msa_mask[-1, -1] = 0
    token = msa_mask[:, 0]
    return m, z, msa_mask, token[:, :, None] * token[:, None, :]


# --------------------------------------------------------------------------------------------
# The modules against the supplement's algorithms


def test_attention_pair_bias_is_algorithm_24():
    mod = randomize_(AttentionPairBias(c_s=10, c_z=6, c_hidden=3, no_heads=2, backend="eager")).to(F64)
    s, z, mask, _ = single_inputs()
    a = ln(mod.layer_norm_s, s)
    q, k, v = (heads(lin(layer, a), 2) for layer in (mod.linear_q, mod.linear_k, mod.linear_v))  # [B, N, H, c]
    g = torch.sigmoid(heads(lin(mod.linear_g, a), 2))
    b = lin(mod.linear_z, ln(mod.layer_norm_z, z))  # [B, N_i, N_j, H]
    logits = torch.einsum("bihc,bjhc->bhij", q, k) / math.sqrt(3) + b.permute(0, 3, 1, 2)
    logits = logits + 1e9 * (mask[:, None, None, :] - 1)
    o = torch.einsum("bhij,bjhc->bihc", torch.softmax(logits, -1), v)
    expected = lin(mod.linear_o, (g * o).flatten(-2))
    torch.testing.assert_close(mod(s, z, mask), expected)
    torch.testing.assert_close(mod(s, z, mask, chunk_size=3), expected)
    assert mod.linear_q.bias is not None and all(
        layer.bias is None for layer in (mod.linear_k, mod.linear_v, mod.linear_g, mod.linear_o, mod.linear_z)
    )


def test_pair_weighted_averaging_is_algorithm_10():
    mod = randomize_(MSAPairWeightedAveraging(c_m=7, c_z=6, c_hidden=3, no_heads=2, backend="eager")).to(F64)
    m, z, _, pair_mask = msa_inputs()
    x = ln(mod.layer_norm_m, m)
    v = heads(lin(mod.linear_v, x), 2)  # [B, S, N, H, c]
    g = torch.sigmoid(heads(lin(mod.linear_g, x), 2))
    b = lin(mod.linear_z, ln(mod.layer_norm_z, z))  # [B, N_i, N_j, H]
    expected = torch.zeros_like(v)
    for batch, h, i in itertools.product(range(2), range(2), range(7)):
        w = torch.softmax(b[batch, i, :, h] + 1e9 * (pair_mask[batch, i] - 1), dim=0)  # [N_j]
        expected[batch, :, i, h] = torch.einsum("j,sjc->sc", w, v[batch, :, :, h])
    expected = lin(mod.linear_o, (g * expected).flatten(-2))
    torch.testing.assert_close(mod(m, z, pair_mask), expected)
    torch.testing.assert_close(mod(m, z, pair_mask, chunk_size=3), expected)
    unmasked = mod(m, z)
    torch.testing.assert_close(unmasked[0], expected[0])  # the first entry has no padding
    assert not torch.allclose(unmasked[1], expected[1])


def test_swiglu_transition_is_algorithm_11():
    mod = randomize_(SwiGLUTransition(6, n=3, backend="eager")).to(F64)
    _, z, _, pair_mask = single_inputs()
    x = ln(mod.layer_norm, z)
    expected = lin(mod.linear_out, F.silu(lin(mod.linear_a, x)) * lin(mod.linear_b, x)) * pair_mask[..., None]
    torch.testing.assert_close(mod(z, pair_mask), expected)
    torch.testing.assert_close(mod(z, pair_mask, chunk_size=5), expected)
    assert all(layer.bias is None for layer in (mod.linear_a, mod.linear_b, mod.linear_out))


@pytest.mark.parametrize("mean_first", [True, False], ids=["supplement", "openfold3"])
def test_outer_product_mean_is_algorithm_9(mean_first):
    """AF3's form: a, b without bias; the mean over the (unmasked) sequences, then linear_out; with
    mean_first=False its bias is divided by the counts too (OpenFold3)."""
    mod = randomize_(OuterProductMean(7, 6, 3, eps=1e-3, projection_bias=False, mean_first=mean_first)).to(F64)
    m, _, msa_mask, _ = msa_inputs()
    x = ln(mod.layer_norm, m)
    a, b = lin(mod.linear_1, x) * msa_mask[..., None], lin(mod.linear_2, x) * msa_mask[..., None]
    count = torch.einsum("bsi,bsj->bij", msa_mask, msa_mask)[..., None] + 1e-3
    outer = torch.einsum("bsic,bsjd->bijcd", a, b).flatten(-2)
    if mean_first:
        expected = (outer / count) @ mod.linear_out.weight.T + mod.linear_out.bias
    else:
        expected = lin(mod.linear_out, outer) / count
    torch.testing.assert_close(mod(m, msa_mask), expected)
    torch.testing.assert_close(mod(m, msa_mask, chunk_size=3), expected)
    z = torch.randn_like(expected)
    torch.testing.assert_close(mod._normalized(x, msa_mask, 2, residual=z), z + expected)


@pytest.mark.parametrize("cls", [TriangleMultiplicationOutgoing, TriangleMultiplicationIncoming])
def test_bias_free_triangle_multiplication_is_algorithms_12_13(cls):
    mod = randomize_(cls(c_z=6, c_hidden=4, bias=False)).to(F64)
    _, z, _, pair_mask = single_inputs()
    x = ln(mod.layer_norm_in, z)
    a = pair_mask[..., None] * torch.sigmoid(lin(mod.linear_a_g, x)) * lin(mod.linear_a_p, x)
    b = pair_mask[..., None] * torch.sigmoid(lin(mod.linear_b_g, x)) * lin(mod.linear_b_p, x)
    equation = "bikc,bjkc->bijc" if cls is TriangleMultiplicationOutgoing else "bkic,bkjc->bijc"
    p = ln(mod.layer_norm_out, torch.einsum(equation, a, b))
    expected = torch.sigmoid(lin(mod.linear_g, x)) * lin(mod.linear_z, p)
    torch.testing.assert_close(mod(z, pair_mask), expected)
    assert all(getattr(mod, name).bias is None for name in ("linear_a_p", "linear_b_g", "linear_g", "linear_z"))


@pytest.mark.parametrize("cls, bias_ik", [(TriangleAttentionStartingNode, False), (TriangleAttentionEndingNode, False),
                                          (TriangleAttentionEndingNode, True)])
def test_bias_free_triangle_attention_is_algorithms_14_15(cls, bias_ik):
    """AF3's triangle attentions: gate and output projection without bias; the ending node's bias
    b_ki (the supplement) or b_ik (bias_ik, OpenFold3's pair block)."""
    kwargs = {"bias_ik": True} if bias_ik else {}
    mod = randomize_(cls(6, 3, 2, bias=False, backend="eager", **kwargs)).to(F64)
    _, z, _, pair_mask = single_inputs()
    x = ln(mod.layer_norm_z, z)
    q, k, v = (heads(lin(layer, x), 2) for layer in (mod.linear_q, mod.linear_k, mod.linear_v))  # [B, I, J, H, c]
    g = torch.sigmoid(heads(lin(mod.linear_g, x), 2))
    b = lin(mod.linear_z, x)  # [B, I, J, H]
    mask_bias = 1e9 * (pair_mask - 1)
    if cls is TriangleAttentionStartingNode:  # edge (i, j) over (i, k), bias b_jk
        logits = torch.einsum("bijhc,bikhc->bijkh", q, k) / math.sqrt(3) + b[:, None] + mask_bias[:, :, None, :, None]
        o = torch.einsum("bijkh,bikhc->bijhc", torch.softmax(logits, dim=3), v)
    else:  # edge (i, j) over (k, j), bias b_ki (or b_ik)
        third = b.transpose(1, 2) if not bias_ik else b  # [B, i, k, H] = b_ki (or b_ik)
        logits = torch.einsum("bijhc,bkjhc->bijkh", q, k) / math.sqrt(3) + third[:, :, None]
        logits = logits + mask_bias.transpose(1, 2)[:, None, :, :, None]  # mask of the key edge (k, j): [B, 1, j, k, 1]
        o = torch.einsum("bijkh,bkjhc->bijhc", torch.softmax(logits, dim=3), v)
    expected = lin(mod.linear_o, (g * o).flatten(-2))
    torch.testing.assert_close(mod(z, pair_mask), expected)
    assert mod.linear_g.bias is None and mod.linear_o.bias is None


def test_bias_ik_is_the_ending_nodes_option():
    with pytest.raises(ValueError, match="`bias_ik` is an option of the ending-node attention only"):
        TriangleAttentionStartingNode(6, 3, 2, bias_ik=True)


# --------------------------------------------------------------------------------------------
# Blocks against Algorithms 17 and 8 written with the sub-modules' public forwards


def _algorithm_17(block, s, z, single_mask, pair_mask):
    keep = [1 if k is None else k for k in block.dropout_masks(s, z)]
    z = pair_updates_as_written(block, z, pair_mask, keep)
    s = s + block.attn_pair_bias(s, z, single_mask)
    return s + block.single_transition(s, single_mask), z


def _algorithm_8_block(block, m, z, msa_mask, pair_mask):
    keep = [1 if k is None else k for k in block.dropout_masks(m, z)]
    z = z + block.outer_product_mean(m, msa_mask)
    m = m + block.pair_weighted_averaging(m, z, pair_mask) * keep[0]
    m = m + block.msa_transition(m, msa_mask)
    return m, pair_updates_as_written(block, z, pair_mask, keep[1:])


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("options", [{}, {"fuse_projection_weights": True, "bias_ik": True}], ids=["af3", "fused+ik"])
def test_pairformer_block_is_algorithm_17(train, options):
    block = randomize_(PairformerBlock(**PAIRFORMER, **options, backend="eager")).to(F64).train(train)
    assert_block_is_written(block, lambda *args: _algorithm_17(block, *args), single_inputs(), train)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("opm_mean_first", [True, False])
def test_msa_module_block_is_algorithm_8(train, opm_mean_first):
    block = randomize_(MSAModuleBlock(**MSA_MODULE, opm_mean_first=opm_mean_first, backend="eager")).to(F64)
    assert_block_is_written(block.train(train), lambda *args: _algorithm_8_block(block, *args), msa_inputs(), train)


def pairformer(no_blocks=2, **kwargs):
    args = dict(PAIRFORMER, no_blocks=no_blocks, backend="eager")
    args.update(kwargs)
    return randomize_(PairformerStack(**args)).to(F64)


def msa_module(no_blocks=2, **kwargs):
    args = dict(MSA_MODULE, no_blocks=no_blocks, backend="eager")
    args.update(kwargs)
    return randomize_(MSAModule(**args)).to(F64)


def test_msa_module_is_its_blocks_and_skips_the_dead_update():
    """The module's z is its blocks' (public forwards, m updated in every block); the last block's
    update of m reaches no output, so OpenFold3's form without it gives the same z for the same
    weights, and its state dict lacks the last block's pair-weighted averaging and MSA transition."""
    module = msa_module(no_blocks=3).eval()
    m, z, msa_mask, pair_mask = msa_inputs()
    with torch.no_grad():
        expected_m, expected_z = m, z
        for block in module.blocks:
            expected_m, expected_z = _algorithm_8_block(block, expected_m, expected_z, msa_mask, pair_mask)
        torch.testing.assert_close(module(m, z, msa_mask, pair_mask), expected_z)
        short = msa_module(no_blocks=3, last_block_msa_update=False).eval()
        missing = set(module.state_dict()) - set(short.state_dict())
        assert missing and all(k.startswith("blocks.2.pair_weighted_averaging.") or k.startswith("blocks.2.msa_transition.")
                               for k in missing)
        short.load_state_dict({k: v for k, v in module.state_dict().items() if k not in missing})
        torch.testing.assert_close(short(m, z, msa_mask, pair_mask), expected_z)


# --------------------------------------------------------------------------------------------
# Stacks


@pytest.mark.parametrize("make", [pairformer, msa_module], ids=["pairformer", "msa_module"])
@pytest.mark.parametrize("blocks_per_ckpt", [1, 2])
def test_checkpointing_gives_the_same_gradients(make, blocks_per_ckpt):
    def grads(stack):
        inputs = single_inputs() if make is pairformer else msa_inputs()
        leaves = [inputs[0].requires_grad_(True), inputs[1].requires_grad_(True)]
        torch.manual_seed(3)
        out = stack(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        loss = sum((o * torch.linspace(-1, 1, o.shape[-1], dtype=F64)).sum() for o in out)
        return torch.autograd.grad(loss, leaves + list(stack.parameters()), allow_unused=True)

    torch.manual_seed(0)
    stack = make(no_blocks=3).train()
    torch.manual_seed(1)
    reference = grads(stack)
    stack.blocks_per_ckpt = blocks_per_ckpt
    torch.manual_seed(1)
    checkpointed = grads(stack)
    for a, b in zip(checkpointed, reference):
        if a is None or b is None:
            assert a is None and b is None  # the MSA module's last MSA update: no gradient
        else:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("make", [pairformer, msa_module], ids=["pairformer", "msa_module"])
def test_chunked_inference_and_padding(make):
    stack = make().eval()
    inputs = single_inputs(padded=False) if make is pairformer else msa_inputs(padded=False)
    with torch.no_grad():
        full = stack(*inputs)
        for chunk_size in (1, 3):
            chunked = stack(*inputs, chunk_size=chunk_size)
            for a, b in zip(chunked if isinstance(chunked, tuple) else (chunked,), full if isinstance(full, tuple) else (full,)):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        # two padded tokens of garbage leave the real ones unchanged
        x, z = inputs[0], inputs[1]
        n = z.shape[-2]
        x_pad = torch.cat([x, torch.randn(*x.shape[:-2], 2, x.shape[-1], dtype=F64)], dim=-2)
        z_pad = torch.randn(*z.shape[:-3], n + 2, n + 2, z.shape[-1], dtype=F64)
        z_pad[..., :n, :n, :] = z
        mask_pad = torch.cat([inputs[2], torch.zeros(*inputs[2].shape[:-1], 2, dtype=F64)], dim=-1)
        token = mask_pad if make is pairformer else mask_pad[:, 0]
        padded = stack(x_pad, z_pad, mask_pad, token[:, :, None] * token[:, None, :])
        if make is pairformer:
            torch.testing.assert_close(padded[0][:, :n], full[0])
            torch.testing.assert_close(padded[1][:, :n, :n], full[1])
        else:
            torch.testing.assert_close(padded[:, :n, :n], full)


def test_stacks_compile_and_run_under_autocast():
    stack = pairformer(no_blocks=1, pair_dropout=0.0).float().eval()
    s, z, single_mask, pair_mask = (t.float() for t in single_inputs())
    compiled = torch.compile(stack, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for a, b in zip(compiled(s, z, single_mask, pair_mask), stack(s, z, single_mask, pair_mask)):
            torch.testing.assert_close(a, b)
    module = msa_module(no_blocks=2, blocks_per_ckpt=1, msa_dropout=0.0, pair_dropout=0.0).float().train()
    m, z2, msa_mask, pair_mask2 = (t.float() for t in msa_inputs())
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    grads = []
    for fn in (module, compiled):
        module.zero_grad()
        torch.manual_seed(4)
        fn(m, z2, msa_mask, pair_mask2).square().mean().backward()
        grads.append([p.grad.clone() for p in module.parameters() if p.grad is not None])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = stack.train()(s, z, single_mask, pair_mask)
        loss = sum(o.float().square().mean() for o in out) + module(m, z2, msa_mask, pair_mask2).float().square().mean()
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in stack.parameters() if p.grad is not None)


def test_bad_inputs_raise():
    stack = pairformer()
    s, z, single_mask, pair_mask = single_inputs()
    with pytest.raises(ValueError, match="`s`"):
        stack(s[..., :5], z)
    with pytest.raises(ValueError, match="`z`"):
        stack(s, z[:, :6, :6])
    with pytest.raises(ValueError, match="`single_mask`"):
        stack(s, z, single_mask[:, :3])
    with pytest.raises(ValueError, match="`pair_mask`"):
        stack(s, z, single_mask, pair_mask[0])
    with pytest.raises(ValueError, match="`chunk_size`"):
        stack(s, z, chunk_size=0)
    m, z, msa_mask, _ = msa_inputs()
    with pytest.raises(ValueError, match="`m`"):
        msa_module()(m[..., :3], z)
    with pytest.raises(ValueError, match="`pair_mask`"):
        MSAPairWeightedAveraging(7, 6, 3, 2)(m.float(), z.float(), msa_mask.float())
    with pytest.raises(ValueError, match="`pair_dropout`"):
        pairformer(pair_dropout=1.5)
    with pytest.raises(ValueError, match="`last_block_msa_update` must be a bool"):
        msa_module(last_block_msa_update=0)
    with pytest.raises(ValueError, match="`no_heads`"):
        AttentionPairBias(10, 6, 3, 0)


def test_af3_preset_and_from_config():
    cfg = get_config("af3")
    p, msa = cfg.pairformer_stack, cfg.msa_module
    assert (p.c_s, p.c_z, p.no_blocks, p.no_heads_pair_bias, p.c_hidden_pair_bias) == (384, 128, 48, 16, 24)
    assert (p.c_hidden_mul, p.c_hidden_pair_att, p.no_heads_pair, p.transition_n, p.pair_dropout) == (128, 32, 4, 4, 0.25)
    assert (msa.c_m, msa.c_z, msa.no_blocks, msa.no_heads_msa, msa.c_hidden_msa_att, msa.c_hidden_opm) == (64, 128, 4, 8, 8, 32)
    assert (msa.msa_dropout, msa.pair_dropout) == (0.15, 0.25)
    cfg.c_z = 64
    assert cfg.pairformer_stack.c_z == cfg.msa_module.c_z == 64
    small = get_config("af3_small")
    stack = PairformerStack.from_config(small, backend="eager")
    module = MSAModule.from_config(small, no_blocks=1)
    assert len(stack.blocks) == small.pairformer_stack.no_blocks and len(module.blocks) == 1
    assert stack.blocks[0].attn_pair_bias.backend == "eager"


# OpenFold3 0.5.0's config sections (openfold3/projects/of3_all_atom/config/model_config.py:
# architecture.pairformer and architecture.msa.msa_module) with the values it ships (its field
# references blocks_per_ckpt, inf and tune_chunk_size resolved; linear_init_params, a nested
# ConfigDict of per-layer init settings, abridged)
OPENFOLD3_PAIRFORMER_SECTION = dict(
    c_s=384, c_z=128, c_hidden_pair_bias=24, no_heads_pair_bias=16, c_hidden_mul=128, c_hidden_pair_att=32,
    no_heads_pair=4, no_blocks=48, transition_type="swiglu", transition_n=4, pair_dropout=0.25,
    fuse_projection_weights=False, blocks_per_ckpt=None, inf=1e9,
    linear_init_params={"att_pair_bias": {"linear_z": {"bias": False, "init": "default"}},
                        "transition": {"linear_out": {"bias": False, "init": "final"}}},
    use_reentrant=False, clear_cache_between_blocks=False, tune_chunk_size=True,
)
OPENFOLD3_MSA_MODULE_SECTION = dict(
    c_m=64, c_z=128, c_hidden_msa_att=8, c_hidden_opm=32, c_hidden_mul=128, c_hidden_pair_att=32, no_heads_msa=8,
    no_heads_pair=4, no_blocks=4, transition_type="swiglu", transition_n=4, msa_dropout=0.15, pair_dropout=0.25,
    opm_first=True, fuse_projection_weights=False, blocks_per_ckpt=None, inf=1e9, eps=1e-8,
    linear_init_params={"msa_pair_avg": {"linear_z": {"bias": False, "init": "normal"}}},
    use_reentrant=False, clear_cache_between_blocks=False, tune_chunk_size=True,
)


def test_from_config_takes_openfold3_sections(caplog):
    with caplog.at_level(logging.INFO, logger="evoformer_blocks"):
        stack = PairformerStack.from_config(OPENFOLD3_PAIRFORMER_SECTION, no_blocks=1, backend="eager")
    assert ("ignored the OpenFold keys ['clear_cache_between_blocks', 'linear_init_params', 'tune_chunk_size', "
            "'use_reentrant']") in caplog.text
    block = stack.blocks[0]
    assert (len(stack.blocks), stack.blocks_per_ckpt, block.c_s, block.c_z) == (1, None, 384, 128)
    assert (block.attn_pair_bias.no_heads, block.attn_pair_bias.c_hidden) == (16, 24)
    assert (block.tri_att_start.no_heads, block.tri_att_start.c_hidden, block.tri_mul_out.c_hidden) == (4, 32, 128)
    assert block.pair_transition.linear_a.weight.shape == (512, 128)  # SwiGLU, n = 4
    assert block.single_transition.linear_a.weight.shape == (1536, 384)
    assert block.pair_dropout_row.p == block.pair_dropout_col.p == 0.25 and block.attn_pair_bias.inf == 1e9
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="evoformer_blocks"):
        module = MSAModule.from_config(OPENFOLD3_MSA_MODULE_SECTION, no_blocks=2)
    assert ("ignored the OpenFold keys ['clear_cache_between_blocks', 'eps', 'linear_init_params', "
            "'tune_chunk_size', 'use_reentrant']") in caplog.text
    block = module.blocks[0]
    assert (len(module.blocks), block.c_m, block.c_z) == (2, 64, 128)
    averaging = block.pair_weighted_averaging
    assert (averaging.no_heads, averaging.c_hidden, block.tri_mul_in.c_hidden) == (8, 8, 128)
    assert block.msa_dropout_row.p == 0.15 and block.pair_dropout_row.p == 0.25
    assert block.outer_product_mean.linear_1.weight.shape == (32, 64)

    # the sections inside OpenFold3's bigger config (architecture, architecture.msa) are found
    architecture = {"pairformer": OPENFOLD3_PAIRFORMER_SECTION, "msa": {"msa_module": OPENFOLD3_MSA_MODULE_SECTION}}
    assert PairformerStack.from_config(architecture, no_blocks=1).blocks[0].c_s == 384
    msa = dict(architecture["msa"], msa_module_embedder={"c_m_feats": 34, "c_m": 64})
    assert MSAModule.from_config(msa, no_blocks=1).blocks[0].c_m == 64
    # with openfold3_options: OpenFold3's function (its last block without the MSA update)
    module = MSAModule.from_config(OPENFOLD3_MSA_MODULE_SECTION, no_blocks=2, **openfold3_options(MSAModule))
    assert module.blocks[-1].pair_weighted_averaging is None and module.blocks[0].tri_att_end.bias_ik

    # keys that would change the function and that the stacks do not compute
    with pytest.raises(ValueError, match=r"`transition_type` 'relu' is not supported"):
        PairformerStack.from_config(dict(OPENFOLD3_PAIRFORMER_SECTION, transition_type="relu"))
    with pytest.raises(ValueError, match=r"`transition_type` 'relu' is not supported"):
        MSAModule.from_config(dict(OPENFOLD3_MSA_MODULE_SECTION, transition_type="relu"))
    with pytest.raises(ValueError, match=r"`opm_first` False is not supported \(the outer product mean after"):
        MSAModule.from_config(dict(OPENFOLD3_MSA_MODULE_SECTION, opm_first=False))
    with pytest.raises(ValueError, match=r"unknown keys \['use_flash'\]"):  # not an OpenFold3 section key
        PairformerStack.from_config(dict(OPENFOLD3_PAIRFORMER_SECTION, use_flash=True))
