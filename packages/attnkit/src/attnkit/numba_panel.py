"""Register-blocked products for the plugins' numba kernels: ``OUT += C @ Y`` with the output held in vector registers,
and :func:`transpose`, a block transposed through registers.

Imported only by plugins' numba kernel modules (it imports numba and llvmlite, which ``import attnkit`` never
does: the core does not depend on numba; the plugins that use it do).

Tiles written as numba loops over an output row (the axpy tiles the kernels used before): each pass over the row
loads and stores four output rows for every four terms, and numba's vectoriser cannot keep a block of the
output in registers across the sum (it may not assume ``OUT`` and ``Y`` are distinct, and a loop over
scalar accumulators is vectorised along the sum instead, spilling them). Here a *panel* is emitted
directly as LLVM IR through :func:`numba.extending.intrinsic`: ``R`` output rows x ``NV`` vectors of the
output (``<8 x float>`` or ``<4 x double>``) live in registers for the whole sum; each term loads ``NV``
vectors of ``Y``, broadcasts ``R`` coefficients and issues ``R·NV`` fused multiply-adds (``llvm.fma``).
Measured on the development VM (AMD EPYC, AVX2, one thread, hot operands of the tiles' shapes): 60-90 GFLOP/s
in float32 against 45-67 for the axpy tiles in the same run, 1.2-1.5x; float64 1.1-1.2x (docs/benchmarks.md,
"Register panels"; ``plugins/attnkit-sparse/benchmarks/bench_panels.py``). ``llvm.fma`` needs the CPU's FMA
unit to be fast: numba compiles for the host CPU, where x86-64 machines since 2013 have one; on a target
without it LLVM calls the library's ``fma`` (correct, slow).

Used by the sparse plugin's fused ``lsh``/``routing`` tiles and by the kernelized plugin's tile
(``attnkit_kernelized._tiles.axpy_rows``: linear's and performer's products).

:func:`set_rows` (:func:`set_at`, :func:`set_t`) is :func:`axpy_rows` (:func:`axpy_at`, :func:`axpy_t`) writing
``OUT = C @ Y`` instead: the accumulators start at zero and the
output block is never read, so a kernel need not zero it first (the kernelized plugin's projections and causal
blocks: performer's and linear's causal forward 1.08x at L = 8,192, session 63, docs/benchmarks.md).

A tile buffer the panels read as vectors should start on a cache line (:func:`empty_aligned`): a 512-bit load
from an address that is not a multiple of 64 bytes touches two lines. numba's ``np.empty`` starts an array on 32
bytes (half of them on 64, by chance, per allocation): a ``32 x 64 x 256`` float32 product ran at 110 GFLOP/s
with its ``Y`` 32 bytes past a line against 154 on one, ``128 x 64 x 64`` at 150 against 173 (one thread, Intel
AVX-512 VM, session 60; docs/benchmarks.md, "Session 60").

The panels need rows of ``OUT`` and ``Y`` with unit stride (the tile buffers are fresh arrays); the
coefficients ``C`` may have any strides, so the same panel serves ``C`` row-major (:func:`axpy_at`) and
key-major (:func:`axpy_t`). ``OUT`` must not overlap ``C`` or ``Y``: the output block is read once before
the sum and written once after it. Column counts that are not a multiple of the vector width finish in a
plain loop, so any ``E`` works; float32 and float64 only (the kernels' dtypes).

:func:`transpose` (``OUT[j, i] = X[i, j]``) moves ``W x W`` tiles (8 x 8 float32, 4 x 4 float64; 16 x 16 and 8 x 8
with 512-bit panels, :data:`PANEL_BITS`) through a network
of shuffles in registers: 0.21 ns per float32 element against 0.57 for the numba loop that gathers a column
(``(32, 256)`` blocks, one thread, development VM; docs/benchmarks.md, "Session 42"). The kernelized plugin turns
each block of key features into the ``(M, T)`` layout its products read with it.

A note for kernels written around these helpers: an element updated by a comparison,
``m[i] = x if x > m[i] else m[i]``, is vectorised by LLVM into masked stores (``vmaskmovps``), which AMD's cores
run several times slower than plain stores (0.76 against 0.08-0.13 ns per element on the development VM); write
``m[i] = np.fmax(m[i], x)`` (the same result where ``m[i]`` is never NaN). ``benchmarks/scan_masked_stores.py``
lists the kernels whose code still stores through a mask.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["LANES32", "PANEL_BITS", "ALIGN", "axpy_at", "axpy_t", "axpy_rows", "set_at", "set_t", "set_rows",
           "transpose", "empty_aligned", "zeros_aligned"]

_I64 = ir.IntType(64)
_I32 = ir.IntType(32)


def _const(v: int) -> ir.Constant:
    return ir.Constant(_I64, v)


def _target_has_avx512() -> bool:
    """Whether numba compiles for a CPU with AVX-512 (``+avx512f`` in its target's features: ``NUMBA_CPU_FEATURES``
    where set; the host's where neither it nor ``NUMBA_CPU_NAME`` is set; False for a named CPU without a feature
    list, as a portable cache is built)."""
    from numba.core import config
    feats = config.CPU_FEATURES
    if feats is None:
        if config.CPU_NAME not in (None, "host"):
            return False
        from llvmlite import binding as ll
        feats = ll.get_host_cpu_features().flatten()
    return "+avx512f" in feats.split(",")


def _panel_bits() -> int:
    """The vector width of the panels, 512 or 256 bits: ``ATTNKIT_PANEL_BITS`` where set (``256`` or ``512``),
    else 512 where numba's target has AVX-512 (:func:`_target_has_avx512`), else 256."""
    import os
    env = os.environ.get("ATTNKIT_PANEL_BITS", "").strip()
    if env:
        if env not in ("256", "512"):
            raise ValueError(f"ATTNKIT_PANEL_BITS: expected 256 or 512, got {env!r}; unset it to choose by the CPU")
        return int(env)
    return 512 if _target_has_avx512() else 256


