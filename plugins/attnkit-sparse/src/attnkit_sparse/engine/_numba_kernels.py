# ruff: noqa: E702  -- the register tiles read best one tile row per line (a0 = ...; a1 = ...)
"""numba kernels of the block-sparse engine: forward (online softmax, saves the log-sum-exp) and backward.

Arrays: ``q (N, L, D)``, ``k (N, S, D)``, ``v (N, S, E)`` with N = B·H (row
``n`` is batch ``n // H``, head ``n % H``); the plan's index arrays (see
:mod:`.plan`) with a leading ``(B', H')`` indexed by ``b % B'``, ``h % H'``.

* :func:`forward`: ``prange`` over N x NQ query blocks. Per visited key block:
  the key tile is transposed into a ``(D, BK)`` buffer, scores ``Q Kᵀ`` and
  ``acc += P V`` are both computed as axpy rows (:func:`_axpy`: 4 rows x 4
  terms per pass, vectorised over the contiguous row with ``reassoc``; no
  horizontal sums), then the tile's element mask (PARTIAL) and an
  online-softmax update of the row maxima and sums. Stores ``out`` and ``lse = m + log(l)`` per row.
* :func:`backward_dq`: ``prange`` over N x NQ: recomputes ``P = exp(scale·QKᵀ −
  lse)`` from the saved log-sum-exp (FlashAttention-2), ``dP = dO Vᵀ``,
  ``dS = P (dP − Δ)``, ``dQ += scale · dS K``.
* :func:`backward_dkdv`: ``prange`` over N x NK key blocks via the transposed
  index: ``dV += Pᵀ dO``, ``dK += scale · dSᵀ Q``. Each worker owns the rows
  it writes, so no two threads write the same rows. It can keep ``scale·dS``
  per tile (``ds``, at the tile's slot of the query-major index); then
  :func:`backward_dq_from_ds` gives ``dQ`` with one product per tile instead
  of :func:`backward_dq`'s three and an ``exp`` (5 tile products in the
  backward instead of 7, for memory ``tiles·BQ·BK``).

``exp`` is evaluated a row of a tile at a time by a polynomial with an exact
power-of-two scaling through an integer view (:func:`_exp_row`), so the loop
vectorises (numba has no vector ``exp`` without Intel's SVML). Its
relative error is ~1e-7 in float32 and ~1e-14 in float64.
"""

from __future__ import annotations

import math

import numba
import numpy as np

# reassociation lets LLVM vectorise the reductions; no NaN/inf assumptions (masked scores are -inf)
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

def constants(dtype: np.dtype, scale: float) -> np.ndarray:
    """The kernels' typed constants (a literal would be float64): ``[scale, -inf, log2(e), ln2 hi, ln2 lo,
    lowest exp argument, 0.5, exp's Taylor coefficients highest degree first (degree 6 / 12)]``."""
    f32 = np.dtype(dtype) == np.float32
    ln2 = (0.693359375, -2.12194440e-4) if f32 else (0.693145751953125, 1.42860682030941723212e-6)
    deg = 6 if f32 else 12
    head = [scale, -np.inf, 1.4426950408889634, ln2[0], ln2[1], -87.0 if f32 else -708.0, 0.5]
    return np.array(head + [1.0 / math.factorial(i) for i in range(deg, -1, -1)], dtype=dtype)


