"""Evoformer pieces, blocks and stacks on CPU: the math of the non-attention modules against
independent references, shapes, masks, activation checkpointing, chunking, the backend setting,
presets/from_config, OpenFold state_dict conversion, bf16 autocast and torch.compile."""

from __future__ import annotations

import itertools

import pytest
import torch
from omegaconf import OmegaConf

from evoformer_blocks import (
    DropoutColumnwise,
    DropoutRowwise,
    EvoformerBlock,
    EvoformerStack,
    ExtraMSABlock,
    ExtraMSAStack,
    OuterProductMean,
    PairTransition,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)
from evoformer_blocks.compat import load_openfold_state_dict, to_openfold_state_dict
from evoformer_blocks.config import get_config
from evoformer_blocks.ops import normalization as layer_norm_op
from evoformer_blocks.ops import triangle as triangle_op

F64 = torch.float64
# A tiny stack: every width distinct, so a transposed or mixed-up dimension cannot pass silently.
TINY = dict(
    c_m=6, c_z=5, c_hidden_msa_att=3, c_hidden_opm=2, c_hidden_mul=4, c_hidden_pair_att=3,
    no_heads_msa=2, no_heads_pair=2, transition_n=2, msa_dropout=0.15, pair_dropout=0.25,
)


def randomize_(module: torch.nn.Module) -> torch.nn.Module:
    """Random weights everywhere: the zero-initialized output layers would make every update 0."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
            else:
                p.normal_(1.0 if ("layer_norm" in name and name.endswith("weight")) else 0.0, 0.2)
    return module


def evoformer_stack(no_blocks=2, dtype=F64, **kwargs) -> EvoformerStack:
    args = dict(TINY, c_s=7, no_blocks=no_blocks, backend="eager")
    args.update(kwargs)
    return randomize_(EvoformerStack(**args)).to(dtype)


def extra_msa_stack(no_blocks=2, dtype=F64, **kwargs) -> ExtraMSAStack:
    args = dict(TINY, no_blocks=no_blocks, backend="eager")
    args.update(kwargs)
    return randomize_(ExtraMSAStack(**args)).to(dtype)


def inputs(batch=(2,), n_seq=4, n_res=7, c_m=6, c_z=5, dtype=F64, padded=True):
    """m, z and masks; with ``padded`` the last batch entry has 2 padded residues and 1 padded row."""
    m = torch.randn(*batch, n_seq, n_res, c_m, dtype=dtype)
    z = torch.randn(*batch, n_res, n_res, c_z, dtype=dtype)
    msa_mask = torch.ones(*batch, n_seq, n_res, dtype=dtype)
    if padded:
        msa_mask[..., -1, :, -2:] = 0
        msa_mask[..., -1, -1, :] = 0
    seq_mask = msa_mask[..., 0, :]  # [*, N_res]
    pair_mask = seq_mask[..., :, None] * seq_mask[..., None, :]  # [*, N_res, N_res]
    return m, z, msa_mask, pair_mask


# --------------------------------------------------------------------------------------------
# The non-attention modules against direct formulas (float64, loops where it helps clarity)


def test_outer_product_mean_matches_definition():
    opm = randomize_(OuterProductMean(c_m=6, c_z=5, c_hidden=3, eps=1e-3)).to(F64)
    m, _, msa_mask, _ = inputs(batch=(2,), n_seq=4, n_res=5)
    out = opm(m, msa_mask)
    x = torch.nn.functional.layer_norm(m, (6,), opm.layer_norm.weight, opm.layer_norm.bias)
    a = (x @ opm.linear_1.weight.T + opm.linear_1.bias) * msa_mask[..., None]
    b = (x @ opm.linear_2.weight.T + opm.linear_2.bias) * msa_mask[..., None]
    expected = torch.zeros(2, 5, 5, 5, dtype=F64)
    for n, i, j in itertools.product(range(2), range(5), range(5)):
        outer = sum(torch.outer(a[n, s, i], b[n, s, j]) for s in range(4))  # [c, e]
        count = (msa_mask[n, :, i] * msa_mask[n, :, j]).sum()
        expected[n, i, j] = (opm.linear_out.weight @ outer.flatten() + opm.linear_out.bias) / (1e-3 + count)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(opm(m, msa_mask, chunk_size=2), out)


@pytest.mark.parametrize("dtype, e", [(torch.bfloat16, 4), (torch.bfloat16, 3), (torch.float32, 2), (F64, 1)])
def test_outer_product_swap_is_an_exact_permute(dtype, e):
    # the outer product mean's [i, c, j, e] -> [i, j, c, e] copy, moved as int64 words where the
    # e-rows allow (also from a view whose offset does not): the same bits as transpose + contiguous
    from evoformer_blocks.outer_product_mean import _SwapMiddle

    base = torch.randn(2 * 3 * 5 * 4 * e + 1).to(dtype)
    for x in (base[:-1].view(2, 3, 5, 4, e), base[1:].view(2, 3, 5, 4, e)):
        x = x.clone().requires_grad_(True) if x.storage_offset() == 0 else x.requires_grad_(True)
        y = _SwapMiddle.apply(x)
        assert y.is_contiguous() and torch.equal(y, x.transpose(-3, -2))
        grad = torch.randn(y.shape).to(dtype)
        (dx,) = torch.autograd.grad(y, x, grad)
        assert torch.equal(dx, grad.transpose(-3, -2))


@pytest.mark.parametrize("cls", [TriangleMultiplicationOutgoing, TriangleMultiplicationIncoming])
def test_triangle_multiplication_matches_definition(cls):
    mod = randomize_(cls(c_z=5, c_hidden=3)).to(F64)
    _, z, _, pair_mask = inputs(batch=(2,), n_res=6)
    out = mod(z, pair_mask)
    lin = lambda layer, t: t @ layer.weight.T + layer.bias  # noqa: E731
    x = torch.nn.functional.layer_norm(z, (5,), mod.layer_norm_in.weight, mod.layer_norm_in.bias)
    a = pair_mask[..., None] * torch.sigmoid(lin(mod.linear_a_g, x)) * lin(mod.linear_a_p, x)
    b = pair_mask[..., None] * torch.sigmoid(lin(mod.linear_b_g, x)) * lin(mod.linear_b_p, x)
    p = torch.zeros(2, 6, 6, 3, dtype=F64)
    for i, j, k in itertools.product(range(6), repeat=3):
        if cls is TriangleMultiplicationOutgoing:  # edges (i, k) and (j, k)
            p[:, i, j] += a[:, i, k] * b[:, j, k]
        else:  # edges (k, i) and (k, j)
            p[:, i, j] += a[:, k, i] * b[:, k, j]
    p = torch.nn.functional.layer_norm(p, (3,), mod.layer_norm_out.weight, mod.layer_norm_out.bias)
    expected = torch.sigmoid(lin(mod.linear_g, x)) * lin(mod.linear_z, p)
    torch.testing.assert_close(out, expected)


def test_transition_masks_and_chunks():
    mod = randomize_(PairTransition(c_z=5, n=2)).to(F64)
    _, z, _, pair_mask = inputs(batch=(2,), n_res=6)
    out = mod(z, pair_mask)
    lin = lambda layer, t: t @ layer.weight.T + layer.bias  # noqa: E731
    x = torch.nn.functional.layer_norm(z, (5,), mod.layer_norm.weight, mod.layer_norm.bias)
    expected = lin(mod.linear_2, torch.relu(lin(mod.linear_1, x))) * pair_mask[..., None]
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(mod(z, pair_mask, chunk_size=5), out)  # 12 rows in chunks of 5


@pytest.mark.parametrize("cls, shared_dim", [(DropoutRowwise, -3), (DropoutColumnwise, -2)])
def test_shared_dropout(cls, shared_dim):
    drop = cls(0.5)
    x = torch.rand(3, 8, 9, 4) + 1.0
    y = drop(x)
    keep = y / x  # 0 or 2
    assert set(keep.unique().tolist()) == {0.0, 2.0}
    # One mask for every index of the shared dimension, different masks elsewhere.
    assert torch.equal(keep, keep.select(shared_dim, 0).unsqueeze(shared_dim).expand_as(keep))
    assert not torch.equal(keep[0], keep[1])
    drop.eval()
    assert torch.equal(drop(x), x)


# --------------------------------------------------------------------------------------------
# Blocks and stacks


@pytest.mark.parametrize("batch", [(), (2,), (2, 1)])
def test_stack_shapes(batch):
    stack = evoformer_stack().eval()
    m, z, msa_mask, pair_mask = inputs(batch=batch, padded=False)
    m_out, z_out, s = stack(m, z, msa_mask, pair_mask)
    assert m_out.shape == m.shape and z_out.shape == z.shape and s.shape == (*batch, 7, 7)
    torch.testing.assert_close(s, stack.linear(m_out[..., 0, :, :]))
    z_extra = extra_msa_stack().eval()(m, z, msa_mask, pair_mask)
    assert z_extra.shape == z.shape
    # Masks default to all ones.
    torch.testing.assert_close(stack(m, z)[1], z_out)


@pytest.mark.parametrize("cls", [EvoformerBlock, ExtraMSABlock])
def test_fresh_block_is_the_identity(cls):
    """With AlphaFold init every residual branch ends in a zero ("final") layer."""
    block = cls(**TINY).to(F64)
    m, z, msa_mask, pair_mask = inputs()
    m_out, z_out = block(m, z, msa_mask, pair_mask)
    assert torch.equal(m_out, m) and torch.equal(z_out, z)


def _algorithm_6(block, m, z, msa_mask, pair_mask):
    """One block written with its sub-modules' public forwards, plain residual adds and dropout as
    a multiplication by the block's keep-masks (AF2 supplement Algorithm 6), the order of the
    block's docstring."""
    keep = [1 if k is None else k for k in block.dropout_masks(m, z)]
    if block.opm_first:  # AF2-Multimer
        z = z + block.outer_product_mean(m, msa_mask)
    m = m + block.msa_att_row(m, z, msa_mask) * keep[0]
    if block.msa_att_col is not None:
        m = m + block.msa_att_col(m, msa_mask)
    m = m + block.msa_transition(m, msa_mask)
    if not block.opm_first:
        z = z + block.outer_product_mean(m, msa_mask)
    return m, pair_updates_as_written(block, z, pair_mask, keep[1:])