#: the panels' vector width in bits, chosen at import (:func:`_panel_bits`). 512: ``<16 x float>`` /
#: ``<8 x double>`` vectors, panels of 4 rows x 4 vectors (64 float32 columns, 16 accumulators of AVX-512's 32
#: registers); on the Intel Xeon (Emerald Rapids) VM of session 57, one thread, hot operands: 108-138 GFLOP/s
#: float32 against 58-68 for the 256-bit panels (docs/benchmarks.md, "Session 57"). 256: ``<8 x float>`` /
#: ``<4 x double>``, panels of 4 rows x 2 vectors (AVX2's 16 registers). Kernels compiled into numba's cache keep
#: the width they were compiled with: give a benchmark that switches ``ATTNKIT_PANEL_BITS`` its own
#: ``NUMBA_CACHE_DIR``.
PANEL_BITS = _panel_bits()


def _make_panel(R: int, NV: int, wide: bool = False, unit_r: bool = False):  # noqa: ANN202 - returns an intrinsic
    """An intrinsic ``panel(OUT, o, os, C, c, crs, cjs, Y, y, ys, K, keep)``: for ``r < R`` and the ``NV·W``
    columns from element offset ``o`` of ``OUT`` (``W`` = 8 float32 or 4 float64 lanes; ``wide``: 16 and 8,
    512-bit vectors), ``OUT[o + r·os + e] += sum_{j < K} C[c + r·crs + j·cjs] · Y[y + j·ys + e]`` (offsets and
    strides in elements, from each array's data pointer); ``keep`` 0: ``=`` instead of ``+=`` (the accumulators
    start at zero, ``OUT`` is not read: no pass zeroing it first). ``unit_r``: the coefficients of one term are adjacent
    (``crs`` is taken as 1, whatever is passed): their addresses are constant offsets, not ``R`` products with a
    stride known only at run time, which a tall panel has no registers left to hold."""

    @intrinsic
    def panel(typingctx, OUT, o, os_, C, c, crs, cjs, Y, y, ys, K, keep):  # noqa: ANN001, ANN202
        for a in (OUT, C, Y):
            if not isinstance(a, types.Array) or a.dtype not in (types.float32, types.float64):
                return None
        if not (OUT.dtype == C.dtype == Y.dtype):
            return None
        sig = types.void(OUT, types.intp, types.intp, C, types.intp, types.intp, types.intp, Y, types.intp,
                         types.intp, types.intp, types.intp)

        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            aout, ov, osv, ac, cv, crsv, cjsv, ay, yv, ysv, kv, keepv = args
            ft = context.get_value_type(signature.args[0].dtype)
            is32 = signature.args[0].dtype == types.float32
            W = (8 if is32 else 4) * (2 if wide else 1)
            vt = ir.VectorType(ft, W)
            pvt = vt.as_pointer()
            ptr = [context.make_array(signature.args[i])(context, builder, a).data
                   for i, a in ((0, aout), (3, ac), (7, ay))]
            pout = builder.gep(ptr[0], [ov])
            pc = builder.gep(ptr[1], [cv])
            py = builder.gep(ptr[2], [yv])
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt, vt, vt]),
                                                 f"llvm.fma.v{W}f{32 if is32 else 64}")
            splat = ir.Constant(ir.VectorType(_I32, W), [0] * W)
            undef = ir.Constant(vt, ir.Undefined)

            def out_vec(r: int, v: int) -> ir.Value:
                row = builder.gep(pout, [builder.mul(osv, _const(r))])
                return builder.bitcast(builder.gep(row, [_const(v * W)]), pvt)

            with builder.if_else(builder.icmp_signed("!=", keepv, _const(0))) as (then, otherwise):
                with then:           # accumulate: the output block's current values
                    loaded = [builder.load(out_vec(r, v), align=1) for r in range(R) for v in range(NV)]
                    from_load = builder.block
                with otherwise:      # overwrite: zeros, nothing read
                    from_zero = builder.block
            zeros = ir.Constant(vt, [ir.Constant(ft, 0.0)] * W)
            init = []
            for a in loaded:
                ph = builder.phi(vt)
                ph.add_incoming(a, from_load)
                ph.add_incoming(zeros, from_zero)
                init.append(ph)
            pre = builder.block
            head = builder.append_basic_block("panel.head")
            body = builder.append_basic_block("panel.body")
            done = builder.append_basic_block("panel.done")
            builder.branch(head)
            builder.position_at_end(head)
            j = builder.phi(_I64)
            j.add_incoming(_const(0), pre)
            acc = []
            for a in init:
                ph = builder.phi(vt)
                ph.add_incoming(a, pre)
                acc.append(ph)
            builder.cbranch(builder.icmp_signed("<", j, kv), body, done)
            builder.position_at_end(body)
            yrow = builder.gep(py, [builder.mul(j, ysv)])
            yvec = [builder.load(builder.bitcast(builder.gep(yrow, [_const(v * W)]), pvt), align=1)
                    for v in range(NV)]
            crow = builder.gep(pc, [builder.mul(j, cjsv)])
            new = []
            for r in range(R):
                s = builder.load(builder.gep(crow, [_const(r) if unit_r else builder.mul(crsv, _const(r))]))
                b = builder.shuffle_vector(builder.insert_element(undef, s, ir.Constant(_I32, 0)), undef, splat)
                for v in range(NV):
                    new.append(builder.call(fma, [b, yvec[v], acc[r * NV + v]]))
            j.add_incoming(builder.add(j, _const(1)), builder.block)
            for ph, nv in zip(acc, new):
                ph.add_incoming(nv, builder.block)
            builder.branch(head)
            builder.position_at_end(done)
            for r in range(R):
                for v in range(NV):
                    builder.store(acc[r * NV + v], out_vec(r, v), align=1)
            return context.get_dummy_value()

        return sig, codegen

    return panel


