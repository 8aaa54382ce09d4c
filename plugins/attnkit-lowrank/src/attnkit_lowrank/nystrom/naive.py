"""The plain reference of ``nystrom`` (the spec's ``reference``): loops, explicit landmarks and kernels.

Per batch row and head: the landmarks are written out as the mean of each
segment of the real tokens (python loops over the segments), the three
kernels as ``exp`` / row sums of explicit score matrices over the real keys
only, the convolution as a sum over shifted copies of V. The pseudo-inverse
is the mechanism's own iteration (:func:`attnkit_lowrank.common.nystrom_pinv`),
checked separately against :func:`torch.linalg.pinv`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.masks import Mask

from ..common import nystrom_pinv


def segment_means(x: Tensor, m: int) -> Tensor:
    """``m`` landmarks of the real tokens ``x`` ``(c, D)`` (segments of ``floor(j·c/m)`` boundaries)."""
    c = x.shape[0]
    rows = []
    for j in range(m):
        lo, hi = (j * c) // m, ((j + 1) * c) // m
        hi = max(hi, lo + 1)
        rows.append(x[lo:hi].mean(0))
    return torch.stack(rows)


def softmax_rows(s: Tensor) -> Tensor:
    """Row softmax written out: ``exp(s - rowmax) / rowsum``."""
    e = torch.exp(s - s.max(-1, keepdim=True).values)
    return e / e.sum(-1, keepdim=True)


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None,
              positions: Any = None) -> Tensor:
    """``nystrom`` the obvious way with ``attn``'s options; q ``(B, H, L, D)`` ... -> ``(B, H, L, E)``."""
    B, H, L, _ = q.shape
    S, E = k.shape[2], v.shape[-1]
    m = attn.landmark_count(L, S)
    scale = attn.get_scale(q)
    kpm = None if mask is None else mask.key_padding_mask
    out = q.new_zeros(B, H, L, E)
    for b in range(B):
        real = torch.arange(S) if kpm is None else torch.nonzero(kpm[b]).flatten()
        for h in range(H):
            kb, vb = k[b, h, real], v[b, h, real]
            if len(real) == 0:
                continue                                    # no real key: zeros
            q_l = segment_means(q[b, h], m)
            k_l = segment_means(kb, m)
            f = softmax_rows(scale * q[b, h] @ k_l.T)
            a = softmax_rows(scale * q_l @ k_l.T)
            g = softmax_rows(scale * q_l @ kb.T)
            out[b, h] = f @ nystrom_pinv(a, attn.pinv_iterations) @ g @ vb
    if attn.conv_weight is not None:
        w = attn.conv_weight.to(q.dtype)
        ks = w.shape[1]
        vz = v if kpm is None else torch.where(kpm[:, None, :, None], v, 0.0)
        for t in range(ks):
            shift = t - ks // 2                               # output i reads v[i + shift]
            lo, hi = max(0, -shift), min(L, S - shift)
            if lo < hi:
                out[:, :, lo:hi] = out[:, :, lo:hi] + w[None, :, t, None, None] * vz[:, :, lo + shift:hi + shift]
    return out