def pair_updates_as_written(block, z, pair_mask, keep):
    """The pair updates of a block (AF2 Algorithm 6 lines 7-11, AF3 Algorithm 17 lines 2-6) with
    their public forwards, plain residual adds and the four pair dropout keep-masks ``keep``."""
    z = z + block.tri_mul_out(z, pair_mask) * keep[0]
    z = z + block.tri_mul_in(z, pair_mask) * keep[1]
    z = z + block.tri_att_start(z, pair_mask) * keep[2]
    z = z + block.tri_att_end(z, pair_mask) * keep[3]
    return z + block.pair_transition(z, pair_mask)


def assert_block_is_written(block, written, inputs, train: bool):
    """``block(*inputs)`` and ``written(*inputs)`` (the algorithm with the block's sub-modules) give
    the same outputs and gradients (inputs and parameters; the first two inputs differentiable), in
    training mode with the same dropout masks (drawn from the same RNG state); in training mode the
    masks must act (eval mode gives another result)."""
    outs, grads = [], []
    for fn in (block, written):
        leaves = [inputs[0].clone().requires_grad_(True), inputs[1].clone().requires_grad_(True)]
        torch.manual_seed(7)
        out = fn(*leaves, *inputs[2:])
        loss = sum((o * torch.linspace(-1, 1, o.shape[-1], dtype=o.dtype)).square().sum() for o in out)
        grads.append(torch.autograd.grad(loss, leaves + list(block.parameters())))
        outs.append(out)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    if train:
        with torch.no_grad():
            assert not torch.allclose(block.eval()(*inputs)[1], outs[0][1])


