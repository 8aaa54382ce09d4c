"""numba kernels of ``lsh``'s CPU hashing and sorting: :func:`hash_rows` (the rotation and its argmax, a block
of rows at a time) and :func:`counting_sort` (each round's permutation and its inverse in one pass).

The attention itself (every round through the permutation, the rounds merged at each position) is in
:mod:`._fused`.
"""

from __future__ import annotations

import numba
import numpy as np

from attnkit.numba_panel import axpy_at, empty_aligned
from attnkit.numba_vreduce import first_index, row_max, row_min

from ..engine._numba_kernels import FASTMATH

#: rows per register block of :func:`hash_rows` (their projections, ``HASH_BLOCK x half``, stay in L1)
HASH_BLOCK = 16


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def hash_rows(x, rot, C, L, out, g0, g1):  # pragma: no cover - compiled
    """``argmax([p; -p])`` of the rotations p of rows ``g0 .. g1`` of ``x`` ``(BH·L, D)`` by ``rot`` ``(R, D, half)``,
    computed here a block of :data:`HASH_BLOCK` rows and one round at a time (the projections never leave
    the cache), into ``out`` int64 ``(BH, R, L)``: the column of the first maximum when ``max(p) >= -min(p)``,
    else ``C +`` the column of the first minimum (the row's maximum, minimum and their first column on whole
    vectors: :mod:`attnkit.numba_vreduce`). Serial (``nogil``): the caller hands
    blocks of rows to threads."""
    D = x.shape[1]
    R, _, half = rot.shape
    P = empty_aligned(HASH_BLOCK, half, x)
    for b0 in range(g0, g1, HASH_BLOCK):
        bn = min(HASH_BLOCK, g1 - b0)
        X = x[b0:b0 + bn]
        for r in range(R):
            for i in range(bn):
                pi = P[i]
                for c in range(half):
                    pi[c] = 0
            axpy_at(P, bn, X, 0, rot[r], 0, D)          # register panels (attnkit.numba_panel)
            for i in range(bn):
                p = P[i]
                mx = row_max(p)                          # vector reductions (attnkit.numba_vreduce)
                mn = row_min(p)
                g = b0 + i
                if mx >= -mn:
                    out[g // L, r, g % L] = first_index(p, mx)
                else:       # (a row of NaN only: C + 0, as the loop this replaced gave)
                    out[g // L, r, g % L] = C + max(first_index(p, mn), 0)
    return out


@numba.njit(cache=True, nogil=True)
def counting_sort(lab, nlab, perm, inv, i0, i1):  # pragma: no cover - compiled
    """Stable sort of the rows ``i0 <= n < i1`` of ``lab`` int64 ``(N, L)`` (labels in ``[0, nlab)``) into ``perm``
    (sorted index -> position, ties by position) and ``inv`` (position -> sorted index), int64 ``(N, L)``: one
    counting pass, a prefix sum over the labels and one placing pass per row. A serial ``nogil`` function; the
    caller runs ranges of rows on threads (:func:`attnkit.numba_pool.run_ranges`)."""
    N, L = lab.shape
    for n in range(i0, i1):
        start = np.zeros(nlab + 1, dtype=np.int64)
        row = lab[n]
        for i in range(L):
            start[row[i] + 1] += 1
        for c in range(nlab):
            start[c + 1] += start[c]
        for i in range(L):
            c = row[i]
            j = start[c]
            start[c] = j + 1
            perm[n, j] = i
            inv[n, i] = j
