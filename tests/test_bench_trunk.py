"""benchmarks/bench_trunk.py and its peer trunks (benchmarks/trunk_peer.py) on the CPU, where
cuEquivariance cannot run: its three fused ops are replaced by reference functions written from
their documented semantics (cuequivariance_torch 0.13), with its signatures. The peer's Pairformer
block on the weights of the library's PairformerBlock computes the same function; the trunk steps of
both trunks (ours and the peer, eager) run end to end at tiny sizes, every gradient reached; and
--baseline's pairing of this checkout's stacks with a revision's gives the same gradients bit for bit."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from evoformer_blocks import PairformerBlock
from test_evoformer import randomize_

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_trunk  # noqa: E402
import trunk_peer  # noqa: E402


# --------------------------------------------------------------------------------------------
# cuEquivariance's ops as documented (signatures of cuequivariance_torch 0.13)


def triangle_attention(q, k, v, bias, mask=None, scale=None, return_aux=False, *, kv_lengths=None):
    """q, k, v [B, N, H, L, D]; bias [B, 1, H, L, L]; mask [B, N, 1, 1, L] (True = valid): softmax
    over the keys of ``scale q.k + bias``, a masked key's logit lowered by 1e9."""
    assert not return_aux and kv_lengths is None
    assert bias.shape == (q.shape[0], 1, q.shape[2], q.shape[3], k.shape[3])
    assert mask is None or mask.shape == (q.shape[0], q.shape[1], 1, 1, k.shape[3])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = (q * scale) @ k.transpose(-1, -2) + bias.to(q.dtype)
    if mask is not None:
        logits = logits - 1e9 * (~mask.bool()).to(logits.dtype)
    return torch.softmax(logits, dim=-1) @ v


def triangle_multiplicative_update(
    x, direction="outgoing", mask=None, norm_in_weight=None, norm_in_bias=None, p_in_weight=None, p_in_bias=None,
    g_in_weight=None, g_in_bias=None, norm_out_weight=None, norm_out_bias=None, p_out_weight=None, p_out_bias=None,
    g_out_weight=None, g_out_bias=None, eps=1e-5, precision=None,
):
    """x [B, N, N, C]; p_in/g_in [2D, C] with rows [a; b]; mask [B, N, N] on the gated a and b;
    outgoing: p[i, j] = sum_k a[i, k] b[j, k], incoming: sum_k a[k, i] b[k, j]; the output
    ``p_out(LayerNorm(p)) * sigmoid(g_out(x_in))``."""
    x_in = F.layer_norm(x, x.shape[-1:], norm_in_weight, norm_in_bias, eps)
    ab = F.linear(x_in, p_in_weight, p_in_bias) * torch.sigmoid(F.linear(x_in, g_in_weight, g_in_bias))
    if mask is not None:
        ab = ab * mask[..., None].to(ab.dtype)
    a, b = ab.chunk(2, dim=-1)
    equation = {"outgoing": "bikc,bjkc->bijc", "incoming": "bkic,bkjc->bijc"}[direction]
    p = F.layer_norm(torch.einsum(equation, a, b), a.shape[-1:], norm_out_weight, norm_out_bias, eps)
    return F.linear(p, p_out_weight, p_out_bias) * torch.sigmoid(F.linear(x_in, g_out_weight, g_out_bias))


def attention_pair_bias(
    single_repr, pair_repr, mask, num_heads, w_ln_a, b_ln_a, w_proj_q, b_proj_q, w_proj_k, w_proj_v, w_proj_g,
    w_proj_o, w_proj_z=None, b_proj_o=None, b_proj_z=None, w_ln_z=None, b_ln_z=None, inf=1e6, eps=1e-5,
    attn_scale=None, return_z_proj=False, is_cached_z_proj=False, *, b_proj_k=None, b_proj_v=None, w_ln_q=None,
    b_ln_q=None, w_ln_k=None, b_ln_k=None, b_proj_g=None, norm_kind="layer_norm",
):
    """single_repr [B, N, D], pair_repr [B, N, N, D_z], mask [B, N] (1 = valid): LayerNorm of both,
    q/k/v/gate from the normalised single, bias ``Linear(LayerNorm(z))`` per head plus ``-inf`` at
    masked keys, softmax, ``w_proj_o(sigmoid(g) * o)``; returns (output, None)."""
    assert not return_z_proj and not is_cached_z_proj and norm_kind == "layer_norm"
    batch, n, _ = single_repr.shape
    a = F.layer_norm(single_repr, single_repr.shape[-1:], w_ln_a, b_ln_a, eps)

    def heads(weight, bias):
        return F.linear(a, weight, bias).unflatten(-1, (num_heads, -1)).transpose(1, 2)  # [B, H, N, DH]

    q, k, v = heads(w_proj_q, b_proj_q), heads(w_proj_k, b_proj_k), heads(w_proj_v, b_proj_v)
    z = F.layer_norm(pair_repr, pair_repr.shape[-1:], w_ln_z, b_ln_z, eps)
    bias = F.linear(z, w_proj_z, b_proj_z).permute(0, 3, 1, 2)  # [B, H, N, N]
    if mask is not None:
        bias = bias + (1.0 - mask[:, None, None, :].to(bias.dtype)) * -inf
    scale = q.shape[-1] ** -0.5 if attn_scale is None else attn_scale
    o = torch.softmax(q @ k.transpose(-1, -2) * scale + bias, dim=-1) @ v  # [B, H, N, DH]
    o = o.transpose(1, 2).flatten(-2)  # [B, N, H * DH]
    g = torch.sigmoid(F.linear(a, w_proj_g, b_proj_g))
    return F.linear(g * o, w_proj_o, b_proj_o), None


