# ruff: noqa: E702  -- the register tiles read best one tile row per line (a0 = ...; a1 = ...)
"""numba CPU kernels for the causal (prefix-sum) product of linear attention.

The one primitive is the *causal product*::

    out[t] = sum_{j <= t} (x[t] . y[j]) * w[j]          (forward in time)
    out[t] = sum_{j >= t} (x[t] . y[j]) * w[j]          (reverse=True)
    den[t] = sum_{j <= t} (x[t] . y[j])                  (with_den=True)

for ``x, y`` of shape ``(N, L, M)`` (N = batch x heads, M features) and
``w`` of shape ``(N, L, E)``. Linear attention's numerator is
``causal_product(phi(q), phi(k), v)`` and its denominator is ``den``.

The backward pass is three more causal products, with no stored states::

    d phi(q) = causal_product(g', v', phi(k))                    # S_t g_t + z_t d_t
    d phi(k) = causal_product(v', g', phi(q), reverse=True)      # R_j v_j + r_j
    d v      = causal_product(phi(k), phi(q), g, reverse=True)   # R_j^T phi(k)_j

where ``g`` is the gradient of the numerator, ``d`` that of the
denominator, ``g' = [g, d]`` and ``v' = [v, 1]``.

Each kernel runs ``prange`` over the N = B*H sequences (``parallel=True``,
``nopython``, ``cache=True``) and walks each sequence in chunks of ``chunk``
positions, so a chunk's inputs stay in L1/L2 while they are reused. Per
chunk: the inter-chunk part ``out[t] = S^T x[t]`` from the state of the
earlier chunks, the causal triangle ``A[t, j] = x[t] . y[j]`` and
``out[t] += sum_j A[t, j] w[j]``, then the state update
``S^T += w^T y`` over the chunk. The state is kept transposed (E x M) so that
every heavy loop is a dot product over a contiguous axis; each dot loop
computes a 2 x 4 tile of results at once (8 vector accumulators sharing 6
loads), which LLVM vectorises with ``reassoc`` fastmath. That keeps the
kernel compute-bound instead of bound by the stores of a rank-1 update.
Work O(L * (M * E + chunk * (M + E))), memory O(M * E + chunk * (M + E))
per sequence besides inputs and outputs.

Nothing here imports torch; :mod:`attnkit_kernelized.kernels.dispatch` wraps
the kernels in ``torch.autograd.Function`` objects.
"""

from __future__ import annotations

import os

import numba
import numpy as np


def _launch_numba_threads() -> None:
    """Start numba's thread pool with idle threads that sleep instead of spinning.

    With the ``omp`` threading layer numba runs its own copy of libgomp next to
    the one bundled with torch; idle GNU OpenMP threads busy-wait by default,
    so after every kernel call numba's threads would spin on the cores torch's
    next operation needs (measured: SDPA and the feature maps ran ~2x slower
    on 2 cores). libgomp reads ``OMP_WAIT_POLICY`` when it is loaded, which
    happens when numba launches its threads, so it is set to ``PASSIVE`` for
    that moment only (unless the user set it) and restored afterwards.
    torch's own pool is not affected.
    """
    key = "OMP_WAIT_POLICY"
    user_set = key in os.environ
    if not user_set:
        os.environ[key] = "PASSIVE"
    try:
        numba.get_num_threads()  # launches the pool (and loads numba's libgomp) once
    finally:
        if not user_set:
            os.environ.pop(key, None)


_launch_numba_threads()


def _dynamic(fn, *args):
    """Run a parallel kernel handing out its B*H sequences one at a time (numba's parallel chunk
    size 1) instead of in equal static blocks, so a thread slowed by a busy core takes fewer."""
    old = numba.set_parallel_chunksize(1)
    try:
        return fn(*args)
    finally:
        numba.set_parallel_chunksize(old)

DEFAULT_CHUNK = 64

# reassociation lets LLVM vectorise the short reductions; no NaN/inf
# assumptions, so zeros from masked positions behave exactly
_FASTMATH = {"reassoc", "contract", "nsz"}


@numba.njit(parallel=True, cache=True, fastmath=_FASTMATH, nogil=True)
def _causal_product(x, y, w, reverse, chunk, with_den, normalize, ST0, z0):  # pragma: no cover - compiled
    N, L, M = x.shape
    E = w.shape[2]
    out = np.empty((N, L, E), dtype=x.dtype)
    den = np.zeros((N, L if with_den else 0), dtype=x.dtype)
    ST_out = np.empty((N, E, M), dtype=x.dtype)
    z_out = np.empty((N, M), dtype=x.dtype)
    n_chunks = (L + chunk - 1) // chunk
    E4 = E - E % 4
    for n in numba.prange(N):
        xn = x[n]; yn = y[n]; wn = w[n]; on = out[n]
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
                    den[n, c0 + t] = s
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
        ST_out[n] = ST
        z_out[n] = z
    return out, den, ST_out, z_out


