# ruff: noqa: E702  -- the polynomial's constants read best one group per line
"""A vectorised ``exp`` for the kernelized numba kernels (numba has no vector ``exp`` without Intel's SVML).

:func:`exp_row` evaluates ``exp(row - c)`` in place by a polynomial with an exact
power-of-two scaling through an integer view, in loops LLVM vectorises: the
argument is reduced by ``n = round(x / ln 2)`` with two constants (Cody-Waite),
a Taylor polynomial (degree 6 in float32, 12 in float64) approximates
``exp`` on ``|r| <= ln2 / 2``, and ``n`` is added to the exponent bits. Relative
error below 2.5e-7 in float32 and 1e-14 in float64 over the range tested
(``tests/test_performer_numba_features.py``); 0 below the underflow bound, NaN
for NaN. Arguments above ~88 (float32) or ~709 (float64) overflow the exponent
field: callers keep their arguments below (the performer's bounded path and
``elu(x) + 1`` do).
"""

from __future__ import annotations

import math

import numba
import numpy as np

_LOG2E, _LN2_HI, _LN2_LO, HALF, _LO, _POLY = range(6)
#: exponent sentinels far outside every float's range: the argument underflowed (0) or was NaN
_UNDER, _NAN = -(1 << 20), 1 << 20


def constants(dtype: np.dtype) -> np.ndarray:
    """Typed constants (a literal would be float64 in numba): ``[log2(e), ln2 hi, ln2 lo, 0.5, lowest argument,
    Taylor coefficients of exp, highest degree first (6 for float32, 12 for float64)]``."""
    f32 = np.dtype(dtype) == np.float32
    ln2 = (0.693359375, -2.12194440e-4) if f32 else (0.693145751953125, 1.42860682030941723212e-6)
    deg = 6 if f32 else 12
    head = [1.4426950408889634, ln2[0], ln2[1], 0.5, -87.0 if f32 else -708.0]
    return np.array(head + [1.0 / math.factorial(i) for i in range(deg, -1, -1)], dtype=dtype)


@numba.njit(cache=True, fastmath={"contract", "nsz"})
def exp_row(row, c, nbuf, cst, is32):  # pragma: no cover - compiled
    """``row[j] = exp(row[j] - c)`` in place (``nbuf``: int32 scratch of ``row``'s length).

    Compiled apart, without ``reassoc``: reassociation partly folds the two-constant (Cody-Waite)
    reduction ``(x - n·ln2_hi) - n·ln2_lo``, and the float32 relative error grew with ``|x|`` to 4.1e-7
    at x = -80 (2.3e-7 without it; measured against NumPy). Called per row; LLVM keeps the flags of
    these instructions when it inlines them. An elementwise loop vectorises without ``reassoc``."""
    log2e = cst[_LOG2E]; c1 = cst[_LN2_HI]; c2 = cst[_LN2_LO]; half = cst[HALF]; lo = cst[_LO]
    n = row.shape[0]
    if is32:
        a6 = cst[_POLY]; a5 = cst[_POLY + 1]; a4 = cst[_POLY + 2]; a3 = cst[_POLY + 3]; a2 = cst[_POLY + 4]
        a1 = cst[_POLY + 5]; a0 = cst[_POLY + 6]
        for j in range(n):
            xj = row[j] - c
            xc = xj if xj > lo else lo
            nf = np.floor(half + xc * log2e)           # round(x log2 e)
            r = (xc - nf * c1) - nf * c2
            row[j] = (((((a6 * r + a5) * r + a4) * r + a3) * r + a2) * r + a1) * r + a0
            e = np.int32(nf)
            nbuf[j] = e if xj > lo else (_UNDER if xj <= lo else _NAN)   # below the bound: 0; NaN: NaN
        ri = row.view(np.int32)
        for j in range(n):
            e = nbuf[j]
            ri[j] = (ri[j] + (e << 23)) if e > _UNDER and e < _NAN else (0 if e <= _UNDER else 0x7FC00000)
    else:
        K = cst.shape[0]
        for j in range(n):
            xj = row[j] - c
            xc = xj if xj > lo else lo
            nf = np.floor(half + xc * log2e)
            r = (xc - nf * c1) - nf * c2
            p = cst[_POLY]
            for i in range(_POLY + 1, K):
                p = p * r + cst[i]
            row[j] = p
            e = np.int32(nf)
            nbuf[j] = e if xj > lo else (_UNDER if xj <= lo else _NAN)
        rl = row.view(np.int64)
        for j in range(n):
            e = np.int64(nbuf[j])
            rl[j] = (rl[j] + (e << 52)) if e > _UNDER and e < _NAN else (0 if e <= _UNDER else 0x7FF8000000000000)
