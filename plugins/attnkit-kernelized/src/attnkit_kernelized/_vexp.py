# ruff: noqa: E702  -- the polynomial's constants read best one group per line
"""A vectorised ``exp`` for the kernelized numba kernels (numba has no vector ``exp`` without Intel's SVML).

:func:`exp_row` evaluates ``exp(row - c)`` in place, and :func:`elu1_row` linear's features
``elu(s x) + 1``, by a polynomial with an exact power-of-two scaling: the argument is reduced by
``n = round(x / ln 2)`` with two constants (Cody-Waite), a Taylor polynomial (degree 6 in float32, 12 in
float64) approximates ``exp`` on ``|r| <= ln2 / 2``, and ``n`` is added to the exponent bits. Relative
error below 2.5e-7 in float32 and 1e-14 in float64 over the range tested
(``tests/test_performer_numba_features.py``); 0 at or below the lowest argument, inf above the highest
(88.7 / 709.7), NaN for NaN.

Whole vectors go through LLVM IR emitted by numba intrinsics (:func:`_exp_at`, :func:`_elu1_at`: one load,
the arithmetic in registers, one store); what is left after them, and strided rows, through numba loops
(:func:`_exp_loops`, two passes through an integer scratch). Both are the same operations in the same order,
so they agree bit for bit (tested). Measured on the development VM, one thread: linear's features at
L = 8,192 (H = 8, D = 64, queries and keys) took 5.1 ms against 8.5 ms for the loops alone (session 37).
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from attnkit.numba_panel import PANEL_BITS

#: float32 lanes of the intrinsics' vectors (float64: half): 16 where the register panels run on 512-bit vectors
#: (:data:`attnkit.numba_panel.PANEL_BITS`: numba's target has AVX-512), else 8
LANES32 = PANEL_BITS // 32

_LOG2E, _LN2_HI, _LN2_LO, HALF, _LO, _HI, _POLY = range(7)
#: exponent sentinels far outside every float's range: the argument underflowed (0), was NaN, overflowed (inf)
_UNDER, _NAN, _OVER = -(1 << 20), 1 << 20, (1 << 20) + 1


def constants(dtype: np.dtype) -> np.ndarray:
    """Typed constants (a literal would be float64 in numba): ``[log2(e), ln2 hi, ln2 lo, 0.5, lowest argument,
    highest argument, Taylor coefficients of exp, highest degree first (6 for float32, 12 for float64)]``.
    Above the highest argument (88.7 / 709.7, just below ``log`` of the largest float) the result is inf."""
    f32 = np.dtype(dtype) == np.float32
    ln2 = (0.693359375, -2.12194440e-4) if f32 else (0.693145751953125, 1.42860682030941723212e-6)
    deg = 6 if f32 else 12
    head = [1.4426950408889634, ln2[0], ln2[1], 0.5, -87.0 if f32 else -708.0, 88.7 if f32 else 709.7]
    return np.array(head + [1.0 / math.factorial(i) for i in range(deg, -1, -1)], dtype=dtype)


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
# fourth pass around them. An intrinsic holds one vector (``<8 x float>``, ``<4 x double>``; twice the lanes on 512-bit
# targets, :data:`LANES32`) from its load to
# its store. The IR carries no fast-math flags, so LLVM keeps the two-constant reduction as written.

def _splat(ft: ir.Type, W: int, v: float) -> ir.Constant:
    return ir.Constant(ir.VectorType(ft, W), [ir.Constant(ft, v)] * W)


def _exp_vector(builder: ir.IRBuilder, x: ir.Value, is32: bool) -> ir.Value:
    """IR for ``exp(x)`` of a vector ``x``: :func:`_exp_loops`' arithmetic (clamp to the argument range, the
    Cody-Waite reduction and the Taylor polynomial as fused multiply-adds, the exponent added to the bits),
    0 at or below the lowest argument, inf above the highest, NaN for NaN. Constants from :func:`constants`
    (the same rounding)."""
    dt = np.float32 if is32 else np.float64
    cst = [float(v) for v in constants(np.dtype(dt))]
    W = x.type.count
    ft = ir.FloatType() if is32 else ir.DoubleType()
    it = ir.IntType(32 if is32 else 64)
    vt, vi = ir.VectorType(ft, W), ir.VectorType(it, W)
    mod = builder.module
    fma = cgutils.get_or_insert_function(mod, ir.FunctionType(vt, [vt, vt, vt]), f"llvm.fma.v{W}f{32 if is32 else 64}")
    floor = cgutils.get_or_insert_function(mod, ir.FunctionType(vt, [vt]), f"llvm.floor.v{W}f{32 if is32 else 64}")
    k = functools.partial(_splat, ft, W)
    lo = k(cst[_LO])
    above = builder.fcmp_ordered(">", x, lo)              # false for NaN
    hi = k(cst[_HI])
    over = builder.fcmp_ordered(">", x, hi)
    xc = builder.select(over, hi, builder.select(above, x, lo))
    nf = builder.call(floor, [builder.call(fma, [xc, k(cst[_LOG2E]), k(cst[HALF])])])
    r = builder.call(fma, [nf, k(-cst[_LN2_HI]), xc])
    r = builder.call(fma, [nf, k(-cst[_LN2_LO]), r])
    p = k(cst[_POLY])
    for a in cst[_POLY + 1:]:
        p = builder.call(fma, [p, r, k(a)])
    shift = ir.Constant(vi, [ir.Constant(it, 23 if is32 else 52)] * W)
    bits = builder.add(builder.bitcast(p, vi), builder.shl(builder.fptosi(nf, vi), shift))
    val = builder.bitcast(bits, vt)
    below = builder.fcmp_ordered("<=", x, lo)
    out = builder.select(above, val, builder.select(below, k(0.0), k(float("nan"))))
    return builder.select(over, k(float("inf")), out)


def _vector_ptr(context, builder, aty, a, off, W):  # noqa: ANN001, ANN202
    ft = context.get_value_type(aty.dtype)
    data = context.make_array(aty)(context, builder, a).data
    return builder.bitcast(builder.gep(data, [off]), ir.VectorType(ft, W).as_pointer())


def _broadcast(builder: ir.IRBuilder, vt: ir.VectorType, s: ir.Value) -> ir.Value:
    """The scalar ``s`` in every lane of a ``vt`` vector."""
    undef = ir.Constant(vt, ir.Undefined)
    first = builder.insert_element(undef, s, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(first, undef, ir.Constant(ir.VectorType(ir.IntType(32), vt.count), [0] * vt.count))


def _float_array(a) -> bool:  # noqa: ANN001
    return isinstance(a, types.Array) and a.dtype in (types.float32, types.float64)


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
def exp_row(row, c, nbuf, cst, is32):  # pragma: no cover - compiled
    """``row[j] = exp(row[j] - c)`` in place (``row`` 1-D float32/float64; ``nbuf``: int32 scratch of ``row``'s
    length; ``cst``: :func:`constants` of its dtype; ``is32``: float32).

    Whole vectors in one pass (:func:`_exp_at`); the last ``len % W`` elements, and a strided row, by
    :func:`_exp_loops` (the same arithmetic). Relative error below 2.5e-7 (float32) and 1e-14 (float64)
    against NumPy; 0 at or below the lowest argument (-87 / -708), NaN for NaN."""
    n = row.shape[0]
    W = LANES32 if is32 else LANES32 // 2
    nv = n - n % W if row.strides[0] == row.itemsize else 0
    for j in range(0, nv, W):
        _exp_at(row, j, c)
    if nv < n:
        _exp_loops(row[nv:], c, nbuf[:n - nv], cst, is32)


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
