"""alpha-entmax by bisection, with the gradient through the implicit function theorem (scores and alpha).

``entmax_alpha(z)_i = [(alpha - 1) z_i - tau]_+ ^ (1 / (alpha - 1))`` with the
threshold ``tau`` such that the row sums to one (Peters, Niculae, Martins
2019; Correia, Niculae, Martins 2019). ``alpha = 2`` is sparsemax, ``alpha -> 1``
softmax; entries below the threshold are exactly 0.

Forward: ``tau`` by bisection on ``[max - 1, max - (1/n)^(alpha - 1)]`` (no
gradient), then the weights normalised. Backward: autograd through one
implicit-function correction ``tau + (f - f.detach()) / g`` with
``f = sum_i p_i(tau) - 1`` and ``g = -df/dtau = sum_{i in support} p_i^(2 - alpha) / (alpha - 1)``
(detached): its gradient is ``dtau/dθ = (df/dθ) / g``, the implicit one, for
the scores and alpha alike, and its value is ``tau`` (the correction is 0). That
gradient is first order only: second derivatives through it raise
(:func:`attnkit.first_order.first_order_path`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.first_order import first_order_path

__all__ = ["MIN_ALPHA", "bisection_iterations", "entmax_bisect"]

#: alpha is clamped to at least this (alpha = 1 is softmax, where the entmax formula divides by 0)
MIN_ALPHA = 1.0001


def bisection_iterations(dtype: torch.dtype) -> int:
    """Halvings of the unit bracket: below float64's (or float32's) resolution of tau."""
    return 60 if dtype == torch.float64 else 32


def _pow_support(base: Tensor, exponent: Tensor, support: Tensor) -> Tensor:
    """``base ** exponent`` on the support, 0 elsewhere, without inf or NaN gradients off it."""
    safe = torch.where(support, base, torch.ones((), dtype=base.dtype, device=base.device))
    return torch.where(support, safe.pow(exponent), torch.zeros((), dtype=base.dtype, device=base.device))


def _bisect(Xd: Tensor, mx: Tensor, amd: Tensor, invd: Tensor, iters: int) -> Tensor:
    """The threshold ``tau`` of each row of ``Xd = (alpha - 1) · scores`` (``-inf`` at masked entries; ``mx``
    the row maxima, 0 for rows of only ``-inf``) by ``iters`` halvings of ``[mx - 1, mx - (1/n)^(alpha - 1)]``;
    ``amd = alpha - 1``, ``invd = 1 / (alpha - 1)``. No gradient."""
    n = Xd.shape[-1]
    lo = mx - 1.0
    hi = mx - (1.0 / n) ** amd
    for _ in range(iters):
        mid = (lo + hi) * 0.5
        f = (Xd - mid).clamp_min(0).pow(invd).sum(-1, keepdim=True) - 1.0
        up = f >= 0
        lo = torch.where(up, mid, lo)
        hi = torch.where(up, hi, mid)
    return (lo + hi) * 0.5


@torch.library.custom_op("attnkit_adaptive::entmax_threshold", mutates_args=())
def entmax_threshold(Xd: Tensor, mx: Tensor, amd: Tensor, invd: Tensor, iters: int) -> Tensor:
    """:func:`_bisect` as one custom operator (what an exported program holds; load it with
    ``import attnkit_adaptive``)."""
    return _bisect(Xd, mx, amd, invd, iters)


@entmax_threshold.register_fake
def _(Xd: Tensor, mx: Tensor, amd: Tensor, invd: Tensor, iters: int) -> Tensor:
    return mx.new_empty(torch.broadcast_shapes(mx.shape, amd.shape, invd.shape))


def entmax_bisect(scores: Tensor, alpha: Tensor, *, n_iter: int | None = None) -> Tensor:
    """alpha-entmax over the last dimension.

    Args:
        scores: ``(..., n)``; ``-inf`` marks entries that must get weight 0. A row of only ``-inf`` gives 0.
        alpha: broadcastable to ``scores[..., :1]``, every value > 1 (clamp first).
        n_iter: bisection steps (default: :func:`bisection_iterations` of the dtype).

    Returns:
        ``(..., n)``, rows summing to one (0 for rows with no finite score), exact zeros below the threshold.
    """
    iters = bisection_iterations(scores.dtype) if n_iter is None else n_iter
    am1 = (alpha - 1).to(scores.dtype)
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    keep = scores != float("-inf")  # a NaN score stays (its row is NaN, never silently masked)
    X = torch.where(keep, scores, zero) * am1  # no -inf in the graph: d/dalpha of -inf * (alpha - 1) is NaN
    inv = 1.0 / am1
    with torch.no_grad():
        Xd = X.detach().masked_fill(~keep, float("-inf"))
        mx = Xd.amax(-1, keepdim=True)
        mx = torch.where(torch.isinf(mx), zero, mx)
        amd = am1.detach()
        invd = inv.detach()
        # exporting: the loop as one operator of the program (unrolled, its 32-60 steps made programs of
        # hundreds of nodes that took seconds to trace); eager and torch.compile: the loop itself
        bisect = entmax_threshold if torch.compiler.is_exporting() else _bisect
        tau0 = bisect(Xd, mx, amd, invd, iters)
        support = ((Xd - tau0) > 0) & keep
        # -df/dtau = sum over the support of p^(2 - alpha) / (alpha - 1)
        g = _pow_support(Xd - tau0, (1.0 - amd) * invd, support).sum(-1, keepdim=True) * invd
        g = torch.where(g > 0, g, torch.ones((), dtype=g.dtype, device=g.device))
    p = _pow_support(X - tau0, inv, support)
    f = p.sum(-1, keepdim=True) - 1.0
    # first order only: g is detached, so a second derivative through this correction would miss terms
    tau = tau0 + first_order_path((f - f.detach()) / g, "entmax (its threshold's implicit gradient)")
    p = _pow_support(X - tau, inv, support)
    s = p.sum(-1, keepdim=True)
    # tau0 is NaN exactly for rows holding a NaN score: NaN in, NaN out (never a silent 0 row)
    return p / torch.where(s > 0, s, torch.ones((), dtype=s.dtype, device=s.device)) + tau0 * 0
