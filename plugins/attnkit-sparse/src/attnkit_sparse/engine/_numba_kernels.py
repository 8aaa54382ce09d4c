# ruff: noqa: E702  -- the register tiles read best one tile row per line (a0 = ...; a1 = ...)
"""numba kernels of the block-sparse engine: forward (online softmax, saves the log-sum-exp) and backward.

Arrays: ``q (N, L, D)``, ``k (N, S, D)``, ``v (N, S, E)`` with N = B·H (row
``n`` is batch ``n // H``, head ``n % H``); the plan's index arrays (see
:mod:`.plan`) with a leading ``(B', H')`` indexed by ``b % B'``, ``h % H'``.

Every kernel is a serial ``nogil`` function over a range of work items; :mod:`.numba_ops` runs ranges on
threads (:func:`attnkit.numba_pool.run_ranges`). A ``parallel=True`` build of the same loop took about three
times as long to compile (numba's parfor passes; 24-36 s against 9-14 s for :func:`forward`, session 35) and ran
no faster (docs/benchmarks.md, "CI time, session 40").

* :func:`forward`: work items are the N x NQ query blocks. The query block is
  transposed (in registers) and scaled once (``(D, BQ)``); per visited key block the scores
  are computed key-major, ``Sᵀ = K Qᵀ`` (:func:`_dots`, register panels), so the column maxima, the ``exp``
  and the column sums of the online softmax are vertical passes vectorised across the 64 queries,
  with no per-row loop; the PARTIAL tile's element mask is applied first.
  The output block accumulates ``acc += Pᵀ V`` (:func:`_axpy_t`: ``P`` read key-major as computed, the values'
  rows as they are), restricted on PARTIAL tiles to the keys some row may see (masked probabilities are exact
  zeros). With the axpy tiles of session 25 that form ran at half the speed of ``accᵀ += Vᵀ P`` with the key
  block's values transposed; on the register panels it is the faster one, and it needs no transposed values
  (session 61: ``sinkhorn``'s forward 1.11x, ``local`` 1.07x, outputs identical). The query block's buffers are
  allocated once per call, not per item. Stores ``out`` and ``lse = m + log(l)`` per row.
* :func:`backward_dkdv`: work items are the N x NK key blocks, via the transposed
  index: recomputes ``P = exp(scale·QKᵀ − lse)`` from the saved log-sum-exp
  (FlashAttention-2), ``dV += Pᵀ dO``, ``dS = P (dP − Δ)``, ``dK += scale · dSᵀ Q``.
  Each worker owns the rows it writes, so no two threads write the same rows.
  It keeps ``scale·dS`` per tile (``ds``, key-major as computed, at the tile's
  slot of the query-major index); :func:`backward_dq_from_ds` then gives ``dQ``
  with one product per tile (5 tile products in the backward, for memory
  ``tiles·BQ·BK``). Both take a range of query blocks, so a dS buffer too
  large for memory is filled and read in passes over query-block ranges.
* :func:`backward_sequence`: both for one sequence in one call, no dS buffer: each tile's ``dQ += dS K`` straight
  into the sequence's rows (:func:`_axpy_t`, ``dS`` read key-major; until session 61 through a transposed key
  block and a transposed ``dQ`` tile added back row by row: ``local``'s forward+backward 1.07x with the forward's
  change, ``sinkhorn``'s 1.06x).

``exp`` is evaluated a row of a tile at a time by the core's vector ``exp``
(:mod:`attnkit.numba_vexp`: a polynomial with an exact power-of-two scaling,
emitted as LLVM IR; numba has no vector ``exp`` without Intel's SVML), through
:func:`_exp_sub`. Its relative error is below 2.5e-7 in float32 and 1e-14 in
float64.

Two rules keep the inner loops vectorised (checked in the assembly): loops run
from 0 over views (``range(a, b)`` with a runtime ``a`` makes numba wrap
possibly negative indices, a select per element LLVM cannot vectorise), and
float32 stays float32 (``int32 · float32`` and ``float32 · 0`` are float64 in
numba's typing; constants come from the typed ``cst`` array).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from attnkit.numba_panel import axpy_at as _panel_axpy_at
from attnkit.numba_panel import axpy_t as _panel_axpy_t
from attnkit.numba_panel import empty_aligned, transpose, zeros_aligned
from attnkit.numba_panel import set_at as _panel_set_at
from attnkit.numba_vexp import LANES32, exp_sub_at, exp_sub_item

# reassociation lets LLVM vectorise the reductions; no NaN/inf assumptions (masked scores are -inf)
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


def constants(dtype: np.dtype, scale: float) -> np.ndarray:
    """The kernels' typed constants (a literal would be float64): ``[scale, -inf, 0.5, 1]`` (the exp's own live in
    :mod:`attnkit.numba_vexp`'s IR)."""
    return np.array([scale, -np.inf, 0.5, 1.0], dtype=dtype)


