# ruff: noqa: E702  -- the polynomial's constants read best one group per line
"""A vectorised ``exp`` for the kernelized numba kernels (numba has no vector ``exp`` without Intel's SVML).

:func:`exp_row` evaluates ``exp(row - c)`` in place, and :func:`elu1_row` linear's features
``elu(s x) + 1``, by a polynomial with an exact power-of-two scaling: the argument is reduced by
``n = round(x / ln 2)`` with two constants (Cody-Waite), a Taylor polynomial (degree 6 in float32, 12 in
float64) approximates ``exp`` on ``|r| <= ln2 / 2``, and ``n`` is added to the exponent bits. Relative
error below 2.5e-7 in float32 and 1e-14 in float64 over the range tested
(``tests/test_performer_numba_features.py``); 0 at or below the lowest argument, inf above the highest
(88.7 / 709.7), NaN for NaN.

Whole vectors go through LLVM IR emitted by numba intrinsics (:func:`_exp_at`, :func:`_elu1_at`, on the core's
:func:`attnkit.numba_vexp.exp_vector`: one load,
the arithmetic in registers, one store); what is left after them, and strided rows, one element at a time by the
same IR in :func:`exp_row` (:func:`attnkit.numba_vexp.exp_item`, since session 60) and through numba loops in
:func:`elu1_row` (:func:`_exp_loops`, two passes through an integer scratch). All are the same operations in the
same order, so they agree bit for bit (tested). Measured on the development VM, one thread: linear's features at
L = 8,192 (H = 8, D = 64, queries and keys) took 5.1 ms against 8.5 ms for the loops alone (session 37).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

# the vector exp and its constants live in the core since session 57 (the sparse plugin's tiles use them too);
# constants and HALF are re-exported for this plugin's kernels
from attnkit.numba_vexp import HALF, LANES32, constants, exp_item  # noqa: F401
from attnkit.numba_vexp import HI as _HI
from attnkit.numba_vexp import LN2_HI as _LN2_HI
from attnkit.numba_vexp import LN2_LO as _LN2_LO
from attnkit.numba_vexp import LO as _LO
from attnkit.numba_vexp import LOG2E as _LOG2E
from attnkit.numba_vexp import POLY as _POLY
from attnkit.numba_vexp import broadcast as _broadcast
from attnkit.numba_vexp import exp_vector as _exp_vector
from attnkit.numba_vexp import float_array as _float_array
from attnkit.numba_vexp import splat as _splat
from attnkit.numba_vexp import vector_ptr as _vector_ptr

#: exponent sentinels far outside every float's range: the argument underflowed (0), was NaN, overflowed (inf)
_UNDER, _NAN, _OVER = -(1 << 20), 1 << 20, (1 << 20) + 1


@numba.njit(cache=True, fastmath={"contract", "nsz"})
def _exp_loops(row, c, nbuf, cst, is32):  # pragma: no cover - compiled
    """``row[j] = exp(row[j] - c)`` in place by numba loops (``nbuf``: int32 scratch of ``row``'s length): the
    arithmetic of :func:`_exp_vector`, two passes (the exponent is added through an integer view of the row).
    :func:`exp_row` runs it on what is left after its whole vectors, and on strided rows.

    Compiled apart, without ``reassoc``: reassociation partly folds the two-constant (Cody-Waite)
    reduction ``(x - n·ln2_hi) - n·ln2_lo``, and the float32 relative error grew with ``|x|`` to 4.1e-7
    at x = -80 (2.3e-7 without it; measured against NumPy). Called per row; LLVM keeps the flags of
    these instructions when it inlines them. An elementwise loop vectorises without ``reassoc``."""
    log2e = cst[_LOG2E]; c1 = cst[_LN2_HI]; c2 = cst[_LN2_LO]; half = cst[HALF]; lo = cst[_LO]; hi = cst[_HI]
    n = row.shape[0]
    if is32:
        a6 = cst[_POLY]; a5 = cst[_POLY + 1]; a4 = cst[_POLY + 2]; a3 = cst[_POLY + 3]; a2 = cst[_POLY + 4]
        a1 = cst[_POLY + 5]; a0 = cst[_POLY + 6]
        for j in range(n):
            xj = row[j] - c
            xc = xj if xj > lo else lo
            xc = xc if xc < hi else hi
            nf = np.floor(half + xc * log2e)           # round(x log2 e)
            r = (xc - nf * c1) - nf * c2
            row[j] = (((((a6 * r + a5) * r + a4) * r + a3) * r + a2) * r + a1) * r + a0
            e = np.int32(nf)
            nbuf[j] = e if xj > lo and xj <= hi else (_UNDER if xj <= lo else (_OVER if xj > hi else _NAN))
        ri = row.view(np.int32)
        for j in range(n):
            e = nbuf[j]
            ri[j] = ((ri[j] + (e << 23)) if e > _UNDER and e < _NAN
                     else (0 if e <= _UNDER else (0x7F800000 if e == _OVER else 0x7FC00000)))
    else:
        K = cst.shape[0]
        for j in range(n):
            xj = row[j] - c
            xc = xj if xj > lo else lo
            xc = xc if xc < hi else hi
            nf = np.floor(half + xc * log2e)
            r = (xc - nf * c1) - nf * c2
            p = cst[_POLY]
            for i in range(_POLY + 1, K):
                p = p * r + cst[i]
            row[j] = p
            e = np.int32(nf)
            nbuf[j] = e if xj > lo and xj <= hi else (_UNDER if xj <= lo else (_OVER if xj > hi else _NAN))
        rl = row.view(np.int64)
        for j in range(n):
            e = np.int64(nbuf[j])
            rl[j] = ((rl[j] + (e << 52)) if e > _UNDER and e < _NAN
                     else (0 if e <= _UNDER else (0x7FF0000000000000 if e == _OVER else 0x7FF8000000000000)))


# ---- one pass on whole vectors: the same arithmetic emitted as LLVM IR --------------------------------------
# numba's loops need the two passes above: a float cannot be viewed as an integer inside one loop, so the
# exponent goes through ``nbuf`` and a second pass, and the elu features of ``linear`` needed a third and a
# fourth pass around them. An intrinsic holds one vector (``<8 x float>``, ``<4 x double>``; twice the lanes on
# 512-bit targets, :data:`LANES32`) from its load to its store. The IR (:func:`attnkit.numba_vexp.exp_vector`)
# carries no fast-math flags, so LLVM keeps the two-constant reduction as written.

@intrinsic
def _exp_at(typingctx, row, j, c):  # noqa: ANN001, ANN202
    """``row[j:j+W] = exp(row[j:j+W] - c)`` (``W`` = 8 float32, 4 float64; ``row`` 1-D with unit stride)."""
    if not _float_array(row) or not isinstance(c, (types.Float, types.Integer)):   # cast to row's dtype
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        is32 = signature.args[0].dtype == types.float32
        W = LANES32 if is32 else LANES32 // 2
        ptr = _vector_ptr(context, builder, signature.args[0], args[0], args[1], W)
        ft = context.get_value_type(signature.args[0].dtype)
        x = builder.fsub(builder.load(ptr, align=1), _broadcast(builder, ir.VectorType(ft, W), args[2]))
        builder.store(_exp_vector(builder, x, is32), ptr, align=1)
        return context.get_dummy_value()

    return types.void(row, types.intp, row.dtype), codegen


@intrinsic
def _elu1_at(typingctx, dst, d, src, s, scale):  # noqa: ANN001, ANN202
    """``dst[d:d+W] = elu(scale · src[s:s+W]) + 1``: ``v + 1`` where ``v > 0``, else ``exp(v)`` (NaN stays NaN)."""
    if not (_float_array(dst) and _float_array(src)) or dst.dtype != src.dtype or not isinstance(
            scale, (types.Float, types.Integer)):   # the scale is cast to the arrays' dtype
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        is32 = signature.args[0].dtype == types.float32
        W = LANES32 if is32 else LANES32 // 2
        ft = context.get_value_type(signature.args[0].dtype)
        vt = ir.VectorType(ft, W)
        pd = _vector_ptr(context, builder, signature.args[0], args[0], args[1], W)
        ps = _vector_ptr(context, builder, signature.args[2], args[2], args[3], W)
        v = builder.fmul(builder.load(ps, align=1), _broadcast(builder, vt, args[4]))
        zero = _splat(ft, W, 0.0)
        pos = builder.fcmp_ordered(">", v, zero)
        e = _exp_vector(builder, builder.select(pos, zero, v), is32)   # exp of the rest only: no overflow
        builder.store(builder.select(pos, builder.fadd(v, _splat(ft, W, 1.0)), e), pd, align=1)
        return context.get_dummy_value()

    return types.void(dst, types.intp, src, types.intp, dst.dtype), codegen


@numba.njit(cache=True)
def exp_row(row, c):  # pragma: no cover - compiled
    """``row[j] = exp(row[j] - c)`` in place (``row`` 1-D float32/float64, ``c`` cast to its dtype).

    Whole vectors in one pass (:func:`_exp_at`); the last ``len % W`` elements, and a strided row, one at a time
    by the same IR (:func:`attnkit.numba_vexp.exp_item`), with no call and no slice of the row: the remainder
    through :func:`_exp_loops` on a slice cost every call about 45 ns on rows of 256 float32 even when nothing was
    left (0.47 -> 0.41 ns an element with the row maximum before it, one thread; docs/benchmarks.md, "Session
    60"). Relative error below 2.5e-7 (float32) and 1e-14 (float64) against NumPy; 0 at or below the lowest
    argument (-87 / -708), NaN for NaN."""
    n = row.shape[0]
    it = row.itemsize
    W = LANES32 if it == 4 else LANES32 // 2
    nv = n - n % W if row.strides[0] == it else 0
    for j in range(0, nv, W):
        _exp_at(row, j, c)
    for j in range(nv, n):
        exp_item(row, j, c)


@numba.njit(cache=True)
def elu1_row(dst, src, scale, nbuf, cst, is32):  # pragma: no cover - compiled
    """``dst[j] = elu(scale · src[j]) + 1`` for ``j < len(src)`` (1-D, one float dtype, ``dst`` at least as long;
    ``nbuf``: int32 scratch, any length >= 1): ``v + 1`` where
    ``v = scale · src[j] > 0``, else ``exp(v)`` (:func:`_exp_vector`; 0 at or below the lowest argument, NaN
    stays NaN). Whole vectors in one pass (:func:`_elu1_at`); the rest, and strided rows, by
    :func:`_exp_loops` in pieces of ``len(nbuf)``."""
    n = src.shape[0]
    W = LANES32 if is32 else LANES32 // 2
    it = src.itemsize
    nv = n - n % W if src.strides[0] == it and dst.strides[0] == it else 0
    for j in range(0, nv, W):
        _elu1_at(dst, j, src, j, scale)
    zero = cst[HALF] - cst[HALF]
    nb = nbuf.shape[0]
    for b0 in range(nv, n, nb):      # the rest (or a strided row) in pieces of the scratch's length
        m = min(nb, n - b0)
        t = dst[b0:b0 + m]
        for j in range(m):
            v = src[b0 + j] * scale
            t[j] = zero if v > zero else v
        _exp_loops(t, zero, nbuf[:m], cst, is32)
        for j in range(m):   # t = exp(min(v, 0)) is 1 where v > 0: + max(v, 0) gives v + 1 there (a plain store;
            v = src[b0 + j] * scale      # a conditional one compiles to masked stores, see attnkit.numba_panel)
            t[j] += np.fmax(v, zero)
