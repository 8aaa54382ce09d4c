"""Vector reductions for the plugins' numba kernels: the largest and the smallest entry of a row, NaN ignored.

Imported only by plugins' numba kernel modules (it imports numba and llvmlite, which ``import attnkit`` never does).

A maximum written as a numba loop, ``m = x if x > m else m`` or ``m = np.fmax(m, x)``, is not vectorised: LLVM
reorders a floating-point max reduction only under ``nnan``, which the kernels do not assume (a padded row may
hold NaN). Measured per float32 element on rows of 256 (one thread, AMD EPYC Zen 3 VM, session 58;
``benchmarks/bench_vreduce.py``): the select 0.30 ns, ``np.fmax`` 1.0 ns, 16 running lanes in an array updated by
``np.fmax`` (the performer's fused forward before) 0.77 ns, :func:`row_max` 0.07 ns (0.09-0.13 in later runs, the
others moving alike); ``lsh``'s argmax scan of a row of 128 1.11 ns, :func:`row_max` + :func:`row_min` +
:func:`first_index` 0.32 ns. Here the row is read in vectors of
:data:`LANES32` float32 lanes (float64: half) into four running vectors by ``llvm.maxnum`` / ``llvm.minnum``, then
single vectors, then a scalar tail; ``maxnum`` returns the other operand when one is NaN, as ``np.fmax`` does, so
the result is the largest non-NaN entry, and NaN only when every entry is NaN.

:func:`column_max_min` reduces down the columns of a block instead, a vector of columns at a time: each lane is
a column, so nothing is folded across lanes. ``lsh``'s hash (``argmax [p; -p]`` of every row of a block of
rotations) computes its block transposed and reads its four results per row from it: the hash at 16K (4 rounds
of 128 buckets a side, one thread) took 13.3 ms a head with ``row_max``, ``row_min`` and ``first_index`` on each
row and 9.1 ms so (session 61, docs/benchmarks.md).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .numba_panel import LANES32
from .numba_vexp import broadcast, float_array

__all__ = ["row_max", "row_min", "first_index", "column_max_min"]

_I64 = ir.IntType(64)
_UNROLL = 4


def _loop(builder: ir.IRBuilder, start: ir.Value, stop: ir.Value, step: int, inits: list, body) -> tuple:  # noqa: ANN001
    """IR of ``for j in range(start, stop, step)`` carrying the values ``inits`` (any types):
    ``state = body(j, state)`` each pass; returns the loop counter after the loop and the state there."""
    pre = builder.block
    head = builder.append_basic_block("vr.head")
    blk = builder.append_basic_block("vr.body")
    done = builder.append_basic_block("vr.done")
    builder.branch(head)
    builder.position_at_end(head)
    j = builder.phi(_I64)
    j.add_incoming(start, pre)
    phis = []
    for a in inits:
        ph = builder.phi(a.type)
        ph.add_incoming(a, pre)
        phis.append(ph)
    builder.cbranch(builder.icmp_signed("<", j, stop), blk, done)
    builder.position_at_end(blk)
    new = body(j, phis)
    j.add_incoming(builder.add(j, ir.Constant(_I64, step)), builder.block)
    for ph, v in zip(phis, new):
        ph.add_incoming(v, builder.block)
    builder.branch(head)
    builder.position_at_end(done)
    return j, phis


def _vector_loop(builder: ir.IRBuilder, data: ir.Value, start: ir.Value, stop: ir.Value, step: int, acc: list,
                 combine, vt: ir.VectorType) -> tuple[ir.Value, list]:  # noqa: ANN001
    """IR of ``for j in range(start, stop, step)``: ``acc[u] = combine(acc[u], row[j + u·W : j + (u+1)·W])``;
    returns the loop counter after the loop and the accumulators there."""
    W = vt.count

    def body(j, phis):  # noqa: ANN001, ANN202
        return [combine(ph, builder.load(builder.bitcast(builder.gep(data, [builder.add(j, ir.Constant(_I64, u * W))]),
                                                         vt.as_pointer()), align=1))
                for u, ph in enumerate(phis)]

    return _loop(builder, start, stop, step, acc, body)


def _row_ir(context, builder, signature, args):  # noqa: ANN001, ANN202
    """What both kinds of intrinsic read from ``(row, n, value)``: the float type, the vector type of
    :data:`LANES32` lanes (float64: half), the row's data pointer, ``n`` as an ``intp`` and ``value`` in the
    row's dtype."""
    aty = signature.args[0]
    W = LANES32 if aty.dtype == types.float32 else LANES32 // 2
    ft = context.get_value_type(aty.dtype)
    data = context.make_array(aty)(context, builder, args[0]).data
    n = context.cast(builder, args[1], signature.args[1], types.intp)
    value = context.cast(builder, args[2], signature.args[2], aty.dtype)
    return ft, ir.VectorType(ft, W), data, n, value


