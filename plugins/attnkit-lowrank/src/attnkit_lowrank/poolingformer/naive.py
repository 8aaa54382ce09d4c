"""The plain reference of ``poolingformer``: per query, an explicit window of keys and explicit segment means."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from attnkit.masks import Mask


def _attend(x: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
    s = scale * keys @ x
    p = torch.exp(s - s.max())
    return (p / p.sum()) @ values


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None,
              positions: Any = None) -> Tensor:
    """``poolingformer`` the obvious way with ``attn``'s windows and pooling; ``(B, H, L, E)``.

    Key padding: per batch row the kept keys are listed in order and renumbered
    0..c-1; query i stands at the number of kept keys at or before it, minus one.
    """
    B, H, L, _ = q.shape
    scale = attn.get_scale(q)
    causal = mask is not None and mask.is_causal
    kpm = None if mask is None else mask.key_padding_mask
    r1, r2 = attn.window // 2, attn.pool_window // 2
    size, stride = attn.pool_size, attn.pool_stride
    out = q.new_zeros(B, H, L, v.shape[-1])
    for b in range(B):
        kept = list(range(L)) if kpm is None else [j for j in range(L) if bool(kpm[b, j])]
        c = len(kept)
        if c == 0:
            continue
        rank = [sum(1 for j in kept if j <= i) - 1 for i in range(L)]
        n_seg = 1 if c <= size else math.ceil((c - size) / stride) + 1
        segs = [(p * stride, min(p * stride + size, c)) for p in range(n_seg)]
        for h in range(H):
            kb, vb = k[b, h, kept], v[b, h, kept]
            kp = torch.stack([kb[s:e].mean(0) for s, e in segs])
            vp = torch.stack([vb[s:e].mean(0) for s, e in segs])
            for i in range(L):
                r = rank[i]
                near = [j for j in range(c) if abs(r - j) <= r1 and (not causal or j <= r)]
                y = _attend(q[b, h, i], kb[near], vb[near], scale) if near else q.new_zeros(v.shape[-1])
                seen = [p for p, (s, e) in enumerate(segs)
                        if e - 1 >= r - r2 and ((e - 1 <= r) if causal else (s <= r + r2))]
                z = _attend(q[b, h, i], kp[seen], vp[seen], scale) if seen else torch.zeros_like(y)
                out[b, h, i] = y + z
    return out
