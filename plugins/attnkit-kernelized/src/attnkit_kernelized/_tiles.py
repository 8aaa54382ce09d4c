"""The product tile the kernelized numba kernels build their products from, and the causal block built on it.

:func:`axpy_rows` adds a product of two small row-major matrices to a third,
``OUT[:on, :ne] += C[:on, :yn] @ Y[:yn, :ne]``. It is :func:`attnkit.numba_panel.axpy_rows`: register
panels of 4 output rows x 2 vectors held in registers across the whole sum (LLVM IR through a numba
intrinsic). It replaced "axpy rows" written as numba loops (4 output rows and 4 terms per pass over a
row, which loads and stores the output rows every four terms): one thread, linear's fused forward at
L = 8,192 went from 43-44 ms to 35 ms (docs/benchmarks.md, "Register panels"). :func:`transpose` is
:func:`attnkit.numba_panel.transpose` (8 x 8 tiles through registers), which turns a block of key features
into the ``(M, T)`` layout the products read.

:func:`causal_block` is one block of the causal product built from it (the state's part, the causal
triangle, the denominator, the state update): the one copy of that loop, used by the unfused product
(:func:`attnkit_kernelized.linear.numba_ops._causal_rows`, causal and reverse) and, through
:func:`causal_block_normalised`, by the fused no-grad forwards of ``linear`` and ``performer``. Both are plain
calls, not inlined: a block is thousands of products, and inlined (numba copies the callee's IR into each caller)
performer's first no-grad forward took 9.6-10.3 s instead of 4.1-4.2 (docs/benchmarks.md, "Session 59").
"""

from __future__ import annotations

import numba

from attnkit.numba_panel import axpy_rows, set_rows, transpose

from ._numba import FASTMATH

__all__ = ["axpy_rows", "set_rows", "transpose", "divide_row", "feature_grad_row", "causal_block",
           "causal_block_normalised"]


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
def feature_grad_row(out, acc, g, X, p, padded, scale, zero):  # pragma: no cover - compiled
    """One row of the performer features' gradient: ``out = acc - scale · sum(g) · X[p]`` (``acc = (g ⊙ phi) W'``
    of the row, ``g`` its ``g ⊙ phi``; ``scale`` 0: the queries' form, ``out = acc``, ``X`` unread), 0 where
    ``padded`` whatever ``X[p]`` holds."""
    D = out.shape[0]
    if padded:
        for d in range(D):
            out[d] = zero
    elif scale != 0:
        s = zero
        for m in range(g.shape[0]):
            s += g[m]
        s = s * scale
        xr = X[p]
        for d in range(D):
            out[d] = acc[d] - s * xr[d]
    else:
        for d in range(D):
            out[d] = acc[d]


@numba.njit(cache=True, fastmath=FASTMATH)
def causal_block(xc, wc, yc, yT, A, oc, db, S, z, T, M, E, zero, with_den, normalize):  # pragma: no cover - compiled
    """One block of ``T`` positions of the causal product, the block's features ready: ``xc (T, M)`` queries,
    ``wc (T, E)`` values, ``yc (T, M)`` the keys and ``yT (M, >= T)`` the same keys transposed; ``(S, z)`` the
    state of the earlier blocks.

    Writes ``oc[:T] = x S + tril(x yᵀ) w`` (``oc`` is not read first) and, with ``with_den``,
    ``db[:T] = x z + rowsum tril(x yᵀ)``; with ``normalize`` too, ``oc`` is divided by it (0 where it is 0, NaN
    stays NaN). Then ``S += yᵀ w`` and, with ``with_den``, ``z += Σ y`` (a key row at a time: along ``z``'s vector,
    not ``M`` row sums of ``yT``, which took twice as long). ``A (>= T, >= T)`` is scratch. The causal triangle
    is taken four query rows at a time over whole 16-column blocks up to the group's last row (so its rows
    vectorise), the group's diagonal block cut to its lower triangle, then ``out += A w`` over the visible keys.
    """
    set_rows(oc, xc, S, T, M, E)                   # inter: the earlier blocks' state (no zeroing pass first)
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
        for t in range(T):
            yr = yc[t]
            for m in range(M):
                z[m] += yr[m]


@numba.njit(cache=True, fastmath=FASTMATH)
def causal_block_normalised(xb, yb, yT, A, db, vn, outn, S, z, c0, T, M, E, zero):  # pragma: no cover - compiled
    """:func:`causal_block` of the fused no-grad kernels of ``linear`` and ``performer``: the features ready in
    ``xb`` / ``yb`` ``(>= T, M)``, ``yb`` transposed into ``yT``, the normalised output written straight to
    ``outn[c0:c0+T]`` (the products are register panels, which do not care whose array they store to; a block
    in ``ob`` copied out cost ~0.5 us of a ~25 us performer block). ``db (>= T)`` is scratch."""
    transpose(yT, yb, T, M)
    c1 = c0 + T
    causal_block(xb[:T], vn[c0:c1], yb[:T], yT, A, outn[c0:c1], db, S, z, T, M, E, zero, True, True)
