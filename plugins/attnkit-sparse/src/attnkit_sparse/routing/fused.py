"""The fused CPU (numba) attention of ``routing``: clusters read through their routed positions, merged in place.

:func:`attend_clusters` takes q, k, v in their original order with each cluster's routed positions and runs
the kernels of :mod:`._fused`, one work item per sequence (``N = B·H``; items handed to threads one at a time
by :func:`attnkit.numba_pool.run_items`): no routed copies of q, k, v (nor their gradients' scatter), no engine
plan, no per-cluster outputs and no separate combination (nor its backward). The backward recomputes the
probabilities from the union's log-sum-exp, or, where a training forward kept its probability tiles
(:func:`save_tiles`), rescales those. Used when the sequences spread evenly over the threads
and the clusters are at most :data:`MAX_WIDTH` wide (:func:`use_fused`); otherwise the gathers, the engine and
the combination run (:mod:`.gather`).

float32 and float64 CPU tensors.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from attnkit import cpu_buffers
from attnkit.first_order import first_order

from ..base import spread_evenly

__all__ = ["attend_clusters", "use_fused", "FUSED"]

#: "auto" (fused when the ``B·H`` sequences spread evenly over the threads: ``N % threads == 0`` or
#: ``N >= 4·threads``), True (always) or False (never: gathers, engine, combination)
FUSED: str | bool = "auto"


#: the widest cluster the fused kernels take under "auto" (their per-thread tiles hold a cluster's keys and
#: their gradients, and W x 64 scores: about 2 MiB in float32 at 2,048); wider ones (few clusters over a long
#: sequence) run on the engine
MAX_WIDTH = 2048


#: "auto" (the forward keeps its probability tiles for the backward when they take at most
#: :data:`SAVED_MAX_BYTES` and the process keeps freed memory, :func:`attnkit.cpu_memory.keeps_freed_memory`),
#: True (always) or False (never: the backward computes the scores again)
SAVE_TILES: str | bool = "auto"

#: the most bytes of probability tiles a training forward keeps under "auto": ``B·H·C·W·(W + 1)`` elements (about
#: ``B·H·L·W`` for clusters of ``W`` slots; 67 MiB in float32 for H = 8 heads of 16K positions, clusters of 128)
SAVED_MAX_BYTES = 256 << 20


def save_tiles(N: int, C: int, W: int, itemsize: int) -> bool:
    """Whether a training forward over ``N = B·H`` sequences of ``C`` clusters of ``W`` slots keeps its probability
    tiles for the backward (:data:`SAVE_TILES`, :data:`SAVED_MAX_BYTES`).

    Under "auto" only where the process keeps freed memory (:func:`attnkit.cpu_memory.keep_freed_memory`): there
    the buffer reuses the previous step's pages. Under glibc's default a buffer of 32 MiB or more is a fresh
    ``mmap`` each step, and faulting its pages in cost more than the recompute saves (at 16K, 8 heads, between
    dense attention steps: 0.51 s a training step against 0.30 s; docs/benchmarks.md, "Session 56")."""
    if SAVE_TILES != "auto":
        return bool(SAVE_TILES)
    from attnkit.cpu_memory import keeps_freed_memory

    from ._fused import saved_shape
    return keeps_freed_memory() and math.prod(saved_shape(N, C, W)) * itemsize <= SAVED_MAX_BYTES


def use_fused(N: int, W: int) -> bool:
    """Whether ``N = B·H`` sequences with clusters of ``W`` slots run on the fused kernels (:data:`FUSED`)."""
    if FUSED != "auto":
        return bool(FUSED)
    return spread_evenly(N) and W <= MAX_WIDTH


def _np(x: Tensor) -> Any:
    return x.detach().contiguous().numpy()


def _items(work: Any, N: int) -> None:
    from attnkit.numba_pool import run_items
    run_items(work, N, team=True)


class _Fused(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, qi: Tensor, ki: Tensor, nq: Tensor, nk: Tensor,
                causal: bool, scale: float, save: bool) -> Tensor:
        from ..engine._numba_kernels import constants
        from ._fused import forward_seq, saved_shape
        N, L, _ = q.shape
        qa, ka, va = _np(q), _np(k), _np(v)
        qia, kia, nqa, nka = _np(qi), _np(ki), _np(nq), _np(nk)
        cst = constants(qa.dtype, scale)
        out = cpu_buffers.empty((N, L, va.shape[-1]), qa.dtype)     # reused once nothing refers to it (no faults)
        m, l_, lse = (np.empty((N, L), dtype=qa.dtype) for _ in range(3))
        # torch's allocation, not NumPy's: NumPy asks for transparent huge pages (madvise) for 4 MiB and more, and
        # where memory is fragmented (a process that has freed gigabytes) the kernel then compacts memory on the
        # first touch of each 2 MiB: a training step at 16K took 0.94 s instead of 0.27 (glibc's default
        # allocator, a dense 16K attention's step between; docs/benchmarks.md, "Session 56")
        ps_t = torch.empty(saved_shape(N, qia.shape[1], qia.shape[2]) if save else (1, 1, 1, 1, 1), dtype=q.dtype)
        ps = ps_t.numpy()
        _items(lambda n: forward_seq(qa, ka, va, qia, kia, nqa, nka, bool(causal), cst, n, out, m, l_, lse,
                                     bool(save), ps), N)
        out_t = torch.from_numpy(out)
        ctx.save_for_backward(q, k, v, qi, ki, nq, nk, out_t, torch.from_numpy(lse), ps_t)
        ctx.causal, ctx.scale, ctx.saved = causal, scale, bool(save)
        return out_t

    @staticmethod
    @first_order
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:
        from ..engine._numba_kernels import constants
        from ._fused import backward_seq
        q, k, v, qi, ki, nq, nk, out, lse, ps = ctx.saved_tensors
        N, L, D = q.shape
        E = v.shape[-1]
        qa, ka, va, ga = _np(q), _np(k), _np(v), _np(g)
        qia, kia, nqa, nka, la, oa, psa = _np(qi), _np(ki), _np(nq), _np(nk), _np(lse), _np(out), _np(ps)
        cst = constants(qa.dtype, ctx.scale)
        dq, dk = cpu_buffers.empty((N, L, D), qa.dtype), cpu_buffers.empty((N, L, D), qa.dtype)
        dv = cpu_buffers.empty((N, L, E), qa.dtype)
        _items(lambda n: backward_seq(qa, ka, va, ga, oa, qia, kia, nqa, nka, la, bool(ctx.causal), cst, n,
                                      dq, dk, dv, ctx.saved, psa), N)
        return (torch.from_numpy(dq), torch.from_numpy(dk), torch.from_numpy(dv), None, None, None, None, None, None,
                None)


def attend_clusters(q: Tensor, k: Tensor, v: Tensor, qi: Tensor, qok: Tensor, ki: Tensor, kok: Tensor, *,
                    causal: bool, scale: float) -> Tensor:
    """``routing``'s attention over all its clusters at once, differentiable in ``q``, ``k`` and ``v``.

    Args:
        q, k: ``(B, H, L, D)``; v: ``(B, H, L, E)``; float32 or float64 CPU.
        qi, ki: int64 ``(B, H, C, W)``: each cluster's routed query and key positions, the used ones first.
        qok, kok: bool ``(B, H, C, W)``: which slots are used (a prefix of each cluster's slots).
        causal: keys only at original positions ``<=`` the query's.
        scale: multiplier of ``q · k``.

    Returns:
        ``(B, H, L, E)``: each position's softmax over the keys of every cluster that routed it (a key counted
        once per cluster); 0 where no cluster gave it a key.
    """
    B, H, L, D = q.shape
    E = v.shape[-1]
    C, W = qi.shape[2], qi.shape[3]
    N = B * H
    nq, nk = qok.reshape(N, C, W).sum(-1), kok.reshape(N, C, W).sum(-1)
    save = save_tiles(N, C, W, q.element_size()) and torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad)
    out = _Fused.apply(q.reshape(N, L, D), k.reshape(N, L, D), v.reshape(N, L, E), qi.reshape(N, C, W),
                       ki.reshape(N, C, W), nq, nk, bool(causal), float(scale), save)
    return out.view(B, H, L, E)