MULTIMER_OPTIONS = [{}, {"opm_first": True}, {"fuse_projection_weights": True}, {"no_column_attention": True},
                    {"opm_first": True, "no_column_attention": True}]


@pytest.mark.parametrize("cls", [EvoformerBlock, ExtraMSABlock])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("options", MULTIMER_OPTIONS, ids=lambda o: "+".join(o) or "af2")
def test_block_is_algorithm_6(cls, train, options):
    """The block's fused glue (residual adds with the next layer norm, masks and dropout masks
    scaling the update inside that add, shared mask biases) computes the algorithm as written, its
    gradients too; in training mode with the same dropout masks (the block's dropout_masks, drawn
    from the same RNG state); with AF2-Multimer's options too (the outer product mean first, no
    column attention: the Evoformer block's)."""
    if cls is ExtraMSABlock and "no_column_attention" in options:
        pytest.skip("OpenFold's no_column_attention is the Evoformer block's option")
    block = randomize_(cls(**TINY, **options, backend="eager")).to(F64).train(train)
    assert_block_is_written(block, lambda *args: _algorithm_6(block, *args), inputs(), train)


@pytest.mark.parametrize("make", [evoformer_stack, extra_msa_stack], ids=["evoformer", "extra_msa"])
def test_padding_does_not_change_real_positions(make):
    """Padded residues and rows (mask 0, filled with garbage) leave the real entries unchanged."""
    stack = make().eval()
    m, z, msa_mask, pair_mask = inputs(batch=(1,), n_seq=3, n_res=5, padded=False)
    out = stack(m, z, msa_mask, pair_mask)
    # Pad to 5 rows and 8 residues with random values.
    m_pad = torch.randn(1, 5, 8, 6, dtype=F64)
    z_pad = torch.randn(1, 8, 8, 5, dtype=F64)
    m_pad[:, :3, :5] = m
    z_pad[:, :5, :5] = z
    msa_mask_pad = torch.zeros(1, 5, 8, dtype=F64)
    msa_mask_pad[:, :3, :5] = 1
    pair_mask_pad = torch.zeros(1, 8, 8, dtype=F64)
    pair_mask_pad[:, :5, :5] = 1
    out_pad = stack(m_pad, z_pad, msa_mask_pad, pair_mask_pad)
    if isinstance(stack, EvoformerStack):
        torch.testing.assert_close(out_pad[0][:, :3, :5], out[0])
        torch.testing.assert_close(out_pad[1][:, :5, :5], out[1])
        torch.testing.assert_close(out_pad[2][:, :5], out[2])
    else:
        torch.testing.assert_close(out_pad[:, :5, :5], out)


