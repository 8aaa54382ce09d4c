"""The plain references of ``transformer-xl``: the four terms with an explicit relative-index gather.

No relative shift: the encoding of every (query, key) pair's distance is
gathered into a ``(H, L, T, D)`` tensor and the four dot products are
written out one by one. ``reference`` is the spec's (one call, no memory);
``segment_reference`` is the streaming reference (a whole sequence cut into
segments of ``chunk`` positions with a memory of ``mem_len`` positions).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.masks import Geometry, Mask

from ..common import sinusoid


def gathered_encodings(attn: Any, dist: Tensor, dtype: torch.dtype) -> Tensor:
    """``W_r R_{dist[i, j]}`` gathered per pair: ``(H, L, T, D)`` (negative distances clamped to 0)."""
    H, D = attn.num_heads, attn.head_dim
    table = attn.r_proj(sinusoid(torch.arange(int(dist.max().clamp_min(0)) + 1, device=dist.device),
                                 attn.rel_dim, dtype))                           # (N, H*D)
    g = table[dist.clamp_min(0)]                                                  # (L, T, H*D) gather
    return g.view(*dist.shape, H, D).permute(2, 0, 1, 3)


def four_term_attention(attn: Any, q: Tensor, K: Tensor, V: Tensor, dist: Tensor, keep: Tensor,
                        scale: float, with_weights: bool = False) -> Any:
    """``softmax(scale * (AC + B + C + D))`` over kept keys (0 for rows that keep none) times V.

    q ``(B, H, L, D)``, K ``(B, H, T, D)``, V ``(B, H, T, E)``, dist ``(L, T)`` int,
    keep bool broadcastable to ``(B, H, L, T)``. With ``with_weights``: ``(out, weights (B, H, L, T))``.
    """
    R = gathered_encodings(attn, dist, q.dtype)                                   # (H, L, T, D)
    u = attn.u[None, :, None]
    content = q @ K.transpose(-1, -2)                                             # (a) q_i . k_j
    content_bias = (u @ K.transpose(-1, -2))                                      # (c) u . k_j
    position = torch.einsum("bhid,hijd->bhij", q, R)                              # (b) q_i . W_r R_{i-j}
    position_bias = torch.einsum("hd,hijd->hij", attn.v_bias, R)[None]            # (d) v . W_r R_{i-j}
    s = (content + content_bias + position + position_bias) * scale
    s = torch.where(keep, s, torch.full_like(s, float("-inf")))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.where(keep, (s - m).exp(), torch.zeros_like(s))
    den = w.sum(-1, keepdim=True)
    w = w / torch.where(den > 0, den, torch.ones_like(den))
    return (w @ V, w) if with_weights else w @ V


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None,
              positions: Any = None) -> Tensor:
    """One call without memory: causal (bottom-right) four-term relative attention. Returns ``(B, H, L, E)``."""
    B, H, L, _ = q.shape
    S = k.shape[2]
    i = torch.arange(L, device=q.device)[:, None]
    j = torch.arange(S, device=q.device)[None, :]
    dist = (S - L) + i - j
    keep = dist >= 0
    if mask is not None:
        keep = keep & mask.dense(Geometry(B, H, L, S, q.device, positions))
        kpm = mask.key_padding_mask
        if kpm is not None:
            pad = ~kpm[:, None, :, None]
            k, v = k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)
    return four_term_attention(attn, q, k, v, dist, keep, attn.get_scale(q))


def segment_reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, chunk: int) -> Tensor:
    """A whole sequence ``(B, H, N, ·)`` fed in segments of ``chunk`` with a memory of ``attn.mem_len``.

    Query ``n`` of the segment starting at ``a`` sees keys ``j`` with
    ``max(0, a - mem_len) <= j <= n`` at distance ``n - j``. Returns ``(B, H, N, E)``.
    """
    N = q.shape[2]
    n = torch.arange(N, device=q.device)[:, None]
    j = torch.arange(N, device=q.device)[None, :]
    start = (n // chunk) * chunk
    keep = (j <= n) & (j >= start - attn.mem_len)
    return four_term_attention(attn, q, k, v, n - j, keep, attn.get_scale(q))
