"""The plain reference of ``informer``: per head, explicit sampled scores, a sort, and row-by-row attention."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.masks import Mask

from .module import causal_sample_indices, counts, sample_indices


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None,
              positions: Any = None) -> Tensor:
    """``informer`` the obvious way with ``attn``'s factor and seed; ``(B, H, L, E)``.

    Causal (``mask.is_causal``): query i's keys sampled from ``0..i``, its
    measure ``max - sum / (i+1)``, active iff fewer than u earlier queries have
    a measure >= its own; active rows attend to keys ``0..i``, lazy rows output
    ``mean(V[0..i])``.
    """
    if mask is not None and mask.is_causal:
        return _causal(attn, q, k, v)
    B, H, L, _ = q.shape
    S = k.shape[2]
    U, u = counts(attn.factor, L, S)
    idx = sample_indices(attn.seed, L, S, U, q.device)
    scale = attn.get_scale(q)
    out = q.new_zeros(B, H, L, v.shape[-1])
    for b in range(B):
        for h in range(H):
            m = []
            for i in range(L):
                s = torch.stack([q[b, h, i] @ k[b, h, j] for j in idx[i].tolist()])
                m.append(float((s.max() - s.sum() / S).detach()))
            active = set(sorted(range(L), key=lambda i: -m[i])[:u])
            for i in range(L):
                if i in active:
                    sc = scale * k[b, h] @ q[b, h, i]
                    p = torch.exp(sc - sc.max())
                    out[b, h, i] = (p / p.sum()) @ v[b, h]
                else:
                    out[b, h, i] = v[b, h].mean(0)
    return out


def _causal(attn: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    B, H, L, _ = q.shape
    U, u = counts(attn.factor, L, L)
    idx = causal_sample_indices(attn.seed, L, U, q.device)
    scale = attn.get_scale(q)
    out = q.new_zeros(B, H, L, v.shape[-1])
    for b in range(B):
        for h in range(H):
            m = []
            for i in range(L):
                assert all(j <= i for j in idx[i].tolist())
                s = torch.stack([q[b, h, i] @ k[b, h, j] for j in idx[i].tolist()])
                m.append(float((s.max() - s.sum() / (i + 1)).detach()))
            for i in range(L):
                if sum(1 for j in range(i) if m[j] >= m[i]) < u:
                    sc = scale * k[b, h, :i + 1] @ q[b, h, i]
                    p = torch.exp(sc - sc.max())
                    out[b, h, i] = (p / p.sum()) @ v[b, h, :i + 1]
                else:
                    out[b, h, i] = v[b, h, :i + 1].mean(0)
    return out