@pytest.mark.parametrize("make", [evoformer_stack, extra_msa_stack], ids=["evoformer", "extra_msa"])
def test_chunked_inference_equals_unchunked(make):
    stack = make().eval()
    m, z, msa_mask, pair_mask = inputs(batch=(2,), n_seq=5, n_res=7)
    with torch.no_grad():
        full = stack(m, z, msa_mask, pair_mask)
        for chunk_size in (1, 3, 100):
            chunked = stack(m, z, msa_mask, pair_mask, chunk_size=chunk_size)
            for a, b in zip(chunked if isinstance(chunked, tuple) else (chunked,), full if isinstance(full, tuple) else (full,)):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _grads(stack, seed):
    """Outputs and gradients (inputs and parameters) of one training-mode pass with dropout."""
    torch.manual_seed(0)
    m, z, msa_mask, pair_mask = inputs(batch=(2,))
    m.requires_grad_(True)
    z.requires_grad_(True)
    torch.manual_seed(seed)  # the dropout masks
    out = stack(m, z, msa_mask, pair_mask)
    out = out if isinstance(out, tuple) else (out,)
    loss = sum((o * torch.linspace(-1, 1, o.shape[-1], dtype=F64)).sum() for o in out)
    stack.zero_grad()
    loss.backward()
    return [o.detach() for o in out] + [m.grad, z.grad] + [p.grad.clone() for p in stack.parameters()]


@pytest.mark.parametrize("make", [evoformer_stack, extra_msa_stack], ids=["evoformer", "extra_msa"])
@pytest.mark.parametrize("blocks_per_ckpt", [1, 2])
def test_activation_checkpointing_gives_same_gradients(make, blocks_per_ckpt):
    torch.manual_seed(1)
    stack = make(no_blocks=3).train()  # 3 blocks: groups of 2 leave a group of 1
    reference = _grads(stack, seed=7)
    calls = []
    stack.blocks[0].outer_product_mean.linear_out.register_forward_hook(lambda *args: calls.append(1))
    stack.blocks_per_ckpt = blocks_per_ckpt
    checkpointed = _grads(stack, seed=7)
    assert len(calls) == 2, "checkpointing recomputes the first block in the backward pass"
    assert len(reference) == len(checkpointed)
    for a, b in zip(checkpointed, reference):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # Dropout is active: another seed gives other gradients.
    other = _grads(stack, seed=8)
    assert not all(torch.allclose(a, b) for a, b in zip(other, checkpointed))


def test_one_call_tables_cover_the_block():
    """The parameters and epsilons an AF2 block passes to its one extension call (evoformer.py's tables,
    in csrc/modules/block_node_bindings.cpp's order): every parameter of the block exactly once, the
    other entries the biases AF2's attentions leave out (q's), each epsilon a module's."""
    from evoformer_blocks import evoformer as module

    block = EvoformerBlock(**TINY)
    named = dict(block.named_parameters())
    listed = module._ONE_CALL_PARAMETERS
    assert len(listed) == 97 and sorted(n for n in listed if n in named) == sorted(named)
    absent = [n for n in listed if n not in named]
    assert absent == [f"{a}.linear_q.bias" for a in ("msa_att_row", "msa_att_col", "tri_att_start", "tri_att_end")]
    modules = dict(block.named_modules())
    paths = [".".join(path) for path in module._ONE_CALL_MODULES]
    resolved = [paths[i] + "." + name for i, name in module._ONE_CALL_PARAMETER_INDEX]
    assert resolved == list(listed) and all(p in modules for p in paths)
    eps = [modules[paths[i]].eps for i in module._ONE_CALL_EPS_INDEX]
    assert eps == [1e-5] * 10 + [block.outer_product_mean.eps]


