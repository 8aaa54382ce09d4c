"""Plain softmax attention: the readable definition, and the float64 reference of the tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .masks import Geometry, Mask, resolve


def masked_softmax_attention(q: Tensor, k: Tensor, v: Tensor, *, keep: Tensor | None = None,
                             bias: Tensor | None = None, scale: float | None = None) -> Tensor:
    """``softmax(q kᵀ · scale + bias, masked by keep) v`` with fully masked rows 0 (never NaN).

    Args:
        q: ``(B, H, L, D)``; k: ``(B, H, S, D)``; v: ``(B, H, S, E)``.
        keep: bool broadcastable to ``(B, H, L, S)``, True = may attend; None = all.
        bias: additive float broadcastable to ``(B, H, L, S)``; None = 0.
        scale: default ``1/sqrt(D)``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if keep is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v)
    keep = keep.expand(scores.shape)
    scores = scores.masked_fill(~keep, float("-inf"))
    row_any = keep.any(-1, keepdim=True)
    # a fully masked row: softmax over zeros (no NaN), then zeroed
    scores = torch.where(row_any, scores, torch.zeros((), dtype=scores.dtype, device=scores.device))
    weights = torch.softmax(scores, dim=-1) * row_any
    return torch.matmul(weights, v)


def naive_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                    key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None,
                    scale: float | None = None, mask: Mask | None = None, positions: Any = None) -> Tensor:
    """Softmax attention written out, with the masks of :meth:`attnkit.Attention.forward`.

    Args:
        q: ``(B, H, L, D)``; k: ``(B, H, S, D)``; v: ``(B, H, S, E)``.
        causal: bottom-right aligned causal mask (query ``i`` sees ``j <= i + S - L``).
        key_padding_mask: bool ``(B, S)``, True = real token.
        attn_mask: bool (True = attend) or additive float, broadcastable to ``(B, H, L, S)``.
        scale: default ``1/sqrt(D)``.
        mask: an :class:`attnkit.masks.Mask`, ``&``-ed with the shorthands.
        positions: see :mod:`attnkit.positions`.

    Returns:
        ``(B, H, L, E)`` in the dtype of ``q``; rows with no visible key are 0.
    """
    from .positions import as_positions

    m = resolve(mask, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
    if m is None:
        return masked_softmax_attention(q, k, v, scale=scale)
    B, H, L, _ = q.shape
    geom = Geometry(B, H, L, k.shape[2], q.device, as_positions(positions, L=L, S=k.shape[2]))
    return masked_softmax_attention(q, k, v, keep=m.dense(geom), bias=m.bias(geom, q.dtype), scale=scale)


def reference_attention(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
    """:func:`naive_attention` computed in float64, returned in float64."""
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kwargs["attn_mask"] = mask.double()
    return naive_attention(q.double(), k.double(), v.double(), **kwargs)


def softmax_reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None,
                      positions: Any = None) -> Tensor:
    """The spec reference of exact softmax attention: the dense masked softmax, ``attn``'s scale.

    ``reference(attn, q, k, v, *, mask, positions)`` is the signature every
    spec's reference has (see ``AttentionSpec.reference``).
    """
    scale = getattr(attn, "scale", None)
    return naive_attention(q, k, v, mask=mask, positions=positions, scale=scale)
