"""Exact scaled dot-product attention (``softmax``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import Attention
from .masks import keep_mask, split_attn_mask
from .reference import naive_attention


class SoftmaxAttention(Attention):
    """Exact softmax attention, ``softmax(q kᵀ / sqrt(D)) v`` (Vaswani et al. 2017).

    Backends: ``sdpa`` (:func:`torch.nn.functional.scaled_dot_product_attention`,
    the default) and ``torch`` (the naive matmul-softmax-matmul path). Honours
    causal masks (bottom-right aligned when L != S), key padding, arbitrary bool
    or additive masks, cross-attention, and exact streaming through a KV cache.

    Args:
        num_heads: unused; accepted so every implementation builds alike.
        head_dim: unused; accepted so every implementation builds alike.
        scale: multiplier of ``q·k``; None means ``1/sqrt(D)``.
        backend: ``"auto"``, ``"sdpa"`` or ``"torch"``.
        dropout: dropout probability on the attention weights in training.
    """

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None,
                 scale: float | None = None, backend: str = "auto", dropout: float = 0.0) -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            from .errors import InvalidInputError

            raise InvalidInputError(f"dropout: expected a float in [0, 1), got {dropout!r}")
        self.dropout = float(dropout)

    def _forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool,
                 key_padding_mask: Tensor | None, attn_mask: Tensor | None) -> Tensor:
        scale = self.get_scale(q)
        p = self.dropout if self.training else 0.0
        backend = self.resolve_backend(q, k, v)
        if backend == "torch":
            if p:
                return self._torch_dropout(q, k, v, causal, key_padding_mask, attn_mask, scale, p)
            return naive_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                                   attn_mask=attn_mask, scale=scale)
        L, S = q.shape[-2], k.shape[-2]
        if key_padding_mask is None and attn_mask is None:
            if not causal or L == S:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, dropout_p=p)
        keep = keep_mask(L, S, causal=causal, key_padding_mask=key_padding_mask,
                         attn_mask=attn_mask, device=q.device)
        _, bias = split_attn_mask(attn_mask)
        row_any = None
        if keep is not None:
            row_any = keep.any(-1, keepdim=True)
            if not bool(row_any.all()):
                # open fully masked rows so SDPA sees no all -inf row, zero them after
                keep = keep | ~row_any
            else:
                row_any = None
        mask: Tensor | None
        if bias is None:
            mask = keep
        else:
            mask = bias if keep is None else bias.masked_fill(~keep, float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, dropout_p=p)
        if row_any is not None:
            out = out * row_any.to(out.dtype)
        return out

    @staticmethod
    def _torch_dropout(q, k, v, causal, kpm, attn_mask, scale, p):
        # naive path with dropout on the weights: weights = attention on identity values
        S = k.shape[-2]
        eye = torch.eye(S, dtype=q.dtype, device=q.device).expand(*v.shape[:2], S, S)
        weights = naive_attention(q, k, eye, causal=causal, key_padding_mask=kpm,
                                  attn_mask=attn_mask, scale=scale)
        return torch.matmul(F.dropout(weights, p), v)

    # -- streaming: a KV cache ------------------------------------------------
    def _init_state(self, batch: int, *, device: torch.device | None,
                    dtype: torch.dtype | None) -> dict[str, Any]:
        return {"batch": batch, "k": None, "v": None}

    def _step(self, q: Tensor, k: Tensor, v: Tensor, state: dict[str, Any]) -> tuple[Tensor, dict[str, Any]]:
        from .errors import InvalidInputError

        if not isinstance(state, dict) or "k" not in state:
            raise InvalidInputError(f"step: state must come from init_state(), got {type(state).__name__}")
        if q.shape[0] != state["batch"]:
            raise InvalidInputError(
                f"step: state was made for batch {state['batch']}, got q with batch {q.shape[0]}"
            )
        if state["k"] is None:
            keys, values = k, v
        else:
            if state["k"].shape[1:2] != k.shape[1:2] or state["k"].shape[-1] != k.shape[-1]:
                raise InvalidInputError(
                    f"step: cached keys have shape {tuple(state['k'].shape)}, new k {tuple(k.shape)} "
                    "disagrees on H or D"
                )
            keys = torch.cat([state["k"], k], dim=2)
            values = torch.cat([state["v"], v], dim=2)
        out = self._forward(q, keys, values, causal=True, key_padding_mask=None, attn_mask=None)
        return out, {"batch": state["batch"], "k": keys, "v": values}
