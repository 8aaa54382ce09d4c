"""Routing's CPU path around the engine: routed gathers and the clusters' combination as numba kernels with
their own gradients (:mod:`._numba`), instead of ``index_select`` gathers (backward: a zero fill and a
scatter-add each) and a combination by ``scatter_reduce``/``index_add`` over whole zero tensors with half a
dozen elementwise passes and their autograd. float32 and float64 CPU tensors; ``N = B·H``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["gather_routed", "combine_routed"]


def _np(x: Tensor) -> Any:
    return x.detach().contiguous().numpy()


def _run(kernel: Any, items: int, *args: Any) -> Any:
    from attnkit.numba_pool import run_parallel, start_pool
    start_pool()
    return run_parallel(kernel, *args, items=items)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, idx: Tensor) -> Tensor:
        from ._numba import gather_rows
        ctx.save_for_backward(idx)
        ctx.L = x.shape[1]
        N, M = idx.shape
        return torch.from_numpy(_run(gather_rows, N * -(-M // 512), _np(x), _np(idx)))

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        from ._numba import scatter_rows
        (idx,) = ctx.saved_tensors
        return torch.from_numpy(_run(scatter_rows, idx.shape[0], _np(g), idx.numpy(), ctx.L)), None


def gather_routed(x: Tensor, idx: Tensor) -> Tensor:
    """``x`` ``(N, L, F)``, ``idx`` int64 ``(N, M)`` -> ``(N, M, F)`` (row ``j`` = ``x[idx[j]]``); differentiable in
    ``x`` (the gradient scatter-adds each routed row back to its position)."""
    return _Gather.apply(x, idx)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out_s: Tensor, lse_s: Tensor, idx: Tensor, L: int) -> Tensor:
        from ._numba import combine_forward
        os_ = out_s.detach().contiguous()
        out, w = _run(combine_forward, idx.shape[0], os_.numpy(), _np(lse_s), _np(idx), L)
        out, w = torch.from_numpy(out), torch.from_numpy(w)
        ctx.save_for_backward(out, os_, w, idx)
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, None, None]:
        from ._numba import combine_backward
        out, out_s, w, idx = ctx.saved_tensors
        N, M = idx.shape
        d_out, d_lse = _run(combine_backward, N * -(-M // 512), _np(g), out.numpy(), out_s.numpy(), w.numpy(),
                            idx.contiguous().numpy())
        return torch.from_numpy(d_out), torch.from_numpy(d_lse), None, None


def combine_routed(out_s: Tensor, lse_s: Tensor, idx: Tensor, L: int) -> Tensor:
    """``(N, L, E)``: each position's routed rows ``out_s`` ``(N, M, E)`` combined by their log-sum-exp ``lse_s``
    ``(N, M)`` (``-inf``: the row counts for nothing); 0 where no row counts. Differentiable in both."""
    return _Combine.apply(out_s, lse_s, idx, L)
