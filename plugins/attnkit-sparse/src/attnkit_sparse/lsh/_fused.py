# ruff: noqa: E702, E741  -- tile code reads best a tile row per line; O, l: the softmax output and running sum
"""numba kernels of the fused CPU path of ``lsh``: each round's chunks read straight through the permutation.

One call handles sequence ``n``, rounds ``r0 .. r1`` and chunks ``c0 .. c1`` of the sorted order, serially
(``nogil``: :mod:`.fused` hands such items to threads). A chunk's queries, and the keys and values of the
previous and of its own chunk, are gathered by ``perm`` into small tiles (the previous chunk's tiles are
the last chunk's own ones, moved, not read again); scores ``Sᵀ = K̂ (scale·Q)ᵀ`` key-major, the element
masks (not itself; causal by original positions and padded keys when asked), one softmax over the
``2·cs`` keys and ``P V``; the engine's register tiles do the products (``_axpy``, ``_axpy_t``) and its
vectorised ``exp`` the exponentials. There are no sorted copies of q, k, v, no sorted outputs and no
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

import math

import numba
import numpy as np

from ..engine._numba_kernels import _HALF, _NINF, _SC, FASTMATH, _axpy, _axpy_t, _exp_into


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _mask(ST, pk, pq, kp, kn, qn, real, bi, causal, padded, ninf):  # pragma: no cover - compiled
    """``-inf`` in the key-major scores ``ST`` ``(kn, ·)`` where key ``j`` may not be seen by query ``i``."""
    if causal or padded:
        for j in range(kn):
            pj = pk[j]
            row = ST[j]
            if padded and not real[bi, pj]:
                for i in range(qn):
                    row[i] = ninf
                continue
            for i in range(qn):
                pi = pq[i]
                if pj == pi or (causal and pj > pi):
                    row[i] = ninf
    else:   # a round is a permutation: a position meets itself only on its own chunk's diagonal
        for i in range(qn):
            ST[kp + i, i] = ninf


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def forward_items(q, kh, v, perm, real, H, causal, padded, cs, cst, is32, n, r0, r1, c0, c1,
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
    one = cst[cst.shape[0] - 1]
    sc = cst[_SC]
    ninf = cst[_NINF]
    QT = np.zeros((D, cs), dtype=dt)
    Kb = np.empty((2 * cs, D), dtype=dt)
    Vb = np.empty((2 * cs, E), dtype=dt)
    ST = np.empty((2 * cs, cs), dtype=dt)
    O = np.empty((cs, E), dtype=dt)
    mx = np.empty(cs, dtype=dt)
    shift = np.empty(cs, dtype=dt)
    csum = np.empty(cs, dtype=dt)
    nbuf = np.empty(cs, dtype=np.int32)
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
                        kd = Kb[j]; ksrc = Kb[cs + j]
                        for d in range(D):
                            kd[d] = ksrc[d]
                        vd = Vb[j]; vsrc = Vb[cs + j]
                        for e in range(E):
                            vd[e] = vsrc[e]
                else:
                    for j in range(cs):
                        p = pr[a - cs + j]
                        pk[j] = p
                        kd = Kb[j]; ksrc = ks[p]
                        for d in range(D):
                            kd[d] = ksrc[d]
                        vd = Vb[j]; vsrc = vs[p]
                        for e in range(E):
                            vd[e] = vsrc[e]
            for i in range(qn):
                p = pr[a + i]
                pq[i] = p
                pk[kp + i] = p
                qi = qs[p]
                for d in range(D):
                    QT[d, i] = qi[d] * sc
                kd = Kb[kp + i]; ksrc = ks[p]
                for d in range(D):
                    kd[d] = ksrc[d]
                vd = Vb[kp + i]; vsrc = vs[p]
                for e in range(E):
                    vd[e] = vsrc[e]
            for i in range(qn, cs):
                for d in range(D):
                    QT[d, i] = zero
            for j in range(kn):
                row = ST[j]
                for i in range(cs):
                    row[i] = zero
            _axpy(ST, kn, Kb, QT, 0, D)
            _mask(ST, pk, pq, kp, kn, qn, real, bi, causal, padded, ninf)
            for i in range(cs):
                mx[i] = ninf
            for j in range(kn):
                row = ST[j]
                for i in range(cs):
                    x = row[i]
                    mx[i] = x if x > mx[i] else mx[i]
            for i in range(cs):    # an all-masked column keeps 0 as its shift (its exps are all 0)
                shift[i] = mx[i] if mx[i] > ninf else zero
                csum[i] = zero
            for j in range(kn):
                row = ST[j]
                _exp_into(row, one, shift, zero, row, nbuf, cst, is32)
                for i in range(cs):
                    csum[i] += row[i]
            for i in range(qn):
                oi = O[i]
                for e in range(E):
                    oi[e] = zero
            for g in range(0, qn, 4):
                _axpy_t(O, g, min(4, qn - g), ST, Vb, 0, 0, kn)
            for i in range(qn):    # merge into the position's running (m, l, out)
                p = pq[i]
                oi = on[p]; Oi = O[i]
                mi = mx[i]; li = csum[i]
                if first:
                    for e in range(E):
                        oi[e] = Oi[e]
                    mn[p] = mi
                    ln[p] = li
                elif li > zero:
                    mo = mn[p]
                    if mi > mo:
                        s1[0] = math.exp(mo - mi)
                        al = s1[0]
                        for e in range(E):
                            oi[e] = oi[e] * al + Oi[e]
                        ln[p] = ln[p] * al + li
                        mn[p] = mi
                    else:
                        s1[0] = math.exp(mi - mo)
                        be = s1[0]
                        for e in range(E):
                            oi[e] += be * Oi[e]
                        ln[p] += be * li
                if last:
                    lp = ln[p]
                    if lp > zero:
                        s1[1] = one / lp
                        rr = s1[1]
                        for e in range(E):
                            oi[e] *= rr
                        lse[n, p] = mn[p] + math.log(lp)
                    else:
                        for e in range(E):
                            oi[e] = zero
                        lse[n, p] = -ninf


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def backward_items(q, kh, v, g, perm, real, lse, delta, H, causal, padded, cs, cst, is32, n, r0, r1, c0, c1,
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
    one = cst[cst.shape[0] - 1]
    sc = cst[_SC]
    ninf = cst[_NINF]
    QT = np.zeros((D, cs), dtype=dt)
    Qb = np.empty((cs, D), dtype=dt)
    GT = np.zeros((E, cs), dtype=dt)
    Gb = np.empty((cs, E), dtype=dt)
    Kb = np.empty((2 * cs, D), dtype=dt)
    Vb = np.empty((2 * cs, E), dtype=dt)
    ST = np.empty((2 * cs, cs), dtype=dt)
    DT = np.empty((2 * cs, cs), dtype=dt)
    dQb = np.empty((cs, D), dtype=dt)
    dKb = np.empty((2 * cs, D), dtype=dt)
    dVb = np.empty((2 * cs, E), dtype=dt)
    lrow = np.empty(cs, dtype=dt)
    drow = np.empty(cs, dtype=dt)
    nbuf = np.empty(cs, dtype=np.int32)
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
                    kd = Kb[j]; ksrc = Kb[cs + j]; gd = dKb[j]; gsrc = dKb[cs + j]
                    for d in range(D):
                        kd[d] = ksrc[d]
                        gd[d] = gsrc[d]
                    vd = Vb[j]; vsrc = Vb[cs + j]; hd = dVb[j]; hsrc = dVb[cs + j]
                    for e in range(E):
                        vd[e] = vsrc[e]
                        hd[e] = hsrc[e]
            elif c > 0:
                for j in range(cs):
                    p = pr[a - cs + j]
                    pk[j] = p
                    kd = Kb[j]; ksrc = ks[p]; gd = dKb[j]
                    for d in range(D):
                        kd[d] = ksrc[d]
                        gd[d] = zero
                    vd = Vb[j]; vsrc = vs[p]; hd = dVb[j]
                    for e in range(E):
                        vd[e] = vsrc[e]
                        hd[e] = zero
            kn = kp + qn
            for i in range(qn):
                p = pr[a + i]
                pq[i] = p
                pk[kp + i] = p
                qi = qs[p]; qb = Qb[i]
                for d in range(D):
                    x = qi[d] * sc
                    QT[d, i] = x
                    qb[d] = x
                gi = gs[p]; gb = Gb[i]
                for e in range(E):
                    GT[e, i] = gi[e]
                    gb[e] = gi[e]
                kd = Kb[kp + i]; ksrc = ks[p]; gd = dKb[kp + i]
                for d in range(D):
                    kd[d] = ksrc[d]
                    gd[d] = zero
                vd = Vb[kp + i]; vsrc = vs[p]; hd = dVb[kp + i]
                for e in range(E):
                    vd[e] = vsrc[e]
                    hd[e] = zero
                lrow[i] = lse[n, p]
                drow[i] = delta[n, p]
            for i in range(qn, cs):
                for d in range(D):
                    QT[d, i] = zero
                for e in range(E):
                    GT[e, i] = zero
                lrow[i] = -ninf
                drow[i] = zero
            for j in range(kn):
                row = ST[j]; drw = DT[j]
                for i in range(cs):
                    row[i] = zero
                    drw[i] = zero
            _axpy(ST, kn, Kb, QT, 0, D)                   # scores, key-major
            _mask(ST, pk, pq, kp, kn, qn, real, bi, causal, padded, ninf)
            _axpy(DT, kn, Vb, GT, 0, E)                   # dPᵀ = V dOᵀ
            for j in range(kn):
                row = ST[j]; drw = DT[j]
                _exp_into(row, one, lrow, zero, row, nbuf, cst, is32)     # P = exp(S − lse)
                for i in range(cs):
                    drw[i] = row[i] * (drw[i] - drow[i])                  # dS = P (dP − Δ)
            _axpy(dVb, kn, ST, Gb, 0, qn)                 # dV += Pᵀ dO
            _axpy(dKb, kn, DT, Qb, 0, qn)                 # dK̂ += dSᵀ (scale·Q)
            for i in range(qn):
                qd = dQb[i]
                for d in range(D):
                    qd[d] = zero
            for gi_ in range(0, qn, 4):
                _axpy_t(dQb, gi_, min(4, qn - gi_), DT, Kb, 0, 0, kn)    # dQ = dS K̂ (times scale below)
            for i in range(qn):
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