def causal_product(x: np.ndarray, y: np.ndarray, w: np.ndarray, *, reverse: bool = False,
                   chunk: int = DEFAULT_CHUNK, with_den: bool = False, normalize: bool = False, state=None,
                   return_state: bool = False):
    """The causal product (see the module docstring), with argument checks.

    Args:
        x, y: ``(N, L, M)`` float32 or float64 arrays.
        w: ``(N, L, E)`` of the same dtype.
        reverse: suffix sums (``j >= t``) instead of prefix sums.
        chunk: positions per block, >= 1.
        with_den: also return ``den[t] = sum_j x[t] . y[j]``.
        normalize: return ``out / den`` (0 where ``den == 0``) instead of ``out``; needs ``with_den``.
        state: ``(S^T (N, E, M), z (N, M))`` carried in from earlier positions
            (the prefix sums start from it), or None for zeros.
        return_state: also return the final state ``(S^T, z)``.

    Returns:
        ``out`` ``(N, L, E)``, then ``den`` ``(N, L)`` when ``with_den``, then
        the final state when ``return_state`` (a tuple when more than one).

    Raises:
        ValueError: shapes, dtypes or chunk out of range.
    """
    if x.ndim != 3 or y.shape != x.shape or w.ndim != 3 or w.shape[:2] != x.shape[:2]:
        raise ValueError(
            f"causal_product: x and y must be (N, L, M) and w (N, L, E); got {x.shape}, {y.shape}, {w.shape}"
        )
    if not (x.dtype == y.dtype == w.dtype) or x.dtype not in (np.float32, np.float64):
        raise ValueError(
            f"causal_product: x, y and w must share dtype float32 or float64; got {x.dtype}, {y.dtype}, {w.dtype}"
        )
    if chunk < 1:
        raise ValueError(f"causal_product: chunk must be >= 1, got {chunk}")
    if normalize and not with_den:
        raise ValueError("causal_product: normalize=True needs with_den=True")
    N, _, M = x.shape
    E = w.shape[2]
    if state is None:
        ST0, z0 = np.zeros((N, E, M), x.dtype), np.zeros((N, M), x.dtype)
    else:
        ST0, z0 = (np.ascontiguousarray(a, dtype=x.dtype) for a in state)
        if ST0.shape != (N, E, M) or z0.shape != (N, M):
            raise ValueError(f"causal_product: state must be ((N, E, M), (N, M)) = ({(N, E, M)}, {(N, M)}); "
                             f"got {ST0.shape}, {z0.shape}")
    x, y, w = (np.ascontiguousarray(a) for a in (x, y, w))
    out, den, ST, z = _dynamic(_causal_product, x, y, w, bool(reverse), int(chunk), bool(with_den), bool(normalize),
                               ST0, z0)
    result = (out,) + ((den,) if with_den else ()) + (((ST, z),) if return_state else ())
    return result if len(result) > 1 else out


