"""The peer trunks of bench_trunk.py: AF2's Evoformer and extra-MSA blocks written in plain PyTorch
the way OpenFold writes them, and AF3's Pairformer block the way an AF3 repository (OpenFold3,
Boltz) writes it, with cuEquivariance's fused ops where it has them.

* MSA row attention with pair bias and both triangle attentions: ``cuequivariance_torch.
  triangle_attention`` (q, k, v ``[B, N, H, L, D]``, the pair bias ``[B, 1, H, L, L]`` in float32,
  the mask as booleans ``[B, N, 1, 1, L]``);
* both triangle multiplicative updates: ``cuequivariance_torch.triangle_multiplicative_update``
  (layer norms, projections, gates and the triangle product in its fused kernels);
* MSA column attention: ``torch.nn.functional.scaled_dot_product_attention`` with the mask as an
  additive bias; the extra MSA's global column attention in plain PyTorch;
* layer norms, projections, transitions, the outer product mean, dropout and residual adds: plain
  PyTorch modules and operations.

The Pairformer block (AF3 supplement Algorithm 17, :class:`PeerPairformerBlock`) uses the same
triangle modules in AF3's bias-free form (``bias=False``), SwiGLU transitions, and, for the single
representation's attention with pair bias (Algorithm 24 without conditioning),
``cuequivariance_torch.attention_pair_bias`` (s ``[B, N, c_s]``, z ``[B, N, N, c_z]``, the token mask
``[B, N]`` with 1 = valid; its layer norms, the q/k/v/gate/output and pair-bias projections, the
masked softmax and the gate in the op). Its transitions' updates are masked, as the library's
Pairformer (and OpenFold3's) masks them.

A :class:`PeerStack` (:class:`PeerPairformerStack`) checkpoints each block
(``torch.utils.checkpoint``, non-reentrant, the RNG state restored for the recomputation's dropout)
and can ``torch.compile`` each block (with CUDA graphs, the checkpointed block). Its weights are
its own (random); the benchmark times it.
tests/test_bench_trunk.py runs the Pairformer peer on the CPU with reference functions in place of
cuEquivariance's and checks that, on the library block's weights, it computes the same function.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

INF = 1e9


def _cueq():
    import cuequivariance_torch

    return cuequivariance_torch


class GatedAttention(nn.Module):
    """The projections around an attention core: q, k, v (no bias) and the gate from the normalised
    input, then ``linear_o(sigmoid(g) * o)``."""

    def __init__(self, c_in: int, c_hidden: int, no_heads: int, bias: bool = True):
        super().__init__()
        self.no_heads, self.c_hidden = no_heads, c_hidden
        hidden = no_heads * c_hidden
        self.linear_q = nn.Linear(c_in, hidden, bias=False)
        self.linear_k = nn.Linear(c_in, hidden, bias=False)
        self.linear_v = nn.Linear(c_in, hidden, bias=False)
        self.linear_g = nn.Linear(c_in, hidden, bias=bias)  # AF3: no biases (bias=False)
        self.linear_o = nn.Linear(hidden, c_in, bias=bias)

    def heads(self, x: torch.Tensor) -> list[torch.Tensor]:
        """q, k, v of x ``[*, L, c_in]`` as ``[*, H, L, D]``."""
        shape = (*x.shape[:-1], self.no_heads, self.c_hidden)
        return [lin(x).view(shape).transpose(-2, -3) for lin in (self.linear_q, self.linear_k, self.linear_v)]

    def output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """``linear_o(sigmoid(linear_g(x)) * o)`` for the core's output o ``[*, H, L, D]``."""
        o = o.transpose(-2, -3).flatten(-2)  # [*, L, H * D]
        return self.linear_o(torch.sigmoid(self.linear_g(x)) * o)


