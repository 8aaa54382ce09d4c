# ruff: noqa: E702  -- a sequence's views read best one group per line
"""numba CPU kernels of the delta rule (``fast-weight``) and their operators.

:func:`_delta_chunked` runs ``S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T``, ``out_t = S_t^T q_t`` from a
state ``S0`` in the chunked UT-transform form (DeltaNet, Yang et al. 2024), blocks of :data:`BLOCK` positions whose
products are register panels (:func:`_delta_block`), for a range of the B*H sequences
(:func:`attnkit_kernelized._numba.rows` runs ranges on threads), saving the state every ``chunk`` positions.
:func:`_delta_chunked_backward` walks the checkpoint intervals in reverse: it recomputes an interval's blocks from
its checkpoint (:func:`_block_keep`, memory O(L/chunk · M·E) instead of O(L·M·E)), then runs their backward in
reverse (:func:`_block_backward`, panels too), and returns the gradients of q, k, v, beta and the initial state.

Both replaced per-position loops (one pass over the whole ``M x E`` state per position, forward and backward):
one thread, 8 x 2,048 positions, M = 128, E = 64, the forward 18-22 against 26-38 ms, the backward 76 against
112 ms (docs/benchmarks.md, "Session 64").

Operators (``torch.library``, namespace ``attnkit_kernelized``):
``numba_delta_rule`` (differentiable) and ``numba_delta_backward``.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from attnkit.numba_panel import axpy_t, empty_aligned

from .._numba import FASTMATH, arr, check_float, output, rows
from .._ops import define
from .._tiles import axpy_rows, set_rows, transpose
from ..common import DEFAULT_CHUNK

_FASTMATH = FASTMATH


#: positions per block of the chunked forward (:func:`_delta_chunked`); a checkpoint interval is cut into blocks
#: of at most this many positions
BLOCK = 16


@numba.njit(cache=True, fastmath=_FASTMATH, inline="always")
def _forward_solve(U, R, KK, bb, T, E):  # pragma: no cover - compiled
    """``u_i = b_i (R_i - sum_{j<i} KK_ij u_j)`` for ``i < T`` into ``U`` (``R`` may be ``U`` itself): the block's
    unit-lower-triangular solve by forward substitution, row ``i`` reading only the rows before it."""
    for i in range(T):
        b = bb[i]
        ui = U[i]
        ri = R[i]
        ki = KK[i]
        for e in range(E):
            ui[e] = ri[e]
        for j in range(i):
            g = ki[j]
            uj = U[j]
            for e in range(E):
                ui[e] -= g * uj[e]
        for e in range(E):
            ui[e] *= b


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
        ui = U[i]
        vi = vb[i]
        for e in range(E):
            ui[e] = vi[e] - ui[e]
    _forward_solve(U, U, G, bb, T, E)
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
    :func:`_delta_chunked_backward` recomputes from). A block never crosses a checkpoint."""
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
def _block_keep(qb, kb, vb, bb, S, KT, U, R, KK, QK, T, M, E):  # pragma: no cover - compiled
    """:func:`_delta_block` without the output, keeping what the block's backward reads: ``KT (M, >= T)`` the keys
    transposed, ``R = V - K S`` and ``U = u`` ``(>= T, E)``, ``KK = K Kᵀ`` and ``QK = Q Kᵀ`` ``(>= T, >= T)``;
    ``S`` updated in place."""
    transpose(KT, kb, T, M)
    set_rows(R, kb, S, T, M, E)
    set_rows(KK, kb, KT, T, M, T)
    set_rows(QK, qb, KT, T, M, T)
    for i in range(T):
        ri = R[i]
        vi = vb[i]
        for e in range(E):
            ri[e] = vi[e] - ri[e]
    _forward_solve(U, R, KK, bb, T, E)
    axpy_rows(S, KT, U, M, T, E)


