"""The CPU path of :class:`~attnkit_sparse.lsh.attention.LSHAttention` around the engine: sorted gathers and the
combination of the rounds as numba kernels with their own gradients (:mod:`._numba`).

With torch ops the rounds cost, besides the engine: three ``index_select`` gathers whose backward is
a zero fill and a scatter-add each, an ``index_select`` unsort of the outputs (and its scatter-add
backward into a zero tensor of all the sorted rows) and half a dozen elementwise passes over
``n_hashes`` copies of the output to weight and sum them. Here each is one pass:

* :func:`gather_rounds` ``(N, L, F) -> (N, R, L, F)``, gradient :func:`._numba.unsort_sum` (each position
  sums its ``R`` sorted rows: a gather, no zero fill, no scatter);
* :func:`combine_rounds` ``(N, R, L, E), (N, R, L) -> (N, L, E)``: unsort and weight by the rounds'
  log-sum-exp in one pass; its gradient writes the sorted rows' gradients directly in sorted order.

float32 and float64 CPU tensors. Shapes use ``N = B·H``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["gather_rounds", "combine_rounds", "inverse", "labels"]


def _np(x: Tensor) -> Any:
    return x.detach().contiguous().numpy()


def _run(kernel: Any, items: int, *args: Any) -> Any:
    from attnkit.numba_pool import run_parallel, start_pool
    start_pool()
    return run_parallel(kernel, *args, items=items)


def inverse(perm: Tensor) -> Tensor:
    """``inv`` with ``inv[..., perm[..., j]] = j`` (a scatter of ``arange``: no second sort)."""
    L = perm.shape[-1]
    ar = torch.arange(L, device=perm.device, dtype=perm.dtype).expand_as(perm)
    return torch.empty_like(perm).scatter_(-1, perm, ar)


def labels(x: Tensor, rot: Tensor, C: int, out: Tensor, *, max_floats: int = 1 << 22) -> Tensor:
    """``argmax([x R; -x R])`` labels of ``x`` ``(B, H, L, D)`` into ``out`` int64 ``(B, H, R, L)``, with ``rot``
    ``(R, D, half)`` and labels in ``[0, 2C)`` (see :func:`.hashing.buckets`).

    The rotated rows ``(rows, R, half)`` are computed a slab of rows at a time (at most ``max_floats``
    floats, 16 MiB in float32; the projection is ``L·R·L/(2·bucket)``, quadratic in L, so it is never
    whole) by one matrix product each, and reduced by :func:`._numba.hash_labels` (one pass: first max and
    first min of each row). The slab size trades cache reuse against the number of parallel calls, each
    of which waits for both threads: at 16K on the 2-core VM, 4 / 16 / 64 MiB slabs took 84 / 105 / 175 ms
    idle, but 1470 / 450 / 360 ms while other processes held the cores.
    """
    from ._numba import hash_labels

    B, H, L, D = x.shape
    R, _, half = rot.shape
    flat = x.detach().reshape(B * H * L, D)
    rmat = rot.permute(1, 0, 2).reshape(D, R * half).contiguous()
    step = max(1, max_floats // (R * half))
    o = out.view(B * H, R, L).numpy()
    for r0 in range(0, B * H * L, step):
        proj = torch.mm(flat[r0:r0 + step], rmat).view(-1, R, half)
        _run(hash_labels, proj.shape[0], proj.numpy(), r0, L, C, o)
    return out


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, perm: Tensor, inv: Tensor) -> Tensor:
        from ._numba import gather_rounds as kernel
        ctx.save_for_backward(inv)
        N, R = perm.shape[:2]
        return torch.from_numpy(_run(kernel, N * R, _np(x), _np(perm)))

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, None, None]:
        from ._numba import BLOCK, unsort_sum
        (inv,) = ctx.saved_tensors
        N, _, L = inv.shape
        return torch.from_numpy(_run(unsort_sum, N * -(-L // BLOCK), _np(g), _np(inv))), None, None


def gather_rounds(x: Tensor, perm: Tensor, inv: Tensor) -> Tensor:
    """``x`` ``(N, L, F)``, ``perm``/``inv`` int64 ``(N, R, L)`` -> ``(N, R, L, F)`` with row ``j`` of round ``r`` =
    ``x[perm[r, j]]``; differentiable in ``x`` (the gradient sums each position's ``R`` rows via ``inv``)."""
    return _Gather.apply(x, perm, inv)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out_s: Tensor, lse_s: Tensor, perm: Tensor, inv: Tensor) -> tuple[Tensor, Tensor]:
        from ._numba import BLOCK, combine_forward
        N, R, L, _ = out_s.shape
        os_ = out_s.detach().contiguous()
        out, w, alone = _run(combine_forward, N * -(-L // BLOCK), os_.numpy(), _np(lse_s), _np(inv))
        out, w, alone = torch.from_numpy(out), torch.from_numpy(w), torch.from_numpy(alone)
        ctx.save_for_backward(out, os_, w, perm)
        ctx.mark_non_differentiable(alone)
        return out, alone

    @staticmethod
    def backward(ctx: Any, g: Tensor, _g_alone: Any) -> tuple[Tensor, Tensor, None, None]:
        from ._numba import combine_backward
        out, out_s, w, perm = ctx.saved_tensors
        N, R = perm.shape[:2]
        d_out, d_lse = _run(combine_backward, N * R, _np(g), out.numpy(), out_s.numpy(), w.numpy(), perm.numpy())
        return torch.from_numpy(d_out), torch.from_numpy(d_lse), None, None


def combine_rounds(out_s: Tensor, lse_s: Tensor, perm: Tensor, inv: Tensor) -> tuple[Tensor, Tensor]:
    """The rounds' outputs unsorted and combined by their log-sum-exp, in one pass.

    Args:
        out_s: ``(N, R, L, E)`` each round's output in its sorted order.
        lse_s: ``(N, R, L)`` their log-sum-exp (``-inf``: the row had no pair in that round).
        perm, inv: int64 ``(N, R, L)``, sorted row -> position and position -> sorted row.

    Returns:
        ``(out, alone)``: ``(N, L, E)`` = ``Σ_r softmax_r(lse_r) · out_r`` by position, differentiable in
        ``out_s`` and ``lse_s``; 0 at positions with no pair in any round, which ``alone`` ``(N, L)`` marks.
    """
    return _Combine.apply(out_s, lse_s, perm, inv)
