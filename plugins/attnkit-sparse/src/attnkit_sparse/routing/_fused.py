# ruff: noqa: E702, E741  -- tile code reads best a tile row per line; O, l: the softmax output and running sum
"""numba kernels of routing's fused CPU path: each cluster's rows read straight through its routed positions.

One call handles sequence ``n`` (all its clusters, serially; ``nogil``: :mod:`.fused` hands sequences to
threads). Cluster ``c``'s used query slots are the first ``nq[n, c]`` of ``qi[n, c]`` and its used key slots
the first ``nk[n, c]`` of ``ki[n, c]`` (the routing lists them first, ascending). The cluster's keys and values
are gathered by position into tiles once; its queries (scaled, transposed) follow in blocks of :data:`QBLOCK`,
each against all the keys (so no online softmax: a block's softmax is complete), which keeps the tiles each
product streams in the first-level cache. Scores ``Sᵀ = K (scale·Q)ᵀ`` key-major, ``causal`` by original
positions (a block skips the keys after its latest query), one softmax per query over the cluster's keys and
``P V``, with the tile steps ``lsh``'s fused path uses too (:mod:`.._gathered`: the engine's register tiles
and vectorised ``exp``).
There are no routed copies of q, k, v, no per-cluster outputs and no separate combination: each cluster's
rows are merged at the position, by their log-sum-exp, into ``out``, ``m`` (running maximum), ``l`` (running
sum), and every position is normalised at the end (0, and ``lse = +inf``, where no cluster gave it a key).

The backward recomputes the probabilities from the saved (union) log-sum-exp, ``P = exp(S − lse)`` (or, with the
forward's tiles kept, ``P = exp(S − shift)·exp(shift − lse)`` from them: no scores product, no exponentials), and
``Δ = dO·O``: ``dS = P (dP − Δ)``, ``dQ = scale·dS K``, ``dK = scale·dSᵀ Q``, ``dV = Pᵀ dO``, added at the
positions (a sequence's rows are zeroed first: positions no cluster routed get 0).

Rows ``n`` of ``q``, ``k``, ``v``, ``g``, ``out``: ``(N, L, ·)`` with ``N = B·H``; ``qi``, ``ki`` int64 ``(N, C, W)``;
``nq``, ``nk`` int64 ``(N, C)``.
"""

from __future__ import annotations

import numba
import numpy as np

from attnkit.numba_panel import empty_aligned, zeros_aligned
from attnkit.numba_prefetch import prefetch_ahead

from .._gathered import (
    gather_kv,
    gather_query,
    gather_query_grad,
    merge_row,
    normalise_row,
    tile_backward,
    tile_backward_saved,
    tile_scores,
    tile_softmax_pv,
    transpose_columns,
    zero_kv,
)
from ..engine._numba_kernels import _HALF, _NINF, _ONE, _SC, FASTMATH


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _causal(ST, pk, pq, kn, qn, ninf):  # pragma: no cover - compiled
    """``-inf`` in the key-major scores ``ST`` where key position ``pk[j]`` is after query position ``pq[i]``.
    Stored unconditionally (``fmin(s, NaN)`` is ``s``): a conditional store compiles to slow masked stores (see
    :func:`attnkit_sparse.engine._numba_kernels._apply_tile_mask`)."""
    keep = ninf - ninf        # NaN in the scores' dtype
    for j in range(kn):
        pj = pk[j]
        row = ST[j]
        for i in range(qn):
            row[i] = np.fmin(row[i], ninf if pj > pq[i] else keep)


#: queries per score tile: a cluster's queries run in blocks of this many against all its keys, so the
#: tiles a product streams (``dO``, the scaled queries, a score row) stay in the core's first-level cache
QBLOCK = 64


