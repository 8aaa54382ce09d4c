"""The plain O(L·S) reference of ``linear`` (the spec's ``reference``), and the helpers the other references share.

Explicit feature matrices, the attention matrix ``A = phi(Q) phi(K)^T`` with the
dense mask multiplied in, ``out = A V / A 1`` (0 where a query sees no key).
No chunking, no state, no stabiliser, no kernel: what every backend is held to.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.masks import Geometry, Mask

from ..common import normalize
from ..feature_maps import deterministic_feature_map


def dense_keep(mask: Mask | None, q: Tensor, k: Tensor, positions: Any = None) -> Tensor | None:
    """The mask as bool ``(B', H', L, S)`` (True = may attend), or None."""
    if mask is None:
        return None
    B, H, L, _ = q.shape
    return mask.dense(Geometry(B, H, L, k.shape[2], q.device, positions))


def real_keys(mask: Mask | None, k: Tensor) -> Tensor:
    """Bool ``(B, S)``: True at real keys (the mask's key padding parts), everywhere when none."""
    kpm = None if mask is None else mask.key_padding_mask
    return torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device) if kpm is None else kpm


def zero_padded_keys(mask: Mask | None, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``k`` and ``v`` with padded keys set to 0 (padded keys have no influence, whatever they hold)."""
    pad = ~real_keys(mask, k)[:, None, :, None]
    return k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)


def attention_from_features(phi_q: Tensor, phi_k: Tensor, v: Tensor, keep: Tensor | None,
                            weight: Tensor | None = None) -> Tensor:
    """``sum_j A_ij v_j / sum_j A_ij`` with ``A = phi_q phi_k^T`` (times ``weight``) where ``keep``, else 0."""
    A = phi_q @ phi_k.transpose(-1, -2)
    if weight is not None:
        A = A * weight
    if keep is not None:
        A = torch.where(keep, A, torch.zeros_like(A))
    return normalize(A @ v, A.sum(-1))


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None,
              positions: Any = None) -> Tensor:
    """``linear`` computed the obvious way with ``attn``'s options (feature map, DPFP rolls, scale).

    Returns:
        ``(B, H, L, E)``.
    """
    keep = dense_keep(mask, q, k, positions)
    k, v = zero_padded_keys(mask, k, v)
    if attn.scale is not None:
        q, k = q * attn.scale ** 0.5, k * attn.scale ** 0.5
    phi = deterministic_feature_map(attn.feature_map, nu=attn.dpfp_nu)
    return attention_from_features(phi(q), phi(k), v, keep)
