"""numba CPU kernels of gated causal RFA and their operators.

The recurrence (the caller folds RFA's input gate ``1 - g_t`` into ``k``)::

    S_t = g_t S_{t-1} + k_t v_t^T,   z_t = g_t z_{t-1} + k_t,   num_t = S_t^T q_t,   den_t = z_t . q_t

:func:`_gated_forward` runs it position by position from a state ``(S0, z0)``
for a range of the B*H sequences (:func:`attnkit_kernelized._numba.rows` runs
ranges on threads), saving the state every ``chunk`` positions;
:func:`_gated_backward` walks the positions in reverse, recomputing each
chunk's states from its checkpoint (memory O(L/chunk · M·E) instead of
O(L·M·E)), and returns the gradient of every gate (``<dS_t, S_{t-1}> +
<dz_t, z_{t-1}>``) and of the initial state.

Operators (``torch.library``, namespace ``attnkit_kernelized``):
``numba_gated_attention`` (differentiable) and ``numba_gated_backward``.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from .._numba import FASTMATH, arr, check_float, rows
from .._ops import define
from ..common import DEFAULT_CHUNK, normalize

_FASTMATH = FASTMATH


@numba.njit(cache=True, fastmath=_FASTMATH, nogil=True)
def _gated_forward(q, k, v, g, chunk, S0, z0, num, den, ckS, ckz, i0, i1):  # pragma: no cover - compiled
    """S_t = g_t S_{t-1} + k_t v_t^T, z_t = g_t z_{t-1} + k_t from (S0, z0); num_t = S_t^T q_t, den_t = z_t . q_t,
    for the sequences ``i0 <= n < i1``.

    Writes num (N, L, E), den (N, L) and the states (S, z) at every chunk start
    and at the end, ckS (N, C+1, M, E) and ckz (N, C+1, M), for the backward pass.
    """
    N, L, M = q.shape
    E = v.shape[2]
    n_chunks = (L + chunk - 1) // chunk
    for n in range(i0, i1):
        S = S0[n].copy()
        z = z0[n].copy()
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


@numba.njit(cache=True, fastmath=_FASTMATH, nogil=True)
def _gated_backward(q, k, v, g, ckS, ckz, dnum, dden, dSL, dzL, chunk, dq, dk, dv, dg, dS0, dz0, i0,
                    i1):  # pragma: no cover - compiled
    """Gradients of :func:`_gated_forward` w.r.t. q, k, v, g and (S0, z0) of the sequences ``i0 <= n < i1``, given
    those of the outputs and of the final state (dSL, dzL), written into dq, dk, dv, dg, dS0, dz0: a reverse sweep
    recomputing each chunk's states from its checkpoint."""
    N, L, M = q.shape
    E = v.shape[2]
    n_chunks = (L + chunk - 1) // chunk
    for n in range(i0, i1):
        G = dSL[n].copy()                                    # dLoss/dS_t
        gz = dzL[n].copy()                                   # dLoss/dz_t
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
        dS0[n] = G
        dz0[n] = gz


# ------------------------------------------------------------------ operators
def _seq(x: Tensor) -> np.ndarray:
    """``(B, H, ...)`` -> a contiguous ``(B*H, ...)`` array."""
    return arr(x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]))


