"""The plain reference of ``luna``: per head, the pack and the unpack as explicit row softmaxes (per prefix
when causal)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.masks import Mask


def _attend(queries: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
    rows = []
    for x in queries:
        s = scale * keys @ x
        p = torch.exp(s - s.max())
        rows.append((p / p.sum()) @ values)
    return torch.stack(rows)


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None,
              positions: Any = None) -> Tensor:
    """``luna`` the obvious way with ``attn``'s learned packed sequence; ``(B, H, L, E)``.

    Non-causal: P packs the real keys, every query unpacks. Causal: query t
    unpacks the pack of the real keys among ``0..t`` (0 when there is none):
    with ``causal_form="paper"`` the mean of ``(elu(scale p·k_j) + 1) k_j`` over
    them, with ``"prefix-softmax"`` their softmax-weighted sum.
    """
    B, H, L, _ = q.shape
    S = k.shape[2]
    scale = attn.get_scale(q)
    kpm = None if mask is None else mask.key_padding_mask
    causal = mask is not None and mask.is_causal
    out = q.new_zeros(B, H, L, v.shape[-1])
    for b in range(B):
        for h in range(H):
            p = attn.packed[h if attn.per_head else 0].to(q.dtype)
            for i in range(L):
                real = [j for j in range(S) if (kpm is None or bool(kpm[b, j])) and (not causal or j <= i)]
                if not real:
                    continue
                kb, vb = k[b, h, real], v[b, h, real]
                if causal and attn.causal_form == "paper":
                    # the paper's causal pack: weights elu(scale p·k) + 1, averaged over the visible keys
                    w = torch.stack([torch.stack([torch.nn.functional.elu(scale * (pl @ kj)) + 1 for kj in kb])
                                     for pl in p])                          # (m, visible)
                    k_p, v_p = (w @ kb) / len(real), (w @ vb) / len(real)
                else:
                    k_p = _attend(p, kb, kb, scale)      # the packed sequence attends to the (visible) keys
                    v_p = _attend(p, kb, vb, scale)
                out[b, h, i] = _attend(q[b, h, i:i + 1], k_p, v_p, scale)[0]
    return out


def reference_state(attn: Any, q: Tensor, k: Tensor, v: Tensor, packed: Tensor | None = None) -> Tensor:
    """The next packed sequence ``LayerNorm(P + Attn(P, K, K))`` ``(B, H, m, D)``, explicitly, no padding."""
    B, H = q.shape[:2]
    scale = attn.get_scale(q)
    rows = []
    for b in range(B):
        for h in range(H):
            p = attn.packed[h if attn.per_head else 0].to(q.dtype) if packed is None else packed[b, h]
            x = p + _attend(p, k[b, h], k[b, h], scale)
            mu = x.mean(-1, keepdim=True)
            var = ((x - mu) ** 2).mean(-1, keepdim=True)
            rows.append((x - mu) / torch.sqrt(var + 1e-5))
    return torch.stack(rows).reshape(B, H, *rows[0].shape)
