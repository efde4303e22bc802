"""The parameters of stacked projections kept back to back in one buffer (primitives.pack_rows,
StackedParameters): the modules pack them at construction and again after dtype and device moves and
state-dict loads, with parameter names, objects, values and state dicts unchanged, and compute what
an unpacked copy computes. (The nodes reading them as views: test_module_nodes_cuda.py.)"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import evoformer_blocks as eb
from evoformer_blocks.pairformer import AttentionPairBias
from evoformer_blocks.primitives import back_to_back, pack_rows, pack_stacked, separate_storages

MODULES = {
    "msa_row": lambda: eb.MSARowAttentionWithPairBias(8, 4, 3, 2),
    "msa_column": lambda: eb.MSAColumnAttention(8, 3, 2),
    "triangle_start": lambda: eb.TriangleAttentionStartingNode(4, 3, 2),
    "attention_pair_bias": lambda: AttentionPairBias(6, 4, 3, 2),
    "triangle_out": lambda: eb.TriangleMultiplicationOutgoing(4, 3),
    "triangle_in_no_bias": lambda: eb.TriangleMultiplicationIncoming(4, 3, bias=False),
    "opm": lambda: eb.OuterProductMean(8, 4, 3),
}
# groups each module packs (a group with an absent bias is left alone)
PACKED_GROUPS = {"msa_row": 1, "msa_column": 1, "triangle_start": 1, "attention_pair_bias": 1,
                 "triangle_out": 2, "triangle_in_no_bias": 1, "opm": 2}


def groups(module) -> list:
    return [g for g in module._stacked_groups() if all(p is not None for p in g)]


def randomized(module):
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return module


def unpacked(module):
    """A copy whose stacked parameters each have a storage of their own."""
    copy_ = copy.deepcopy(module)
    separate_storages(copy_)
    assert not any(back_to_back(g) for g in groups(copy_))
    return copy_


def inputs(name: str, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    m, z, s = rand(5, 7, 8), rand(7, 7, 4), rand(7, 6)
    return {"msa_row": (m, z), "msa_column": (m,), "triangle_start": (z,), "attention_pair_bias": (s, z),
            "triangle_out": (z,), "triangle_in_no_bias": (z,), "opm": (m,)}[name]


def assert_packed(module, name: str) -> None:
    packed = groups(module)
    assert len(packed) == PACKED_GROUPS[name]
    for group in packed:
        assert back_to_back(group)
        stack = torch.cat([p.detach() for p in group])
        view = group[0].detach().new_empty(0).set_(group[0].untyped_storage(), group[0].storage_offset(),
                                                   stack.shape)
        assert torch.equal(view, stack)


@pytest.mark.parametrize("name", list(MODULES))
def test_packed_at_construction(name):
    module = MODULES[name]()
    assert_packed(module, name)
    assert all(isinstance(p, torch.nn.Parameter) for p in module.parameters())


@pytest.mark.parametrize("name", list(MODULES))
def test_results_and_gradients_equal_an_unpacked_copy(name):
    packed = randomized(MODULES[name]())
    other = unpacked(packed)
    outs, grads = [], []
    for module in (packed, other):
        args = [a.clone().requires_grad_(True) for a in inputs(name)]
        out = module(*args)
        out.float().square().sum().backward()
        outs.append(out)
        grads.append([a.grad for a in args] + [p.grad for p in module.parameters()])
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*grads):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("move", ["float64", "bfloat16", "half"])
def test_packing_survives_moves(name, move):
    module = randomized(MODULES[name]())
    before = {k: v.clone() for k, v in module.state_dict().items()}
    ids = [id(p) for p in module.parameters()]
    module = module.to(torch.float64) if move == "float64" else module.bfloat16() if move == "bfloat16" else module.half()
    assert [id(p) for p in module.parameters()] == ids  # (an optimizer made before keeps its parameters)
    assert_packed(module, name)
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key].to(value.dtype))


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_keeps_the_packing(name, assign):
    module = MODULES[name]()
    source = randomized(MODULES[name]())
    state = {k: v.clone() for k, v in source.state_dict().items()}  # (each its own storage)
    module.load_state_dict(state, assign=assign)
    assert_packed(module, name)
    assert list(module.state_dict()) == list(source.state_dict())
    for key, value in module.state_dict().items():
        assert torch.equal(value, state[key])


@pytest.mark.parametrize("name", ["msa_row", "triangle_out", "opm"])
def test_deepcopy_and_pickle_keep_the_packing(name):
    module = randomized(MODULES[name]())
    twin = copy.deepcopy(module)
    assert_packed(twin, name)
    first, twin_first = groups(module)[0][0], groups(twin)[0][0]
    assert twin_first.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert_packed(loaded, name)
    for (key, a), (_, b) in zip(module.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), key


def test_a_module_restored_without_the_load_hook_gets_it():
    # (a module pickled before it had the hook: restoring it packs it and registers the hook, so a
    # later load with assign=True packs again)
    module = MODULES["triangle_out"]()
    state = dict(module.__dict__)
    state["_load_state_dict_post_hooks"] = type(state["_load_state_dict_post_hooks"])()
    restored = type(module).__new__(type(module))
    restored.__setstate__(state)
    separate_storages(restored)
    restored.load_state_dict({k: v.clone() for k, v in module.state_dict().items()}, assign=True)
    assert_packed(restored, "triangle_out")


def test_separate_storages_and_pack_stacked_over_a_block():
    block = eb.EvoformerBlock(8, 4, c_hidden_msa_att=3, c_hidden_opm=2, c_hidden_mul=3, c_hidden_pair_att=3,
                              no_heads_msa=2, no_heads_pair=2, transition_n=2, msa_dropout=0.0, pair_dropout=0.0,
                              inf=1e9, eps_opm=1e-3)
    stacked = [g for mod in block.modules() if hasattr(mod, "_stacked_groups") for g in groups(mod)]
    assert len(stacked) == 4 + 2 + 2 * 2  # four attentions; the outer product mean; two triangle multiplications
    values = [torch.cat([p.detach() for p in g]) for g in stacked]
    assert all(back_to_back(g) for g in stacked)
    separate_storages(block)
    assert not any(back_to_back(g) for g in stacked)
    pack_stacked(block)
    assert all(back_to_back(g) for g in stacked)
    assert all(torch.equal(torch.cat([p.detach() for p in g]), v) for g, v in zip(stacked, values))


def test_pack_rows_leaves_what_it_cannot_stack():
    a, b = torch.randn(3, 4), torch.randn(2, 4)
    assert pack_rows([a, b]) and back_to_back([a, b])
    assert not pack_rows([a, None])
    c = torch.randn(2, 5)
    storage = c.untyped_storage().data_ptr()
    assert not pack_rows([a, c])  # (other trailing sizes)
    assert c.untyped_storage().data_ptr() == storage
    d = torch.randn(2, 4, dtype=torch.float64)
    assert not pack_rows([a, d])  # (another dtype)
    assert not back_to_back([b, a])  # (order matters)
