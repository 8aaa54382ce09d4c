"""The plain reference of ``memory-compressed``: explicit window sums and a dense masked softmax, per head."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.masks import Mask


def _windows(x: Tensor, s: int, w: Tensor | None) -> Tensor:
    """Window summaries of ``x`` ``(S, C)``: ``sum_t W[:, :, t] x_{j·s+t}`` or the window mean."""
    S = x.shape[0]
    out = []
    for j in range(-(-S // s)):
        idx = range(j * s, min((j + 1) * s, S))
        out.append(sum(x[i] for i in idx) / len(idx) if w is None else sum(w[:, :, i - j * s] @ x[i] for i in idx))
    return torch.stack(out)


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None,
              positions: Any = None) -> Tensor:
    """``memory-compressed`` the obvious way with ``attn``'s convolutions; ``(B, H, L, E)``."""
    B, H, L, _ = q.shape
    S, s = k.shape[2], attn.stride
    scale = attn.get_scale(q)
    wk = None if attn.conv_k is None else attn.conv_k.to(q.dtype)
    wv = None if attn.conv_v is None else attn.conv_v.to(q.dtype)
    causal = mask is not None and mask.is_causal
    out = q.new_zeros(B, H, L, v.shape[-1])
    for b in range(B):
        for h in range(H):
            kc, vc = _windows(k[b, h], s, wk), _windows(v[b, h], s, wv)
            for i in range(L):
                seen = [j for j in range(kc.shape[0]) if not causal or min((j + 1) * s, S) - 1 <= i]
                if not seen:
                    continue
                sc = scale * kc[seen] @ q[b, h, i]
                p = torch.exp(sc - sc.max())
                out[b, h, i] = (p / p.sum()) @ vc[seen]
    return out
