# ruff: noqa: E702  -- the kernel reads best one short statement group per line
"""The performer's causal forward without autograd in one numba kernel: features and product fused.

:mod:`.numba_features` writes the positive features ``phi_q``, ``phi_k`` (each
``(B, H, L, M)``, 4x the size of q at M = 4D) and the linear product
(:mod:`attnkit_kernelized.linear.numba_ops`) reads them back: at L = 8,192, M = 256 that
is 128 MiB of fresh pages written and read per call, where the page faults alone cost
about as much as the exponentials. When no gradient is needed the features are never
kept, so here each sequence is walked once in blocks of ``chunk`` positions, and per
block:

* the block's query and key projections ``X W'^T`` go into buffers that stay in cache
  (:func:`attnkit_kernelized._tiles.axpy_rows`), are shifted as in :mod:`.numba_features`
  (queries: their row maximum; keys: ``|k'|^2/2``, 0 at padded keys, whatever they hold)
  and exponentiated there (:func:`attnkit_kernelized._vexp.exp_row`); the key pass also
  updates each feature's largest exponent and the sequence's smallest (the bounds the
  caller checks afterwards: beyond them the result is discarded for the log-space form);
* the causal product :func:`attnkit_kernelized._tiles.causal_block` that the unfused
  :func:`attnkit_kernelized.linear.numba_ops._causal_rows` runs too (normalised):
  ``out = x S`` from the earlier blocks' state, the causal
  triangle, ``S += y^T v``, ``z += sum y``.

The same arithmetic as the unfused path (features, then the product in blocks of
``min(chunk, MAX_BLOCK)``), in one pass; ``tests/test_performer_numba_fused.py`` holds it
to the unfused kernels and the torch expressions in float64.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from attnkit.numba_panel import empty_aligned
from attnkit.numba_vreduce import row_max, row_min

from .._numba import FASTMATH, arr, output, pad_rows, rows
from .._ops import define
from .._tiles import causal_block_normalised
from .._vexp import HALF, constants, exp_row
from ..linear.numba_ops import MAX_BLOCK
from .numba_features import _project

_FM = FASTMATH


# The block's features are two calls, not inlined into the kernel: in a copy of the kernel with parts switched
# off (session 42), the key pass's bookkeeping (the per-feature maximum and the minimum) cost about 7 ms of the
# kernel's ~120 at L = 8,192 (H = 8, M = 256, two threads) inlined, against about 2 ms as a call: the larger loop
# body slowed the code around it.

@numba.njit(cache=True, fastmath=_FM, nogil=True)
def _query_block(xb, X, WT, T, mb, zero):  # pragma: no cover - compiled
    """``xb[t] = exp(p - max p)`` with ``p = X[t] WT`` for ``t < T`` (the block's query features; ``mb``: scratch
    of ``T`` floats). Every row's maximum first, then the exponentials: a row's ``exp`` waits for its maximum,
    and with the two interleaved row by row the maxima's reductions did not overlap the exponentials (0.7 us of
    a 3.1 us block of 32 x 256; docs/benchmarks.md, "Session 61")."""
    _project(xb, X, WT, T)
    for t in range(T):
        mb[t] = row_max(xb[t])
    for t in range(T):
        exp_row(xb[t], mb[t])


@numba.njit(cache=True, fastmath=_FM, nogil=True)
def _key_block(yb, X, WT, T, pad, s2h, h, low, zero):  # pragma: no cover - compiled
    """``yb[t] = exp(p - s2h |X[t]|^2)`` with ``p = X[t] WT`` for ``t < T`` (the block's key features; 0 where
    ``pad[t]``, whatever ``X[t]`` holds; ``pad`` may be empty: no padding). Updates ``h[j]``, the largest key
    exponent of feature ``j``, and returns ``low`` lowered to the smallest exponent of the block's real keys."""
    D = X.shape[1]
    M = WT.shape[1]
    has_pad = pad.shape[0] > 0
    _project(yb, X, WT, T)
    for t in range(T):
        row = yb[t]
        if has_pad and pad[t]:
            for j in range(M):
                row[j] = zero
        else:
            kr = X[t]
            sq = zero
            for d in range(D):
                sq += kr[d] * kr[d]
            c = s2h * sq
            for j in range(M):
                h[j] = np.fmax(h[j], row[j] - c)    # fmax: a plain store, not a masked one (attnkit.numba_panel)
            low = min(low, row_min(row) - c)
            exp_row(row, c)
    return low


