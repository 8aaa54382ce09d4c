# ruff: noqa: E702, E741  -- tile code reads best a tile row per line; O, l: the softmax output and running sum
"""numba kernels of the fused CPU path of ``lsh``: each round's chunks read straight through the permutation.

One call handles sequence ``n``, rounds ``r0 .. r1`` and chunks ``c0 .. c1`` of the sorted order, serially
(``nogil``: :mod:`.fused` hands such items to threads). A chunk's queries, and the keys and values of the
previous and of its own chunk, are gathered by ``perm`` into small tiles (the previous chunk's tiles are
the last chunk's own ones, moved, not read again); scores ``Sᵀ = K̂ (scale·Q)ᵀ`` key-major, the element
masks (not itself; causal by original positions and padded keys when asked), one softmax over the
``2·cs`` keys and ``P V``, by the tile steps routing's fused path shares (:mod:`.._gathered`: the engine's
register tiles and its vectorised ``exp``). There are no sorted copies of q, k, v, no sorted outputs and no
separate unsort: each position's rounds are merged as they come, by their log-sum-exp, into ``out``,
``m`` (running maximum) and ``l`` (running sum) at the position itself — a union softmax over all the
rounds' pairs, a pair counted once per round that holds it — and normalised in the last round.

The backward recomputes the probabilities from the saved log-sum-exp (``P = exp(S − lse)``, with the
global ``lse`` of the union, so the rounds need no combination step) and ``Δ = dO·O``:
``dS = P (dP − Δ)``, ``dQ = scale·dS K̂``, ``dK̂ = scale·dSᵀ Q``, ``dV = Pᵀ dO``; the keys' gradient tiles
are carried from one chunk to the next (a key gets its own chunk's and the next chunk's queries) and
written once per round, so within an item no row is written twice.

Rows ``n`` of ``q``, ``kh``, ``v``, ``g``, ``out``: ``(N, L, ·)`` with ``N = B·H`` (batch ``n // H``); ``perm``
int64 ``(N, R, L)`` (sorted row -> position); ``real`` bool ``(B, L)`` (key not padded; read only with
``padded``). Round ``0`` assigns every output row, later rounds add: a round holds every position once.
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
    tile_scores,
    tile_softmax_pv,
    transpose_columns,
    zero_kv,
)
from ..engine._numba_kernels import _HALF, _NINF, _ONE, _SC, FASTMATH


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _mask(ST, pk, pq, kp, kn, qn, real, bi, causal, padded, ninf):  # pragma: no cover - compiled
    """``-inf`` in the key-major scores ``ST`` ``(kn, ·)`` where key ``j`` may not be seen by query ``i``."""
    if causal or padded:
        keep = ninf - ninf    # NaN in the scores' dtype
        for j in range(kn):
            pj = pk[j]
            row = ST[j]
            if padded and not real[bi, pj]:
                for i in range(qn):
                    row[i] = ninf
                continue
            for i in range(qn):     # unconditional stores (fmin(s, NaN) is s): see routing's _causal
                pi = pq[i]
                row[i] = np.fmin(row[i], ninf if (pj == pi or (causal and pj > pi)) else keep)
    else:   # a round is a permutation: a position meets itself only on its own chunk's diagonal
        for i in range(qn):
            ST[kp + i, i] = ninf


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def forward_items(q, kh, v, perm, real, H, causal, padded, cs, cst, n, r0, r1, c0, c1,
                  out, m, l, lse):  # pragma: no cover - compiled
    """Rounds ``r0 .. r1`` and chunks ``c0 .. c1`` of sequence ``n`` merged into ``out`` ``(N, L, E)``, ``m``, ``l``
    ``(N, L)``; in the last round (``R − 1``) ``out`` is normalised and ``lse = m + log l`` (``+inf`` and output 0
    for a position with no pair in any round)."""
    N, L, D = q.shape
    E = v.shape[2]
    R = perm.shape[1]
    bi = (n // H) % real.shape[0]
    dt = q.dtype
    zero = cst[_HALF] - cst[_HALF]
    one = cst[_ONE]
    sc = cst[_SC]
    ninf = cst[_NINF]
    QT = zeros_aligned(D, cs, q)
    Qr = empty_aligned(cs, D, q)
    Kb = empty_aligned(2 * cs, D, q)
    Vb = empty_aligned(2 * cs, E, q)
    ST = empty_aligned(2 * cs, cs, q)
    O = empty_aligned(cs, E, q)
    mx = np.empty(cs, dtype=dt)
    shift = empty_aligned(1, cs, q)[0]   # read as vectors (_exp_sub)
    csum = np.empty(cs, dtype=dt)
    s1 = np.empty(2, dtype=dt)
    pq = np.empty(cs, dtype=np.int64)
    pk = np.empty(2 * cs, dtype=np.int64)
    qs = q[n]; ks = kh[n]; vs = v[n]; on = out[n]; mn = m[n]; ln = l[n]
    for r in range(r0, r1):
        pr = perm[n, r]
        first = r == 0
        last = r == R - 1
        for c in range(c0, c1):
            a = c * cs
            qn = min(cs, L - a)
            kp = cs if c > 0 else 0
            kn = kp + qn
            if c > 0:
                if c > c0:     # the previous chunk's own tiles (full: only the last chunk is short), moved
                    for j in range(cs if c > 1 else 0):     # (chunk 0's are in place already)
                        pk[j] = pk[cs + j]
                        gather_kv(Kb, Vb, j, Kb[cs + j], Vb[cs + j])
                else:
                    for j in range(cs):
                        p = pr[a - cs + j]
                        pk[j] = p
                        gather_kv(Kb, Vb, j, ks[p], vs[p])
            end = a + qn   # the chunk's rows, in the sorted order known in advance
            for i in range(qn):
                p = pr[a + i]
                prefetch_ahead(qs, pr, a + i, end); prefetch_ahead(ks, pr, a + i, end)
                prefetch_ahead(vs, pr, a + i, end)
                pq[i] = p
                pk[kp + i] = p
                gather_query(Qr, i, qs[p], sc)
                gather_kv(Kb, Vb, kp + i, ks[p], vs[p])
            transpose_columns(QT, Qr, qn, zero)
            tile_scores(ST, kn, cs, Kb, QT, D)
            _mask(ST, pk, pq, kp, kn, qn, real, bi, causal, padded, ninf)
            tile_softmax_pv(ST, kn, cs, qn, Vb, O, mx, shift, csum, zero, one, ninf)
            for i in range(qn):    # merge into the position's running (m, l, out)
                p = pq[i]
                prefetch_ahead(on, pq, i, qn)
                merge_row(on, mn, ln, p, O[i], mx[i], csum[i], first, s1, zero)
                if last:
                    normalise_row(on, mn, ln, lse[n], p, s1, zero, one, ninf)


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def backward_items(q, kh, v, g, perm, real, lse, delta, H, causal, padded, cs, cst, n, r0, r1, c0, c1,
                   dq, dk, dv, dk_edge, dv_edge):  # pragma: no cover - compiled
    """The gradients of :func:`forward_items` for rounds ``r0 .. r1``, chunks ``c0 .. c1`` of sequence ``n``:
    ``dq``, ``dk`` (of ``kh``), ``dv`` ``(N, L, ·)`` assigned in round 0, added to later; the previous chunk's
    keys of chunk ``c0 > 0`` (another item's) get their share added to ``dk_edge``, ``dv_edge`` instead
    (zero-filled by the caller; unused when every item starts at chunk 0)."""
    N, L, D = q.shape
    E = v.shape[2]
    bi = (n // H) % real.shape[0]
    dt = q.dtype
    zero = cst[_HALF] - cst[_HALF]
    one = cst[_ONE]
    sc = cst[_SC]
    ninf = cst[_NINF]
    QT = zeros_aligned(D, cs, q)
    Qb = empty_aligned(cs, D, q)
    GT = zeros_aligned(E, cs, q)
    Gb = empty_aligned(cs, E, q)
    Kb = empty_aligned(2 * cs, D, q)
    Vb = empty_aligned(2 * cs, E, q)
    ST = empty_aligned(2 * cs, cs, q)
    DT = empty_aligned(2 * cs, cs, q)
    dQb = empty_aligned(cs, D, q)
    dKb = empty_aligned(2 * cs, D, q)
    dVb = empty_aligned(2 * cs, E, q)
    lrow = empty_aligned(1, cs, q)[0]
    drow = np.empty(cs, dtype=dt)
    pq = np.empty(cs, dtype=np.int64)
    pk = np.empty(2 * cs, dtype=np.int64)
    qs = q[n]; ks = kh[n]; vs = v[n]; gs = g[n]
    dqn = dq[n]; dkn = dk[n]; dvn = dv[n]
    for r in range(r0, r1):
        pr = perm[n, r]
        first = r == 0
        kn = 0
        for c in range(c0, c1):
            a = c * cs
            qn = min(cs, L - a)
            kp = cs if c > 0 else 0
            if c > c0:      # the previous chunk: its own tiles and its keys' gradients so far, moved
                for j in range(cs if c > 1 else 0):         # (chunk 0's are in place already)
                    pk[j] = pk[cs + j]
                    gather_kv(Kb, Vb, j, Kb[cs + j], Vb[cs + j])
                    gather_kv(dKb, dVb, j, dKb[cs + j], dVb[cs + j])
            elif c > 0:
                for j in range(cs):
                    p = pr[a - cs + j]
                    pk[j] = p
                    gather_kv(Kb, Vb, j, ks[p], vs[p])
                    zero_kv(dKb, dVb, j, zero)
            kn = kp + qn
            end = a + qn
            for i in range(qn):
                p = pr[a + i]
                prefetch_ahead(qs, pr, a + i, end); prefetch_ahead(gs, pr, a + i, end)
                prefetch_ahead(ks, pr, a + i, end); prefetch_ahead(vs, pr, a + i, end)
                pq[i] = p
                pk[kp + i] = p
                gather_query_grad(Qb, Gb, i, qs[p], gs[p], sc)
                gather_kv(Kb, Vb, kp + i, ks[p], vs[p])
                zero_kv(dKb, dVb, kp + i, zero)
                lrow[i] = lse[n, p]
                drow[i] = delta[n, p]
            for i in range(qn, cs):
                lrow[i] = -ninf
                drow[i] = zero
            transpose_columns(QT, Qb, qn, zero)
            transpose_columns(GT, Gb, qn, zero)
            tile_scores(ST, kn, cs, Kb, QT, D)      # scores, key-major
            _mask(ST, pk, pq, kp, kn, qn, real, bi, causal, padded, ninf)
            tile_backward(ST, DT, kn, cs, qn, Kb, Vb, GT, Gb, Qb, lrow, drow, dKb, dVb, dQb,
                          zero, one)
            for i in range(qn):
                prefetch_ahead(dqn, pq, i, qn)
                dst = dqn[pq[i]]; src = dQb[i]
                if first:
                    for d in range(D):
                        dst[d] = src[d] * sc
                else:
                    for d in range(D):
                        dst[d] += src[d] * sc
            if c > 0:       # the previous chunk's keys are complete (its own and this chunk's queries)
                tk = dkn if c > c0 else dk_edge[n]
                tv = dvn if c > c0 else dv_edge[n]
                add = (not first) or c == c0
                for j in range(cs):
                    p = pk[j]
                    prefetch_ahead(tk, pk, j, cs); prefetch_ahead(tv, pk, j, cs)
                    dst = tk[p]; src = dKb[j]
                    dstv = tv[p]; srcv = dVb[j]
                    if add:
                        for d in range(D):
                            dst[d] += src[d]
                        for e in range(E):
                            dstv[e] += srcv[e]
                    else:
                        for d in range(D):
                            dst[d] = src[d]
                        for e in range(E):
                            dstv[e] = srcv[e]
        # the item's last chunk: its keys have all the item's shares (the next chunk's queries, if any,
        # belong to another item, which adds them to the edge buffers)
        c = c1 - 1
        kp = cs if c > 0 else 0
        for j in range(kp, kn):
            p = pk[j]
            dst = dkn[p]; src = dKb[j]
            dstv = dvn[p]; srcv = dVb[j]
            if first:
                for d in range(D):
                    dst[d] = src[d]
                for e in range(E):
                    dstv[e] = srcv[e]
            else:
                for d in range(D):
                    dst[d] += src[d]
                for e in range(E):
                    dstv[e] += srcv[e]
