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
positions. Within a chunk the causal part is a small masked ``x y^T`` block
(kept in L1); the running state ``S = sum_j y_j w_j^T`` (M x E) is read and
written once per chunk, row by row, fusing the inter-chunk product
``x S`` with the state update. Work O(L * (M * E + chunk * (M + E))),
memory O(M * E + chunk * (M + chunk)) per sequence besides inputs and outputs.

Nothing here imports torch; :mod:`attnkit_kernelized.kernels.dispatch` wraps
the kernels in ``torch.autograd.Function`` objects.
"""

from __future__ import annotations

import numba
import numpy as np

DEFAULT_CHUNK = 32

# reassociation lets LLVM vectorise the short reductions; no NaN/inf
# assumptions, so zeros from masked positions behave exactly
_FASTMATH = {"reassoc", "contract", "nsz"}


@numba.njit(parallel=True, cache=True, fastmath=_FASTMATH, nogil=True)
def _causal_product(x, y, w, reverse, chunk, with_den):  # pragma: no cover - compiled
    N, L, M = x.shape
    E = w.shape[2]
    out = np.empty((N, L, E), dtype=x.dtype)
    den = np.zeros((N, L if with_den else 0), dtype=x.dtype)
    n_chunks = (L + chunk - 1) // chunk
    for n in numba.prange(N):
        xn = x[n]
        yn = y[n]
        wn = w[n]
        on = out[n]
        S = np.zeros((M, E), dtype=x.dtype)       # sum_j y_j w_j^T over finished chunks
        z = np.zeros(M, dtype=x.dtype)            # sum_j y_j (denominator state)
        zero = np.zeros(1, dtype=x.dtype)          # a typed 0 (a literal 0.0 would be float64)
        yT = np.empty((M, chunk), dtype=x.dtype)
        A = np.empty((chunk, chunk), dtype=x.dtype)
        for ci in range(n_chunks):
            c = n_chunks - 1 - ci if reverse else ci
            c0 = c * chunk
            c1 = min(c0 + chunk, L)
            T = c1 - c0
            xc = xn[c0:c1]
            wc = wn[c0:c1]
            oc = on[c0:c1]
            for j in range(T):
                yj = yn[c0 + j]
                for m in range(M):
                    yT[m, j] = yj[m]
            # intra-chunk block A = x y^T, vectorised over j through y^T
            for t in range(T):
                At = A[t]
                for j in range(T):
                    At[j] = 0.0
                xt = xc[t]
                for m in range(M):
                    xm = xt[m]
                    ym = yT[m]
                    for j in range(T):
                        At[j] += xm * ym[j]
            # masked A w (and row sums for the denominator)
            for t in range(T):
                ot = oc[t]
                for e in range(E):
                    ot[e] = 0.0
                if reverse:
                    j0 = t
                    j1 = T
                else:
                    j0 = 0
                    j1 = t + 1
                At = A[t]
                for j in range(j0, j1):
                    a = At[j]
                    wj = wc[j]
                    for e in range(E):
                        ot[e] += a * wj[e]
                if with_den:
                    s = zero[0]
                    for j in range(j0, j1):
                        s += At[j]
                    xt = xc[t]
                    for m in range(M):
                        s += xt[m] * z[m]
                    den[n, c0 + t] = s
            # fused: out += x S_prev, then S += y^T w, one pass over the rows of S
            for m in range(M):
                Sm = S[m]
                for t in range(T):
                    xm = xc[t, m]
                    ot = oc[t]
                    for e in range(E):
                        ot[e] += xm * Sm[e]
                ym = yT[m]
                for j in range(T):
                    yv = ym[j]
                    wj = wc[j]
                    for e in range(E):
                        Sm[e] += yv * wj[e]
            if with_den:
                for m in range(M):
                    ym = yT[m]
                    s = zero[0]
                    for j in range(T):
                        s += ym[j]
                    z[m] += s
    return out, den


def causal_product(x: np.ndarray, y: np.ndarray, w: np.ndarray, *, reverse: bool = False,
                   chunk: int = DEFAULT_CHUNK, with_den: bool = False):
    """The causal product (see the module docstring), with argument checks.

    Args:
        x, y: ``(N, L, M)`` float32 or float64 arrays.
        w: ``(N, L, E)`` of the same dtype.
        reverse: suffix sums (``j >= t``) instead of prefix sums.
        chunk: positions per block, >= 1.
        with_den: also return ``den[t] = sum_j x[t] . y[j]``.

    Returns:
        ``out`` ``(N, L, E)``, or ``(out, den)`` with ``den`` ``(N, L)`` when
        ``with_den``.

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
    x, y, w = (np.ascontiguousarray(a) for a in (x, y, w))
    out, den = _causal_product(x, y, w, bool(reverse), int(chunk), bool(with_den))
    return (out, den) if with_den else out


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