_SC, _NINF, _HALF, _ONE = range(4)


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _exp_sub(row, scl, sub):  # pragma: no cover - compiled
    """``row[j] = exp(scl·row[j] − sub[j])`` in place for ``j < len(row)``: whole vectors through the core's vector
    exp (:func:`attnkit.numba_vexp.exp_sub_at`, 16 float32 lanes on AVX-512 targets: 0.5 ns an element on rows of
    64 against 1.45 for the two-pass numba loops it replaced, one thread, session 57), the last ``len % W``
    elements and strided rows one at a time by the same arithmetic (:func:`attnkit.numba_vexp.exp_sub_item`). No
    call and no slice: with the remainder through those loops on a slice of the row, inlined into a tile loop, a
    128 x 64 float32 tile took 6.2-8.0 us instead of 1.9 (docs/benchmarks.md, "Session 60")."""
    n = row.shape[0]
    it = row.itemsize
    W = LANES32 if it == 4 else LANES32 // 2
    nv = n - n % W if row.strides[0] == it and sub.strides[0] == it else 0
    for j in range(0, nv, W):
        exp_sub_at(row, j, scl, sub)
    for j in range(nv, n):
        exp_sub_item(row, j, scl, sub)


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _dots(X, x0, xn, YT, OUT, zero):  # pragma: no cover - compiled
    """``OUT[i, :] = sum_d X[x0 + i, d] · YT[d, :]`` for ``i < xn``: the products of a tile of rows with
    another tile given transposed (``(D, block)``), as axpy rows (:func:`_axpy`), which keep the
    vector units busier than dot-product tiles with their horizontal sums (measured), written over ``OUT``
    (:func:`attnkit.numba_panel.set_at`: no zeroing pass first); columns past ``YT``'s are set to 0."""
    _panel_set_at(OUT, xn, X[x0:x0 + xn], 0, YT, 0, YT.shape[0])
    for i in range(xn):
        o = OUT[i]
        for j in range(YT.shape[1], o.shape[0]):
            o[j] = zero


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _axpy_at(OUT, on, C, c0, Y, y0, yn):  # pragma: no cover - compiled
    """``OUT[i] += sum_{j < yn} C[i, c0 + j] · Y[y0 + j]`` for ``i < on``: the core's register panels
    (:func:`attnkit.numba_panel.axpy_at`; ``OUT`` distinct from ``C`` and ``Y``). Until session 57 a numba loop of
    4 rows x 4 terms per pass over a row; the panels (512-bit on AVX-512 targets), with :func:`_exp_sub`, made
    ``local``'s (window 256) forward at 16K 1.57x and its forward+backward 1.67x faster on an Intel Emerald Rapids
    VM (docs/benchmarks.md, "Session 57")."""
    _panel_axpy_at(OUT, on, C, c0, Y, y0, yn)


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _axpy(OUT, on, C, Y, y0, yn):  # pragma: no cover - compiled
    """``OUT[i] += sum_{j < yn} C[i, j] · Y[y0 + j]`` for ``i < on`` (:func:`_axpy_at`)."""
    _axpy_at(OUT, on, C, 0, Y, y0, yn)


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _axpy_t(OUT, o0, n, CT, Y, y0, j0, j1):  # pragma: no cover - compiled
    """``OUT[o0 + r] += sum_{j0 <= j < j1} CT[j, o0 + r] · Y[y0 + j]`` for ``r < n``: the coefficients given
    transposed (``CT`` is key-major) and the terms restricted to ``[j0, j1)`` (on a PARTIAL tile, the keys some
    row of the group may see), on the core's register panels (:func:`attnkit.numba_panel.axpy_t`)."""
    _panel_axpy_t(OUT, o0, n, CT, Y, y0, j0, j1)


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _apply_tile_mask(ST, kn, qn, bankT, t, cst):  # pragma: no cover - compiled
    """``-inf`` where the bank entry ``t`` forbids a pair, in a key-major tile ``ST[:kn, :qn]`` (``bankT`` the bank
    key-major too, ``(P, BK, BQ)``), whatever the score holds (NaN included); allowed scores stay as they are.

    ``fmin(s, NaN)`` is ``s`` and ``fmin(s, -inf)`` is ``-inf``, so every score is stored unconditionally: the
    conditional form (``if not allowed: ST[j, i] = -inf``) compiles to masked stores, which took 1.39 ns per
    element on the development VM against 0.20 here (docs/benchmarks.md, "Session 42")."""
    drop = cst[_NINF]
    keep = drop - drop        # NaN in the array's dtype
    for j in range(kn):
        r = ST[j]
        b = bankT[t, j]
        for i in range(qn):
            r[i] = np.fmin(r[i], keep if b[i] else drop)


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def forward(q, k, v, H, kv_count, kv_idx, kv_tile, bank, span, bq, bk, cst, out, lse, i0,
            i1):  # pragma: no cover - compiled
    """The work items ``i0 <= it < i1`` (``it = n·NQ + qb``: sequence ``n``, query block ``qb``) of the forward:
    writes their rows of ``out`` ``(N, L, E)`` and ``lse`` ``(N, L)``. A serial ``nogil`` function; the caller
    runs ranges of items on threads (:func:`attnkit.numba_pool.run_ranges`). ``bank``: the plan's element masks
    key-major, ``(P, BK, BQ)`` (as the backward kernels read it too)."""
    N, L, D = q.shape
    S = k.shape[1]
    E = v.shape[2]
    Bp, Hp, NQ = kv_count.shape
    zero = cst[_HALF] - cst[_HALF]
    one = cst[_ONE]
    sc = cst[_SC]
    ninf = cst[_NINF]
    # a query block's buffers, allocated once for the items (each item resets what it reads)
    acc = empty_aligned(bq, E, q)           # the output block's running sums
    QT = empty_aligned(D, bq, q)            # the query block, scaled and transposed
    ST = empty_aligned(bk, bq, q)           # scores then probabilities, key-major
    m = np.empty(bq, dtype=q.dtype)
    mx = np.empty(bq, dtype=q.dtype)
    msub = empty_aligned(1, bq, q)[0]       # read as vectors (_exp_sub), as csum; written whole before each read
    alpha = np.empty(bq, dtype=q.dtype)
    lsum = np.empty(bq, dtype=q.dtype)
    csum = empty_aligned(1, bq, q)[0]
    for it in range(i0, i1):
        n = it // NQ; qb = it % NQ
        bi = (n // H) % Bp; hi_ = (n % H) % Hp
        q0 = qb * bq
        qn = min(bq, L - q0)
        qs = q[n]; ks = k[n]; vs = v[n]
        for i in range(bq):
            ai = acc[i]
            for e in range(E):
                ai[e] = zero
        transpose(QT, qs[q0:], qn, D)       # (registers; the columns past qn are zeroed below)
        for d in range(D):
            qd = QT[d]
            for i in range(qn):
                qd[i] *= sc
            for i in range(qn, bq):
                qd[i] = zero
        for i in range(bq):
            m[i] = ninf
            lsum[i] = zero
        for c in range(kv_count[bi, hi_, qb]):
            kb = kv_idx[bi, hi_, qb, c]; t = kv_tile[bi, hi_, qb, c]
            k0 = kb * bk
            kn = min(bk, S - k0)
            _dots(ks, k0, kn, QT, ST, zero)
            if t >= 0:
                _apply_tile_mask(ST, kn, qn, bank, t, cst)
            for i in range(bq):
                mx[i] = m[i]
            for j in range(kn):
                r = ST[j]
                for i in range(bq):
                    x = r[i]
                    mx[i] = np.fmax(mx[i], x)      # fmax, not a select: see attnkit.numba_panel (masked stores)
            for i in range(bq):       # exp(m_old - m_new); an all-masked column keeps 0 as its shift
                s_ = mx[i] if mx[i] > ninf else zero
                alpha[i] = m[i] - s_
                msub[i] = s_
                m[i] = mx[i]
                csum[i] = zero
            _exp_sub(alpha, one, csum)
            for j in range(kn):
                pj = ST[j]
                _exp_sub(pj, one, msub)
                for i in range(bq):
                    csum[i] += pj[i]
            for i in range(bq):
                lsum[i] = lsum[i] * alpha[i] + csum[i]
            for i in range(bq):               # rescale every query's sum by its alpha
                ai = acc[i]
                a_ = alpha[i]
                for e in range(E):
                    ai[e] *= a_
            if t >= 0:                        # the keys some row of the tile may see (masked P is exactly 0)
                c0 = bk; c1 = 0
                for r in range(qn):
                    l0 = span[t, r, 0]; l1 = min(span[t, r, 1], kn)
                    if l1 > l0:
                        c0 = min(c0, l0); c1 = max(c1, l1)
            else:
                c0 = 0; c1 = kn
            if c1 > c0:                       # acc += Pᵀ V over those keys, P read key-major (no transposed V)
                _axpy_t(acc, 0, qn, ST, vs, k0, c0, c1)
        for i in range(qn):
            o = out[n, q0 + i]
            if lsum[i] > 0 or lsum[i] != lsum[i]:
                r = one / lsum[i]
                ai = acc[i]
                for e in range(E):
                    o[e] = ai[e] * r
                lse[n, q0 + i] = m[i] + math.log(lsum[i])
            else:
                for e in range(E):
                    o[e] = zero
                lse[n, q0 + i] = -ninf


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def backward_dq_from_ds(k, ds, ds_off, dq, qlo, qhi, H, kv_count, kv_idx, bq, bk, i0,
                        i1):  # pragma: no cover - compiled
    """``dQ = sum over visited tiles of (scale·dS) K`` for the query blocks ``qlo <= qb < qhi``, from the tiles
    :func:`backward_dkdv` kept in ``ds`` for the same blocks (key-major ``(BK, BQ)`` tiles, as that kernel
    computes them: no transposed copy); writes the blocks' rows of ``dq`` ``(N, L, D)``.

    ``ds`` is compact: the tiles of query block ``qb`` start at ``ds_off[b', h', qb] - ds_off[b', h', qlo]``
    (``ds_off`` is an exclusive cumulative sum of ``kv_count``), so the buffer holds visited tiles only, never
    NQ x max(count). Runs the work items ``i0 <= it < i1`` (``it = n·(qhi - qlo) + qb - qlo``)."""
    N, S, D = k.shape
    L = dq.shape[1]
    Bp, Hp, NQ = kv_count.shape
    nr = qhi - qlo
    for it in range(i0, i1):
        n = it // nr; qb = qlo + it % nr
        bi = (n // H) % Bp; hi = (n % H) % Hp
        q0 = qb * bq
        qn = min(bq, L - q0)
        ks = k[n]
        acc = zeros_aligned(bq, D, k)
        base = ds_off[bi, hi, qb] - ds_off[bi, hi, qlo]
        for c in range(kv_count[bi, hi, qb]):
            k0 = kv_idx[bi, hi, qb, c] * bk
            dst = ds[n, base + c]          # key-major (BK, BQ)
            kn = min(bk, S - k0)
            _axpy_t(acc, 0, qn, dst, ks, k0, 0, kn)
        dq[n, q0:q0 + qn] = acc[:qn]


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def backward_dkdv(q, k, v, do, lse, delta, H, q_count, q_idx, q_tile, q_slot, bank, bq, bk, cst,
                  ds, ds_off, qT, doT, dk, dv, qlo, qhi, i0, i1):  # pragma: no cover - compiled
    """``dK``, ``dV`` from the query blocks ``qlo <= qb < qhi``, added to ``dk`` ``(N, S, D)`` and ``dv``
    ``(N, S, E)``, and ``scale·dS`` per tile of those blocks into ``ds`` (compact from block ``qlo``, as
    :func:`backward_dq_from_ds` reads it). ``qT``, ``doT``: ``q`` and ``do`` transposed, ``(N, D, L)`` and
    ``(N, E, L)``, so a tile's transposed block is a copy of contiguous row pieces instead of a scalar transpose
    per tile. Runs the work items ``i0 <= it < i1`` (``it = n·NK + kb``: sequence ``n``, key block ``kb``)."""
    N, L, D = q.shape
    S = k.shape[1]
    E = v.shape[2]
    Bp, Hp, NK = q_count.shape
    zero = cst[_HALF] - cst[_HALF]   # float32 for float32 (cst[_SC] * 0 would be float64)
    sc = cst[_SC]
    for it in range(i0, i1):
        n = it // NK; kb = it % NK
        bi = (n // H) % Bp; hi = (n % H) % Hp
        k0 = kb * bk
        kn = min(bk, S - k0)
        qs = q[n]; ks = k[n]; vs = v[n]; dos = do[n]
        QT = zeros_aligned(D, bq, q)
        OT = zeros_aligned(E, bq, q)
        ST = empty_aligned(bk, bq, q)     # scores / probabilities, key-major (keys x queries)
        dPT = empty_aligned(bk, bq, q)
        dka = zeros_aligned(bk, D, q)
        dva = zeros_aligned(bk, E, q)
        for c in range(q_count[bi, hi, kb]):
            qb = q_idx[bi, hi, kb, c]; t = q_tile[bi, hi, kb, c]
            if qb < qlo or qb >= qhi:
                continue
            q0 = qb * bq
            qn = min(bq, L - q0)
            for d in range(D):
                src = qT[n, d, q0:q0 + qn]
                dst = QT[d]
                for i in range(qn):
                    dst[i] = src[i]
            for e in range(E):
                src = doT[n, e, q0:q0 + qn]
                dst = OT[e]
                for i in range(qn):
                    dst[i] = src[i]
            _dots(ks, k0, kn, QT, ST, zero)
            if t >= 0:
                _apply_tile_mask(ST, kn, qn, bank, t, cst)
            lr = lse[n, q0:q0 + qn]
            dl = delta[n, q0:q0 + qn]
            for j in range(kn):
                row = ST[j, :qn]
                _exp_sub(row, sc, lr)
            _axpy(dva, kn, ST, dos, q0, qn)
            _dots(vs, k0, kn, OT, dPT, zero)
            for j in range(kn):
                for i in range(qn):
                    dPT[j, i] = ST[j, i] * (dPT[j, i] - dl[i]) * sc
            _axpy(dka, kn, dPT, qs, q0, qn)
            # keep scale·dS for dQ, key-major as computed, at the tile's slot in kv_idx
            dst = ds[n, ds_off[bi, hi, qb] - ds_off[bi, hi, qlo] + q_slot[bi, hi, kb, c]]
            for j in range(kn):
                dj = dst[j, :qn]
                sj = dPT[j, :qn]
                for i in range(qn):
                    dj[i] = sj[i]
        dk[n, k0:k0 + kn] += dka[:kn]
        dv[n, k0:k0 + kn] += dva[:kn]



@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def delta_rows(g, out, g_lse, delta):  # pragma: no cover - compiled
    """``delta[p] = g[p]·out[p] − g_lse[p]`` for one sequence's rows ``g``, ``out`` ``(L, E)`` and ``g_lse``,
    ``delta`` ``(L,)``: the softmax backward's row term ``Δ`` (the log-sum-exp's own gradient enters it), without
    the ``(L, E)`` product torch's ``(g * out).sum(-1)`` writes first."""
    L, E = g.shape
    zero = np.zeros(1, dtype=delta.dtype)[0]
    for p in range(L):
        gp = g[p]
        op = out[p]
        acc = zero
        for e in range(E):
            acc += gp[e] * op[e]
        delta[p] = acc - g_lse[p]


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def backward_sequence(qs, ks, vs, dos, qTs, doTs, lr_all, dl_all, qc, qi, qt, bank, bq, bk, cst, dqs, dks,
                       dvs):  # pragma: no cover - compiled
    """``dQ``, ``dK``, ``dV`` of one sequence in one pass (the caller runs one call per sequence, on threads, when
    the ``N = B·H`` sequences spread evenly over them). Besides :func:`backward_dkdv`'s key-major ``dK``, ``dV``
    it adds ``scale·dS K`` into the sequence's ``dQ`` rows while the ``dS`` tile is in cache (no ``ds`` buffer
    written and read back, no second kernel). Key blocks ascending: the sums run in a fixed order
    (deterministic). Writes every row of ``dqs``, ``dks``, ``dvs``."""
    L, D = qs.shape
    S = ks.shape[0]
    E = vs.shape[1]
    NK = qc.shape[0]
    zero = cst[_HALF] - cst[_HALF]   # float32 for float32 (cst[_SC] * 0 would be float64)
    sc = cst[_SC]
    QT = zeros_aligned(D, bq, qs)
    OT = zeros_aligned(E, bq, qs)
    ST = empty_aligned(bk, bq, qs)     # scores / probabilities, key-major (keys x queries)
    dPT = empty_aligned(bk, bq, qs)
    for i in range(L):
        r = dqs[i]
        for d in range(D):
            r[d] = zero
    for kb in range(NK):
        k0 = kb * bk
        kn = min(bk, S - k0)
        dka = dks[k0:k0 + kn]
        dva = dvs[k0:k0 + kn]
        for j in range(kn):
            a = dka[j]
            for d in range(D):
                a[d] = zero
            b = dva[j]
            for e in range(E):
                b[e] = zero
        for c in range(qc[kb]):
            qb = qi[kb, c]; t = qt[kb, c]
            q0 = qb * bq
            qn = min(bq, L - q0)
            for d in range(D):
                src = qTs[d, q0:q0 + qn]
                dst = QT[d]
                for i in range(qn):
                    dst[i] = src[i]
            for e in range(E):
                src = doTs[e, q0:q0 + qn]
                dst = OT[e]
                for i in range(qn):
                    dst[i] = src[i]
            _dots(ks, k0, kn, QT, ST, zero)
            if t >= 0:
                _apply_tile_mask(ST, kn, qn, bank, t, cst)
            lr = lr_all[q0:q0 + qn]
            dl = dl_all[q0:q0 + qn]
            for j in range(kn):
                row = ST[j, :qn]
                _exp_sub(row, sc, lr)
            _axpy(dva, kn, ST, dos, q0, qn)
            _dots(vs, k0, kn, OT, dPT, zero)
            for j in range(kn):
                for i in range(qn):
                    dPT[j, i] = ST[j, i] * (dPT[j, i] - dl[i]) * sc
            _axpy(dka, kn, dPT, qs, q0, qn)
            _axpy_t(dqs[q0:], 0, qn, dPT, ks, k0, 0, kn)   # dQ += dS K, dS read key-major: no transposed K