@numba.njit(cache=True, fastmath=_FASTMATH, nogil=True)
def _block_backward(qb, kb, bb, dob, S0, G, U, R, KK, QK, dqb, dkb, dvb, dbb, ST, GT, UT, W, D, C, T, M,
                    E):  # pragma: no cover - compiled
    """Gradients of one block of :func:`_delta_block` from ``G`` (the loss's gradient w.r.t. the state after the
    block, updated in place to the one before it) and ``dob`` (the block's output gradient), with what
    :func:`_block_keep` kept (``S0`` the state before the block): writes ``dqb``, ``dkb (>= T, M)``,
    ``dvb (>= T, E)``, ``dbb (>= T)``. ``ST``, ``GT (E, M)``, ``UT (E, >= T)``, ``W (>= T, E)``,
    ``D``, ``C (>= T, >= T)``: scratch.

    With ``A = I + tril(diag(b) K Kᵀ, -1)``, ``u = A⁻¹ diag(b) R``, ``R = V - K S0``, ``out = Q S0 + tril(Q Kᵀ) u``,
    ``S1 = S0 + Kᵀ u``: ``du = tril(Q Kᵀ)ᵀ dout + K G``; ``w = A⁻ᵀ du`` (back substitution); ``dV = b w``
    (``dR``); ``db_i = w_i · R_i - sum_{j<i} (w_i · u_j) (K Kᵀ)_ij``; ``dQ = dout S0ᵀ + C K`` with
    ``C = tril(dout uᵀ)``; ``dK = u Gᵀ - dR S0ᵀ + Cᵀ Q + (P + Pᵀ) K`` with ``P_ij = -b_i (w_i · u_j)`` below the
    diagonal; ``G <- G + Qᵀ dout - Kᵀ dR``."""
    transpose(ST, S0, M, E)
    transpose(GT, G, M, E)
    transpose(UT, U, T, E)
    # du = K G + tril(Q K^T)^T dout, into W
    set_rows(W, kb, G, T, M, E)
    for i in range(T):
        wi = W[i]
        for j in range(i, T):
            c = QK[j, i]
            dj = dob[j]
            for e in range(E):
                wi[e] += c * dj[e]
    # w = A^-T du: row i takes the rows after it (A_ji = b_j KK_ji, j > i)
    for i in range(T - 1, -1, -1):
        wi = W[i]
        for j in range(i + 1, T):
            c = bb[j] * KK[j, i]
            wj = W[j]
            for e in range(E):
                wi[e] -= c * wj[e]
    # D = w u^T, C = dout u^T (only their lower triangles are read)
    set_rows(D, W, UT, T, E, T)
    set_rows(C, dob, UT, T, E, T)
    for i in range(T):
        b = bb[i]
        wi = W[i]
        ri = R[i]
        s = wi[0] * ri[0]
        for e in range(1, E):
            s += wi[e] * ri[e]
        Di = D[i]
        KKi = KK[i]
        for j in range(i):
            s -= Di[j] * KKi[j]
        dbb[i] = s
        dvi = dvb[i]
        for e in range(E):
            dvi[e] = b * wi[e]           # dR = b w = dV
        for j in range(i + 1, T):
            C[i, j] = 0                  # C: the inclusive lower triangle
    for i in range(T):                   # D <- P + P^T, P_ij = -b_i D_ij below the diagonal
        D[i, i] = 0
        for j in range(i):
            p = -bb[i] * D[i, j]
            D[i, j] = p
            D[j, i] = p
    # dQ = dout S0^T + C K
    set_rows(dqb, dob, ST, T, E, M)
    axpy_rows(dqb, C, kb, T, T, M)
    # dK = u G^T - dR S0^T + C^T Q + (P + P^T) K; W <- -dR
    set_rows(dkb, U, GT, T, E, M)
    for i in range(T):
        wi = W[i]
        c = -bb[i]
        for e in range(E):
            wi[e] *= c
    axpy_rows(dkb, W, ST, T, E, M)
    axpy_t(dkb, 0, T, C, qb, 0, 0, T)
    axpy_rows(dkb, D, kb, T, T, M)
    # G <- G + Q^T dout - K^T dR
    axpy_t(G, 0, M, qb, dob, 0, 0, T)
    axpy_t(G, 0, M, kb, W, 0, 0, T)


@numba.njit(cache=True, fastmath=_FASTMATH, nogil=True)
def _delta_chunked_backward(q, k, v, beta, ckpt, dout, dSL, chunk, block, dq, dk, dv, db, dS0, i0,
                            i1):  # pragma: no cover - compiled
    """Gradients of :func:`_delta_chunked` w.r.t. q, k, v, beta and S0 of the sequences ``i0 <= n < i1``, given
    those of the output and of the final state (``dSL``), written into dq, dk, dv, db, dS0: per checkpoint, in
    reverse, the forward's blocks recomputed from the checkpoint (:func:`_block_keep`), then their backward in
    reverse (:func:`_block_backward`)."""
    N, L, M = q.shape
    E = v.shape[2]
    n_chunks = (L + chunk - 1) // chunk
    B = max(1, min(block, chunk))
    nb = (chunk + B - 1) // B                      # blocks per checkpoint interval
    Sb = np.empty((nb, M, E), dtype=q.dtype)      # each block's starting state
    Ub = np.empty((nb, B, E), dtype=q.dtype)
    Rb = np.empty((nb, B, E), dtype=q.dtype)
    KKb = np.empty((nb, B, B), dtype=q.dtype)
    QKb = np.empty((nb, B, B), dtype=q.dtype)
    KT = empty_aligned(M, B, q)
    S = empty_aligned(M, E, q)
    G = empty_aligned(M, E, q)
    ST = empty_aligned(E, M, q)
    GT = empty_aligned(E, M, q)
    UT = empty_aligned(E, B, q)
    W = empty_aligned(B, E, q)
    D = empty_aligned(B, B, q)
    C = empty_aligned(B, B, q)
    for n in range(i0, i1):
        qn = q[n]; kn = k[n]; vn = v[n]; bn = beta[n]; don = dout[n]
        G[:] = dSL[n]
        for ci in range(n_chunks - 1, -1, -1):
            c0 = ci * chunk
            c1 = min(c0 + chunk, L)
            S[:] = ckpt[n, ci]
            for bi in range((c1 - c0 + B - 1) // B):
                p0 = c0 + bi * B
                p1 = min(p0 + B, c1)
                Sb[bi] = S
                _block_keep(qn[p0:p1], kn[p0:p1], vn[p0:p1], bn[p0:p1], S, KT, Ub[bi], Rb[bi], KKb[bi], QKb[bi],
                            p1 - p0, M, E)
            for bi in range((c1 - c0 + B - 1) // B - 1, -1, -1):
                p0 = c0 + bi * B
                p1 = min(p0 + B, c1)
                _block_backward(qn[p0:p1], kn[p0:p1], bn[p0:p1], don[p0:p1], Sb[bi], G, Ub[bi], Rb[bi], KKb[bi],
                                QKb[bi], dq[n, p0:p1], dk[n, p0:p1], dv[n, p0:p1], db[n, p0:p1], ST, GT, UT, W, D,
                                C, p1 - p0, M, E)
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
    rows(_delta_chunked_backward, q.shape[0], *arrays, int(chunk), BLOCK, *grads)
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
