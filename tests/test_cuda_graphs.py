"""The stacks' ``cuda_graphs`` switch: the setting, its fallbacks (CPU), and on a GPU the replayed
training steps and inference forwards against the plain stack, bit for bit, with checkpointing,
dropout, masks, autocast and gradient accumulation; the bounded signature cache; calls the graphs
cannot serve."""

from __future__ import annotations

import copy
import logging
import pickle

import pytest
import torch

from evoformer_blocks import EvoformerStack, ExtraMSAStack
from evoformer_blocks.config import get_config
from gpu import requires_sm80

# Widths the fused kernels take (head widths multiples of 8), every one distinct; lengths that fill
# no tile.
SMALL = dict(
    c_m=48, c_z=32, c_hidden_msa_att=16, c_hidden_opm=8, c_hidden_mul=24, c_hidden_pair_att=8,
    no_heads_msa=4, no_heads_pair=2, transition_n=2, msa_dropout=0.15, pair_dropout=0.25,
)
N_SEQ, N_RES = 6, 21


def make_stack(cls, no_blocks=3, **kwargs):
    args = dict(SMALL, no_blocks=no_blocks)
    if cls is EvoformerStack:
        args["c_s"] = 40
    args.update(kwargs)
    stack = cls(**args)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random weights: the zero-initialized output layers would hide everything
        for name, p in stack.named_parameters():
            scale = p.shape[-1] ** -0.5 if p.dim() == 2 else 0.2
            p.copy_(torch.randn(p.shape, generator=gen) * scale + float("layer_norm" in name and name.endswith("weight")))
    return stack


def on_gpu(test):
    for mark in requires_sm80:
        test = mark(test)
    return test


