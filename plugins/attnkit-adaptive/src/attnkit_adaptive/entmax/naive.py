"""The plain reference of ``entmax``: the dense scores, the threshold by plain bisection then Newton steps.

Written independently of :mod:`attnkit_adaptive.entmax.ops`: the threshold
``tau`` of every row by 200 halvings (no gradient), then three Newton steps
``tau <- tau - f(tau) / f'(tau)`` through autograd (``f = sum p - 1``): the
gradient of the last iterate is the implicit one. Tests also hold it to
sort-based closed forms at alpha = 2 (sparsemax) and 1.5.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.masks import Geometry, Mask
from attnkit.positions import as_positions

__all__ = ["entmax_reference", "reference"]


def entmax_reference(scores: Tensor, alpha: Tensor, keep: Tensor | None = None) -> Tensor:
    """alpha-entmax of the last dimension, pairs outside ``keep`` 0, rows with none kept 0.

    Args:
        scores: ``(..., n)`` finite.
        alpha: broadcastable to ``scores[..., :1]``, > 1.
        keep: bool broadcastable to ``scores`` or None.
    """
    if keep is None:
        keep = torch.ones_like(scores, dtype=torch.bool)
    keep = keep.expand(scores.shape)
    a = alpha.to(scores.dtype)
    X = torch.where(keep, scores, torch.zeros((), dtype=scores.dtype)) * (a - 1)
    with torch.no_grad():
        big = torch.finfo(scores.dtype).max
        top = X.masked_fill(~keep, -big).amax(-1, keepdim=True)
        lo, hi = top - 1, top.clone()
        for _ in range(200):
            mid = (lo + hi) / 2
            total = torch.where(keep & (X > mid), (X - mid).clamp_min(0) ** (1 / (a - 1)), 0).sum(-1, keepdim=True)
            lo = torch.where(total >= 1, mid, lo)
            hi = torch.where(total >= 1, hi, mid)
        tau = (lo + hi) / 2
        support = keep & (X > tau)
    for _ in range(3):
        base = torch.where(support, X - tau, torch.ones((), dtype=X.dtype))
        p = torch.where(support, base ** (1 / (a - 1)), 0)
        dp = torch.where(support, base ** ((2 - a) / (a - 1)) / (a - 1), 0)
        f = p.sum(-1, keepdim=True) - 1
        d = dp.sum(-1, keepdim=True)
        tau = tau + f / torch.where(d > 0, d, torch.ones((), dtype=d.dtype))
    base = torch.where(support, X - tau, torch.ones((), dtype=X.dtype))
    p = torch.where(support, base ** (1 / (a - 1)), 0)
    total = p.sum(-1, keepdim=True)
    return p / torch.where(total > 0, total, torch.ones((), dtype=total.dtype))


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None, positions: Any = None) -> Tensor:
    """``entmax_alpha(scale · q kᵀ + bias) v`` over the pairs ``mask`` allows, the plain way.

    Args:
        attn: the built module (its alpha per head and scale).
        q, k, v: ``(B, H, L, D)``, ``(B, H, S, D)``, ``(B, H, S, E)``.
        mask: the resolved caller's mask or None.
        positions: as given to forward.

    Returns:
        ``(B, H, L, E)``.
    """
    B, H, L, _ = q.shape
    S = k.shape[2]
    s = torch.matmul(q, k.transpose(-1, -2)) * attn.get_scale(q)
    keep = None
    if mask is not None:
        geom = Geometry(B, H, L, S, q.device, as_positions(positions, L=L, S=S))
        keep = mask.dense(geom)
        bias = mask.bias(geom, s.dtype)
        if bias is not None:
            s = s + torch.where(keep.expand(s.shape), bias.expand(s.shape), torch.zeros((), dtype=s.dtype))
    w = entmax_reference(s, attn.alphas(s.dtype).view(1, -1, 1, 1), keep)
    return torch.matmul(w, v)
