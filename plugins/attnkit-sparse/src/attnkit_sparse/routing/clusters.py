"""Routing's balanced clusters, shared by the module and its reference.

Queries and keys are compared with the centroids in the unit-sphere space they
share (``q̂ = q/‖q‖``, ``k̂ = k/‖k‖``, unit centroids ``μ_c``). Each cluster
``c`` routes the ``w`` queries with the largest ``q̂·μ_c`` and the ``w`` keys
with the largest ``k̂·μ_c`` (top-k per centroid: balanced clusters), where
``w = max(1, ceil(n / num_clusters))`` for the ``n`` real (non-padded)
positions of the batch element; padded positions are never routed. A query
attends the keys of every cluster that routed it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["route", "cluster_width", "unit"]


def unit(x: Tensor) -> Tensor:
    return torch.nn.functional.normalize(x, dim=-1, eps=1e-12)


def cluster_width(n: int, num_clusters: int) -> int:
    """Tokens each cluster routes for ``n`` real positions: ``max(1, ceil(n / num_clusters))``."""
    return max(1, math.ceil(n / num_clusters))


def route(q: Tensor, k: Tensor, centroids: Tensor, key_padding_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor,
                                                                                               Tensor]:
    """The routed positions of each cluster.

    Args:
        q, k: ``(B, H, L, D)``.
        centroids: ``(H', C, D)`` unit vectors, ``H'`` 1 or H.
        key_padding_mask: ``(B, L)`` bool (True = real) or None.

    Returns:
        ``(q_idx, q_ok, k_idx, k_ok)``: int64 ``(B, H, C, W)`` positions routed to each cluster, ascending
        (``W`` the widest batch element's width), and bool ``(B, H, C, W)`` which entries are used.
    """
    B, H, L, _ = q.shape
    C = centroids.shape[1]
    n = torch.full((B,), L, dtype=torch.long) if key_padding_mask is None else key_padding_mask.sum(-1).cpu()
    widths = torch.tensor([cluster_width(int(x), C) for x in n.tolist()], device=q.device)
    W = min(int(widths.max()), L)
    out = []
    for x in (q, k):
        s = torch.einsum("bhld,hcd->bhcl", unit(x.detach()), centroids.to(x.dtype))   # (B, H, C, L)
        if key_padding_mask is not None:
            s = s.masked_fill(~key_padding_mask.to(q.device)[:, None, None, :], float("-inf"))
        val, idx = s.topk(W, dim=-1)                                                   # (B, H, C, W)
        ok = (torch.arange(W, device=q.device) < widths.view(B, 1, 1, 1)) & (val > float("-inf"))
        idx = torch.where(ok, idx, torch.full_like(idx, L))                            # unused: sort last
        idx, order = idx.sort(-1)
        ok = ok.gather(-1, order)
        out += [torch.where(ok, idx, torch.zeros_like(idx)), ok]
    return out[0], out[1], out[2], out[3]