@numba.njit(cache=True, fastmath=_FM, nogil=True)
def _fused_rows(Q, K, V, WT, pad, s2h, cst, chunk, bound, S0, z0, out, S_out, z_out, hi, lo, PQ, PK, den, n0,
                n1):  # pragma: no cover - compiled
    """Sequences ``n0 <= n < n1`` of ``Q, K (N, L, D)``, ``V (N, L, E)``: ``out[n]`` the normalised causal linear
    attention of ``phi_q = exp(Q WT - rowmax)``, ``phi_k = exp(K WT - s2h |K|^2)`` (0 where ``pad[n, t]``; ``pad``
    may be ``(N, 0)``) and V from the state ``(S0[n], z0[n])``; the final state into ``S_out[n], z_out[n]``, the
    largest key exponent per feature into ``hi[n]`` and the smallest into ``lo[n]`` (-inf / +inf: no real key).
    A sequence stops at the first block whose key exponents leave ``[-bound, bound]``: its ``hi``/``lo`` then
    show it, and the caller discards the result. With ``PQ``, ``PK (N, L, M)`` and ``den (N, L)`` of length ``L``
    (not 0), the features and the denominators are written there too (what a backward needs)."""
    N, L, D = Q.shape
    M = WT.shape[1]
    E = V.shape[2]
    has_pad = pad.shape[1] > 0
    keep = PQ.shape[1] > 0
    zero = cst[HALF] - cst[HALF]
    ninf = -np.inf * cst[HALF] * 2   # typed -inf
    xb = empty_aligned(chunk, M, Q)   # the block's query features
    yb = empty_aligned(chunk, M, Q)   # the block's key features
    yT = empty_aligned(M, chunk, Q)   # ... transposed
    A = empty_aligned(chunk, chunk, Q)
    db = np.empty(chunk, dtype=Q.dtype)        # the block's denominators (scratch)
    mb = np.empty(chunk, dtype=Q.dtype)        # the block's query maxima (scratch)
    hb = np.empty(M, dtype=Q.dtype)      # hi[n] (a local buffer: updates of an argument array vectorise less)
    for n in range(n0, n1):
        qn = Q[n]; kn = K[n]; vn = V[n]; outn = out[n]
        S = empty_aligned(S0.shape[1], S0.shape[2], S0)   # the state: a panel operand (x S), on a cache line
        S[:] = S0[n]
        z = z0[n].copy()
        h = hb
        for j in range(M):
            h[j] = ninf
        low = -ninf
        for c0 in range(0, L, chunk):
            c1 = min(c0 + chunk, L)
            T = c1 - c0
            # ---- features of the block: queries shifted by their row maximum, keys by |k'|^2/2
            _query_block(xb, qn[c0:], WT, T, mb, zero)
            low = _key_block(yb, kn[c0:], WT, T, pad[n, c0:] if has_pad else pad[n], s2h, h, low, zero)
            if low < -bound or row_max(h) > bound:
                break               # the caller discards the result (hi, lo show why)
            causal_block_normalised(xb, yb, yT, A, db, vn, outn, S, z, c0, T, M, E, zero)
            if keep:
                for t in range(T):
                    a_ = xb[t]; b_ = yb[t]; pa = PQ[n, c0 + t]; pb = PK[n, c0 + t]
                    for j in range(M):
                        pa[j] = a_[j]
                        pb[j] = b_[j]
                    den[n, c0 + t] = db[t]
        S_out[n] = S
        z_out[n] = z
        lo[n] = low
        hi[n] = hb


