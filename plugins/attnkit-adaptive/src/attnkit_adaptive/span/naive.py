"""The plain references of ``adaptive-span`` and ``dynamic-span``: the soft span mask over the full score matrix.

``reference(attn, q, k, v, *, mask, positions)`` builds the whole ``(L, S)``
score matrix, the distance ``x = i - j`` of every pair, the soft mask
``m_z(x) = clamp((R + z - x) / R, 0, 1)`` (0 for future keys) with the
module's own spans (``attn.spans_for(q)``: one per head, or one per query),
the caller's mask element by element, and ``m · exp(s) / sum(m · exp(s))``.
No blocks, no band: what the band path is held to in float64 (outputs and
gradients, the spans' included).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.masks import Geometry, Mask
from attnkit.positions import as_positions

__all__ = ["reference", "soft_span_mask"]


def soft_span_mask(z: Tensor, ramp: float, L: int, S: int) -> Tensor:
    """``m_z(i - j)`` for every (query, key), 0 for future keys.

    Args:
        z: spans broadcastable to ``(B, H, L)``.
        ramp: R > 0.

    Returns:
        ``(B', H, L, S)`` in the dtype of ``z``.
    """
    zb = z.reshape(z.shape[-3:]) if z.dim() != 3 else z
    i = torch.arange(L, device=z.device)[:, None] + (S - L)
    j = torch.arange(S, device=z.device)[None, :]
    x = (i - j).to(z.dtype)
    m = ((ramp + zb[..., None] - x) / ramp).clamp(0.0, 1.0)
    return m * (x >= 0).to(z.dtype)


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None, positions: Any = None) -> Tensor:
    """Soft-span attention the dense way: ``(B, H, L, S)`` scores, mask and weights; rows with no key are 0.

    Args:
        attn: the built module (its spans, ramp and scale).
        q, k, v: ``(B, H, L, D)``, ``(B, H, S, D)``, ``(B, H, S, E)``.
        mask: the resolved caller's mask (causal, key padding) or None.
        positions: unused by the span mechanisms (refused by them); accepted for the signature.

    Returns:
        ``(B, H, L, E)``.
    """
    B, H, L, _ = q.shape
    S = k.shape[2]
    s = torch.matmul(q, k.transpose(-1, -2)) * attn.get_scale(q)
    m = soft_span_mask(attn.spans_for(q), float(attn.ramp), L, S)
    keep = (m > 0).expand(B, H, L, S)
    if mask is not None:
        geom = Geometry(B, H, L, S, q.device, as_positions(positions, L=L, S=S))
        keep = keep & mask.dense(geom)
    s = s.masked_fill(~keep, float("-inf"))
    mx = s.detach().amax(-1, keepdim=True)
    mx = torch.where(torch.isinf(mx), torch.zeros((), dtype=mx.dtype, device=q.device), mx)
    w = torch.exp(s - mx) * m
    den = w.sum(-1, keepdim=True)
    return torch.matmul(w, v) / torch.where(den > 0, den, torch.ones((), dtype=den.dtype, device=q.device))
