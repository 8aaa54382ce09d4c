# ruff: noqa: E702  -- the polynomial's constants read best one group per line
"""numba CPU kernels of the performer's positive features on its bounded causal path.

The torch form of these features (:meth:`.module.PerformerAttention._bounded_causal`) is
a matmul followed by seven elementwise or reduction passes over ``(B, H, L, M)``
tensors (the squared norms subtracted, a row maximum, a shift, ``exp`` for the
queries; the shift, ``exp``, a maximum and a minimum over the keys), each a fresh
tensor, plus their autograd nodes. At M = 256 they took about 2.5x the time of the
linear-attention kernel they feed (measured, session 25 in docs/benchmarks.md).
Here each tensor gets **one** numba pass over blocks of 16 rows: the projection
``X W'^T`` of the block (:func:`attnkit_kernelized._tiles.axpy_rows`, into a buffer
that stays in cache), the shift, the bounds and ``exp`` there, and one write of the
features; the backward likewise forms ``g * phi`` a block at a time and multiplies it
by ``W'`` in the same pass (no ``(B, H, L, M)`` temporary). The autograd functions
below wrap them:

* queries: ``phi_q[r] = exp(p[r] - max_m p[r, m])`` with ``p = q W'^T``
  (``W' = sqrt(scale) · W``). The squared-norm term ``|q'|^2/2`` is a per-row
  constant, so it cancels against the row maximum and is never formed.
  Backward: ``dq = (g * phi_q) W'`` (the maximum is a detached shift).
* keys: ``lk = p - |k'|^2/2``, ``phi_k = exp(lk)`` (0 at padded keys) and, in
  the same pass, the largest exponent per feature over the real keys
  ``hi (B, H, M)`` and the smallest of a sequence ``lo (B, H)``, which decide
  whether the bounded path may run at all. Backward:
  ``dk = G W' - (sum_m G) · scale · k`` with ``G = g * phi_k`` (0 at padded keys).

``exp`` is a polynomial evaluated with an exact power-of-two scaling through an
integer view, in loops LLVM vectorises (numba has no vector ``exp`` without Intel's
SVML); relative error below 2.5e-7 in float32 and 1e-14 in float64, 0 below the
underflow bound, NaN for NaN. It is meant for the bounded path's arguments
(``|lk| <= 600`` in float64, ``<= 60`` in float32: no overflow).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from torch import Tensor

from .._busy import kernel_thread_count
from .._numba import FASTMATH, arr, dynamic, rows
from .._tiles import axpy_rows

# the plugin's flags (reassoc lets the row maximum and the norms vectorise) for the row loops; the exp apart
_FM = FASTMATH
_EXP_FM = {"contract", "nsz"}

_LOG2E, _LN2_HI, _LN2_LO, _HALF, _LO, _POLY = range(6)
#: exponent sentinels far outside every float's range: the argument underflowed (0) or was NaN
_UNDER, _NAN = -(1 << 20), 1 << 20


def _constants(dtype: np.dtype) -> np.ndarray:
    """Typed constants (a literal would be float64 in numba): ``[log2(e), ln2 hi, ln2 lo, 0.5, lowest argument,
    Taylor coefficients of exp, highest degree first (6 for float32, 12 for float64)]``."""
    f32 = np.dtype(dtype) == np.float32
    ln2 = (0.693359375, -2.12194440e-4) if f32 else (0.693145751953125, 1.42860682030941723212e-6)
    deg = 6 if f32 else 12
    head = [1.4426950408889634, ln2[0], ln2[1], 0.5, -87.0 if f32 else -708.0]
    return np.array(head + [1.0 / math.factorial(i) for i in range(deg, -1, -1)], dtype=dtype)


@numba.njit(cache=True, fastmath=_EXP_FM)
def _exp_row(row, c, nbuf, cst, is32):  # pragma: no cover - compiled
    """``row[j] = exp(row[j] - c)`` in place (``nbuf``: int32 scratch of ``row``'s length).

    Compiled apart, without ``reassoc``: reassociation partly folds the two-constant (Cody-Waite)
    reduction ``(x - n·ln2_hi) - n·ln2_lo``, and the float32 relative error grew with ``|x|`` to 4.1e-7
    at x = -80 (2.3e-7 without it; measured against NumPy). Called per row; LLVM keeps the flags of
    these instructions when it inlines them. An elementwise loop vectorises without ``reassoc``."""
    log2e = cst[_LOG2E]; c1 = cst[_LN2_HI]; c2 = cst[_LN2_LO]; half = cst[_HALF]; lo = cst[_LO]
    n = row.shape[0]
    if is32:
        a6 = cst[_POLY]; a5 = cst[_POLY + 1]; a4 = cst[_POLY + 2]; a3 = cst[_POLY + 3]; a2 = cst[_POLY + 4]
        a1 = cst[_POLY + 5]; a0 = cst[_POLY + 6]
        for j in range(n):
            xj = row[j] - c
            xc = xj if xj > lo else lo
            nf = np.floor(half + xc * log2e)           # round(x log2 e)
            r = (xc - nf * c1) - nf * c2
            row[j] = (((((a6 * r + a5) * r + a4) * r + a3) * r + a2) * r + a1) * r + a0
            e = np.int32(nf)
            nbuf[j] = e if xj > lo else (_UNDER if xj <= lo else _NAN)   # below the bound: 0; NaN: NaN
        ri = row.view(np.int32)
        for j in range(n):
            e = nbuf[j]
            ri[j] = (ri[j] + (e << 23)) if e > _UNDER and e < _NAN else (0 if e <= _UNDER else 0x7FC00000)
    else:
        K = cst.shape[0]
        for j in range(n):
            xj = row[j] - c
            xc = xj if xj > lo else lo
            nf = np.floor(half + xc * log2e)
            r = (xc - nf * c1) - nf * c2
            p = cst[_POLY]
            for i in range(_POLY + 1, K):
                p = p * r + cst[i]
            row[j] = p
            e = np.int32(nf)
            nbuf[j] = e if xj > lo else (_UNDER if xj <= lo else _NAN)
        rl = row.view(np.int64)
        for j in range(n):
            e = np.int64(nbuf[j])
            rl[j] = (rl[j] + (e << 52)) if e > _UNDER and e < _NAN else (0 if e <= _UNDER else 0x7FF8000000000000)


_BLOCK = 16   # rows per projection block (a (16, M) buffer stays in L1/L2 while it is exponentiated)
_ITEM = 64    # rows per parallel work item of the row-wise kernels


@numba.njit(cache=True, fastmath=_FM, nogil=True)
def _query_rows(X, WT, P, cst, is32, r0, r1):  # pragma: no cover - compiled
    """``P[r] = exp(p - max p)`` with ``p = X[r] WT`` for the rows ``r0 <= r < r1`` (``X (R, D)``, ``WT (D, M)``,
    ``P (R, M)``). Each block of rows is projected into a buffer of its own (:func:`axpy_rows`), exponentiated
    there and copied out (writes into argument arrays vectorise less: LLVM must assume they alias the inputs)."""
    D, M = WT.shape
    zero = cst[_HALF] - cst[_HALF]
    buf = np.empty((_BLOCK, M), dtype=P.dtype)
    nbuf = np.empty(M, dtype=np.int32)
    for b0 in range(r0, r1, _BLOCK):
        nb = min(_BLOCK, r1 - b0)
        for i in range(nb):
            row = buf[i]
            for j in range(M):
                row[j] = zero
        axpy_rows(buf, X[b0:], WT, nb, D, M)
        for i in range(nb):
            row = buf[i]
            m = row[0]
            for j in range(M):
                m = row[j] if row[j] > m else m
            _exp_row(row, m, nbuf, cst, is32)
            out = P[b0 + i]
            for j in range(M):
                out[j] = row[j]


@numba.njit(cache=True, fastmath=_FM, nogil=True)
def _key_rows(X, WT, pad, s2h, cst, is32, P, hi, lo, n0, n1):  # pragma: no cover - compiled
    """For the sequences ``n0 <= n < n1`` of ``X (N, L, D)``: ``P[n, t] = exp(X[n, t] WT - s2h |X[n, t]|^2)``
    (0 where ``pad[n, t]``; ``pad`` may be ``(N, 0)``: nothing padded), ``hi[n, m]`` the largest exponent of
    feature m and ``lo[n]`` the smallest exponent over the real keys (-inf and +inf when there is none)."""
    N, L, D = X.shape
    M = WT.shape[1]
    has_pad = pad.shape[1] > 0
    zero = cst[_HALF] - cst[_HALF]
    ninf = -np.inf * cst[_HALF] * 2   # typed -inf
    buf = np.empty((_BLOCK, M), dtype=P.dtype)
    nbuf = np.empty(M, dtype=np.int32)
    for n in range(n0, n1):
        Xn = X[n]; Pn = P[n]
        h = hi[n]
        for j in range(M):
            h[j] = ninf
        low = -ninf
        for b0 in range(0, L, _BLOCK):
            nb = min(_BLOCK, L - b0)
            for i in range(nb):
                row = buf[i]
                for j in range(M):
                    row[j] = zero
            axpy_rows(buf, Xn[b0:], WT, nb, D, M)
            for i in range(nb):
                row = buf[i]
                out = Pn[b0 + i]
                if has_pad and pad[n, b0 + i]:
                    for j in range(M):
                        out[j] = zero
                    continue
                kr = Xn[b0 + i]
                sq = zero
                for d in range(D):
                    sq += kr[d] * kr[d]
                c = s2h * sq
                rmin = row[0]
                for j in range(M):
                    x = row[j]
                    rmin = x if x < rmin else rmin
                    xc = x - c
                    h[j] = xc if xc > h[j] else h[j]
                low = min(low, rmin - c)
                _exp_row(row, c, nbuf, cst, is32)
                for j in range(M):
                    out[j] = row[j]
        lo[n] = low


@numba.njit(cache=True, fastmath=_FM, nogil=True)
def _back_rows(G, PHI, W, X, pad, scale, DX, r0, r1):  # pragma: no cover - compiled
    """``DX[r] = (G[r] * PHI[r]) W - scale · sum_m (G[r] * PHI[r])_m · X[r]`` for ``r0 <= r < r1``
    (``G, PHI (R, M)``, ``W (M, D)``, ``X, DX (R, D)``; ``scale = 0``: the queries' form, X unused);
    0 where ``pad[r]`` (``pad`` may be empty: nothing padded)."""
    M, D = W.shape
    has_pad = pad.shape[0] > 0
    zero = W[0, 0] - W[0, 0]
    gb = np.empty((_BLOCK, M), dtype=DX.dtype)
    ob = np.empty((_BLOCK, D), dtype=DX.dtype)
    for b0 in range(r0, r1, _BLOCK):
        nb = min(_BLOCK, r1 - b0)
        for i in range(nb):
            g = G[b0 + i]; f = PHI[b0 + i]; row = gb[i]; o = ob[i]
            for j in range(M):
                row[j] = g[j] * f[j]
            for d in range(D):
                o[d] = zero
        axpy_rows(ob, gb, W, nb, M, D)
        for i in range(nb):
            o = ob[i]; out = DX[b0 + i]
            if has_pad and pad[b0 + i]:
                for d in range(D):
                    out[d] = zero
                continue
            if scale != 0:
                row = gb[i]
                s = zero
                for j in range(M):
                    s += row[j]
                s = s * scale
                x = X[b0 + i]
                for d in range(D):
                    out[d] = o[d] - s * x[d]
            else:
                for d in range(D):
                    out[d] = o[d]


@numba.njit(parallel=True, cache=True, nogil=True)
def _query_team(X, WT, P, cst, is32):  # pragma: no cover - compiled
    R = X.shape[0]
    for b in numba.prange((R + _ITEM - 1) // _ITEM):
        i = np.int64(b)
        _query_rows(X, WT, P, cst, is32, i * _ITEM, min(R, (i + 1) * _ITEM))


@numba.njit(parallel=True, cache=True, nogil=True)
def _key_team(X, WT, pad, s2h, cst, is32, P, hi, lo):  # pragma: no cover - compiled
    for n in numba.prange(X.shape[0]):
        i = np.int64(n)
        _key_rows(X, WT, pad, s2h, cst, is32, P, hi, lo, i, i + 1)


@numba.njit(parallel=True, cache=True, nogil=True)
def _back_team(G, PHI, W, X, pad, scale, DX):  # pragma: no cover - compiled
    R = G.shape[0]
    for b in numba.prange((R + _ITEM - 1) // _ITEM):
        i = np.int64(b)
        _back_rows(G, PHI, W, X, pad, scale, DX, i * _ITEM, min(R, (i + 1) * _ITEM))


def _run_rows(kernel, team, R: int, *args) -> None:
    """``team(*args)`` on numba's threads, or while the machine is busy (see .._busy) ``kernel(*args, r0, r1)``
    over blocks of ``_ITEM`` rows handed out by Python threads."""
    if kernel_thread_count() is not None:
        blocks = -(-R // _ITEM)
        rows(lambda b0, b1: kernel(*args, b0 * _ITEM, min(R, b1 * _ITEM)), blocks)
    else:
        dynamic(team, *args)


class _QueryFeatures(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, w: Tensor) -> Tensor:
        B, H, L, D = q.shape
        M = w.shape[0]
        X = arr(q).reshape(B * H * L, D)
        phi = torch.empty(B, H, L, M, dtype=q.dtype)
        P = phi.numpy().reshape(B * H * L, M)
        cst = _constants(X.dtype)
        _run_rows(_query_rows, _query_team, X.shape[0], X, arr(w.t()), P, cst, X.dtype == np.float32)
        ctx.save_for_backward(phi, w)
        return phi

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None
        phi, w = ctx.saved_tensors
        B, H, L, M = phi.shape
        D = w.shape[1]
        dq = torch.empty(B, H, L, D, dtype=phi.dtype)
        PHI = phi.numpy().reshape(-1, M)
        no_pad = np.zeros(0, dtype=np.bool_)
        _run_rows(_back_rows, _back_team, PHI.shape[0], arr(g.to(phi.dtype)).reshape(-1, M), PHI, arr(w),
                  np.zeros((1, D), dtype=PHI.dtype), no_pad, PHI.dtype.type(0), dq.numpy().reshape(-1, D))
        return dq, None


class _KeyFeatures(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k: Tensor, w: Tensor, scale: float, pad: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        B, H, L, D = k.shape
        M = w.shape[0]
        X = arr(k).reshape(B * H, L, D)
        padn = (np.zeros((B * H, 0), dtype=np.bool_) if pad is None
                else arr(pad[:, 0, :, 0].reshape(B, 1, L).expand(B, H, L).reshape(B * H, L)))
        phi = torch.empty(B, H, L, M, dtype=k.dtype)
        hi = np.empty((B * H, M), dtype=X.dtype)
        lo = np.empty(B * H, dtype=X.dtype)
        cst = _constants(X.dtype)
        args = (X, arr(w.t()), padn, X.dtype.type(0.5 * scale), cst, X.dtype == np.float32,
                phi.numpy().reshape(B * H, L, M), hi, lo)
        if kernel_thread_count() is not None:   # busy machine (see .._busy): sequences handed out by Python threads
            rows(_key_rows, B * H, *args)
        else:
            dynamic(_key_team, *args)
        hi_t, lo_t = torch.from_numpy(hi).view(B, H, M), torch.from_numpy(lo).view(B, H)
        ctx.mark_non_differentiable(hi_t, lo_t)
        ctx.save_for_backward(phi, w, k)
        ctx.scale = scale
        ctx.padn = padn.reshape(-1)
        return phi, hi_t, lo_t

    @staticmethod
    def backward(ctx, g: Tensor, _g_hi: Tensor, _g_lo: Tensor) -> tuple[Tensor | None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        phi, w, k = ctx.saved_tensors
        B, H, L, M = phi.shape
        D = w.shape[1]
        dk = torch.empty(B, H, L, D, dtype=phi.dtype)
        PHI = phi.numpy().reshape(-1, M)
        # 0 at padded keys, whatever they hold (NaN, Inf): phi is 0 there and the row is skipped
        _run_rows(_back_rows, _back_team, PHI.shape[0], arr(g.to(phi.dtype)).reshape(-1, M), PHI, arr(w),
                  arr(k).reshape(-1, D), ctx.padn, PHI.dtype.type(ctx.scale), dk.numpy().reshape(-1, D))
        return dk, None, None, None


def positive_features(q: Tensor, k: Tensor, w: Tensor, scale: float, pad: Tensor | None
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The bounded causal path's features on CPU, differentiable in ``q`` and ``k``.

    Args:
        q: ``(B, H, L, D)``; k: ``(B, H, L, D)``; float32 or float64 CPU tensors.
        w: ``(M, D)``, the random projection times ``sqrt(scale)`` (no gradient).
        scale: the attention scale (``|k'|^2/2 = scale · |k|^2 / 2``).
        pad: ``(B, 1, L, 1)`` bool, True at padded keys (:func:`..common.padded`), or None.

    Returns:
        ``(phi_q (B, H, L, M), phi_k (B, H, L, M), hi (B, H, M), lo (B, H))``: ``phi_q`` each query row
        shifted by its largest exponent, ``phi_k = exp(W' k' - |k'|^2/2)`` (0 at padded keys), ``hi`` the
        largest key exponent per feature and ``lo`` the smallest of each sequence over the real keys
        (``-inf`` / ``+inf`` when a sequence has none); ``hi`` and ``lo`` carry no gradient.
    """
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64) or k.dtype != q.dtype:
        raise ValueError(f"positive_features: q and k must be float32 or float64 CPU tensors of one dtype; got "
                         f"{q.dtype} and {k.dtype} on {q.device}")
    w = w.detach().to(q.dtype)
    phi_q = _QueryFeatures.apply(q, w)
    phi_k, hi, lo = _KeyFeatures.apply(k, w, float(scale), pad)
    return phi_q, phi_k, hi, lo