def _fused(q: Tensor, k: Tensor, v: Tensor, w: Tensor, scale: float, pad: Tensor | None, S0: Tensor | None,
           z0: Tensor | None, chunk: int, bound: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return run_fused(q, k, v, w, scale, pad, S0, z0, chunk, bound, False)[:5]


def run_fused(q: Tensor, k: Tensor, v: Tensor, w: Tensor, scale: float, pad: Tensor | None, S0: Tensor | None,
              z0: Tensor | None, chunk: int, bound: float, keep: bool) -> tuple[Tensor, ...]:
    """The kernel on tensors: ``(out, S, z, hi, lo)`` as :func:`fused_causal` returns them, and with ``keep`` also
    ``(phi_q (B, H, L, M), phi_k (B, H, L, M), den (B, H, L))`` (the training operator's forward,
    :mod:`.numba_train`; no autograd here)."""
    B, H, L, D = q.shape
    M, E, N = w.shape[0], v.shape[-1], B * H
    dt = q.dtype
    if (q.device.type != "cpu" or dt not in (torch.float32, torch.float64) or k.dtype != dt or v.dtype != dt
            or k.shape != q.shape or v.shape[:3] != q.shape[:3]):
        raise ValueError(f"fused_causal: q, k, v must be float32 or float64 CPU tensors of one dtype and length; "
                         f"got {q.dtype} {tuple(q.shape)}, {k.dtype} {tuple(k.shape)}, {v.dtype} {tuple(v.shape)}")
    X, Kx, V = (arr(t).reshape(N, L, t.shape[-1]) for t in (q, k, v))
    padn = pad_rows(pad, B, H, L)
    npdt = X.dtype
    S0a = np.zeros((N, M, E), dtype=npdt) if S0 is None else arr(S0.to(dt)).reshape(N, M, E)
    z0a = np.zeros((N, M), dtype=npdt) if z0 is None else arr(z0.to(dt)).reshape(N, M)
    outa = output((N, L, E), npdt)
    S = np.empty((N, M, E), dtype=npdt)
    z = np.empty((N, M), dtype=npdt)
    hi = np.empty((N, M), dtype=npdt)
    lo = np.empty(N, dtype=npdt)
    Lk = L if keep else 0
    PQ, PK = output((N, Lk, M), npdt), output((N, Lk, M), npdt)
    den = output((N, Lk), npdt)
    args = (X, Kx, V, arr(w.to(dt).t()), padn, npdt.type(0.5 * scale), constants(npdt),
            max(1, min(int(chunk), MAX_BLOCK)), npdt.type(bound), S0a, z0a, outa, S, z, hi, lo, PQ, PK, den)
    rows(_fused_rows, N, *args)
    res = (torch.from_numpy(outa).view(B, H, L, E), torch.from_numpy(S).view(B, H, M, E),
           torch.from_numpy(z).view(B, H, M), torch.from_numpy(hi).view(B, H, M), torch.from_numpy(lo).view(B, H))
    if keep:
        res += (torch.from_numpy(PQ).view(B, H, L, M), torch.from_numpy(PK).view(B, H, L, M),
                torch.from_numpy(den).view(B, H, L))
    return res


def _fused_fake(q, k, v, w, scale, pad, S0, z0, chunk, bound):
    B, H, L, _ = q.shape
    M, E = w.shape[0], v.shape[-1]
    return (q.new_empty(B, H, L, E), q.new_empty(B, H, M, E), q.new_empty(B, H, M), q.new_empty(B, H, M),
            q.new_empty(B, H))


#: ``attnkit_kernelized::numba_performer_fused_causal`` (no autograd: the module calls it only without one)
numba_performer_fused_causal = define("numba_performer_fused_causal", _fused, _fused_fake)


def fused_causal(q: Tensor, k: Tensor, v: Tensor, w: Tensor, scale: float, pad: Tensor | None,
                 S0: Tensor | None, z0: Tensor | None, chunk: int, bound: float = float("inf")
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Causal performer attention on positive features, no autograd (the numba backend's bounded path).

    Args:
        q, k: ``(B, H, L, D)``; v: ``(B, H, L, E)``; float32 or float64 CPU tensors of one dtype.
        w: ``(M, D)``, the random projection times ``sqrt(scale)``.
        scale: the attention scale (``|k'|^2/2 = scale · |k|^2 / 2``).
        pad: ``(B, 1, L, 1)`` bool, True at padded keys, or None.
        S0, z0: the state ``(B, H, M, E)``, ``(B, H, M)`` relative to exponent 0 (None: zeros).
        chunk: positions per block (at most :data:`~attnkit_kernelized.linear.numba_ops.MAX_BLOCK`).
        bound: a sequence stops at the first block with a key exponent beyond ``[-bound, bound]`` (its output and
            state are then incomplete, and ``hi``/``lo`` show the violation).

    Returns:
        ``(out (B, H, L, E), S (B, H, M, E), z (B, H, M), hi (B, H, M), lo (B, H))`` with ``phi_k = exp(lk)``
        unshifted: valid only when ``hi`` and ``lo`` lie within the caller's bound (else features may have
        under- or overflowed and the caller must discard the result); ``hi``/``lo`` as in
        :func:`.numba_features.positive_features`.

    Raises:
        ValueError: inputs that are not float32/float64 CPU tensors of one dtype and length.
    """
    with torch.no_grad():
        return numba_performer_fused_causal(q.detach(), k.detach(), v.detach(), w.detach(), float(scale), pad,
                                            None if S0 is None else S0.detach(),
                                            None if z0 is None else z0.detach(), int(chunk), float(bound))
