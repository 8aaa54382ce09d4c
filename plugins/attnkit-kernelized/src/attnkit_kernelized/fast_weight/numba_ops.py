# ruff: noqa: E702  -- four rows of the state at a time read best one group per line
"""numba CPU kernels of the delta rule (``fast-weight``) and their operators.

:func:`_delta_forward` runs ``S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T``,
``out_t = S_t^T q_t`` position by position from a state ``S0`` (one pass over
the M x E state per position) for a range of the B*H sequences
(:func:`attnkit_kernelized._numba.rows` runs ranges on threads), saving the
state every ``chunk`` positions; :func:`_delta_backward` walks the positions in
reverse, recomputing each chunk's states from its checkpoint (memory
O(L/chunk · M·E) instead of O(L·M·E)), and returns the gradients of q, k, v,
beta and the initial state.

Operators (``torch.library``, namespace ``attnkit_kernelized``):
``numba_delta_rule`` (differentiable) and ``numba_delta_backward``.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from .._numba import FASTMATH, arr, check_float, rows
from .._ops import define
from ..common import DEFAULT_CHUNK

_FASTMATH = FASTMATH


@numba.njit(cache=True, fastmath=_FASTMATH, inline="always")
def _residual(r, vt, kt, S):  # pragma: no cover - compiled
    """``r = v_t - S^T k_t`` (``S`` ``(M, E)``): a position's correction before its write, from the state before it."""
    M, E = S.shape
    for e in range(E):
        r[e] = vt[e]
    for m in range(M):
        km = kt[m]
        for e in range(E):
            r[e] -= km * S[m, e]