_P4x2 = _make_panel(4, 2)
_P1x2 = _make_panel(1, 2)
_P4x1 = _make_panel(4, 1)
_P1x1 = _make_panel(1, 1)
_Q4x4 = _make_panel(4, 4, wide=True)
_Q1x4 = _make_panel(1, 4, wide=True)
_Q4x2 = _make_panel(4, 2, wide=True)
_Q1x2 = _make_panel(1, 2, wide=True)
_Q4x1 = _make_panel(4, 1, wide=True)
_Q1x1 = _make_panel(1, 1, wide=True)
_Q16x1 = _make_panel(16, 1, wide=True, unit_r=True)


@numba.njit(cache=True)
def _panels_256(OUT, o, os_, rows, C, c, crs, cjs, Y, y, ys, K, E, keep):  # pragma: no cover - compiled
    """``OUT[o + r·os + e] += sum_{j<K} C[c + r·crs + j·cjs] · Y[y + j·ys + e]`` for ``r < rows``, ``e < E - E % W``
    (element offsets and strides; unit stride along ``e``; ``W`` = 8 float32, 4 float64 lanes: 256-bit vectors);
    ``keep`` 0: ``=`` instead of ``+=``.

    A plain call, not inlined: inlined into every product of a kernel it added ~12 s to the compile of
    linear's fused forward (44-52 s against 32-38 s before the panels, cold cache); called, that compile
    took 27 s, and the call costs nothing measurable next to a product."""
    W = 8 if OUT.itemsize == 4 else 4
    e2 = E - E % (2 * W)
    e1 = E - E % W
    r4 = rows - rows % 4
    for r in range(0, r4, 4):
        ob = o + r * os_
        cb = c + r * crs
        for e in range(0, e2, 2 * W):
            _P4x2(OUT, ob + e, os_, C, cb, crs, cjs, Y, y + e, ys, K, keep)
        if e1 > e2:
            _P4x1(OUT, ob + e2, os_, C, cb, crs, cjs, Y, y + e2, ys, K, keep)
    for r in range(r4, rows):
        ob = o + r * os_
        cb = c + r * crs
        for e in range(0, e2, 2 * W):
            _P1x2(OUT, ob + e, os_, C, cb, crs, cjs, Y, y + e, ys, K, keep)
        if e1 > e2:
            _P1x1(OUT, ob + e2, os_, C, cb, crs, cjs, Y, y + e2, ys, K, keep)