class TriangleAttention(nn.Module):
    """The pair attention around (starting node) or, with ``ending``, across edges; with ``c_z``
    given for an MSA row attention, the pair bias comes from z instead of from the input;
    ``bias=False``: AF3's form (no bias in the gate and the output projection)."""

    def __init__(self, c_in: int, c_hidden: int, no_heads: int, c_z: Optional[int] = None, ending: bool = False,
                 bias: bool = True):
        super().__init__()
        self.ending = ending
        self.layer_norm = nn.LayerNorm(c_in)
        self.layer_norm_z = nn.LayerNorm(c_z) if c_z is not None else None
        self.linear_z = nn.Linear(c_z or c_in, no_heads, bias=False)
        self.attention = GatedAttention(c_in, c_hidden, no_heads, bias=bias)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
        # x [B, N, L, c_in], mask [B, N, L]; z [B, L, L, c_z] for the MSA row attention
        if self.ending:
            x, mask = x.transpose(-2, -3), mask.transpose(-1, -2)
        x = self.layer_norm(x)
        zz = x if z is None else self.layer_norm_z(z)
        bias = self.linear_z(zz).permute(0, 3, 1, 2).unsqueeze(1).float()  # [B, 1, H, L, L]
        q, k, v = self.attention.heads(x)  # [B, N, H, L, D]
        o = _cueq().triangle_attention(q, k, v, bias, mask.bool()[:, :, None, None, :])  # [B, N, H, L, D]
        out = self.attention.output(x, o)  # [B, N, L, c_in]
        return out.transpose(-2, -3) if self.ending else out


