"""A small AlphaFold-style trunk: MSA and pair embeddings → (extra-MSA stack) → Evoformer stack →
distogram head, or AlphaFold 3's: → MSA module → Pairformer → distogram head; plus the distogram
loss and contact-precision metrics."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from evoformer_blocks import EvoformerStack, ExtraMSAStack, MSAModule, PairformerStack
from evoformer_blocks.primitives import Linear

NUM_TOKENS = 21  # 20 residue types and the padding token


def distance_bins(first_break: float, last_break: float, no_bins: int) -> torch.Tensor:
    """The ``no_bins - 1`` bin edges (Å) of the distogram; bin 0 is below ``first_break``."""
    return torch.linspace(first_break, last_break, no_bins - 1)


class ContactTrunk(nn.Module):
    """Predicts the distogram of a protein from its MSA.

    Embeddings (as in AF2's input embedder, with one-hot tokens only): every MSA row gets
    ``Linear(msa) + Linear(query)``; the pair gets ``Linear_i(query)_i + Linear_j(query)_j`` plus a
    one-hot relative position ``clip(j - i, -relpos_k, relpos_k)`` through a Linear. Optionally the
    rows after the first ``msa_depth`` (up to ``extra_msa_depth`` of them) pass through an
    :class:`ExtraMSAStack` that updates the pair representation first, as in AF2. The distogram
    head is a Linear on ``z`` symmetrized over ``(i, j)``.

    ``evoformer_stack`` / ``extra_msa_stack`` are the stacks' keyword arguments (a preset section of
    :func:`evoformer_blocks.config.get_config`); ``backend`` reaches every attention. With
    ``pairformer_stack`` and ``msa_module`` instead (an AF3 preset's sections) the trunk is AlphaFold
    3's: the embedded MSA updates the pair representation in an :class:`MSAModule`, then a
    :class:`PairformerStack` updates it with the single representation (``Linear(query)``).
    ``cuda_graphs`` is every stack's switch (they replay CUDA graphs; inputs of one shape per step).
    """

    def __init__(
        self,
        no_bins: int,
        relpos_k: int,
        evoformer_stack: Optional[dict] = None,
        extra_msa_stack: Optional[dict] = None,
        msa_module: Optional[dict] = None,
        pairformer_stack: Optional[dict] = None,
        backend: Optional[str] = None,
        cuda_graphs: bool = False,
    ):
        super().__init__()
        if (evoformer_stack is None) == (pairformer_stack is None):
            raise ValueError("ContactTrunk: give `evoformer_stack` (AF2) or `pairformer_stack` (AF3), not both")
        trunk = evoformer_stack if evoformer_stack is not None else pairformer_stack
        c_z = trunk["c_z"]
        c_m = evoformer_stack["c_m"] if evoformer_stack is not None else msa_module["c_m"]
        self.relpos_k = relpos_k
        self.msa_embed = Linear(NUM_TOKENS, c_m)
        self.query_to_m = Linear(NUM_TOKENS, c_m)
        self.query_to_z_i = Linear(NUM_TOKENS, c_z)
        self.query_to_z_j = Linear(NUM_TOKENS, c_z)
        self.relpos = Linear(2 * relpos_k + 1, c_z)
        self.extra_msa = self.evoformer = self.msa_module = self.pairformer = None
        if extra_msa_stack is not None:
            self.extra_msa_embed = Linear(NUM_TOKENS, extra_msa_stack["c_m"])
            self.extra_msa = ExtraMSAStack.from_config(extra_msa_stack, backend=backend, cuda_graphs=cuda_graphs)
        if evoformer_stack is not None:
            self.evoformer = EvoformerStack.from_config(evoformer_stack, backend=backend, cuda_graphs=cuda_graphs)
            # The stack's single representation feeds AF2's structure module; this trunk has none, so
            # that projection gets no gradient (frozen, which DistributedDataParallel requires).
            self.evoformer.linear.requires_grad_(False)
        else:
            self.query_to_s = Linear(NUM_TOKENS, pairformer_stack["c_s"])
            self.msa_module = MSAModule.from_config(msa_module, backend=backend, cuda_graphs=cuda_graphs)
            self.pairformer = PairformerStack.from_config(pairformer_stack, backend=backend, cuda_graphs=cuda_graphs)
            # The single representation feeds AF3's diffusion module; this trunk reads only z, so
            # the last Pairformer block's single updates get no gradient, nor does the MSA module's
            # last update of m (not computed): frozen, as DistributedDataParallel requires.
            last, last_msa = self.pairformer.blocks[-1], self.msa_module.blocks[-1]
            for unused in (last.attn_pair_bias, last.single_transition, last_msa.pair_weighted_averaging,
                           last_msa.msa_transition):
                if unused is not None:
                    unused.requires_grad_(False)
        self.distogram = Linear(c_z, no_bins, init="final")

    def forward(
        self,
        msa: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        extra_msa: Optional[torch.Tensor] = None,
        extra_msa_mask: Optional[torch.Tensor] = None,
        chunk_size: Optional[int] = None,
    ) -> torch.Tensor:
        """``msa`` ``[B, N_seq, L]`` tokens (row 0 = query), ``msa_mask`` ``[B, N_seq, L]``,
        ``pair_mask`` ``[B, L, L]``; optional extra MSA ``[B, N_extra, L]``. Returns distogram
        logits ``[B, L, L, no_bins]``."""
        onehot = F.one_hot(msa, NUM_TOKENS).float()  # [B, N_seq, L, 21]
        query = onehot[:, 0]  # [B, L, 21]
        m = self.msa_embed(onehot) + self.query_to_m(query)[:, None]  # [B, N_seq, L, c_m]
        length = msa.shape[-1]
        offset = torch.arange(length, device=msa.device)
        offset = (offset[None, :] - offset[:, None]).clamp(-self.relpos_k, self.relpos_k) + self.relpos_k  # [L, L]
        z = (
            self.query_to_z_i(query)[:, :, None]  # [B, L, 1, c_z]
            + self.query_to_z_j(query)[:, None, :]  # [B, 1, L, c_z]
            + self.relpos(F.one_hot(offset, 2 * self.relpos_k + 1).float())  # [L, L, c_z]
        )  # [B, L, L, c_z]
        if self.extra_msa is not None and extra_msa is not None:
            e = self.extra_msa_embed(F.one_hot(extra_msa, NUM_TOKENS).float())  # [B, N_extra, L, c_e]
            z = self.extra_msa(e, z, extra_msa_mask, pair_mask, chunk_size=chunk_size)  # [B, L, L, c_z]
        if self.evoformer is not None:
            _, z, _ = self.evoformer(m, z, msa_mask, pair_mask, chunk_size=chunk_size)
        else:
            z = self.msa_module(m, z, msa_mask, pair_mask, chunk_size=chunk_size)
            s = self.query_to_s(query)  # [B, L, c_s]
            _, z = self.pairformer(s, z, msa_mask[:, 0], pair_mask, chunk_size=chunk_size)
        logits = self.distogram(z)  # [B, L, L, no_bins]
        return logits + logits.transpose(-2, -3)  # [B, L, L, no_bins], symmetric in (i, j)


def distogram_loss(logits: torch.Tensor, coords: torch.Tensor, pair_mask: torch.Tensor, edges: torch.Tensor):
    """Cross-entropy of the distogram against the true distance bins, averaged over the real pairs
    of each protein, then over proteins. ``logits`` ``[B, L, L, no_bins]``, ``coords`` ``[B, L, 3]``."""
    dist = torch.cdist(coords, coords)  # [B, L, L]
    target = torch.bucketize(dist, edges.to(dist.device), right=True)  # [B, L, L]: bin index
    ce = F.cross_entropy(logits.float().flatten(0, 2), target.flatten(), reduction="none")  # [B * L * L]
    ce = ce.view_as(dist)  # [B, L, L]
    per_protein = (ce * pair_mask).sum(dim=(-1, -2)) / pair_mask.sum(dim=(-1, -2)).clamp_min(1.0)  # [B]
    return per_protein.mean()


def bins_below(edges: torch.Tensor, cutoff: float) -> int:
    """How many distogram bins lie below ``cutoff``, which must be one of the ``edges``."""
    hits = (edges - cutoff).abs() < 1e-4
    if not bool(hits.any()):
        raise ValueError(f"contact cutoff {cutoff} Å must be a distogram bin edge; edges are {edges.tolist()}")
    return int(hits.nonzero()[0, 0]) + 1  # bins 0 .. n-1


def contact_probability(logits: torch.Tensor, edges: torch.Tensor, cutoff: float) -> torch.Tensor:
    """P(distance < cutoff) from distogram logits: the mass of the bins whose upper edge is at most
    ``cutoff`` (which must be one of the edges). Returns ``[B, L, L]``."""
    return torch.softmax(logits.float(), dim=-1)[..., : bins_below(edges, cutoff)].sum(dim=-1)


def top_l_precision(
    probs: torch.Tensor, contacts: torch.Tensor, lengths: torch.Tensor, min_separation: int, fraction: int = 5
) -> tuple[list[float], list[float]]:
    """Per protein: precision of the top ``L // fraction`` pairs with ``|i - j| >= min_separation``
    ranked by ``probs``, and the contact density of those pairs (the precision of a random ranking).
    ``probs``/``contacts`` ``[B, L, L]``; proteins without such pairs are skipped."""
    precisions, densities = [], []
    for p, c, n in zip(probs, contacts, lengths.tolist()):
        i, j = torch.triu_indices(n, n, offset=min_separation, device=p.device)
        if i.numel() == 0:
            continue
        truth = c[i, j].float()
        k = min(max(1, n // fraction), i.numel())
        top = p[i, j].topk(k).indices
        precisions.append(truth[top].mean().item())
        densities.append(truth.mean().item())
    return precisions, densities
