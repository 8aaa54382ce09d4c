"""The CPU (numba) attention of :class:`~attnkit_sparse.lsh.attention.LSHAttention`: rounds fused, no sorted copies.

:func:`attend_rounds` takes q, the unit keys and v in their original order with each round's
permutation and runs the kernels of :mod:`._fused`: every chunk reads its rows through the permutation
and merges its outputs into the positions' running log-sum-exp, so the sorted gathers, the sorted
outputs, their unsort and the separate combination of the rounds (and the backward's scatter of
them) do not exist. The backward recomputes the probabilities from the union's log-sum-exp.

Work items (serial ``nogil`` kernel calls handed to threads one at a time by
:func:`attnkit.numba_pool.run_items`): one per sequence ``n`` with all its rounds when the ``N = B·H``
sequences spread evenly over the threads; otherwise the rounds run one after another, each split into
blocks of chunks per sequence (the keys of a block's first chunk's previous chunk then get that
share of their gradient in an edge buffer, added at the end).

float32 and float64 CPU tensors. Shapes use ``N = B·H``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from attnkit import cpu_buffers
from attnkit.first_order import first_order

from ..base import spread_evenly

__all__ = ["attend_rounds", "BLOCKS"]

#: chunk blocks per sequence and round: "auto" (1 when the sequences spread evenly over the threads, then
#: each item is a whole sequence with all its rounds; else enough blocks for two items per thread) or an int
BLOCKS: str | int = "auto"


def _blocks(N: int, nq: int, threads: int) -> int:
    if BLOCKS != "auto":
        return max(1, min(int(BLOCKS), nq))
    if spread_evenly(N, threads):
        return 1
    return max(1, min(nq, -(-2 * threads // N)))


def _items(kernel: Any, args: tuple, tail: tuple, N: int, R: int, nq: int) -> None:
    """Call ``kernel(*args, n, r0, r1, c0, c1, *tail)`` over every (sequence, round, chunk) once."""
    from attnkit.numba_pool import kernel_threads, run_items
    t = kernel_threads()
    nb = _blocks(N, nq, t)
    if nb == 1:
        run_items(lambda n: kernel(*args, n, 0, R, 0, nq, *tail), N, threads=t, team=True)
        return
    edges = [nq * b // nb for b in range(nb + 1)]
    for r in range(R):
        run_items(lambda i, r=r: kernel(*args, i // nb, r, r + 1, edges[i % nb], edges[i % nb + 1], *tail),
                  N * nb, threads=t, team=True)


def _np(x: Tensor) -> Any:
    return x.detach().contiguous().numpy()


def _real(kpm: Tensor | None) -> tuple[Any, bool]:
    if kpm is None:
        return np.ones((1, 1), dtype=np.bool_), False
    return _np(kpm.to(torch.bool)), True


class _Fused(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, kh: Tensor, v: Tensor, perm: Tensor, kpm: Tensor | None, H: int,
                causal: bool, cs: int, scale: float) -> tuple[Tensor, Tensor]:
        from ..engine._numba_kernels import constants
        from ._fused import forward_items
        N, L, _ = q.shape
        R = perm.shape[1]
        nq = -(-L // cs)
        qa, ka, va, pa = _np(q), _np(kh), _np(v), _np(perm)
        real, padded = _real(kpm)
        cst = constants(qa.dtype, scale)
        out = cpu_buffers.empty((N, L, va.shape[-1]), qa.dtype)     # reused once nothing refers to it (no faults)
        m, l_, lse = (np.empty((N, L), dtype=qa.dtype) for _ in range(3))
        args = (qa, ka, va, pa, real, H, bool(causal), bool(padded), cs, cst)
        _items(forward_items, args, (out, m, l_, lse), N, R, nq)
        out_t, lse_t = torch.from_numpy(out), torch.from_numpy(lse)
        ctx.save_for_backward(q, kh, v, perm, out_t, lse_t)
        ctx.kpm, ctx.H, ctx.causal, ctx.cs, ctx.scale = kpm, H, causal, cs, scale
        alone = torch.isinf(lse_t)
        ctx.mark_non_differentiable(alone)
        return out_t, alone

    @staticmethod
    @first_order
    def backward(ctx: Any, g: Tensor, _g_alone: Any) -> tuple[Any, ...]:
        from ..engine._numba_kernels import constants
        from ._fused import backward_items
        q, kh, v, perm, out, lse = ctx.saved_tensors
        N, L, D = q.shape
        E = v.shape[-1]
        R = perm.shape[1]
        nq = -(-L // ctx.cs)
        g = g.contiguous()
        delta = (g * out).sum(-1)                                        # Δ_i = dO_i · O_i
        qa = _np(q)
        real, padded = _real(ctx.kpm)
        cst = constants(qa.dtype, ctx.scale)
        dq, dk = cpu_buffers.empty((N, L, D), qa.dtype), cpu_buffers.empty((N, L, D), qa.dtype)
        dv = cpu_buffers.empty((N, L, E), qa.dtype)
        from attnkit.numba_pool import kernel_threads
        edge = _blocks(N, nq, kernel_threads()) > 1
        dk_e = np.zeros((N, L, D) if edge else (N, 0, D), dtype=qa.dtype)
        dv_e = np.zeros((N, L, E) if edge else (N, 0, E), dtype=qa.dtype)
        args = (qa, _np(kh), _np(v), _np(g), _np(perm), real, _np(lse), _np(delta), ctx.H, bool(ctx.causal),
                bool(padded), ctx.cs, cst)
        _items(backward_items, args, (dq, dk, dv, dk_e, dv_e), N, R, nq)
        dk_t, dv_t = torch.from_numpy(dk), torch.from_numpy(dv)
        if edge:
            dk_t += torch.from_numpy(dk_e)
            dv_t += torch.from_numpy(dv_e)
        return torch.from_numpy(dq), dk_t, dv_t, None, None, None, None, None, None


def attend_rounds(q: Tensor, kh: Tensor, v: Tensor, perm: Tensor, kpm: Tensor | None, *, causal: bool,
                  chunk: int, scale: float) -> tuple[Tensor, Tensor]:
    """``lsh``'s attention over all its rounds at once, differentiable in ``q``, ``kh`` and ``v``.

    Args:
        q: ``(B, H, L, D)`` queries; kh: ``(B, H, L, D)`` unit keys; v: ``(B, H, L, E)``; float32 or float64 CPU.
        perm: int64 ``(B, H, R, L)``: each round's positions in sorted order.
        kpm: bool ``(B, L)`` (True = real key) or None.
        causal: keys only at original positions ``<=`` the query's.
        chunk: the chunk length ``cs`` of the sorted order (a query attends its chunk and the previous one).
        scale: multiplier of ``q · k̂``.

    Returns:
        ``(out, alone)``: ``(B, H, L, E)`` the softmax over the union of the rounds' pairs (a pair counted
        once per round that holds it; 0 where a position has no pair in any round) and bool ``(B, H, L)``
        marking those positions.
    """
    B, H, L, D = q.shape
    E = v.shape[-1]
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"attend_rounds: q must be a float32 or float64 CPU tensor, got {q.dtype} on {q.device}")
    if chunk < 1:
        raise ValueError(f"attend_rounds: chunk must be an int >= 1, got {chunk}")
    R = perm.shape[2]
    out, alone = _Fused.apply(q.reshape(B * H, L, D), kh.reshape(B * H, L, D), v.reshape(B * H, L, E),
                              perm.reshape(B * H, R, L), kpm, H, bool(causal), int(chunk), float(scale))
    return out.view(B, H, L, E), alone.view(B, H, L)
