"""The plain reference of ``clustered`` and ``improved-clustered``: explicit hashes, K-means and per-query attention.

The hash codes and the Lloyd iterations are written out with python loops
over queries and clusters (integer Hamming distances, ties to the lower
cluster, majority votes), each cluster's centroid as the mean of its
members, each output row by its own softmax.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.masks import Mask

from .module import hyperplanes


def _kmeans(codes: list[tuple[int, ...]], C: int, iterations: int) -> list[int]:
    L, nb = len(codes), len(codes[0])
    cent = [codes[(c * L) // C] for c in range(C)]

    def nearest(x):
        d = [sum(a != b for a, b in zip(x, cc)) for cc in cent]
        return d.index(min(d))

    assign = [nearest(x) for x in codes]
    for _ in range(iterations):
        for c in range(C):
            members = [codes[i] for i in range(L) if assign[i] == c]
            if members:
                cent[c] = tuple(int(2 * sum(m[b] for m in members) > len(members)) for b in range(nb))
        assign = [nearest(x) for x in codes]
    return assign


def _softmax_rows(s: Tensor, keep: Tensor) -> Tensor:
    if not bool(keep.any()):
        return torch.zeros_like(s)
    s = s.masked_fill(~keep, float("-inf"))
    e = torch.exp(s - s.max(-1, keepdim=True).values)
    return e / e.sum(-1, keepdim=True)


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None,
              positions: Any = None) -> Tensor:
    """``clustered`` / ``improved-clustered`` the obvious way with ``attn``'s options; ``(B, H, L, E)``."""
    B, H, L, D = q.shape
    S = k.shape[2]
    C = attn.cluster_count(L)
    top_k = attn.top_k_count(S) if hasattr(attn, "top_k_count") else None
    scale = attn.get_scale(q)
    kpm = None if mask is None else mask.key_padding_mask
    w = hyperplanes(attn.seed, attn.bits, D, q.dtype, q.device)
    out = q.new_zeros(B, H, L, v.shape[-1])
    for b in range(B):
        keep = torch.ones(S, dtype=torch.bool) if kpm is None else kpm[b]
        for h in range(H):
            codes = [tuple(int(x) for x in (q[b, h, i] @ w > 0)) for i in range(L)]
            assign = _kmeans(codes, C, attn.iterations)
            for c in range(C):
                members = [i for i in range(L) if assign[i] == c]
                if not members:
                    continue
                centroid = torch.stack([q[b, h, i] for i in members]).mean(0)
                score = (scale * k[b, h] @ centroid).masked_fill(~keep, float("-inf"))
                a = _softmax_rows(scale * k[b, h] @ centroid, keep)
                if top_k is None:
                    for i in members:
                        out[b, h, i] = a @ v[b, h]
                    continue
                # the centroid's top_k keys by score (the same order as by weight, without underflow ties)
                top = sorted(range(S), key=lambda j: -float(score[j].detach()))[:top_k]
                others = [j for j in range(S) if j not in top]
                mass = sum(a[j] for j in top)
                for i in members:
                    tk = torch.tensor(top)
                    p = _softmax_rows(scale * k[b, h, tk] @ q[b, h, i], keep[tk])
                    rest = sum((a[j] * v[b, h, j] for j in others), torch.zeros_like(v[b, h, 0]))
                    out[b, h, i] = mass * (p @ v[b, h, tk]) + rest
    return out
