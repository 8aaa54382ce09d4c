# ruff: noqa: E702  -- the kernels read best one short statement group per line
"""``fast-weight``'s causal form under autograd on the numba backend: the feature map and the delta rule as one
operator, from ``q, k, v`` and the betas.

On the unfused path a training step runs the map as two operators (:mod:`.numba_features`: a pass over q and one
over k) and the delta rule as a third (:mod:`.numba_ops`); the backward writes ``d phi_q`` and ``d phi_k`` and
runs the map's backward over them in two more passes. Those four passes are short and memory-bound and each is
handed to the threads on its own: with another process keeping the cores busy they slowed about 4x where the delta
rule's kernels slowed 2.2x (``torch.profiler``, docs/benchmarks.md, "Session 66").

:data:`numba_fast_weight_causal` is one differentiable operator whose work items are whole sequences:

* forward (:func:`_train_rows`): per block of :data:`.numba_ops.BLOCK` positions, the block's features
  (:func:`.numba_fused._phi_rows`, as the fused no-grad kernel computes them; a padded key's row is 0) in cache,
  the delta rule's block (:func:`.numba_ops._delta_block`) on them, the state kept every ``chunk`` positions; the
  features and their row sums are written for the backward;
* backward (:func:`_train_back_rows`): per sequence, the delta rule's backward from the checkpoints
  (:func:`.numba_ops._delta_chunked_backward`), then the map's backward on the sequence's rows
  (:func:`.numba_features._phi_back`) while they are warm; a padded key's gradient is 0.

The same arithmetic as the unfused operators (features, the delta rule, the map's backward), in the same order:
the results agree with them to the bit.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import torch
from torch import Tensor

from attnkit.numba_panel import empty_aligned

from .._busy import busy_threads
from .._numba import FASTMATH, arr, output, pad_rows, rows
from .._ops import define
from .._vexp import HALF, constants
from .numba_features import _phi_back
from .numba_fused import KINDS, _phi_rows
from .numba_ops import BLOCK, _delta_block, _delta_chunked_backward

__all__ = ["fast_weight_causal", "numba_fast_weight_causal"]


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def _train_rows(Q, K, V, beta, pad, kind, nu, normalize, cst, is32, chunk, S0, out, ckpt, PQ, PK, SQ, SK, n0,
                n1):  # pragma: no cover - compiled
    """Sequences ``n0 <= n < n1`` of ``Q, K (N, L, D)``, ``V (N, L, E)``, ``beta (N, L)``: ``out[n]`` the delta
    rule of ``phi(Q)``, ``phi(K)`` (key rows 0 where ``pad[n, t]``; ``pad`` may be ``(N, 0)``) from ``S0[n]``;
    the state before every ``chunk``-th position and at the end into ``ckpt[n]`` (as
    :func:`.numba_ops._delta_chunked` keeps it), the features into ``PQ[n]``, ``PK[n]`` ``(L, M)`` and, with
    ``normalize``, their rows' sums before the division into ``SQ[n]``, ``SK[n]`` (0 at padded keys)."""
    N, L, D = Q.shape
    M = PQ.shape[2]
    E = V.shape[2]
    has_pad = pad.shape[1] > 0
    n_chunks = (L + chunk - 1) // chunk
    B = max(1, min(BLOCK, chunk))
    qb = empty_aligned(BLOCK, M, Q)
    kb = empty_aligned(BLOCK, M, Q)
    KT = empty_aligned(M, BLOCK, Q)
    U = empty_aligned(BLOCK, E, Q)
    G = empty_aligned(BLOCK, BLOCK, Q)
    r = np.empty(2 * D, dtype=Q.dtype)
    nbuf = np.empty(8, dtype=np.int32)        # elu1_row's scratch
    zero = cst[HALF] - cst[HALF]
    sq = np.zeros(BLOCK if normalize else 0, dtype=Q.dtype)
    sk = np.zeros(BLOCK if normalize else 0, dtype=Q.dtype)
    for n in range(n0, n1):
        qn = Q[n]; kn = K[n]; vn = V[n]; bn = beta[n]; on = out[n]; pq = PQ[n]; pk = PK[n]
        S = empty_aligned(M, E, Q)
        S[:] = S0[n]
        for ci in range(n_chunks):
            ckpt[n, ci] = S
            c1 = min((ci + 1) * chunk, L)
            for p0 in range(ci * chunk, c1, B):
                p1 = min(p0 + B, c1)
                T = p1 - p0
                _phi_rows(qb, qn[p0:p1], T, kind, nu, normalize, pad[n, :0], r, nbuf, cst, is32, sq)
                padb = pad[n, p0:p1] if has_pad else pad[n]
                _phi_rows(kb, kn[p0:p1], T, kind, nu, normalize, padb, r, nbuf, cst, is32, sk)
                _delta_block(qb, kb, vn[p0:p1], bn[p0:p1], on[p0:p1], S, KT, U, G, T, M, E)
                for t in range(T):
                    a_ = qb[t]; b_ = kb[t]; da = pq[p0 + t]; db = pk[p0 + t]
                    for j in range(M):
                        da[j] = a_[j]
                        db[j] = b_[j]
                if normalize:
                    for t in range(T):
                        SQ[n, p0 + t] = sq[t]
                        SK[n, p0 + t] = zero if has_pad and padb[t] else sk[t]
        ckpt[n, n_chunks] = S


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def _train_back_rows(Q, K, PQ, PK, SQ, SK, V, beta, pad, ckpt, dout, dSL, chunk, kind, nu, normalize, dPQ, dPK, dq,
                     dk, dv, db, dS0, n0, n1):  # pragma: no cover - compiled
    """Gradients of :func:`_train_rows` for the sequences ``n0 <= n < n1``: the delta rule's
    (:func:`.numba_ops._delta_chunked_backward`: ``d phi`` into ``dPQ[n]``, ``dPK[n]``, and ``dv``, ``db``,
    ``dS0``), then the map's backward on the sequence's rows into ``dq[n]``, ``dk[n]`` (0 at padded keys)."""
    L = Q.shape[1]
    D = Q.shape[2]
    has_pad = pad.shape[1] > 0
    zero = dq.dtype.type(0)
    for n in range(n0, n1):
        _delta_chunked_backward(PQ, PK, V, beta, ckpt, dout, dSL, chunk, BLOCK, dPQ, dPK, dv, db, dS0, n, n + 1)
        _phi_back(Q[n], PQ[n], SQ[n], dPQ[n], dq[n], kind, nu, normalize, 0, L)
        _phi_back(K[n], PK[n], SK[n], dPK[n], dk[n], kind, nu, normalize, 0, L)
        if has_pad:
            for t in range(L):
                if pad[n, t]:
                    row = dk[n, t]
                    for d in range(D):
                        row[d] = zero