def _make_head(kind: str):  # noqa: ANN202 - returns a numba intrinsic
    """An intrinsic ``head(row, n, init)``: the ``kind`` (``"max"`` or ``"min"``, NaN ignored) of ``init`` and
    ``row[:n - n % W]`` (``W`` lanes of :data:`LANES32`; ``row`` 1-D with unit stride)."""

    @intrinsic
    def head(typingctx, row, n, init):  # noqa: ANN001, ANN202
        if not float_array(row) or not isinstance(n, types.Integer):
            return None

        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            ft, vt, data, nv, iv = _row_ir(context, builder, signature, args)
            W = vt.count
            sfx = f"v{W}f{32 if isinstance(ft, ir.FloatType) else 64}"
            op = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt, vt]), f"llvm.{kind}num.{sfx}")
            fold = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ft, [vt]),
                                                  f"llvm.vector.reduce.f{kind}.{sfx}")
            init = broadcast(builder, vt, iv)

            def combine(a, b):  # noqa: ANN001, ANN202
                return builder.call(op, [a, b])

            big = W * _UNROLL
            stop4 = builder.mul(builder.sdiv(nv, ir.Constant(_I64, big)), ir.Constant(_I64, big))
            j, acc = _vector_loop(builder, data, ir.Constant(_I64, 0), stop4, big, [init] * _UNROLL, combine, vt)
            a = acc[0]
            for b in acc[1:]:
                a = combine(a, b)
            stop1 = builder.mul(builder.sdiv(nv, ir.Constant(_I64, W)), ir.Constant(_I64, W))
            _, (a,) = _vector_loop(builder, data, j, stop1, W, [a], combine, vt)
            return builder.call(fold, [a])

        return row.dtype(row, n, row.dtype), codegen

    return head


_max_head = _make_head("max")
_min_head = _make_head("min")


