"""The plain reference of ``sparse-adaptive``: the whole ``(L, S)`` predictor matrix, top-k per row, dense softmax.

No chunks, no gathers: every pair's predictor score, the caller's mask
element by element, a bool edge matrix from ``topk`` per query, and the
dense masked softmax of ``scale · q kᵀ + e`` over the edges.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from attnkit.masks import Geometry, Mask

from .predictor import distance_bucket


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None, positions: Any = None) -> Tensor:
    """Sparse adaptive attention the dense way; rows with no edge are 0.

    Args:
        attn: the built module (predictor parameters, num_edges, scale).
        q, k, v: ``(B, H, L, D)``, ``(B, H, S, D)``, ``(B, H, S, E)``.
        mask: the resolved caller's mask or None.
        positions: unused (refused by the module).

    Returns:
        ``(B, H, L, E)``.
    """
    B, H, L, _ = q.shape
    S = k.shape[2]
    qr = torch.einsum("bhld,hdr->bhlr", q, attn.pred_q.to(q.dtype))
    kr = torch.einsum("bhsd,hdr->bhsr", k, attn.pred_k.to(q.dtype))
    e = torch.einsum("bhlr,bhsr->bhls", qr, kr) / math.sqrt(attn.predictor_dim)
    i = torch.arange(L)[:, None] + (S - L)
    j = torch.arange(S)[None, :]
    e = e + attn.distance_encoding.to(q.dtype)[:, distance_bucket((i - j).abs(), attn.distance_buckets)][None]
    keep = torch.ones(B, H, L, S, dtype=torch.bool)
    if mask is not None:
        keep = keep & mask.dense(Geometry(B, H, L, S, q.device, None))
    e = e.masked_fill(~keep, float("-inf"))
    idx = e.topk(min(attn.num_edges, S), dim=-1).indices
    edges = torch.zeros(B, H, L, S, dtype=torch.bool).scatter(-1, idx, True) & keep
    s = torch.matmul(q, k.transpose(-1, -2)) * attn.get_scale(q) + torch.where(edges, e, torch.zeros_like(e))
    s = s.masked_fill(~edges, float("-inf"))
    any_ = edges.any(-1, keepdim=True)
    w = torch.softmax(torch.where(any_, s, torch.zeros_like(s)), dim=-1) * any_
    return torch.matmul(w, v)
