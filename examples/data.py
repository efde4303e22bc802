"""Synthetic proteins whose contacts are written in the co-evolution of their MSAs (no downloads).

For every protein:

1. **Structure.** A compact random 3-D chain: a Cα-like trace grown residue by residue with
   3.8 Å steps, excluded volume (no two residues three or more apart closer than ``clash``; the
   residue two back at least ``min_i2`` away, which bounds the bond angle), and a pull towards the
   centroid of the chain so far, which makes a globule. The contact map is ``distance < 8 Å``
   between these representative atoms (a Cβ-like contact definition).
2. **Sequences.** A Potts model over 20 residue types: random fields ``h_i(a)`` and couplings
   ``J_ij(a, b) = coupling * W(a, b)`` on every contact with ``|i - j| >= 3``, where ``W`` is one
   residue-residue interaction matrix shared by all proteins (a few random "physico-chemical"
   axes, like hydrophobic and charge complementarity). Independent Gibbs-sampling chains
   (vectorized over proteins and sequences) give the MSA; its first row is the query sequence.
   Nothing but the co-evolution of the columns tells where the long-range contacts are.

Proteins have varied lengths; :func:`collate` pads them and returns masks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

NUM_AA = 20  # residue types 0..19
PAD = NUM_AA  # token of padded positions (not a residue type)
STEP = 3.8  # Å between consecutive residues


def interaction_matrix(generator: torch.Generator, rank: int = 4) -> torch.Tensor:
    """A symmetric ``[20, 20]`` residue-residue interaction ``W``, scaled to unit RMS.

    ``W = sum_r s_r u_r u_rᵀ`` over ``rank`` random residue-property axes ``u_r`` with signs
    ``s_r`` alternating (+: like attracts like, -: opposites attract, as for charges).
    """
    axes = torch.randn(rank, NUM_AA, generator=generator)  # [rank, 20]
    signs = torch.tensor([1.0 if r % 2 == 0 else -1.0 for r in range(rank)])  # [rank]
    w = torch.einsum("r,ra,rb->ab", signs, axes, axes)  # [20, 20]
    return w / w.pow(2).mean().sqrt()


def random_chains(
    lengths: list[int],
    generator: torch.Generator,
    candidates: int = 32,
    clash: float = 4.2,
    min_i2: float = 5.2,
    compaction: float = 1.0,
) -> torch.Tensor:
    """Grows ``len(lengths)`` chains at once; returns coordinates ``[P, max(lengths), 3]`` (Å).

    Each new residue is one of ``candidates`` random 3.8 Å steps from the previous one: those that
    respect excluded volume are weighted by ``exp(-compaction * d / STEP)`` with ``d`` the distance
    to the centroid of the chain so far (a dead end takes the least clashing step). Positions past
    a chain's length are grown too and ignored by the caller.
    """
    n, length = len(lengths), max(lengths)
    coords = torch.zeros(n, length, 3)
    for t in range(1, length):
        dirs = torch.randn(n, candidates, 3, generator=generator)
        dirs = dirs / dirs.norm(dim=-1, keepdim=True)  # [P, K, 3]
        cand = coords[:, t - 1, None, :] + STEP * dirs  # [P, K, 3]
        ok = torch.ones(n, candidates, dtype=torch.bool)
        slack = torch.zeros(n, candidates)
        if t >= 2:
            d2 = (cand - coords[:, t - 2, None, :]).norm(dim=-1)  # [P, K]
            ok &= d2 >= min_i2
            slack = d2 - min_i2
        if t >= 3:
            d_far = torch.cdist(cand, coords[:, : t - 2, :]).amin(dim=-1)  # [P, K]
            ok &= d_far >= clash
            slack = torch.minimum(slack, d_far - clash)
        centroid = coords[:, :t, :].mean(dim=1, keepdim=True)  # [P, 1, 3]
        logits = -compaction * (cand - centroid).norm(dim=-1) / STEP  # [P, K]
        logits = torch.where(ok, logits, torch.full_like(logits, -math.inf))
        dead = ~ok.any(dim=-1)  # [P]
        logits[dead] = torch.where(slack[dead] == slack[dead].amax(dim=-1, keepdim=True), 0.0, -math.inf)
        choice = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)  # [P, 1]
        coords[:, t, :] = cand[torch.arange(n), choice[:, 0]]
    return coords


def gibbs_msa(
    contacts: torch.Tensor,
    mask: torch.Tensor,
    w: torch.Tensor,
    n_seq: int,
    sweeps: int,
    coupling: float,
    field: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """Samples ``n_seq`` sequences per protein from a Potts model with couplings on contacts.

    ``contacts`` ``[P, L, L]`` (bool, symmetric: the coupled pairs), ``mask`` ``[P, L]``; energy
    ``-sum_i h_i(x_i) - sum_{i<j} coupling * contacts_ij * W(x_i, x_j)`` with fields
    ``h ~ field * N(0, 1)``. Systematic-scan Gibbs sampling, ``sweeps`` sweeps from uniform random
    sequences, every sequence an independent chain. Returns tokens ``[P, n_seq, L]`` (PAD where
    ``mask`` is 0).

    ``W`` (symmetric) is used through its eigen-decomposition ``W = Q diag(lam) Qᵀ`` restricted to
    its non-zero eigenvalues, so the field on residue ``i`` is
    ``coupling * (sum_{j in contacts(i)} Q[x_j]) @ (Q diag(lam))ᵀ`` with a short gather.
    """
    n, length = mask.shape
    lam, q = torch.linalg.eigh(w)
    keep = lam.abs() > 1e-6 * lam.abs().max()
    embed, readout = q[:, keep], (q[:, keep] * lam[keep]).t()  # [20, r], [r, 20]
    h = field * torch.randn(n, length, NUM_AA, generator=generator)  # [P, L, 20]
    x = torch.randint(0, NUM_AA, (n, length, n_seq), generator=generator)  # [P, L, S]
    e = embed[x]  # [P, L, S, r]
    # Neighbour lists: at most k_max partners per residue, padded with weight-0 partners.
    k_max = max(1, int(contacts.sum(dim=-1).max()))
    weight, nbr = contacts.float().topk(k_max, dim=-1)  # [P, L, k_max]: 1/0 and partner index
    batch = torch.arange(n)[:, None]  # [P, 1]
    for _ in range(sweeps):
        for i in range(length):
            partners = e[batch, nbr[:, i, :]]  # [P, k_max, S, r]
            local = torch.einsum("pk,pksr->psr", weight[:, i, :], partners) @ readout  # [P, S, 20]
            logits = h[:, i, None, :] + coupling * local  # [P, S, 20]
            gumbel = -torch.log(-torch.log(torch.rand(logits.shape, generator=generator).clamp_min(1e-20)))
            x[:, i, :] = (logits + gumbel).argmax(dim=-1)  # Gumbel-max: a sample of softmax(logits)
            e[:, i] = embed[x[:, i, :]]
    x = x.transpose(1, 2)  # [P, S, L]
    return torch.where(mask[:, None, :], x, torch.full_like(x, PAD))


@dataclass
class ProteinSet:
    """A padded set of proteins. ``msa`` ``[P, S, L]`` tokens, ``coords`` ``[P, L, 3]``,
    ``mask`` ``[P, L]`` bool, ``lengths`` ``[P]``."""

    msa: torch.Tensor
    coords: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor

    def __len__(self) -> int:
        return self.msa.shape[0]

    def subset(self, index: torch.Tensor) -> "ProteinSet":
        return ProteinSet(self.msa[index], self.coords[index], self.mask[index], self.lengths[index])


def make_proteins(
    n: int,
    min_len: int,
    max_len: int,
    n_seq: int,
    sweeps: int,
    coupling: float,
    field: float,
    contact_cutoff: float,
    seed: int,
    interaction_seed: int,
) -> ProteinSet:
    """``n`` proteins with lengths uniform in ``[min_len, max_len]`` (see the module docstring).

    ``interaction_seed`` fixes the shared interaction matrix ``W`` (the "physics", the same for
    training and held-out proteins); ``seed`` fixes everything else.
    """
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    w = interaction_matrix(torch.Generator().manual_seed(interaction_seed))
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=gen)
    mask = torch.arange(max_len)[None, :] < lengths[:, None]  # [P, L]
    coords = random_chains(lengths.tolist(), gen)
    coords = coords[:, :max_len] if coords.shape[1] >= max_len else torch.nn.functional.pad(
        coords, (0, 0, 0, max_len - coords.shape[1])
    )  # [P, max_len, 3]
    pair_mask = mask[:, :, None] & mask[:, None, :]  # [P, L, L]
    sep = (torch.arange(max_len)[:, None] - torch.arange(max_len)[None, :]).abs()  # [L, L]
    coupled = (torch.cdist(coords, coords) < contact_cutoff) & pair_mask & (sep >= 3)  # [P, L, L]
    msa = gibbs_msa(coupled, mask, w, n_seq, sweeps, coupling, field, gen)
    coords = torch.where(mask[..., None], coords, torch.zeros_like(coords))
    return ProteinSet(msa=msa, coords=coords, mask=mask, lengths=lengths)


def contact_map(coords: torch.Tensor, mask: torch.Tensor, cutoff: float) -> torch.Tensor:
    """``[*, L, L]`` bool: both residues real and closer than ``cutoff`` Å."""
    pair = mask[..., :, None] & mask[..., None, :]
    return (torch.cdist(coords, coords) < cutoff) & pair


def collate(
    proteins: ProteinSet, index: torch.Tensor, depth: int, generator: torch.Generator, extra_depth: int = 0,
    pad_to: Optional[int] = None,
) -> dict:
    """A batch of the proteins ``index``, cropped to their longest length (``pad_to``: padded to that
    length instead, at least the longest, so that every batch has one shape).

    MSA rows: the query row, then ``depth - 1`` other rows drawn at random (fresh for every call);
    with ``extra_depth`` > 0 another ``extra_depth`` random rows form the extra MSA.

    Returns ``msa`` ``[B, depth, L]`` (long), ``msa_mask`` ``[B, depth, L]``, ``seq_mask`` ``[B, L]``,
    ``pair_mask`` ``[B, L, L]`` (float 0/1), ``coords`` ``[B, L, 3]``, ``lengths`` ``[B]`` and, with
    ``extra_depth``, ``extra_msa`` ``[B, extra_depth, L]`` and ``extra_msa_mask``.
    """
    batch = proteins.subset(index)
    length = int(batch.lengths.max())
    if pad_to is not None:
        if not length <= pad_to <= batch.msa.shape[-1]:
            raise ValueError(f"pad_to={pad_to} must lie between the longest protein ({length}) and the "
                             f"stored length ({batch.msa.shape[-1]})")
        length = pad_to
    n_rows = batch.msa.shape[1]
    if depth < 1 or extra_depth < 0 or depth + extra_depth > n_rows:
        raise ValueError(
            f"need depth >= 1, extra_depth >= 0 and depth + extra_depth <= {n_rows} (the sampled MSA "
            f"depth), got depth={depth}, extra_depth={extra_depth}"
        )
    order = torch.rand(len(index), n_rows - 1, generator=generator).argsort(dim=-1) + 1  # [B, n_rows - 1]
    rows = torch.cat([torch.zeros(len(index), 1, dtype=torch.long), order], dim=1)  # [B, n_rows], query first
    msa = torch.gather(batch.msa[:, :, :length], 1, rows[:, :, None].expand(-1, -1, length))  # [B, n_rows, L]
    seq_mask = batch.mask[:, :length].float()  # [B, L]
    out = {
        "msa": msa[:, :depth],  # [B, depth, L]
        "msa_mask": seq_mask[:, None, :].expand(-1, depth, -1).contiguous(),  # [B, depth, L]
        "seq_mask": seq_mask,  # [B, L]
        "pair_mask": seq_mask[:, :, None] * seq_mask[:, None, :],  # [B, L, L]
        "coords": batch.coords[:, :length],  # [B, L, 3]
        "lengths": batch.lengths,  # [B]
    }
    if extra_depth > 0:
        out["extra_msa"] = msa[:, depth : depth + extra_depth]  # [B, extra_depth, L]
        out["extra_msa_mask"] = seq_mask[:, None, :].expand(-1, extra_depth, -1).contiguous()  # [B, extra_depth, L]
    return out
