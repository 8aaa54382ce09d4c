# ruff: noqa: E702, E741  -- tile code reads best a tile row per line; O, l: the softmax output and running sum
"""numba kernels of routing's fused CPU path: each cluster's rows read straight through its routed positions.

One call handles sequence ``n`` (all its clusters, serially; ``nogil``: :mod:`.fused` hands sequences to
threads). Cluster ``c``'s used query slots are the first ``nq[n, c]`` of ``qi[n, c]`` and its used key slots
the first ``nk[n, c]`` of ``ki[n, c]`` (the routing lists them first, ascending). The queries (scaled,
transposed), keys and values are gathered by position into small tiles; scores ``Sᵀ = K (scale·Q)ᵀ``
key-major, ``causal`` by original positions, one softmax per query over the cluster's keys and ``P V``, with
the engine's register tiles (``_axpy``, ``_axpy_t``) and its vectorised ``exp`` (the model is ``lsh/_fused.py``).
There are no routed copies of q, k, v, no per-cluster outputs and no separate combination: each cluster's
rows are merged at the position, by their log-sum-exp, into ``out``, ``m`` (running maximum), ``l`` (running
sum), and every position is normalised at the end (0, and ``lse = +inf``, where no cluster gave it a key).

The backward recomputes the probabilities from the saved (union) log-sum-exp, ``P = exp(S − lse)``, and
``Δ = dO·O``: ``dS = P (dP − Δ)``, ``dQ = scale·dS K``, ``dK = scale·dSᵀ Q``, ``dV = Pᵀ dO``, added at the
positions (a sequence's rows are zeroed first: positions no cluster routed get 0).

Rows ``n`` of ``q``, ``k``, ``v``, ``g``, ``out``: ``(N, L, ·)`` with ``N = B·H``; ``qi``, ``ki`` int64 ``(N, C, W)``;
``nq``, ``nk`` int64 ``(N, C)``.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from ..engine._numba_kernels import _HALF, _NINF, _SC, FASTMATH, _axpy, _axpy_t, _exp_into


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def forward_seq(q, k, v, qi, ki, nq, nk, causal, cst, is32, n, out, m, l, lse):  # pragma: no cover - compiled
    """Sequence ``n``'s clusters merged into ``out`` ``(N, L, E)`` and ``lse`` ``(N, L)`` (``m``, ``l`` scratch)."""
    N, L, D = q.shape
    E = v.shape[2]
    C, W = qi.shape[1], qi.shape[2]
    dt = q.dtype
    zero = cst[_HALF] - cst[_HALF]
    one = cst[cst.shape[0] - 1]
    sc = cst[_SC]
    ninf = cst[_NINF]
    QT = np.zeros((D, W), dtype=dt)
    Kb = np.empty((W, D), dtype=dt)
    Vb = np.empty((W, E), dtype=dt)
    ST = np.empty((W, W), dtype=dt)
    O = np.empty((W, E), dtype=dt)
    mx = np.empty(W, dtype=dt)
    shift = np.empty(W, dtype=dt)
    csum = np.empty(W, dtype=dt)
    nbuf = np.empty(W, dtype=np.int32)
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
        for i in range(qn):
            qr = qs[pq[i]]
            for d in range(D):
                QT[d, i] = qr[d] * sc
        for i in range(qn, W):
            for d in range(D):
                QT[d, i] = zero
        for j in range(kn):
            kd = Kb[j]; ksrc = ks[pk[j]]
            for d in range(D):
                kd[d] = ksrc[d]
            vd = Vb[j]; vsrc = vs[pk[j]]
            for e in range(E):
                vd[e] = vsrc[e]
            row = ST[j]
            for i in range(W):
                row[i] = zero
        _axpy(ST, kn, Kb, QT, 0, D)
        if causal:
            for j in range(kn):
                pj = pk[j]
                row = ST[j]
                for i in range(qn):
                    if pj > pq[i]:
                        row[i] = ninf
        for i in range(W):
            mx[i] = ninf
        for j in range(kn):
            row = ST[j]
            for i in range(W):
                x = row[i]
                mx[i] = x if x > mx[i] else mx[i]
        for i in range(W):    # an all-masked column keeps 0 as its shift (its exps are all 0)
            shift[i] = mx[i] if mx[i] > ninf else zero
            csum[i] = zero
        for j in range(kn):
            row = ST[j]
            _exp_into(row, one, shift, zero, row, nbuf, cst, is32)
            for i in range(W):
                csum[i] += row[i]
        for i in range(qn):
            oi = O[i]
            for e in range(E):
                oi[e] = zero
        for g in range(0, qn, 4):
            _axpy_t(O, g, min(4, qn - g), ST, Vb, 0, 0, kn)
        for i in range(qn):    # merge into the position's running (m, l, out)
            li = csum[i]
            if not li > zero:
                continue
            p = pq[i]
            oi = on[p]; Oi = O[i]
            mi = mx[i]
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
    for p in range(L):
        lp = ln[p]
        oi = on[p]
        if lp > zero:
            s1[1] = one / lp
            rr = s1[1]
            for e in range(E):
                oi[e] *= rr
            lse[n, p] = mn[p] + math.log(lp)
        else:           # no key: +inf, so the backward's exp(S - lse) is 0 there
            lse[n, p] = -ninf


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def backward_seq(q, k, v, g, out, qi, ki, nq, nk, lse, causal, cst, is32, n,
                 dq, dk, dv):  # pragma: no cover - compiled
    """The gradients of :func:`forward_seq` for sequence ``n`` into ``dq``, ``dk``, ``dv`` ``(N, L, ·)`` (its rows
    zeroed first), with ``Δ = g·out`` per position computed in the same first pass."""
    N, L, D = q.shape
    E = v.shape[2]
    C, W = qi.shape[1], qi.shape[2]
    dt = q.dtype
    zero = cst[_HALF] - cst[_HALF]
    one = cst[cst.shape[0] - 1]
    sc = cst[_SC]
    ninf = cst[_NINF]
    QT = np.zeros((D, W), dtype=dt)
    Qb = np.empty((W, D), dtype=dt)
    GT = np.zeros((E, W), dtype=dt)
    Gb = np.empty((W, E), dtype=dt)
    Kb = np.empty((W, D), dtype=dt)
    Vb = np.empty((W, E), dtype=dt)
    ST = np.empty((W, W), dtype=dt)
    DT = np.empty((W, W), dtype=dt)
    dQb = np.empty((W, D), dtype=dt)
    dKb = np.empty((W, D), dtype=dt)
    dVb = np.empty((W, E), dtype=dt)
    lrow = np.empty(W, dtype=dt)
    drow = np.empty(W, dtype=dt)
    nbuf = np.empty(W, dtype=np.int32)
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
        for i in range(qn):
            p = pq[i]
            qr = qs[p]; qb = Qb[i]
            for d in range(D):
                x = qr[d] * sc
                QT[d, i] = x
                qb[d] = x
            gr = gs[p]; gb = Gb[i]
            for e in range(E):
                GT[e, i] = gr[e]
                gb[e] = gr[e]
            lrow[i] = lse[n, p]
            drow[i] = dl[p]
        for i in range(qn, W):
            for d in range(D):
                QT[d, i] = zero
            for e in range(E):
                GT[e, i] = zero
            lrow[i] = -ninf
            drow[i] = zero
        for j in range(kn):
            p = pk[j]
            kd = Kb[j]; ksrc = ks[p]; gd = dKb[j]
            for d in range(D):
                kd[d] = ksrc[d]
                gd[d] = zero
            vd = Vb[j]; vsrc = vs[p]; hd = dVb[j]
            for e in range(E):
                vd[e] = vsrc[e]
                hd[e] = zero
            row = ST[j]; drw = DT[j]
            for i in range(W):
                row[i] = zero
                drw[i] = zero
        _axpy(ST, kn, Kb, QT, 0, D)                   # scores, key-major
        if causal:
            for j in range(kn):
                pj = pk[j]
                row = ST[j]
                for i in range(qn):
                    if pj > pq[i]:
                        row[i] = ninf
        _axpy(DT, kn, Vb, GT, 0, E)                   # dPᵀ = V dOᵀ
        for j in range(kn):
            row = ST[j]; drw = DT[j]
            _exp_into(row, one, lrow, zero, row, nbuf, cst, is32)     # P = exp(S − lse)
            for i in range(W):
                drw[i] = row[i] * (drw[i] - drow[i])                  # dS = P (dP − Δ)
        _axpy(dVb, kn, ST, Gb, 0, qn)                 # dV += Pᵀ dO
        _axpy(dKb, kn, DT, Qb, 0, qn)                 # dK += dSᵀ (scale·Q)
        for i in range(qn):
            qd = dQb[i]
            for d in range(D):
                qd[d] = zero
        for g_ in range(0, qn, 4):
            _axpy_t(dQb, g_, min(4, qn - g_), DT, Kb, 0, 0, kn)       # dQ = dS K (times scale below)
        for i in range(qn):
            dst = dqn[pq[i]]; src = dQb[i]
            for d in range(D):
                dst[d] += src[d] * sc
        for j in range(kn):
            p = pk[j]
            dst = dkn[p]; src = dKb[j]
            for d in range(D):
                dst[d] += src[d]
            dstv = dvn[p]; srcv = dVb[j]
            for e in range(E):
                dstv[e] += srcv[e]