class ColumnAttention(nn.Module):
    """MSA column attention by SDPA, the mask as an additive bias."""

    def __init__(self, c_m: int, c_hidden: int, no_heads: int):
        super().__init__()
        self.layer_norm = nn.LayerNorm(c_m)
        self.attention = GatedAttention(c_m, c_hidden, no_heads)

    def forward(self, m: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.layer_norm(m.transpose(-2, -3))  # [B, R, S, c_m]
        q, k, v = self.attention.heads(x)  # [B, R, H, S, D]
        b, r, h, s, d = q.shape
        bias = (INF * (mask.transpose(-1, -2) - 1)).to(q.dtype).reshape(b * r, 1, 1, s)  # [B * R, 1, 1, S]
        o = F.scaled_dot_product_attention(*(t.reshape(b * r, h, s, d) for t in (q, k, v)), attn_mask=bias)
        return self.attention.output(x, o.view(b, r, h, s, d)).transpose(-2, -3)  # [B, S, R, c_m]


class GlobalColumnAttention(nn.Module):
    """The extra MSA's global column attention (AF2 Algorithm 19) in plain PyTorch."""

    def __init__(self, c_m: int, c_hidden: int, no_heads: int, eps: float = 1e-10):
        super().__init__()
        self.no_heads, self.c_hidden, self.eps = no_heads, c_hidden, eps
        self.layer_norm = nn.LayerNorm(c_m)
        self.linear_q = nn.Linear(c_m, no_heads * c_hidden, bias=False)
        self.linear_k = nn.Linear(c_m, c_hidden, bias=False)
        self.linear_v = nn.Linear(c_m, c_hidden, bias=False)
        self.linear_g = nn.Linear(c_m, no_heads * c_hidden)
        self.linear_o = nn.Linear(no_heads * c_hidden, c_m)

    def forward(self, m: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.layer_norm(m.transpose(-2, -3))  # [B, R, S, c_m]
        mask = mask.transpose(-1, -2)  # [B, R, S]
        q = (x * mask[..., None]).sum(-2) / (mask.sum(-1, keepdim=True) + self.eps)  # [B, R, c_m]
        q = self.linear_q(q).unflatten(-1, (self.no_heads, self.c_hidden)) * self.c_hidden**-0.5  # [B, R, H, D]
        k, v = self.linear_k(x), self.linear_v(x)  # [B, R, S, D]
        a = torch.softmax(q @ k.transpose(-1, -2) + (INF * (mask - 1))[..., None, :], dim=-1)  # [B, R, H, S]
        o = a @ v  # [B, R, H, D]
        g = torch.sigmoid(self.linear_g(x)).unflatten(-1, (self.no_heads, self.c_hidden))  # [B, R, S, H, D]
        out = self.linear_o((g * o.unsqueeze(-3)).flatten(-2))  # [B, R, S, c_m]
        return out.transpose(-2, -3)


class Transition(nn.Module):
    def __init__(self, c: int, n: int):
        super().__init__()
        self.layer_norm = nn.LayerNorm(c)
        self.linear_1, self.linear_2 = nn.Linear(c, n * c), nn.Linear(n * c, c)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.linear_2(torch.relu(self.linear_1(self.layer_norm(x)))) * mask[..., None]


class OuterProductMean(nn.Module):
    def __init__(self, c_m: int, c_z: int, c_hidden: int, eps: float = 1e-3):
        super().__init__()
        self.eps = eps
        self.layer_norm = nn.LayerNorm(c_m)
        self.linear_1, self.linear_2 = nn.Linear(c_m, c_hidden), nn.Linear(c_m, c_hidden)
        self.linear_out = nn.Linear(c_hidden * c_hidden, c_z)

    def forward(self, m: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.layer_norm(m)
        a = self.linear_1(x) * mask[..., None]  # [B, S, R, c]
        b = self.linear_2(x) * mask[..., None]
        outer = torch.einsum("bsic,bsjd->bijcd", a, b).flatten(-2)  # [B, R, R, c * c]
        norm = torch.einsum("bsi,bsj->bij", mask, mask)[..., None]  # [B, R, R, 1]
        return self.linear_out(outer) / (norm + self.eps)


class SwiGLUTransition(nn.Module):
    """AF3 Algorithm 11: ``linear_out(silu(linear_a(x)) * linear_b(x))`` of the normalised input, no
    biases; the update masked."""

    def __init__(self, c: int, n: int):
        super().__init__()
        self.layer_norm = nn.LayerNorm(c)
        self.linear_a, self.linear_b = nn.Linear(c, n * c, bias=False), nn.Linear(c, n * c, bias=False)
        self.linear_out = nn.Linear(n * c, c, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.layer_norm(x)
        return self.linear_out(F.silu(self.linear_a(x)) * self.linear_b(x)) * mask[..., None]


class TriangleMultiplication(nn.Module):
    """AF2 Algorithms 11/12 (AF3 Algorithms 12/13 with ``bias=False``) by cuEquivariance's fused
    triangle_multiplicative_update. ``p_in``/``g_in`` hold the a and b halves as rows ``[a; b]``."""

    def __init__(self, c_z: int, c_hidden: int, outgoing: bool, bias: bool = True):
        super().__init__()
        self.direction = "outgoing" if outgoing else "incoming"
        self.norm_in = nn.LayerNorm(c_z)
        self.norm_out = nn.LayerNorm(c_hidden)
        self.p_in = nn.Linear(c_z, 2 * c_hidden, bias=bias)
        self.g_in = nn.Linear(c_z, 2 * c_hidden, bias=bias)
        self.p_out = nn.Linear(c_hidden, c_z, bias=bias)
        self.g_out = nn.Linear(c_z, c_z, bias=bias)

    def forward(self, z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return _cueq().triangle_multiplicative_update(
            z, self.direction, mask,
            norm_in_weight=self.norm_in.weight, norm_in_bias=self.norm_in.bias,
            p_in_weight=self.p_in.weight, p_in_bias=self.p_in.bias,
            g_in_weight=self.g_in.weight, g_in_bias=self.g_in.bias,
            norm_out_weight=self.norm_out.weight, norm_out_bias=self.norm_out.bias,
            p_out_weight=self.p_out.weight, p_out_bias=self.p_out.bias,
            g_out_weight=self.g_out.weight, g_out_bias=self.g_out.bias,
        )


class AttentionPairBias(nn.Module):
    """AF3 Algorithm 24 in the trunk (no conditioning) by cuEquivariance's fused
    attention_pair_bias: layer norms of s and z, q (with bias), k, v, the gate and the output
    projection (no biases) from the normalised s, one pair bias per head from the normalised z, a
    masked key gets ``-inf``."""

    def __init__(self, c_s: int, c_z: int, c_hidden: int, no_heads: int, inf: float = 1e9):
        super().__init__()
        self.no_heads, self.inf = no_heads, inf
        hidden = no_heads * c_hidden
        self.layer_norm_s, self.layer_norm_z = nn.LayerNorm(c_s), nn.LayerNorm(c_z)
        self.linear_z = nn.Linear(c_z, no_heads, bias=False)
        self.linear_q = nn.Linear(c_s, hidden)
        self.linear_k = nn.Linear(c_s, hidden, bias=False)
        self.linear_v = nn.Linear(c_s, hidden, bias=False)
        self.linear_g = nn.Linear(c_s, hidden, bias=False)
        self.linear_o = nn.Linear(hidden, c_s, bias=False)

    def forward(self, s: torch.Tensor, z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # s [B, N, c_s], z [B, N, N, c_z], mask [B, N] (1 = valid); the op returns (update, None)
        update, _ = _cueq().attention_pair_bias(
            s, z, mask, self.no_heads,
            w_ln_a=self.layer_norm_s.weight, b_ln_a=self.layer_norm_s.bias,
            w_proj_q=self.linear_q.weight, b_proj_q=self.linear_q.bias,
            w_proj_k=self.linear_k.weight, w_proj_v=self.linear_v.weight,
            w_proj_g=self.linear_g.weight, w_proj_o=self.linear_o.weight,
            w_proj_z=self.linear_z.weight, w_ln_z=self.layer_norm_z.weight, b_ln_z=self.layer_norm_z.bias,
            inf=self.inf, eps=self.layer_norm_s.eps,
        )
        return update


def shared_dropout(x: torch.Tensor, p: float, dim: int, training: bool) -> torch.Tensor:
    """x times a dropout mask shared along ``dim`` (AF2's row- and column-wise dropout)."""
    if not training or p == 0.0:
        return x
    shape = list(x.shape)
    shape[dim] = 1
    return x * F.dropout(x.new_ones(shape), p=p, training=True)


class PeerBlock(nn.Module):
    """One Evoformer block (or, with ``extra``, an extra-MSA block) of the af2 preset's widths."""

    def __init__(self, c_m, c_z, c_hidden_msa_att, c_hidden_opm, c_hidden_mul, c_hidden_pair_att, no_heads_msa,
                 no_heads_pair, transition_n, msa_dropout, pair_dropout, extra: bool = False, **_ignored):
        super().__init__()
        self.msa_dropout, self.pair_dropout = msa_dropout, pair_dropout
        self.msa_att_row = TriangleAttention(c_m, c_hidden_msa_att, no_heads_msa, c_z=c_z)
        if extra:
            self.msa_att_col = GlobalColumnAttention(c_m, c_hidden_msa_att, no_heads_msa)
        else:
            self.msa_att_col = ColumnAttention(c_m, c_hidden_msa_att, no_heads_msa)
        self.msa_transition = Transition(c_m, transition_n)
        self.outer_product_mean = OuterProductMean(c_m, c_z, c_hidden_opm)
        self.tri_mul_out = TriangleMultiplication(c_z, c_hidden_mul, outgoing=True)
        self.tri_mul_in = TriangleMultiplication(c_z, c_hidden_mul, outgoing=False)
        self.tri_att_start = TriangleAttention(c_z, c_hidden_pair_att, no_heads_pair)
        self.tri_att_end = TriangleAttention(c_z, c_hidden_pair_att, no_heads_pair, ending=True)
        self.pair_transition = Transition(c_z, transition_n)

    def forward(self, m, z, msa_mask, pair_mask):
        t = self.training
        m = m + shared_dropout(self.msa_att_row(m, msa_mask, z), self.msa_dropout, -3, t)
        m = m + self.msa_att_col(m, msa_mask)
        m = m + self.msa_transition(m, msa_mask)
        z = z + self.outer_product_mean(m, msa_mask)
        z = z + shared_dropout(self.tri_mul_out(z, pair_mask), self.pair_dropout, -3, t)
        z = z + shared_dropout(self.tri_mul_in(z, pair_mask), self.pair_dropout, -3, t)
        z = z + shared_dropout(self.tri_att_start(z, pair_mask), self.pair_dropout, -3, t)
        z = z + shared_dropout(self.tri_att_end(z, pair_mask), self.pair_dropout, -2, t)
        z = z + self.pair_transition(z, pair_mask)
        return m, z


class PeerPairformerBlock(nn.Module):
    """One Pairformer block (AF3 supplement Algorithm 17) of the af3 preset's widths."""

    def __init__(self, c_s, c_z, c_hidden_pair_bias, no_heads_pair_bias, c_hidden_mul, c_hidden_pair_att,
                 no_heads_pair, transition_n, pair_dropout, inf=1e9, **_ignored):
        super().__init__()
        self.pair_dropout = pair_dropout
        self.tri_mul_out = TriangleMultiplication(c_z, c_hidden_mul, outgoing=True, bias=False)
        self.tri_mul_in = TriangleMultiplication(c_z, c_hidden_mul, outgoing=False, bias=False)
        self.tri_att_start = TriangleAttention(c_z, c_hidden_pair_att, no_heads_pair, bias=False)
        self.tri_att_end = TriangleAttention(c_z, c_hidden_pair_att, no_heads_pair, ending=True, bias=False)
        self.pair_transition = SwiGLUTransition(c_z, transition_n)
        self.attn_pair_bias = AttentionPairBias(c_s, c_z, c_hidden_pair_bias, no_heads_pair_bias, inf=inf)
        self.single_transition = SwiGLUTransition(c_s, transition_n)

    def forward(self, s, z, single_mask, pair_mask):
        t, p = self.training, self.pair_dropout
        z = z + shared_dropout(self.tri_mul_out(z, pair_mask), p, -3, t)
        z = z + shared_dropout(self.tri_mul_in(z, pair_mask), p, -3, t)
        z = z + shared_dropout(self.tri_att_start(z, pair_mask), p, -3, t)
        z = z + shared_dropout(self.tri_att_end(z, pair_mask), p, -2, t)
        z = z + self.pair_transition(z, pair_mask)
        s = s + self.attn_pair_bias(s, z, single_mask)
        s = s + self.single_transition(s, single_mask)
        return s, z


class _CheckpointedBlock(nn.Module):
    """One block (eager or compiled) under ``torch.utils.checkpoint`` (non-reentrant); compiled
    itself where the checkpoint has to be inside the compiled region."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x, z, x_mask, pair_mask):
        return checkpoint(self.block, x, z, x_mask, pair_mask, use_reentrant=False)


class _CheckpointedBlocks(nn.Module):
    """Blocks taking and returning two representations, each block checkpointed and, with a
    ``compile_mode``, ``torch.compile``d (None: eager; ``"default"``, ``"reduce-overhead"``).

    Eager and ``"default"`` checkpoint the (compiled) block from outside. ``"reduce-overhead"``
    compiles the checkpointed block instead (the compiler's own recomputation in the backward graph):
    CUDA-graph trees under an outer non-reentrant checkpoint fail with torch 2.11 (the recorded
    graphs see other tensors alive at replay). With it, call
    ``torch.compiler.cudagraph_mark_step_begin()`` before each training step (``cuda_graph_steps``
    says so)."""

    def _set_blocks(self, blocks: list[nn.Module], compile_mode: Optional[str]) -> None:
        self.blocks = nn.ModuleList(blocks)
        self.cuda_graph_steps = compile_mode == "reduce-overhead"
        if compile_mode is None:
            self._calls = [_CheckpointedBlock(b) for b in self.blocks]
        elif self.cuda_graph_steps:
            self._calls = [torch.compile(_CheckpointedBlock(b), mode=compile_mode, dynamic=False)
                           for b in self.blocks]
        else:
            self._calls = [_CheckpointedBlock(torch.compile(b, mode=compile_mode, dynamic=False))
                           for b in self.blocks]

    def _run_blocks(self, x, z, x_mask, pair_mask):
        for call in self._calls:
            x, z = call(x, z, x_mask, pair_mask)
        return x, z


class PeerStack(_CheckpointedBlocks):
    """``no_blocks`` peer Evoformer (``extra``: extra-MSA) blocks, each checkpointed; with ``c_s``,
    the single representation from the first MSA row as EvoformerStack gives it."""

    def __init__(self, no_blocks: int, c_s: Optional[int] = None, compile_mode: Optional[str] = None,
                 extra: bool = False, **block_args):
        super().__init__()
        self._set_blocks([PeerBlock(extra=extra, **block_args) for _ in range(no_blocks)], compile_mode)
        self.linear = nn.Linear(block_args["c_m"], c_s) if c_s else None

    def forward(self, m, z, msa_mask, pair_mask):
        m, z = self._run_blocks(m, z, msa_mask, pair_mask)
        if self.linear is None:
            return z
        return m, z, self.linear(m[..., 0, :, :])


class PeerPairformerStack(_CheckpointedBlocks):
    """``no_blocks`` peer Pairformer blocks, each checkpointed: ``forward(s, z, single_mask,
    pair_mask)`` returns ``(s, z)``."""

    def __init__(self, no_blocks: int, compile_mode: Optional[str] = None, **block_args):
        super().__init__()
        self._set_blocks([PeerPairformerBlock(**block_args) for _ in range(no_blocks)], compile_mode)

    def forward(self, s, z, single_mask, pair_mask):
        return self._run_blocks(s, z, single_mask, pair_mask)