_SC, _NINF, _LOG2E, _LN2_HI, _LN2_LO, _LO, _HALF, _POLY = range(8)


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _exp_row(x, n, out, nbuf, cst, is32):  # pragma: no cover - compiled
    """``out[:n] = exp(x[:n])`` for ``x <= ~0``, 0 below the underflow bound (and for ``-inf``), NaN for NaN,
    in vectorisable passes; ``x`` is overwritten with the reduced argument, ``nbuf`` is int32 scratch."""
    lo = cst[_LO]; log2e = cst[_LOG2E]; c1 = cst[_LN2_HI]; c2 = cst[_LN2_LO]
    half = cst[_HALF]
    for j in range(n):
        xj = x[j]
        under = xj <= lo
        nan = xj != xj
        xc = lo if (under or nan) else xj
        ni = np.int32(half - xc * log2e)      # round(-xc·log2 e) by truncation (xc <= ~0)
        nbuf[j] = 2000 if nan else (-1000 if under else -ni)
        x[j] = (xc + ni * c1) + ni * c2
        out[j] = cst[_POLY]
    K = cst.shape[0]
    for c in range(_POLY + 1, K):
        cc = cst[c]
        for j in range(n):
            out[j] = out[j] * x[j] + cc
    if is32:
        oi = out.view(np.int32)
        for j in range(n):
            e = nbuf[j]
            oi[j] = (oi[j] + (e << 23)) if e > -1000 and e < 2000 else (0 if e <= -1000 else 0x7FC00000)
    else:
        ol = out.view(np.int64)
        for j in range(n):
            e = np.int64(nbuf[j])
            ol[j] = (ol[j] + (e << 52)) if e > -1000 and e < 2000 else (0 if e <= -1000 else 0x7FF8000000000000)


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _transpose(X, x0, xn, OUT):  # pragma: no cover - compiled
    """``OUT[d, j] = X[x0 + j, d]`` for ``j < xn`` (a tile of rows, transposed into a ``(D, block)`` buffer)."""
    D = X.shape[1]
    for j in range(xn):
        xj = X[x0 + j]
        for d in range(D):
            OUT[d, j] = xj[d]


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _dots(X, x0, xn, YT, OUT, zero):  # pragma: no cover - compiled
    """``OUT[i, :] = sum_d X[x0 + i, d] · YT[d, :]`` for ``i < xn``: the products of a tile of rows with
    another tile given transposed (``(D, block)``), as axpy rows (:func:`_axpy`), which keep the
    vector units busier than dot-product tiles with their horizontal sums (measured)."""
    for i in range(xn):
        o = OUT[i]
        for j in range(o.shape[0]):
            o[j] = zero
    _axpy(OUT, xn, X[x0:x0 + xn], YT, 0, YT.shape[0])


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _axpy(OUT, on, C, Y, y0, yn):  # pragma: no cover - compiled
    """``OUT[i] += sum_{j < yn} C[i, j] · Y[y0 + j]`` for ``i < on``: 4 rows x 4 terms per pass over a row,
    so each load of ``Y`` feeds four rows and each row is loaded and stored once per four terms."""
    E = Y.shape[1]
    on4 = on - on % 4
    yn4 = yn - yn % 4
    for i in range(0, on4, 4):
        oa = OUT[i]; ob = OUT[i + 1]; oc = OUT[i + 2]; od = OUT[i + 3]
        ca = C[i]; cb = C[i + 1]; cc = C[i + 2]; cd = C[i + 3]
        for j in range(0, yn4, 4):
            y0_ = Y[y0 + j]; y1 = Y[y0 + j + 1]; y2 = Y[y0 + j + 2]; y3 = Y[y0 + j + 3]
            p0 = ca[j]; p1 = ca[j + 1]; p2 = ca[j + 2]; p3 = ca[j + 3]
            r0 = cb[j]; r1 = cb[j + 1]; r2 = cb[j + 2]; r3 = cb[j + 3]
            s0 = cc[j]; s1 = cc[j + 1]; s2 = cc[j + 2]; s3 = cc[j + 3]
            t0 = cd[j]; t1 = cd[j + 1]; t2 = cd[j + 2]; t3 = cd[j + 3]
            for e in range(E):
                u0 = y0_[e]; u1 = y1[e]; u2 = y2[e]; u3 = y3[e]
                oa[e] += p0 * u0 + p1 * u1 + p2 * u2 + p3 * u3
                ob[e] += r0 * u0 + r1 * u1 + r2 * u2 + r3 * u3
                oc[e] += s0 * u0 + s1 * u1 + s2 * u2 + s3 * u3
                od[e] += t0 * u0 + t1 * u1 + t2 * u2 + t3 * u3
        for j in range(yn4, yn):
            yj = Y[y0 + j]
            p0 = ca[j]; r0 = cb[j]; s0 = cc[j]; t0 = cd[j]
            for e in range(E):
                u = yj[e]
                oa[e] += p0 * u; ob[e] += r0 * u; oc[e] += s0 * u; od[e] += t0 * u
    for i in range(on4, on):
        oa = OUT[i]; ca = C[i]
        for j in range(yn):
            yj = Y[y0 + j]
            p0 = ca[j]
            for e in range(E):
                oa[e] += p0 * yj[e]


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _axpy_rows(OUT, o0, n, C, c0, Y, y0, j0, j1, e0, e1):  # pragma: no cover - compiled
    """``OUT[o0 + r, e] += sum_{j0 <= j < j1} C[c0 + r, j] · Y[y0 + j, e]`` for ``r < n <= 4``, ``e0 <= e < e1``.

    The span-restricted form of :func:`_axpy` used on PARTIAL tiles: only the
    columns (and terms) that some row of the group can use are computed.
    """
    if n == 4:
        oa = OUT[o0]; ob = OUT[o0 + 1]; oc = OUT[o0 + 2]; od = OUT[o0 + 3]
        ca = C[c0]; cb = C[c0 + 1]; cc = C[c0 + 2]; cd = C[c0 + 3]
        j4 = j1 - (j1 - j0) % 4
        for j in range(j0, j4, 4):
            y0_ = Y[y0 + j]; y1 = Y[y0 + j + 1]; y2 = Y[y0 + j + 2]; y3 = Y[y0 + j + 3]
            p0 = ca[j]; p1 = ca[j + 1]; p2 = ca[j + 2]; p3 = ca[j + 3]
            r0 = cb[j]; r1 = cb[j + 1]; r2 = cb[j + 2]; r3 = cb[j + 3]
            s0 = cc[j]; s1 = cc[j + 1]; s2 = cc[j + 2]; s3 = cc[j + 3]
            t0 = cd[j]; t1 = cd[j + 1]; t2 = cd[j + 2]; t3 = cd[j + 3]
            for e in range(e0, e1):
                u0 = y0_[e]; u1 = y1[e]; u2 = y2[e]; u3 = y3[e]
                oa[e] += p0 * u0 + p1 * u1 + p2 * u2 + p3 * u3
                ob[e] += r0 * u0 + r1 * u1 + r2 * u2 + r3 * u3
                oc[e] += s0 * u0 + s1 * u1 + s2 * u2 + s3 * u3
                od[e] += t0 * u0 + t1 * u1 + t2 * u2 + t3 * u3
        for j in range(j4, j1):
            yj = Y[y0 + j]
            p0 = ca[j]; r0 = cb[j]; s0 = cc[j]; t0 = cd[j]
            for e in range(e0, e1):
                u = yj[e]
                oa[e] += p0 * u; ob[e] += r0 * u; oc[e] += s0 * u; od[e] += t0 * u
    else:
        for r in range(n):
            oa = OUT[o0 + r]; ca = C[c0 + r]
            for j in range(j0, j1):
                yj = Y[y0 + j]
                p0 = ca[j]
                for e in range(e0, e1):
                    oa[e] += p0 * yj[e]


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _apply_tile_mask(Sc, rn, cn, bank, t, transposed):  # pragma: no cover - compiled
    """``-inf`` where the bank entry ``t`` forbids a pair (``Sc`` is ``(rows, cols)``, transposed for key-major)."""
    ninf = -np.inf
    if transposed:
        for i in range(rn):
            for j in range(cn):
                if not bank[t, j, i]:
                    Sc[i, j] = ninf
    else:
        for i in range(rn):
            bt = bank[t, i]
            for j in range(cn):
                if not bt[j]:
                    Sc[i, j] = ninf