def _causal(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, pad: Tensor | None, S0: Tensor, chunk: int, kind: int,
            nu: int, normalize: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    B, H, L, D = q.shape
    E, N = v.shape[-1], B * H
    dt = q.dtype
    if (q.device.type != "cpu" or dt not in (torch.float32, torch.float64) or k.dtype != dt or v.dtype != dt
            or beta.dtype != dt or S0.dtype != dt or k.shape != q.shape or v.shape[:3] != q.shape[:3]
            or beta.shape != q.shape[:3]):
        raise ValueError(f"numba_fast_weight_causal: q, k, v, beta, S0 must be float32 or float64 CPU tensors of one "
                         f"dtype and length; got {q.dtype} {tuple(q.shape)}, {k.dtype} {tuple(k.shape)}, "
                         f"{v.dtype} {tuple(v.shape)}, {beta.dtype} {tuple(beta.shape)}, {S0.dtype}")
    M = S0.shape[-2]
    X, Kx, V = (arr(t).reshape(N, L, t.shape[-1]) for t in (q, k, v))
    npdt = X.dtype
    nc = -(-L // chunk) + 1
    out, ckpt = output((N, L, E), npdt), np.empty((N, nc, M, E), dtype=npdt)
    PQ, PK = output((N, L, M), npdt), output((N, L, M), npdt)
    Ls = L if normalize else 0
    SQ, SK = np.empty((N, Ls), dtype=npdt), np.empty((N, Ls), dtype=npdt)
    rows(_train_rows, N, X, Kx, V, arr(beta).reshape(N, L), pad_rows(pad, B, H, L), kind, nu, normalize,
         constants(npdt), npdt == np.float32, chunk, arr(S0).reshape(N, M, E), out, ckpt, PQ, PK, SQ, SK)
    return (torch.from_numpy(out).view(B, H, L, E), torch.from_numpy(ckpt[:, -1].copy()).view(B, H, M, E),
            torch.from_numpy(ckpt).view(B, H, nc, M, E), torch.from_numpy(PQ).view(B, H, L, M),
            torch.from_numpy(PK).view(B, H, L, M), torch.from_numpy(SQ).view(B, H, Ls),
            torch.from_numpy(SK).view(B, H, Ls))


def _causal_fake(q, k, v, beta, pad, S0, chunk, kind, nu, normalize):
    B, H, L, _ = q.shape
    M, E = S0.shape[-2], v.shape[-1]
    Ls = L if normalize else 0
    return (q.new_empty(B, H, L, E), S0.new_empty(S0.shape), q.new_empty(B, H, -(-L // chunk) + 1, M, E),
            q.new_empty(B, H, L, M), q.new_empty(B, H, L, M), q.new_empty(B, H, Ls), q.new_empty(B, H, Ls))


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, beta, pad, S0, chunk, kind, nu, normalize = inputs
    _, _, ckpt, phi_q, phi_k, sums_q, sums_k = output
    ctx.mark_non_differentiable(ckpt, phi_q, phi_k, sums_q, sums_k)
    ctx.save_for_backward(q, k, v, beta, pad, ckpt, phi_q, phi_k, sums_q, sums_k)
    ctx.args = (chunk, kind, nu, normalize)
    ctx.device = q.device        # not read back from ctx.saved_tensors: checkpointing allows one unpack
    ctx.set_materialize_grads(False)


def _backward_impl(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, pad: Tensor | None, ckpt: Tensor, phi_q: Tensor,
                   phi_k: Tensor, sums_q: Tensor, sums_k: Tensor, g_out: Tensor, g_S: Tensor, chunk: int, kind: int,
                   nu: int, normalize: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    B, H, L, D = q.shape
    M, E, N = phi_q.shape[-1], v.shape[-1], B * H
    Ls = sums_q.shape[-1]
    npdt = arr(q).dtype

    def seq(t: Tensor, *shape: int) -> np.ndarray:
        return arr(t.to(q.dtype)).reshape(N, *shape)

    dPQ, dPK = output((N, L, M), npdt), output((N, L, M), npdt)
    dq, dk, dv = output((N, L, D), npdt), output((N, L, D), npdt), output((N, L, E), npdt)
    db, dS0 = np.empty((N, L), dtype=npdt), np.empty((N, M, E), dtype=npdt)
    rows(_train_back_rows, N, seq(q, L, D), seq(k, L, D), seq(phi_q, L, M), seq(phi_k, L, M), seq(sums_q, Ls),
         seq(sums_k, Ls), seq(v, L, E), seq(beta, L), pad_rows(pad, B, H, L), seq(ckpt, -(-L // chunk) + 1, M, E),
         seq(g_out, L, E), seq(g_S, M, E), chunk, kind, nu, normalize, dPQ, dPK, dq, dk, dv, db, dS0)
    return (torch.from_numpy(dq).view(B, H, L, D), torch.from_numpy(dk).view(B, H, L, D),
            torch.from_numpy(dv).view(B, H, L, E), torch.from_numpy(db).view(B, H, L),
            torch.from_numpy(dS0).view(B, H, M, E))


def _backward_fake(q, k, v, beta, pad, ckpt, phi_q, phi_k, sums_q, sums_k, g_out, g_S, chunk, kind, nu, normalize):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta),
            g_S.new_empty(g_S.shape))


#: ``attnkit_kernelized::numba_fast_weight_causal_backward``: the gradients of :data:`numba_fast_weight_causal`
#: w.r.t. ``q``, ``k``, ``v``, ``beta``, ``S0`` (an operator itself, so the backward traces)
numba_fast_weight_causal_backward = define("numba_fast_weight_causal_backward", _backward_impl, _backward_fake)


def _backward(ctx: Any, g_out: Tensor | None, g_S: Tensor | None, *_rest: Any) -> tuple[Tensor | None, ...]:
    with busy_threads(ctx.device):       # see .._busy: one torch thread on a busy machine
        q, k, v, beta, pad, ckpt, phi_q, phi_k, sums_q, sums_k = ctx.saved_tensors
        B, H, L, _ = q.shape
        M, E = phi_q.shape[-1], v.shape[-1]
        g_out = q.new_zeros(B, H, L, E) if g_out is None else g_out.contiguous()
        g_S = q.new_zeros(B, H, M, E) if g_S is None else g_S.contiguous()
        dq, dk, dv, db, dS0 = numba_fast_weight_causal_backward(q, k, v, beta, pad, ckpt, phi_q, phi_k, sums_q,
                                                                sums_k, g_out, g_S, *ctx.args)
        return dq, dk, dv, db, None, dS0, None, None, None, None


#: ``attnkit_kernelized::numba_fast_weight_causal``: ``(q, k (B, H, L, D), v (B, H, L, E), beta (B, H, L),
#: pad (B, 1, L, 1) or None, S0 (B, H, M, E), chunk, kind, nu, normalize) -> (out (B, H, L, E), S (B, H, M, E),
#: checkpoints, phi_q, phi_k (B, H, L, M), their row sums (B, H, L or 0))``, differentiable in ``q``, ``k``, ``v``,
#: ``beta`` and ``S0``
numba_fast_weight_causal = define("numba_fast_weight_causal", _causal, _causal_fake, backward=_backward,
                                  setup_context=_setup)


def fast_weight_causal(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, pad: Tensor | None, S0: Tensor | None, *,
                       chunk: int, feature_map: str = "dpfp", nu: int = 1, normalize: bool = True
                       ) -> tuple[Tensor, Tensor]:
    """The delta rule on ``phi(q)``, ``phi(k)`` computed in the kernels, differentiable (the numba backend's
    training form).

    Args:
        q, k: ``(B, H, L, D)``; v: ``(B, H, L, E)``; beta: ``(B, H, L)`` write strengths; float32 or float64 CPU
            tensors of one dtype.
        pad: ``(B, 1, L, 1)`` bool, True at padded keys (their features are 0 and their gradients in ``k`` 0,
            whatever they hold; ``v`` must be 0 there, as the module makes it), or None.
        S0: the state ``(B, H, M, E)`` carried in (None: zeros).
        chunk: checkpoint interval of the backward (positions).
        feature_map: ``"dpfp"``, ``"elu"``, ``"relu"`` or ``"softplus"`` (:mod:`attnkit_kernelized.feature_maps`).
        nu: DPFP's rolls (``M = 2·D·nu``, ``nu`` in ``[1, D]``; the other maps: ``M = D``).
        normalize: divide each feature row by its sum (a row summing to 0 stays 0).

    Returns:
        ``(out (B, H, L, E), S (B, H, M, E))``.

    Raises:
        ValueError: inputs that are not float32/float64 CPU tensors of one dtype and length, another map, ``nu``
            out of range, or ``chunk < 1``.
    """
    B, H, L, D = q.shape
    if feature_map not in KINDS:
        raise ValueError(f"fast_weight_causal: feature_map must be one of {sorted(KINDS)}; got {feature_map!r}")
    if nu < 1 or nu > D:
        raise ValueError(f"fast_weight_causal: nu must lie in [1, D = {D}] (a roll wraps at most once); got {nu}")
    if chunk < 1:
        raise ValueError(f"fast_weight_causal: chunk must be at least 1; got {chunk}")
    M = 2 * D * nu if feature_map == "dpfp" else D
    if S0 is None:
        S0 = q.new_zeros(B, H, M, v.shape[-1])
    out, S, *_ = numba_fast_weight_causal(q, k, v, beta, pad, S0, int(chunk), KINDS[feature_map], int(nu),
                                          bool(normalize))
    return out, S
