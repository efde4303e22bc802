"""AlphaFold 3's stacks on a GPU: the Pairformer and the MSA module replayed from CUDA graphs
(``cuda_graphs``) equal the plain stacks bit for bit, training with checkpointing and dropout and
inference. The blocks on the fused ops against eager, and compiled with fullgraph=True, are in
test_modules_cuda.py (test_blocks_cutlass_match_eager, test_blocks_compile_fullgraph_on_cutlass)."""

from __future__ import annotations

import copy

import pytest
import torch

import evoformer_blocks as eb
from gpu import requires_sm80
from test_cuda_graphs import as_tuple, assert_bitwise, loss_of
from test_modules_cuda import randomize

pytestmark = requires_sm80

# Widths the fused kernels take (head widths multiples of 8); lengths that fill no tile.
PAIRFORMER = dict(c_s=48, c_z=32, c_hidden_pair_bias=16, no_heads_pair_bias=3, c_hidden_mul=24, c_hidden_pair_att=8,
                  no_heads_pair=2, transition_n=2, pair_dropout=0.25)
MSA_MODULE = dict(c_m=40, c_z=32, c_hidden_msa_att=8, c_hidden_opm=8, c_hidden_mul=24, c_hidden_pair_att=8,
                  no_heads_msa=4, no_heads_pair=2, transition_n=2, msa_dropout=0.15, pair_dropout=0.25)
N_MSA, N_TOKEN = 6, 21


def make_stack(cls, **kwargs):
    args = dict(PAIRFORMER if cls is eb.PairformerStack else MSA_MODULE, no_blocks=3)
    args.update(kwargs)
    return randomize(cls(**args)).to("cuda", torch.bfloat16)


def make_inputs(cls, seed, requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(1, N_TOKEN, N_TOKEN, 32, generator=gen)
    if cls is eb.PairformerStack:
        x = torch.randn(1, N_TOKEN, 48, generator=gen)
        x_mask = (torch.rand(1, N_TOKEN, generator=gen) > 0.1).float()
    else:
        x = torch.randn(1, N_MSA, N_TOKEN, 40, generator=gen)
        x_mask = (torch.rand(1, N_MSA, N_TOKEN, generator=gen) > 0.1).float()
    pair_mask = (torch.rand(1, N_TOKEN, N_TOKEN, generator=gen) > 0.1).float()
    x, z = (t.to("cuda", torch.bfloat16).requires_grad_(requires_grad) for t in (x, z))
    return x, z, x_mask.cuda(), pair_mask.cuda()


def training_step(stack, cls, seed):
    x, z, x_mask, pair_mask = make_inputs(cls, seed)
    stack.zero_grad(set_to_none=True)
    torch.manual_seed(1000 + seed)
    out = as_tuple(stack(x, z, x_mask, pair_mask))
    loss_of(out).backward()
    return [o.detach() for o in out] + [x.grad, z.grad] + [p.grad for p in stack.parameters()]


@pytest.mark.parametrize("cls", [eb.PairformerStack, eb.MSAModule])
@pytest.mark.parametrize("blocks_per_ckpt", [1, None], ids=["ckpt1", "nockpt"])
def test_training_steps_replay_in_cuda_graphs(cls, blocks_per_ckpt):
    """Training steps with dropout (the first plain, the second captured, then replays; fresh inputs
    every step) equal the plain stack's bit for bit."""
    plain = make_stack(cls, blocks_per_ckpt=blocks_per_ckpt).train()
    graphed = copy.deepcopy(plain)
    graphed.cuda_graphs = True
    for step in range(4):
        assert_bitwise(training_step(graphed, cls, step), training_step(plain, cls, step))
    assert graphed._graphs.replays >= 2


@pytest.mark.parametrize("cls", [eb.PairformerStack, eb.MSAModule])
def test_inference_replays_in_cuda_graphs(cls):
    plain = make_stack(cls, blocks_per_ckpt=1).eval()
    graphed = copy.deepcopy(plain)
    graphed.cuda_graphs = True
    with torch.no_grad():
        for step in range(4):
            inputs = make_inputs(cls, step, requires_grad=False)
            assert_bitwise(as_tuple(graphed(*inputs)), as_tuple(plain(*inputs)))
    assert graphed._graphs.replays >= 2
