"""numba kernel building the element masks of the sorted chunks (CPU): one pass, with spans and pair counts.

The same masks as :func:`attnkit_sparse.lsh.attention.chunk_masks` (torch), which the tests compare it with;
building them as a handful of broadcast torch ops costs several passes over ``n_hashes·L·2·bucket_size``
bools, this one writes each entry once.
"""

from __future__ import annotations

import math

import numba
import numpy as np


@numba.njit(parallel=True, cache=True, nogil=True)
def chunk_masks(pos, real, cs, causal):  # pragma: no cover - compiled
    """``pos`` int64 ``(N, NQ·cs)`` sorted original positions (-1 past L), ``real`` bool ``(N, NQ·cs)``
    (key not padded) -> bank bool ``(N, NQ, 2, cs, cs)``, span int32 ``(N, NQ, 2, cs, 2)``, pairs int64 ``(N·NQ,)``."""
    N, T = pos.shape
    nq = T // cs
    bank = np.zeros((N, nq, 2, cs, cs), dtype=np.bool_)
    span = np.empty((N, nq, 2, cs, 2), dtype=np.int32)
    pairs = np.zeros(N * nq, dtype=np.int64)
    for item in numba.prange(N * nq):
        n = item // nq
        c = item % nq
        count = 0
        for slot in range(2):
            kc = c - 1 + slot
            for i in range(cs):
                pi = pos[n, c * cs + i]
                lo = cs
                hi = 0
                if kc >= 0 and pi >= 0:
                    for j in range(cs):
                        pj = pos[n, kc * cs + j]
                        ok = pj >= 0 and pj != pi and real[n, kc * cs + j] and (not causal or pj <= pi)
                        if ok:
                            bank[n, c, slot, i, j] = True
                            count += 1
                            if j < lo:
                                lo = j
                            hi = j + 1
                span[n, c, slot, i, 0] = lo
                span[n, c, slot, i, 1] = hi
        pairs[item] = count
    return bank, span, pairs


#: positions per work item of the kernels that run over (sequence, block of positions)
BLOCK = 512


# ---------------------------------------------------------------------------------------------------------------
# hashing labels, sorted gathers and the combination of the rounds (the CPU path of LSHAttention)
# ---------------------------------------------------------------------------------------------------------------

@numba.njit(parallel=True, cache=True, nogil=True)
def hash_labels(proj, r0, L, C, out):  # pragma: no cover - compiled
    """``argmax([p; -p])`` of each row and round of ``proj`` ``(n, R, half)`` (the rotated rows ``r0 .. r0 + n`` of
    the flattened ``(BH·L)`` sequence) into ``out`` int64 ``(BH, R, L)``: the column of the first maximum when
    ``max(p) >= -min(p)``, else ``C +`` the column of the first minimum. One read of ``proj``."""
    n, R, half = proj.shape
    for row in numba.prange(n):
        g = r0 + row
        bh = g // L
        pos = g % L
        for r in range(R):
            p = proj[row, r]
            mx = p[0]
            mn = p[0]
            amx = 0
            amn = 0
            for c in range(1, half):
                x = p[c]
                if x > mx:
                    mx = x
                    amx = c
                if x < mn:
                    mn = x
                    amn = c
            out[bh, r, pos] = amx if mx >= -mn else C + amn
    return out


@numba.njit(parallel=True, cache=True, nogil=True)
def gather_rounds(x, perm):  # pragma: no cover - compiled
    """``x`` ``(N, L, F)``, ``perm`` int64 ``(N, R, L)`` -> ``(N, R, L, F)``: ``out[n, r, j] = x[n, perm[n, r, j]]``."""
    N, L, F = x.shape
    R = perm.shape[1]
    out = np.empty((N, R, L, F), dtype=x.dtype)
    for item in numba.prange(N * R):
        n = item // R
        r = item % R
        xs = x[n]
        o = out[n, r]
        p = perm[n, r]
        for j in range(L):
            src = xs[p[j]]
            dst = o[j]
            for f in range(F):
                dst[f] = src[f]
    return out


