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
    """``poolingformer`` the obvious way with ``attn``'s windows and pooling; ``(B, H, L, E)``."""
    B, H, L, _ = q.shape
    scale = attn.get_scale(q)
    causal = mask is not None and mask.is_causal
    r1, r2 = attn.window // 2, attn.pool_window // 2
    size, stride = attn.pool_size, attn.pool_stride
    n_seg = 1 if L <= size else math.ceil((L - size) / stride) + 1
    segs = [(p * stride, min(p * stride + size, L)) for p in range(n_seg)]
    out = q.new_zeros(B, H, L, v.shape[-1])
    for b in range(B):
        for h in range(H):
            kp = torch.stack([k[b, h, s:e].mean(0) for s, e in segs])
            vp = torch.stack([v[b, h, s:e].mean(0) for s, e in segs])
            for i in range(L):
                near = [j for j in range(L) if abs(i - j) <= r1 and (not causal or j <= i)]
                y = _attend(q[b, h, i], k[b, h, near], v[b, h, near], scale)
                seen = [p for p, (s, e) in enumerate(segs)
                        if e - 1 >= i - r2 and ((e - 1 <= i) if causal else (s <= i + r2))]
                z = _attend(q[b, h, i], kp[seen], vp[seen], scale) if seen else torch.zeros_like(y)
                out[b, h, i] = y + z
    return out