def saved_shape(N: int, C: int, W: int) -> tuple[int, int, int, int, int]:
    """The shape of the tiles :func:`forward_seq` saves for the backward: ``(N, C, nb, W + 1, BQ)``, one
    ``(W + 1, BQ)`` tile per query block (``BQ = min(W, QBLOCK)``, ``nb`` blocks of a cluster's ``W`` slots)."""
    bq = min(W, QBLOCK)
    return N, C, (W + bq - 1) // bq, W + 1, bq


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _seen(pk, kn, last):  # pragma: no cover - compiled
    """How many of the ascending key positions ``pk[:kn]`` are ``<= last`` (the keys a causal query block whose
    latest position is ``last`` can see: the later ones only get masked scores)."""
    j = kn
    while j > 0 and pk[j - 1] > last:
        j -= 1
    return j


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def forward_seq(q, k, v, qi, ki, nq, nk, causal, cst, n, out, m, l, lse, save, PS):  # pragma: no cover - compiled
    """Sequence ``n``'s clusters merged into ``out`` ``(N, L, E)`` and ``lse`` ``(N, L)`` (``m``, ``l`` scratch).
    With ``save``, each query block's tile is computed in ``PS[n, c, block]`` (``(N, C, nb, W + 1, BQ)``,
    :func:`saved_shape`) and left there for :func:`backward_seq`: ``exp(S − shift)`` in its first ``kb`` rows,
    each column's ``shift`` in its last; otherwise ``PS`` is not read (any 5-D array of the dtype)."""
    N, L, D = q.shape
    E = v.shape[2]
    C, W = qi.shape[1], qi.shape[2]
    BQ = min(W, QBLOCK)
    dt = q.dtype
    zero = cst[_HALF] - cst[_HALF]
    one = cst[_ONE]
    sc = cst[_SC]
    ninf = cst[_NINF]
    QT = zeros_aligned(D, BQ, q)
    Qr = empty_aligned(BQ, D, q)
    Kb = empty_aligned(W, D, q)
    Vb = empty_aligned(W, E, q)
    ST0 = empty_aligned(W + 1, BQ, q)
    O = empty_aligned(BQ, E, q)
    mx = np.empty(BQ, dtype=dt)
    shift = empty_aligned(1, BQ, q)[0]   # read as vectors (_exp_sub)
    csum = np.empty(BQ, dtype=dt)
    s1 = np.empty(2, dtype=dt)
    qs = q[n]; ks = k[n]; vs = v[n]; on = out[n]; mn = m[n]; ln = l[n]
    for p in range(L):
        op = on[p]
        for e in range(E):
            op[e] = zero
        mn[p] = ninf
        ln[p] = zero
    for c in range(C):
        qn = nq[n, c]
        kn = nk[n, c]
        if qn == 0 or kn == 0:
            continue
        pq = qi[n, c]; pk = ki[n, c]
        for j in range(kn):
            prefetch_ahead(ks, pk, j, kn); prefetch_ahead(vs, pk, j, kn)
            gather_kv(Kb, Vb, j, ks[pk[j]], vs[pk[j]])
        for q0 in range(0, qn, BQ):
            bn = min(BQ, qn - q0)
            pb = pq[q0:q0 + bn]
            for i in range(bn):
                prefetch_ahead(qs, pb, i, bn)
                gather_query(Qr, i, qs[pb[i]], sc)
            transpose_columns(QT, Qr, bn, zero)
            kb = _seen(pk, kn, pb[bn - 1]) if causal else kn
            ST = PS[n, c, q0 // BQ] if save else ST0
            tile_scores(ST, kb, BQ, Kb, QT, D)
            if causal:
                _causal(ST, pk, pb, kb, bn, ninf)
            tile_softmax_pv(ST, kb, BQ, bn, Vb, O, mx, shift, csum, zero, one, ninf)
            if save:
                srow = ST[W]
                for i in range(BQ):
                    srow[i] = shift[i]
            for i in range(bn):    # merge into the position's running (m, l, out)
                prefetch_ahead(on, pb, i, bn)
                merge_row(on, mn, ln, pb[i], O[i], mx[i], csum[i], False, s1, zero)
    for p in range(L):
        normalise_row(on, mn, ln, lse[n], p, s1, zero, one, ninf)


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def backward_seq(q, k, v, g, out, qi, ki, nq, nk, lse, causal, cst, n,
                 dq, dk, dv, saved, PS):  # pragma: no cover - compiled
    """The gradients of :func:`forward_seq` for sequence ``n`` into ``dq``, ``dk``, ``dv`` ``(N, L, ·)`` (its rows
    zeroed first), with ``Δ = g·out`` per position computed in the same first pass. With ``saved``, the
    probabilities come from the forward's tiles in ``PS`` (:func:`.._gathered.tile_backward_saved`) instead of
    the scores computed again."""
    N, L, D = q.shape
    E = v.shape[2]
    C, W = qi.shape[1], qi.shape[2]
    BQ = min(W, QBLOCK)
    dt = q.dtype
    zero = cst[_HALF] - cst[_HALF]
    one = cst[_ONE]
    sc = cst[_SC]
    ninf = cst[_NINF]
    QT = zeros_aligned(D, BQ, q)
    Qb = empty_aligned(BQ, D, q)
    GT = zeros_aligned(E, BQ, q)
    Gb = empty_aligned(BQ, E, q)
    Kb = empty_aligned(W, D, q)
    Vb = empty_aligned(W, E, q)
    ST = empty_aligned(W, BQ, q)
    DT = empty_aligned(W, BQ, q)
    dQb = empty_aligned(BQ, D, q)
    dKb = empty_aligned(W, D, q)
    dVb = empty_aligned(W, E, q)
    lrow = empty_aligned(1, BQ, q)[0]
    drow = np.empty(BQ, dtype=dt)
    fac = np.empty(BQ, dtype=dt)
    qs = q[n]; ks = k[n]; vs = v[n]; gs = g[n]; os_ = out[n]
    dqn = dq[n]; dkn = dk[n]; dvn = dv[n]
    dl = np.empty(L, dtype=dt)
    for p in range(L):
        a = dqn[p]; b = dkn[p]
        for d in range(D):
            a[d] = zero
            b[d] = zero
        c_ = dvn[p]; gp = gs[p]; op = os_[p]
        acc = zero
        for e in range(E):
            c_[e] = zero
            acc += gp[e] * op[e]
        dl[p] = acc
    for c in range(C):
        qn = nq[n, c]
        kn = nk[n, c]
        if qn == 0 or kn == 0:
            continue
        pq = qi[n, c]; pk = ki[n, c]
        for j in range(kn):
            prefetch_ahead(ks, pk, j, kn); prefetch_ahead(vs, pk, j, kn)
            gather_kv(Kb, Vb, j, ks[pk[j]], vs[pk[j]])
            zero_kv(dKb, dVb, j, zero)
        for q0 in range(0, qn, BQ):
            bn = min(BQ, qn - q0)
            pb = pq[q0:q0 + bn]
            for i in range(bn):
                p = pb[i]
                prefetch_ahead(qs, pb, i, bn); prefetch_ahead(gs, pb, i, bn)
                gather_query_grad(Qb, Gb, i, qs[p], gs[p], sc)
                lrow[i] = lse[n, p]
                drow[i] = dl[p]
            for i in range(bn, BQ):
                lrow[i] = -ninf
                drow[i] = zero
            transpose_columns(GT, Gb, bn, zero)
            kb = _seen(pk, kn, pb[bn - 1]) if causal else kn
            if saved:
                tile_backward_saved(PS[n, c, q0 // BQ], fac, ST, DT, kb, BQ, bn, Kb, Vb, GT, Gb, Qb, lrow, drow,
                                    dKb, dVb, dQb, zero)
            else:
                transpose_columns(QT, Qb, bn, zero)
                tile_scores(ST, kb, BQ, Kb, QT, D)      # scores, key-major
                if causal:
                    _causal(ST, pk, pb, kb, bn, ninf)
                tile_backward(ST, DT, kb, BQ, bn, Kb, Vb, GT, Gb, Qb, lrow, drow, dKb, dVb, dQb,
                              zero, one)
            for i in range(bn):
                prefetch_ahead(dqn, pb, i, bn)
                dst = dqn[pb[i]]; src = dQb[i]
                for d in range(D):
                    dst[d] += src[d] * sc
        for j in range(kn):
            p = pk[j]
            prefetch_ahead(dkn, pk, j, kn); prefetch_ahead(dvn, pk, j, kn)
            dst = dkn[p]; src = dKb[j]
            for d in range(D):
                dst[d] += src[d]
            dstv = dvn[p]; srcv = dVb[j]
            for e in range(E):
                dstv[e] += srcv[e]
