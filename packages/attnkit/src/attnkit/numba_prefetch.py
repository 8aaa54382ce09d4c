"""Software prefetch for the plugins' numba kernels: rows read or updated at positions the kernel knows ahead.

A kernel that gathers rows at routed or sorted positions (``routing``'s clusters, ``lsh``'s buckets) reads
rows scattered over the sequence: the hardware prefetchers cannot predict them, and a gather loop copies one
row (a few cache lines) at a time, so its misses barely overlap. The positions are known in advance (the
cluster's list), so the loop asks for row ``j + d`` while it copies row ``j``: :func:`prefetch_row` issues
``llvm.prefetch`` for each cache line of a row. Prefetching never faults and never changes a value.

Measured on the development VM (AMD EPYC, 2 threads), ``routing``'s fused backward at L = 16,384 (H = 8,
clusters of 128): 194 ms without, 168 ms prefetching the gathered rows 8 ahead, 157 ms prefetching the rows
it adds gradients to as well, against 132 ms with every row in cache (session 37, docs/benchmarks.md).
Prefetching the next cluster's rows all at once, instead, gained nothing.

The two helpers are plain numba functions, not ``inline="always"``: LLVM still inlines them into the calling
kernel (the prefetch instructions sit in the kernel's loop), but numba's own passes no longer copy them into
every call site, which cost routing's and lsh's first compile 4-7 s each (session 38, docs/benchmarks.md).

Imported only by plugins' numba kernel modules (it imports numba and llvmlite, which ``import attnkit``
never does).
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["prefetch_row", "prefetch_ahead", "AHEAD", "LINE"]

#: bytes per cache line assumed (x86-64 and most ARM cores)
LINE = 64
#: rows ahead a gather (or scatter-add) loop prefetches (routing's backward at L = 16,384, clusters of 128:
#: 4, 8 and 16 measured alike)
AHEAD = 8
_I32 = ir.IntType(32)


@intrinsic
def _prefetch(typingctx, A, i):  # noqa: ANN001, ANN202
    """Prefetch (for reading, into all cache levels) the line holding element ``i`` (flat, from ``A``'s data
    pointer) of the array ``A``."""
    if not isinstance(A, types.Array):
        return None

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
        fty = ir.FunctionType(ir.VoidType(), [ptr.type, _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(builder.module, fty, "llvm.prefetch.p0")
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.void(A, types.intp), codegen


@numba.njit(cache=True)
def prefetch_row(A, r):  # pragma: no cover - compiled
    """Prefetch every cache line of row ``r`` of the 2-D array ``A`` (any dtype, rows contiguous: unit stride along
    a row). Nothing happens for ``r`` outside ``[0, A.shape[0])``."""
    if r < 0 or r >= A.shape[0]:
        return
    it = A.itemsize
    step = max(1, LINE // it)
    base = r * (A.strides[0] // it)
    n = A.shape[1]
    if n == 0:
        return
    for x in range(0, n, step):
        _prefetch(A, base + x)
    _prefetch(A, base + n - 1)   # the last line, when the row does not start on a line


@numba.njit(cache=True)
def prefetch_ahead(A, positions, j, n):  # pragma: no cover - compiled
    """In a loop over ``j < n`` that reads (or adds to) row ``positions[j]`` of ``A``: prefetch row
    ``positions[j + AHEAD]`` when ``j + AHEAD < n`` (:func:`prefetch_row`)."""
    if j + AHEAD < n:
        prefetch_row(A, positions[j + AHEAD])
