"""The plain reference of ``linformer`` (the spec's ``reference``): explicit projections, one head at a time.

Each projected key is written as the sum ``sum_j E[i, j] k_j`` over the S keys
(a loop over the projected positions), the softmax as ``exp`` over row sums.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.masks import Mask


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None,
              positions: Any = None) -> Tensor:
    """``linformer`` the obvious way with ``attn``'s projections; ``(B, H, L, E)``."""
    B, H, L, _ = q.shape
    S = k.shape[2]
    scale = attn.get_scale(q)
    e_all = attn.proj_k.to(q.dtype)
    f_all = e_all if attn.proj_v is None else attn.proj_v.to(q.dtype)
    out = q.new_zeros(B, H, L, v.shape[-1])
    for h in range(H):
        p = h if attn.per_head else 0
        e, f = e_all[p], f_all[p]
        for b in range(B):
            k_p = torch.stack([(e[i, :S, None] * k[b, h]).sum(0) for i in range(attn.proj_len)])
            v_p = torch.stack([(f[i, :S, None] * v[b, h]).sum(0) for i in range(attn.proj_len)])
            s = scale * q[b, h] @ k_p.T
            w = torch.exp(s - s.max(-1, keepdim=True).values)
            out[b, h] = (w / w.sum(-1, keepdim=True)) @ v_p
    return out
