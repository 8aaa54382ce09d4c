# ruff: noqa: E702  -- the kernel reads best one short statement group per line
"""``linear``'s causal forward without autograd in one numba kernel: ``elu(x) + 1`` and the product fused.

The unfused numba path writes ``phi_q = elu(q) + 1`` and ``phi_k`` (:mod:`.numba_elu`, each the size of
q: 16 MiB of fresh pages at L = 8,192, H = 8, D = 64, float32) and the product
(:func:`.numba_ops._causal_rows`) reads them back. When no gradient is needed the features are never
kept, so here each sequence is walked once in blocks of ``chunk`` positions, and per block:

* the block's query and key features ``elu(s x) + 1`` (``s`` the square root of the attention scale, 1
  without one) go into buffers that stay in cache, by :func:`attnkit_kernelized._vexp.elu1_row` over the
  block's rows as one flat run, as :mod:`.numba_elu` computes them (the same values); a padded key's row is 0,
  whatever it holds;
* the causal product :func:`attnkit_kernelized._tiles.causal_block` that the unfused
  :func:`.numba_ops._causal_rows` runs too (normalised, 0 where the denominator is 0):
  ``out = x S`` from the earlier blocks' state, the causal triangle, ``S += y^T v``,
  ``z += sum y``.

The same arithmetic as the unfused path, in one pass; ``tests/test_linear_numba_fused.py`` holds it to the
torch expressions and the unfused path in float64.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from attnkit.numba_panel import empty_aligned

from .._numba import FASTMATH, arr, output, pad_rows, rows
from .._ops import define
from .._tiles import causal_block_normalised
from .._vexp import HALF, constants, elu1_row
from .numba_ops import MAX_BLOCK

_FM = FASTMATH


@numba.njit(cache=True, fastmath=_FM, nogil=True)
def _fused_rows(Q, K, V, pad, scale, cst, is32, chunk, S0, z0, out, S_out, z_out, PQ, PK, den, n0,
                n1):  # pragma: no cover - compiled
    """Sequences ``n0 <= n < n1`` of ``Q, K (N, L, D)``, ``V (N, L, E)``: ``out[n]`` the normalised causal linear
    attention of ``phi = elu(scale x) + 1`` (key rows 0 where ``pad[n, t]``; ``pad`` may be ``(N, 0)``) and V
    from the state ``(S0[n], z0[n])``; the final state into ``S_out[n], z_out[n]``. With ``PQ``, ``PK (N, L, D)``
    and ``den (N, L)`` of length ``L`` (not 0), the features and the denominators are written there too (what
    the training operator's backward needs, :mod:`.numba_train`)."""
    N, L, M = Q.shape
    E = V.shape[2]
    has_pad = pad.shape[1] > 0
    keep = PQ.shape[1] > 0
    zero = cst[HALF] - cst[HALF]
    xf = empty_aligned(1, chunk * M, Q)[0]     # the block's query features (flat, and as rows: xb)
    yf = empty_aligned(1, chunk * M, Q)[0]     # the block's key features
    xb = xf.reshape((chunk, M))
    yb = yf.reshape((chunk, M))
    Qf = Q.reshape((N, L * M))                 # flat rows: a block's features in one pass
    Kf = K.reshape((N, L * M))
    yT = empty_aligned(M, chunk, Q)   # ... transposed
    A = empty_aligned(chunk, chunk, Q)
    db = np.empty(chunk, dtype=Q.dtype)        # the block's denominators (scratch)
    nbuf = np.empty(8, dtype=np.int32)        # elu1_row's scratch
    for n in range(n0, n1):
        vn = V[n]; outn = out[n]
        S = empty_aligned(S0.shape[1], S0.shape[2], S0)   # the state: a panel operand (x S), on a cache line
        S[:] = S0[n]
        z = z0[n].copy()
        for c0 in range(0, L, chunk):
            c1 = min(c0 + chunk, L)
            T = c1 - c0
            # ---- features of the block
            elu1_row(xf, Qf[n, c0 * M:c1 * M], scale, nbuf, cst, is32)
            elu1_row(yf, Kf[n, c0 * M:c1 * M], scale, nbuf, cst, is32)
            if has_pad:
                for t in range(T):
                    if pad[n, c0 + t]:
                        row = yb[t]
                        for j in range(M):
                            row[j] = zero
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


def _fused(q: Tensor, k: Tensor, v: Tensor, scale: float, pad: Tensor | None, S0: Tensor | None,
           z0: Tensor | None, chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    return run_fused(q, k, v, scale, pad, S0, z0, chunk, False)


def run_fused(q: Tensor, k: Tensor, v: Tensor, scale: float, pad: Tensor | None, S0: Tensor | None,
              z0: Tensor | None, chunk: int, keep: bool) -> tuple[Tensor, ...]:
    """The kernel on tensors: ``(out, S, z)`` as :func:`fused_causal` returns them, and with ``keep`` also
    ``(phi_q (B, H, L, D), phi_k (B, H, L, D), den (B, H, L))`` (the training operator's forward,
    :mod:`.numba_train`; no autograd here)."""
    B, H, L, D = q.shape
    E, N = v.shape[-1], B * H
    dt = q.dtype
    if (q.device.type != "cpu" or dt not in (torch.float32, torch.float64) or k.dtype != dt or v.dtype != dt
            or k.shape != q.shape or v.shape[:3] != q.shape[:3]):
        raise ValueError(f"fused_causal: q, k, v must be float32 or float64 CPU tensors of one dtype and shape "
                         f"(B, H, L, *); got {q.dtype} {tuple(q.shape)}, {k.dtype} {tuple(k.shape)}, "
                         f"{v.dtype} {tuple(v.shape)}")
    X, Kx, V = (arr(t).reshape(N, L, t.shape[-1]) for t in (q, k, v))
    padn = pad_rows(pad, B, H, L)
    npdt = X.dtype
    S0a = np.zeros((N, D, E), dtype=npdt) if S0 is None else arr(S0.to(dt)).reshape(N, D, E)
    z0a = np.zeros((N, D), dtype=npdt) if z0 is None else arr(z0.to(dt)).reshape(N, D)
    outa = output((N, L, E), npdt)
    S = np.empty((N, D, E), dtype=npdt)
    z = np.empty((N, D), dtype=npdt)
    Lk = L if keep else 0
    PQ, PK = output((N, Lk, D), npdt), output((N, Lk, D), npdt)
    den = output((N, Lk), npdt)
    args = (X, Kx, V, padn, npdt.type(scale), constants(npdt), npdt == np.float32,
            max(1, min(int(chunk), MAX_BLOCK)), S0a, z0a, outa, S, z, PQ, PK, den)
    rows(_fused_rows, N, *args)
    res = (torch.from_numpy(outa).view(B, H, L, E), torch.from_numpy(S).view(B, H, D, E),
           torch.from_numpy(z).view(B, H, D))
    if keep:
        res += (torch.from_numpy(PQ).view(B, H, L, D), torch.from_numpy(PK).view(B, H, L, D),
                torch.from_numpy(den).view(B, H, L))
    return res


def _fused_fake(q, k, v, scale, pad, S0, z0, chunk):
    B, H, L, D = q.shape
    E = v.shape[-1]
    return q.new_empty(B, H, L, E), q.new_empty(B, H, D, E), q.new_empty(B, H, D)


#: ``attnkit_kernelized::numba_linear_fused_causal`` (no autograd: the module calls it only without one)
numba_linear_fused_causal = define("numba_linear_fused_causal", _fused, _fused_fake)


def fused_causal(q: Tensor, k: Tensor, v: Tensor, scale: float, pad: Tensor | None, S0: Tensor | None,
                 z0: Tensor | None, chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """Causal linear attention with ``phi(x) = elu(scale x) + 1``, no autograd (the numba backend's fused path).

    Args:
        q, k: ``(B, H, L, D)``; v: ``(B, H, L, E)``; float32 or float64 CPU tensors of one dtype.
        scale: the factor q and k are multiplied by before the feature map (1.0: none).
        pad: ``(B, 1, L, 1)`` bool, True at padded keys (their features are 0, whatever they hold), or None.
        S0, z0: the state ``(B, H, D, E)``, ``(B, H, D)`` carried in (None: zeros).
        chunk: positions per block (at most :data:`~.numba_ops.MAX_BLOCK`).

    Returns:
        ``(out (B, H, L, E), S (B, H, D, E), z (B, H, D))``: the output (0 where a query sees no key) and the
        state after the last key.

    Raises:
        ValueError: inputs that are not float32/float64 CPU tensors of one dtype and length.
    """
    with torch.no_grad():
        return numba_linear_fused_causal(q.detach(), k.detach(), v.detach(), float(scale), pad,
                                         None if S0 is None else S0.detach(), None if z0 is None else z0.detach(),
                                         int(chunk))