def test_no_checkpointing_without_grad():
    stack = evoformer_stack(blocks_per_ckpt=1).eval()
    calls = []
    stack.blocks[0].outer_product_mean.linear_out.register_forward_hook(lambda *args: calls.append(1))
    m, z, msa_mask, pair_mask = inputs()
    with torch.no_grad():
        stack(m, z, msa_mask, pair_mask)
    assert len(calls) == 1


def test_one_backend_reaches_every_op(recording_backends):
    calls, backends = recording_backends  # the attention op's spies record their name
    block_calls = backends["spy_a"].block_calls  # the other ops' spies record the op's name
    stack = evoformer_stack(no_blocks=2, backend="spy_a", dtype=torch.float32)
    extra = extra_msa_stack(no_blocks=1, backend="spy_a", dtype=torch.float32)
    with_backend = [mod for mod in [*stack.modules(), *extra.modules()] if hasattr(mod, "backend")]
    assert all(mod.backend == "spy_a" for mod in with_backend)
    m, z, msa_mask, pair_mask = inputs(dtype=torch.float32)
    stack.eval()(m, z, msa_mask, pair_mask)
    extra.eval()(m, z, msa_mask, pair_mask)
    # Per block: row, column, starting- and ending-node attention (the extra MSA block's global
    # column attention is plain PyTorch); both triangle multiplications; the layer norms of the row
    # attention (m and z); and, fused with the residual add in front of them, those of the column
    # attention, both transitions, the outer product mean and both triangle attentions (the
    # triangle multiplications normalise inside their op).
    assert calls == ["spy_a"] * (2 * 4 + 3)
    assert block_calls.count(triangle_op.OP) == 3 * 2
    assert block_calls.count(layer_norm_op.OP) == 3 * 2
    assert block_calls.count(layer_norm_op.ADD_OP) == 3 * 6


# --------------------------------------------------------------------------------------------
# Presets, from_config and input checks


def test_af2_preset_sizes():
    cfg = get_config("af2")
    e, x = cfg.evoformer_stack, cfg.extra_msa_stack
    assert (e.c_m, e.c_z, e.c_s, e.no_blocks) == (256, 128, 384, 48)
    assert (e.no_heads_msa, e.c_hidden_msa_att, e.no_heads_pair, e.c_hidden_pair_att) == (8, 32, 4, 32)
    assert (e.transition_n, e.c_hidden_opm, e.c_hidden_mul, e.msa_dropout, e.pair_dropout) == (4, 32, 128, 0.15, 0.25)
    assert (x.c_m, x.c_z, x.no_blocks, x.no_heads_msa, x.c_hidden_msa_att) == (64, 128, 4, 8, 8)
    cfg.c_z = 64  # the shared width reaches both sections
    assert cfg.evoformer_stack.c_z == cfg.extra_msa_stack.c_z == 64


