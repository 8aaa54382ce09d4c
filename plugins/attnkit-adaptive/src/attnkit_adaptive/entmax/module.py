"""``EntmaxAttention``: alpha-entmax in place of softmax, alpha learned per head."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnkit import Attention
from attnkit.context import CallContext
from attnkit.errors import InvalidInputError

from .._checks import positive_int, real
from .._half import Float32Inside
from .ops import MIN_ALPHA, bisection_iterations, entmax_bisect

DTYPE_NAME = {torch.float32: "float32", torch.float64: "float64"}

__all__ = ["EntmaxAttention"]


class EntmaxAttention(Float32Inside, Attention):
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
        n_iter: bisection halvings of the threshold's unit bracket; None picks the dtype's
            resolution, 60 in float64 and 32 in float32. More are allowed; fewer are refused
            (at build below 32, at the call below the dtype's count), because the threshold would
            stop short of the dtype's resolution and the weights would not be alpha-entmax.
        head_dim: when given, inputs must have this head dimension.
        scale: multiplier of ``q·k``; None means ``1/sqrt(D)``.
        backend: ``"auto"`` or ``"torch"``.

    Raises:
        InvalidInputError: ``alpha`` below 1 or not finite, a per-head ``alpha`` of the wrong length,
            ``num_heads`` not a positive int, ``n_iter`` below 32 (or, at the call, below 60 for
            float64 inputs).
    """

    #: the least n_iter any accepted dtype can use (float32's resolution); float64 calls need 60
    option_constraints = {"n_iter": {"minimum": 32}}

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
        if self.n_iter is not None and self.n_iter < bisection_iterations(torch.float32):
            raise InvalidInputError(
                f"n_iter: expected None or at least {bisection_iterations(torch.float32)} halvings (float32's "
                f"resolution of the threshold; float64 needs {bisection_iterations(torch.float64)}), got "
                f"{self.n_iter}: fewer leave the threshold short and the weights are not alpha-entmax")
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
        need = bisection_iterations(s.dtype)
        if self.n_iter is not None and self.n_iter < need:
            raise InvalidInputError(
                f"n_iter={self.n_iter}: {DTYPE_NAME.get(s.dtype, s.dtype)} inputs need at least {need} bisection "
                "halvings to reach the dtype's resolution of the threshold; build with n_iter=None (the dtype's "
                f"count) or n_iter>={need}")
        w = entmax_bisect(s, self.alphas(s.dtype).view(1, -1, 1, 1), n_iter=self.n_iter)
        return torch.matmul(w, v)

    def lab_stats(self) -> dict[str, Any]:
        """For ``attnkit train``: alpha of each head."""
        return {"alpha": [round(float(a), 3) for a in self.alphas().detach()]}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, learn_alpha={self.learn_alpha}"