@numba.njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz"})
def unsort_sum(xs, inv):  # pragma: no cover - compiled
    """``xs`` ``(N, R, L, F)``, ``inv`` int64 ``(N, R, L)`` -> ``(N, L, F)``: ``out[n, i] = Σ_r xs[n, r, inv[n, r, i]]``
    (the gradient of :func:`gather_rounds`: each position gathers its rows, no scatter, no zero fill)."""
    N, R, L, F = xs.shape
    out = np.empty((N, L, F), dtype=xs.dtype)
    nblk = (L + BLOCK - 1) // BLOCK
    for item in numba.prange(N * nblk):
        n = item // nblk
        i0 = (item % nblk) * BLOCK
        o = out[n]
        for i in range(i0, min(L, i0 + BLOCK)):
            oi = o[i]
            src = xs[n, 0, inv[n, 0, i]]
            for f in range(F):
                oi[f] = src[f]
            for r in range(1, R):
                src = xs[n, r, inv[n, r, i]]
                for f in range(F):
                    oi[f] += src[f]
    return out


@numba.njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz"})
def combine_forward(out_s, lse_s, inv):  # pragma: no cover - compiled
    """Unsort the rounds and combine them by their log-sum-exp.

    ``out_s`` ``(N, R, L, E)`` and ``lse_s`` ``(N, R, L)`` in sorted order (``-inf``: no pair in that round),
    ``inv`` int64 ``(N, R, L)`` (position -> sorted row) -> ``out`` ``(N, L, E)`` = ``Σ_r w_r · out_r``,
    ``w`` ``(N, R, L)`` = ``softmax_r(lse_r)`` by position (0 for every round of a position with no pair in
    any round, whose output is 0), and ``alone`` bool ``(N, L)`` (no pair in any round)."""
    N, R, L, E = out_s.shape
    out = np.empty((N, L, E), dtype=out_s.dtype)
    w = np.empty((N, R, L), dtype=out_s.dtype)
    alone = np.empty((N, L), dtype=np.bool_)
    nblk = (L + BLOCK - 1) // BLOCK
    for item in numba.prange(N * nblk):
        n = item // nblk
        i0 = (item % nblk) * BLOCK
        for i in range(i0, min(L, i0 + BLOCK)):
            m = -np.inf
            for r in range(R):
                lr = lse_s[n, r, inv[n, r, i]]
                if lr > m:
                    m = lr
            oi = out[n, i]
            for e in range(E):
                oi[e] = 0.0
            if m == -np.inf:
                alone[n, i] = True
                for r in range(R):
                    w[n, r, i] = 0.0
                continue
            alone[n, i] = False
            den = 0.0
            for r in range(R):
                wr = math.exp(lse_s[n, r, inv[n, r, i]] - m)
                w[n, r, i] = wr
                den += wr
            for r in range(R):
                wr = w[n, r, i] / den
                w[n, r, i] = wr
                src = out_s[n, r, inv[n, r, i]]
                for e in range(E):
                    oi[e] += wr * src[e]
    return out, w, alone


@numba.njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz"})
def combine_backward(g, out, out_s, w, perm):  # pragma: no cover - compiled
    """The gradient of :func:`combine_forward` in sorted order: for sorted row ``j`` of round ``r`` holding
    position ``i = perm[r, j]``: ``d out_s = w_r(i) · g_i`` and ``d lse_s = w_r(i) · (g_i·out_s[r, j] − g_i·out_i)``."""
    N, R, L, E = out_s.shape
    d_out = np.empty((N, R, L, E), dtype=out_s.dtype)
    d_lse = np.empty((N, R, L), dtype=out_s.dtype)
    for item in numba.prange(N * R):
        n = item // R
        r = item % R
        for j in range(L):
            i = perm[n, r, j]
            wr = w[n, r, i]
            gi = g[n, i]
            oi = out[n, i]
            src = out_s[n, r, j]
            dst = d_out[n, r, j]
            acc = 0.0
            for e in range(E):
                dst[e] = wr * gi[e]
                acc += gi[e] * (src[e] - oi[e])
            d_lse[n, r, j] = wr * acc
    return d_out, d_lse


@numba.njit(parallel=True, cache=True, nogil=True)
def counting_sort(lab, nlab):  # pragma: no cover - compiled
    """Stable sort of each row of ``lab`` int64 ``(N, L)`` (labels in ``[0, nlab)``) -> ``perm`` (sorted index ->
    position, ties by position) and ``inv`` (position -> sorted index), int64 ``(N, L)``: one counting pass,
    a prefix sum over the labels and one placing pass per row."""
    N, L = lab.shape
    perm = np.empty((N, L), dtype=np.int64)
    inv = np.empty((N, L), dtype=np.int64)
    for n in numba.prange(N):
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
    return perm, inv
