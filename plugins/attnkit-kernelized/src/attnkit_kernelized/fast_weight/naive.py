"""The plain reference of ``fast-weight`` (the spec's ``reference``): the delta rule as a per-step loop.

The paper's equations (Schlag et al. 2021, eq. 23-25) with fast weights
``W`` of shape (E, M), one position at a time::

    v_bar = W_{t-1} phi(k_t);   W_t = W_{t-1} + beta_t (v_t - v_bar) phi(k_t)^T;   y_t = W_t phi(q_t)

with the module's feature map, normalisation, beta (learned projection or
fixed) and output scale; padded keys write nothing (skipped). No chunking,
no UT transform, no kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.errors import InvalidInputError
from attnkit.masks import Mask

from ..linear.naive import real_keys, zero_padded_keys


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None,
              positions: Any = None) -> Tensor:
    """``fast-weight`` (causal) computed step by step with ``attn``'s parameters and options; ``(B, H, L, E)``."""
    if mask is None or not mask.is_causal or not mask.kinds <= {"causal", "key_padding"}:
        raise InvalidInputError(f"fast-weight reference: expected a causal mask (and key padding), got {mask!r}")
    real = real_keys(mask, k)                                   # (B, S)
    k, v = zero_padded_keys(mask, k, v)
    phi_q, phi_k, beta = attn.phi(q), attn.phi(k), attn.betas(k)
    B, H, L, M = phi_q.shape
    W = phi_q.new_zeros(B, H, v.shape[-1], M)
    ys = []
    for t in range(L):
        k_t = phi_k[:, :, t]                                    # (B, H, M)
        v_bar = (W @ k_t.unsqueeze(-1)).squeeze(-1)             # (B, H, E)
        update = beta[:, :, t, None, None] * (v[:, :, t] - v_bar).unsqueeze(-1) * k_t.unsqueeze(-2)
        W = W + torch.where(real[:, t, None, None, None], update, torch.zeros_like(update))
        ys.append((W @ phi_q[:, :, t].unsqueeze(-1)).squeeze(-1))
    out = torch.stack(ys, dim=2) if ys else v.new_zeros(B, H, 0, v.shape[-1])
    return out if attn.scale is None else out * attn.scale
