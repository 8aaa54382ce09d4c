"""The ``numba`` backend: CPU block-sparse kernels behind one ``torch.library`` custom operator.

``attnkit_sparse::numba_block_attention(q, k, v, <plan tensors>, H, BQ, BK, scale) -> (out, lse)``
(the plan's bank as the kernels read it, key-major: :meth:`.plan.BlockPlan.key_major_bank`)
runs :func:`._numba_kernels.forward`; its registered autograd runs
``attnkit_sparse::numba_block_attention_backward`` (one kernel per sequence, or the two-kernel backward,
recomputing probabilities from the saved log-sum-exp), and fake
implementations give ``torch.compile`` the output shapes, so a compiled model
sees one operator. The kernels take float32 and float64 CPU tensors; :func:`attend`
runs float16 and bfloat16 inputs on float32 copies and casts the output back (autograd
through the casts gives the gradients in the input dtype; the log-sum-exp stays float32).

Threads: the kernels are serial ``nogil`` functions over ranges of work items, run on
``torch.get_num_threads()`` threads (:func:`attnkit.numba_pool.run_ranges`, capped by numba's maximum, on a team
of torch's OpenMP pool): each thread takes the next range when it finishes one, so a thread slowed by another
process on the cores takes fewer ranges.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from attnkit import cpu_buffers
from attnkit.first_order import first_order
from attnkit.numba_panel import transpose
from attnkit.numba_pool import run_ranges

from ..base import spread_evenly
from . import _numba_kernels as K
from .plan import BlockPlan

NAMESPACE = "attnkit_sparse"

#: the two-kernel backward keeps scale·dS per tile (tiles·BQ·BK floats) for dQ in a buffer of at most this many
#: bytes; when the tiles need more, both kernels run in passes over ranges of query blocks that fit (a query
#: block's tiles at least)
DS_BUFFER_MAX_BYTES = 1 << 30

#: one fused backward call per sequence (``backward_sequence``: dQ from each dS tile while it is in cache,
#: no dS buffer) when the B·H sequences spread evenly over the threads: "auto", True or False
FUSED_BACKWARD: str | bool = "auto"


def _fused(n: int) -> bool:
    if FUSED_BACKWARD != "auto":
        return bool(FUSED_BACKWARD)
    return spread_evenly(n)



def _arr(x: Tensor) -> np.ndarray:
    return x.detach().contiguous().numpy()


def _seq(x: Tensor) -> np.ndarray:
    """``(B, H, N, F)`` -> contiguous NumPy ``(B·H, N, F)``."""
    return _arr(x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]))


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"numba_block_attention: expected float32 or float64 CPU tensors, got {q.dtype} on "
                         f"{q.device}")


def _forward(q: Tensor, k: Tensor, v: Tensor, kv_count: Tensor, kv_idx: Tensor, kv_tile: Tensor, q_count: Tensor,
             q_idx: Tensor, q_tile: Tensor, q_slot: Tensor, bank: Tensor, span: Tensor, bq: int, bk: int,
             scale: float) -> tuple[Tensor, Tensor]:
    _check(q, k, v)
    B, H, L, _ = q.shape
    E = v.shape[-1]
    nq = kv_count.shape[-1]
    cst = K.constants(_arr(q).dtype, scale)
    qa = _seq(q)
    out = cpu_buffers.empty((B * H, L, E), qa.dtype)     # buffers reused once nothing refers to them (no faults)
    lse = np.empty((B * H, L), dtype=qa.dtype)
    run_ranges(K.forward, B * H * nq, qa, _seq(k), _seq(v), H, _arr(kv_count), _arr(kv_idx), _arr(kv_tile),
               _arr(bank), _arr(span), bq, bk, cst, out, lse)
    return torch.from_numpy(out).view(B, H, L, E), torch.from_numpy(lse).view(B, H, L)


def _forward_fake(q, k, v, kv_count, kv_idx, kv_tile, q_count, q_idx, q_tile, q_slot, bank, span, bq, bk, scale):
    B, H, L, _ = q.shape
    return q.new_empty(B, H, L, v.shape[-1]), q.new_empty(B, H, L)


def _backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, g: Tensor, g_lse: Tensor, kv_count: Tensor,
              kv_idx: Tensor, kv_tile: Tensor, q_count: Tensor, q_idx: Tensor, q_tile: Tensor, q_slot: Tensor,
              bank: Tensor, bq: int, bk: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    _check(q, k, v)
    B, H, L, D = q.shape
    S, E = k.shape[-2], v.shape[-1]
    cst = K.constants(_arr(q).dtype, scale)
    qa, ka, va, ga = _seq(q), _seq(k), _seq(v), _seq(g)
    # Δ_i = dO_i · O_i - dlse_i: the log-sum-exp's own gradient (dlse_i/ds_ij = P_ij) enters dS = P (dP - Δ);
    # per sequence on the threads (K.delta_rows), filled before the kernels read it
    oa, gla = _seq(out), _arr(g_lse.reshape(B * H, L))
    delta_a = np.empty((B * H, L), dtype=qa.dtype)
    stats = (_arr(lse.reshape(B * H, L)), delta_a, H)
    bank_a = _arr(bank)
    nq = kv_idx.shape[-2]
    if _fused(B * H):
        dq = cpu_buffers.empty((B * H, L, D), qa.dtype)
        dk = cpu_buffers.empty((B * H, S, D), qa.dtype)
        dv = cpu_buffers.empty((B * H, S, E), qa.dtype)
        qT, gT = cpu_buffers.empty((B * H, D, L), qa.dtype), cpu_buffers.empty((B * H, E, L), qa.dtype)
        lse_a = stats[0]
        qc_a, qi_a, qt_a = _arr(q_count), _arr(q_idx), _arr(q_tile)
        bp, hp = qc_a.shape[:2]

        def sequences(n0: int, n1: int) -> None:
            for n in range(n0, n1):
                i = ((n // H) % bp, (n % H) % hp)
                # each sequence's q and dO transposed on its own thread, in registers (NumPy's strided copy
                # of the whole batch ran on one thread before the kernels: docs/benchmarks.md, "Session 43")
                transpose(qT[n], qa[n], L, D)
                transpose(gT[n], ga[n], L, E)
                K.delta_rows(ga[n], oa[n], gla[n], delta_a[n])
                K.backward_sequence(qa[n], ka[n], va[n], ga[n], qT[n], gT[n], lse_a[n], delta_a[n], qc_a[i],
                                    qi_a[i], qt_a[i], bank_a, bq, bk, cst, dq[n], dk[n], dv[n])

        run_ranges(sequences, B * H)
        return (torch.from_numpy(dq).view(B, H, L, D), torch.from_numpy(dk).view(B, H, S, D),
                torch.from_numpy(dv).view(B, H, S, E))
    qT, gT = cpu_buffers.empty((B * H, D, L), qa.dtype), cpu_buffers.empty((B * H, E, L), qa.dtype)

    def transposes(n0: int, n1: int) -> None:    # per sequence on the threads, in registers (as above), and Δ
        for n in range(n0, n1):
            transpose(qT[n], qa[n], L, D)
            transpose(gT[n], ga[n], L, E)
            K.delta_rows(ga[n], oa[n], gla[n], delta_a[n])

    run_ranges(transposes, B * H)
    # compact dS buffer: the visited tiles of each query block one after another (a pattern with a few
    # global rows visits NK tiles there and few elsewhere; NQ x max(count) would grow like L^2), filled and read
    # in passes over ranges of query blocks whose tiles fit in DS_BUFFER_MAX_BYTES (one pass as a rule)
    counts = kv_count.to(torch.int64)
    ds_off = (counts.cumsum(-1) - counts).contiguous()
    off_a, kvc_a, kvi_a = _arr(ds_off), _arr(kv_count), _arr(kv_idx)
    qc_a, qi_a, qt_a, qs_a = _arr(q_count), _arr(q_idx), _arr(q_tile), _arr(q_slot)
    dq = cpu_buffers.empty((B * H, L, D), qa.dtype)  # every query block's rows are written by its pass
    dk = np.zeros((B * H, S, D), dtype=qa.dtype)
    dv = np.zeros((B * H, S, E), dtype=qa.dtype)
    tile_bytes = B * H * bq * bk * q.element_size()
    for lo, hi, tiles in _passes(counts.reshape(-1, nq), tile_bytes):
        ds = np.empty((B * H, tiles, bk, bq), dtype=qa.dtype)
        run_ranges(K.backward_dkdv, B * H * q_count.shape[-1], qa, ka, va, ga, *stats, qc_a, qi_a, qt_a, qs_a,
                   bank_a, bq, bk, cst, ds, off_a, qT, gT, dk, dv, lo, hi)
        run_ranges(K.backward_dq_from_ds, B * H * (hi - lo), ka, ds, off_a, dq, lo, hi, H, kvc_a, kvi_a, bq, bk)
    return (torch.from_numpy(dq).view(B, H, L, D), torch.from_numpy(dk).view(B, H, S, D),
            torch.from_numpy(dv).view(B, H, S, E))


def _passes(counts: Tensor, tile_bytes: int) -> list[tuple[int, int, int]]:
    """Ranges ``[lo, hi)`` of query blocks whose dS tiles fit in :data:`DS_BUFFER_MAX_BYTES`, in order, each with
    the tiles its buffer holds (the most any pattern row of ``counts`` ``(B'·H', NQ)`` visits in the range).
    ``tile_bytes``: bytes of one tile over all B·H sequences. A range holds one query block at least."""
    nq = counts.shape[-1]
    per_block = counts.max(0).values.tolist()
    out, lo, held = [], 0, 0
    for qb, c in enumerate(per_block):
        if qb > lo and (held + c) * tile_bytes > DS_BUFFER_MAX_BYTES:
            out.append((lo, qb))
            lo, held = qb, 0
        held += c
    out.append((lo, nq))
    return [(a, b, int(counts[:, a:b].sum(-1).max())) for a, b in out]


def _backward_fake(q, k, v, out, lse, g, g_lse, kv_count, kv_idx, kv_tile, q_count, q_idx, q_tile, q_slot, bank, bq, bk,
                   scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


numba_block_attention_backward = torch.library.custom_op(
    f"{NAMESPACE}::numba_block_attention_backward", mutates_args=())(_backward)
numba_block_attention_backward.register_fake(_backward_fake)

numba_block_attention = torch.library.custom_op(f"{NAMESPACE}::numba_block_attention", mutates_args=())(_forward)
numba_block_attention.register_fake(_forward_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, *index, span, bq, bk, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *index)
    ctx.bq, ctx.bk, ctx.scale = bq, bk, scale


def _autograd(ctx, g_out, g_lse):
    q, k, v, out, lse, *index = ctx.saved_tensors
    if g_out is None:
        g_out = torch.zeros_like(out)
    if g_lse is None:
        g_lse = torch.zeros_like(lse)
    dq, dk, dv = numba_block_attention_backward(q, k, v, out, lse, g_out.contiguous(), g_lse.contiguous(), *index,
                                                ctx.bq, ctx.bk, ctx.scale)
    return dq, dk, dv, *([None] * 12)


numba_block_attention.register_autograd(first_order(_autograd), setup_context=_setup_context)


def attend(q: Tensor, k: Tensor, v: Tensor, plan: BlockPlan, scale: float, *,
           return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Block-sparse attention with the numba kernels (differentiable in q, k, v, and through the lse).

    Args:
        q: ``(B, H, L, D)``; k: ``(B, H, S, D)``; v: ``(B, H, S, E)``; CPU tensors, float32 or float64 as
            they are, float16 or bfloat16 on float32 copies (the kernels have no half form).
        plan: the :class:`~attnkit_sparse.engine.plan.BlockPlan` (on CPU).
        scale: multiplier of ``q · k``.

    Returns:
        ``(B, H, L, E)`` in the input dtype (its gradients too); rows with no allowed key are 0. With
        ``return_lse`` also the log-sum-exp ``(B, H, L)`` of the scaled scores per row (``+inf`` for a row
        with no allowed key; float32 for half inputs).
    """
    index = (plan.kv_count, plan.kv_idx, plan.kv_tile, plan.q_count, plan.q_idx, plan.q_tile, plan.q_slot,
             plan.key_major_bank(), plan.span)
    return attend_index(q, k, v, index, plan.block_size, scale, return_lse=return_lse)


def attend_index(q: Tensor, k: Tensor, v: Tensor, index: tuple[Tensor, ...], block_size: tuple[int, int],
                 scale: float, *, return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`attend` over the plan's tensors ``(kv_count, kv_idx, kv_tile, q_count, q_idx, q_tile, q_slot,
    key-major bank, span)`` (:class:`~attnkit_sparse.engine.plan.BlockPlan`), however they were built: a
    dynamic-length program builds them from tensors (:func:`.dynamic.band_index`)."""
    bq, bk = block_size
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    out, lse = numba_block_attention(q, k, v, *index, bq, bk, float(scale))
    out = out.to(dtype)
    return (out, lse) if return_lse else out
