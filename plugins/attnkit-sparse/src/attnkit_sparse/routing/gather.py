"""Routing's CPU path around the engine: routed gathers and the clusters' combination as numba kernels with
their own gradients (:mod:`._numba`), instead of ``index_select`` gathers (backward: a zero fill and a
scatter-add each) and a combination by ``scatter_reduce``/``index_add`` over whole zero tensors with half a
dozen elementwise passes and their autograd. float32 and float64 CPU tensors; ``N = B·H``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from attnkit.first_order import first_order
from attnkit.numba_pool import run_ranges

__all__ = ["gather_routed", "combine_routed"]


def _np(x: Tensor) -> Any:
    return x.detach().contiguous().numpy()


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, idx: Tensor) -> Tensor:
        from ._numba import gather_rows
        ctx.save_for_backward(idx)
        ctx.L = x.shape[1]
        N, M = idx.shape
        xa = _np(x)
        out = np.empty((N, M, xa.shape[2]), dtype=xa.dtype)
        run_ranges(gather_rows, N * -(-M // 512), xa, _np(idx), out)
        return torch.from_numpy(out)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        from ._numba import scatter_rows
        (idx,) = ctx.saved_tensors
        ga = _np(g)
        out = np.empty((ga.shape[0], ctx.L, ga.shape[2]), dtype=ga.dtype)
        run_ranges(scatter_rows, idx.shape[0], ga, idx.numpy(), ctx.L, out)
        return torch.from_numpy(out), None


def gather_routed(x: Tensor, idx: Tensor) -> Tensor:
    """``x`` ``(N, L, F)``, ``idx`` int64 ``(N, M)`` -> ``(N, M, F)`` (row ``j`` = ``x[idx[j]]``); differentiable in
    ``x`` (the gradient scatter-adds each routed row back to its position)."""
    return _Gather.apply(x, idx)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out_s: Tensor, lse_s: Tensor, idx: Tensor, L: int) -> Tensor:
        from ._numba import combine_forward
        os_ = out_s.detach().contiguous()
        N, M, E = os_.shape
        out = torch.empty(N, L, E, dtype=os_.dtype)
        w = torch.empty(N, M, dtype=os_.dtype)
        run_ranges(combine_forward, N, os_.numpy(), _np(lse_s), _np(idx), L, out.numpy(), w.numpy())
        ctx.save_for_backward(out, os_, w, idx)
        return out

    @staticmethod
    @first_order
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, None, None]:
        from ._numba import combine_backward
        out, out_s, w, idx = ctx.saved_tensors
        N, M = idx.shape
        d_out = torch.empty_like(out_s)
        d_lse = torch.empty(N, M, dtype=out_s.dtype)
        run_ranges(combine_backward, N * -(-M // 512), _np(g), out.numpy(), out_s.numpy(), w.numpy(),
                   idx.contiguous().numpy(), d_out.numpy(), d_lse.numpy())
        return d_out, d_lse, None, None


def combine_routed(out_s: Tensor, lse_s: Tensor, idx: Tensor, L: int) -> Tensor:
    """``(N, L, E)``: each position's routed rows ``out_s`` ``(N, M, E)`` combined by their log-sum-exp ``lse_s``
    ``(N, M)`` (``-inf``: the row counts for nothing); 0 where no row counts. Differentiable in both."""
    return _Combine.apply(out_s, lse_s, idx, L)


class _Commitment(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, near_q: Tensor, near_k: Tensor, real: Any, mu: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
        from ._numba import commit_sums
        B, H, L, D = q.shape
        C = mu.shape[1]
        S = torch.zeros(H, C, D, dtype=q.dtype)
        n = torch.zeros(H, C, dtype=q.dtype)
        sq = torch.zeros((), dtype=q.dtype)
        for x, nr in ((q, near_q), (k, near_k)):
            s = torch.zeros(B, H, C, D, dtype=q.dtype)
            c = torch.zeros(B, H, C, dtype=q.dtype)
            t = torch.zeros(B * H, dtype=q.dtype)
            run_ranges(commit_sums, B * H, _np(x).reshape(B * H, L, D), _np(nr).reshape(B * H, L), real, H, C, _EPS,
                       s.view(B * H, C, D).numpy(), c.view(B * H, C).numpy(), t.numpy())
            S += s.sum(0)
            n += c.sum(0)
            sq += t.sum()
        raw = sq - 2 * (mu * S).sum() + (n * (mu * mu).sum(-1)).sum()
        ctx.save_for_backward(q, k, near_q, near_k, mu)
        ctx.real = real
        ctx.mark_non_differentiable(S, n)
        return raw, S, n[..., None]

    @staticmethod
    @first_order
    def backward(ctx: Any, g: Tensor, _gs: Any, _gn: Any) -> tuple[Any, ...]:
        from ._numba import commit_grad
        q, k, near_q, near_k, mu = ctx.saved_tensors
        B, H, L, D = q.shape
        coef = float(g)
        mua = _np(mu)
        grads = []
        for x, nr in ((q, near_q), (k, near_k)):
            gx = torch.empty(B, H, L, D, dtype=x.dtype)
            run_ranges(commit_grad, B * H, _np(x).reshape(B * H, L, D), _np(nr).reshape(B * H, L), ctx.real, H, mua,
                       coef, _EPS, gx.view(B * H, L, D).numpy())
            grads.append(gx)
        return grads[0], grads[1], None, None, None, None


#: ``F.normalize``'s default floor of the norm, as :func:`.clusters.unit` uses it
_EPS = 1e-12


def commitment(q: Tensor, k: Tensor, near: tuple[Tensor, Tensor], kpm: Tensor | None, mu: Tensor
               ) -> tuple[Tensor, Tensor, Tensor]:
    """``(raw, sums, counts)``: ``raw = Σ_i ‖x̂_i − μ_c(i)‖²`` over the real queries and keys (differentiable in ``q``
    and ``k``, centroids ``mu`` ``(H, C, D)`` constant), and each (head, cluster)'s sum ``(H, C, D)`` and count
    ``(H, C, 1)`` of unit vectors (not differentiable), for ``q``, ``k`` ``(B, H, L, D)`` float32/float64 CPU and
    the nearest clusters ``near`` ``(B, H, L)``; one numba pass per side forward, one backward (instead of unit
    copies, ``index_add`` and their autograd)."""
    import numpy as np
    real = np.ones((1, q.shape[2]), dtype=np.bool_) if kpm is None else _np(kpm.to(torch.bool))
    return _Commitment.apply(q, k, near[0], near[1], real, mu.contiguous())
