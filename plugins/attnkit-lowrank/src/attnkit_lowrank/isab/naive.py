"""The plain reference of ``isab``: per head, the pack and the unpack as explicit row softmaxes over real keys."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.masks import Mask


def _attend(queries: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
    rows = []
    for x in queries:
        s = scale * keys @ x
        p = torch.exp(s - s.max())
        rows.append((p / p.sum()) @ values)
    return torch.stack(rows)


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None,
              positions: Any = None) -> Tensor:
    """``isab`` the obvious way with ``attn``'s inducing points; ``(B, H, L, E)``."""
    B, H, L, _ = q.shape
    S = k.shape[2]
    scale = attn.get_scale(q)
    kpm = None if mask is None else mask.key_padding_mask
    out = q.new_zeros(B, H, L, v.shape[-1])
    for b in range(B):
        real = torch.arange(S) if kpm is None else torch.nonzero(kpm[b]).flatten()
        if len(real) == 0:
            continue
        for h in range(H):
            ind = attn.inducing[h if attn.per_head else 0].to(q.dtype)
            kb, vb = k[b, h, real], v[b, h, real]
            k_p = _attend(ind, kb, kb, scale)          # the inducing points attend to the real keys
            v_p = _attend(ind, kb, vb, scale)
            out[b, h] = _attend(q[b, h], k_p, v_p, scale)
    return out
