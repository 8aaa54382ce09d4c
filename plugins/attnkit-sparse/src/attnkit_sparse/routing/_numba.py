"""numba kernels of routing's CPU path.

* The routing itself: :func:`route_seq` (one sequence's scores, nearest centroids and selection),
  :func:`top_w_ascending` (the selection over a buffer of scores), both through :func:`select_row`;
  :func:`argmax_clusters` (nearest centroids over that buffer).
* The commitment term: :func:`commit_sums`, :func:`commit_grad`.
* Around the engine (:mod:`.gather`): routed gathers and the clusters' combination, each with its
  gradient. ``N = B·H`` sequences of ``L`` positions, ``M = C·W`` routed rows each (cluster ``c``'s ``W``
  slots one after another); ``idx`` int64 ``(N, M)`` is the position of each routed row. A position may
  be routed by several clusters or by none, so the gradient of a gather is a scatter-add; each work
  item owns one sequence, so no two threads write the same rows.

Every kernel but :func:`route_seq` is a serial ``nogil`` function of its inputs, the output arrays it fills
(the caller allocates them; zeros where a docstring says so) and a range ``i0 <= item < i1`` of its work
items; the callers run ranges on threads (:func:`attnkit.numba_pool.run_ranges`). ``parallel=True`` builds of
the same loops compiled two to five times slower (numba's parfor passes).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba.cpython.unsafe.numbers import trailing_zeros

from attnkit.numba_panel import transpose
from attnkit.numba_vreduce import row_max, row_min

from .._gathered import tile_scores
from ._mask_bits import ge_bits

_FM = {"reassoc", "contract", "nsz"}


@numba.njit(cache=True, nogil=True)
def gather_rows(x, idx, out, i0, i1):  # pragma: no cover - compiled
    """``x`` ``(N, L, F)``, ``idx`` ``(N, M)`` -> ``out`` ``(N, M, F)``: ``out[n, j] = x[n, idx[n, j]]``. Work items:
    blocks of 512 routed rows of one sequence."""
    N, L, F = x.shape
    M = idx.shape[1]
    nblk = (M + 511) // 512
    for item in range(i0, i1):
        n = item // nblk
        j0 = (item % nblk) * 512
        for j in range(j0, min(M, j0 + 512)):
            src = x[n, idx[n, j]]
            dst = out[n, j]
            for f in range(F):
                dst[f] = src[f]


@numba.njit(cache=True, nogil=True, fastmath=_FM)
def scatter_rows(g, idx, L, out, i0, i1):  # pragma: no cover - compiled
    """The gradient of :func:`gather_rows`: ``out[n, i] = Σ_{j: idx[n, j] = i} g[n, j]`` ``(N, L, F)``. Work items:
    the sequences."""
    N, M, F = g.shape
    for n in range(i0, i1):
        o = out[n]
        for i in range(L):
            oi = o[i]
            for f in range(F):
                oi[f] = 0.0
        for j in range(M):
            oi = o[idx[n, j]]
            src = g[n, j]
            for f in range(F):
                oi[f] += src[f]


@numba.njit(cache=True, nogil=True, fastmath=_FM)
def combine_forward(out_s, lse_s, idx, L, out, w, i0, i1):  # pragma: no cover - compiled
    """The routed rows combined by their log-sum-exp per position: ``out`` ``(N, L, E)`` =
    ``Σ_j w_j out_s[j]`` over the rows ``j`` routed to the position, ``w = softmax(lse)`` among them (rows with
    ``lse = -inf`` weigh 0; a position with no finite row gives 0), and ``w`` ``(N, M)``. Work items: the
    sequences."""
    N, M, E = out_s.shape
    for n in range(i0, i1):
        m = np.full(L, -np.inf)
        den = np.zeros(L)
        o = out[n]
        for i in range(L):
            oi = o[i]
            for e in range(E):
                oi[e] = 0.0
        for j in range(M):
            p = idx[n, j]
            if lse_s[n, j] > m[p]:
                m[p] = lse_s[n, j]
        for j in range(M):
            p = idx[n, j]
            lj = lse_s[n, j]
            if lj == -np.inf:
                w[n, j] = 0.0
                continue
            wj = math.exp(lj - m[p])
            w[n, j] = wj
            den[p] += wj
            oi = o[p]
            src = out_s[n, j]
            for e in range(E):
                oi[e] += wj * src[e]
        for i in range(L):
            if den[i] > 0:
                inv = 1.0 / den[i]
                oi = o[i]
                for e in range(E):
                    oi[e] *= inv
        for j in range(M):
            d = den[idx[n, j]]
            if d > 0:
                w[n, j] = w[n, j] / d


@numba.njit(cache=True, nogil=True, fastmath=_FM)
def combine_backward(g, out, out_s, w, idx, d_out, d_lse, i0, i1):  # pragma: no cover - compiled
    """The gradient of :func:`combine_forward` by routed row: ``d out_s[j] = w_j g_p`` and
    ``d lse_s[j] = w_j (g_p·out_s[j] − g_p·out_p)`` for ``p = idx[j]``, into ``d_out`` ``(N, M, E)`` and
    ``d_lse`` ``(N, M)``. Work items: blocks of 512 routed rows of one sequence."""
    N, M, E = out_s.shape
    nblk = (M + 511) // 512
    for item in range(i0, i1):
        n = item // nblk
        j0 = (item % nblk) * 512
        for j in range(j0, min(M, j0 + 512)):
            p = idx[n, j]
            wj = w[n, j]
            gp = g[n, p]
            op = out[n, p]
            src = out_s[n, j]
            dst = d_out[n, j]
            acc = 0.0
            for e in range(E):
                dst[e] = wj * gp[e]
                acc += gp[e] * (src[e] - op[e])
            d_lse[n, j] = wj * acc


@numba.njit(cache=True, nogil=True)
def argmax_clusters(s, out, i0, i1):  # pragma: no cover - compiled
    """``s`` ``(N, C, L)`` -> ``out`` int64 ``(N, L)``, zeros on entry: the first ``c`` with the largest
    ``s[n, c, l]`` (rows of ``-inf``: 0), a vertical pass over the contiguous ``L`` for each ``c``. Work items:
    blocks of 512 positions of one sequence."""
    N, C, L = s.shape
    nblk = (L + 511) // 512
    for item in range(i0, i1):
        n = item // nblk
        l0 = (item % nblk) * 512
        l1 = min(L, l0 + 512)
        best = s[n, 0, l0:l1].copy()
        arg = out[n, l0:l1]
        for c in range(1, C):
            row = s[n, c, l0:l1]
            for j in range(l1 - l0):
                if row[j] > best[j]:
                    best[j] = row[j]
                    arg[j] = c


@numba.njit(cache=True, nogil=True, inline="always")
def _take_ascending(vals, L, t, w, g, out_i, out_ok, cand, nc):  # pragma: no cover - compiled
    """Write, in ascending position order, the positions above ``t`` and the first ``w − g`` equal to it (``g`` of
    them lie above ``t``): with ``nc >= 0`` over the candidates ``cand[:nc]`` (ascending) whose values are
    ``vals[:nc]``, with ``nc < 0`` over every position ``p`` (value ``vals[p]``); returns how many were written."""
    ties = w - g
    m = 0
    for c in range(nc if nc >= 0 else L):
        p = cand[c] if nc >= 0 else c
        x = vals[c]
        if x > t or (x == t and ties > 0):
            if x == t:
                ties -= 1
            out_i[m] = p
            out_ok[m] = True
            m += 1
    return m


#: the largest sample rank :func:`_kth_largest` finds by insertion (above it: :func:`_select_largest`)
_SMALL_RANK = 32
#: positions per step of :func:`select_row`'s candidate pass (their vector compares as one 32-bit mask)
_CBLOCK = 32
#: room past a candidate buffer's capacity: a step of the candidate pass may write that many entries past it
CAND_SLACK = _CBLOCK


@numba.njit(cache=True, nogil=True)
def _kth_largest(a, k, buf):  # pragma: no cover - compiled
    """The ``k``-th largest of ``a`` (``1 <= k <= len(a)``, no NaN), counting repeats (``np.partition``'s value).
    Up to :data:`_SMALL_RANK` through ``buf`` (that long): the ``k`` largest so far, descending; an element
    enters only when it beats the current ``k``-th, so most of a sample costs one comparison. Above it
    :func:`_select_largest` (quickselect on a copy; not ``np.partition``, whose numba build took about 5 s of
    compile time per dtype)."""
    n = a.shape[0]
    if k > buf.shape[0]:
        return _select_largest(a, n, k, np.empty_like(a))
    for j in range(k):
        buf[j] = -np.inf
    for i in range(n):
        x = a[i]
        if x > buf[k - 1]:
            j = k - 1
            while j > 0 and buf[j - 1] < x:
                buf[j] = buf[j - 1]
                j -= 1
            buf[j] = x
    return buf[k - 1]


@numba.njit(cache=True, nogil=True)
def _select_largest(a, n, k, work):  # pragma: no cover - compiled
    """The ``k``-th largest of ``a[:n]`` (``1 <= k <= n``, no NaN), counting repeats (``np.partition``'s value),
    by quickselect on a copy in ``work`` (at least ``n`` long; ``a`` is left as it is). numba's ``np.partition``
    allocates a copy on each call and took about 6 µs for the ~300 candidates of a 16K row (development VM)."""
    for i in range(n):
        work[i] = a[i]
    lo = 0
    hi = n - 1
    want = k - 1                 # index in descending order
    while hi > lo:
        mid = (lo + hi) >> 1     # median of three as the pivot
        x, y, z = work[lo], work[mid], work[hi]
        if x < y:
            x, y = y, x
        if y < z:
            y = z
            if x < y:
                y = x
        piv = y
        i = lo
        j = hi
        while i <= j:            # descending: >= piv to the left, <= piv to the right
            while work[i] > piv:
                i += 1
            while work[j] < piv:
                j -= 1
            if i <= j:
                t = work[i]
                work[i] = work[j]
                work[j] = t
                i += 1
                j -= 1
        if want <= j:
            hi = j
        elif want >= i:
            lo = i
        else:
            return work[want]
    return work[want]


#: buckets of :func:`_select_largest_bucketed`'s histogram
_NBUCKET = 256


@numba.njit(cache=True, nogil=True)
def _select_largest_bucketed(a, n, k, work):  # pragma: no cover - compiled
    """:func:`_select_largest` (the ``k``-th largest of ``a[:n]``, ``1 <= k <= n``, no NaN; ``work`` at least ``n``
    long, ``a`` left as it is) through a histogram: each value's bucket ``int((x - min)·(NB - 1)/(max - min))``
    (a composition of rounded monotone operations, so a larger value never lands in a lower bucket), the bucket
    that holds the ``k``-th largest found from the counts, and quickselect only among that bucket's values.
    Quickselect over all of them branched on every comparison: 1.0 ms of a 16K sequence's 6.0 ms of routing
    went to it (128 clusters, ~420 candidates each; docs/benchmarks.md, "Session 54"). Short inputs, and values
    all equal or spread over more than the float range, go to quickselect directly.

    Compiled without fast-math flags: the bucket expression is evaluated as written."""
    if n < 64:
        return _select_largest(a, n, k, work)
    lo = row_min(a[:n])                            # vector reductions (attnkit.numba_vreduce)
    hi = row_max(a[:n])
    span = hi - lo
    if not (span > 0 and span < np.inf):           # all equal; an infinite or overflowing spread
        return _select_largest(a, n, k, work)
    top = _NBUCKET - 1
    scale = top / span
    if not scale < np.inf:                         # a spread so tiny that the scale overflows
        return _select_largest(a, n, k, work)
    hist = np.zeros(_NBUCKET, dtype=np.int64)
    for i in range(n):
        hist[min(int((a[i] - lo) * scale), top)] += 1
    b = top
    above = 0
    while above + hist[b] < k:
        above += hist[b]
        b -= 1
    m = 0
    for i in range(n):
        x = a[i]
        if min(int((x - lo) * scale), top) == b:
            work[m] = x
            m += 1
    return _select_largest(work, m, k - above, work)


@numba.njit(cache=True, nogil=True)
def masked_inverse(iv, rl, ivm):  # pragma: no cover - compiled
    """``ivm[l] = iv[l]`` where ``rl[l]``, else NaN: the scale :func:`select_row` takes (a padded position's value
    is then NaN, which no comparison routes)."""
    nan = np.nan
    for p in range(iv.shape[0]):
        ivm[p] = iv[p] if rl[p] else nan


@numba.njit(cache=True, nogil=True, inline="always")
def sample_rank(w, st):  # pragma: no cover - compiled
    """The rank in a sample of every ``st``-th value whose value is the threshold guess: about ``3w`` values of
    the row lie above it.

    The count above the guess spreads by about ``sqrt(rank)·st`` (a sample's order statistic), and a cluster
    with fewer than ``w`` candidates is selected again over its whole row (:func:`route_seq` scores its row a
    second time). Aimed at ``2w`` (until session 54), 21 of 1,024 random 16K rows (128 clusters of 128) fell
    short, nearly every sequence paid that second pass, and it cost a quarter of ``route_seq`` (8.5 against
    6.4 ms a sequence, one thread); aimed at ``3w``, none of them fell short and none passed the ``8w + 64``
    cap (docs/benchmarks.md, "Session 54")."""
    return (3 * w + st - 1) // st + 1


@numba.njit(cache=True, nogil=True)
def long_rows(w, L, W):  # pragma: no cover - compiled
    """Whether :func:`route_seq` takes the sampled threshold for rows of ``L`` positions and width ``w``
    (clusters of ``W`` slots, sample stride ``max(1, L // 512)``): :func:`select_row`'s condition for its
    callers' buffers. One definition for the kernel and for the caller that decides whether to allocate the
    scores buffer (:func:`.clusters._route_numba`)."""
    st = max(1, L // 512)
    ms = (L + st - 1) // st
    return w > 0 and sample_rank(w, st) < ms and L > 4 * (8 * W + 64)


@numba.njit(cache=True, nogil=True)
def select_row(row, ivm, w, st, vals, smp, kbuf, cand, cv, out_i, out_ok):  # pragma: no cover - compiled
    """One cluster's routed positions from its raw scores ``row`` ``(L,)``: the values ``x_l = row[l]·ivm[l]``
    (``ivm`` from :func:`masked_inverse`: NaN at padded positions; a NaN value is never routed), the positions of
    the ``min(w, non-NaN values)`` largest, ascending (ties at the w-th value: the lowest positions), into
    ``out_i`` with ``out_ok`` True.

    A threshold from a sample of the row (every ``st``-th value, into ``smp``; its rank found through ``kbuf``,
    :data:`_SMALL_RANK` long) picks about ``3w`` candidates (:func:`sample_rank`) in one pass: :data:`_CBLOCK`
    positions at a time are compared by vectors into one bit mask (:func:`._mask_bits.ge_bits`), and only its set
    bits are visited (positions into ``cand``, values into ``cv``; both hold ``8w + 64`` plus :data:`CAND_SLACK`).
    The exact ``w``-th value is selected among them (:func:`from_candidates`: quickselect). When the sample's
    guess does not give between ``w`` and ``8w + 64`` candidates, the values of the whole row are written to
    ``vals`` and partitioned instead (:func:`select_full`).

    A plain call (not inlined), so :func:`top_w_ascending` and :func:`route_seq` share one build of it."""
    L = row.shape[0]
    ms = smp.shape[0]
    cap = cand.shape[0] - CAND_SLACK
    ninf = -np.inf
    if w <= 0:
        return
    k = sample_rank(w, st)
    nc = -1
    if k < ms and L > 4 * cap:
        for j in range(ms):
            x = row[j * st] * ivm[j * st]
            smp[j] = x if x == x else ninf
        guess = _kth_largest(smp, k, kbuf)
        if guess > ninf:
            cnt = 0
            V = 8 if row.itemsize == 4 else 4                  # lanes of one vector compare
            unit = row.strides[0] == row.itemsize and ivm.strides[0] == ivm.itemsize
            nb = L - L % _CBLOCK if unit else 0
            for b0 in range(0, nb, _CBLOCK):
                bits = 0
                for v0 in range(0, _CBLOCK, V):                # NaN: not set
                    bits |= ge_bits(row, ivm, b0 + v0, guess) << v0
                while bits != 0:               # cnt <= cap on entry: the writes stay inside the slack
                    p = b0 + trailing_zeros(bits)
                    cand[cnt] = p
                    cv[cnt] = row[p] * ivm[p]
                    cnt += 1
                    bits &= bits - 1
                if cnt > cap:
                    break
            for p in range(nb, L):             # the rest (all of a strided row)
                if cnt > cap:
                    break
                x = row[p] * ivm[p]
                cand[cnt] = p
                cv[cnt] = x
                cnt += 1 if x >= guess else 0
            if w <= cnt <= cap:
                nc = cnt
    if nc >= 0:
        from_candidates(cand, cv, nc, w, L, vals, out_i, out_ok)
    else:
        select_full(row, ivm, w, vals, cand, out_i, out_ok)


@numba.njit(cache=True, nogil=True)
def from_candidates(cand, cv, nc, w, L, work, out_i, out_ok):  # pragma: no cover - compiled
    """The ``w`` largest of ``nc >= w`` candidates (positions ``cand``, ascending, values ``cv``), ascending, into
    ``out_i`` / ``out_ok`` (ties at the w-th value: the lowest positions); ``work``: scratch of ``nc`` at least.
    The ``w``-th value by :func:`_select_largest_bucketed`."""
    t = _select_largest_bucketed(cv, nc, w, work)
    g = 0
    for j in range(nc):
        g += 1 if cv[j] > t else 0
    _take_ascending(cv, L, t, w, g, out_i, out_ok, cand, nc)


@numba.njit(cache=True, nogil=True)
def select_full(row, ivm, w, vals, cand, out_i, out_ok):  # pragma: no cover - compiled
    """:func:`select_row` over the whole row (no sample): the values into ``vals``, the ``w``-th largest by
    :func:`_select_largest_bucketed` (not ``np.partition``, whose numba build took about 5 s of compile time per
    dtype); what the sampled threshold falls back to, and the whole selection of short rows."""
    L = row.shape[0]
    ninf = -np.inf
    nf = 0
    for p in range(L):
        x = row[p] * ivm[p]
        x = x if x == x else ninf
        vals[p] = x
        nf += 1 if x > ninf else 0
    w = min(w, nf)
    if w <= 0:
        return
    t = _select_largest_bucketed(vals, L, w, np.empty_like(vals))
    g = 0
    for p in range(L):
        g += 1 if vals[p] > t else 0
    _take_ascending(vals, L, t, w, g, out_i, out_ok, cand, -1)


@numba.njit(cache=True, nogil=True)
def top_w_ascending(s, inv, real, H, widths, W, idx, ok, i0, i1):  # pragma: no cover - compiled
    """Each cluster's routed positions: for row ``(n, c)`` of the scores ``s`` ``(N, C, L)``, the values
    ``s[n, c, l]·inv[n, l]`` (never routed where ``real[b, l]`` is False or the value is NaN; ``b = n // H`` modulo
    ``real``'s rows), the positions of its ``w = min(widths[b], such values)`` largest, ascending (ties at
    the w-th value: the lowest positions), into int64 ``idx`` ``(N, C, W)`` and bool ``ok``, zeros on entry
    (``False`` and position 0 in the unused slots): :func:`select_row` per row. Work items of up to 8 rows of
    one sequence share their scratch buffers."""
    N, C, L = s.shape
    Rb = real.shape[0]
    st = max(1, L // 512)
    ms = (L + st - 1) // st
    cap = 8 * W + 64 + CAND_SLACK
    per = 8
    nci = (C + per - 1) // per
    for it in range(i0, i1):
        n = it // nci
        b = n // H
        w0 = min(widths[b % widths.shape[0]], W)
        vals = np.empty(L, dtype=s.dtype)
        ivm = np.empty(L, dtype=s.dtype)
        smp = np.empty(ms, dtype=s.dtype)
        kbuf = np.empty(_SMALL_RANK, dtype=s.dtype)
        cand = np.empty(cap, dtype=np.int64)
        cv = np.empty(cap, dtype=s.dtype)
        masked_inverse(inv[n], real[b % Rb], ivm)
        for c in range((it % nci) * per, min(C, (it % nci + 1) * per)):
            select_row(s[n, c], ivm, w0, st, vals, smp, kbuf, cand, cv, idx[n, c], ok[n, c])


#: positions per score tile of :func:`route_seq` (a ``(C, TILE)`` tile: 32 KiB for 128 clusters in float32)
TILE = 64


@numba.njit(cache=True, nogil=True, fastmath=_FM)
def _tile_in(XT, xs, p0, step, tn, rl, ivt, zero):  # pragma: no cover - compiled
    """``XT[:, i] = xs[p0 + i·step]`` for ``i < tn`` (0 in the other columns) and ``ivt[i]`` its scale
    ``1 / max(‖x‖, 1e-12)`` where ``rl`` (the position is real), else NaN (NaN past ``tn`` too). One compiled
    function for every caller, so a position's scale is the same bits wherever it is computed.

    Consecutive positions (``step`` 1, the tiles of a sequence) are transposed through registers
    (:func:`attnkit.numba_panel.transpose`), the sample's strided ones by a loop; the squared norms are then summed
    along the tile's columns (vectors across positions, each position's terms in the order of ``d``), in ``ivt``.
    The loop that gathered each position into its column and summed its norm alone took 0.92 ms of a 16K
    sequence's 4.8 ms of tiles, this 0.40 (one thread; docs/benchmarks.md, "Session 54")."""
    D, TW = XT.shape
    nan = np.nan
    if step == 1:
        transpose(XT, xs[p0:], tn, D)
    else:
        for i in range(tn):
            r = xs[p0 + i * step]
            for d in range(D):
                XT[d, i] = r[d]
    for d in range(D):
        row = XT[d]
        for i in range(tn, TW):
            row[i] = zero
    for i in range(TW):
        ivt[i] = zero
    for d in range(D):
        row = XT[d]
        for i in range(TW):
            ivt[i] += row[i] * row[i]
    for i in range(tn):
        nr = math.sqrt(ivt[i])
        sc = 1.0 / (nr if (nr > 1e-12 or nr != nr) else 1e-12)   # a NaN norm stays NaN (as clamp)
        ivt[i] = sc if rl[p0 + i * step] else nan
    for i in range(tn, TW):
        ivt[i] = nan


@numba.njit(cache=True, nogil=True, fastmath=_FM, inline="always")
def _nearest_tile(ST, C, best, best2, arg, arg2):  # pragma: no cover - compiled
    """The first ``c`` of the largest score of each column of ``ST[:C]`` (NaN ignored; a NaN at ``c = 0`` stays the
    maximum: ``c = 0``); returns the buffer (``arg`` or ``arg2``) that holds it.

    One pass: the running maximum and its cluster, each read from one buffer and written to the other: a select
    stored back where it was read compiles to masked stores (slow on AMD's cores; attnkit.numba_panel), a store
    elsewhere does not. A strictly larger score takes over, so ties keep the first cluster."""
    TW = ST.shape[1]
    b0, b1 = best, best2
    a0, a1 = arg, arg2
    r0 = ST[0]
    for i in range(TW):
        b0[i] = r0[i]
        a0[i] = 0
    for c in range(1, C):
        row = ST[c]
        c32 = np.int32(c)
        for i in range(TW):
            bi = b0[i]
            vi = row[i]
            up = vi > bi
            b1[i] = vi if up else bi
            a1[i] = c32 if up else a0[i]
        b0, b1 = b1, b0
        a0, a1 = a1, a0
    return a0


@numba.njit(cache=True, nogil=True, fastmath=_FM)
def route_seq(x, mu, real, H, widths, W, n, s, inv, near, idx, ok):  # pragma: no cover - compiled
    """Sequence ``n``'s routing in one call (``nogil``: the caller hands sequences to threads): each cluster's
    routed positions into ``idx[n]``, ``ok[n]`` (zeros on entry), as :func:`select_row` on the raw scores
    ``μ_h x_nᵀ`` ``(C, L)`` (``μ`` ``(H', C, D)``, head ``h = n % H`` modulo ``H'``) scaled by
    ``1 / max(‖x_l‖, 1e-12)``, and, when ``near`` has rows, each position's nearest centroid (the first largest
    raw score).

    The scores are computed a tile of :data:`TILE` positions at a time on register panels
    (:func:`.._gathered.tile_scores`), each position's nearest centroid while its tile is in cache. When
    :func:`select_row` would take its sampled threshold (long rows), the sample positions are scored first
    (a ``1/st`` share of the product), each cluster's threshold is found from them, and then every tile's
    candidates are kept while the tile is in cache: no score is written to memory (``s`` and ``inv`` are left as
    they were, or hold scratch). A cluster whose threshold gives fewer than ``w`` or more than ``8w + 64``
    candidates has its whole row scored again (those clusters only, one more pass over the tiles) and selected
    over it. Short rows: the scores are written to ``s[n]`` ``(C, L)`` and :func:`select_row` runs per cluster
    on them (still in the last-level cache); ``s`` may have no columns when no row is short (ValueError if a
    short row meets such an ``s``). Both give :func:`select_row`'s result on the same scores."""
    N, L, D = x.shape
    C = mu.shape[1]
    mh = mu[(n % H) % mu.shape[0]]
    dt = x.dtype
    zero = np.zeros(1, dtype=dt)[0]
    ninf = -np.inf
    XT = np.zeros((D, TILE), dtype=dt)
    ST = np.empty((C, TILE), dtype=dt)
    ivt = np.empty(TILE, dtype=dt)
    best = np.empty(TILE, dtype=dt)
    best2 = np.empty(TILE, dtype=dt)
    arg = np.empty(TILE, dtype=np.int32)
    arg2 = np.empty(TILE, dtype=np.int32)
    xs = x[n]
    iv = inv[n]
    want = near.shape[0] > 0
    b = n // H
    rl = real[b % real.shape[0]]
    w0 = min(widths[b % widths.shape[0]], W)
    st = max(1, L // 512)
    ms = (L + st - 1) // st
    cap = 8 * W + 64
    k = sample_rank(w0, st)
    vals = np.empty(L, dtype=dt)
    kbuf = np.empty(_SMALL_RANK, dtype=dt)
    if not long_rows(w0, L, W):                       # short rows: write the scores, select_row on them
        if s.shape[1] != C or s.shape[2] != L:
            raise ValueError("route_seq: short rows need the (N, C, L) scores buffer s")
        sn = s[n]
        for l0 in range(0, L, TILE):
            tn = min(TILE, L - l0)
            _tile_in(XT, xs, l0, 1, tn, rl, ivt, zero)
            for i in range(tn):
                iv[l0 + i] = ivt[i]                  # the masked scale (NaN at padded positions)
            tile_scores(ST, C, TILE, mh, XT, D)       # ST = μ_h XTᵀ: the fused paths' product
            for c in range(C):
                row = ST[c]
                dst = sn[c, l0:l0 + tn]
                for i in range(tn):
                    dst[i] = row[i]
            if want:
                a = _nearest_tile(ST, C, best, best2, arg, arg2)
                for i in range(tn):
                    near[n, l0 + i] = a[i]
        smp = np.empty(ms, dtype=dt)
        cand = np.empty(cap + CAND_SLACK, dtype=np.int64)
        cv = np.empty(cap + CAND_SLACK, dtype=dt)
        for c in range(C):
            select_row(sn[c], iv, w0, st, vals, smp, kbuf, cand, cv, idx[n, c], ok[n, c])
        return
    # ---- the sample positions first: each cluster's threshold (select_row's guess, from the same values)
    SM = np.empty((C, ms), dtype=dt)
    for j0 in range(0, ms, TILE):
        tn = min(TILE, ms - j0)
        _tile_in(XT, xs, j0 * st, st, tn, rl, ivt, zero)
        tile_scores(ST, C, TILE, mh, XT, D)
        for c in range(C):
            row = ST[c]
            dst = SM[c]
            for i in range(tn):
                v = row[i] * ivt[i]
                dst[j0 + i] = v if v == v else ninf
    guess = np.empty(C, dtype=dt)
    cnt = np.zeros(C, dtype=np.int64)
    for c in range(C):
        guess[c] = _kth_largest(SM[c], k, kbuf)
        if not guess[c] > ninf:
            cnt[c] = cap + 1                         # no threshold: the whole row
    # ---- every tile: scores, nearest centroids, each cluster's candidates while the tile is in cache
    candP = np.empty((C, cap + TILE), dtype=np.int64)    # a tile adds at most TILE past cap
    candV = np.empty((C, cap + TILE), dtype=dt)
    V = 8 if x.itemsize == 4 else 4
    for l0 in range(0, L, TILE):
        tn = min(TILE, L - l0)
        _tile_in(XT, xs, l0, 1, tn, rl, ivt, zero)     # NaN scale past tn: those columns never pass
        for i in range(tn):
            iv[l0 + i] = ivt[i]
        tile_scores(ST, C, TILE, mh, XT, D)
        if want:
            a = _nearest_tile(ST, C, best, best2, arg, arg2)
            for i in range(tn):
                near[n, l0 + i] = a[i]
        for c in range(C):
            m = cnt[c]
            if m > cap:
                continue
            g = guess[c]
            row = ST[c]
            cp = candP[c]
            cvv = candV[c]
            bits = 0
            for v0 in range(0, TILE, V):       # the tile's 64 compares as one 64-bit mask
                bits |= ge_bits(row, ivt, v0, g) << v0
            while bits != 0:
                i = trailing_zeros(bits)
                cp[m] = l0 + i
                cvv[m] = row[i] * ivt[i]
                m += 1
                bits &= bits - 1
            cnt[c] = m
    # ---- the w largest of each cluster's candidates; the rest over their whole rows, scored again
    nfb = 0
    fb = np.empty(C, dtype=np.int64)
    for c in range(C):
        m = cnt[c]
        if w0 <= m <= cap:
            from_candidates(candP[c], candV[c], m, w0, L, vals, idx[n, c], ok[n, c])
        else:
            fb[nfb] = c
            nfb += 1
    if nfb == 0:
        return
    Kf = np.empty((nfb, D), dtype=dt)
    for f in range(nfb):
        Kf[f] = mh[fb[f]]
    FB = np.empty((nfb, L), dtype=dt)
    SF = np.empty((nfb, TILE), dtype=dt)
    for l0 in range(0, L, TILE):
        tn = min(TILE, L - l0)
        _tile_in(XT, xs, l0, 1, tn, rl, ivt, zero)
        tile_scores(SF, nfb, TILE, Kf, XT, D)
        for f in range(nfb):
            row = SF[f]
            dst = FB[f, l0:l0 + tn]
            for i in range(tn):
                dst[i] = row[i]
    for f in range(nfb):
        c = fb[f]
        select_full(FB[f], iv, w0, vals, candP[0], idx[n, c], ok[n, c])


@numba.njit(cache=True, nogil=True, fastmath=_FM)
def commit_sums(x, near, real, H, C, eps, sums, counts, sq, i0, i1):  # pragma: no cover - compiled
    """Per sequence ``n`` of ``x`` ``(N, L, D)``: the sums ``(N, C, D)`` of the unit rows ``x̂ = x / max(‖x‖, eps)``
    by nearest cluster ``near`` ``(N, L)``, their counts ``(N, C)`` and ``Σ ‖x̂‖²`` ``(N,)`` (zeros on entry), over
    the real positions (``real[b, l]``, ``b = n // H`` modulo its rows)."""
    N, L, D = x.shape
    Rb = real.shape[0]
    for n in range(i0, i1):
        rl = real[(n // H) % Rb]
        acc = 0.0
        for p in range(L):
            if not rl[p]:
                continue
            xr = x[n, p]
            n2 = 0.0
            for d in range(D):
                n2 += xr[d] * xr[d]
            nrm = math.sqrt(n2)
            inv = 1.0 / (nrm if nrm > eps else eps)
            c = near[n, p]
            s = sums[n, c]
            for d in range(D):
                s[d] += xr[d] * inv
            counts[n, c] += 1.0
            acc += n2 * inv * inv
        sq[n] = acc


@numba.njit(cache=True, nogil=True, fastmath=_FM)
def commit_grad(x, near, real, H, mu, coef, eps, out, i0, i1):  # pragma: no cover - compiled
    """The gradient in ``x`` ``(N, L, D)`` of ``coef·Σ_l ‖x̂_l − μ_c(l)‖²`` (centroids ``mu`` ``(H, C, D)`` constant,
    head ``n % H``): ``2·coef·(x̂ − μ)`` through ``x̂ = x / max(‖x‖, eps)``; 0 at padded positions."""
    N, L, D = x.shape
    Rb = real.shape[0]
    for n in range(i0, i1):
        rl = real[(n // H) % Rb]
        mh = mu[n % H]
        for p in range(L):
            o = out[n, p]
            if not rl[p]:
                for d in range(D):
                    o[d] = 0.0
                continue
            xr = x[n, p]
            n2 = 0.0
            for d in range(D):
                n2 += xr[d] * xr[d]
            nrm = math.sqrt(n2)
            inv = 1.0 / (nrm if nrm > eps else eps)
            m = mh[near[n, p]]
            dot = 0.0
            for d in range(D):
                u = xr[d] * inv
                g = 2.0 * coef * (u - m[d])
                o[d] = g
                dot += u * g
            if nrm > eps:
                for d in range(D):
                    o[d] = (o[d] - xr[d] * inv * dot) * inv
            else:
                for d in range(D):
                    o[d] = o[d] * inv
