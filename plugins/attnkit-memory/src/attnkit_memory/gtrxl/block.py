"""``gtrxl``: the gated Transformer-XL block (GTrXL) of Parisotto et al. (2020), arXiv:1910.06764.

Both sub-layers take a layer-normed input (the "identity map reordering") and
their ReLU'd outputs enter a GRU-type gate instead of the residual sum::

    y = attn(LN(x));          x' = g1(x, relu(y))
    z = mlp(LN(x'));          out = g2(x', relu(z))

    g(x, y): r = sigmoid(W_r y + U_r x)
             z = sigmoid(W_z y + U_z x - b_g)
             h = tanh(W_g y + U_g (r * x))
             g = (1 - z) * x + z * h

With the gate bias ``b_g > 0`` (default 2) the update gate starts near 0, so
a freshly initialised block is close to the identity map (the larger ``b_g``,
the closer). The attention is any registered name; with a ``"segment"``
streaming attention (``transformer-xl``) the block carries its state
(``forward(..., state=..., return_state=True)``, ``init_state``, ``step``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnkit import Attention, Block, MultiHeadAttention
from attnkit.errors import InvalidInputError

__all__ = ["GRUGate", "GatedTransformerBlock"]


class GRUGate(nn.Module):
    """The GRU-type gating layer ``g(x, y)`` with update-gate bias ``-b_g``.

    Args:
        dim: width.
        gate_bias: ``b_g``; > 0 starts the gate near the identity ``g(x, y) = x``.

    Shapes: ``x``, ``y`` ``(..., dim)`` -> ``(..., dim)``.
    """

    def __init__(self, dim: int, gate_bias: float = 2.0) -> None:
        super().__init__()
        self.w = nn.Linear(dim, 3 * dim, bias=False)   # W_r, W_z, W_g
        self.u_rz = nn.Linear(dim, 2 * dim, bias=False)  # U_r, U_z
        self.u_g = nn.Linear(dim, dim, bias=False)     # U_g
        self.gate_bias = float(gate_bias)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        wr, wz, wg = self.w(y).chunk(3, dim=-1)
        ur, uz = self.u_rz(x).chunk(2, dim=-1)
        r = torch.sigmoid(wr + ur)
        z = torch.sigmoid(wz + uz - self.gate_bias)
        h = torch.tanh(wg + self.u_g(r * x))
        return (1 - z) * x + z * h


class GatedTransformerBlock(Block):
    """GTrXL block: LN on each sub-layer input, GRU gates in place of both residual connections.

    Args:
        dim: model width.
        num_heads: heads.
        attention: a registered attention name or an :class:`attnkit.Attention`.
        mlp_ratio: hidden width of the MLP as a multiple of ``dim`` (> 0).
        gate_bias: ``b_g`` of both gates (> 0: identity-like start; 2 as in the paper's best runs).
        dropout: dropout on the attention output projection and the MLP output.
        attention_options: options for :func:`attnkit.build`.
        **options: more options for :func:`attnkit.build`.

    Shapes: ``x`` ``(B, L, dim)`` -> ``(B, L, dim)``.

    Raises:
        InvalidInputError: ``mlp_ratio`` <= 0, a non-finite ``gate_bias``, a bad ``dropout``.
    """

    def __init__(self, dim: int, num_heads: int, attention: str | Attention = "softmax", *,
                 mlp_ratio: float = 4.0, gate_bias: float = 2.0, dropout: float = 0.0,
                 attention_options: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__()
        if isinstance(mlp_ratio, bool) or not isinstance(mlp_ratio, (int, float)) or not mlp_ratio > 0:
            raise InvalidInputError(f"mlp_ratio: expected a number > 0, got {mlp_ratio!r}")
        if isinstance(gate_bias, bool) or not isinstance(gate_bias, (int, float)) \
                or not abs(float(gate_bias)) < float("inf"):
            raise InvalidInputError(f"gate_bias: expected a finite float (> 0 starts near identity), got {gate_bias!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise InvalidInputError(f"dropout: expected a float in [0, 1), got {dropout!r}")
        both = set(options) & set(attention_options or {})
        if both:
            raise InvalidInputError(f"attention options {sorted(both)} given twice (attention_options and keywords)")
        hidden = max(1, int(dim * mlp_ratio))
        self.norm1 = nn.LayerNorm(dim)
        self.attn = MultiHeadAttention(dim, num_heads, attention, dropout=dropout,
                                       **{**(attention_options or {}), **options})
        self.gate1 = GRUGate(dim, gate_bias)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim), nn.Dropout(dropout))
        self.gate2 = GRUGate(dim, gate_bias)

    def _after_attention(self, x: Tensor, y: Tensor) -> Tensor:
        x = self.gate1(x, torch.relu(y))
        return self.gate2(x, torch.relu(self.mlp(self.norm2(x))))

    def forward(self, x: Tensor, *, mask: Any = None, causal: bool = False, key_padding_mask: Tensor | None = None,
                attn_mask: Tensor | None = None, positions: Any = None, state: Any = None,
                return_state: bool = False) -> Tensor | tuple[Tensor, Any]:
        """``(B, L, dim)`` in and out; masks, positions and state as in :meth:`attnkit.Attention.forward`."""
        y = self.attn(self.norm1(x), mask=mask, causal=causal, key_padding_mask=key_padding_mask,
                      attn_mask=attn_mask, positions=positions, state=state, return_state=return_state)
        if return_state:
            y, state = y
            return self._after_attention(x, y), state
        return self._after_attention(x, y)

    def init_state(self, batch: int, **kwargs: Any) -> Any:
        """The inner attention's state (``attnkit.AttentionState``)."""
        return self.attn.init_state(batch, **kwargs)

    def step(self, x: Tensor, state: Any) -> tuple[Tensor, Any]:
        """Consume ``x`` ``(B, T, dim)``; returns ``((B, T, dim), new_state)``."""
        y, state = self.attn.step(self.norm1(x), state)
        return self._after_attention(x, y), state
