"""The plain reference of ``lsh``: the explicit dense mask from the same hashes, then masked softmax.

For every round the same hashes and sort as the module give each position its
chunk; ``N[i, j]`` counts the rounds in which ``j`` is in ``i``'s chunk or the
previous one (``j != i``, causal and key padding applied). The output is the
softmax of ``scale·q_i·k̂_j + log N[i, j]`` over the pairs with ``N > 0`` —
exactly what combining the rounds by their log-sum-exp computes — and ``v_i``
for a (non-padded) position with no pair at all (attention to itself only).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .hashing import buckets, n_buckets, real_lengths, rotations, sort_rounds, unit

__all__ = ["reference", "pair_counts"]


def pair_counts(attn: Any, k: Tensor, *, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
    """int64 ``(B, H, L, L)``: rounds in which query i may attend key j (the dense mask, tests only)."""
    B, H, L, D = k.shape
    cols = max(1, n_buckets(L, attn.bucket_size) // 2)
    rot = rotations(attn.seed, attn.n_hashes, D, cols, dtype=k.dtype, device=k.device)
    lengths = real_lengths(B, L, key_padding_mask, k.device)
    perm = sort_rounds(buckets(k, rot, attn.bucket_size, lengths), key_padding_mask)   # (B, H, R, L)
    rank = perm.argsort(dim=-1)                                          # position -> sorted index
    chunk = rank // attn.bucket_size                                     # (B, H, R, L)
    ci, cj = chunk[..., :, None], chunk[..., None, :]
    allowed = (cj == ci) | (cj == ci - 1)                                # (B, H, R, L, L)
    i = torch.arange(L, device=k.device)
    allowed = allowed & (i[:, None] != i[None, :])
    if causal:
        allowed = allowed & (i[None, :] <= i[:, None])
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, None, :]
    return allowed.sum(2)


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Any = None, positions: Any = None) -> Tensor:
    """``lsh`` the O(L²) way: ``(B, H, L, E)``, with ``attn``'s own seed, rounds and bucket size.

    Args:
        attn: the built :class:`~attnkit_sparse.lsh.attention.LSHAttention`.
        q, k, v: ``(B, H, L, D)``, ``(B, H, L, D)``, ``(B, H, L, E)`` (keys are hashed and normalised).
        mask: the resolved mask (causal and key padding only) or None.
        positions: unused (not supported by ``lsh``).
    """
    causal = mask is not None and mask.is_causal
    kpm = None if mask is None else mask.key_padding_mask
    if kpm is not None:  # as forward does: padded keys and values are zero (so is their hash input)
        kpm = kpm.to(q.device)
        keep = kpm[:, None, :, None]
        k = torch.where(keep, k, torch.zeros((), dtype=k.dtype, device=k.device))
        v = torch.where(keep, v, torch.zeros((), dtype=v.dtype, device=v.device))
    counts = pair_counts(attn, k, causal=causal, key_padding_mask=kpm)
    scores = torch.matmul(q, unit(k).transpose(-1, -2)) * attn.get_scale(q)
    has = counts > 0
    bias = torch.where(has, counts.to(q.dtype).clamp(min=1).log(), torch.full_like(scores, float("-inf")))
    any_ = has.any(-1, keepdim=True)
    p = torch.softmax((scores + bias).masked_fill(~any_, 0.0), -1).masked_fill(~has, 0.0) * any_
    out = torch.matmul(p, v)
    alone = ~any_[..., 0]                                                # (B, H, L): nothing but itself
    if kpm is not None:
        alone = alone & kpm[:, None, :]
    return torch.where(alone[..., None], v, out)
