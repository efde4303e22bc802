"""AF2-Multimer's options of the stacks (OpenFold's ``opm_first``, ``no_column_attention``,
``fuse_projection_weights``), their constructor's argument order, ``from_config`` of OpenFold config
sections and the conversion of OpenFold Multimer weights (CPU, float64). The blocks with these
options against Algorithm 6 as written are in test_evoformer.py (test_block_is_algorithm_6)."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from evoformer_blocks import (
    EvoformerBlock,
    EvoformerStack,
    ExtraMSAStack,
    FusedTriangleMultiplicationIncoming,
    FusedTriangleMultiplicationOutgoing,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)
from evoformer_blocks.compat import load_openfold_state_dict, to_openfold_state_dict
from test_evoformer import OPENFOLD_BLOCK_KEYS, TINY, inputs, randomize_

F64 = torch.float64


@pytest.mark.parametrize("cls", [FusedTriangleMultiplicationOutgoing, FusedTriangleMultiplicationIncoming])
def test_fused_triangle_multiplication_is_openfolds_form(cls):
    """The fused projections as OpenFold's FusedTriangleMultiplicativeUpdate reads them: one
    projection and one gate of width 2 c_hidden, a = the first c_hidden channels, b = the rest."""
    c = 3
    mod = randomize_(cls(c_z=5, c_hidden=c)).to(F64)
    _, z, _, pair_mask = inputs(batch=(2,), n_res=6)
    lin = lambda layer, t: t @ layer.weight.T + layer.bias  # noqa: E731
    x = torch.nn.functional.layer_norm(z, (5,), mod.layer_norm_in.weight, mod.layer_norm_in.bias)
    ab = pair_mask[..., None] * torch.sigmoid(lin(mod.linear_ab_g, x)) * lin(mod.linear_ab_p, x)
    a, b = ab[..., :c], ab[..., c:]
    p = torch.zeros(2, 6, 6, c, dtype=F64)
    for i, j, k in itertools.product(range(6), repeat=3):
        if cls is FusedTriangleMultiplicationOutgoing:
            p[:, i, j] += a[:, i, k] * b[:, j, k]
        else:
            p[:, i, j] += a[:, k, i] * b[:, k, j]
    p = torch.nn.functional.layer_norm(p, (c,), mod.layer_norm_out.weight, mod.layer_norm_out.bias)
    expected = torch.sigmoid(lin(mod.linear_g, x)) * lin(mod.linear_z, p)
    torch.testing.assert_close(mod(z, pair_mask), expected)

    # the four-projection module with the fused weights split is the same function
    plain_cls = TriangleMultiplicationOutgoing if cls is FusedTriangleMultiplicationOutgoing else TriangleMultiplicationIncoming
    plain = plain_cls(c_z=5, c_hidden=c).to(F64)
    state = {k: v for k, v in mod.state_dict().items() if "linear_ab" not in k}
    for half, name in enumerate("ab"):
        for kind in "pg":
            for t in ("weight", "bias"):
                state[f"linear_{name}_{kind}.{t}"] = getattr(mod, f"linear_ab_{kind}").get_parameter(t)[half * c : (half + 1) * c]
    plain.load_state_dict(state)
    torch.testing.assert_close(plain(z, pair_mask), expected)


# OpenFold's config sections (openfold/config.py, model.evoformer_stack and
# model.extra_msa.extra_msa_stack), with TINY's widths, as a user passes them
OPENFOLD_EVOFORMER_SECTION = dict(
    TINY, c_s=7, no_blocks=2, no_column_attention=False, opm_first=True, fuse_projection_weights=True,
    blocks_per_ckpt=None, clear_cache_between_blocks=False, tune_chunk_size=True, inf=1e9, eps=1e-10,
)
OPENFOLD_EXTRA_MSA_SECTION = dict(
    TINY, no_blocks=1, opm_first=True, fuse_projection_weights=True, clear_cache_between_blocks=False,
    tune_chunk_size=True, inf=1e9, eps=1e-10, ckpt=True,
)


def test_from_config_takes_openfold_sections(caplog):
    with caplog.at_level(logging.INFO, logger="evoformer_blocks"):
        evo = EvoformerStack.from_config(OPENFOLD_EVOFORMER_SECTION, backend="eager")
    assert "ignored the OpenFold keys ['clear_cache_between_blocks', 'eps', 'tune_chunk_size']" in caplog.text
    block = evo.blocks[0]
    assert block.opm_first and isinstance(block.tri_mul_in, FusedTriangleMultiplicationIncoming)
    assert block.msa_att_col is not None and evo.blocks_per_ckpt is None
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="evoformer_blocks"):
        extra = ExtraMSAStack.from_config({"extra_msa_stack": OPENFOLD_EXTRA_MSA_SECTION})
    assert "ignored the OpenFold keys ['clear_cache_between_blocks', 'tune_chunk_size']" in caplog.text
    assert extra.blocks_per_ckpt == 1 and extra.blocks[0].msa_att_col.eps == 1e-10  # ckpt=True
    assert extra.blocks[0].opm_first
    assert ExtraMSAStack.from_config(dict(OPENFOLD_EXTRA_MSA_SECTION, ckpt=False)).blocks_per_ckpt is None
    assert ExtraMSAStack.from_config(OPENFOLD_EXTRA_MSA_SECTION, blocks_per_ckpt=2).blocks_per_ckpt == 2
    with pytest.raises(ValueError, match="`ckpt` must be a bool"):
        ExtraMSAStack.from_config(dict(OPENFOLD_EXTRA_MSA_SECTION, ckpt="yes"))
    with pytest.raises(ValueError, match=r"unknown keys \['use_flash'\]"):  # not an OpenFold section key
        EvoformerStack.from_config(dict(OPENFOLD_EVOFORMER_SECTION, use_flash=True))


def test_constructor_takes_openfolds_argument_order():
    """OpenFold's EvoformerStack(c_m, c_z, c_hidden_msa_att, c_hidden_opm, c_hidden_mul,
    c_hidden_pair_att, c_s, no_heads_msa, no_heads_pair, no_blocks, transition_n, msa_dropout,
    pair_dropout, no_column_attention, opm_first, fuse_projection_weights, blocks_per_ckpt, inf, ...)
    and ExtraMSAStack(..., no_blocks, transition_n, msa_dropout, pair_dropout, opm_first,
    fuse_projection_weights, inf, eps, ...), positionally."""
    evo = EvoformerStack(6, 5, 3, 2, 4, 3, 7, 2, 2, 1, 2, 0.1, 0.2, True, True, True, 1, 1e4)
    block = evo.blocks[0]
    assert evo.c_s == 7 and evo.linear.out_features == 7 and len(evo.blocks) == 1 and evo.blocks_per_ckpt == 1
    assert block.msa_att_col is None and block.opm_first and isinstance(block.tri_mul_out, FusedTriangleMultiplicationOutgoing)
    assert block.msa_att_row.no_heads == 2 and block.tri_att_end.c_hidden == 3 and block.tri_mul_in.c_hidden == 4
    assert block.msa_dropout_row.p == 0.1 and block.pair_dropout_col.p == 0.2 and block.tri_att_start.inf == 1e4
    extra = ExtraMSAStack(6, 5, 3, 2, 4, 3, 2, 2, 1, 2, 0.1, 0.2, True, False, 1e4, 1e-6)
    assert extra.blocks[0].opm_first and extra.blocks[0].msa_att_col.eps == 1e-6
    assert isinstance(extra.blocks[0].tri_mul_out, TriangleMultiplicationOutgoing)
    with pytest.raises(TypeError):  # OpenFold's next positional argument (eps) has no place here
        EvoformerStack(6, 5, 3, 2, 4, 3, 7, 2, 2, 1, 2, 0.1, 0.2, True, True, True, 1, 1e4, 1e-10)


@pytest.mark.parametrize("name, value", [("opm_first", 1), ("fuse_projection_weights", "yes"),
                                         ("no_column_attention", None)])
def test_flags_must_be_bools(name, value):
    with pytest.raises(ValueError, match=f"`{name}` must be a bool"):
        EvoformerBlock(**TINY, **{name: value})


def test_multimer_state_dict_round_trip():
    """OpenFold's Multimer names: each triangle multiplication's linear_ab_p and linear_ab_g, and no
    column attention where the stack has none."""
    stack = randomize_(EvoformerStack(**TINY, c_s=7, no_blocks=2, opm_first=True, fuse_projection_weights=True,
                                      no_column_attention=True, backend="eager")).to(F64).eval()
    openfold = to_openfold_state_dict(stack)
    fused = [f"{layer}.{t}" for layer in ("linear_ab_p", "linear_ab_g") for t in ("weight", "bias")]
    block_keys = [k for k in OPENFOLD_BLOCK_KEYS if not k.startswith("msa_att_col.")
                  and not any(f".linear_{p}." in k and "tri_mul" in k for p in ("a_p", "a_g", "b_p", "b_g"))]
    block_keys += [f"pair_stack.{mod}.{n}" for mod in ("tri_mul_out", "tri_mul_in") for n in fused]
    expected = {f"blocks.{i}.{k}" for i in range(2) for k in block_keys} | {"linear.weight", "linear.bias"}
    assert set(openfold) == expected and len(openfold) == len(stack.state_dict())
    fresh = randomize_(EvoformerStack(**TINY, c_s=7, no_blocks=2, opm_first=True, fuse_projection_weights=True,
                                      no_column_attention=True, backend="eager")).to(F64).eval()
    load_openfold_state_dict(fresh, {k: v.clone() for k, v in openfold.items()})
    m, z, msa_mask, pair_mask = inputs()
    for a, b in zip(fresh(m, z, msa_mask, pair_mask), stack(m, z, msa_mask, pair_mask)):
        assert torch.equal(a, b)
    unfused = {k.replace("linear_ab_p", "linear_a_p"): v for k, v in openfold.items()}
    with pytest.raises(ValueError, match="linear_ab_p"):
        load_openfold_state_dict(fresh, unfused)