@numba.njit(parallel=True, cache=True, fastmath=FASTMATH, nogil=True)
def forward(q, k, v, H, kv_count, kv_idx, kv_tile, bank, span, bq, bk, cst, is32):  # pragma: no cover
    N, L, D = q.shape
    S = k.shape[1]
    E = v.shape[2]
    Bp, Hp, NQ = kv_count.shape
    out = np.empty((N, L, E), dtype=q.dtype)
    lse = np.empty((N, L), dtype=q.dtype)
    zero = cst[_SC] * 0
    sc = cst[_SC]
    ninf = cst[_NINF]
    for it in numba.prange(N * NQ):
        n = it // NQ; qb = it % NQ
        bi = (n // H) % Bp; hi_ = (n % H) % Hp
        q0 = qb * bq
        qn = min(bq, L - q0)
        qs = q[n]; ks = k[n]; vs = v[n]
        acc = np.zeros((bq, E), dtype=q.dtype)
        KT = np.zeros((D, bk), dtype=q.dtype)
        Sc = np.empty((bq, bk), dtype=q.dtype)
        Qs = np.empty((bq, D), dtype=q.dtype)       # the query block, scaled once
        for i in range(qn):
            for d in range(D):
                Qs[i, d] = qs[q0 + i, d] * sc
        m = np.full(bq, ninf, dtype=q.dtype)
        lsum = np.zeros(bq, dtype=q.dtype)
        xrow = np.empty(bk, dtype=q.dtype)
        nbuf = np.empty(bk, dtype=np.int32)
        lo = np.zeros(bq, dtype=np.int32)            # per row: the span of columns the tile allows
        hi = np.zeros(bq, dtype=np.int32)
        for c in range(kv_count[bi, hi_, qb]):
            kb = kv_idx[bi, hi_, qb, c]; t = kv_tile[bi, hi_, qb, c]
            k0 = kb * bk
            kn = min(bk, S - k0)
            _transpose(ks, k0, kn, KT)
            for i in range(qn):
                if t >= 0:
                    lo[i] = span[t, i, 0]; hi[i] = min(span[t, i, 1], kn)
                else:
                    lo[i] = 0; hi[i] = kn
            _dots(Qs, 0, qn, KT, Sc, zero)
            if t >= 0:
                _apply_tile_mask(Sc, qn, kn, bank, t, False)
            for i in range(qn):
                row = Sc[i]
                mx = ninf
                for j in range(kn):
                    mx = max(mx, row[j])
                mnew = max(m[i], mx)
                if mnew == ninf:
                    for j in range(kn):
                        if row[j] != row[j]:  # NaN in, NaN out (NaN scores elsewhere reach lsum through exp)
                            lsum[i] = row[j]
                        row[j] = 0
                    continue
                for j in range(kn):
                    xrow[j] = row[j] - mnew
                _exp_row(xrow, kn, row, nbuf, cst, is32)
                s = zero
                for j in range(kn):
                    s += row[j]
                alpha = math.exp(m[i] - mnew)
                if alpha != 1:
                    ai = acc[i]
                    for e in range(E):
                        ai[e] *= alpha
                lsum[i] = lsum[i] * alpha + s
                m[i] = mnew
            for g in range(0, qn, 4):
                gn = min(4, qn - g)
                c0 = bk; c1 = 0
                for r in range(g, g + gn):
                    c0 = min(c0, lo[r]); c1 = max(c1, hi[r])
                if c1 > c0:
                    _axpy_rows(acc, g, gn, Sc, g, vs, k0, c0, c1, 0, E)
        for i in range(qn):
            o = out[n, q0 + i]
            if lsum[i] > 0 or lsum[i] != lsum[i]:
                r = 1 / lsum[i]
                for e in range(E):
                    o[e] = acc[i, e] * r
                lse[n, q0 + i] = m[i] + math.log(lsum[i])
            else:
                for e in range(E):
                    o[e] = 0
                lse[n, q0 + i] = -ninf  # exp(s - inf) = 0: an empty row has no gradient
    return out, lse


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _probs(Sc, rn, cn, lse_rows, sc, xrow, nbuf, cst, is32):  # pragma: no cover - compiled
    """``Sc[i, j] = exp(sc · Sc[i, j] − lse_rows[i])`` in place (rows of query i)."""
    for i in range(rn):
        row = Sc[i]
        li = lse_rows[i]
        for j in range(cn):
            xrow[j] = row[j] * sc - li
        _exp_row(xrow, cn, row, nbuf, cst, is32)


@numba.njit(parallel=True, cache=True, fastmath=FASTMATH, nogil=True)
def backward_dq(q, k, v, do, lse, delta, H, kv_count, kv_idx, kv_tile, bank, bq, bk, cst,
                is32):  # pragma: no cover - compiled
    N, L, D = q.shape
    S = k.shape[1]
    Bp, Hp, NQ = kv_count.shape
    dq = np.zeros((N, L, D), dtype=q.dtype)
    zero = cst[_SC] * 0
    sc = cst[_SC]
    for it in numba.prange(N * NQ):
        n = it // NQ; qb = it % NQ
        bi = (n // H) % Bp; hi = (n % H) % Hp
        q0 = qb * bq
        qn = min(bq, L - q0)
        qs = q[n]; ks = k[n]; vs = v[n]; dos = do[n]
        E = vs.shape[1]
        KT = np.zeros((D, bk), dtype=q.dtype)
        VT = np.zeros((E, bk), dtype=q.dtype)
        Sc = np.empty((bq, bk), dtype=q.dtype)
        dP = np.empty((bq, bk), dtype=q.dtype)
        xrow = np.empty(bk, dtype=q.dtype)
        nbuf = np.empty(bk, dtype=np.int32)
        acc = np.zeros((bq, D), dtype=q.dtype)
        lr = lse[n, q0:q0 + qn]
        dl = delta[n, q0:q0 + qn]
        for c in range(kv_count[bi, hi, qb]):
            kb = kv_idx[bi, hi, qb, c]; t = kv_tile[bi, hi, qb, c]
            k0 = kb * bk
            kn = min(bk, S - k0)
            _transpose(ks, k0, kn, KT)
            _transpose(vs, k0, kn, VT)
            _dots(qs, q0, qn, KT, Sc, zero)
            if t >= 0:
                _apply_tile_mask(Sc, qn, kn, bank, t, False)
            _probs(Sc, qn, kn, lr, sc, xrow, nbuf, cst, is32)
            _dots(dos, q0, qn, VT, dP, zero)
            for i in range(qn):
                di = dl[i]
                for j in range(kn):
                    dP[i, j] = Sc[i, j] * (dP[i, j] - di) * sc
            _axpy(acc, qn, dP, ks, k0, kn)
        dq[n, q0:q0 + qn] = acc[:qn]
    return dq


@numba.njit(parallel=True, cache=True, fastmath=FASTMATH, nogil=True)
def backward_dq_from_ds(k, ds, ds_off, L, H, kv_count, kv_idx, bq, bk):  # pragma: no cover - compiled
    """``dQ = sum over visited tiles of (scale·dS) K`` from the tiles :func:`backward_dkdv` kept in ``ds``.

    ``ds`` is compact: the tiles of query block ``qb`` start at ``ds_off[b', h', qb]`` (an exclusive
    cumulative sum of ``kv_count``), so the buffer holds visited tiles only, never NQ x max(count)."""
    N, S, D = k.shape
    Bp, Hp, NQ = kv_count.shape
    dq = np.zeros((N, L, D), dtype=k.dtype)
    for it in numba.prange(N * NQ):
        n = it // NQ; qb = it % NQ
        bi = (n // H) % Bp; hi = (n % H) % Hp
        q0 = qb * bq
        qn = min(bq, L - q0)
        ks = k[n]
        acc = np.zeros((bq, D), dtype=k.dtype)
        for c in range(kv_count[bi, hi, qb]):
            k0 = kv_idx[bi, hi, qb, c] * bk
            _axpy(acc, qn, ds[n, ds_off[bi, hi, qb] + c], ks, k0, min(bk, S - k0))
        dq[n, q0:q0 + qn] = acc[:qn]
    return dq


@numba.njit(parallel=True, cache=True, fastmath=FASTMATH, nogil=True)
def backward_dkdv(q, k, v, do, lse, delta, H, q_count, q_idx, q_tile, q_slot, bank, bq, bk, cst, is32,
                  ds, ds_off):  # pragma: no cover - compiled
    N, L, D = q.shape
    S = k.shape[1]
    E = v.shape[2]
    Bp, Hp, NK = q_count.shape
    dk = np.zeros((N, S, D), dtype=q.dtype)
    dv = np.zeros((N, S, E), dtype=q.dtype)
    zero = cst[_SC] * 0
    sc = cst[_SC]
    for it in numba.prange(N * NK):
        n = it // NK; kb = it % NK
        bi = (n // H) % Bp; hi = (n % H) % Hp
        k0 = kb * bk
        kn = min(bk, S - k0)
        qs = q[n]; ks = k[n]; vs = v[n]; dos = do[n]
        QT = np.zeros((D, bq), dtype=q.dtype)
        OT = np.zeros((E, bq), dtype=q.dtype)
        ST = np.empty((bk, bq), dtype=q.dtype)     # scores / probabilities, key-major (keys x queries)
        dPT = np.empty((bk, bq), dtype=q.dtype)
        xrow = np.empty(bq, dtype=q.dtype)
        nbuf = np.empty(bq, dtype=np.int32)
        dka = np.zeros((bk, D), dtype=q.dtype)
        dva = np.zeros((bk, E), dtype=q.dtype)
        for c in range(q_count[bi, hi, kb]):
            qb = q_idx[bi, hi, kb, c]; t = q_tile[bi, hi, kb, c]
            q0 = qb * bq
            qn = min(bq, L - q0)
            _transpose(qs, q0, qn, QT)
            _transpose(dos, q0, qn, OT)
            _dots(ks, k0, kn, QT, ST, zero)
            if t >= 0:
                _apply_tile_mask(ST, kn, qn, bank, t, True)
            lr = lse[n, q0:q0 + qn]
            dl = delta[n, q0:q0 + qn]
            for j in range(kn):
                row = ST[j]
                for i in range(qn):
                    xrow[i] = row[i] * sc - lr[i]
                _exp_row(xrow, qn, row, nbuf, cst, is32)
            _axpy(dva, kn, ST, dos, q0, qn)
            _dots(vs, k0, kn, OT, dPT, zero)
            for j in range(kn):
                for i in range(qn):
                    dPT[j, i] = ST[j, i] * (dPT[j, i] - dl[i]) * sc
            _axpy(dka, kn, dPT, qs, q0, qn)
            if ds.shape[0]:  # keep scale·dS for dQ (query-major), at the tile's slot in kv_idx
                dst = ds[n, ds_off[bi, hi, qb] + q_slot[bi, hi, kb, c]]
                for j in range(kn):
                    for i in range(qn):
                        dst[i, j] = dPT[j, i]
        dk[n, k0:k0 + kn] = dka[:kn]
        dv[n, k0:k0 + kn] = dva[:kn]
    return dk, dv