def test_from_config():
    cfg = get_config("small")
    stack = EvoformerStack.from_config(cfg, backend="eager")
    assert len(stack.blocks) == cfg.evoformer_stack.no_blocks and stack.c_s == cfg.c_s
    assert stack.blocks[0].tri_att_start.backend == "eager"
    extra = ExtraMSAStack.from_config(cfg.extra_msa_stack.to_dict(), no_blocks=3)
    assert len(extra.blocks) == 3 and extra.blocks[0].msa_att_col.eps == cfg.extra_msa_stack.eps
    hydra_style = OmegaConf.create({"evoformer_stack": cfg.evoformer_stack.to_dict()})  # not in struct mode
    assert len(EvoformerStack.from_config(hydra_style, no_blocks=1).blocks) == 1
    with pytest.raises(ValueError, match="`cfg` must be"):
        EvoformerStack.from_config([1, 2])
    with pytest.raises(ValueError, match="unknown keys.*c_typo"):
        EvoformerStack.from_config(cfg, c_typo=3)
    with pytest.raises(ValueError, match="lacks the required keys.*no_blocks"):
        EvoformerStack.from_config({k: v for k, v in cfg.evoformer_stack.items() if k != "no_blocks"})
    with pytest.raises(ValueError, match="unknown `name`"):
        get_config("af4")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(no_blocks=0), "no_blocks"),
        (dict(blocks_per_ckpt=0), "blocks_per_ckpt"),
        (dict(msa_dropout=1.0), "msa_dropout"),
        (dict(pair_dropout=-0.1), "pair_dropout"),
        (dict(backend="fast"), "backend"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        evoformer_stack(**kwargs)


def test_bad_inputs_raise():
    stack = evoformer_stack()
    m, z, msa_mask, pair_mask = inputs()
    with pytest.raises(ValueError, match="`m`"):
        stack(m[..., :5], z)
    with pytest.raises(ValueError, match="`z`"):
        stack(m, z[:, :6, :6])
    with pytest.raises(ValueError, match="`msa_mask`"):
        stack(m, z, msa_mask[..., :3, :])
    with pytest.raises(ValueError, match="`pair_mask`"):
        stack(m, z, msa_mask, pair_mask[0])
    with pytest.raises(ValueError, match="`chunk_size`"):
        stack(m, z, chunk_size=0)


def _stacks_and_blocks():
    """Every stack and block by class name, with float32 weights and the eager backend."""
    return {
        "EvoformerStack": evoformer_stack(dtype=torch.float32),
        "ExtraMSAStack": extra_msa_stack(dtype=torch.float32),
        "EvoformerBlock": EvoformerBlock(**TINY, backend="eager"),
        "ExtraMSABlock": ExtraMSABlock(**TINY, backend="eager"),
    }


@pytest.mark.parametrize("name", ["EvoformerStack", "ExtraMSAStack", "EvoformerBlock", "ExtraMSABlock"])
@pytest.mark.parametrize(
    "argument, m_dtype, z_dtype",
    [("m", F64, torch.float32), ("m", torch.bfloat16, torch.float32), ("z", torch.float32, torch.bfloat16)],
)
def test_inputs_of_another_dtype_than_the_weights_raise(name, argument, m_dtype, z_dtype):
    module = _stacks_and_blocks()[name]
    m, z, msa_mask, pair_mask = inputs(dtype=torch.float32)
    m, z = m.to(m_dtype), z.to(z_dtype)
    wrong = {"m": m_dtype, "z": z_dtype}[argument]
    with pytest.raises(ValueError, match=rf"{name}: `{argument}` is {wrong} on cpu, the module's weights are "
                                         r"torch.float32 on cpu: outside torch.autocast .* dtype"):
        module(m, z, msa_mask, pair_mask)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        if wrong == F64:  # autocast never casts float64
            with pytest.raises(ValueError, match=rf"`{argument}` is {wrong} .* under torch.autocast, which casts"):
                module(m, z, msa_mask, pair_mask)
            m, z = (t.bfloat16() if t.dtype == F64 else t for t in (m, z))
        out = module(m, z, msa_mask, pair_mask)  # bfloat16 against float32 weights: the ops cast, it runs
    assert all(torch.isfinite(t).all() for t in (out if isinstance(out, tuple) else (out,)))


@pytest.mark.parametrize("name", ["EvoformerBlock", "ExtraMSABlock"])
def test_autocast_keeps_the_residual_streams_dtype(name):
    # bfloat16 inputs, float32 weights, autocast: the updates' output biases, added in the residual adds
    # (output_bias=False), are cast as F.linear casts them, so m and z stay bfloat16 and the biases get
    # float32 gradients
    module = _stacks_and_blocks()[name].train()
    m, z, msa_mask, pair_mask = inputs(dtype=torch.float32)
    m, z = m.bfloat16(), z.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_m, out_z = module(m, z, msa_mask, pair_mask)
    assert out_m.dtype == out_z.dtype == torch.bfloat16
    (out_m.float().square().mean() + out_z.float().square().mean()).backward()
    for bias in (module.msa_att_row.linear_o.bias, module.msa_att_col.linear_o.bias, module.msa_transition.linear_2.bias,
                 module.tri_att_start.linear_o.bias, module.tri_att_end.linear_o.bias):
        assert bias.grad is not None and bias.grad.dtype == torch.float32 and torch.isfinite(bias.grad).all()
        assert bias.grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["EvoformerStack", "EvoformerBlock"])
def test_inputs_on_another_device_than_the_weights_raise(name):
    module = _stacks_and_blocks()[name]
    m, z, _, _ = inputs(dtype=torch.float32)
    with pytest.raises(ValueError, match=rf"{name}: `m` is torch.float32 on meta, .* on cpu: .* device"):
        module(m.to("meta"), z)
    with pytest.raises(ValueError, match=rf"{name}: `z` is torch.float32 on meta, .* on cpu: .* device"):
        module(m, z.to("meta"))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="`m` .* device"):
        module(m.to("meta"), z)  # autocast casts dtypes, never devices


