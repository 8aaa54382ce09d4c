"""The plain reference of ``routing``: the dense mask counted from the same clusters, then masked softmax.

``N[i, j]`` counts the clusters that route both query ``i`` and key ``j``
(causal applied; padded positions are never routed). The output is the
softmax of ``scale·q_i·k_j + log N[i, j]`` over the pairs with ``N > 0`` —
what combining the clusters by their log-sum-exp computes — and 0 for a
query no cluster routed (or with no allowed key).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .clusters import route

__all__ = ["reference", "pair_counts"]


def pair_counts(attn: Any, q: Tensor, k: Tensor, *, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
    """int64 ``(B, H, L, L)``: clusters in which query i may attend key j (the dense mask, tests only)."""
    B, H, L, _ = q.shape
    qi, qok, ki, kok = route(q, k, attn.centroids_for(q), key_padding_mask)
    C = qi.shape[2]
    qm = torch.zeros(B, H, C, L, dtype=torch.long, device=q.device).scatter_add_(-1, qi, qok.long())
    km = torch.zeros(B, H, C, L, dtype=torch.long, device=q.device).scatter_add_(-1, ki, kok.long())
    n = torch.einsum("bhci,bhcj->bhij", qm, km)
    if causal:
        n = n * torch.ones(L, L, dtype=torch.long, device=q.device).tril()
    return n


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Any = None, positions: Any = None) -> Tensor:
    """``routing`` the O(L²) way, ``(B, H, L, E)``, with ``attn``'s centroids (not updated here)."""
    causal = mask is not None and mask.is_causal
    kpm = None if mask is None else mask.key_padding_mask
    if kpm is not None:
        kpm = kpm.to(q.device)
        keep = kpm[:, None, :, None]
        k = torch.where(keep, k, torch.zeros((), dtype=k.dtype, device=k.device))
        v = torch.where(keep, v, torch.zeros((), dtype=v.dtype, device=v.device))
    counts = pair_counts(attn, q, k, causal=causal, key_padding_mask=kpm)
    scores = torch.matmul(q, k.transpose(-1, -2)) * attn.get_scale(q)
    has = counts > 0
    bias = torch.where(has, counts.to(q.dtype).clamp(min=1).log(), torch.full_like(scores, float("-inf")))
    any_ = has.any(-1, keepdim=True)
    p = torch.softmax((scores + bias).masked_fill(~any_, 0.0), -1).masked_fill(~has, 0.0) * any_
    return torch.matmul(p, v)