@numba.njit(cache=True)
def _panels_512(OUT, o, os_, rows, C, c, crs, cjs, Y, y, ys, K, E, keep):  # pragma: no cover - compiled
    """:func:`_panels_256` on 512-bit vectors (``W`` = 16 float32, 8 float64 lanes): columns in blocks of 4, 2
    and 1 vectors, then one 256-bit vector, so the same ``E - E % (W / 2)`` columns are covered. A last single
    vector of columns runs 16 rows at a time where the coefficients of a term are adjacent (``crs == 1``, as
    :func:`axpy_t` reads them; 16 accumulators: ``lsh``'s hash, ``128 x 64 x 16``, 1.3x the 4-row panels' rate;
    docs/benchmarks.md, "Session 61")."""
    W = 16 if OUT.itemsize == 4 else 8
    h = W // 2
    e4 = E - E % (4 * W)
    e1 = -1                     # where a last single vector of columns starts (-1: none)
    for r0 in range(0, rows, 4):
        ob = o + r0 * os_
        cb = c + r0 * crs
        if rows - r0 >= 4:
            for e in range(0, e4, 4 * W):
                _Q4x4(OUT, ob + e, os_, C, cb, crs, cjs, Y, y + e, ys, K, keep)
            e = e4
            if E - e >= 2 * W:
                _Q4x2(OUT, ob + e, os_, C, cb, crs, cjs, Y, y + e, ys, K, keep)
                e += 2 * W
            if E - e >= W:
                e1 = e
                e += W
            if E - e >= h:
                _P4x1(OUT, ob + e, os_, C, cb, crs, cjs, Y, y + e, ys, K, keep)
        else:
            for r in range(r0, rows):
                ob = o + r * os_
                cb = c + r * crs
                for e in range(0, e4, 4 * W):
                    _Q1x4(OUT, ob + e, os_, C, cb, crs, cjs, Y, y + e, ys, K, keep)
                e = e4
                if E - e >= 2 * W:
                    _Q1x2(OUT, ob + e, os_, C, cb, crs, cjs, Y, y + e, ys, K, keep)
                    e += 2 * W
                if E - e >= W:
                    _Q1x1(OUT, ob + e, os_, C, cb, crs, cjs, Y, y + e, ys, K, keep)
                    e += W
                if E - e >= h:
                    _P1x1(OUT, ob + e, os_, C, cb, crs, cjs, Y, y + e, ys, K, keep)
    if e1 >= 0:                 # the single vector of the rows in groups of 4
        r4 = rows - rows % 4
        r16 = r4 - r4 % 16 if crs == 1 else 0
        for r0 in range(0, r16, 16):
            _Q16x1(OUT, o + r0 * os_ + e1, os_, C, c + r0 * crs, crs, cjs, Y, y + e1, ys, K, keep)
        for r0 in range(r16, r4, 4):
            _Q4x1(OUT, o + r0 * os_ + e1, os_, C, c + r0 * crs, crs, cjs, Y, y + e1, ys, K, keep)