REFERENCE_CUEQ = types.SimpleNamespace(
    triangle_attention=triangle_attention,
    triangle_multiplicative_update=triangle_multiplicative_update,
    attention_pair_bias=attention_pair_bias,
)


@pytest.fixture
def reference_cueq(monkeypatch):
    """The peer modules call the reference functions; bench_trunk's import check passes."""
    monkeypatch.setattr(trunk_peer, "_cueq", lambda: REFERENCE_CUEQ)
    monkeypatch.setattr(bench_trunk, "optional_import", lambda name: types.SimpleNamespace())


# --------------------------------------------------------------------------------------------
# The peer's Pairformer block computes the library block's function

WIDTHS = dict(c_s=12, c_z=8, c_hidden_pair_bias=3, no_heads_pair_bias=4, c_hidden_mul=6, c_hidden_pair_att=5,
              no_heads_pair=2, transition_n=2, pair_dropout=0.25)


def peer_state_dict(block: PairformerBlock) -> dict[str, torch.Tensor]:
    """The library block's weights under the peer block's names (the triangle multiplications'
    input projections as cuEquivariance takes them: rows [a; b])."""
    ours = block.state_dict()
    state = {}
    for name in ("tri_mul_out", "tri_mul_in"):
        state.update({
            f"{name}.norm_in.weight": ours[f"{name}.layer_norm_in.weight"],
            f"{name}.norm_in.bias": ours[f"{name}.layer_norm_in.bias"],
            f"{name}.norm_out.weight": ours[f"{name}.layer_norm_out.weight"],
            f"{name}.norm_out.bias": ours[f"{name}.layer_norm_out.bias"],
            f"{name}.p_in.weight": torch.cat([ours[f"{name}.linear_a_p.weight"], ours[f"{name}.linear_b_p.weight"]]),
            f"{name}.g_in.weight": torch.cat([ours[f"{name}.linear_a_g.weight"], ours[f"{name}.linear_b_g.weight"]]),
            f"{name}.p_out.weight": ours[f"{name}.linear_z.weight"],
            f"{name}.g_out.weight": ours[f"{name}.linear_g.weight"],
        })
    for name in ("tri_att_start", "tri_att_end"):
        state[f"{name}.layer_norm.weight"] = ours[f"{name}.layer_norm_z.weight"]
        state[f"{name}.layer_norm.bias"] = ours[f"{name}.layer_norm_z.bias"]
        state[f"{name}.linear_z.weight"] = ours[f"{name}.linear_z.weight"]
        for proj in "qkvgo":
            state[f"{name}.attention.linear_{proj}.weight"] = ours[f"{name}.linear_{proj}.weight"]
    for key, value in ours.items():  # the transitions and the attention with pair bias: the same names
        if key.split(".")[0] in ("pair_transition", "attn_pair_bias", "single_transition"):
            state[key] = value
    return state


