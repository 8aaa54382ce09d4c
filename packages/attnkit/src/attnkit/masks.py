"""Mask helpers shared by implementations.

Conventions (the tensor contract):

* ``key_padding_mask``: bool ``(B, S)``, True = a real token.
* ``attn_mask``: bool (True = may attend) or additive float, broadcastable to
  ``(B, H, L, S)``; ``-inf`` in a float mask forbids the pair.
* ``causal=True`` with L != S is bottom-right aligned: query ``i`` sits at
  absolute position ``S - L + i`` (the KV-cache convention), so it may see keys
  ``j <= i + S - L``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def causal_keep(L: int, S: int, *, device: torch.device | str | None = None) -> Tensor:
    """Bool ``(L, S)``: True where query ``i`` may see key ``j`` (bottom-right aligned)."""
    i = torch.arange(L, device=device).unsqueeze(-1)
    j = torch.arange(S, device=device).unsqueeze(0)
    return j <= i + (S - L)


def split_attn_mask(attn_mask: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """Split an ``attn_mask`` into (bool keep mask, finite additive bias).

    A bool mask gives ``(mask, None)``. A float mask gives ``(isfinite-or-+inf
    keep, bias with -inf replaced by 0)``; the keep part is None when the
    float mask forbids nothing.
    """
    if attn_mask is None:
        return None, None
    if attn_mask.dtype == torch.bool:
        return attn_mask, None
    forbidden = torch.isneginf(attn_mask)
    bias = attn_mask.masked_fill(forbidden, 0.0)
    keep = ~forbidden if bool(forbidden.any()) else None
    return keep, bias


def keep_mask(
    L: int,
    S: int,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    attn_mask: Tensor | None = None,
    device: torch.device | str | None = None,
) -> Tensor | None:
    """Combine causal, padding and the bool part of ``attn_mask`` into one keep mask.

    Returns:
        bool tensor broadcastable to ``(B, H, L, S)`` (True = attend), at the
        smallest broadcast shape, or None when nothing is masked.
    """
    keep: Tensor | None = None
    if causal:
        keep = causal_keep(L, S, device=device)
    if key_padding_mask is not None:
        kpm = key_padding_mask[:, None, None, :]
        keep = kpm if keep is None else keep & kpm
    bool_part, _ = split_attn_mask(attn_mask)
    if bool_part is not None:
        keep = bool_part if keep is None else keep & bool_part
    return keep


def additive(keep: Tensor | None, bias: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """An additive float mask: ``bias`` where ``keep``, ``-inf`` elsewhere."""
    if keep is None and bias is None:
        return None
    if bias is None:
        out = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    else:
        out = bias.to(dtype)
    if keep is not None:
        out = out.masked_fill(~keep, float("-inf"))
    return out