#: the panels the products call (:data:`PANEL_BITS`)
_panels = _panels_512 if PANEL_BITS == 512 else _panels_256

#: float32 lanes of a :data:`PANEL_BITS` vector (float64: half): the transposes' tile side, and the lanes of
#: :mod:`attnkit.numba_vexp`'s vectors
LANES32 = PANEL_BITS // 32


@numba.njit(cache=True, inline="always")
def _axpy(OUT, o0, n, C, i0, j0, ct, Y, y0, K, E, keep=1):  # pragma: no cover - compiled
    """``OUT[o0 + r, e] += sum_{k < K} c(r, k) · Y[y0 + k, e]`` for ``r < n``, ``e < E``, with the coefficient
    ``c(r, k) = C[i0 + r, j0 + k]``, or ``C[j0 + k, i0 + r]`` when ``ct`` (given transposed): the register panels,
    a plain loop when rows of ``OUT`` or ``Y`` are strided, and the last ``E % W`` columns in a plain loop.
    ``keep`` 0: ``=`` instead of ``+=`` (``OUT``'s block is not read; ``K`` = 0 then writes zeros)."""
    if n <= 0 or E <= 0:
        return
    if K <= 0:
        if not keep:
            for r in range(n):
                for e in range(E):
                    OUT[o0 + r, e] = 0
        return
    it = OUT.itemsize
    sh = 2 if it == 4 else 3                   # strides in elements by a shift (``// it``: four integer divisions
    cr = C.strides[1 if ct else 0] >> sh       # a call); coefficient strides along r and along k
    ck = C.strides[0 if ct else 1] >> sh
    e0 = 0
    if OUT.strides[1] == it and Y.strides[1] == it:
        os_ = OUT.strides[0] >> sh
        ys = Y.strides[0] >> sh
        _panels(OUT, o0 * os_, os_, n, C, i0 * cr + j0 * ck, cr, ck, Y, y0 * ys, ys, K, E, keep)
        e0 = E - E % (8 if it == 4 else 4)
    for e in range(e0, E):
        for r in range(n):
            acc = (C[j0, i0 + r] if ct else C[i0 + r, j0]) * Y[y0, e]     # K > 0 here
            if keep:
                acc = OUT[o0 + r, e] + acc
            for k in range(1, K):
                acc += (C[j0 + k, i0 + r] if ct else C[i0 + r, j0 + k]) * Y[y0 + k, e]
            OUT[o0 + r, e] = acc


@numba.njit(cache=True, inline="always")
def axpy_at(OUT, on, C, c0, Y, y0, yn):  # pragma: no cover - compiled
    """``OUT[i, e] += sum_{j < yn} C[i, c0 + j] · Y[y0 + j, e]`` for ``i < on``, ``e < Y.shape[1]`` (the engine's
    ``_axpy_at``, on register panels). ``OUT``, ``C``, ``Y``: 2-D float32 or float64; ``OUT`` distinct from both."""
    _axpy(OUT, 0, on, C, 0, c0, False, Y, y0, yn, Y.shape[1])


@numba.njit(cache=True, inline="always")
def axpy_t(OUT, o0, n, CT, Y, y0, j0, j1):  # pragma: no cover - compiled
    """``OUT[o0 + r, e] += sum_{j0 <= j < j1} CT[j, o0 + r] · Y[y0 + j, e]`` for ``r < n`` (the engine's
    ``_axpy_t`` with any ``n``: the coefficients given transposed, key-major)."""
    _axpy(OUT, o0, n, CT, o0, j0, True, Y, y0 + j0, j1 - j0, Y.shape[1])


