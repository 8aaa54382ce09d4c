"""A vector ``exp`` for the plugins' numba kernels, emitted as LLVM IR (numba has no vector ``exp`` without Intel's
SVML): :func:`exp_vector` builds it inside an intrinsic, :func:`exp_sub_at` is one such intrinsic.

Imported only by plugins' numba kernel modules (it imports numba and llvmlite, which ``import attnkit`` never does).

``exp(x)``: the argument is reduced by ``n = round(x / ln 2)`` with two constants (Cody-Waite), a Taylor
polynomial (degree 6 in float32, 12 in float64) approximates ``exp`` on ``|r| <= ln2 / 2``, and ``n`` is added
to the exponent bits. Relative error below 2.5e-7 in float32 and 1e-14 in float64; 0 at or below the lowest
argument (-87 / -708), inf above the highest (88.7 / 709.7), NaN for NaN. The IR carries no fast-math flags,
so LLVM keeps the two-constant reduction as written. Vectors are :data:`LANES32` float32 lanes wide (float64:
half): the register panels' width (:data:`attnkit.numba_panel.LANES32`, re-exported here).

Written for the kernelized plugin in session 37 (``attnkit_kernelized._vexp``, which builds its row functions
on it) and moved here in session 57, when the sparse plugin's tiles took it too (:func:`exp_sub_at`: 0.5 ns
per element on rows of 64 against 1.45 for the engine's two-pass numba loops, one thread, Intel Emerald
Rapids VM).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .numba_panel import LANES32

__all__ = ["LANES32", "constants", "exp_vector", "exp_sub_at", "exp_sub_item", "exp_item", "splat", "broadcast",
           "vector_ptr", "float_array"]


LOG2E, LN2_HI, LN2_LO, HALF, LO, HI, POLY = range(7)


def constants(dtype: np.dtype) -> np.ndarray:
    """Typed constants (a literal would be float64 in numba): ``[log2(e), ln2 hi, ln2 lo, 0.5, lowest argument,
    highest argument, Taylor coefficients of exp, highest degree first (6 for float32, 12 for float64)]``.
    Above the highest argument (88.7 / 709.7, just below ``log`` of the largest float) the result is inf."""
    f32 = np.dtype(dtype) == np.float32
    ln2 = (0.693359375, -2.12194440e-4) if f32 else (0.693145751953125, 1.42860682030941723212e-6)
    deg = 6 if f32 else 12
    head = [1.4426950408889634, ln2[0], ln2[1], 0.5, -87.0 if f32 else -708.0, 88.7 if f32 else 709.7]
    return np.array(head + [1.0 / math.factorial(i) for i in range(deg, -1, -1)], dtype=dtype)


def splat(ft: ir.Type, W: int, v: float) -> ir.Constant:
    """A ``W``-lane vector constant of ``v``."""
    return ir.Constant(ir.VectorType(ft, W), [ir.Constant(ft, v)] * W)


def exp_vector(builder: ir.IRBuilder, x: ir.Value, is32: bool) -> ir.Value:
    """IR for ``exp(x)`` of a vector ``x`` (any lane count): the arithmetic of the kernelized plugin's
    ``_vexp._exp_loops``, which agree with it bit for bit (clamp to the argument range, the
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
    k = functools.partial(splat, ft, W)
    lo = k(cst[LO])
    above = builder.fcmp_ordered(">", x, lo)              # false for NaN
    hi = k(cst[HI])
    over = builder.fcmp_ordered(">", x, hi)
    xc = builder.select(over, hi, builder.select(above, x, lo))
    nf = builder.call(floor, [builder.call(fma, [xc, k(cst[LOG2E]), k(cst[HALF])])])
    r = builder.call(fma, [nf, k(-cst[LN2_HI]), xc])
    r = builder.call(fma, [nf, k(-cst[LN2_LO]), r])
    p = k(cst[POLY])
    for a in cst[POLY + 1:]:
        p = builder.call(fma, [p, r, k(a)])
    shift = ir.Constant(vi, [ir.Constant(it, 23 if is32 else 52)] * W)
    bits = builder.add(builder.bitcast(p, vi), builder.shl(builder.fptosi(nf, vi), shift))
    val = builder.bitcast(bits, vt)
    below = builder.fcmp_ordered("<=", x, lo)
    out = builder.select(above, val, builder.select(below, k(0.0), k(float("nan"))))
    return builder.select(over, k(float("inf")), out)


def vector_ptr(context, builder, aty, a, off, W):  # noqa: ANN001, ANN202
    """A pointer to ``W`` lanes of the array ``a`` (numba type ``aty``) from element offset ``off``."""
    ft = context.get_value_type(aty.dtype)
    data = context.make_array(aty)(context, builder, a).data
    return builder.bitcast(builder.gep(data, [off]), ir.VectorType(ft, W).as_pointer())


def broadcast(builder: ir.IRBuilder, vt: ir.VectorType, s: ir.Value) -> ir.Value:
    """The scalar ``s`` in every lane of a ``vt`` vector."""
    undef = ir.Constant(vt, ir.Undefined)
    first = builder.insert_element(undef, s, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(first, undef, ir.Constant(ir.VectorType(ir.IntType(32), vt.count), [0] * vt.count))


def float_array(a) -> bool:  # noqa: ANN001
    """Whether the numba type ``a`` is an array of float32 or float64."""
    return isinstance(a, types.Array) and a.dtype in (types.float32, types.float64)


@intrinsic
def exp_sub_at(typingctx, row, j, scl, sub):  # noqa: ANN001, ANN202
    """``row[j:j+W] = exp(scl · row[j:j+W] − sub[j:j+W])`` in place (``W`` = :data:`LANES32` float32 lanes, half
    for float64; ``row`` and ``sub`` 1-D of one float dtype with unit stride, ``scl`` cast to it)."""
    if not (float_array(row) and float_array(sub)) or row.dtype != sub.dtype or not isinstance(
            scl, (types.Float, types.Integer)):
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        is32 = signature.args[0].dtype == types.float32
        W = LANES32 if is32 else LANES32 // 2
        ft = context.get_value_type(signature.args[0].dtype)
        p = vector_ptr(context, builder, signature.args[0], args[0], args[1], W)
        ps = vector_ptr(context, builder, signature.args[3], args[3], args[1], W)
        x = builder.fsub(builder.fmul(builder.load(p, align=1), broadcast(builder, ir.VectorType(ft, W), args[2])),
                         builder.load(ps, align=1))
        builder.store(exp_vector(builder, x, is32), p, align=1)
        return context.get_dummy_value()

    return types.void(row, types.intp, row.dtype, sub), codegen


# ---- one element: what is left after a row's whole vectors, and strided rows ----------------------------------
# The same IR on a one-lane vector, so every element of a row gets the same bits, however the row is cut. A row
# function whose remainder went through a call (numba loops over slices of the row) paid for it on every row even
# when nothing was left: inlined into a tile loop, the sparse engine's ``_exp_sub`` took 6.2-8.0 us on a 128 x 64
# float32 tile against 1.9 us without the call (the same vector work; docs/benchmarks.md, "Session 60").

def _scalar_exp(builder: ir.IRBuilder, x: ir.Value, is32: bool) -> ir.Value:
    """:func:`exp_vector` of the scalar ``x`` (through a one-lane vector: the same arithmetic as every lane)."""
    i0 = ir.Constant(ir.IntType(32), 0)
    xv = builder.insert_element(ir.Constant(ir.VectorType(x.type, 1), ir.Undefined), x, i0)
    return builder.extract_element(exp_vector(builder, xv, is32), i0)


def _item_ptr(context, builder, aty, a, j):  # noqa: ANN001, ANN202
    """A pointer to element ``j`` of the 1-D array ``a`` (numba type ``aty``, any stride; no bounds check)."""
    ary = context.make_array(aty)(context, builder, a)
    return cgutils.get_item_pointer(context, builder, aty, ary, [j], wraparound=False)


@intrinsic
def exp_sub_item(typingctx, row, j, scl, sub):  # noqa: ANN001, ANN202
    """``row[j] = exp(scl · row[j] − sub[j])`` for one element (``row`` and ``sub`` 1-D of one float dtype, any
    strides; ``scl`` cast to it): the lane arithmetic of :func:`exp_sub_at`, bit for bit."""
    if not (float_array(row) and float_array(sub)) or row.dtype != sub.dtype or row.ndim != 1 or sub.ndim != 1 \
            or not isinstance(scl, (types.Float, types.Integer)):
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        is32 = signature.args[0].dtype == types.float32
        p = _item_ptr(context, builder, signature.args[0], args[0], args[1])
        ps = _item_ptr(context, builder, signature.args[3], args[3], args[1])
        x = builder.fsub(builder.fmul(builder.load(p), args[2]), builder.load(ps))
        builder.store(_scalar_exp(builder, x, is32), p)
        return context.get_dummy_value()

    return types.void(row, types.intp, row.dtype, sub), codegen


@intrinsic
def exp_item(typingctx, row, j, c):  # noqa: ANN001, ANN202
    """``row[j] = exp(row[j] − c)`` for one element (``row`` 1-D float32/float64, any stride; ``c`` cast to its
    dtype): the arithmetic of :func:`exp_vector` on ``row[j] − c``."""
    if not float_array(row) or row.ndim != 1 or not isinstance(c, (types.Float, types.Integer)):
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        is32 = signature.args[0].dtype == types.float32
        p = _item_ptr(context, builder, signature.args[0], args[0], args[1])
        builder.store(_scalar_exp(builder, builder.fsub(builder.load(p), args[2]), is32), p)
        return context.get_dummy_value()

    return types.void(row, types.intp, row.dtype), codegen
