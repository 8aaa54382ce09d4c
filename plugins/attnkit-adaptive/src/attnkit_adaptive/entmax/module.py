"""``EntmaxAttention``: alpha-entmax in place of softmax, alpha learned per head."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnkit import Attention
from attnkit.context import CallContext
from attnkit.errors import InvalidInputError

from .._checks import positive_int, real
from .ops import MIN_ALPHA, entmax_bisect

__all__ = ["EntmaxAttention"]


class EntmaxAttention(Attention):
    """Adaptively sparse attention (Correia et al. 2019): ``entmax_alpha(q kᵀ · scale) v`` with alpha per head.

    ``alpha = 2`` is sparsemax, ``alpha -> 1`` softmax; weights below the
    row's threshold are exactly 0. alpha is a parameter per head (``alpha``
    is its initial value, ``learn_alpha`` whether it trains), clamped to
    ``[1.0001, inf)`` in the forward pass (alpha = 1 runs as 1.0001, within
    ~1e-4 of softmax; the paper keeps alpha in (1, 2] with a sigmoid, here
    any alpha > 1 is allowed). Computed densely (``(B, H, L, S)`` scores) by
    bisection on the threshold (:func:`attnkit_adaptive.entmax.ops.entmax_bisect`),
    gradients of scores and alpha through the implicit function theorem.

    Every mask kind is honoured (materialised: masked pairs get weight 0,
    an additive ``attn_mask`` is added to the scores); fully masked rows give 0.

    Shapes: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` -> ``(B, H, L, E)``.

    Args:
        num_heads: H (one alpha per head).
        alpha: the initial alpha, >= 1 (a float, or one per head).
        learn_alpha: alpha is a trained parameter (else a fixed buffer).
        n_iter: bisection steps; None picks 60 in float64, 32 in float32.
        head_dim: when given, inputs must have this head dimension.
        scale: multiplier of ``q·k``; None means ``1/sqrt(D)``.
        backend: ``"auto"`` or ``"torch"``.

    Raises:
        InvalidInputError: ``alpha`` below 1 or not finite, a per-head ``alpha`` of the wrong length,
            ``n_iter`` or ``num_heads`` not a positive int.
    """

    def __init__(self, *, num_heads: int, alpha: float | list[float] = 1.5, learn_alpha: bool = True,
                 n_iter: int | None = None, head_dim: int | None = None, scale: float | None = None,
                 backend: str = "auto") -> None:
        super().__init__(num_heads=positive_int("num_heads", num_heads), head_dim=head_dim, scale=scale,
                         backend=backend)
        values = list(alpha) if isinstance(alpha, (list, tuple)) else [alpha] * self.num_heads
        if len(values) != self.num_heads:
            raise InvalidInputError(f"alpha: expected a float or {self.num_heads} floats (one per head), "
                                    f"got {len(values)} values")
        values = [real("alpha", a, low=1.0) for a in values]
        if not isinstance(learn_alpha, bool):
            raise InvalidInputError(f"learn_alpha: expected a bool, got {learn_alpha!r}")
        self.n_iter = None if n_iter is None else positive_int("n_iter", n_iter)
        init = torch.tensor(values, dtype=torch.get_default_dtype())
        if learn_alpha:
            self.alpha = nn.Parameter(init)
        else:
            self.register_buffer("alpha", init)
        self.learn_alpha = learn_alpha

    def alphas(self, dtype: torch.dtype | None = None) -> Tensor:
        """alpha per head as used, ``(H,)``: clamped to >= 1.0001, in the graph."""
        a = self.alpha.clamp_min(MIN_ALPHA)
        return a if dtype is None else a.to(dtype)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: CallContext) -> Tensor:
        s = torch.matmul(q, k.transpose(-1, -2)) * ctx.scale
        bias = ctx.bias(s.dtype)
        if bias is not None:
            s = s + bias
        keep = ctx.dense_keep()
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        w = entmax_bisect(s, self.alphas(s.dtype).view(1, -1, 1, 1), n_iter=self.n_iter)
        return torch.matmul(w, v)

    def lab_stats(self) -> dict[str, Any]:
        """For ``attnkit train``: alpha of each head."""
        return {"alpha": [round(float(a), 3) for a in self.alphas().detach()]}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, learn_alpha={self.learn_alpha}"