@numba.njit(cache=True, inline="always")
def axpy_rows(OUT, C, Y, on, yn, ne):  # pragma: no cover - compiled
    """``OUT[i, :ne] += sum_{j < yn} C[i, j] · Y[j, :ne]`` for ``i < on`` (``OUT (>= on, >= ne)``,
    ``C (>= on, >= yn)``, ``Y (>= yn, >= ne)``, one float dtype; rows of ``OUT`` and ``Y`` with unit stride,
    else a plain loop; ``OUT`` distinct from ``C`` and ``Y``)."""
    _axpy(OUT, 0, on, C, 0, 0, False, Y, 0, yn, ne)


@numba.njit(cache=True, inline="always")
def set_at(OUT, on, C, c0, Y, y0, yn):  # pragma: no cover - compiled
    """:func:`axpy_at` writing ``OUT[i, e] = sum_{j < yn} C[i, c0 + j] · Y[y0 + j, e]`` (the output block not read;
    zeros where ``yn`` is 0)."""
    _axpy(OUT, 0, on, C, 0, c0, False, Y, y0, yn, Y.shape[1], 0)


@numba.njit(cache=True, inline="always")
def set_t(OUT, o0, n, CT, Y, y0, j0, j1):  # pragma: no cover - compiled
    """:func:`axpy_t` writing ``OUT[o0 + r, e] = sum_{j0 <= j < j1} CT[j, o0 + r] · Y[y0 + j, e]`` (the output block
    not read; zeros where ``j1 <= j0``)."""
    _axpy(OUT, o0, n, CT, o0, j0, True, Y, y0 + j0, j1 - j0, Y.shape[1], 0)


@numba.njit(cache=True, inline="always")
def set_rows(OUT, C, Y, on, yn, ne):  # pragma: no cover - compiled
    """``OUT[i, :ne] = sum_{j < yn} C[i, j] · Y[j, :ne]`` for ``i < on``: :func:`axpy_rows` with the output block
    overwritten, not read (no pass zeroing it before the product; zeros where ``yn`` is 0)."""
    _axpy(OUT, 0, on, C, 0, 0, False, Y, 0, yn, ne, 0)


#: bytes a tile buffer's data is aligned to by :func:`empty_aligned` (one cache line: a 512-bit vector)
ALIGN = 64


@numba.njit(cache=True)
def empty_aligned(rows, cols, like):  # pragma: no cover - compiled
    """An uninitialised C-contiguous ``(rows, cols)`` array of ``like``'s dtype whose data starts on an
    :data:`ALIGN`-byte boundary (numba's ``np.empty`` guarantees 32): a view into a slightly longer buffer, which it
    keeps alive. Rows whose length in bytes is a multiple of :data:`ALIGN` all start on a line. For a 1-D buffer,
    take row 0 of a ``(1, n)`` one."""
    it = like.itemsize
    step = ALIGN // it
    buf = np.empty(rows * cols + step, dtype=like.dtype)
    off = ((-buf.ctypes.data) % ALIGN) // it
    return buf[off:off + rows * cols].reshape((rows, cols))


@numba.njit(cache=True)
def zeros_aligned(rows, cols, like):  # pragma: no cover - compiled
    """:func:`empty_aligned` filled with zeros."""
    out = empty_aligned(rows, cols, like)
    out[:] = 0
    return out


# ---- transposes: a tile of W x W elements through registers ---------------------------------------------------
# A numba loop that gathers a column (``OUT[j, i] = X[i, j]``) moves one element per load and store: the
# kernelized plugin's causal blocks spent 8 of 57 ms of the performer's causal product at L = 8,192 on it. Here
# ``W`` rows (``W`` = 8 float32, 4 float64; twice that with 512-bit panels) are loaded as vectors, transposed by a
# network of shuffles in registers (unpack pairs of rows, then pairs of pairs, then halves: ``log2(W)`` stages) and
# stored as ``W`` vectors.

