"""The plain O(L·S) reference of ``rfa`` (the spec's ``reference``).

Non-causal: ungated, ``A = phi(Q) phi(K)^T`` with the dense mask multiplied
in, ``out = A V / A 1``. Causal: the gated recurrence written as an explicit
L x S weighting, ``A_tj = phi(q_t) . phi(k_j) (1 - g_j) prod_{j < i <= t} g_i``
for ``j <= t`` (the dense causal mask multiplied in), with ``g = 1`` and
``phi(k) = 0`` at padded keys. The module's random frequencies, sigma and gate
parameters; no chunking, state or kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.masks import Mask

from ..linear.naive import attention_from_features, dense_keep, real_keys, zero_padded_keys


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None,
              positions: Any = None) -> Tensor:
    """``rfa`` computed the obvious way with ``attn``'s parameters and options; ``(B, H, L, E)``."""
    keep = dense_keep(mask, q, k, positions)
    real = real_keys(mask, k)[:, None, :]                             # (B, 1, S)
    k, v = zero_padded_keys(mask, k, v)
    phi_q, phi_k = attn.phi(q), attn.phi(k) * real.unsqueeze(-1)
    causal = mask is not None and mask.is_causal
    if not causal or not attn.gate:
        return attention_from_features(phi_q, phi_k, v, keep)
    g = torch.where(real, torch.sigmoid(attn.gate_logits(k)), torch.ones(()))          # (B, H, S)
    write = torch.where(real, 1 - g, torch.zeros(()))                                   # (1 - g_j)
    L, S = q.shape[2], k.shape[2]
    # decay[t, j] = prod of g_i over j < i <= t, a product of explicit factors for each pair
    decay = torch.ones(*g.shape[:2], L, S, dtype=q.dtype, device=q.device)
    for t in range(L):
        for j in range(t):
            decay[:, :, t, j] = g[:, :, j + 1:t + 1].prod(-1)
    return attention_from_features(phi_q, phi_k, v, keep, weight=decay * write.unsqueeze(-2))
