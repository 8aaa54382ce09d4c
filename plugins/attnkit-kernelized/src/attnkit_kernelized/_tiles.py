# ruff: noqa: E702  -- the register tiles read best one tile row per line (a0 = ...; a1 = ...)
"""The register tile the kernelized numba kernels build their products from.

:func:`axpy_rows` adds a product of two small row-major matrices to a third,
``OUT[:on, :ne] += C[:on, :yn] @ Y[:yn, :ne]``, as "axpy rows": four rows of
``OUT`` and four terms per pass over a row, vectorised over the contiguous row
(``reassoc`` fastmath), so every load of a ``Y`` row feeds four output rows and
no horizontal sum is needed. On a hot 64 x 64 x 64 product it runs at about the
machine's one-thread matmul rate (measured ~90 GFLOP/s against torch's 97 on the
2-core AMD EPYC of docs/benchmarks.md), where dot-product tiles over the
reduction axis (the kernels' earlier form) reached about half of that: each of
their short dots ended in a horizontal sum.

Rules that keep it vectorised (checked by timing, see docs/mechanisms/linear.md):
pass row-sliced views (``A[i:]`` keeps numba's C layout; a column slice does
not), and keep every loop starting at 0 with no runtime offset (a runtime
start makes numba wrap possibly negative indices, a select per element).

:func:`causal_block` is one block of the causal product built from it (the state's part, the causal
triangle, the denominator, the state update): the one copy of that loop, used by the unfused product
(:func:`attnkit_kernelized.linear.numba_ops._causal_rows`, causal and reverse) and, through
:func:`causal_block_normalised`, by the fused no-grad forwards of ``linear`` and ``performer``.
"""

from __future__ import annotations

import numba