@numba.njit(cache=True, fastmath=_FASTMATH, nogil=True)
def _delta_forward(q, k, v, beta, chunk, S0, i0, i1):  # pragma: no cover - compiled
    """Delta rule per position from S0 for the sequences ``i0 <= n < i1``; returns their out (i1 - i0, L, E) and
    states at chunk starts and at the end (i1 - i0, C+1, M, E), arrays of its own: writing into arrays the caller
    passed in (even only a copy at each sequence's end) ran this loop 3x slower (session 41, 8 x 512 positions,
    M = 128, E = 64, one thread: 26 against 7 ms), so the caller copies them into place.

    One pass over the state per position: while row m of S takes position t's write, the same row gives
    t's read-out and ``r`` of position t + 1 (``v_{t+1} - S_t^T k_{t+1}``), four rows at a time (independent
    accumulations). Two passes (``r``, then the write and read-out) measured 23.3 against 18.5 ms for
    8 x 2048 positions, M = 128, E = 64, one thread."""
    N, L, M = q.shape
    E = v.shape[2]
    n_chunks = (L + chunk - 1) // chunk
    out = np.empty((i1 - i0, L, E), dtype=q.dtype)
    ckpt = np.empty((i1 - i0, n_chunks + 1, M, E), dtype=q.dtype)
    M4 = M - M % 4
    for n in range(i0, i1):
        S = S0[n].copy()
        r = np.empty(E, dtype=q.dtype)           # r_t = v_t - S_{t-1}^T k_t
        rn = np.empty(E, dtype=q.dtype)          # r_{t+1}, accumulated during position t's pass
        if L > 0:
            _residual(r, v[n, 0], k[n, 0], S)
        for t in range(L):
            if t % chunk == 0:
                ckpt[n - i0, t // chunk] = S
            kt = k[n, t]
            qt = q[n, t]
            b = beta[n, t]
            ot = out[n - i0, t]
            tn = min(t + 1, L - 1)                # past the last position: computed, never used
            kn = k[n, tn]
            for e in range(E):
                rn[e] = v[n, tn, e]
            for e in range(E):
                ot[e] = 0.0
            # S += b k r^T; out = S^T q; r_{t+1} -= S^T k_{t+1}
            for m in range(0, M4, 4):
                c0 = b * kt[m]; c1 = b * kt[m + 1]; c2 = b * kt[m + 2]; c3 = b * kt[m + 3]
                q0 = qt[m]; q1 = qt[m + 1]; q2 = qt[m + 2]; q3 = qt[m + 3]
                n0 = kn[m]; n1 = kn[m + 1]; n2 = kn[m + 2]; n3 = kn[m + 3]
                s0 = S[m]; s1 = S[m + 1]; s2 = S[m + 2]; s3 = S[m + 3]
                for e in range(E):
                    re = r[e]
                    a0 = s0[e] + c0 * re; a1 = s1[e] + c1 * re
                    a2 = s2[e] + c2 * re; a3 = s3[e] + c3 * re
                    s0[e] = a0; s1[e] = a1; s2[e] = a2; s3[e] = a3
                    ot[e] += (q0 * a0 + q1 * a1) + (q2 * a2 + q3 * a3)
                    rn[e] -= (n0 * a0 + n1 * a1) + (n2 * a2 + n3 * a3)
            for m in range(M4, M):
                c = b * kt[m]
                qm = qt[m]
                nm = kn[m]
                Sm = S[m]
                for e in range(E):
                    a = Sm[e] + c * r[e]
                    Sm[e] = a
                    ot[e] += qm * a
                    rn[e] -= nm * a
            r, rn = rn, r
        ckpt[n - i0, n_chunks] = S
    return out, ckpt


@numba.njit(cache=True, fastmath=_FASTMATH, nogil=True)
def _delta_backward(q, k, v, beta, ckpt, dout, dSL, chunk, dq, dk, dv, db, dS0, i0,
                    i1):  # pragma: no cover - compiled
    """Gradients of :func:`_delta_forward` w.r.t. q, k, v, beta and S0 of the sequences ``i0 <= n < i1``, given
    those of the output and of the final state (dSL), written into dq, dk, dv, db, dS0: a reverse sweep recomputing
    each chunk's states from its checkpoint."""
    N, L, M = q.shape
    E = v.shape[2]
    n_chunks = (L + chunk - 1) // chunk
    for n in range(i0, i1):
        G = dSL[n].copy()                                 # dLoss/dS_t
        states = np.empty((chunk + 1, M, E), dtype=q.dtype)  # S_{c0-1} .. S_{c1-1} of one chunk
        R = np.empty((chunk + 1, E), dtype=q.dtype)       # r_t of the chunk (and one past its end)
        gk = np.empty(E, dtype=q.dtype)
        zero = np.zeros(1, dtype=q.dtype)
        for ci in range(n_chunks - 1, -1, -1):
            c0 = ci * chunk
            c1 = min(c0 + chunk, L)
            T = c1 - c0
            # recompute the chunk's states from its checkpoint, one pass per position as in the forward: the
            # rows written for position t also give r of position t + 1 (past the end: unused)
            states[0] = ckpt[n, ci]
            _residual(R[0], v[n, c0], k[n, c0], states[0])
            for i in range(T):
                t = c0 + i
                tn = min(t + 1, L - 1)
                b = beta[n, t]
                Sp = states[i]
                Sn = states[i + 1]
                rt = R[i]
                rn = R[i + 1]
                for e in range(E):
                    rn[e] = v[n, tn, e]
                for m in range(M):
                    c = b * k[n, t, m]
                    kn = k[n, tn, m]
                    for e in range(E):
                        a = Sp[m, e] + c * rt[e]
                        Sn[m, e] = a
                        rn[e] -= kn * a
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
                # G += q do^T (now dLoss/dS_t) and, from the same rows, gk = G^T k: S_t = S_{t-1} + b k r^T,
                # r = v - S_{t-1}^T k
                for e in range(E):
                    gk[e] = 0.0
                for m in range(M):
                    qm = qt[m]
                    km = kt[m]
                    for e in range(E):
                        g = G[m, e] + qm * do[e]
                        G[m, e] = g
                        gk[e] += km * g
                s = zero[0]
                for e in range(E):
                    dv[n, t, e] = b * gk[e]
                    s += gk[e] * rt[e]
                db[n, t] = s
                # dk = b (G r - S_{t-1} gk), then dS_{t-1} = (I - b k k^T) G, row by row
                for m in range(M):
                    c = b * kt[m]
                    s1 = zero[0]
                    s2 = zero[0]
                    for e in range(E):
                        g = G[m, e]
                        s1 += g * rt[e]
                        s2 += Sp[m, e] * gk[e]
                        G[m, e] = g - c * gk[e]
                    dk[n, t, m] = b * (s1 - s2)
        dS0[n] = G


# ------------------------------------------------------------------ operators
def _seq(x: Tensor) -> np.ndarray:
    """``(B, H, ...)`` -> a contiguous ``(B*H, ...)`` array."""
    return arr(x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]))