def _transpose_network(builder: ir.IRBuilder, rows: list, W: int) -> list:
    """The ``W`` vectors of a ``W x W`` tile transposed: stage ``s`` interleaves blocks of ``2**s`` elements of
    rows ``i`` and ``i + 2**s`` (the usual unpack / shuffle / permute network, written as ``shufflevector``)."""
    cur = list(rows)
    step = 1
    while step < W:
        nxt = [None] * W
        for i in range(W):
            if i & step:
                continue
            a, b = cur[i], cur[i + step]
            # lo: each even block of `step` elements of a followed by the same block of b; hi: the odd blocks
            lo, hi = [], []
            for blk in range(0, W // step, 2):
                lo += [blk * step + e for e in range(step)] + [W + blk * step + e for e in range(step)]
                hi += [(blk + 1) * step + e for e in range(step)] + [W + (blk + 1) * step + e for e in range(step)]
            mask_lo = ir.Constant(ir.VectorType(_I32, W), lo)
            mask_hi = ir.Constant(ir.VectorType(_I32, W), hi)
            nxt[i] = builder.shuffle_vector(a, b, mask_lo)
            nxt[i + step] = builder.shuffle_vector(a, b, mask_hi)
        cur = nxt
        step *= 2
    return cur


@intrinsic
def _tile_t(typingctx, OUT, o, os_, X, x, xs):  # noqa: ANN001, ANN202
    """``OUT[o + j·os + i] = X[x + i·xs + j]`` for ``i, j < W`` (``W`` = 8 float32, 4 float64, twice that with
    512-bit panels; element offsets
    and row strides from each array's data pointer; rows of ``W`` elements with unit stride)."""
    for a in (OUT, X):
        if not isinstance(a, types.Array) or a.dtype not in (types.float32, types.float64):
            return None
    if OUT.dtype != X.dtype:
        return None
    sig = types.void(OUT, types.intp, types.intp, X, types.intp, types.intp)

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        aout, ov, osv, ax, xv, xsv = args
        ft = context.get_value_type(signature.args[0].dtype)
        W = LANES32 if signature.args[0].dtype == types.float32 else LANES32 // 2
        pvt = ir.VectorType(ft, W).as_pointer()
        pout = builder.gep(context.make_array(signature.args[0])(context, builder, aout).data, [ov])
        px = builder.gep(context.make_array(signature.args[3])(context, builder, ax).data, [xv])
        rows = [builder.load(builder.bitcast(builder.gep(px, [builder.mul(xsv, _const(i))]), pvt), align=1)
                for i in range(W)]
        cols = _transpose_network(builder, rows, W)
        for j, v in enumerate(cols):
            builder.store(v, builder.bitcast(builder.gep(pout, [builder.mul(osv, _const(j))]), pvt), align=1)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(cache=True, nogil=True)
def transpose(OUT, X, nr, nc):  # pragma: no cover - compiled
    """``OUT[j, i] = X[i, j]`` for ``i < nr``, ``j < nc`` (``X (>= nr, >= nc)``, ``OUT (>= nc, >= nr)``, one float
    dtype, distinct arrays): tiles of ``W x W`` through registers where rows of both have unit stride (``W`` = 8
    float32, 4 float64; twice that with 512-bit panels), the edges and strided rows by a plain loop. ``nogil``:
    called from Python, threads run it side by side (the sparse engine transposes each sequence's ``q`` and ``dO``
    on its own thread)."""
    it = OUT.itemsize
    W = LANES32 if it == 4 else LANES32 // 2
    r0 = 0
    c0 = 0
    if OUT.strides[1] == it and X.strides[1] == it:
        os_ = OUT.strides[0] // it
        xs = X.strides[0] // it
        r0 = nr - nr % W
        c0 = nc - nc % W
        for i in range(0, r0, W):
            for j in range(0, c0, W):
                _tile_t(OUT, j * os_ + i, os_, X, i * xs + j, xs)
    for i in range(r0):              # the last columns of the tiled rows
        xr = X[i]
        for j in range(c0, nc):
            OUT[j, i] = xr[j]
    for j in range(nc):              # the last rows
        orow = OUT[j]
        for i in range(r0, nr):
            orow[i] = X[i, j]