def make_inputs(seed, device="cpu", dtype=torch.float32, n_seq=N_SEQ, n_res=N_RES, requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(1, n_seq, n_res, SMALL["c_m"], generator=gen)
    z = torch.randn(1, n_res, n_res, SMALL["c_z"], generator=gen)
    msa_mask = (torch.rand(1, n_seq, n_res, generator=gen) > 0.1).float()
    pair_mask = (torch.rand(1, n_res, n_res, generator=gen) > 0.1).float()
    m, z = (t.to(device, dtype).requires_grad_(requires_grad) for t in (m, z))
    return m, z, msa_mask.to(device), pair_mask.to(device)


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def loss_of(out):
    return sum((o.float() * torch.linspace(-1, 1, o.shape[-1], device=o.device)).sum() for o in as_tuple(out))


# --------------------------------------------------------------------------------------------
# The setting (CPU)


@pytest.mark.parametrize("value, expected", [(True, 2), (False, 0), (None, 0), (0, 0), (1, 1), (5, 5)])
def test_setting_values(value, expected):
    stack = make_stack(EvoformerStack, no_blocks=1, cuda_graphs=value)
    assert stack.cuda_graphs == expected
    stack.cuda_graphs = 3
    assert stack.cuda_graphs == 3


@pytest.mark.parametrize("value", [-1, 1.5, "yes"])
def test_setting_rejects_bad_values(value):
    with pytest.raises(ValueError, match="`cuda_graphs` must be True, False or a non-negative int"):
        make_stack(ExtraMSAStack, no_blocks=1, cuda_graphs=value)


def test_setting_from_config_copy_and_pickle():
    cfg = get_config("small")
    stack = EvoformerStack.from_config(cfg, cuda_graphs=True)
    assert stack.cuda_graphs == 2
    for clone in (copy.deepcopy(stack), pickle.loads(pickle.dumps(stack))):
        assert clone.cuda_graphs == 2 and clone._graphs.stack is clone
    assert "_graphs" not in str(stack.state_dict().keys())


@pytest.mark.parametrize("cls", [EvoformerStack, ExtraMSAStack])
def test_cpu_inputs_run_the_plain_stack_and_say_why(cls, caplog):
    plain = make_stack(cls).train()
    graphed = copy.deepcopy(plain)
    graphed.cuda_graphs = True
    with caplog.at_level(logging.WARNING, logger="evoformer_blocks"):
        for seed in range(2):
            results = []
            for stack in (plain, graphed):
                inputs = make_inputs(seed)
                torch.manual_seed(seed)
                out = stack(*inputs)
                results.append([*as_tuple(out), *torch.autograd.grad(loss_of(out), inputs[:2])])
            for a, b in zip(*results):
                assert torch.equal(a, b)
    assert "CUDA graphs need CUDA tensors" in caplog.text
    assert caplog.text.count("CUDA graphs need CUDA tensors") == 1  # logged once


# --------------------------------------------------------------------------------------------
# On a GPU


def gpu_pair(cls, dtype=torch.bfloat16, **kwargs):
    plain = make_stack(cls, **kwargs).to("cuda", dtype)
    graphed = copy.deepcopy(plain)
    graphed.cuda_graphs = kwargs.get("cuda_graphs", True)
    return plain, graphed


def training_step(stack, seed, dtype, zero_grad=True, **input_kwargs):
    """Outputs, input gradients and parameter gradients of one step (dropout drawn from seed)."""
    m, z, msa_mask, pair_mask = make_inputs(seed, "cuda", dtype, **input_kwargs)
    if zero_grad:
        stack.zero_grad(set_to_none=True)
    torch.manual_seed(1000 + seed)
    out = as_tuple(stack(m, z, msa_mask, pair_mask))
    loss_of(out).backward()
    return [o.detach() for o in out] + [m.grad, z.grad] + [p.grad for p in stack.parameters()]


def assert_bitwise(a_list, b_list):
    assert len(a_list) == len(b_list)
    for i, (a, b) in enumerate(zip(a_list, b_list)):
        if a is None or b is None:
            assert a is None and b is None, f"item {i}: one gradient is None"
            continue
        assert torch.isfinite(a.float()).all(), f"item {i} is not finite"
        assert torch.equal(a, b), f"item {i} differs: max {(a.float() - b.float()).abs().max().item()}"


@pytest.mark.parametrize("cls", [EvoformerStack, ExtraMSAStack])
@pytest.mark.parametrize("blocks_per_ckpt", [1, None], ids=["ckpt1", "nockpt"])
@pytest.mark.parametrize("dropout", [False, True], ids=["nodropout", "dropout"])
@on_gpu
def test_training_steps_equal_the_plain_stack(cls, blocks_per_ckpt, dropout):
    """Every step of the graphed stack (the first plain, the second captured, then replays; fresh
    inputs and masks each step; gradients accumulated over two steps) equals the plain stack's bit
    for bit, with dropout too: the replays draw the plain stack's masks, and the backward graph's
    recomputation applies the forward's."""
    plain, graphed = gpu_pair(cls, blocks_per_ckpt=blocks_per_ckpt)
    plain.train(dropout)
    graphed.train(dropout)
    for step in range(5):
        zero = step % 2 == 0  # steps 1 and 3 accumulate onto the step before
        assert_bitwise(training_step(graphed, step, torch.bfloat16, zero), training_step(plain, step, torch.bfloat16, zero))
    assert graphed._graphs.replays >= 4
    if dropout:  # the masks act: another generator state gives other outputs
        a = training_step(graphed, 0, torch.bfloat16)
        torch.manual_seed(5)
        m, z, msa_mask, pair_mask = make_inputs(0, "cuda", torch.bfloat16)
        b = as_tuple(graphed(m, z, msa_mask, pair_mask))
        assert not torch.equal(a[0], b[0].detach())


@pytest.mark.parametrize("cls", [EvoformerStack, ExtraMSAStack])
@on_gpu
def test_inference_forwards_equal_the_plain_stack(cls):
    plain, graphed = gpu_pair(cls, blocks_per_ckpt=1)
    plain.eval()
    graphed.eval()
    with torch.no_grad():
        for step in range(4):
            inputs = make_inputs(step, "cuda", torch.bfloat16, requires_grad=False)
            assert_bitwise(as_tuple(graphed(*inputs)), as_tuple(plain(*inputs)))
            inputs = make_inputs(step, "cuda", torch.bfloat16, requires_grad=False)
            chunked = as_tuple(graphed(*inputs, chunk_size=4))
            assert_bitwise(chunked, as_tuple(plain(*inputs, chunk_size=4)))
    assert graphed._graphs.replays >= 4
    # The results are the caller's own tensors: the next replay leaves them as they were.
    with torch.no_grad():
        first = as_tuple(graphed(*make_inputs(8, "cuda", torch.bfloat16, requires_grad=False)))
        kept = [t.clone() for t in first]
        graphed(*make_inputs(9, "cuda", torch.bfloat16, requires_grad=False))
    assert_bitwise(first, kept)


@on_gpu
def test_autocast_training_equals_the_plain_stack():
    plain, graphed = gpu_pair(EvoformerStack, dtype=torch.float32, blocks_per_ckpt=1)
    for step in range(3):
        results = []
        for stack in (graphed, plain):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                results.append(training_step(stack, step, torch.float32))
        assert_bitwise(*results)
    assert graphed._graphs.replays >= 1


@on_gpu
def test_signature_cache_is_bounded_and_shapes_that_change_fall_back(caplog):
    plain, graphed = gpu_pair(ExtraMSAStack, blocks_per_ckpt=1, cuda_graphs=1)
    with caplog.at_level(logging.INFO, logger="evoformer_blocks"):
        for n_res in (21, 21, 21, 16, 16, 16, 21):
            assert_bitwise(training_step(graphed, n_res, torch.bfloat16, n_res=n_res),
                           training_step(plain, n_res, torch.bfloat16, n_res=n_res))
            assert len(graphed._graphs._captured) <= 1
        assert "dropped the least recently used" in caplog.text
        for n_res in range(22, 32):  # a new shape every call: the plain stack, said once
            assert_bitwise(training_step(graphed, n_res, torch.bfloat16, n_res=n_res),
                           training_step(plain, n_res, torch.bfloat16, n_res=n_res))
    assert "shapes that change on every call" in caplog.text


@on_gpu
def test_calls_the_graphs_cannot_serve(caplog):
    plain, graphed = gpu_pair(EvoformerStack, blocks_per_ckpt=1)
    for step in range(2):  # captured
        training_step(graphed, step, torch.bfloat16)
    # Two calls before a backward: the second runs the plain stack; both gradients are right.
    with caplog.at_level(logging.INFO, logger="evoformer_blocks"):
        grads = []
        for stack in (graphed, plain):
            stack.zero_grad(set_to_none=True)
            first, second = make_inputs(10, "cuda", torch.bfloat16), make_inputs(11, "cuda", torch.bfloat16)
            torch.manual_seed(3)
            loss = loss_of(stack(*first)) + loss_of(stack(*second))
            loss.backward()
            grads.append([first[0].grad, second[1].grad] + [p.grad for p in stack.parameters()])
        assert_bitwise(*grads)
    assert "still awaited its backward" in caplog.text
    # A call whose outputs were dropped without a backward frees the graphs for the next call.
    replays = graphed._graphs.replays
    graphed(*make_inputs(12, "cuda", torch.bfloat16))
    training_step(graphed, 13, torch.bfloat16)
    assert graphed._graphs.replays == replays + 2
    # A second backward through one replay raises.
    out = graphed(*make_inputs(14, "cuda", torch.bfloat16))
    loss = loss_of(out)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="ran a second time"):
        loss.backward()
    # Converting the stack drops its graphs.
    graphed.float()
    assert not graphed._graphs._captured