def block_inputs(dtype, n=7, batch=2):
    s = torch.randn(batch, n, WIDTHS["c_s"], dtype=dtype)
    z = torch.randn(batch, n, n, WIDTHS["c_z"], dtype=dtype)
    single_mask = torch.ones(batch, n, dtype=dtype)
    single_mask[-1, -2:] = 0
    pair_mask = (torch.rand(batch, n, n) > 0.3).to(dtype)
    pair_mask[:, torch.arange(n), torch.arange(n)] = 1  # every row and column has a valid key
    return s, z, single_mask, pair_mask


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_peer_pairformer_block_is_the_library_block(reference_cueq, dtype, assert_close):
    ours = randomize_(PairformerBlock(**WIDTHS, backend="eager")).to(dtype).eval()
    peer = trunk_peer.PeerPairformerBlock(**WIDTHS).to(dtype).eval()
    assert sum(p.numel() for p in peer.parameters()) == sum(p.numel() for p in ours.parameters())
    peer.load_state_dict(peer_state_dict(ours))  # strict: every peer parameter given
    s, z, single_mask, pair_mask = block_inputs(dtype)
    s_ours, z_ours = ours(s, z, single_mask, pair_mask)
    s_peer, z_peer = peer(s, z, single_mask, pair_mask)
    # float32's tolerance in float64 too: the peer hands the triangle bias to the op in float32
    assert_close(s_peer, s_ours, torch.float32)
    assert_close(z_peer, z_ours, torch.float32)
    # the pair side alone changes the result: the comparison sees every update
    assert not torch.allclose(z_ours, z, atol=1e-2) and not torch.allclose(s_ours, s, atol=1e-2)


def test_peer_pairformer_stack_trains(reference_cueq):
    """Training mode: the row- and column-wise pair dropouts act, each block checkpointed (its
    recomputation draws the same masks), gradients reach the inputs and every parameter."""
    stack = trunk_peer.PeerPairformerStack(no_blocks=2, **WIDTHS, blocks_per_ckpt=1).double()
    s, z, single_mask, pair_mask = block_inputs(torch.float64)
    s.requires_grad_(True)
    z.requires_grad_(True)
    torch.manual_seed(3)
    s_out, z_out = stack.train()(s, z, single_mask, pair_mask)
    assert s_out.shape == s.shape and z_out.shape == z.shape
    (s_out.sum() + z_out.square().sum()).backward()
    assert s.grad is not None and z.grad is not None
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in stack.parameters())
    # the same step without checkpointing, from the same RNG state: the same gradients
    grads = [p.grad.clone() for p in stack.parameters()]
    stack.zero_grad()
    torch.manual_seed(3)
    out = (s, z)
    for block in stack.blocks:
        out = block(*out, single_mask, pair_mask)
    (out[0].sum() + out[1].square().sum()).backward()
    for p, g in zip(stack.parameters(), grads):
        torch.testing.assert_close(p.grad, g)
    with torch.no_grad():  # dropout on in training mode only
        trained, evaluated = (stack.train(mode)(s, z, single_mask, pair_mask)[1] for mode in (True, False))
        assert not torch.allclose(trained, evaluated)


# --------------------------------------------------------------------------------------------
# bench_trunk's steps, on the CPU at tiny sizes


@pytest.mark.parametrize("impl", ["plain", "peer-eager"])
@pytest.mark.parametrize("trunk_name", ["af2", "pairformer"])
def test_trunk_step_runs_on_cpu(reference_cueq, trunk_name, impl):
    """The benchmark's own build, inputs and step (bf16, training mode with dropout) on the small
    presets: one step reaches the trunk's input leaves and every parameter."""
    if trunk_name == "af2":
        trunk, case = bench_trunk.AF2Trunk(preset="small"), bench_trunk.Case(3, 8)
        trunk.cfg.evoformer_stack.no_blocks = 1
        for section in (trunk.cfg.evoformer_stack, trunk.cfg.extra_msa_stack):
            section.msa_dropout, section.pair_dropout = 0.15, 0.25
    else:
        trunk, case = bench_trunk.PairformerTrunk(preset="af3_small"), bench_trunk.TokenCase(8)
        trunk.cfg.pairformer_stack.pair_dropout = 0.25
    stacks = bench_trunk.build_stacks(trunk, impl, train=True, device="cpu")
    assert all(next(s.parameters()).dtype == torch.bfloat16 and s.training for s in stacks)
    t = trunk.inputs(case, device="cpu")
    step = bench_trunk.make_step(trunk, stacks, t)
    step()
    assert all(t[name].grad is not None for name in trunk.leaves)
    assert all(p.grad is not None for stack in stacks for p in stack.parameters())
    step()  # gradients set to None, not accumulated
    assert trunk.flops(case) > 0