from ._numba import FASTMATH


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def axpy_rows(OUT, C, Y, on, yn, ne):  # pragma: no cover - compiled
    """``OUT[i, :ne] += sum_{j < yn} C[i, j] * Y[j, :ne]`` for ``i < on``.

    ``OUT (>= on, >= ne)``, ``C (>= on, >= yn)``, ``Y (>= yn, >= ne)``: C-contiguous
    rows of one float dtype (row-sliced views are fine). 4 rows x 4 terms per pass.
    """
    on4 = on - on % 4
    yn4 = yn - yn % 4
    for i in range(0, on4, 4):
        oa = OUT[i]; ob = OUT[i + 1]; oc = OUT[i + 2]; od = OUT[i + 3]
        ca = C[i]; cb = C[i + 1]; cc = C[i + 2]; cd = C[i + 3]
        for j in range(0, yn4, 4):
            u0_ = Y[j]; u1_ = Y[j + 1]; u2_ = Y[j + 2]; u3_ = Y[j + 3]
            p0 = ca[j]; p1 = ca[j + 1]; p2 = ca[j + 2]; p3 = ca[j + 3]
            r0 = cb[j]; r1 = cb[j + 1]; r2 = cb[j + 2]; r3 = cb[j + 3]
            s0 = cc[j]; s1 = cc[j + 1]; s2 = cc[j + 2]; s3 = cc[j + 3]
            t0 = cd[j]; t1 = cd[j + 1]; t2 = cd[j + 2]; t3 = cd[j + 3]
            for e in range(ne):
                u0 = u0_[e]; u1 = u1_[e]; u2 = u2_[e]; u3 = u3_[e]
                oa[e] += p0 * u0 + p1 * u1 + p2 * u2 + p3 * u3
                ob[e] += r0 * u0 + r1 * u1 + r2 * u2 + r3 * u3
                oc[e] += s0 * u0 + s1 * u1 + s2 * u2 + s3 * u3
                od[e] += t0 * u0 + t1 * u1 + t2 * u2 + t3 * u3
        for j in range(yn4, yn):
            u_ = Y[j]
            p0 = ca[j]; r0 = cb[j]; s0 = cc[j]; t0 = cd[j]
            for e in range(ne):
                u = u_[e]
                oa[e] += p0 * u; ob[e] += r0 * u; oc[e] += s0 * u; od[e] += t0 * u
    for i in range(on4, on):
        oa = OUT[i]; ca = C[i]
        for j in range(yn):
            u_ = Y[j]
            p0 = ca[j]
            for e in range(ne):
                oa[e] += p0 * u_[e]


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def divide_row(row, s, E, zero):  # pragma: no cover - compiled
    """``row[:E] /= s``, the normalisation by a denominator: 0 where ``s`` is 0 (no key visible; NaN stays NaN)."""
    if s == 0:
        for e in range(E):
            row[e] = zero
    else:
        rr = 1 / s
        for e in range(E):
            row[e] *= rr


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def causal_block(xc, wc, yT, A, oc, db, S, z, T, M, E, zero, with_den, normalize):  # pragma: no cover - compiled
    """One block of ``T`` positions of the causal product, the block's features ready: ``xc (T, M)`` queries,
    ``wc (T, E)`` values, ``yT (M, >= T)`` the keys transposed; ``(S, z)`` the state of the earlier blocks.

    Writes ``oc[:T] = x S + tril(x yᵀ) w`` and, with ``with_den``, ``db[:T] = x z + rowsum tril(x yᵀ)``; with
    ``normalize`` too, ``oc`` is divided by it (0 where it is 0, NaN stays NaN). Then ``S += yᵀ w`` and, with
    ``with_den``, ``z += Σ y``. ``A (>= T, >= T)`` is scratch. The causal triangle is taken four query rows at a
    time over whole 16-column blocks up to the group's last row (so its rows vectorise), the group's diagonal
    block cut to its lower triangle, then ``out += A w`` over the visible keys.
    """
    for t in range(T):
        o_ = oc[t]
        for e in range(E):
            o_[e] = zero
    axpy_rows(oc, xc, S, T, M, E)                  # inter: the earlier blocks' state
    for i in range(0, T, 4):
        r = min(4, T - i)
        n16 = min(T, (i + r + 15) // 16 * 16)
        for t in range(r):
            a_ = A[i + t]
            for j in range(n16):
                a_[j] = zero
        axpy_rows(A[i:], xc[i:], yT, r, M, n16)
        for t in range(r):
            a_ = A[i + t]
            for j in range(i + t + 1, i + r):
                a_[j] = zero
        axpy_rows(oc[i:], A[i:], wc, r, i + r, E)
        if with_den:
            for t in range(r):
                a_ = A[i + t]
                s = zero
                for j in range(i + t + 1):
                    s += a_[j]
                xa = xc[i + t]
                for m in range(M):
                    s += xa[m] * z[m]
                db[i + t] = s
                if normalize:
                    divide_row(oc[i + t], s, E, zero)
    axpy_rows(S, yT, wc, M, T, E)                  # the state: S += yᵀ w over the block, z += Σ y
    if with_den:
        for m in range(M):
            yr = yT[m]
            s = zero
            for t in range(T):
                s += yr[t]
            z[m] += s


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def causal_block_normalised(xb, yb, yT, A, ob, db, vn, outn, S, z, c0, T, M, E, zero):  # pragma: no cover - compiled
    """:func:`causal_block` of the fused no-grad kernels of ``linear`` and ``performer``: the features ready in
    ``xb`` / ``yb`` ``(>= T, M)``, ``yb`` transposed into ``yT``, the normalised output written to
    ``outn[c0:c0+T]``. ``ob (>= T, E)`` and ``db (>= T)`` are scratch."""
    for j in range(M):      # transposed (gathering along a column ran 2x faster than scattering rows)
        d_ = yT[j]
        for t in range(T):
            d_[t] = yb[t, j]
    c1 = c0 + T
    causal_block(xb[:T], vn[c0:c1], yT, A, ob, db, S, z, T, M, E, zero, True, True)
    for t in range(T):
        o_ = ob[t]; d_ = outn[c0 + t]
        for e in range(E):
            d_[e] = o_[e]
