"""The plain O(L·S) reference of ``performer`` (the spec's ``reference``).

The features as the paper writes them, with the module's random projection
(its ``features`` buffer) and scale: ``A = phi(Q) phi(K)^T`` with the dense
mask applied, ``out = A V / A 1`` (0 where a query sees no key). No chunking,
no state, no kernel.

The exponential maps are evaluated in log space so that the reference itself
stays exact for inputs of any norm (the features alone under- and overflow
even in float64 for q, k scaled by 100): for the positive map
``log A_ij = logsumexp_m (lq_im + lk_jm)`` with ``lq = W x - |x|^2/2``, and
``out_i = softmax_j(log A_ij) V`` over the keys query ``i`` sees; for the trig
map ``A_ij = (s_i . s_j) exp(|y_j|^2/2 - max_j' |y_j'|^2/2)`` (the max over the
keys query ``i`` sees; ``s`` the sine and cosine features, the per-query factor
``exp(|x_i|^2/2)`` cancelling). Both are ``phi(q_i) . phi(k_j)`` up to a factor per
query, which the normalisation removes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.masks import Mask

from ..common import normalize
from ..feature_maps import favor_generalized
from ..linear.naive import attention_from_features, dense_keep, real_keys, zero_padded_keys


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None,
              positions: Any = None) -> Tensor:
    """``performer`` computed the obvious way with ``attn``'s features, feature map and scale; ``(B, H, L, E)``."""
    keep = dense_keep(mask, q, k, positions)
    real = real_keys(mask, k)[:, None, None, :]                         # (B, 1, 1, S)
    keep = real if keep is None else keep & real
    k, v = zero_padded_keys(mask, k, v)
    s = attn.get_scale(q) ** 0.5
    w = attn.features.to(q.dtype)
    x, y = q * s, k * s                                                  # the features of sqrt(scale)·q, ·k
    if attn.feature_map == "generalized":
        return attention_from_features(favor_generalized(x, w), favor_generalized(y, w), v, keep)
    px, py = x @ w.T, y @ w.T
    if attn.feature_map == "positive":
        lq = px - 0.5 * (x * x).sum(-1, keepdim=True)                    # (B, H, L, M)
        lk = py - 0.5 * (y * y).sum(-1, keepdim=True)                    # (B, H, S, M)
        log_a = torch.logsumexp(lq.unsqueeze(-2) + lk.unsqueeze(-3), dim=-1)          # (B, H, L, S)
        log_a = log_a.masked_fill(~keep, float("-inf"))
        seen = keep.any(-1, keepdim=True)
        weights = torch.softmax(torch.where(seen, log_a, torch.zeros_like(log_a)), dim=-1)
        return torch.where(seen, weights @ v, torch.zeros(()))
    sq = torch.cat([torch.sin(px), torch.cos(px)], dim=-1)
    sk = torch.cat([torch.sin(py), torch.cos(py)], dim=-1)
    lk = (0.5 * (y * y).sum(-1)).unsqueeze(-2).expand(keep.shape[0], -1, q.shape[2], -1)   # (B, H, L, S)
    lk = lk.masked_fill(~keep, float("-inf"))
    top = lk.amax(-1, keepdim=True)
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    A = torch.where(keep, (sq @ sk.transpose(-1, -2)) * torch.exp(lk - top), torch.zeros(()))
    return normalize(A @ v, A.sum(-1))
