"""OpenFold3's AF3 modules against ours with its weights loaded: its PairFormerStack and
MSAModuleStack (openfold3 0.5.0) with every parameter random, converted by
evoformer_blocks.compat_af3, give the same outputs on the same inputs (float64, CPU). Marked
``reference`` and skipped where openfold3 is not installed (CI does not install it: it pulls many
packages; see README for the separate environment this runs in). The key names are checked without
OpenFold3 too."""

from __future__ import annotations

import pytest
import torch

from evoformer_blocks import MSAModule, PairformerStack
from evoformer_blocks.compat_af3 import load_openfold3_state_dict, openfold3_options, to_openfold3_state_dict
from test_af3 import MSA_MODULE, PAIRFORMER, msa_inputs, single_inputs

F64 = torch.float64


def random_(module):
    """Every parameter random (OpenFold3 zero-initialises its output layers)."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = p.shape[-1] ** -0.5 if p.dim() == 2 else 0.3
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale + float("layer_norm" in name and name.endswith("weight")))
    return module


def test_openfold3_names_without_openfold3():
    pairformer = PairformerStack(**PAIRFORMER, no_blocks=1, **openfold3_options(PairformerStack))
    keys = set(to_openfold3_state_dict(pairformer))
    assert {"blocks.0.pair_stack.tri_att_end.layer_norm.weight", "blocks.0.pair_stack.tri_att_end.mha.linear_g.weight",
            "blocks.0.attn_pair_bias.layer_norm_a.bias", "blocks.0.attn_pair_bias.mha.linear_q.bias",
            "blocks.0.single_transition.swiglu.linear_b.weight", "blocks.0.pair_stack.tri_mul_in.linear_b_g.weight"} <= keys
    module = MSAModule(**MSA_MODULE, no_blocks=2, **openfold3_options(MSAModule))
    keys = set(to_openfold3_state_dict(module))
    assert "blocks.0.msa_att_row.linear_v.weight" in keys and "blocks.1.msa_att_row.linear_v.weight" not in keys
    assert "blocks.1.outer_product_mean.linear_out.bias" in keys and len(keys) == len(module.state_dict())


def converted(theirs_cls, ours_cls, args: dict, **their_args):
    """OpenFold3's module with random weights and ours in OpenFold3's form with them, float64, eval."""
    theirs = random_(theirs_cls(**args, **their_args).to(F64)).eval()
    ours = ours_cls(**args, **openfold3_options(ours_cls), backend="eager").to(F64).eval()
    load_openfold3_state_dict(ours, theirs.state_dict())
    return theirs, ours


COMMON = dict(transition_type="swiglu", fuse_projection_weights=False, blocks_per_ckpt=None, inf=1e9)


@pytest.mark.reference
def test_pairformer_matches_openfold3():
    pairformer_module = pytest.importorskip("openfold3.core.model.latent.pairformer")
    args = dict(PAIRFORMER, no_blocks=2)
    theirs, ours = converted(pairformer_module.PairFormerStack, PairformerStack, args, **COMMON)
    s, z, single_mask, pair_mask = single_inputs()
    with torch.no_grad():
        expected = theirs(s, z, single_mask, pair_mask)
        got = ours(s, z, single_mask, pair_mask)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)
    # the supplement's ending-node bias (the default) computes something else with these weights
    default = PairformerStack(**args, backend="eager").to(F64).eval()
    load_openfold3_state_dict(default, theirs.state_dict())
    with torch.no_grad():
        assert not torch.allclose(default(s, z, single_mask, pair_mask)[1], expected[1], rtol=1e-3, atol=1e-3)


@pytest.mark.reference
def test_msa_module_matches_openfold3():
    msa_module = pytest.importorskip("openfold3.core.model.latent.msa_module")
    theirs, ours = converted(msa_module.MSAModuleStack, MSAModule, dict(MSA_MODULE, no_blocks=2), **COMMON,
                             opm_first=True, eps=1e-3)
    m, z, msa_mask, pair_mask = msa_inputs()
    with torch.no_grad():
        expected = theirs(m, z, msa_mask, pair_mask)
        got = ours(m, z, msa_mask, pair_mask)
    expected = expected[1] if isinstance(expected, tuple) else expected
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
