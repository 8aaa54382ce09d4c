"""Exact scaled dot-product attention (``softmax``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import masks as _masks
from .attention import Attention
from .context import CallContext
from .errors import InvalidInputError, UnsupportedFeatureError
from .reference import masked_softmax_attention


class SoftmaxAttention(Attention):
    """Exact softmax attention, ``softmax(q kᵀ / sqrt(D)) v`` (Vaswani et al. 2017).

    Backends: ``sdpa`` (:func:`torch.nn.functional.scaled_dot_product_attention`,
    the default) and ``torch`` (the naive matmul-softmax-matmul path). Honours
    every mask kind (causal bottom-right aligned when L != S, key padding,
    bool or additive tensors, sliding windows, documents, mask functions and
    unions, materialised as a dense mask: this is the O(L·S) mechanism),
    positions, cross-attention, and exact streaming through a KV cache (with
    causal and key padding masks).

    Args:
        num_heads: when given, inputs must have this many heads.
        head_dim: when given, inputs must have this head dimension.
        scale: multiplier of ``q·k``; None means ``1/sqrt(D)``.
        backend: ``"auto"``, ``"sdpa"`` or ``"torch"``.
        dropout: dropout probability on the attention weights in training, in [0, 1).
    """

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None,
                 scale: float | None = None, backend: str = "auto", dropout: float = 0.0) -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise InvalidInputError(f"dropout: expected a float in [0, 1), got {dropout!r}")
        self.dropout = float(dropout)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: CallContext) -> Any:
        if ctx.return_state:
            return self._cached(q, k, v, ctx)
        return self._softmax(q, k, v, ctx.mask, ctx.geometry, ctx.scale, ctx.backend)

    def _softmax(self, q: Tensor, k: Tensor, v: Tensor, mask: _masks.Mask | None, geom: _masks.Geometry,
                 scale: float, backend: str) -> Tensor:
        p = self.dropout if self.training else 0.0
        if backend == "torch":
            keep = None if mask is None else mask.dense(geom)
            bias = None if mask is None else mask.bias(geom, q.dtype)
            if p:
                return self._torch_dropout(q, k, v, keep, bias, scale, p)
            return masked_softmax_attention(q, k, v, keep=keep, bias=bias, scale=scale)
        L, S = q.shape[-2], k.shape[-2]
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, scale=scale, dropout_p=p)
        if L == S and geom.positions is None and mask.kinds == {"causal"}:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=p)
        kpm_only = mask.kinds == {"key_padding"}
        keep = mask.key_padding_mask[:, None, None, :] if kpm_only else mask.dense(geom)
        bias = mask.bias(geom, q.dtype)
        row_any = keep.any(-1, keepdim=True)
        # (torch.compile and torch.export: no branch on the mask's values, one graph; opening and zeroing rows that
        # have keys changes nothing)
        all_rows = False if torch.compiler.is_compiling() else bool(row_any.all())
        if not all_rows:
            # open fully masked rows so SDPA sees no all -inf row, zero them after
            keep = keep | ~row_any
        attn_mask = keep if bias is None else bias.masked_fill(~keep, float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, dropout_p=p)
        if not all_rows:
            out = out * row_any.to(out.dtype)
        return out

    def _forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                 key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None) -> Tensor:
        """The version-1 spelling, kept for subclasses that override ``_forward`` and call ``super()``."""
        m = _masks.resolve(causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        geom = _masks.Geometry(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device, None)
        return self._softmax(q, k, v, m, geom, self.get_scale(q), self.resolve_backend(q, k, v))

    @staticmethod
    def _torch_dropout(q, k, v, keep, bias, scale, p):
        # naive path with dropout on the weights: weights = attention on identity values
        S = k.shape[-2]
        eye = torch.eye(S, dtype=q.dtype, device=q.device).expand(*v.shape[:2], S, S)
        weights = masked_softmax_attention(q, k, eye, keep=keep, bias=bias, scale=scale)
        return torch.matmul(F.dropout(weights, p), v)

    # -- streaming: a KV cache ------------------------------------------------
    def _init_state(self, batch: int, *, device: torch.device | None,
                    dtype: torch.dtype | None) -> dict[str, Any]:
        return {"k": None, "v": None, "kpm": None}

    def _cached(self, q: Tensor, k: Tensor, v: Tensor, ctx: CallContext) -> tuple[Tensor, dict[str, Any]]:
        mask = ctx.mask
        parts = mask.conjuncts() if mask is not None else []
        if any(p.kind not in ("causal", "key_padding") for p in parts):
            raise UnsupportedFeatureError(
                self.impl_name, f"{mask!r} with state=", "with a KV cache it honours causal and key_padding_mask")
        return self._append(q, k, v, ctx.state, ctx.key_padding_mask, ctx.scale, ctx.backend)

    def _append(self, q: Tensor, k: Tensor, v: Tensor, state: dict[str, Any], kpm: Tensor | None,
                scale: float, backend: str) -> tuple[Tensor, dict[str, Any]]:
        """Attend the chunk's queries to the cache plus the chunk (causal); padded keys arrive zeroed."""
        keys, values, cache_kpm = self._extend(state, k, v, kpm)
        geom = _masks.Geometry(q.shape[0], q.shape[1], q.shape[2], keys.shape[2], q.device, None)
        full = _masks.causal() if cache_kpm is None else _masks.causal() & _masks.key_padding(cache_kpm)
        out = self._softmax(q, keys, values, full, geom, scale, backend)
        return out, {"k": keys, "v": values, "kpm": cache_kpm}

    @staticmethod
    def _extend(state: dict[str, Any], k: Tensor, v: Tensor, kpm: Tensor | None
                ) -> tuple[Tensor, Tensor, Tensor | None]:
        if not isinstance(state, dict) or "k" not in state:
            raise InvalidInputError(f"step: state must come from init_state(), got {type(state).__name__}")
        if state["k"] is None:
            return k, v, kpm
        if state["k"].shape[1:2] != k.shape[1:2] or state["k"].shape[-1] != k.shape[-1]:
            raise InvalidInputError(
                f"step: cached keys have shape {tuple(state['k'].shape)}, new k {tuple(k.shape)} disagrees on H or D")
        keys = torch.cat([state["k"], k], dim=2)
        values = torch.cat([state["v"], v], dim=2)
        old, n_old = state["kpm"], state["k"].shape[2]
        if old is None and kpm is None:
            return keys, values, None
        B = k.shape[0]
        old = old if old is not None else torch.ones(B, n_old, dtype=torch.bool, device=k.device)
        new = kpm if kpm is not None else torch.ones(B, k.shape[2], dtype=torch.bool, device=k.device)
        return keys, values, torch.cat([old, new], dim=1)

    def _step(self, q: Tensor, k: Tensor, v: Tensor, state: dict[str, Any]) -> tuple[Tensor, dict[str, Any]]:
        return self._append(q, k, v, state, None, self.get_scale(q), self.resolve_backend(q, k, v))
