"""The plain reference of ``soft`` (the spec's ``reference``): explicit bottleneck windows and kernels.

Per batch row and head: each bottleneck token is written out as the
convolution sum ``sum_t W[:, :, t] k_{j·s + t}`` (or the mean of its window),
each kernel entry as ``exp(-scale/2 · sum((x - y)^2))`` of an explicit
difference. The Newton-Raphson inverse is the mechanism's own iteration
(:func:`attnkit_lowrank.common.newton_pinv`), checked separately against
:func:`torch.linalg.pinv`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.masks import Mask

from ..common import newton_pinv


def gauss(x: Tensor, y: Tensor, scale: float) -> Tensor:
    """``(n, m)`` kernel matrix from explicit differences."""
    return torch.exp(-0.5 * scale * ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1))


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None,
              positions: Any = None) -> Tensor:
    """``soft`` the obvious way with ``attn``'s options and convolution; ``(B, H, L, E)``."""
    B, H, L, D = q.shape
    S, s = k.shape[2], attn.window
    m = -(-S // s)
    scale = attn.get_scale(q)
    w = None if attn.conv_weight is None else attn.conv_weight.to(q.dtype)
    out = q.new_zeros(B, H, L, v.shape[-1])
    for b in range(B):
        for h in range(H):
            kb = k[b, h]
            tokens = []
            for j in range(m):
                window = range(j * s, min((j + 1) * s, S))
                if w is None:
                    tokens.append(sum(kb[i] for i in window) / len(window))
                else:
                    tokens.append(sum(w[:, :, i - j * s] @ kb[i] for i in window))
            k_b = torch.stack(tokens)
            a_pinv = newton_pinv(gauss(k_b, k_b, scale), attn.pinv_iterations)
            out[b, h] = gauss(q[b, h], k_b, scale) @ a_pinv @ gauss(kb, k_b, scale).T @ v[b, h]
    return out