def test_peer_graphs_compiles_the_checkpointed_blocks(reference_cueq, monkeypatch):
    """peer-graphs (no CUDA graphs on the CPU, so ``torch.compile`` stands in as the identity): each
    compiled call is a checkpointed block, the stack runs them without an outer checkpoint, its
    gradients are the eager peer's, and every step marks a CUDA-graph step first."""
    compiled, marks = [], []

    def fake_compile(module, mode=None, dynamic=None):
        compiled.append((module, mode))
        return module

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    monkeypatch.setattr(trunk_peer, "checkpoint", _counting(trunk_peer.checkpoint))
    graphs = trunk_peer.PeerPairformerStack(no_blocks=2, compile_mode="reduce-overhead",
                                            **WIDTHS).double()
    assert graphs.cuda_graph_steps and [mode for _, mode in compiled] == ["reduce-overhead"] * 2
    assert all(isinstance(m, trunk_peer._CheckpointedBlock) and m.block is b
               for (m, _), b in zip(compiled, graphs.blocks))
    eager = trunk_peer.PeerPairformerStack(no_blocks=2, **WIDTHS).double()
    eager.load_state_dict(graphs.state_dict())
    assert not eager.cuda_graph_steps
    s, z, single_mask, pair_mask = block_inputs(torch.float64)
    grads = []
    for stack in (graphs, eager):
        trunk_peer.checkpoint.calls = 0
        torch.manual_seed(5)
        s_out, z_out = stack.train()(s, z, single_mask, pair_mask)
        (s_out.sum() + z_out.square().sum()).backward()
        assert trunk_peer.checkpoint.calls == 2  # one per block: inside the compiled call, or around it
        grads.append([p.grad.clone() for p in stack.parameters()])
    for g_graphs, g_eager in zip(*grads):
        torch.testing.assert_close(g_graphs, g_eager)

    class Trunk:  # make_step's view of a trunk: its leaves and its loss
        leaves = ["s"]

        @staticmethod
        def loss(stacks, t):
            return stacks[0](t["s"], z, single_mask, pair_mask)[1].sum()

    step = bench_trunk.make_step(Trunk, [graphs], {"s": s.clone().requires_grad_(True)})
    step()
    step()
    assert len(marks) == 2


def _counting(fn):
    """fn, counting its calls in the wrapper's ``calls``."""

    def wrapper(*args, **kwargs):
        wrapper.calls += 1
        return fn(*args, **kwargs)

    wrapper.calls = 0
    return wrapper


def test_trunk_cases_and_flops():
    trunk = bench_trunk.PairformerTrunk()
    assert [c.label() for c in trunk.cases] == ["N_token 384", "N_token 768"]
    section = trunk.cfg.pairformer_stack
    assert (section.no_blocks, section.c_s, section.c_z, section.pair_dropout) == (48, 384, 128, 0.25)
    # cubic (triangle) terms make N_token 768 more than 4x N_token 384
    assert 4 < trunk.flops(trunk.cases[1]) / trunk.flops(trunk.cases[0]) < 8
    af2 = bench_trunk.AF2Trunk()
    assert af2.flops(af2.cases[0]) > bench_trunk.AF2Trunk(extra=False).flops(af2.cases[0])


def test_block_arguments_build_the_presets_blocks():
    # The block benchmarks build one block from a preset's stack section: every stack-only key
    # (the recompute options included) must be left out, and the Pairformer block keeps its c_s.
    import bench_block
    from evoformer_blocks import EvoformerBlock, ExtraMSABlock

    EvoformerBlock(**bench_block.block_args(False))
    ExtraMSABlock(**bench_block.block_args(True))
    assert bench_block.pairformer_block_args()["c_s"] == 384
    PairformerBlock(**bench_block.pairformer_block_args())


# --------------------------------------------------------------------------------------------
# --baseline: this checkout's trunk against a revision's, paired (a subprocess: one baseline per process)

BASELINE_SCRIPT = r"""
import sys
sys.path.insert(0, "benchmarks")
import bench_trunk
for trunk, case in ((bench_trunk.AF2Trunk(preset="small", blocks=2), bench_trunk.Case(3, 8)),
                    (bench_trunk.PairformerTrunk(preset="af3_small", blocks=2), bench_trunk.TokenCase(8))):
    assert trunk.flops(case) > 0
    ours, theirs, same = bench_trunk.baseline_pair(trunk, case, "HEAD", device="cpu")
    assert same, type(trunk).__name__
    ours(), theirs()
# in training mode each step draws its own dropout masks: the comparison tells
trunk = bench_trunk.AF2Trunk(preset="small", blocks=1)
trunk.cfg.evoformer_stack.msa_dropout = trunk.cfg.evoformer_stack.pair_dropout = 0.25
assert not bench_trunk.baseline_pair(trunk, bench_trunk.Case(3, 8), "HEAD", train=True, device="cpu")[2]
print("ok")
"""


def test_baseline_pair_gives_the_same_gradients(run_beside_baseline):
    """`--baseline`'s pairing on the CPU against this checkout's own commit: the revision's stacks
    (both trunks, two blocks) take this side's weights and give every gradient bitwise equal; with
    dropout drawn per step they do not (what the check would report)."""
    run_beside_baseline(BASELINE_SCRIPT)
