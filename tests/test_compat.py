"""Loading OpenFold-named state_dicts into our modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from evoformer_blocks import (
    MSAColumnAttention,
    MSAColumnGlobalAttention,
    MSARowAttentionWithPairBias,
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
    compat,
)
from evoformer_blocks.compat import (
    Converter,
    load_openfold_state_dict,
    openfold_key_map,
    register_converter,
    to_openfold_state_dict,
)

C_M, C_Z, C_HIDDEN, HEADS = 6, 4, 3, 2
F64 = torch.float64

# The parameter names of OpenFold's modules (openfold/model/msa.py, triangular_attention.py,
# primitives.py), written out by hand as an independent check of the converter table.
MHA = ["linear_q.weight", "linear_k.weight", "linear_v.weight", "linear_g.weight", "linear_g.bias",
       "linear_o.weight", "linear_o.bias"]  # fmt: skip
LN = ["weight", "bias"]
OPENFOLD_KEYS = {
    "msa_row": [f"layer_norm_m.{p}" for p in LN] + [f"layer_norm_z.{p}" for p in LN] + ["linear_z.weight"]
    + [f"mha.{p}" for p in MHA],
    "msa_column": [f"_msa_att.layer_norm_m.{p}" for p in LN] + [f"_msa_att.mha.{p}" for p in MHA],
    "triangle_start": [f"layer_norm.{p}" for p in LN] + ["linear.weight"] + [f"mha.{p}" for p in MHA],
    "triangle_end": [f"layer_norm.{p}" for p in LN] + ["linear.weight"] + [f"mha.{p}" for p in MHA],
    "msa_column_global": [f"layer_norm_m.{p}" for p in LN] + [f"global_attention.{p}" for p in MHA],
}
MAKE = {
    "msa_row": lambda: MSARowAttentionWithPairBias(C_M, C_Z, C_HIDDEN, HEADS),
    "msa_column": lambda: MSAColumnAttention(C_M, C_HIDDEN, HEADS),
    "triangle_start": lambda: TriangleAttentionStartingNode(C_Z, C_HIDDEN, HEADS),
    "triangle_end": lambda: TriangleAttentionEndingNode(C_Z, C_HIDDEN, HEADS),
    "msa_column_global": lambda: MSAColumnGlobalAttention(C_M, C_HIDDEN, HEADS),
}


def inputs(name):
    m = torch.randn(2, 3, 5, C_M, dtype=F64)
    z = torch.randn(2, 5, 5, C_Z, dtype=F64)
    if name == "msa_row":
        return (m, z, (torch.rand(2, 3, 5) > 0.3).to(F64))
    if name.startswith("triangle"):
        return (z, (torch.rand(2, 5, 5) > 0.3).to(F64))
    return (m, (torch.rand(2, 3, 5) > 0.3).to(F64))


def random_module(name):
    module = MAKE[name]().to(F64)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
    return module


def random_openfold_state_dict(name):
    return to_openfold_state_dict(random_module(name))


@pytest.mark.parametrize("name", list(MAKE))
def test_openfold_names(name):
    assert sorted(openfold_key_map(MAKE[name]())) == sorted(OPENFOLD_KEYS[name])


@pytest.mark.parametrize("name", list(MAKE))
def test_round_trip_gives_the_same_outputs(name):
    source = random_module(name)
    state_dict = to_openfold_state_dict(source)
    target = MAKE[name]().to(F64)
    x = inputs(name)
    assert not torch.allclose(target(*x), source(*x))
    result = load_openfold_state_dict(target, state_dict)
    assert result.missing_keys == [] and result.unexpected_keys == []
    torch.testing.assert_close(target(*x), source(*x), rtol=0, atol=0)
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key


@pytest.mark.parametrize("name", list(MAKE))
def test_each_openfold_tensor_lands_in_its_place(name):
    # Independent of the reverse mapping: fill an OpenFold-named dict by hand and look each tensor up.
    module = MAKE[name]()
    shapes = {k: v.shape for k, v in to_openfold_state_dict(module).items()}
    state_dict = {k: torch.full(shape, float(i)) for i, (k, shape) in enumerate(sorted(shapes.items()))}
    load_openfold_state_dict(module, state_dict)
    renamed = {
        "_msa_att.": "", "mha.": "", "global_attention.": "", "layer_norm.": "layer_norm_z.", "linear.": "linear_z.",
    }  # fmt: skip
    for key, value in state_dict.items():
        ours = key
        for old, new in renamed.items():
            if ours.startswith(old):
                ours = new + ours[len(old):]
        assert torch.equal(module.get_parameter(ours), value), (key, ours)


def test_load_casts_to_the_module_dtype():
    state_dict = random_openfold_state_dict("triangle_end")
    module = MAKE["triangle_end"]()  # float32
    load_openfold_state_dict(module, state_dict)
    assert module.linear_z.weight.dtype == torch.float32
    torch.testing.assert_close(module.linear_z.weight, state_dict["linear.weight"].float())


def test_missing_unexpected_and_misshaped_keys_raise():
    module = MAKE["msa_row"]()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    good = random_openfold_state_dict("msa_row")

    missing = {k: v for k, v in good.items() if k != "mha.linear_g.bias"}
    with pytest.raises(ValueError, match=r"(?s)missing keys:.*mha\.linear_g\.bias"):
        load_openfold_state_dict(module, missing)

    unexpected = {**good, "mha.linear_x.weight": torch.zeros(3), "linear_q.weight": good["mha.linear_q.weight"]}
    with pytest.raises(ValueError, match=r"(?s)unexpected keys:.*linear_q\.weight.*mha\.linear_x\.weight"):
        load_openfold_state_dict(module, unexpected)

    misshaped = {**good, "linear_z.weight": torch.zeros(HEADS + 1, C_Z)}
    with pytest.raises(ValueError, match=r"(?s)shape mismatches:.*linear_z\.weight.*\[2, 4\].*\(3, 4\)"):
        load_openfold_state_dict(module, misshaped)

    everything = {**missing, "extra": torch.zeros(1), "linear_z.weight": torch.zeros(1)}
    with pytest.raises(ValueError) as info:
        load_openfold_state_dict(module, everything)
    message = str(info.value)
    assert "missing keys" in message and "unexpected keys" in message and "shape mismatches" in message
    assert "MSARowAttentionWithPairBias" in message

    # Nothing was loaded by the failed calls, and the caller's dict is untouched.
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert "mha.linear_g.bias" in good and len(good) == len(OPENFOLD_KEYS["msa_row"])


def test_non_strict_skips_missing_and_unexpected_but_not_shapes():
    module = MAKE["msa_column"]()
    good = random_openfold_state_dict("msa_column")
    partial = {k: v for k, v in good.items() if not k.startswith("_msa_att.layer_norm_m")}
    partial["something.else"] = torch.zeros(2)
    result = load_openfold_state_dict(module, partial, strict=False)
    assert result.missing_keys == ["_msa_att.layer_norm_m.bias", "_msa_att.layer_norm_m.weight"]
    assert result.unexpected_keys == ["something.else"]
    assert torch.equal(module.linear_q.weight, good["_msa_att.mha.linear_q.weight"].float())
    assert torch.equal(module.layer_norm_m.weight, torch.ones(C_M))  # left as it was
    with pytest.raises(ValueError, match="shape mismatches"):
        load_openfold_state_dict(module, {"_msa_att.mha.linear_q.weight": torch.zeros(1, 1)}, strict=False)


def test_bad_arguments():
    with pytest.raises(ValueError, match="`state_dict`"):
        load_openfold_state_dict(MAKE["msa_row"](), [("linear_z.weight", torch.zeros(2, 4))])
    with pytest.raises(ValueError, match="`module`"):
        openfold_key_map("not a module")
    with pytest.raises(ValueError, match="no OpenFold converter for Bilinear"):
        openfold_key_map(nn.Bilinear(2, 2, 2))
    with pytest.raises(ValueError, match="`cls`"):
        register_converter(int, Converter("x"))
    with pytest.raises(ValueError, match="`converter`"):
        register_converter(nn.Module, {"a": "b"})


class ToyStack(nn.Module):
    """Stands in for a future Evoformer stack: a list of blocks, each with two attention modules."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(ToyBlock() for _ in range(2))
        self.final_norm = nn.LayerNorm(C_Z)
        self.scale = nn.Parameter(torch.ones(()))


class ToyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.row = MSARowAttentionWithPairBias(C_M, C_Z, C_HIDDEN, HEADS)
        self.tri = TriangleAttentionEndingNode(C_Z, C_HIDDEN, HEADS)


@pytest.fixture
def toy_converters(monkeypatch):
    monkeypatch.setitem(compat.CONVERTERS, ToyBlock, Converter("Block", children={"msa_att_row": "row", "core.tri_att_end": "tri"}))
    monkeypatch.setitem(
        compat.CONVERTERS,
        ToyStack,
        Converter("Stack", children={"blocks.*": "blocks.*", "layer_norm": "final_norm"}, tensors={"gamma": "scale"}),
    )


def test_composite_converters(toy_converters):
    stack = ToyStack().to(F64)
    with torch.no_grad():
        for p in stack.parameters():
            p.copy_(torch.randn_like(p))
    mapping = openfold_key_map(stack)
    assert mapping["blocks.1.msa_att_row.mha.linear_q.weight"] == "blocks.1.row.linear_q.weight"
    assert mapping["blocks.0.core.tri_att_end.layer_norm.bias"] == "blocks.0.tri.layer_norm_z.bias"
    assert mapping["layer_norm.weight"] == "final_norm.weight" and mapping["gamma"] == "scale"
    assert len(mapping) == len(stack.state_dict())
    fresh = ToyStack().to(F64)
    load_openfold_state_dict(fresh, to_openfold_state_dict(stack))
    for key, value in stack.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_converter_that_misses_a_tensor_is_refused(monkeypatch, toy_converters):
    monkeypatch.setitem(compat.CONVERTERS, ToyStack, Converter("Stack", children={"blocks.*": "blocks.*"}))
    with pytest.raises(ValueError, match=r"not mapped \['final_norm.bias', 'final_norm.weight', 'scale'\]"):
        openfold_key_map(ToyStack())
    monkeypatch.setitem(compat.CONVERTERS, ToyStack, Converter("Stack", children={"blocks": "blocks.*"}))
    with pytest.raises(ValueError, match=r"'\.\*' on both sides"):
        openfold_key_map(ToyStack())
    monkeypatch.setitem(compat.CONVERTERS, ToyStack, Converter("Stack", children={"x": "nothing_here"}))
    with pytest.raises(ValueError, match="no submodule 'nothing_here'"):
        openfold_key_map(ToyStack())
