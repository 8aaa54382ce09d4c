"""Sinkhorn attention's sorting: block summaries, the learned sorting network, Gumbel-Sinkhorn, sorted blocks.

Shared by the module and its reference. ``L`` is padded at the end to
``NB·b`` rows (``b = block_size``) with zero rows, which are never keys of
their own block and add zero vectors to the sorted blocks' mixtures.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["pad_blocks", "sort_matrix", "sorted_blocks", "sinkhorn"]


def pad_blocks(x: Tensor, b: int) -> Tensor:
    """``(B, H, L, F)`` zero-padded at the end to a multiple of ``b`` rows."""
    pad = -x.shape[2] % b
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x


def sinkhorn(logits: Tensor, iters: int, causal: bool) -> Tensor:
    """``(..., NB, NB)`` -> the (soft) sorting matrix.

    Bidirectional: ``iters`` alternating row and column normalisations in log
    space (a doubly stochastic matrix in the limit). Causal: row ``i`` may only
    take blocks ``j < i`` and is normalised over its row only (a column
    normalisation would let later blocks change earlier rows); row 0 is zero.
    """
    if causal:
        nb = logits.shape[-1]
        allowed = torch.ones(nb, nb, dtype=torch.bool, device=logits.device).tril(-1)
        z = logits.masked_fill(~allowed, float("-inf"))
        has = allowed.any(-1, keepdim=True)
        return torch.softmax(z.masked_fill(~has, 0.0), -1) * has
    z = logits
    for _ in range(iters):
        z = z - torch.logsumexp(z, -1, keepdim=True)
        z = z - torch.logsumexp(z, -2, keepdim=True)
    return z.exp()


def sort_matrix(k: Tensor, weight: Tensor, b: int, *, temperature: float, iters: int, causal: bool,
                noise: Tensor | None = None) -> Tensor:
    """``(B, H, NB, NB)`` sorting matrix from the keys ``k`` ``(B, H, L, D)`` (unpadded).

    Block summaries ``X_i`` = mean of the block's real keys (causal: of the blocks before it, so a row
    never sees its own block's future); logits ``R_ij = (X_i W)·X_j / sqrt(D)`` with the learned
    ``weight`` ``(H', D, D)``; ``(R + noise) / temperature`` through :func:`sinkhorn`.
    """
    B, H, L, D = k.shape
    nb = math.ceil(L / b)
    kp = pad_blocks(k, b).reshape(B, H, nb, b, D)
    counts = torch.full((nb,), float(b), dtype=k.dtype, device=k.device)
    counts[-1] = L - (nb - 1) * b
    summ = kp.sum(3)                                                      # (B, H, NB, D)
    if causal:   # block i is summarised by blocks 0..i-1 (their mean; zero for block 0)
        csum = torch.cumsum(summ, 2) - summ
        ccount = torch.cumsum(counts, 0) - counts
        x = csum / ccount.clamp(min=1).view(1, 1, nb, 1)
    else:
        x = summ / counts.view(1, 1, nb, 1)
    logits = torch.einsum("bhid,hde,bhje->bhij", x, weight.expand(H, D, D), x) / math.sqrt(D)
    if noise is not None:
        logits = logits + noise
    return sinkhorn(logits / temperature, iters, causal)


def sorted_blocks(x: Tensor, s: Tensor, b: int) -> Tensor:
    """``(B, H, NB·b, F)``: block ``i`` = ``Σ_j s[i, j] · block j`` of ``x`` ``(B, H, L, F)`` (zero-padded)."""
    B, H, _, F = x.shape
    nb = s.shape[-1]
    xb = pad_blocks(x, b).reshape(B, H, nb, b * F)
    return torch.matmul(s, xb).view(B, H, nb * b, F)