def _forward(phi_q: Tensor, phi_k: Tensor, v: Tensor, beta: Tensor, S0: Tensor,
             chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    arrays = [_seq(t) for t in (phi_q, phi_k, v, beta, S0)]
    check_float(*arrays)
    q, k, w, b, S0n = arrays
    N, nc, dt = B * H, -(-L // int(chunk)) + 1, q.dtype
    out, ckpt = np.empty((N, L, E), dtype=dt), np.empty((N, nc, M, E), dtype=dt)

    def part(i0: int, i1: int) -> None:
        out[i0:i1], ckpt[i0:i1] = _delta_forward(q, k, w, b, int(chunk), S0n, i0, i1)

    rows(part, N)
    return (torch.from_numpy(out).view(B, H, L, E), torch.from_numpy(ckpt[:, -1].copy()).view(B, H, M, E),
            torch.from_numpy(ckpt).view(B, H, nc, M, E))


def _forward_fake(phi_q, phi_k, v, beta, S0, chunk):
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    return v.new_empty(B, H, L, E), torch.empty_like(S0), v.new_empty(B, H, -(-L // chunk) + 1, M, E)


def _backward_impl(phi_q: Tensor, phi_k: Tensor, v: Tensor, beta: Tensor, ckpt: Tensor, dout: Tensor, dS: Tensor,
                   chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    arrays = [_seq(t) for t in (phi_q, phi_k, v, beta, ckpt, dout, dS)]
    check_float(*arrays)
    q, k, w, b, *_, dSL = arrays
    grads = [np.empty_like(a) for a in (q, k, w, b, dSL)]   # dq, dk, dv, dbeta, dS0
    rows(_delta_backward, q.shape[0], *arrays, int(chunk), *grads)
    return tuple(torch.from_numpy(a).view(t.shape) for a, t in zip(grads, (phi_q, phi_k, v, beta, dS)))


def _backward_fake(phi_q, phi_k, v, beta, ckpt, dout, dS, chunk):
    return tuple(torch.empty_like(t) for t in (phi_q, phi_k, v, beta, dS))


#: ``attnkit_kernelized::numba_delta_backward``: gradients of :data:`numba_delta_rule`
numba_delta_backward = define("numba_delta_backward", _backward_impl, _backward_fake)


def _setup_context(ctx, inputs, output):
    phi_q, phi_k, v, beta, S0, chunk = inputs
    ctx.save_for_backward(phi_q, phi_k, v, beta, output[2])
    ctx.chunk = chunk
    ctx.set_materialize_grads(False)


def _backward(ctx, g_out, g_S, _g_ckpt):
    phi_q, phi_k, v, beta, ckpt = ctx.saved_tensors
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    grads = numba_delta_backward(
        phi_q, phi_k, v, beta, ckpt, phi_q.new_zeros(B, H, L, E) if g_out is None else g_out,
        phi_q.new_zeros(B, H, M, E) if g_S is None else g_S, ctx.chunk)
    return (*grads, None)


#: ``attnkit_kernelized::numba_delta_rule``: ``(phi_q, phi_k, v, beta, S0, chunk) -> (out, S, checkpoints)``,
#: differentiable in the first five inputs
numba_delta_rule = define("numba_delta_rule", _forward, _forward_fake, backward=_backward,
                          setup_context=_setup_context)


def delta_rule(phi_q: Tensor, phi_k: Tensor, v: Tensor, beta: Tensor, S0: Tensor | None = None, *,
               chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor]:
    """The delta rule with the numba kernels (the ``numba`` backend of ``fast-weight``).

    Args:
        phi_q, phi_k: ``(B, H, L, M)``; v: ``(B, H, L, E)``; beta: ``(B, H, L)``; float32/float64 CPU tensors.
        S0: the state ``(B, H, M, E)`` carried in (None: zeros).
        chunk: checkpoint interval of the backward pass.

    Returns:
        ``(out (B, H, L, E), S (B, H, M, E))``.
    """
    B, H, L, M = phi_q.shape
    S0 = phi_q.new_zeros(B, H, M, v.shape[-1]) if S0 is None else S0
    out, S, _ = numba_delta_rule(phi_q, phi_k, v, beta, S0, chunk)
    return out, S
