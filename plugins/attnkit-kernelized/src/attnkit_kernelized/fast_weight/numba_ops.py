# ruff: noqa: E702  -- a sequence's views read best one group per line
"""numba CPU kernels of the delta rule (``fast-weight``) and their operators.

:func:`_delta_chunked` runs ``S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T``, ``out_t = S_t^T q_t`` from a
state ``S0`` in the chunked UT-transform form (DeltaNet, Yang et al. 2024), blocks of :data:`BLOCK` positions whose
products are register panels (:func:`_delta_block`), for a range of the B*H sequences
(:func:`attnkit_kernelized._numba.rows` runs ranges on threads), saving the state every ``chunk`` positions.
It replaced a per-position loop (one pass over the ``M x E`` state per position, which reads and writes the whole
state for every position): one thread, 8 x 2,048 positions, M = 128, E = 64, 18-22 against 26-38 ms
(docs/benchmarks.md, "Session 64"). :func:`_delta_backward` walks the positions in reverse, recomputing each
chunk's states from its checkpoint by the per-position recurrence (memory O(L/chunk · M·E) instead of
O(L·M·E)), and returns the gradients of q, k, v, beta and the initial state.

Operators (``torch.library``, namespace ``attnkit_kernelized``):
``numba_delta_rule`` (differentiable) and ``numba_delta_backward``.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from attnkit.numba_panel import empty_aligned

from .._numba import FASTMATH, arr, check_float, output, rows
from .._ops import define
from .._tiles import axpy_rows, set_rows, transpose
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


#: positions per block of the chunked forward (:func:`_delta_chunked`); a checkpoint interval is cut into blocks
#: of at most this many positions
BLOCK = 16


@numba.njit(cache=True, fastmath=_FASTMATH, nogil=True)
def _delta_block(qb, kb, vb, bb, ob, S, KT, U, G, T, M, E):  # pragma: no cover - compiled
    """One block of ``T`` positions of the chunked (UT-transform) delta rule from the state ``S (M, E)`` (updated
    in place): ``qb, kb (>= T, M)``, ``vb (>= T, E)``, ``bb (>= T)`` the block's features, values and betas; writes
    ``ob[:T]`` (not read first). ``KT (M, >= T)``, ``U (>= T, E)``, ``G (>= T, >= T)``: scratch.

    ``u = (I + tril(diag(b) K K^T, -1))^{-1} diag(b) (V - K S)`` by forward substitution (row ``i`` reads only the
    rows before it), ``out = Q S + tril(Q K^T) u``, ``S += K^T u``: the products are register panels
    (:mod:`attnkit.numba_panel`), so the state is read three times per block instead of once per position."""
    transpose(KT, kb, T, M)
    set_rows(U, kb, S, T, M, E)                   # K S
    set_rows(G, kb, KT, T, M, T)                  # K K^T (its strict lower triangle is read)
    for i in range(T):
        b = bb[i]
        ui = U[i]
        vi = vb[i]
        gi = G[i]
        for e in range(E):
            ui[e] = vi[e] - ui[e]
        for j in range(i):
            g = gi[j]
            uj = U[j]
            for e in range(E):
                ui[e] -= g * uj[e]
        for e in range(E):
            ui[e] *= b
    set_rows(ob, qb, S, T, M, E)                  # Q S (the state before the block)
    set_rows(G, qb, KT, T, M, T)                  # Q K^T, into G (K K^T is no longer needed)
    # the causal triangle a query row at a time over the keys up to its own: a row never reads a later key's u
    # (a 0 of a mask times a non-finite u would be NaN), so a non-finite key stays in its future
    for i in range(T):
        axpy_rows(ob[i:], G[i:], U, 1, i + 1, E)
    axpy_rows(S, KT, U, M, T, E)                  # S += K^T u


@numba.njit(cache=True, fastmath=_FASTMATH, nogil=True)
def _delta_chunked(q, k, v, beta, chunk, block, S0, out, ckpt, i0, i1):  # pragma: no cover - compiled
    """The delta rule from ``S0`` for the sequences ``i0 <= n < i1`` of ``q, k (N, L, M)``, ``v (N, L, E)``,
    ``beta (N, L)``, in blocks of at most ``block`` positions (:func:`_delta_block`): ``out[n] (L, E)``, and the
    state at every ``chunk``-th position and at the end in ``ckpt[n] (ceil(L / chunk) + 1, M, E)`` (what
    :func:`_delta_backward` recomputes from). A block never crosses a checkpoint."""
    N, L, M = q.shape
    E = v.shape[2]
    n_chunks = (L + chunk - 1) // chunk
    B = max(1, min(block, chunk))
    KT = empty_aligned(M, B, q)
    U = empty_aligned(B, E, q)
    G = empty_aligned(B, B, q)
    for n in range(i0, i1):
        S = empty_aligned(M, E, q)
        S[:] = S0[n]
        qn = q[n]; kn = k[n]; vn = v[n]; bn = beta[n]; on = out[n]
        for ci in range(n_chunks):
            ckpt[n, ci] = S
            c1 = min((ci + 1) * chunk, L)
            for p0 in range(ci * chunk, c1, B):
                p1 = min(p0 + B, c1)
                _delta_block(qn[p0:p1], kn[p0:p1], vn[p0:p1], bn[p0:p1], on[p0:p1], S, KT, U, G, p1 - p0, M, E)
        ckpt[n, n_chunks] = S


@numba.njit(cache=True, fastmath=_FASTMATH, nogil=True)
def _delta_backward(q, k, v, beta, ckpt, dout, dSL, chunk, dq, dk, dv, db, dS0, i0,
                    i1):  # pragma: no cover - compiled
    """Gradients of :func:`_delta_chunked` w.r.t. q, k, v, beta and S0 of the sequences ``i0 <= n < i1``, given
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
    out, ckpt = output((N, L, E), dt), np.empty((N, nc, M, E), dtype=dt)
    rows(_delta_chunked, N, q, k, w, b, int(chunk), BLOCK, S0n, out, ckpt)
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
