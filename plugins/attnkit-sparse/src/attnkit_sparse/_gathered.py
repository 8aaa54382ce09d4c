# ruff: noqa: E702, E741  -- tile code reads best a tile row per line; l: the running sum
"""Tile steps shared by the fused CPU paths of ``lsh`` and ``routing``: attention over rows gathered by position.

Both paths gather a group of queries (an lsh chunk of a round, a routing cluster) and its keys into small
tiles, mask them by their own rule, and then run the same steps, which live here as numba helpers (the per-row
and per-position ones inlined; the tile-level :func:`tile_softmax_pv`, :func:`tile_backward` and
:func:`tile_backward_saved` plain calls, each built once per signature: inlined, numba copied their IR into every
caller, and routing's first training step took 11.7-13.1 s per dtype against 7.3-7.5; docs/benchmarks.md,
"Session 59"):

- :func:`gather_kv`, :func:`gather_query`, :func:`gather_query_grad`: a position's rows copied into the tiles
  (queries scaled), :func:`transpose_columns`: the query (and output-gradient) tiles transposed in registers;
  :func:`zero_kv`: a tile row of key and value gradients cleared;
- :func:`tile_scores`: key-major scores ``Sᵀ = K (scale·Q)ᵀ`` ``(kn, width)``;
- :func:`tile_softmax_pv`: one softmax per query column (row max, ``exp`` in place, sums) and ``O = P V``;
- :func:`merge_row`, :func:`normalise_row`: a group's rows merged at their position into the running
  ``(m, l, out)`` by log-sum-exp, and the position's output normalised (``lse = +inf`` and 0 where no group
  gave it a key);
- :func:`tile_backward`: from the masked scores, ``P = exp(S − lse)``, ``dS = P (dP − Δ)``, ``dV += Pᵀ dO``,
  ``dK += dSᵀ (scale·Q)`` and ``dQ = dS K`` (the caller scales and scatters it); :func:`tile_backward_saved`:
  the same from the forward's saved ``exp(S − shift)`` tile (no scores product, no exponentials).

``width`` is the tile's query capacity (columns); ``qn ≤ width`` of them are used, the rest are zero.
The products run on register panels (:mod:`attnkit.numba_panel`: the output block held in vector registers
across the sum), the exponentials on the engine's vectorised ``exp``.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from attnkit.numba_panel import axpy_at, set_at, set_t, transpose

from .engine._numba_kernels import FASTMATH, _exp_sub


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def gather_kv(Kb, Vb, j, kr, vr):  # pragma: no cover - compiled
    """Row ``j`` of the key and value tiles from the rows ``kr``, ``vr`` (a routed or sorted position's)."""
    kd = Kb[j]
    for d in range(kd.shape[0]):
        kd[d] = kr[d]
    vd = Vb[j]
    for e in range(vd.shape[0]):
        vd[e] = vr[e]


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def zero_kv(dKb, dVb, j, zero):  # pragma: no cover - compiled
    """Row ``j`` of the key and value gradient tiles set to 0 (a freshly gathered key's)."""
    gd = dKb[j]
    for d in range(gd.shape[0]):
        gd[d] = zero
    hd = dVb[j]
    for e in range(hd.shape[0]):
        hd[e] = zero


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def gather_query(Qb, i, qr, sc):  # pragma: no cover - compiled
    """Row ``i`` of the query tile: ``scale·q`` from the row ``qr`` (a routed or sorted position's)."""
    qb = Qb[i]
    for d in range(qb.shape[0]):
        qb[d] = qr[d] * sc


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def gather_query_grad(Qb, Gb, i, qr, gr, sc):  # pragma: no cover - compiled
    """Query ``i`` of a backward tile: ``scale·q`` as row ``i`` of ``Qb`` and the output gradient ``gr`` as row
    ``i`` of ``Gb`` (:func:`transpose_columns` then makes their transposed copies)."""
    gather_query(Qb, i, qr, sc)
    gb = Gb[i]
    for e in range(gb.shape[0]):
        gb[e] = gr[e]


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def transpose_columns(XT, Xb, qn, zero):  # pragma: no cover - compiled
    """``XT[:, :qn] = Xb[:qn]ᵀ`` through register tiles (:func:`attnkit.numba_panel.transpose`: the gathered rows
    written as columns one element at a time, as before session 43, took 2-3x as long: docs/benchmarks.md,
    "Session 42", the transpose rows), and the unused columns ``qn <=`` set to 0."""
    transpose(XT, Xb, qn, Xb.shape[1])
    width = XT.shape[1]
    for d in range(XT.shape[0]):
        xr = XT[d]
        for i in range(qn, width):
            xr[i] = zero


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def tile_scores(ST, kn, width, Kb, QT, D):  # pragma: no cover - compiled
    """``ST[:kn] = Kb[:kn] QT`` ``(kn, width)``: the key-major scores of the gathered keys and queries (written
    over, not zeroed first: :func:`attnkit.numba_panel.set_at`)."""
    set_at(ST, kn, Kb, 0, QT[:, :width], 0, D)


@numba.njit(cache=True, fastmath=FASTMATH)
def tile_softmax_pv(ST, kn, width, qn, Vb, O, mx, shift, csum, zero, one, ninf):  # pragma: no cover - compiled
    """Masked scores ``ST[:kn]`` to unnormalised probabilities in place, per query column ``i``: ``mx[i]`` the
    maximum (``-inf`` for an all-masked column, whose probabilities are then 0), ``csum[i]`` the sum, and
    ``O[:qn] = P V`` over the ``kn`` keys of ``Vb``."""
    for i in range(width):
        mx[i] = ninf
    for j in range(kn):
        row = ST[j]
        for i in range(width):
            x = row[i]
            mx[i] = np.fmax(mx[i], x)      # fmax, not a select: see attnkit.numba_panel (masked stores)
    for i in range(width):    # an all-masked column keeps 0 as its shift (its exps are all 0)
        shift[i] = mx[i] if mx[i] > ninf else zero
        csum[i] = zero
    for j in range(kn):
        row = ST[j]
        _exp_sub(row, one, shift)
        for i in range(width):
            csum[i] += row[i]
    set_t(O, 0, qn, ST, Vb, 0, 0, kn)


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def merge_row(on, mn, ln, p, Oi, mi, li, assign, s1, zero):  # pragma: no cover - compiled
    """A group's row for position ``p`` (output ``Oi``, maximum ``mi``, sum ``li``) merged into the running
    ``on[p]``, ``mn[p]``, ``ln[p]``; ``assign``: the position's first group, whose row replaces what is there."""
    oi = on[p]
    E = oi.shape[0]
    if assign:
        for e in range(E):
            oi[e] = Oi[e]
        mn[p] = mi
        ln[p] = li
    elif li > zero:
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


@numba.njit(cache=True, fastmath=FASTMATH, inline="always")
def normalise_row(on, mn, ln, lse_n, p, s1, zero, one, ninf):  # pragma: no cover - compiled
    """Position ``p``'s merged output divided by its sum and ``lse_n[p] = m + log l``; with no key in any
    group, output 0 and ``lse = +inf`` (so a backward's ``exp(S − lse)`` is 0 there)."""
    oi = on[p]
    E = oi.shape[0]
    lp = ln[p]
    if lp > zero:
        s1[1] = one / lp
        rr = s1[1]
        for e in range(E):
            oi[e] *= rr
        lse_n[p] = mn[p] + math.log(lp)
    else:
        for e in range(E):
            oi[e] = zero
        lse_n[p] = -ninf


@numba.njit(cache=True, fastmath=FASTMATH)
def tile_backward(ST, DT, kn, width, qn, Kb, Vb, GT, Gb, Qb, lrow, drow, dKb, dVb, dQb,
                  zero, one):  # pragma: no cover - compiled
    """The gradient products of one tile from its masked scores ``ST[:kn]`` (overwritten by ``P``):
    ``DT = V dOᵀ`` then ``dS = P (dP − Δ)`` in ``DT``, ``dVb[:kn] += Pᵀ dO``, ``dKb[:kn] += dSᵀ (scale·Q)`` and
    ``dQb[:qn] = dS K`` (unscaled). ``lrow``, ``drow``: each query column's ``lse`` and ``Δ`` (``+inf`` and 0 on
    the unused columns); ``GT``/``Gb``, ``Qb``: ``dO`` transposed/row-major and the scaled queries."""
    tile_scores(DT, kn, width, Vb, GT, Vb.shape[1])     # dPᵀ = V dOᵀ, key-major
    for j in range(kn):
        row = ST[j]; drw = DT[j]
        _exp_sub(row, one, lrow)     # P = exp(S − lse)
        for i in range(width):
            drw[i] = row[i] * (drw[i] - drow[i])                  # dS = P (dP − Δ)
    _grad_products(ST, DT, kn, qn, Kb, Gb, Qb, dKb, dVb, dQb)


@numba.njit(cache=True, fastmath=FASTMATH)
def tile_backward_saved(PT, fac, ST, DT, kn, width, qn, Kb, Vb, GT, Gb, Qb, lrow, drow, dKb, dVb, dQb,
                        zero):  # pragma: no cover - compiled
    """:func:`tile_backward` from the forward's saved tile instead of the scores: ``PT[:kn]`` holds
    ``exp(S − shift)`` (0 where masked) and ``PT[-1]`` each column's ``shift``, so ``P = PT·exp(shift − lse)``
    (into ``ST``; ``fac``: scratch of ``width``). No scores product and no exponential per element."""
    last = PT.shape[0] - 1
    for i in range(width):
        fac[i] = math.exp(PT[last, i] - lrow[i])     # 0 on the unused columns (lse = +inf)
    for j in range(kn):     # P first, dS in a loop of its own: one loop writing both ran 10% slower
        src = PT[j]; row = ST[j]
        for i in range(width):
            row[i] = src[i] * fac[i]
    tile_scores(DT, kn, width, Vb, GT, Vb.shape[1])     # dPᵀ = V dOᵀ, key-major
    for j in range(kn):
        row = ST[j]; drw = DT[j]
        for i in range(width):
            drw[i] = row[i] * (drw[i] - drow[i])                  # dS = P (dP − Δ)
    _grad_products(ST, DT, kn, qn, Kb, Gb, Qb, dKb, dVb, dQb)


@numba.njit(cache=True, fastmath=FASTMATH)
def _grad_products(ST, DT, kn, qn, Kb, Gb, Qb, dKb, dVb, dQb):  # pragma: no cover - compiled
    """From ``P`` (``ST``) and ``dS`` (``DT``), key-major: ``dVb[:kn] += Pᵀ dO``, ``dKb[:kn] += dSᵀ (scale·Q)``,
    ``dQb[:qn] = dS K`` (unscaled)."""
    axpy_at(dVb, kn, ST, 0, Gb, 0, qn)                 # dV += Pᵀ dO
    axpy_at(dKb, kn, DT, 0, Qb, 0, qn)                 # dK += dSᵀ (scale·Q)
    set_t(dQb, 0, qn, DT, Kb, 0, 0, kn)           # dQ = dS K
