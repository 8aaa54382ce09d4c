"""``isab``: :class:`InducedAttention`, the induced set attention of the Set Transformer (Lee et al. 2019).

``m`` learned inducing points ``I`` first attend to the keys (pack), then the
queries attend to the packed result (unpack)::

    A = softmax(scale · I K^T)             (m, S)   padded keys excluded
    K_p = A K,  V_p = A V                  (m, D), (m, E)
    out = softmax(scale · Q K_p^T) V_p     (L, E)

O((L + S)·m·D). The Set Transformer's ISAB wraps each of the two attentions
in its own projections and feed-forward block (a model layer); the attention
contract here takes q, k, v already projected, so the packed keys and values
are the weighted sums of k and v themselves.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

import attnkit
from attnkit import InvalidInputError

from ..common import Float32Inside, check_bool, check_int, softmax_attend
from ..plugin import ISAB


class InducedAttention(Float32Inside, attnkit.Attention):
    """Induced set attention: learned inducing points pack the keys, the queries attend to the pack.

    Shapes: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` ->
    ``(B, H, L, E)``. Non-causal (also cross-attention); key padding (padded
    keys get no weight in the pack; a row with no real key gives 0).

    Args:
        num_heads: number of heads H (required with ``per_head=True``).
        head_dim: head dimension D of the inducing points (required).
        scale: multiplier of ``q·k`` in both attentions; None means ``1/sqrt(D)``.
        backend: ``"auto"`` or ``"torch"``.
        num_inducing: number of inducing points m (the paper uses 16 or 32).
        per_head: one set of inducing points per head instead of one shared set.

    Raises:
        InvalidInputError: an option of the wrong type or out of range.
        UnsupportedFeatureError: causal, ``attn_mask``, other mask kinds.
    """

    option_constraints = {"num_inducing": {"minimum": 1}}
    capabilities = ISAB.capabilities
    refusal_reasons = {
        "causal": "the inducing points attend to the whole key sequence, so every output sees every key",
        "attn_mask": "a per-pair mask cannot be applied through inducing points",
    }

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None, scale: float | None = None,
                 backend: str = "auto", num_inducing: int = 32, per_head: bool = False) -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.num_inducing = check_int("num_inducing", num_inducing)
        self.per_head = check_bool("per_head", per_head)
        if head_dim is None:
            raise InvalidInputError("head_dim: the inducing points are head_dim vectors; give head_dim")
        if per_head and num_heads is None:
            raise InvalidInputError("num_heads: per_head=True keeps inducing points per head; give num_heads")
        p = num_heads if per_head else 1
        bound = math.sqrt(6 / (num_inducing + head_dim))          # Xavier uniform, as the Set Transformer
        self.inducing = nn.Parameter(torch.empty(p, num_inducing, head_dim).uniform_(-bound, bound))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_inducing={self.num_inducing}, per_head={self.per_head}"

    def pack(self, k: Tensor, v: Tensor, scale: float, keep: Tensor | None) -> tuple[Tensor, Tensor]:
        """Packed keys ``(B, H, m, D)`` and values ``(B, H, m, E)``."""
        s = (scale * self.inducing.to(k.dtype)) @ k.transpose(-1, -2)          # (B, H or 1.., m, S)
        if keep is not None:
            s = s.masked_fill(~keep[:, None, None, :], torch.finfo(s.dtype).min)
        a = torch.softmax(s, -1)
        if keep is not None:
            a = a * keep[:, None, None, :].to(a.dtype)                          # no real key: all 0
        return a @ k, a @ v

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx) -> Tensor:
        k_p, v_p = self.pack(k, v, ctx.scale, ctx.key_padding_mask)
        return softmax_attend(q, (ctx.scale * k_p).transpose(-1, -2), v_p)
