"""Naive attention: the readable definition, and the float64 reference of the tests."""

from __future__ import annotations

import torch
from torch import Tensor

from .masks import keep_mask, split_attn_mask


def naive_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                    key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None,
                    scale: float | None = None) -> Tensor:
    """Softmax attention written out: ``softmax(q kᵀ · scale + bias, masked) v``.

    Args:
        q: ``(B, H, L, D)``; k: ``(B, H, S, D)``; v: ``(B, H, S, E)``.
        causal: bottom-right aligned causal mask (query ``i`` sees ``j <= i + S - L``).
        key_padding_mask: bool ``(B, S)``, True = real token.
        attn_mask: bool (True = attend) or additive float, broadcastable to ``(B, H, L, S)``.
        scale: default ``1/sqrt(D)``.

    Returns:
        ``(B, H, L, E)`` in the dtype of ``q``; rows with no visible key are 0.
    """
    L, S = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    _, bias = split_attn_mask(attn_mask)
    if bias is not None:
        scores = scores + bias
    keep = keep_mask(L, S, causal=causal, key_padding_mask=key_padding_mask,
                     attn_mask=attn_mask, device=q.device)
    if keep is not None:
        keep = keep.expand(scores.shape)
        scores = scores.masked_fill(~keep, float("-inf"))
        row_any = keep.any(-1, keepdim=True)
        # a fully masked row: softmax over zeros (no NaN), then zeroed
        scores = torch.where(row_any, scores, torch.zeros((), dtype=scores.dtype, device=scores.device))
        weights = torch.softmax(scores, dim=-1) * row_any
    else:
        weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, v)


def reference_attention(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
    """:func:`naive_attention` computed in float64, returned in float64."""
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kwargs["attn_mask"] = mask.double()
    return naive_attention(q.double(), k.double(), v.double(), **kwargs)
