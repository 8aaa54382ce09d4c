"""numba kernels of ``lsh``'s CPU hashing and sorting: :func:`hash_rows` (the rotation and its argmax, a block
of rows at a time) and :func:`counting_sort` (each round's permutation and its inverse in one pass).

The attention itself (every round through the permutation, the rounds merged at each position) is in
:mod:`._fused`.
"""

from __future__ import annotations

import numba
import numpy as np

from attnkit.numba_panel import empty_aligned, set_t, transpose, zeros_aligned
from attnkit.numba_vreduce import column_max_min

from ..engine._numba_kernels import FASTMATH

#: rows per block of :func:`hash_rows` (a vector of float32 lanes with 512-bit panels)
HASH_BLOCK = 16


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def hash_rows(x, rot, C, L, out, g0, g1):  # pragma: no cover - compiled
    """``argmax([p; -p])`` of the rotations p of rows ``g0 .. g1`` of ``x`` ``(BH·L, D)`` by ``rot`` ``(R, D, half)``,
    into ``out`` int64 ``(BH, R, L)``: the first column of the maximum when ``max(p) >= -min(p)``, else ``C +``
    the first column of the minimum. A block of :data:`HASH_BLOCK` rows and one round at a time, transposed:
    ``pT = rot[r]^T xT`` ``(half, HASH_BLOCK)`` on register panels (:func:`attnkit.numba_panel.axpy_t`), then
    each row's maximum, minimum and their first columns down the columns of ``pT``, a row per vector lane
    (:func:`attnkit.numba_vreduce.column_max_min`): nothing is reduced across lanes, and the projections never
    leave L1. Serial (``nogil``): the caller hands blocks of rows to threads."""
    D = x.shape[1]
    R, _, half = rot.shape
    nb = HASH_BLOCK
    PT = empty_aligned(half, nb, x)             # the block's rotations, transposed
    XT = zeros_aligned(D, nb, x)                # the block's rows, transposed
    mx = np.empty(nb, x.dtype)
    mn = np.empty(nb, x.dtype)
    ix = np.empty(nb, np.int64)
    jx = np.empty(nb, np.int64)
    for b0 in range(g0, g1, nb):
        bn = min(nb, g1 - b0)
        transpose(XT, x[b0:b0 + bn], bn, D)     # (a short last block: the lanes past bn hold earlier rows)
        for r in range(R):
            set_t(PT, 0, half, rot[r], XT, 0, 0, D)
            column_max_min(PT, half, mx, ix, mn, jx)
            for i in range(bn):
                g = b0 + i
                # (a row of NaN only: NaN >= NaN is False, and C + 0, as before)
                out[g // L, r, g % L] = ix[i] if mx[i] >= -mn[i] else C + max(jx[i], 0)
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
