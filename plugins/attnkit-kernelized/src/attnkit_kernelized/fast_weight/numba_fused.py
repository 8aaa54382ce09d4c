# ruff: noqa: E702  -- the kernel reads best one short statement group per line
"""``fast-weight``'s causal forward without autograd in one numba kernel: the feature map and the delta rule fused.

The unfused numba path computes ``phi(q)`` and ``phi(k)`` in torch (DPFP is a concatenation, a ``relu``, a
product, a sum and a division: five passes writing fresh ``(B, H, L, 2D)`` tensors, 32 MiB each at L = 8,192,
H = 8, D = 64, float32, about a third of the forward) and the delta rule
(:func:`.numba_ops._delta_chunked`) reads them back. When no gradient is needed the features are never kept, so
here each sequence is walked once in blocks of :data:`.numba_ops.BLOCK` positions, and per block:

* the block's query and key features (:func:`_phi_rows`: the module's map, sum-normalised when it is; a padded
  key's row is 0, whatever it holds) go into buffers that stay in cache;
* the chunked delta rule's block :func:`.numba_ops._delta_block` (the same code the unfused kernel runs):
  ``u = (I + tril(diag(b) K K^T, -1))^{-1} diag(b) (V - K S)``, ``out = Q S + tril(Q K^T) u``, ``S += K^T u``.

The betas (``sigmoid(w_h . k_t + b_h)`` or the fixed value) come in computed: one small torch pass. The same
arithmetic as the unfused path (the features' rounding aside); ``tests/test_fast_weight.py`` holds it to the
unfused kernel, the torch form and the naive reference in float64.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from attnkit.numba_panel import empty_aligned

from .._numba import FASTMATH, arr, output, pad_rows, rows
from .._ops import define
from .._vexp import HALF, constants, elu1_row
from .numba_ops import BLOCK, _delta_block

_FM = FASTMATH

#: the feature maps the kernel computes, by the module's ``feature_map`` name
KINDS = {"dpfp": 0, "elu": 1, "relu": 2, "softplus": 3}


@numba.njit(cache=True, fastmath=_FM, nogil=True)
def _phi_rows(fb, X, T, kind, nu, normalize, pad, r, nbuf, cst, is32, sums):  # pragma: no cover - compiled
    """``fb[t] = phi(X[t])`` for ``t < T`` (``X (>= T, D)``, ``fb (>= T, M)``), divided by its sum when
    ``normalize`` (a row summing to 0 stays 0), 0 where ``pad[t]`` (``pad`` may be empty: no padding). ``kind``:
    0 DPFP-``nu`` (``r = relu([x, -x])``, ``phi = [r * roll(r, 1), ..., r * roll(r, nu)]``), 1 ``elu(x) + 1``,
    2 ``relu(x)``, 3 ``softplus(x)`` (torch's: ``x`` above 20). ``r``: scratch of ``2D`` floats. A NaN input stays
    NaN (``relu`` keeps it, as torch's does). With ``normalize`` and ``sums`` not empty, ``sums[t]`` gets the row's
    sum before the division (what the backward divides by)."""
    D = X.shape[1]
    M = fb.shape[1]
    zero = cst[HALF] - cst[HALF]
    has_pad = pad.shape[0] > 0
    if kind == 1:
        for t in range(T):
            elu1_row(fb[t], X[t], zero + 1, nbuf, cst, is32)
    for t in range(T):
        f = fb[t]
        if has_pad and pad[t]:
            for j in range(M):
                f[j] = zero
            continue
        x = X[t]
        if kind == 0:
            n = 2 * D
            for d in range(D):
                a = x[d]
                r[d] = zero if a < zero else a        # NaN: kept (a < 0 is False)
                b = -a
                r[D + d] = zero if b < zero else b
            for i in range(1, nu + 1):
                o = (i - 1) * n
                for j in range(i):
                    f[o + j] = r[j] * r[j - i + n]
                for j in range(i, n):
                    f[o + j] = r[j] * r[j - i]
        elif kind == 2:
            for d in range(D):
                a = x[d]
                f[d] = zero if a < zero else a
        elif kind == 3:
            for d in range(D):
                a = x[d]
                f[d] = a if a > 20 else np.log1p(np.exp(a))
        if normalize:
            s = zero
            for j in range(M):
                s += f[j]
            if sums.shape[0] > 0:
                sums[t] = s
            if s != zero:
                for j in range(M):
                    f[j] = f[j] / s


@numba.njit(cache=True, fastmath=_FM, nogil=True)
def _fused_rows(Q, K, V, beta, pad, kind, nu, normalize, M, cst, is32, S0, out, S_out, n0,
                n1):  # pragma: no cover - compiled
    """Sequences ``n0 <= n < n1`` of ``Q, K (N, L, D)``, ``V (N, L, E)``, ``beta (N, L)``: ``out[n]`` the delta
    rule of ``phi(Q)``, ``phi(K)`` (:func:`_phi_rows`; key rows 0 where ``pad[n, t]``, ``pad`` may be ``(N, 0)``)
    from the state ``S0[n] (M, E)``; the final state into ``S_out[n]``."""
    N, L, D = Q.shape
    E = V.shape[2]
    has_pad = pad.shape[1] > 0
    B = BLOCK
    qb = empty_aligned(B, M, Q)
    kb = empty_aligned(B, M, Q)
    KT = empty_aligned(M, B, Q)
    U = empty_aligned(B, E, Q)
    G = empty_aligned(B, B, Q)
    r = np.empty(2 * D, dtype=Q.dtype)
    nbuf = np.empty(8, dtype=np.int32)        # elu1_row's scratch
    nosum = np.empty(0, dtype=Q.dtype)
    for n in range(n0, n1):
        qn = Q[n]; kn = K[n]; vn = V[n]; bn = beta[n]; on = out[n]
        S = empty_aligned(M, E, Q)
        S[:] = S0[n]
        for p0 in range(0, L, B):
            p1 = min(p0 + B, L)
            T = p1 - p0
            _phi_rows(qb, qn[p0:p1], T, kind, nu, normalize, pad[n, :0], r, nbuf, cst, is32, nosum)
            _phi_rows(kb, kn[p0:p1], T, kind, nu, normalize, pad[n, p0:p1] if has_pad else pad[n], r, nbuf, cst,
                      is32, nosum)
            _delta_block(qb, kb, vn[p0:p1], bn[p0:p1], on[p0:p1], S, KT, U, G, T, M, E)
        S_out[n] = S


def _fused(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, pad: Tensor | None, S0: Tensor | None, feature_map: str,
           nu: int, normalize: bool) -> tuple[Tensor, Tensor]:
    B, H, L, D = q.shape
    E, N, dt = v.shape[-1], B * H, q.dtype
    if (q.device.type != "cpu" or dt not in (torch.float32, torch.float64) or k.dtype != dt or v.dtype != dt
            or beta.dtype != dt or k.shape != q.shape or v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]):
        raise ValueError(f"fused_causal: q, k, v, beta must be float32 or float64 CPU tensors of one dtype and length; "
                         f"got {q.dtype} {tuple(q.shape)}, {k.dtype} {tuple(k.shape)}, {v.dtype} {tuple(v.shape)}, "
                         f"{beta.dtype} {tuple(beta.shape)}")
    if feature_map not in KINDS:
        raise ValueError(f"fused_causal: feature_map must be one of {sorted(KINDS)}; got {feature_map!r}")
    if nu < 1 or nu > D:
        raise ValueError(f"fused_causal: nu must lie in [1, D = {D}] (a roll wraps at most once); got {nu}")
    M = 2 * D * nu if feature_map == "dpfp" else D
    X, Kx, V = (arr(t).reshape(N, L, t.shape[-1]) for t in (q, k, v))
    bn = arr(beta).reshape(N, L)
    padn = pad_rows(pad, B, H, L)
    npdt = X.dtype
    S0a = np.zeros((N, M, E), dtype=npdt) if S0 is None else arr(S0.to(dt)).reshape(N, M, E)
    outa = output((N, L, E), npdt)
    S = np.empty((N, M, E), dtype=npdt)
    rows(_fused_rows, N, X, Kx, V, bn, padn, KINDS[feature_map], int(nu), bool(normalize), M, constants(npdt),
         npdt == np.float32, S0a, outa, S)
    return torch.from_numpy(outa).view(B, H, L, E), torch.from_numpy(S).view(B, H, M, E)


def _fused_fake(q, k, v, beta, pad, S0, feature_map, nu, normalize):
    B, H, L, D = q.shape
    M = 2 * D * nu if feature_map == "dpfp" else D
    return q.new_empty(B, H, L, v.shape[-1]), q.new_empty(B, H, M, v.shape[-1])


#: ``attnkit_kernelized::numba_delta_fused_causal`` (no autograd: the module calls it only without one)
numba_delta_fused_causal = define("numba_delta_fused_causal", _fused, _fused_fake)


def fused_causal(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, pad: Tensor | None, S0: Tensor | None, *,
                 feature_map: str = "dpfp", nu: int = 1, normalize: bool = True) -> tuple[Tensor, Tensor]:
    """The delta rule on ``phi(q)``, ``phi(k)`` computed in the kernel, no autograd (the numba backend's fused path).

    Args:
        q, k: ``(B, H, L, D)``; v: ``(B, H, L, E)``; beta: ``(B, H, L)`` write strengths; float32 or float64 CPU
            tensors of one dtype.
        pad: ``(B, 1, L, 1)`` bool, True at padded keys (their features are 0, whatever they hold), or None.
        S0: the state ``(B, H, M, E)`` carried in (None: zeros).
        feature_map: ``"dpfp"``, ``"elu"``, ``"relu"`` or ``"softplus"`` (:mod:`attnkit_kernelized.feature_maps`).
        nu: DPFP's rolls (``M = 2·D·nu``; the other maps: ``M = D``).
        normalize: divide each feature row by its sum (a row summing to 0 stays 0).

    Returns:
        ``(out (B, H, L, E), S (B, H, M, E))``: ``out_t = S_t^T phi(q_t)`` and the state after the last position.

    Raises:
        ValueError: inputs that are not float32/float64 CPU tensors of one dtype and length, another map, or
            ``nu`` outside ``[1, D]``.
    """
    with torch.no_grad():
        return numba_delta_fused_causal(q.detach(), k.detach(), v.detach(), beta.detach(), pad,
                                        None if S0 is None else S0.detach(), feature_map, int(nu), bool(normalize))