@on_gpu
def test_eager_backend_runs_the_plain_stack_and_says_why(caplog):
    plain, graphed = gpu_pair(ExtraMSAStack, no_blocks=1, backend="eager")
    with caplog.at_level(logging.WARNING, logger="evoformer_blocks"):
        for step in range(3):
            assert_bitwise(training_step(graphed, step, torch.bfloat16), training_step(plain, step, torch.bfloat16))
    assert graphed._graphs.replays == 0
    assert "the eager backend is selected" in caplog.text


@on_gpu
def test_capture_while_the_previous_steps_graph_is_alive(caplog):
    """A training loop that keeps the last step's loss (and with it that step's autograd graph and
    the parameters' gradient accumulators, made on the default stream) until the next forward, as
    most loops do: the capture still succeeds, under autocast with float32 weights and without
    checkpointing too. Outputs and input gradients equal the plain stack's bit for bit; parameter
    gradients to a bfloat16 rounding (in this configuration, float32 weights under autocast without
    checkpointing, one of them was seen one rounding apart on an H100)."""
    plain, graphed = gpu_pair(EvoformerStack, dtype=torch.float32, blocks_per_ckpt=None)
    results = {}
    with caplog.at_level(logging.INFO, logger="evoformer_blocks"):
        for name, stack in (("graphed", graphed), ("plain", plain)):
            loss, steps = None, []
            for step in range(4):
                m, z, msa_mask, pair_mask = make_inputs(step, "cuda", torch.bfloat16, n_seq=4, n_res=16)
                m, z = (t.detach().repeat(2, 1, 1, 1).requires_grad_(True) for t in (m, z))  # batch of 2
                msa_mask, pair_mask = msa_mask.repeat(2, 1, 1), pair_mask.repeat(2, 1, 1)
                stack.zero_grad(set_to_none=True)
                torch.manual_seed(step)
                with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                    out = stack(m, z, msa_mask, pair_mask)
                loss = loss_of(out)  # the previous step's loss lives until here
                loss.backward()
                steps.append([o.detach() for o in out] + [m.grad, z.grad] + [p.grad for p in stack.parameters()])
            results[name] = steps
    assert "capture failed" not in caplog.text
    assert graphed._graphs.replays >= 2
    n_out = len(as_tuple(out)) + 2
    for a, b in zip(results["graphed"], results["plain"]):
        assert_bitwise(a[:n_out], b[:n_out])
        for x, y in zip(a[n_out:], b[n_out:]):
            torch.testing.assert_close(x, y, rtol=2**-7, atol=2**-7 * y.abs().max().item())
