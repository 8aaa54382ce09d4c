# ruff: noqa: E702  -- the register tiles read best one tile row per line (a0 = ...; a1 = ...)
"""numba CPU kernels of linear attention (``linear``, ``performer``, ungated ``rfa``) and their operators.

The one primitive is the *product*::

    out[t] = sum_{j in J(t)} (x[t] . y[j]) * w[j]  (+ x[t]^T S0)
    den[t] = sum_{j in J(t)} (x[t] . y[j])         (+ x[t] . z0)   (with_den)

for ``x (N, L, M)``, ``y (N, S, M)``, ``w (N, S, E)`` (N = batch x heads) and
an initial state ``S0 = sum of earlier y_j w_j^T`` with ``z0``; ``J(t)`` is
``j <= t`` (causal), ``j >= t`` (reverse) or every ``j`` (full). Linear
attention's numerator is ``product(phi(q), phi(k), v)`` and ``den`` its
denominator; the backward pass is three more products
(:func:`attnkit_kernelized._ops.linear_attention_backward`).

:func:`_causal_rows` (causal and reverse) computes the sequences ``n0 <= n < n1``
of the N = B*H (serial, ``nogil``, ``nopython``, ``cache=True``), each into
arrays of its own, copied into the caller's at its end (writing into argument
arrays lets LLVM assume they alias the inputs and vectorise the tiles less:
measured 2x slower). Two ways run it over the sequences: :func:`_causal_team`,
a numba ``prange`` with one sequence per iteration (numba's OpenMP threads, the
default), and, while the machine is busy (:mod:`attnkit_kernelized._busy`),
:func:`attnkit_kernelized._numba.rows`: blocks of sequences handed out one at a
time to the calling thread and Python helper threads, so a thread another
process deschedules takes fewer and nobody waits for a fixed share (numba's
OpenMP layer splits a ``prange`` statically). Each sequence is computed by one
thread with the same loop either way (the two builds may round in the last bits
differently; neither depends on the thread count or the order).

The kernel walks each sequence in chunks of ``chunk`` positions, so a chunk's
inputs stay in L1/L2 while they are reused. Per chunk: the inter-chunk part
``out[t] = S^T x[t]`` from the state of the earlier chunks, the causal triangle
``A[t, j] = x[t] . y[j]`` and ``out[t] += sum_j A[t, j] w[j]``, then the state
update ``S^T += w^T y`` over the chunk. The state is kept transposed (E x M)
so that every heavy loop is a dot product over a contiguous axis; each dot
loop computes a 2 x 4 tile of results at once (8 vector accumulators sharing
6 loads), which LLVM vectorises with ``reassoc`` fastmath. That keeps the
kernel compute-bound instead of bound by the stores of a rank-1 update.
Work O(L * (M * E + chunk * (M + E))), memory O(M * E + chunk * (M + E)) per
sequence besides inputs and outputs. With ``normalize`` the division by the
denominator is fused (0 where it is 0, NaN stays NaN).

:func:`_full_rows` (the non-causal form, L != S allowed) accumulates the
whole state with the same tiles, then ``out[t] = S^T x[t]``.

Operators (``torch.library``, namespace ``attnkit_kernelized``):
``numba_linear_product`` (the primitive, no autograd) and
``numba_linear_attention`` (differentiable, normalised).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from .._busy import kernel_thread_count
from .._numba import FASTMATH, arr, check_float, dynamic, rows
from .._ops import call_linear_attention, define, define_linear_attention
from ..common import DEFAULT_CHUNK

_FASTMATH = FASTMATH


@numba.njit(cache=True, fastmath=_FASTMATH, nogil=True)
def _causal_rows(x, y, w, reverse, chunk, with_den, normalize, ST0, z0, out, den, ST_out, z_out, n0,
                 n1):  # pragma: no cover - compiled
    N, L, M = x.shape
    E = w.shape[2]
    n_chunks = (L + chunk - 1) // chunk
    E4 = E - E % 4
    for n in range(n0, n1):
        xn = x[n]; yn = y[n]; wn = w[n]
        # the results of the sequence go to arrays allocated here, copied out at its end: writes into the
        # caller's arrays could alias the inputs for LLVM, which then vectorises the tiles less (2x slower)
        on = np.empty((xn.shape[0], E), dtype=x.dtype)
        dn = np.zeros(xn.shape[0] if with_den else 0, dtype=x.dtype)
        zero = np.zeros(1, dtype=x.dtype)          # a typed 0 (a literal 0.0 would be float64)
        ST = ST0[n].copy()                         # the state S^T = sum_j w_j y_j^T (E x M)
        z = z0[n].copy()
        yT = np.empty((M, chunk), dtype=x.dtype)
        wT = np.empty((E, chunk), dtype=x.dtype)
        A = np.empty((chunk, chunk), dtype=x.dtype)
        for ci in range(n_chunks):
            c = n_chunks - 1 - ci if reverse else ci
            c0 = c * chunk
            c1 = min(c0 + chunk, L)
            T = c1 - c0
            xc = xn[c0:c1]; yc = yn[c0:c1]; wc = wn[c0:c1]; oc = on[c0:c1]
            # ---- inter: out[t, e] = x_t . ST[e] (2 rows x 4 state rows share loads)
            T2 = T - T % 2
            for e in range(0, E4, 4):
                s0 = ST[e]; s1 = ST[e + 1]; s2 = ST[e + 2]; s3 = ST[e + 3]
                for t in range(0, T2, 2):
                    xa = xc[t]; xb = xc[t + 1]
                    a0 = zero[0]; a1 = zero[0]; a2 = zero[0]; a3 = zero[0]
                    b0 = zero[0]; b1 = zero[0]; b2 = zero[0]; b3 = zero[0]
                    for m in range(M):
                        p = xa[m]; q = xb[m]
                        v0 = s0[m]; v1 = s1[m]; v2 = s2[m]; v3 = s3[m]
                        a0 += p * v0; a1 += p * v1; a2 += p * v2; a3 += p * v3
                        b0 += q * v0; b1 += q * v1; b2 += q * v2; b3 += q * v3
                    oc[t, e] = a0; oc[t, e + 1] = a1; oc[t, e + 2] = a2; oc[t, e + 3] = a3
                    oc[t + 1, e] = b0; oc[t + 1, e + 1] = b1; oc[t + 1, e + 2] = b2; oc[t + 1, e + 3] = b3
                for t in range(T2, T):
                    xa = xc[t]
                    a0 = zero[0]; a1 = zero[0]; a2 = zero[0]; a3 = zero[0]
                    for m in range(M):
                        p = xa[m]
                        a0 += p * s0[m]; a1 += p * s1[m]; a2 += p * s2[m]; a3 += p * s3[m]
                    oc[t, e] = a0; oc[t, e + 1] = a1; oc[t, e + 2] = a2; oc[t, e + 3] = a3
            for e in range(E4, E):
                s0 = ST[e]
                for t in range(T):
                    xa = xc[t]
                    a0 = zero[0]
                    for m in range(M):
                        a0 += xa[m] * s0[m]
                    oc[t, e] = a0
            # ---- intra: A[t, j] = x_t . y_j for the causal (or anti-causal) triangle
            for t in range(0, T2, 2):
                xa = xc[t]; xb = xc[t + 1]
                if reverse:
                    j0 = t; j1 = T
                else:
                    j0 = 0; j1 = t + 2
                for j in range(j0, j1 - (j1 - j0) % 2, 2):
                    ya = yc[j]; yb = yc[j + 1]
                    a0 = zero[0]; a1 = zero[0]; b0 = zero[0]; b1 = zero[0]
                    for m in range(M):
                        p = xa[m]; q = xb[m]; u = ya[m]; r = yb[m]
                        a0 += p * u; a1 += p * r; b0 += q * u; b1 += q * r
                    A[t, j] = a0; A[t, j + 1] = a1; A[t + 1, j] = b0; A[t + 1, j + 1] = b1
                if (j1 - j0) % 2:
                    j = j1 - 1
                    ya = yc[j]
                    a0 = zero[0]; b0 = zero[0]
                    for m in range(M):
                        a0 += xa[m] * ya[m]; b0 += xb[m] * ya[m]
                    A[t, j] = a0; A[t + 1, j] = b0
            for t in range(T2, T):
                xa = xc[t]
                if reverse:
                    j0 = t; j1 = T
                else:
                    j0 = 0; j1 = t + 1
                for j in range(j0, j1):
                    ya = yc[j]
                    a0 = zero[0]
                    for m in range(M):
                        a0 += xa[m] * ya[m]
                    A[t, j] = a0
            # ---- out[t] += sum over the triangle of A[t, j] w_j (small: T*T*E/2)
            for t in range(T):
                if reverse:
                    j0 = t; j1 = T
                else:
                    j0 = 0; j1 = t + 1
                ot = oc[t]
                for j in range(j0, j1):
                    a = A[t, j]
                    wj = wc[j]
                    for e in range(E):
                        ot[e] += a * wj[e]
            if with_den:
                for t in range(T):
                    if reverse:
                        j0 = t; j1 = T
                    else:
                        j0 = 0; j1 = t + 1
                    s = zero[0]
                    for j in range(j0, j1):
                        s += A[t, j]
                    xa = xc[t]
                    for m in range(M):
                        s += xa[m] * z[m]
                    dn[c0 + t] = s
                    if normalize:  # out /= den, 0 where no key is visible
                        ot = oc[t]
                        if s == 0:
                            for e in range(E):
                                ot[e] = 0.0
                        else:
                            r = 1 / s
                            for e in range(E):
                                ot[e] *= r
            # ---- state: ST[e, m] += sum_j w[j, e] y[j, m] (dots over the chunk's positions)
            for j in range(T):
                yj = yc[j]; wj = wc[j]
                for m in range(M):
                    yT[m, j] = yj[m]
                for e in range(E):
                    wT[e, j] = wj[e]
            M2 = M - M % 2
            for e in range(0, E4, 4):
                w0 = wT[e]; w1 = wT[e + 1]; w2 = wT[e + 2]; w3 = wT[e + 3]
                for m in range(0, M2, 2):
                    ya = yT[m]; yb = yT[m + 1]
                    a0 = zero[0]; a1 = zero[0]; a2 = zero[0]; a3 = zero[0]
                    b0 = zero[0]; b1 = zero[0]; b2 = zero[0]; b3 = zero[0]
                    for j in range(T):
                        p = ya[j]; q = yb[j]
                        v0 = w0[j]; v1 = w1[j]; v2 = w2[j]; v3 = w3[j]
                        a0 += p * v0; a1 += p * v1; a2 += p * v2; a3 += p * v3
                        b0 += q * v0; b1 += q * v1; b2 += q * v2; b3 += q * v3
                    ST[e, m] += a0; ST[e + 1, m] += a1; ST[e + 2, m] += a2; ST[e + 3, m] += a3
                    ST[e, m + 1] += b0; ST[e + 1, m + 1] += b1; ST[e + 2, m + 1] += b2; ST[e + 3, m + 1] += b3
                for m in range(M2, M):
                    ya = yT[m]
                    a0 = zero[0]; a1 = zero[0]; a2 = zero[0]; a3 = zero[0]
                    for j in range(T):
                        p = ya[j]
                        a0 += p * w0[j]; a1 += p * w1[j]; a2 += p * w2[j]; a3 += p * w3[j]
                    ST[e, m] += a0; ST[e + 1, m] += a1; ST[e + 2, m] += a2; ST[e + 3, m] += a3
            for e in range(E4, E):
                w0 = wT[e]
                for m in range(M):
                    ya = yT[m]
                    a0 = zero[0]
                    for j in range(T):
                        a0 += ya[j] * w0[j]
                    ST[e, m] += a0
            if with_den:
                for m in range(M):
                    ya = yT[m]
                    s = zero[0]
                    for j in range(T):
                        s += ya[j]
                    z[m] += s
        out[n] = on
        if with_den:
            den[n] = dn
        ST_out[n] = ST
        z_out[n] = z


@numba.njit(cache=True, fastmath=_FASTMATH, nogil=True)
def _full_rows(x, y, w, chunk, with_den, normalize, ST0, z0, out, den, ST_out, z_out, n0,
               n1):  # pragma: no cover - compiled
    N, L, M = x.shape
    S = y.shape[1]
    E = w.shape[2]
    E4 = E - E % 4
    M2 = M - M % 2
    for n in range(n0, n1):
        xn = x[n]; yn = y[n]; wn = w[n]
        # the results of the sequence go to arrays allocated here, copied out at its end: writes into the
        # caller's arrays could alias the inputs for LLVM, which then vectorises the tiles less (2x slower)
        on = np.empty((xn.shape[0], E), dtype=x.dtype)
        dn = np.zeros(xn.shape[0] if with_den else 0, dtype=x.dtype)
        zero = np.zeros(1, dtype=x.dtype)          # a typed 0 (a literal 0.0 would be float64)
        ST = ST0[n].copy()                         # S^T = S0^T + sum_j w_j y_j^T (E x M)
        z = z0[n].copy()
        yT = np.empty((M, chunk), dtype=x.dtype)
        wT = np.empty((E, chunk), dtype=x.dtype)
        # ---- state over every key, a chunk of keys at a time (dots over the chunk's positions)
        for c0 in range(0, S, chunk):
            c1 = min(c0 + chunk, S)
            T = c1 - c0
            yc = yn[c0:c1]; wc = wn[c0:c1]
            for j in range(T):
                yj = yc[j]; wj = wc[j]
                for m in range(M):
                    yT[m, j] = yj[m]
                for e in range(E):
                    wT[e, j] = wj[e]
            for e in range(0, E4, 4):
                w0 = wT[e]; w1 = wT[e + 1]; w2 = wT[e + 2]; w3 = wT[e + 3]
                for m in range(0, M2, 2):
                    ya = yT[m]; yb = yT[m + 1]
                    a0 = zero[0]; a1 = zero[0]; a2 = zero[0]; a3 = zero[0]
                    b0 = zero[0]; b1 = zero[0]; b2 = zero[0]; b3 = zero[0]
                    for j in range(T):
                        p = ya[j]; q = yb[j]
                        v0 = w0[j]; v1 = w1[j]; v2 = w2[j]; v3 = w3[j]
                        a0 += p * v0; a1 += p * v1; a2 += p * v2; a3 += p * v3
                        b0 += q * v0; b1 += q * v1; b2 += q * v2; b3 += q * v3
                    ST[e, m] += a0; ST[e + 1, m] += a1; ST[e + 2, m] += a2; ST[e + 3, m] += a3
                    ST[e, m + 1] += b0; ST[e + 1, m + 1] += b1; ST[e + 2, m + 1] += b2; ST[e + 3, m + 1] += b3
                for m in range(M2, M):
                    ya = yT[m]
                    a0 = zero[0]; a1 = zero[0]; a2 = zero[0]; a3 = zero[0]
                    for j in range(T):
                        p = ya[j]
                        a0 += p * w0[j]; a1 += p * w1[j]; a2 += p * w2[j]; a3 += p * w3[j]
                    ST[e, m] += a0; ST[e + 1, m] += a1; ST[e + 2, m] += a2; ST[e + 3, m] += a3
            for e in range(E4, E):
                w0 = wT[e]
                for m in range(M):
                    ya = yT[m]
                    a0 = zero[0]
                    for j in range(T):
                        a0 += ya[j] * w0[j]
                    ST[e, m] += a0
            if with_den:
                for m in range(M):
                    ya = yT[m]
                    s = zero[0]
                    for j in range(T):
                        s += ya[j]
                    z[m] += s
        # ---- out[t, e] = x_t . ST[e], a chunk of queries at a time (2 rows x 4 state rows share loads)
        for c0 in range(0, L, chunk):
            c1 = min(c0 + chunk, L)
            T = c1 - c0
            T2 = T - T % 2
            xc = xn[c0:c1]; oc = on[c0:c1]
            for e in range(0, E4, 4):
                s0 = ST[e]; s1 = ST[e + 1]; s2 = ST[e + 2]; s3 = ST[e + 3]
                for t in range(0, T2, 2):
                    xa = xc[t]; xb = xc[t + 1]
                    a0 = zero[0]; a1 = zero[0]; a2 = zero[0]; a3 = zero[0]
                    b0 = zero[0]; b1 = zero[0]; b2 = zero[0]; b3 = zero[0]
                    for m in range(M):
                        p = xa[m]; q = xb[m]
                        v0 = s0[m]; v1 = s1[m]; v2 = s2[m]; v3 = s3[m]
                        a0 += p * v0; a1 += p * v1; a2 += p * v2; a3 += p * v3
                        b0 += q * v0; b1 += q * v1; b2 += q * v2; b3 += q * v3
                    oc[t, e] = a0; oc[t, e + 1] = a1; oc[t, e + 2] = a2; oc[t, e + 3] = a3
                    oc[t + 1, e] = b0; oc[t + 1, e + 1] = b1; oc[t + 1, e + 2] = b2; oc[t + 1, e + 3] = b3
                for t in range(T2, T):
                    xa = xc[t]
                    a0 = zero[0]; a1 = zero[0]; a2 = zero[0]; a3 = zero[0]
                    for m in range(M):
                        p = xa[m]
                        a0 += p * s0[m]; a1 += p * s1[m]; a2 += p * s2[m]; a3 += p * s3[m]
                    oc[t, e] = a0; oc[t, e + 1] = a1; oc[t, e + 2] = a2; oc[t, e + 3] = a3
            for e in range(E4, E):
                s0 = ST[e]
                for t in range(T):
                    xa = xc[t]
                    a0 = zero[0]
                    for m in range(M):
                        a0 += xa[m] * s0[m]
                    oc[t, e] = a0
            if with_den:
                for t in range(T):
                    xa = xc[t]
                    s = zero[0]
                    for m in range(M):
                        s += xa[m] * z[m]
                    dn[c0 + t] = s
                    if normalize:  # out /= den, 0 where no key is visible
                        ot = oc[t]
                        if s == 0:
                            for e in range(E):
                                ot[e] = 0.0
                        else:
                            r = 1 / s
                            for e in range(E):
                                ot[e] *= r
        out[n] = on
        if with_den:
            den[n] = dn
        ST_out[n] = ST
        z_out[n] = z


@numba.njit(parallel=True, cache=True, nogil=True)
def _causal_team(x, y, w, reverse, chunk, with_den, normalize, ST0, z0, out, den, ST_out,
                 z_out):  # pragma: no cover - compiled
    for n in numba.prange(x.shape[0]):   # prange's index is unsigned: int64 reuses the row kernel Python calls
        i = np.int64(n)
        _causal_rows(x, y, w, reverse, chunk, with_den, normalize, ST0, z0, out, den, ST_out, z_out, i, i + 1)


@numba.njit(parallel=True, cache=True, nogil=True)
def _full_team(x, y, w, chunk, with_den, normalize, ST0, z0, out, den, ST_out, z_out):  # pragma: no cover - compiled
    for n in numba.prange(x.shape[0]):   # int64, as above: one compile of the row kernel per dtype
        i = np.int64(n)
        _full_rows(x, y, w, chunk, with_den, normalize, ST0, z0, out, den, ST_out, z_out, i, i + 1)


# ------------------------------------------------------------------ operators
_MODES = ("causal", "reverse", "full")


def _product(x: Tensor, y: Tensor, w: Tensor, S0: Tensor, z0: Tensor, mode: str, chunk: int, with_den: bool,
             normalize: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The product primitive on CPU tensors ``x (N, L, DX)``, ``y (N, S, DX)``, ``w (N, S, DW)``,
    ``S0 (N, DX, DW)``, ``z0 (N, DX)``; returns ``(out (N, L, DW), den (N, L) or (N, 0), S, z)``."""
    N, L, DX = x.shape
    S, DW = y.shape[1], w.shape[2]
    if not (y.shape == (N, S, DX) and w.shape[:2] == (N, S) and S0.shape == (N, DX, DW) and z0.shape == (N, DX)):
        raise ValueError(f"numba_linear_product: expected x (N, L, DX), y (N, S, DX), w (N, S, DW), S0 (N, DX, DW), "
                         f"z0 (N, DX); got {tuple(x.shape)}, {tuple(y.shape)}, {tuple(w.shape)}, {tuple(S0.shape)}, "
                         f"{tuple(z0.shape)}")
    if mode not in _MODES or (mode != "full" and L != S) or chunk < 1 or (normalize and not with_den):
        raise ValueError(f"numba_linear_product: mode must be one of {_MODES} (L == S unless 'full'), chunk >= 1, "
                         f"normalize only with with_den; got mode={mode!r}, L={L}, S={S}, chunk={chunk}, "
                         f"with_den={with_den}, normalize={normalize}")
    if any(t.device.type != "cpu" for t in (x, y, w, S0, z0)):
        raise ValueError(f"numba_linear_product: numba kernels take CPU tensors, got {x.device}")
    xa, ya, wa, z0a = arr(x), arr(y), arr(w), arr(z0)
    ST0 = np.ascontiguousarray(arr(S0).transpose(0, 2, 1))
    check_float(xa, ya, wa, ST0, z0a)
    dt = xa.dtype
    out = np.empty((N, L, DW), dtype=dt)
    den = np.zeros((N, L if with_den else 0), dtype=dt)
    ST = np.empty((N, DW, DX), dtype=dt)
    z = np.empty((N, DX), dtype=dt)
    if kernel_thread_count() is not None:   # busy machine (see .._busy): sequences handed out by Python threads
        if mode == "full":
            rows(_full_rows, N, xa, ya, wa, int(chunk), bool(with_den), bool(normalize), ST0, z0a, out, den, ST, z)
        else:
            rows(_causal_rows, N, xa, ya, wa, mode == "reverse", int(chunk), bool(with_den), bool(normalize), ST0,
                 z0a, out, den, ST, z)
    elif mode == "full":                      # idle: numba's OpenMP team, one sequence per prange iteration
        dynamic(_full_team, xa, ya, wa, int(chunk), bool(with_den), bool(normalize), ST0, z0a, out, den, ST, z)
    else:
        dynamic(_causal_team, xa, ya, wa, mode == "reverse", int(chunk), bool(with_den), bool(normalize), ST0, z0a,
                out, den, ST, z)
    return (torch.from_numpy(out), torch.from_numpy(den), torch.from_numpy(ST).transpose(1, 2).contiguous(),
            torch.from_numpy(z))


