# ruff: noqa: E702  -- the register tiles read best one tile row per line (a0 = ...; a1 = ...)
"""numba kernels of the soft-span band: forward (online softmax, saves the log-sum-exp) and backward.

Arrays: ``q (N, L, D)``, ``k (N, L, D)``,
``v (N, L, E)`` with N = B·H (row ``n`` is batch ``n // H``); ``z (N, L)`` the
span of every query (a per-head span repeated along L); ``lo (N, L)`` int32,
the first key each query may reach (``i - ceil(R + z_i) + 1`` clamped to 0,
``i + 1`` when none; the element test below decides); ``far (N,)`` int32, the
largest ``i - lo_i`` of each row; ``kp (B', L)``
uint8 key padding (1 = real key; B' = 1 with all ones when there is none);
``xs (L,)`` the positions ``0, 1, ...`` in the dtype (exact distances
``xs[i] - xs[j]`` without int-to-float promotion).

The element test, the same arithmetic as the plain reference
(:mod:`.naive`): ``num = (R + z_i) - (i - j)``; the pair counts when
``i - j >= 0``, ``num > 0`` and ``kp[j]``; its weight is
``m = min(num / R, 1)`` and the span gradient flows where ``num <= R`` (the
clamp passes its gradient at its bounds, as torch's does).

Every kernel is a serial ``nogil`` function over a range of work items; :mod:`.numba_band` runs ranges on
threads (:func:`attnkit.numba_pool.run_ranges`): a ``parallel=True`` build of the same loops took about three
times as long to compile (numba's parfor passes).

* :func:`forward`: work items are the N x query blocks of ``bq`` rows (with ``save``, each row's scaled scores over
  its reach are kept for :func:`backward_fused`). The
  block's keys ``[min lo, q0 + bq)`` are visited in tiles of ``bk``; inside a
  tile each group of 4 query rows computes only the columns some row of the
  group reaches, scores ``Q Kᵀ`` and ``acc += P V`` as register-tiled axpy
  rows (:func:`_mm4`: 4 rows x 4 terms per pass, vectorised over the
  contiguous output row). Online softmax with the soft mask as a weight:
  ``acc += m·exp(s - M)·v``, ``l += m·exp(s - M)``. Stores ``out`` and
  ``lse = M + log l`` (+inf for a row with no key: its output is 0).
* :func:`backward_fused` (the backward the wrapper runs): query-major, FlashAttention-2's order. Each query
  block forms ``P``, ``dP = dO Vᵀ``, ``t`` and ``dS`` once (its scores read from what the forward kept, or
  recomputed), writes ``dQ`` and ``dz`` of its rows and accumulates ``dK``, ``dV`` for the keys of its window
  (:func:`_mm4t`, the product with ``A`` read transposed); a work item is a chunk of query blocks of one row,
  in order, owning its keys; keys before the chunk go to spill rows (:func:`add_spill`). 4 tile products
  per block with kept scores, 5 without.
  (The key-major route it replaced, ``dK`` / ``dV`` per key block and then ``dQ`` / ``dz`` from a kept ``t`` or
  from recomputed scores, was deleted in session 38: three more builds per dtype, run only by the test that
  compared the routes.)

``exp`` is evaluated a row segment at a time by :func:`_exp_seg` (a Taylor
polynomial after a Cody-Waite reduction, the power of two added through the
exponent bits), so the loop vectorises: numba has no vector ``exp`` without
Intel's SVML. Relative error ~1e-7 in float32, ~1e-15 in float64.

Cold compile: the small helpers are inlined (``inline="always"``), and so are :func:`forward`'s two
products (:func:`_mm4_inline`: called, its forward ran ~5 % slower); every other register-tiled product is
called (:func:`_mm4_64` / :func:`_mm4_any`, :func:`_mm4t_64` / :func:`_mm4t_any`), compiled once per
argument types and shared by every call site and kernel. Inlined at :func:`backward_fused`'s 7 product sites
(two copies of the body each, one per width) they made it most of the plugin's cold compile: the test suite's
kernels took 690 s to compile from cold on the shared 2-core VM, ~200 s called; the kernels' CPU time is
unchanged within noise (1 thread, float32, span 64, L = 2K / 4K; docs/mechanisms/adaptive-span.md).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from attnkit.numba_panel import transpose

# reassociation lets LLVM vectorise the reductions. No "arcp": m = num / R is a true division, as the
# reference's, so the weights and the span-gradient test agree to the last bit; masked scores are -inf
FASTMATH = {"reassoc", "contract", "nsz"}

_RAMP, _SC, _NINF, _LOG2E, _LN2_HI, _LN2_LO, _LO, _HALF, _POLY = range(9)


def constants(dtype: np.dtype, ramp: float, scale: float) -> np.ndarray:
    """The kernels' typed constants (a Python literal would be float64 in numba):
    ``[R, scale, -inf, log2(e), ln2 hi, ln2 lo, lowest exp argument, 0.5, exp's Taylor coefficients
    (highest degree first)]``."""
    f32 = np.dtype(dtype) == np.float32
    ln2 = (0.693359375, -2.12194440e-4) if f32 else (0.693145751953125, 1.42860682030941723212e-6)
    deg = 7 if f32 else 13
    head = [ramp, scale, -np.inf, 1.4426950408889634, ln2[0], ln2[1], -87.0 if f32 else -708.0, 0.5]
    return np.array(head + [1.0 / math.factorial(i) for i in range(deg, -1, -1)], dtype=dtype)


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _exp_seg(row, red, ebuf, cst, is32):  # pragma: no cover - compiled
    """``row[:] = exp(row[:])`` for arguments ``<= ~0``: 0 below the underflow bound and for ``-inf``, NaN for
    NaN. ``red`` (the dtype) and ``ebuf`` (int32) are scratch at least as long as ``row``.

    Every loop here and below runs over a slice from index 0: numba then knows the index is not negative
    (no wraparound select on the address) and LLVM vectorises it; ``range(c0, c1)`` over a whole row does not.
    """
    n = row.shape[0]
    lo = cst[_LO]; log2e = cst[_LOG2E]; h1 = cst[_LN2_HI]; h2 = cst[_LN2_LO]; half = cst[_HALF]
    for c in range(n):
        x = row[c]
        under = x <= lo
        nan = x != x
        xc = lo if (under or nan) else x
        nf = np.trunc(half - xc * log2e)          # n = round(-x·log2 e) (x <= ~0: truncation of +0.5), in the dtype
        ebuf[c] = 4000 if nan else (-4000 if under else -np.int32(nf))
        red[c] = (xc + nf * h1) + nf * h2         # x + n·ln2 in two parts, |red| <= ln2 / 2
        row[c] = cst[_POLY]
    # float32: Horner per element with the 8 coefficients in registers, one pass over the row instead of one per
    # degree (bitwise the same result; 2-15 % faster forward in a noisy A/B); float64 keeps the passes
    if is32:
        a0 = cst[_POLY]; a1 = cst[_POLY + 1]; a2 = cst[_POLY + 2]; a3 = cst[_POLY + 3]
        a4 = cst[_POLY + 4]; a5 = cst[_POLY + 5]; a6 = cst[_POLY + 6]; a7 = cst[_POLY + 7]
        for c in range(n):
            r = red[c]
            row[c] = ((((((a0 * r + a1) * r + a2) * r + a3) * r + a4) * r + a5) * r + a6) * r + a7
    else:
        for p in range(_POLY + 1, cst.shape[0]):
            cp = cst[p]
            for c in range(n):
                row[c] = row[c] * red[c] + cp
    if is32:
        bits = row.view(np.int32)
        for c in range(n):
            e = ebuf[c]
            bits[c] = (bits[c] + (e << 23)) if -4000 < e < 4000 else (0 if e <= -4000 else 0x7FC00000)
    else:
        bits = row.view(np.int64)
        for c in range(n):
            e = np.int64(ebuf[c])
            bits[c] = (bits[c] + (e << 52)) if -4000 < e < 4000 else (0 if e <= -4000 else 0x7FF8000000000000)


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _mm4_body(OUT, o0, n, A, a0, B, b0, t0, t1, e0, ne):  # pragma: no cover - compiled
    """``OUT[o0 + r, e] += sum_{t0 <= t < t1} A[a0 + r, t] · B[b0 + t, e]`` for ``r < n <= 4``, ``e0 <= e < e1``.

    4 rows x 4 terms per pass over the output row: each load of a ``B`` row feeds four output rows, each
    output row is loaded and stored once per four terms, and the innermost loop (over ``e``, contiguous,
    on slices from 0: see :func:`_exp_seg`) vectorises with no horizontal sum (~75 GFLOP/s float32 on a
    64-wide row, one Zen 5 core, against ~16 with ``range(e0, e1)`` over whole rows). ``ne = e1 - e0``."""
    e1 = e0 + ne
    if n == 4:
        oa = OUT[o0, e0:e1]; ob = OUT[o0 + 1, e0:e1]; oc = OUT[o0 + 2, e0:e1]; od = OUT[o0 + 3, e0:e1]
        ca = A[a0]; cb = A[a0 + 1]; cc = A[a0 + 2]; cd = A[a0 + 3]
        t4 = t1 - (t1 - t0) % 4
        for t in range(t0, t4, 4):
            y0 = B[b0 + t, e0:e1]; y1 = B[b0 + t + 1, e0:e1]; y2 = B[b0 + t + 2, e0:e1]; y3 = B[b0 + t + 3, e0:e1]
            p0 = ca[t]; p1 = ca[t + 1]; p2 = ca[t + 2]; p3 = ca[t + 3]
            r0 = cb[t]; r1 = cb[t + 1]; r2 = cb[t + 2]; r3 = cb[t + 3]
            s0 = cc[t]; s1 = cc[t + 1]; s2 = cc[t + 2]; s3 = cc[t + 3]
            u0 = cd[t]; u1 = cd[t + 1]; u2 = cd[t + 2]; u3 = cd[t + 3]
            for e in range(ne):
                w0 = y0[e]; w1 = y1[e]; w2 = y2[e]; w3 = y3[e]
                oa[e] += p0 * w0 + p1 * w1 + p2 * w2 + p3 * w3
                ob[e] += r0 * w0 + r1 * w1 + r2 * w2 + r3 * w3
                oc[e] += s0 * w0 + s1 * w1 + s2 * w2 + s3 * w3
                od[e] += u0 * w0 + u1 * w1 + u2 * w2 + u3 * w3
        for t in range(t4, t1):
            y = B[b0 + t, e0:e1]
            p0 = ca[t]; r0 = cb[t]; s0 = cc[t]; u0 = cd[t]
            for e in range(ne):
                w = y[e]
                oa[e] += p0 * w; ob[e] += r0 * w; oc[e] += s0 * w; od[e] += u0 * w
    else:
        for r in range(n):
            oa = OUT[o0 + r, e0:e1]; ca = A[a0 + r]
            for t in range(t0, t1):
                y = B[b0 + t, e0:e1]
                p0 = ca[t]
                for e in range(ne):
                    oa[e] += p0 * y[e]


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def _mm4_64(OUT, o0, n, A, a0, B, b0, t0, t1, e0):  # pragma: no cover - compiled
    """:func:`_mm4_body` on 64 output columns, the width a compile-time constant."""
    _mm4_body(OUT, o0, n, A, a0, B, b0, t0, t1, e0, 64)


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def _mm4_any(OUT, o0, n, A, a0, B, b0, t0, t1, e0, ne):  # pragma: no cover - compiled
    """:func:`_mm4_body` on ``ne`` output columns."""
    _mm4_body(OUT, o0, n, A, a0, B, b0, t0, t1, e0, ne)


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _mm4(OUT, o0, n, A, a0, B, b0, t0, t1, e0, e1):  # pragma: no cover - compiled
    """``OUT[o0 + r, e] += sum_t A[a0 + r, t] · B[b0 + t, e]``: :func:`_mm4_body`. Output rows of 64 (the usual
    head size) take a copy of the body with the width a compile-time constant: LLVM then unrolls the row into
    whole vectors with no remainder or runtime checks (1.4-1.6x on 64-wide products in a micro-benchmark, one
    core: 41-45 -> 59-74 GFLOP/s; splitting wider rows into constant 32- or 48-wide pieces did not pay).
    The two copies are called, not inlined: each is compiled once per argument types and shared by every call
    site and kernel (inlined at every site they made most of the kernels' cold compile time; see the module
    docstring)."""
    if e1 - e0 == 64:
        _mm4_64(OUT, o0, n, A, a0, B, b0, t0, t1, e0)
    else:
        _mm4_any(OUT, o0, n, A, a0, B, b0, t0, t1, e0, e1 - e0)


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _mm4_inline(OUT, o0, n, A, a0, B, b0, t0, t1, e0, e1):  # pragma: no cover - compiled
    """:func:`_mm4` with both copies of the body inlined: for :func:`forward` only (its two products per
    group run ~5 % faster inlined than called; two sites, so little compile time)."""
    if e1 - e0 == 64:
        _mm4_body(OUT, o0, n, A, a0, B, b0, t0, t1, e0, 64)
    else:
        _mm4_body(OUT, o0, n, A, a0, B, b0, t0, t1, e0, e1 - e0)


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _zero(OUT, o0, n, c0, c1, zero):  # pragma: no cover - compiled
    for r in range(o0, o0 + n):
        o = OUT[r, c0:c1]
        for c in range(c1 - c0):
            o[c] = zero


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _query_row_weights(srow, mrow, xi, xk, rz, kpk, cst):  # pragma: no cover - compiled
    """Query row at position ``xi`` (``rz = R + z_i``) against the keys at positions ``xk`` (a slice of ``xs``,
    ``kpk`` their padding flags), all slices of one length: the soft-mask weight into ``mrow`` (0 where the
    pair does not count); the scores ``srow`` (``q·k``) are scaled in place, ``-inf`` where the pair does not count."""
    R = cst[_RAMP]; sc = cst[_SC]; ninf = cst[_NINF]; zero = R * 0; one = R / R
    for c in range(srow.shape[0]):
        x = xi - xk[c]
        num = rz - x
        ok = (x >= zero) and (num > zero) and kpk[c] != 0
        mrow[c] = min(num / R, one) if ok else zero
        srow[c] = srow[c] * sc if ok else ninf


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _round8(c0, c1, width):  # pragma: no cover - compiled
    """``[c0, c1)`` widened to multiples of 8 within ``[0, width)``: the score products then run whole 8-wide
    vectors with no scalar remainder (5-17 % faster per product at 35-47 columns in spite of the extra
    columns; the extra scores are computed into the tile buffer and never used)."""
    return c0 - c0 % 8, min(c1 + (8 - c1 % 8) % 8, width)


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _group_cols(los, q0, g, gn, t0, kn):  # pragma: no cover - compiled
    """The columns ``[c0, c1)`` of the key tile at ``t0`` (``kn`` keys) that query rows ``q0 + g .. + gn`` reach."""
    glo = los[q0 + g]
    for r in range(g + 1, g + gn):
        glo = min(glo, los[q0 + r])
    return max(glo - t0, 0), min(q0 + g + gn - t0, kn)


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def forward(q, k, v, z, lo, kp, xs, H, bq, bk, cst, is32, far, save, sbuf, out, lse, i0,
            i1):  # pragma: no cover - compiled
    """The work items ``i0 <= it < i1`` (``it = n·NQ + qb``: row ``n``, query block ``qb``): their rows of ``out``
    ``(N, L, E)`` and ``lse`` ``(N, L)``. With ``save``, also keeps every row's scaled scores (``-inf`` where the
    pair does not count) over its own reach, ``sbuf[n, i, j - i + far[n]] = s_ij`` for ``lo_i <= j <= i``
    (``sbuf (N, L, max far + 1)``), for :func:`backward_fused` (which then skips its ``Q Kᵀ`` product)."""
    N, L, D = q.shape
    E = v.shape[2]
    NQ = (L + bq - 1) // bq
    R = cst[_RAMP]; ninf = cst[_NINF]; zero = R * 0
    for it in range(i0, i1):
        n = it // NQ; qb = it % NQ
        kpb = kp[(n // H) % kp.shape[0]]
        q0 = qb * bq
        qn = min(bq, L - q0)
        qs = q[n]; ks = k[n]; vs = v[n]; zs = z[n]; los = lo[n]
        fn = far[n]
        klo = q0
        for r in range(qn):
            klo = min(klo, los[q0 + r])
        acc = np.zeros((bq, E), dtype=q.dtype)
        KT = np.zeros((D, bk), dtype=q.dtype)
        Sc = np.empty((bq, bk), dtype=q.dtype)
        Mw = np.empty((bq, bk), dtype=q.dtype)
        red = np.empty(bk, dtype=q.dtype)
        ebuf = np.empty(bk, dtype=np.int32)
        mx = np.full(bq, ninf, dtype=q.dtype)
        lsum = np.zeros(bq, dtype=q.dtype)
        gc0 = np.zeros(bq // 4 + 1, dtype=np.int64)
        gc1 = np.zeros(bq // 4 + 1, dtype=np.int64)
        for t0 in range(klo, q0 + qn, bk):
            kn = min(bk, q0 + qn - t0)
            transpose(KT, ks[t0:t0 + kn], kn, ks.shape[1])
            xk_t = xs[t0:t0 + kn]; kp_t = kpb[t0:t0 + kn]
            for g in range(0, qn, 4):
                gn = min(4, qn - g)
                c0, c1 = _group_cols(los, q0, g, gn, t0, kn)
                gc0[g // 4] = c0; gc1[g // 4] = c1
                if c1 <= c0:
                    continue
                nc = c1 - c0
                r0, r1 = _round8(c0, c1, bk)
                _zero(Sc, g, gn, r0, r1, zero)
                _mm4_inline(Sc, g, gn, qs, q0 + g, KT, 0, 0, D, r0, r1)
                for r in range(g, g + gn):
                    i = q0 + r
                    srow = Sc[r, c0:c1]; mrow = Mw[r, c0:c1]
                    _query_row_weights(srow, mrow, xs[i], xk_t[c0:c1], R + zs[i], kp_t[c0:c1], cst)
                    if save:
                        ja = max(los[i], t0 + c0); jb = min(i + 1, t0 + c1)
                        if jb > ja:
                            dst = sbuf[n, i, ja - i + fn:jb - i + fn]; src = srow[ja - t0 - c0:jb - t0 - c0]
                            for c in range(jb - ja):
                                dst[c] = src[c]
                    m_t = ninf
                    for c in range(nc):
                        sc_ = srow[c]
                        m_t = max(m_t, sc_ if sc_ == sc_ else ninf)   # NaN scores reach lsum through exp
                    mnew = max(mx[r], m_t)
                    if mnew == ninf:   # nothing finite counted in this row so far
                        for c in range(nc):
                            if srow[c] != srow[c]:
                                lsum[r] = srow[c]   # NaN in, NaN out
                            srow[c] = zero
                        continue
                    for c in range(nc):
                        srow[c] = srow[c] - mnew
                    _exp_seg(srow, red, ebuf, cst, is32)
                    s = zero
                    for c in range(nc):
                        w = srow[c] * mrow[c]
                        srow[c] = w
                        s += w
                    if mnew != mx[r]:
                        alpha = math.exp(mx[r] - mnew)
                        ar = acc[r]
                        for e in range(E):
                            ar[e] *= alpha
                        lsum[r] = lsum[r] * alpha
                        mx[r] = mnew
                    lsum[r] += s
            for g in range(0, qn, 4):
                c0 = gc0[g // 4]; c1 = gc1[g // 4]
                if c1 > c0:
                    _mm4_inline(acc, g, min(4, qn - g), Sc[:, c0:c1], g, vs[t0 + c0:t0 + c1], 0, 0, c1 - c0, 0, E)
        for r in range(qn):
            o = out[n, q0 + r]
            if lsum[r] > zero or lsum[r] != lsum[r]:
                inv = 1 / lsum[r]
                for e in range(E):
                    o[e] = acc[r, e] * inv
                lse[n, q0 + r] = mx[r] + math.log(lsum[r])
            else:
                for e in range(E):
                    o[e] = zero
                lse[n, q0 + r] = -ninf  # exp(s - inf) = 0: a row with no key has no gradient


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _mm4t_body(OUT, o0, n, A, a0, B, b0, t0, t1, e0, ne):  # pragma: no cover - compiled
    """``OUT[o0 + r, e] += sum_{t0 <= t < t1} A[t, a0 + r] · B[b0 + t, e]`` for ``r < n <= 4``, ``e0 <= e < e1``:
    :func:`_mm4` with ``A`` read transposed (its 4 x 4 coefficients per pass are 4 rows of 4 adjacent columns),
    so a product ``Aᵀ B`` needs no transposed copy of ``A``. ``ne = e1 - e0``."""
    e1 = e0 + ne
    if n == 4:
        oa = OUT[o0, e0:e1]; ob = OUT[o0 + 1, e0:e1]; oc = OUT[o0 + 2, e0:e1]; od = OUT[o0 + 3, e0:e1]
        t4 = t1 - (t1 - t0) % 4
        for t in range(t0, t4, 4):
            y0 = B[b0 + t, e0:e1]; y1 = B[b0 + t + 1, e0:e1]; y2 = B[b0 + t + 2, e0:e1]; y3 = B[b0 + t + 3, e0:e1]
            x0 = A[t, a0:a0 + 4]; x1 = A[t + 1, a0:a0 + 4]; x2 = A[t + 2, a0:a0 + 4]; x3 = A[t + 3, a0:a0 + 4]
            p0 = x0[0]; p1 = x1[0]; p2 = x2[0]; p3 = x3[0]
            r0 = x0[1]; r1 = x1[1]; r2 = x2[1]; r3 = x3[1]
            s0 = x0[2]; s1 = x1[2]; s2 = x2[2]; s3 = x3[2]
            u0 = x0[3]; u1 = x1[3]; u2 = x2[3]; u3 = x3[3]
            for e in range(ne):
                w0 = y0[e]; w1 = y1[e]; w2 = y2[e]; w3 = y3[e]
                oa[e] += p0 * w0 + p1 * w1 + p2 * w2 + p3 * w3
                ob[e] += r0 * w0 + r1 * w1 + r2 * w2 + r3 * w3
                oc[e] += s0 * w0 + s1 * w1 + s2 * w2 + s3 * w3
                od[e] += u0 * w0 + u1 * w1 + u2 * w2 + u3 * w3
        for t in range(t4, t1):
            y = B[b0 + t, e0:e1]
            x0 = A[t, a0:a0 + 4]
            p0 = x0[0]; r0 = x0[1]; s0 = x0[2]; u0 = x0[3]
            for e in range(ne):
                w = y[e]
                oa[e] += p0 * w; ob[e] += r0 * w; oc[e] += s0 * w; od[e] += u0 * w
    else:
        for r in range(n):
            oa = OUT[o0 + r, e0:e1]
            for t in range(t0, t1):
                y = B[b0 + t, e0:e1]
                p0 = A[t, a0 + r]
                for e in range(ne):
                    oa[e] += p0 * y[e]


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def _mm4t_64(OUT, o0, n, A, a0, B, b0, t0, t1, e0):  # pragma: no cover - compiled
    """:func:`_mm4t_body` on 64 output columns, the width a compile-time constant."""
    _mm4t_body(OUT, o0, n, A, a0, B, b0, t0, t1, e0, 64)


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def _mm4t_any(OUT, o0, n, A, a0, B, b0, t0, t1, e0, ne):  # pragma: no cover - compiled
    """:func:`_mm4t_body` on ``ne`` output columns."""
    _mm4t_body(OUT, o0, n, A, a0, B, b0, t0, t1, e0, ne)


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _mm4t(OUT, o0, n, A, a0, B, b0, t0, t1, e0, e1):  # pragma: no cover - compiled
    """``OUT[o0 + r, e] += sum_t A[t, a0 + r] · B[b0 + t, e]``: :func:`_mm4t_body`. Output rows of 64 (the usual
    head size) take a copy of the body with the width a compile-time constant: LLVM then unrolls the row into
    whole vectors with no remainder or runtime checks (1.4-1.6x on 64-wide products in a micro-benchmark, one
    core: 41-45 -> 59-74 GFLOP/s; splitting wider rows into constant 32- or 48-wide pieces did not pay).
    The two copies are called, not inlined: each is compiled once per argument types and shared by every call
    site and kernel (inlined at every site they made most of the kernels' cold compile time; see the module
    docstring)."""
    if e1 - e0 == 64:
        _mm4t_64(OUT, o0, n, A, a0, B, b0, t0, t1, e0)
    else:
        _mm4t_any(OUT, o0, n, A, a0, B, b0, t0, t1, e0, e1 - e0)


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _dkdv_keys(dk, dv, k_off, j_lo, j_hi, wo, q0, qn, fn, P, dS, qs, dos, D, E):  # pragma: no cover - compiled
    """``dV[j] += Σ_i P[i, j] dO[i]``, ``dK[j] += Σ_i dS[i, j] Q[i]`` for the keys ``j_lo <= j < j_hi`` in groups of
    4 (written at rows ``j - k_off`` of ``dk`` / ``dv``), over the block's queries each group can reach
    (``j <= i < j + 4 + far``); ``P`` and ``dS`` are the block's ``(query row, key - wo)`` tiles."""
    for j0 in range(j_lo, j_hi, 4):
        gn = min(4, j_hi - j0)
        t0 = max(j0 - q0, 0)
        t1 = min(j0 + gn + fn - q0, qn)
        if t1 <= t0:
            continue
        _mm4t(dv, j0 - k_off, gn, P, j0 - wo, dos, q0, t0, t1, 0, E)
        _mm4t(dk, j0 - k_off, gn, dS, j0 - wo, qs, q0, t0, t1, 0, D)


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def _saved_rows(Sb, Pb, mrow_, red, ebuf, sn, g, gn, q0, wo, c0, c1, fn, los, xs, zs, lses, dlt, dzn, cst,
                is32):  # pragma: no cover - compiled
    """:func:`backward_fused`'s element pass from the forward's saved scores ``sn = sbuf[n]``: rows ``g .. g + gn``,
    columns ``[c0, c1)`` (``Sb`` holds ``dP`` there): ``P`` into ``Pb``, ``scale · dS`` into ``Sb``, ``dz`` per row;
    columns outside a row's own reach ``[lo_i, i]`` get 0."""
    R = cst[_RAMP]; sc = cst[_SC]; zero = R * 0; one = R / R
    for r in range(g, g + gn):
        i = q0 + r
        a = los[i] - wo; b = i + 1 - wo                  # the row's own reach, within [c0, c1)
        if b < a:
            b = a
        pz = Pb[r]; sz = Sb[r]
        for c in range(c0, a):
            pz[c] = zero; sz[c] = zero
        for c in range(b, c1):
            pz[c] = zero; sz[c] = zero
        nc = b - a
        if nc == 0:
            dzn[i] = zero
            continue
        srow = Pb[r, a:b]; prow = Sb[r, a:b]; mrow = mrow_[:nc]
        src = sn[i, wo + a - i + fn:wo + b - i + fn]
        xk = xs[wo + a:wo + b]
        xi = xs[i]
        rz = R + zs[i]
        li = lses[i]
        di = dlt[r]
        for c in range(nc):
            srow[c] = src[c] - li
            mrow[c] = min((rz - (xi - xk[c])) / R, one)   # used only where the pair counts (e > 0 there)
        _exp_seg(srow, red, ebuf, cst, is32)
        gz = zero
        for c in range(nc):
            e_ = srow[c]
            tt = e_ * (prow[c] - di)
            gz += tt if rz - (xi - xk[c]) <= R else zero
            srow[c] = e_ * mrow[c]
            prow[c] = (sc * mrow[c]) * tt
        dzn[i] = gz / R


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def backward_fused(q, k, v, o, do, lse, z, lo, far, kp, xs, H, bq, cb, cst, is32, have_s, sbuf, dq, dk, dv, dz,
                   spk, spv, i0, i1):  # pragma: no cover - compiled
    """``dQ``, ``dK``, ``dV`` and ``dz`` in one query-major pass (FlashAttention-2's order), no kept ``t``.

    Work item: a chunk of ``cb`` query blocks of one row ``n``, in order. Each block recomputes its scores and
    ``dP = dO Vᵀ`` once per group of 4 query rows over the columns the group reaches, forms ``P = m e`` and
    ``dS = scale · m t`` (``t = e (dP - Δ)``, ``Δ = dO·O`` per row computed here), writes ``dQ = dS K`` and ``dz``
    of its rows, then accumulates ``dV += Pᵀ dO`` and ``dK += dSᵀ Q`` for the keys of its window. Within a chunk
    the blocks run in order, so the chunk owns the keys from its first query on: key rows ``[q0, q0 + bq)`` are
    zeroed by their own block (an earlier query never reaches a later key) and accumulated in place. Keys
    before the chunk's first query (the window of its first blocks) go to the chunk's ``(far, D)`` spill rows;
    :func:`add_spill` adds them afterwards, in chunk order (deterministic, no atomics).
    With ``have_s`` the scaled scores come from the forward's ``sbuf`` (see :func:`forward`) instead of ``Q Kᵀ``:
    4 tile products per block instead of 5.
    Runs the work items ``i0 <= it < i1`` (``it = n·NC + chunk``) and writes their rows of ``dq`` ``(N, L, D)``,
    ``dz`` ``(N, L)``, of ``dk``, ``dv`` (the keys the chunk owns) and their spill rows ``spk`` ``(N·NC, SP, D)``,
    ``spv`` ``(N·NC, SP, E)`` (zeros on entry; ``SP`` = the largest ``far``)."""
    N, L, D = q.shape
    E = v.shape[2]
    NQ = (L + bq - 1) // bq
    NC = (NQ + cb - 1) // cb
    fmax = 0
    for n in range(N):
        fmax = max(fmax, far[n])
    SP = fmax
    WM = fmax + bq + 8                                    # the widest window, plus the score products' rounding
    R = cst[_RAMP]; sc = cst[_SC]; zero = R * 0
    for it in range(i0, i1):
        n = it // NC; ch = it % NC
        kpb = kp[(n // H) % kp.shape[0]]
        qs = q[n]; ks = k[n]; vs = v[n]; os_ = o[n]; dos = do[n]; zs = z[n]; los = lo[n]; lses = lse[n]
        dks = dk[n]; dvs = dv[n]
        fn = far[n]
        cs = ch * cb * bq
        ce = min(L, cs + cb * bq)
        KT = np.zeros((D, WM), dtype=q.dtype)
        VT = np.zeros((E, WM), dtype=q.dtype)
        Pb = np.empty((bq, WM), dtype=q.dtype)
        Sb = np.empty((bq, WM), dtype=q.dtype)
        mrow_ = np.empty(WM, dtype=q.dtype)
        red = np.empty(WM, dtype=q.dtype)
        ebuf = np.empty(WM, dtype=np.int32)
        acc = np.empty((bq, D), dtype=q.dtype)
        dlt = np.empty(bq, dtype=q.dtype)
        for q0 in range(cs, ce, bq):
            qn = min(bq, L - q0)
            klo = q0
            for r in range(qn):
                klo = min(klo, los[q0 + r])
            wo = klo
            W = q0 + qn - wo
            if not have_s:
                transpose(KT, ks[wo:wo + W], W, ks.shape[1])
            transpose(VT, vs[wo:wo + W], W, vs.shape[1])
            for r in range(qn):
                i = q0 + r
                orow = os_[i]; drow = dos[i]
                s = zero
                for e in range(E):
                    s += orow[e] * drow[e]
                dlt[r] = s
            _zero(acc, 0, qn, 0, D, zero)
            _zero(dks, q0, qn, 0, D, zero)      # this block's own keys: first reached here
            _zero(dvs, q0, qn, 0, E, zero)
            for g in range(0, qn, 4):
                gn = min(4, qn - g)
                c0, c1 = _group_cols(los, q0, g, gn, wo, W)
                if c1 > c0:
                    nc = c1 - c0
                    r0, r1 = _round8(c0, c1, WM)
                    if not have_s:
                        _zero(Pb, g, gn, r0, r1, zero)
                        _mm4(Pb, g, gn, qs, q0 + g, KT, 0, 0, D, r0, r1)
                    _zero(Sb, g, gn, r0, r1, zero)
                    _mm4(Sb, g, gn, dos, q0 + g, VT, 0, 0, E, r0, r1)
                    xk = xs[wo + c0:wo + c1]; kpk = kpb[wo + c0:wo + c1]
                    mrow = mrow_[:nc]
                    if have_s:
                        _saved_rows(Sb, Pb, mrow_, red, ebuf, sbuf[n], g, gn, q0, wo, c0, c1, fn, los, xs, zs, lses,
                                    dlt, dz[n], cst, is32)
                    else:
                        for r in range(g, g + gn):
                            i = q0 + r
                            srow = Pb[r, c0:c1]; prow = Sb[r, c0:c1]
                            rz = R + zs[i]
                            xi = xs[i]
                            _query_row_weights(srow, mrow, xi, xk, rz, kpk, cst)
                            li = lses[i]
                            di = dlt[r]
                            for c in range(nc):
                                srow[c] = srow[c] - li
                            _exp_seg(srow, red, ebuf, cst, is32)
                            gz = zero
                            for c in range(nc):
                                e_ = srow[c]
                                tt = e_ * (prow[c] - di)          # d out / d m_ij (0 where the pair does not count)
                                gz += tt if rz - (xi - xk[c]) <= R else zero
                                srow[c] = e_ * mrow[c]            # P_ij
                                prow[c] = (sc * mrow[c]) * tt     # scale · dS_ij
                            dz[n, i] = gz / R
                    _mm4(acc, g, gn, Sb[:, c0:c1], g, ks[wo + c0:wo + c1], 0, 0, nc, 0, D)
                else:
                    c0 = c1 = 0
                    for r in range(g, g + gn):
                        dz[n, q0 + r] = zero
                # the key groups below read row i at keys (i - far - 4, i + 4): zero what the group did not compute
                for r in range(g, g + gn):
                    i = q0 + r
                    rd0 = max(i - fn - 3 - wo, 0)
                    rd1 = min(i + 4 - wo, W)
                    pz = Pb[r]; sz = Sb[r]
                    for c in range(rd0, min(c0, rd1)):
                        pz[c] = zero; sz[c] = zero
                    for c in range(max(c1, rd0), rd1):
                        pz[c] = zero; sz[c] = zero
            for r in range(qn):
                dqr = dq[n, q0 + r]; ar = acc[r]
                for d in range(D):
                    dqr[d] = ar[d]
            if wo < cs:   # keys before the chunk: its spill rows
                _dkdv_keys(spk[it], spv[it], cs - SP, wo, cs, wo, q0, qn, fn, Pb, Sb, qs, dos, D, E)
            _dkdv_keys(dks, dvs, 0, max(wo, cs), q0 + qn, wo, q0, qn, fn, Pb, Sb, qs, dos, D, E)


@numba.njit(cache=True, nogil=True)
def add_spill(dk, dv, spk, spv, bq, cb, i0, i1):  # pragma: no cover - compiled
    """Add :func:`backward_fused`'s spill rows into ``dk`` / ``dv``: per row ``i0 <= n < i1``, the chunks in
    order."""
    N, L, D = dk.shape
    E = dv.shape[2]
    SP = spk.shape[1]
    NC = spk.shape[0] // N
    for n in range(i0, i1):
        for ch in range(1, NC):
            it = n * NC + ch
            cs = ch * cb * bq
            for r in range(SP):
                j = cs - SP + r
                if j >= 0:
                    for d in range(D):
                        dk[n, j, d] += spk[it, r, d]
                    for e in range(E):
                        dv[n, j, e] += spv[it, r, e]