def _forward(phi_q: Tensor, phi_k: Tensor, v: Tensor, g: Tensor, S0: Tensor, z0: Tensor,
             chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    arrays = [_seq(t) for t in (phi_q, phi_k, v, g, S0, z0)]
    check_float(*arrays)
    q, k, w, gn, S0n, z0n = arrays
    N, nc, dt = B * H, -(-L // int(chunk)) + 1, q.dtype
    num, den = np.empty((N, L, E), dtype=dt), np.empty((N, L), dtype=dt)
    ckS, ckz = np.empty((N, nc, M, E), dtype=dt), np.empty((N, nc, M), dtype=dt)
    rows(_gated_forward, N, q, k, w, gn, int(chunk), S0n, z0n, num, den, ckS, ckz)
    return (torch.from_numpy(num).view(B, H, L, E), torch.from_numpy(den).view(B, H, L),
            torch.from_numpy(ckS[:, -1].copy()).view(B, H, M, E), torch.from_numpy(ckz[:, -1].copy()).view(B, H, M),
            torch.from_numpy(ckS).view(B, H, nc, M, E), torch.from_numpy(ckz).view(B, H, nc, M))


def _forward_fake(phi_q, phi_k, v, g, S0, z0, chunk):
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    nc = -(-L // chunk) + 1
    return (v.new_empty(B, H, L, E), v.new_empty(B, H, L), torch.empty_like(S0), torch.empty_like(z0),
            v.new_empty(B, H, nc, M, E), v.new_empty(B, H, nc, M))


def _backward_impl(phi_q: Tensor, phi_k: Tensor, v: Tensor, g: Tensor, ckS: Tensor, ckz: Tensor, dnum: Tensor,
                   dden: Tensor, dS: Tensor, dz: Tensor, chunk: int
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    arrays = [_seq(t) for t in (phi_q, phi_k, v, g, ckS, ckz, dnum, dden, dS, dz)]
    check_float(*arrays)
    q, k, w, gn, *_, dSL, dzL = arrays
    grads = [np.empty_like(a) for a in (q, k, w, gn, dSL, dzL)]   # dq, dk, dv, dg, dS0, dz0
    rows(_gated_backward, q.shape[0], *arrays, int(chunk), *grads)
    return tuple(torch.from_numpy(a).view(t.shape) for a, t in zip(grads, (phi_q, phi_k, v, g, dS, dz)))


def _backward_fake(phi_q, phi_k, v, g, ckS, ckz, dnum, dden, dS, dz, chunk):
    return tuple(torch.empty_like(t) for t in (phi_q, phi_k, v, g, dS, dz))


#: ``attnkit_kernelized::numba_gated_backward``: gradients of :data:`numba_gated_attention`
numba_gated_backward = define("numba_gated_backward", _backward_impl, _backward_fake)


def _setup_context(ctx, inputs, output):
    phi_q, phi_k, v, g, S0, z0, chunk = inputs
    ctx.save_for_backward(phi_q, phi_k, v, g, output[4], output[5])
    ctx.chunk = chunk
    ctx.set_materialize_grads(False)


def _backward(ctx, g_num, g_den, g_S, g_z, _g_ckS, _g_ckz):
    phi_q, phi_k, v, g, ckS, ckz = ctx.saved_tensors
    B, H, L, M = phi_q.shape
    zeros = phi_q.new_zeros
    grads = numba_gated_backward(
        phi_q, phi_k, v, g, ckS, ckz,
        zeros(B, H, L, v.shape[-1]) if g_num is None else g_num, zeros(B, H, L) if g_den is None else g_den,
        zeros(B, H, M, v.shape[-1]) if g_S is None else g_S, zeros(B, H, M) if g_z is None else g_z, ctx.chunk)
    return (*grads, None)


#: ``attnkit_kernelized::numba_gated_attention``: ``(phi_q, phi_k, v, g, S0, z0, chunk) -> (num, den, S, z,
#: checkpoints of S, checkpoints of z)``, differentiable in the first six inputs
numba_gated_attention = define("numba_gated_attention", _forward, _forward_fake, backward=_backward,
                               setup_context=_setup_context)


def gated_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, log_g: Tensor, S0: Tensor | None = None,
                    z0: Tensor | None = None, *, chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor, Tensor]:
    """Gated causal linear attention with the numba kernels (the ``numba`` backend of causal ``rfa``).

    Args:
        phi_q, phi_k: ``(B, H, L, M)`` (the input gate folded into ``phi_k``); v: ``(B, H, L, E)``;
            float32/float64 CPU tensors.
        log_g: ``(B, H, L)`` log of the decays ``g_t`` in (0, 1] (0: no decay).
        S0, z0: the state ``(B, H, M, E)``, ``(B, H, M)`` carried in (None: zeros).
        chunk: checkpoint interval of the backward pass.

    Returns:
        ``(out (B, H, L, E), S, z)``: ``num / den`` (0 where ``den == 0``) and the final state.
    """
    B, H, L, M = phi_q.shape
    S0 = phi_q.new_zeros(B, H, M, v.shape[-1]) if S0 is None else S0
    z0 = phi_q.new_zeros(B, H, M) if z0 is None else z0
    num, den, S, z, _, _ = numba_gated_attention(phi_q, phi_k, v, torch.exp(log_g), S0, z0, chunk)
    return normalize(num, den), S, z