# ------------------------------------------------------------------ gated (RFA)
@numba.njit(parallel=True, cache=True, fastmath=_FASTMATH, nogil=True)
def _gated_forward(q, k, v, g, chunk):  # pragma: no cover - compiled
    """S_t = g_t S_{t-1} + k_t v_t^T, z_t = g_t z_{t-1} + k_t; num_t = S_t^T q_t, den_t = z_t . q_t.

    Returns num (N, L, E), den (N, L) and the states (S, z) at every chunk start
    (N, C+1, M, E) and (N, C+1, M) for the backward pass.
    """
    N, L, M = q.shape
    E = v.shape[2]
    n_chunks = (L + chunk - 1) // chunk
    num = np.empty((N, L, E), dtype=q.dtype)
    den = np.empty((N, L), dtype=q.dtype)
    ckS = np.empty((N, n_chunks + 1, M, E), dtype=q.dtype)
    ckz = np.empty((N, n_chunks + 1, M), dtype=q.dtype)
    for n in numba.prange(N):
        S = np.zeros((M, E), dtype=q.dtype)
        z = np.zeros(M, dtype=q.dtype)
        zero = np.zeros(1, dtype=q.dtype)
        for t in range(L):
            if t % chunk == 0:
                ckS[n, t // chunk] = S
                ckz[n, t // chunk] = z
            gt = g[n, t]
            kt = k[n, t]
            vt = v[n, t]
            qt = q[n, t]
            ot = num[n, t]
            for e in range(E):
                ot[e] = 0.0
            d = zero[0]
            for m in range(M):
                km = kt[m]
                qm = qt[m]
                Sm = S[m]
                for e in range(E):
                    Sm[e] = gt * Sm[e] + km * vt[e]
                    ot[e] += qm * Sm[e]
                z[m] = gt * z[m] + km
                d += qm * z[m]
            den[n, t] = d
        ckS[n, n_chunks] = S
        ckz[n, n_chunks] = z
    return num, den, ckS, ckz


@numba.njit(parallel=True, cache=True, fastmath=_FASTMATH, nogil=True)
def _gated_backward(q, k, v, g, ckS, ckz, dnum, dden, chunk):  # pragma: no cover - compiled
    """Gradients of :func:`_gated_forward` w.r.t. q, k, v and g (reverse sweep, chunk recompute)."""
    N, L, M = q.shape
    E = v.shape[2]
    n_chunks = (L + chunk - 1) // chunk
    dq = np.empty((N, L, M), dtype=q.dtype)
    dk = np.empty((N, L, M), dtype=q.dtype)
    dv = np.empty((N, L, E), dtype=q.dtype)
    dg = np.empty((N, L), dtype=q.dtype)
    for n in numba.prange(N):
        G = np.zeros((M, E), dtype=q.dtype)                  # dLoss/dS_t
        gz = np.zeros(M, dtype=q.dtype)                      # dLoss/dz_t
        Ss = np.empty((chunk + 1, M, E), dtype=q.dtype)      # S_{c0-1} .. S_{c1-1}
        zs = np.empty((chunk + 1, M), dtype=q.dtype)
        zero = np.zeros(1, dtype=q.dtype)
        for ci in range(n_chunks - 1, -1, -1):
            c0 = ci * chunk
            c1 = min(c0 + chunk, L)
            T = c1 - c0
            Ss[0] = ckS[n, ci]
            zs[0] = ckz[n, ci]
            for i in range(T):
                t = c0 + i
                gt = g[n, t]
                kt = k[n, t]
                vt = v[n, t]
                for m in range(M):
                    km = kt[m]
                    for e in range(E):
                        Ss[i + 1, m, e] = gt * Ss[i, m, e] + km * vt[e]
                    zs[i + 1, m] = gt * zs[i, m] + km
            for i in range(T - 1, -1, -1):
                t = c0 + i
                gt = g[n, t]
                kt = k[n, t]
                vt = v[n, t]
                qt = q[n, t]
                do = dnum[n, t]
                dd = dden[n, t]
                Sn = Ss[i + 1]
                Sp = Ss[i]
                # num_t = S_t^T q_t, den_t = z_t . q_t
                for m in range(M):
                    s = zero[0]
                    for e in range(E):
                        s += Sn[m, e] * do[e]
                    dq[n, t, m] = s + zs[i + 1, m] * dd
                for m in range(M):
                    qm = qt[m]
                    for e in range(E):
                        G[m, e] += qm * do[e]
                    gz[m] += qm * dd
                # S_t = g_t S_{t-1} + k_t v_t^T, z_t = g_t z_{t-1} + k_t
                for e in range(E):
                    dv[n, t, e] = 0.0
                s_g = zero[0]
                for m in range(M):
                    km = kt[m]
                    s = zero[0]
                    for e in range(E):
                        s += G[m, e] * vt[e]
                        dv[n, t, e] += km * G[m, e]
                        s_g += G[m, e] * Sp[m, e]
                    dk[n, t, m] = s + gz[m]
                    s_g += gz[m] * zs[i, m]
                dg[n, t] = s_g
                for m in range(M):
                    for e in range(E):
                        G[m, e] *= gt
                    gz[m] *= gt
    return dq, dk, dv, dg


def gated_forward(q, k, v, g, chunk: int):
    """Gated recurrence forward: ``(num, den, S checkpoints, z checkpoints)``."""
    return _dynamic(_gated_forward, q, k, v, g, int(chunk))


def gated_backward(q, k, v, g, ckS, ckz, dnum, dden, chunk: int):
    """Gated recurrence backward: ``(dq, dk, dv, dg)``."""
    return _dynamic(_gated_backward, q, k, v, g, ckS, ckz, dnum, dden, int(chunk))


# ------------------------------------------------------------------ delta rule
@numba.njit(parallel=True, cache=True, fastmath=_FASTMATH, nogil=True)
def _delta_forward(q, k, v, beta, chunk):  # pragma: no cover - compiled
    """Delta rule per position; returns out (N, L, E) and the states at chunk starts (N, C+1, M, E)."""
    N, L, M = q.shape
    E = v.shape[2]
    n_chunks = (L + chunk - 1) // chunk
    out = np.empty((N, L, E), dtype=q.dtype)
    ckpt = np.empty((N, n_chunks + 1, M, E), dtype=q.dtype)
    for n in numba.prange(N):
        S = np.zeros((M, E), dtype=q.dtype)
        r = np.empty(E, dtype=q.dtype)
        for t in range(L):
            if t % chunk == 0:
                ckpt[n, t // chunk] = S
            kt = k[n, t]
            qt = q[n, t]
            b = beta[n, t]
            ot = out[n, t]
            # r = v_t - S^T k_t
            for e in range(E):
                r[e] = v[n, t, e]
            for m in range(M):
                km = kt[m]
                Sm = S[m]
                for e in range(E):
                    r[e] -= km * Sm[e]
            # S += beta k r^T, then out = S^T q (one pass over S)
            for e in range(E):
                ot[e] = 0.0
            for m in range(M):
                c = b * kt[m]
                qm = qt[m]
                Sm = S[m]
                for e in range(E):
                    Sm[e] += c * r[e]
                    ot[e] += qm * Sm[e]
        ckpt[n, n_chunks] = S
    return out, ckpt


@numba.njit(parallel=True, cache=True, fastmath=_FASTMATH, nogil=True)
def _delta_backward(q, k, v, beta, ckpt, dout, chunk):  # pragma: no cover - compiled
    """Gradients of :func:`_delta_forward` w.r.t. q, k, v and beta (reverse sweep, chunk recompute)."""
    N, L, M = q.shape
    E = v.shape[2]
    n_chunks = (L + chunk - 1) // chunk
    dq = np.empty((N, L, M), dtype=q.dtype)
    dk = np.empty((N, L, M), dtype=q.dtype)
    dv = np.empty((N, L, E), dtype=q.dtype)
    db = np.empty((N, L), dtype=q.dtype)
    for n in numba.prange(N):
        G = np.zeros((M, E), dtype=q.dtype)               # dLoss/dS_t
        states = np.empty((chunk + 1, M, E), dtype=q.dtype)  # S_{c0-1} .. S_{c1-1} of one chunk
        R = np.empty((chunk, E), dtype=q.dtype)           # r_t of the chunk
        gk = np.empty(E, dtype=q.dtype)
        zero = np.zeros(1, dtype=q.dtype)
        for ci in range(n_chunks - 1, -1, -1):
            c0 = ci * chunk
            c1 = min(c0 + chunk, L)
            T = c1 - c0
            # recompute the chunk's states from its checkpoint
            states[0] = ckpt[n, ci]
            for i in range(T):
                t = c0 + i
                kt = k[n, t]
                b = beta[n, t]
                Sp = states[i]
                Sn = states[i + 1]
                rt = R[i]
                for e in range(E):
                    rt[e] = v[n, t, e]
                for m in range(M):
                    km = kt[m]
                    for e in range(E):
                        rt[e] -= km * Sp[m, e]
                for m in range(M):
                    c = b * kt[m]
                    for e in range(E):
                        Sn[m, e] = Sp[m, e] + c * rt[e]
            for i in range(T - 1, -1, -1):
                t = c0 + i
                kt = k[n, t]
                qt = q[n, t]
                b = beta[n, t]
                Sp = states[i]
                Sn = states[i + 1]
                rt = R[i]
                do = dout[n, t]
                # out_t = S_t^T q_t
                for m in range(M):
                    s = zero[0]
                    for e in range(E):
                        s += Sn[m, e] * do[e]
                    dq[n, t, m] = s
                for m in range(M):
                    qm = qt[m]
                    for e in range(E):
                        G[m, e] += qm * do[e]
                # S_t = S_{t-1} + b k r^T, r = v - S_{t-1}^T k
                for e in range(E):
                    gk[e] = 0.0
                for m in range(M):
                    km = kt[m]
                    for e in range(E):
                        gk[e] += km * G[m, e]
                s = zero[0]
                for e in range(E):
                    dv[n, t, e] = b * gk[e]
                    s += gk[e] * rt[e]
                db[n, t] = s
                for m in range(M):
                    s1 = zero[0]
                    s2 = zero[0]
                    for e in range(E):
                        s1 += G[m, e] * rt[e]
                        s2 += Sp[m, e] * gk[e]
                    dk[n, t, m] = b * (s1 - s2)
                # dS_{t-1} = (I - b k k^T) G
                for m in range(M):
                    c = b * kt[m]
                    for e in range(E):
                        G[m, e] -= c * gk[e]
    return dq, dk, dv, db


def delta_forward(q, k, v, beta, chunk: int):
    """Delta-rule forward: ``(out (N, L, E), checkpoints (N, L/chunk + 1, M, E))``."""
    return _dynamic(_delta_forward, q, k, v, beta, int(chunk))


def delta_backward(q, k, v, beta, ckpt, dout, chunk: int):
    """Delta-rule backward: ``(dq, dk, dv, dbeta)``."""
    return _dynamic(_delta_backward, q, k, v, beta, ckpt, dout, int(chunk))