def test_a_stack_checks_its_inputs_once(monkeypatch):
    """The stack checks m and z against its weights once per call; its blocks do not check again."""
    from evoformer_blocks import _checks

    checked = []
    check = _checks.check_like_weights
    monkeypatch.setattr(_checks, "check_like_weights", lambda *a: checked.append(a[1]) or check(*a))
    stack = evoformer_stack(no_blocks=3, dtype=torch.float32)
    m, z, msa_mask, pair_mask = inputs(dtype=torch.float32)
    stack(m, z, msa_mask, pair_mask)
    assert checked == ["m", "z"]


@pytest.mark.parametrize("blocks_per_ckpt", [None, 1])
def test_a_stack_makes_its_mask_biases_once(monkeypatch, blocks_per_ckpt):
    """A stack turns its masks into attention biases once per call, and its blocks (and the
    checkpointed recomputation) share them; a block whose attentions have another inf makes its own,
    and the stack still computes what its blocks run one by one compute."""
    from evoformer_blocks import attention

    made = []
    to_bias = attention.mask_to_bias
    monkeypatch.setattr(attention, "mask_to_bias",
                        lambda mask, inf, dtype: made.append(inf) or to_bias(mask, inf, dtype))
    torch.manual_seed(0)
    stack = evoformer_stack(no_blocks=3, blocks_per_ckpt=blocks_per_ckpt).eval()
    m, z, msa_mask, pair_mask = inputs()
    stack(m.requires_grad_(True), z, msa_mask, pair_mask)[0].sum().backward()
    assert made == [1e9, 1e9], "the MSA mask's bias and the pair mask's, once for three blocks and their recompute"

    block = stack.blocks[1]  # inf 2: a masked key keeps a visible weight, so a wrong bias would show
    for module in (block.msa_att_row, block.msa_att_col, block.tri_att_start, block.tri_att_end):
        module.inf = 2.0
    made.clear()
    with torch.no_grad():
        m_out, z_out, _ = stack(m, z, msa_mask, pair_mask)
        assert made == [1e9, 1e9, 2.0, 2.0]
        m_ref, z_ref = m, z
        for block in stack.blocks:
            m_ref, z_ref = block(m_ref, z_ref, msa_mask, pair_mask)
    assert torch.equal(m_out, m_ref) and torch.equal(z_out, z_ref)