@numba.njit(cache=True, inline="always")
def _vector_end(row):  # pragma: no cover - compiled
    """Where the intrinsics' whole vectors end in ``row``: ``n - n % W`` for a row with unit stride, 0 for a strided
    one (which the loops then take whole)."""
    n = row.shape[0]
    if row.strides[0] != row.itemsize:
        return 0
    return n - n % (LANES32 if row.itemsize == 4 else LANES32 // 2)


@numba.njit(cache=True, inline="always")
def row_max(row):  # pragma: no cover - compiled
    """The largest entry of the 1-D float32/float64 array ``row`` (length >= 1), NaN ignored: NaN only when every
    entry is NaN (``np.fmax`` folded over the row). Vector code when ``row`` has unit stride, a loop otherwise."""
    j0 = _vector_end(row)
    m = _max_head(row, j0, row[0]) if j0 > 0 else row[0]
    for j in range(j0, row.shape[0]):
        m = np.fmax(m, row[j])
    return m


@numba.njit(cache=True, inline="always")
def row_min(row):  # pragma: no cover - compiled
    """The smallest entry of ``row``, NaN ignored, as :func:`row_max`."""
    j0 = _vector_end(row)
    m = _min_head(row, j0, row[0]) if j0 > 0 else row[0]
    for j in range(j0, row.shape[0]):
        m = np.fmin(m, row[j])
    return m


@intrinsic
def _first_head(typingctx, row, n, value):  # noqa: ANN001, ANN202
    """The first ``j < n - n % W`` with ``row[j] == value`` (``W`` lanes of :data:`LANES32`; ``row`` 1-D with unit
    stride), ``-1`` when there is none: whole vectors compared at once, the loop left at the first match."""
    if not float_array(row) or not isinstance(n, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        _, vt, data, nv, xv = _row_ir(context, builder, signature, args)
        W = vt.count
        iw = ir.IntType(W)
        cttz = cgutils.get_or_insert_function(builder.module, ir.FunctionType(iw, [iw, ir.IntType(1)]),
                                              f"llvm.cttz.i{W}")
        target = broadcast(builder, vt, xv)
        stop = builder.mul(builder.sdiv(nv, ir.Constant(_I64, W)), ir.Constant(_I64, W))
        pre = builder.block
        head = builder.append_basic_block("fi.head")
        body = builder.append_basic_block("fi.body")
        found = builder.append_basic_block("fi.found")
        done = builder.append_basic_block("fi.done")
        builder.branch(head)
        builder.position_at_end(head)
        j = builder.phi(_I64)
        j.add_incoming(ir.Constant(_I64, 0), pre)
        builder.cbranch(builder.icmp_signed("<", j, stop), body, done)
        builder.position_at_end(body)
        x = builder.load(builder.bitcast(builder.gep(data, [j]), vt.as_pointer()), align=1)
        bits = builder.bitcast(builder.fcmp_ordered("==", x, target), iw)
        j.add_incoming(builder.add(j, ir.Constant(_I64, W)), body)
        builder.cbranch(builder.icmp_unsigned("!=", bits, ir.Constant(iw, 0)), found, head)
        builder.position_at_end(found)
        at = builder.add(j, builder.zext(builder.call(cttz, [bits, ir.Constant(ir.IntType(1), 1)]), _I64))
        builder.branch(done)
        builder.position_at_end(done)
        res = builder.phi(_I64)
        res.add_incoming(ir.Constant(_I64, -1), head)
        res.add_incoming(at, found)
        return res

    return types.intp(row, n, row.dtype), codegen


@numba.njit(cache=True, inline="always")
def first_index(row, value):  # pragma: no cover - compiled
    """The first index ``j`` with ``row[j] == value`` in the 1-D float32/float64 array ``row``, ``-1`` when there is
    none (``value`` NaN: none). With :func:`row_max`, ``first_index(row, row_max(row))`` is the first maximum
    (``np.nanargmax``'s answer). Vector compares when ``row`` has unit stride, a loop otherwise."""
    j0 = _vector_end(row)
    if j0 > 0:
        j = _first_head(row, j0, value)
        if j >= 0:
            return j
    for j in range(j0, row.shape[0]):
        if row[j] == value:
            return j
    return -1


_I32 = ir.IntType(32)


@intrinsic
def _columns_head(typingctx, X, n, e, mx, ix, mn, jx):  # noqa: ANN001, ANN202
    """For the ``W`` columns ``e .. e + W`` of ``X[:n]`` (``W`` lanes of :data:`LANES32`, float64 half; rows of
    ``X`` with unit stride): ``mx[e + l]`` the largest entry of column ``e + l``, ``ix[e + l]`` its first row,
    ``mn``/``jx`` the smallest and its first row, NaN ignored; ``ix = -1`` (``mx = -inf``) where no entry exceeds
    -inf, ``jx = -1`` (``mn = +inf``) where none is below +inf. One pass down the rows, one vector load each:
    the running extremes and their rows live in registers (strict compares: a later equal entry never replaces
    an earlier one, NaN never replaces anything)."""
    if not float_array(X) or X.ndim != 2 or not isinstance(n, types.Integer) or not isinstance(e, types.Integer):
        return None
    for a, dt in ((mx, X.dtype), (ix, types.int64), (mn, X.dtype), (jx, types.int64)):
        if not isinstance(a, types.Array) or a.ndim != 1 or a.dtype != dt:
            return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        aty = signature.args[0]
        ft = context.get_value_type(aty.dtype)
        W = LANES32 if aty.dtype == types.float32 else LANES32 // 2
        vt, it = ir.VectorType(ft, W), ir.VectorType(_I32, W)
        xa = context.make_array(aty)(context, builder, args[0])
        rs = builder.sdiv(cgutils.unpack_tuple(builder, xa.strides, 2)[0], ir.Constant(_I64, aty.dtype.bitwidth // 8))
        nv = context.cast(builder, args[1], signature.args[1], types.intp)
        ev = context.cast(builder, args[2], signature.args[2], types.intp)
        base = builder.gep(xa.data, [ev])
        inf = float("inf")
        inits = [ir.Constant(vt, [ir.Constant(ft, -inf)] * W), ir.Constant(it, [-1] * W),
                 ir.Constant(vt, [ir.Constant(ft, inf)] * W), ir.Constant(it, [-1] * W)]

        def body(j, state):  # noqa: ANN001, ANN202
            x = builder.load(builder.bitcast(builder.gep(base, [builder.mul(j, rs)]), vt.as_pointer()), align=1)
            at = broadcast(builder, it, builder.trunc(j, _I32))
            vmax, imax, vmin, imin = state
            up = builder.fcmp_ordered(">", x, vmax)
            down = builder.fcmp_ordered("<", x, vmin)
            return [builder.select(up, x, vmax), builder.select(up, at, imax),
                    builder.select(down, x, vmin), builder.select(down, at, imin)]

        _, state = _loop(builder, ir.Constant(_I64, 0), nv, 1, inits, body)
        for k, v in enumerate(state):
            oty = signature.args[3 + k]
            p = builder.gep(context.make_array(oty)(context, builder, args[3 + k]).data, [ev])
            if k % 2:       # positions: int32 lanes widened to the output's integers
                v = builder.sext(v, ir.VectorType(context.get_value_type(oty.dtype), W))
            builder.store(v, builder.bitcast(p, v.type.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(X, types.intp, types.intp, mx, ix, mn, jx), codegen


@numba.njit(cache=True, inline="always")
def column_max_min(X, n, mx, ix, mn, jx):  # pragma: no cover - compiled
    """Down each column ``e`` of ``X[:n]`` (``X (>= n, C)`` float32/float64, ``n`` >= 1, ``n`` < 2**31): ``mx[e]``
    the largest entry and ``ix[e]`` the first row holding it, ``mn[e]`` the smallest and ``jx[e]`` its first
    row, NaN ignored: ``row_max``, ``first_index(.., row_max)``, ``row_min``, ``first_index(.., row_min)`` of the
    column (NaN and -1 for a column of NaN only). ``mx``, ``mn``: 1-D of ``X``'s dtype, ``ix``, ``jx``: 1-D int64,
    each of length >= ``C``, unit stride. Columns in vectors of :data:`LANES32` lanes (float64: half) where rows
    of ``X`` have unit stride, the rest by a loop."""
    C = X.shape[1]
    W = LANES32 if X.itemsize == 4 else LANES32 // 2
    e0 = C - C % W if X.strides[1] == X.itemsize else 0
    for e in range(0, e0, W):
        _columns_head(X, n, e, mx, ix, mn, jx)
    for e in range(C):
        if e >= e0 or ix[e] < 0 or jx[e] < 0:  # the last columns; columns of -inf, +inf and NaN only
            col = X[:n, e]
            m = row_max(col)
            mx[e] = m
            ix[e] = first_index(col, m)
            m = row_min(col)
            mn[e] = m
            jx[e] = first_index(col, m)