def _product_fake(x, y, w, S0, z0, mode, chunk, with_den, normalize):
    N, L, _ = x.shape
    return (x.new_empty(N, L, w.shape[-1]), x.new_empty(N, L if with_den else 0), torch.empty_like(S0),
            torch.empty_like(z0))


#: ``attnkit_kernelized::numba_linear_product`` (see :func:`attnkit_kernelized._ops.define_linear_attention`)
numba_linear_product = define("numba_linear_product", _product, _product_fake)

#: ``attnkit_kernelized::numba_linear_attention``: normalised, differentiable, with state in and out
numba_linear_attention = define_linear_attention("numba", numba_linear_product)


def linear_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, S0: Tensor | None = None, z0: Tensor | None = None,
                     *, causal: bool, chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor, Tensor]:
    """Normalised linear attention with the numba kernels (the ``numba`` backend; differentiable).

    Args:
        phi_q: ``(B, H, L, M)``; phi_k: ``(B, H, S, M)``; v: ``(B, H, S, E)``; float32/float64 CPU tensors.
        S0, z0: the state ``(B, H, M, E)``, ``(B, H, M)`` carried in (None: zeros).
        causal: prefix sums (L == S) or every key (any S).
        chunk: positions per kernel block.

    Returns:
        ``(out (B, H, L, E), S (B, H, M, E), z (B, H, M))``: the output (0 where a
        query sees no key) and the state after the last key.
    """
    return call_linear_attention(numba_linear_attention, phi_q, phi_k, v, S0, z0, causal=causal, chunk=chunk)