@pytest.mark.parametrize(
    "make, shape, argument",
    [
        (lambda: PairTransition(c_z=5, n=2), (2, 6, 6, 5), "x"),
        (lambda: OuterProductMean(c_m=6, c_z=5, c_hidden=3), (2, 4, 6, 6), "m"),
        (lambda: TriangleMultiplicationOutgoing(c_z=5, c_hidden=4), (2, 6, 6, 5), "z"),
        (lambda: TriangleMultiplicationIncoming(c_z=5, c_hidden=4), (2, 6, 6, 5), "z"),
    ],
)
def test_pair_modules_check_dtype_and_device(make, shape, argument):
    module = make()
    name = type(module).__name__
    x = torch.randn(shape)
    for wrong in (x.double(), x.bfloat16()):
        with pytest.raises(ValueError, match=rf"{name}: `{argument}` is {wrong.dtype} on cpu, .* torch.float32 on cpu"):
            module(wrong)
    with pytest.raises(ValueError, match=rf"{name}: `{argument}` is torch.float32 on meta, .* device"):
        module(x.to("meta"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(module(x.bfloat16())).all()


# --------------------------------------------------------------------------------------------
# OpenFold state_dicts

# OpenFold's names for the tensors of one Evoformer block (openfold/model/evoformer.py:
# EvoformerBlock with a PairStack), written out independently of the converters.
_LINEAR, _LN = ("weight", "bias"), ("weight", "bias")
_MHA = [f"mha.linear_{p}.weight" for p in "qkv"] + [f"mha.linear_{p}.{t}" for p in "go" for t in _LINEAR]
_TRI_MUL = [f"{layer}.{t}" for layer in ("linear_a_p", "linear_a_g", "linear_b_p", "linear_b_g", "linear_g", "linear_z", "layer_norm_in", "layer_norm_out") for t in _LINEAR]
_TRANSITION = [f"{layer}.{t}" for layer in ("layer_norm", "linear_1", "linear_2") for t in _LINEAR]
OPENFOLD_BLOCK_KEYS = (
    [f"msa_att_row.{n}" for n in ["layer_norm_m.weight", "layer_norm_m.bias", "layer_norm_z.weight", "layer_norm_z.bias", "linear_z.weight", *_MHA]]
    + [f"msa_att_col._msa_att.{n}" for n in ["layer_norm_m.weight", "layer_norm_m.bias", *_MHA]]
    + [f"msa_transition.{n}" for n in _TRANSITION]
    + [f"outer_product_mean.{layer}.{t}" for layer in ("layer_norm", "linear_1", "linear_2", "linear_out") for t in _LINEAR]
    + [f"pair_stack.{mod}.{n}" for mod in ("tri_mul_out", "tri_mul_in") for n in _TRI_MUL]
    + [f"pair_stack.{mod}.{n}" for mod in ("tri_att_start", "tri_att_end") for n in ["layer_norm.weight", "layer_norm.bias", "linear.weight", *_MHA]]
    + [f"pair_stack.pair_transition.{n}" for n in _TRANSITION]
)
_GLOBAL = [f"global_attention.linear_{p}.weight" for p in "qkv"] + [f"global_attention.linear_{p}.{t}" for p in "go" for t in _LINEAR]


@pytest.mark.parametrize("make", [evoformer_stack, extra_msa_stack], ids=["evoformer", "extra_msa"])
def test_openfold_state_dict_round_trip(make):
    stack = make(no_blocks=2).eval()
    openfold = to_openfold_state_dict(stack)
    block_keys = OPENFOLD_BLOCK_KEYS
    if isinstance(stack, ExtraMSAStack):
        block_keys = [k for k in block_keys if not k.startswith("msa_att_col.")]
        block_keys += [f"msa_att_col.{n}" for n in ["layer_norm_m.weight", "layer_norm_m.bias", *_GLOBAL]]
    expected = {f"blocks.{i}.{k}" for i in range(2) for k in block_keys}
    if isinstance(stack, EvoformerStack):
        expected |= {"linear.weight", "linear.bias"}
    assert set(openfold) == expected and len(openfold) == len(stack.state_dict())

    fresh = make(no_blocks=2).eval()  # other random weights
    load_openfold_state_dict(fresh, {k: v.clone() for k, v in openfold.items()})
    for (name, a), (_, b) in zip(fresh.state_dict().items(), stack.state_dict().items()):
        assert torch.equal(a, b), name
    m, z, msa_mask, pair_mask = inputs()
    for a, b in zip(fresh(m, z, msa_mask, pair_mask), stack(m, z, msa_mask, pair_mask)):
        assert torch.equal(a, b)

    with pytest.raises(ValueError, match="missing keys"):
        load_openfold_state_dict(fresh, {k: v for k, v in openfold.items() if "tri_mul_in" not in k})
    renamed = {k.replace("pair_stack.", ""): v for k, v in openfold.items()}
    with pytest.raises(ValueError, match="unexpected keys"):
        load_openfold_state_dict(fresh, renamed)


# --------------------------------------------------------------------------------------------
# bf16 autocast and torch.compile


def test_bf16_autocast_forward_backward():
    torch.manual_seed(0)
    stack = evoformer_stack(dtype=torch.float32, blocks_per_ckpt=1).train()
    m, z, msa_mask, pair_mask = inputs(dtype=torch.float32)
    with torch.no_grad():
        ref = stack.eval()(m, z, msa_mask, pair_mask)
    stack.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = stack.eval()(m, z, msa_mask, pair_mask)
        stack.train()
        loss = sum(o.float().square().mean() for o in stack(m, z, msa_mask, pair_mask))
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in stack.parameters())
    for a, b in zip(out, ref):
        assert torch.isfinite(a).all()
        # bf16 keeps 8 mantissa bits: compare relative to the output's scale.
        assert (a.float() - b).abs().max() <= 0.1 * b.abs().max()


def test_torch_compile_matches_eager():
    stack = evoformer_stack(no_blocks=1, dtype=torch.float32, blocks_per_ckpt=1, msa_dropout=0.0, pair_dropout=0.0).eval()
    m, z, msa_mask, pair_mask = inputs(dtype=torch.float32)
    compiled = torch.compile(stack, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for a, b in zip(compiled(m, z, msa_mask, pair_mask), stack(m, z, msa_mask, pair_mask)):
            torch.testing.assert_close(a, b)
    # Training: checkpointed blocks inside the compiled graph, gradients as in eager mode.
    stack.train()
    grads = []
    for fn in (stack, compiled):
        stack.zero_grad()
        sum(o.square().mean() for o in fn(m, z, msa_mask, pair_mask)).backward()
        grads.append([p.grad.clone() for p in stack.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
