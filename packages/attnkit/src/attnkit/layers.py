"""Layers around any registered attention: multi-head projections and a small pre-norm stack.

These are conveniences for the lab and examples; the attention modules are the product.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .attention import Attention
from .errors import InvalidInputError


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(f"{name}: expected a positive int, got {value!r}")
    return value


def _make_attention(attention: str | Attention, num_heads: int, head_dim: int, options: dict) -> Attention:
    if isinstance(attention, Attention):
        if options:
            raise InvalidInputError(
                f"attention options {sorted(options)} were given with an already built attention module; "
                "pass them to attnkit.build instead"
            )
        return attention
    if not isinstance(attention, str):
        raise InvalidInputError(
            f"attention: expected a registered name or an attnkit.Attention, got {type(attention).__name__}"
        )
    from .registry import default_registry

    return default_registry().build_with_hints(
        attention, {"num_heads": num_heads, "head_dim": head_dim}, **options
    )


class MultiHeadAttention(nn.Module):
    """Multi-head attention with q/k/v/out projections around a registered attention.

    Args:
        dim: model width; ``dim = num_heads * head_dim``.
        num_heads: number of heads H.
        attention: a registered name (``"softmax"``, ``"performer"``, ...) or an
            :class:`attnkit.Attention` instance.
        bias: projections with bias.
        dropout: dropout on the output projection in training.
        **attention_options: passed to :func:`attnkit.build`.

    Shapes: ``x`` ``(B, L, dim)``, ``context`` ``(B, S, dim)``, output ``(B, L, dim)``.
    """

    def __init__(self, dim: int, num_heads: int, attention: str | Attention = "softmax", *,
                 bias: bool = True, dropout: float = 0.0, **attention_options: Any) -> None:
        super().__init__()
        _positive_int("dim", dim)
        _positive_int("num_heads", num_heads)
        if dim % num_heads:
            raise InvalidInputError(f"dim: expected a multiple of num_heads={num_heads}, got {dim}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.attention = _make_attention(attention, num_heads, self.head_dim, attention_options)
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(dim, dim, bias=bias)
        self.v_proj = nn.Linear(dim, dim, bias=bias)
        self.out_proj = nn.Linear(dim, dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def _split(self, x: Tensor) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.num_heads, self.head_dim).transpose(1, 2)

    def _merge(self, x: Tensor) -> Tensor:
        B, H, L, E = x.shape
        return x.transpose(1, 2).reshape(B, L, H * E)

    def _check_x(self, x: Any, name: str) -> None:
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            got = f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
            raise InvalidInputError(f"{name}: expected a (B, L, dim={self.dim}) tensor, got {got}")

    def forward(self, x: Tensor, context: Tensor | None = None, *, causal: bool = False,
                key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None) -> Tensor:
        """Self-attention over ``x``, or cross-attention from ``x`` to ``context``.

        ``key_padding_mask`` is ``(B, S)`` bool, True = real token (S = L for
        self-attention). ``attn_mask`` broadcasts to ``(B, H, L, S)``.
        """
        self._check_x(x, "x")
        src = x if context is None else context
        if context is not None:
            self._check_x(context, "context")
        q, k, v = self._split(self.q_proj(x)), self._split(self.k_proj(src)), self._split(self.v_proj(src))
        out = self.attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        return self.dropout(self.out_proj(self._merge(out)))

    def init_state(self, batch: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> Any:
        """Streaming state of the inner attention."""
        return self.attention.init_state(batch, device=device, dtype=dtype)

    def step(self, x: Tensor, state: Any) -> tuple[Tensor, Any]:
        """Consume ``x`` ``(B, T, dim)`` new positions; returns ``((B, T, dim), new_state)``."""
        self._check_x(x, "x")
        q, k, v = self._split(self.q_proj(x)), self._split(self.k_proj(x)), self._split(self.v_proj(x))
        out, state = self.attention.step(q, k, v, state)
        return self.dropout(self.out_proj(self._merge(out))), state


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    Args:
        dim: model width.
        num_heads: heads.
        attention: registered name or :class:`attnkit.Attention`.
        mlp_ratio: hidden width of the MLP as a multiple of ``dim``; 0 gives an
            attention-only block (as in Zoology's MQAR models).
        dropout: dropout after attention and MLP.
        attention_options: options for :func:`attnkit.build`.
    """

    def __init__(self, dim: int, num_heads: int, attention: str | Attention = "softmax", *,
                 mlp_ratio: float = 4.0, dropout: float = 0.0,
                 attention_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        if isinstance(mlp_ratio, bool) or not isinstance(mlp_ratio, (int, float)) or mlp_ratio < 0:
            raise InvalidInputError(f"mlp_ratio: expected a number >= 0 (0 = no MLP), got {mlp_ratio!r}")
        self.norm1 = nn.LayerNorm(dim)
        self.attn = MultiHeadAttention(dim, num_heads, attention, dropout=dropout, **(attention_options or {}))
        self.norm2: nn.Module | None = None
        self.mlp: nn.Module | None = None
        if mlp_ratio > 0:
            hidden = max(1, int(dim * mlp_ratio))
            self.norm2 = nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim), nn.Dropout(dropout))

    def _ffn(self, x: Tensor) -> Tensor:
        return x if self.mlp is None else x + self.mlp(self.norm2(x))

    def forward(self, x: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None,
                attn_mask: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.norm1(x), causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        return self._ffn(x)

    def init_state(self, batch: int, **kwargs: Any) -> Any:
        return self.attn.init_state(batch, **kwargs)

    def step(self, x: Tensor, state: Any) -> tuple[Tensor, Any]:
        h, state = self.attn.step(self.norm1(x), state)
        return self._ffn(x + h), state


class Transformer(nn.Module):
    """A stack of pre-norm :class:`TransformerBlock` and a final LayerNorm, ``(B, L, dim)`` in and out.

    Args:
        dim: model width.
        depth: number of blocks.
        num_heads: heads per block.
        attention: registered name used by every block.
        mlp_ratio: MLP hidden width multiple; 0 for attention-only blocks.
        dropout: dropout inside blocks.
        attention_options: options for :func:`attnkit.build`.
    """

    def __init__(self, dim: int, depth: int, num_heads: int, attention: str = "softmax", *,
                 mlp_ratio: float = 4.0, dropout: float = 0.0,
                 attention_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        _positive_int("depth", depth)
        self.blocks = nn.ModuleList(
            TransformerBlock(dim, num_heads, attention, mlp_ratio=mlp_ratio, dropout=dropout,
                             attention_options=attention_options)
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None,
                attn_mask: Tensor | None = None) -> Tensor:
        for block in self.blocks:
            x = block(x, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        return self.norm(x)

    def init_state(self, batch: int, **kwargs: Any) -> list[Any]:
        return [b.init_state(batch, **kwargs) for b in self.blocks]

    def step(self, x: Tensor, state: list[Any]) -> tuple[Tensor, list[Any]]:
        new = []
        for block, s in zip(self.blocks, state):
            x, s = block.step(x, s)
            new.append(s)
        return self.norm(x), new
