"""``fast-weight``'s feature map (sum-normalised when the module's ``normalize``) as one numba pass, for the numba
backend's unfused path under autograd (the training operator, :mod:`.numba_train`, calls its backward's row
function :func:`_phi_back` on each sequence instead).

torch evaluates DPFP and the normalisation as a concatenation, a ``relu``, a product, a sum and a division, each a
fresh ``(B, H, L, 2D)`` tensor, and autograd's backward walks them again (about 40% of a training step at L =
8,192 on two threads, ``torch.profiler``, docs/benchmarks.md "Session 64"). Here the forward is
:func:`.numba_fused._phi_rows` over every row (the values the fused no-grad kernel computes, so the two paths agree
to the bit) and the backward one pass per row: the normalisation's ``(g - g · f) / s`` (``g`` where the row sums to
0, as torch's ``where`` gives), then the map's derivative from the recomputed map (DPFP: each product's two
factors; ``elu + 1``: 1 above 0, ``exp(x)`` below; ``relu``: 1 above 0; ``softplus``: ``sigmoid(x)``, 1 above
20 as torch's). Only the numba backend's unfused path uses it (:meth:`.module.FastWeightAttention._segment_features`:
what runs when the training operator is switched off); the torch
path and the reference keep torch's maps, against which ``tests/test_fast_weight_numba_fused.py`` checks it.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from attnkit.first_order import first_order

from .._numba import FASTMATH, arr, output, rows
from .._vexp import constants
from .numba_fused import KINDS, _phi_rows

_ROWS = 64   # rows per work item


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def _phi_all(X, F, sums, kind, nu, normalize, cst, is32, i0, i1):  # pragma: no cover - compiled
    """``F[i] = phi(X[i])`` for ``i0 <= i < i1`` (:func:`.numba_fused._phi_rows`), with ``normalize`` each row's sum
    before the division in ``sums[i]``."""
    r = np.empty(2 * X.shape[1], dtype=X.dtype)
    nbuf = np.empty(8, dtype=np.int32)
    _phi_rows(F[i0:i1], X[i0:i1], i1 - i0, kind, nu, normalize, np.zeros(0, dtype=np.bool_), r, nbuf, cst, is32,
              sums[i0:i1] if normalize else sums)


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def _phi_back(X, F, sums, Gd, DX, kind, nu, normalize, i0, i1):  # pragma: no cover - compiled
    """``DX[i]``: the gradient w.r.t. ``X[i]`` of ``F[i] = phi(X[i])`` given ``Gd[i]`` (the loss's w.r.t. ``F[i]``),
    for ``i0 <= i < i1``; ``sums[i]``: the row's sum before the normalisation (with ``normalize``)."""
    D = X.shape[1]
    M = F.shape[1]
    zero = X.dtype.type(0)
    dh = np.empty(M, dtype=X.dtype)
    r = np.empty(2 * D, dtype=X.dtype)
    dr = np.empty(2 * D, dtype=X.dtype)
    re = np.empty(2 * D + 2 * nu, dtype=X.dtype)
    ge = np.empty(2 * D + nu, dtype=X.dtype)
    for i in range(i0, i1):
        x = X[i]
        g = Gd[i]
        dx = DX[i]
        s = sums[i] if normalize else zero
        if s != zero:                               # f = h / s: dh = (g - g . f) / s
            f = F[i]
            gf = zero
            for j in range(M):
                gf += g[j] * f[j]
            rs = 1 / s
            for j in range(M):
                dh[j] = (g[j] - gf) * rs
        else:                                       # not normalised, or a row summing to 0 (kept as it is)
            for j in range(M):
                dh[j] = g[j]
        if kind == 0:                               # DPFP: r = relu([x, -x]); h[o + j] = r[j] r[(j - i) mod n]
            n = 2 * D
            for d in range(D):
                a = x[d]
                r[d] = a if a > zero else zero
                r[D + d] = -a if a < zero else zero
            re[nu:nu + n] = r[:n]                   # r extended by its wrap: re[nu + j] = r[j mod n]
            re[:nu] = r[n - nu:n]
            re[nu + n:] = r[:nu]
            for j in range(n):
                dr[j] = zero
            for rr in range(1, nu + 1):
                o = (rr - 1) * n
                ge[:n] = dh[o:o + n]                # dh of this roll extended: ge[j] = dh[o + j mod n]
                ge[n:n + rr] = dh[o:o + rr]
                back = re[nu - rr:nu - rr + n]      # r[j - rr], r[j + rr] and dh[o + j + rr] as plain slices:
                ahead = re[nu + rr:nu + rr + n]     # every load at a fixed offset, so the loop vectorises
                g1 = ge[rr:rr + n]
                for j in range(n):                  # h[o + j] = r[j] r[j - rr], h[o + j + rr] = r[j + rr] r[j]
                    dr[j] += ge[j] * back[j] + g1[j] * ahead[j]
            for d in range(D):                      # loads first, then selects: a conditional load compiles to
                a = x[d]                            # a masked one, which AMD's cores run several times slower
                p = dr[d]
                m = dr[D + d]
                dx[d] = (p if a > zero else zero) - (m if a < zero else zero)
        elif kind == 1:                             # elu(x) + 1
            for d in range(D):
                a = x[d]
                p = dh[d]
                dx[d] = p if a > zero else p * np.exp(a)
        elif kind == 2:                             # relu
            for d in range(D):
                p = dh[d]
                dx[d] = p if x[d] > zero else zero
        else:                                       # softplus (torch's threshold 20)
            for d in range(D):
                a = x[d]
                p = dh[d]
                dx[d] = p if a > 20 else p / (1 + np.exp(-a))


class _Phi(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, kind: int, nu: int, normalize: bool, M: int) -> Tensor:
        X = arr(x).reshape(-1, x.shape[-1])
        F = output((X.shape[0], M), X.dtype)
        sums = np.empty(X.shape[0] if normalize else 0, dtype=X.dtype)
        if X.shape[0]:
            rows(_phi_all, X.shape[0], X, F, sums, kind, nu, normalize, constants(X.dtype), X.dtype == np.float32,
                 item=_ROWS)
        f = torch.from_numpy(F).view(*x.shape[:-1], M)
        ctx.save_for_backward(x, f, torch.from_numpy(sums))
        ctx.args = (kind, nu, normalize)
        return f

    @staticmethod
    @first_order
    def backward(ctx, g: Tensor):
        x, f, sums = ctx.saved_tensors
        kind, nu, normalize = ctx.args
        X = arr(x).reshape(-1, x.shape[-1])
        F = f.numpy().reshape(X.shape[0], -1)
        DX = output(X.shape, X.dtype)
        if X.shape[0]:
            rows(_phi_back, X.shape[0], X, F, sums.numpy(), arr(g.to(f.dtype)).reshape(F.shape), DX, kind, nu,
                 normalize, item=_ROWS)
        return torch.from_numpy(DX).view(x.shape), None, None, None, None


def phi(x: Tensor, feature_map: str = "dpfp", nu: int = 1, normalize: bool = True) -> Tensor:
    """``fast-weight``'s feature map of ``x (..., D)``, differentiable: ``(..., M)`` with ``M = 2·D·nu`` for
    ``"dpfp"``, ``D`` for ``"elu"``, ``"relu"``, ``"softplus"``; divided by its sum over the last dim when
    ``normalize`` (a row summing to 0 stays 0).

    Raises:
        ValueError: ``x`` not a float32/float64 CPU tensor, another map, or ``nu`` outside ``[1, D]``.
    """
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"phi: x must be a float32 or float64 CPU tensor; got {x.dtype} on {x.device}")
    if feature_map not in KINDS:
        raise ValueError(f"phi: feature_map must be one of {sorted(KINDS)}; got {feature_map!r}")
    if nu < 1 or nu > x.shape[-1]:
        raise ValueError(f"phi: nu must lie in [1, D = {x.shape[-1]}] (a roll wraps at most once); got {nu}")
    M = 2 * x.shape[-1] * nu if feature_map == "dpfp" else x.shape[-1]
    return _Phi.apply(x, KINDS[feature_map], int(nu), bool(normalize), M)
