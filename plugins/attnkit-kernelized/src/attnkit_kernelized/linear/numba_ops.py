# ruff: noqa: E702  -- the register tiles read best one tile row per line (a0 = ...; a1 = ...)
"""numba CPU kernels of linear attention (``linear``, ``performer``, ungated ``rfa``) and their operators.

The one primitive is the *product*::

    out[t] = sum_{j in J(t)} (x[t] . y[j]) * w[j]  (+ x[t]^T S0)
    den[t] = sum_{j in J(t)} (x[t] . y[j])         (+ x[t] . z0)   (with_den)

for ``x (N, L, M)``, ``y (N, S, M)``, ``w (N, S, E)`` (N = batch x heads) and
an initial state ``S0 = sum of earlier y_j w_j^T`` with ``z0``; ``J(t)`` is
``j <= t`` (causal), ``j >= t`` (reverse) or every ``j`` (full). Linear
attention's numerator is ``product(phi(q), phi(k), v)`` and ``den`` its
denominator; the backward pass is three more products
(:func:`attnkit_kernelized._ops.linear_attention_backward`).

:func:`_causal_rows` (causal and reverse) computes the sequences ``n0 <= n < n1``
of the N = B*H (serial, ``nogil``, ``nopython``, ``cache=True``), each into
arrays of its own, copied into the caller's at its end (writing into argument
arrays lets LLVM assume they alias the inputs and vectorise the tiles less:
measured 2x slower). :func:`attnkit_kernelized._numba.rows` runs it over the
sequences: ranges of them handed out one at a time to a team of torch's OpenMP
threads, so a thread another process deschedules takes fewer and nobody waits
for a fixed share. Each sequence is computed by one thread with the same loop
(the result depends neither on the thread count nor on the order).

The kernel walks each sequence in chunks of ``chunk`` positions, so a chunk's
inputs stay in L1/L2 while they are reused. Every product is
:func:`attnkit_kernelized._tiles.axpy_rows` (``OUT += C @ Y``, 4 output rows x 4
terms per pass, vectorised along the contiguous row: no horizontal sums). Per
chunk: the inter-chunk part ``out = x S`` from the state ``S`` (M x E) of the
earlier chunks; the causal triangle ``A = x y^T`` four query rows at a time,
over whole 16-column blocks up to the group's last row (so its rows vectorise),
the group's diagonal block cut to its lower triangle, and ``out += A w``; then
the state update ``S += y^T w`` over the chunk (``y^T`` is copied once per
chunk). In reverse mode the chunk's rows are copied in reversed order, so the
anti-causal triangle is the causal one. Work O(L * (M * E + chunk * (M + E))),
memory O(M * E + chunk * (M + E)) per sequence besides inputs and outputs. With
``normalize`` the division by the denominator is fused (0 where it is 0, NaN
stays NaN).

:func:`_full_rows` (the non-causal form, L != S allowed) accumulates the
whole state with the same tiles, then ``out[t] = S^T x[t]``.

Operators (``torch.library``, namespace ``attnkit_kernelized``):
``numba_linear_product`` (the primitive, no autograd) and
``numba_linear_attention`` (differentiable, normalised).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from attnkit.numba_panel import empty_aligned

from .._numba import FASTMATH, arr, check_float, output, rows
from .._ops import call_linear_attention, define, define_linear_attention
from .._tiles import axpy_rows, causal_block, divide_row, feature_grad_row, set_rows, transpose
from ..common import DEFAULT_CHUNK

_FASTMATH = FASTMATH


@numba.njit(cache=True, fastmath=_FASTMATH, nogil=True)
def _causal_rows(x, y, w, reverse, chunk, with_den, normalize, S0, z0, out, den, S_out, z_out, feat, n0,
                 n1):  # pragma: no cover - compiled
    N, L, M = x.shape
    E = w.shape[2]
    n_chunks = (L + chunk - 1) // chunk
    zero = np.zeros(1, dtype=x.dtype)[0]           # a typed 0 (a literal 0.0 would be float64)
    # the features' backward on the output (feat_on): the performer's with a W of columns (_features_back_block),
    # elu(x) + 1's without (_elu_back_block)
    phi, W, X, pad, scale = feat
    feat_on = phi.shape[1] > 0
    D = W.shape[1]
    perf_on = D > 0
    gb = empty_aligned(chunk if perf_on else 0, E, x)
    dxb = empty_aligned(chunk if perf_on else 0, D, x)
    for n in range(n0, n1):
        xn = x[n]; yn = y[n]; wn = w[n]; outn = out[n]
        S = empty_aligned(M, E, x)                 # the state S = S0 + sum_j y_j w_j^T (M x E), on a line
        S[:] = S0[n]
        z = z0[n].copy()
        # per-chunk buffers: results are written here and copied out at the chunk's end (writing straight into
        # the caller's arrays lets LLVM assume they alias the inputs, which vectorises the tiles less)
        xb = empty_aligned(chunk, M, x)   # reverse mode: the chunk's rows in reversed order
        wb = empty_aligned(chunk, E, x)
        yT = empty_aligned(M, chunk, x)   # the chunk's keys transposed (reversed in reverse mode)
        A = empty_aligned(chunk, chunk, x)
        ob = empty_aligned(chunk, E, x)
        db = np.empty(chunk, dtype=x.dtype)
        for ci in range(n_chunks):
            c = n_chunks - 1 - ci if reverse else ci
            c0 = c * chunk
            c1 = min(c0 + chunk, L)
            T = c1 - c0
            if reverse:   # row t of the buffers is position c1 - 1 - t: the anti-causal triangle becomes causal
                for t in range(T):
                    xs = xn[c1 - 1 - t]; xd = xb[t]
                    for m in range(M):
                        xd[m] = xs[m]
                    ws = wn[c1 - 1 - t]; wd = wb[t]
                    for e in range(E):
                        wd[e] = ws[e]
                yc = yn[c0:c1][::-1]
                transpose(yT, yc, T, M)
                xc = xb[:T]; wc = wb[:T]
            else:
                xc = xn[c0:c1]; wc = wn[c0:c1]; yc = yn[c0:c1]
                transpose(yT, yc, T, M)
            # ---- out = x S + the causal triangle (normalised with ``normalize``), den, then the state
            causal_block(xc, wc, yc, yT, A, ob, db, S, z, T, M, E, zero, with_den, normalize)
            # ---- the chunk's results out (back in position order in reverse mode)
            if feat_on:
                if perf_on:
                    _features_back_block(ob, gb, dxb, T, c0, c1, reverse, phi[n], W, X[n], pad[n], scale, outn,
                                         zero)
                else:
                    _elu_back_block(ob, T, c0, c1, reverse, phi[n], scale, outn, zero)
                continue
            for t in range(T):
                p = c1 - 1 - t if reverse else c0 + t
                o_ = ob[t]; d_ = outn[p]
                for e in range(E):
                    d_[e] = o_[e]
                if with_den:
                    den[n, p] = db[t]
        S_out[n] = S
        z_out[n] = z


@numba.njit(cache=True, fastmath=_FASTMATH)
def _features_back_block(ob, gb, dxb, T, c0, c1, reverse, phin, W, Xn, padn, scale, outn,
                         zero):  # pragma: no cover - compiled
    """The performer's features backward on a block of the product's output, in place of writing it:
    ``ob[:T] = dphi`` (buffer row t is position ``c1 - 1 - t`` in reverse mode, ``c0 + t`` else) becomes
    ``outn[p] = (dphi * phi) W - scale · sum_m (dphi * phi)_m · X[p]`` (``phin (L, M)`` the features,
    ``W (M, D)``, ``Xn (L, D)``; ``scale`` 0: the queries' form), 0 where ``padn[p]`` (``padn`` may be
    empty: nothing padded). What :func:`attnkit_kernelized.performer.numba_features._back_rows` computes from
    a written ``dphi``; here ``dphi`` never leaves the block's buffer."""
    M = ob.shape[1]
    D = W.shape[1]
    has_pad = padn.shape[0] > 0
    for t in range(T):
        p = c1 - 1 - t if reverse else c0 + t
        o_ = ob[t]; f = phin[p]; g = gb[t]
        for m in range(M):
            g[m] = o_[m] * f[m]
    set_rows(dxb, gb, W, T, M, D)
    for t in range(T):
        p = c1 - 1 - t if reverse else c0 + t
        feature_grad_row(outn[p], dxb[t], gb[t], Xn, p, has_pad and padn[p], scale, zero)


@numba.njit(cache=True, fastmath=_FASTMATH)
def _elu_back_block(ob, T, c0, c1, reverse, phin, scale, outn, zero):  # pragma: no cover - compiled
    """``elu(s x) + 1``'s backward on a block of the product's output, in place of writing it: ``ob[:T] = dphi``
    (buffer row t is position ``c1 - 1 - t`` in reverse mode, ``c0 + t`` else) becomes
    ``outn[p] = scale · dphi · min(phi, 1)`` (the map's derivative: 1 where ``s x > 0``, ``exp(s x) = phi``
    elsewhere; ``phin (L, M)`` the features). A padded key's features are 0, so its gradient is 0 too. What
    :mod:`.numba_elu`'s backward computes from a written ``dphi``, then times ``scale``."""
    M = ob.shape[1]
    one = zero + 1
    for t in range(T):
        p = c1 - 1 - t if reverse else c0 + t
        o_ = ob[t]; f = phin[p]; d_ = outn[p]
        for m in range(M):
            d_[m] = o_[m] * np.fmin(f[m], one) * scale


@numba.njit(cache=True, fastmath=_FASTMATH, nogil=True)
def _prep_rows(g, o, den, v, has_g, gp, vp, gn, r0, r1):  # pragma: no cover - compiled
    """The backward's inputs of normalised linear attention for the rows ``r0 <= r < r1`` of ``(R, E)`` arrays, in
    one pass: ``gn = g / den`` (0 where ``den`` is 0), ``gp = [gn, -(g . o) / den]``, ``vp = [v, 1]``
    (``has_g`` False: ``g`` is 0, ``g`` itself unread)."""
    E = v.shape[1]
    zero = np.zeros(1, dtype=gp.dtype)[0]           # a typed 0 (a literal 0.0 would be float64)
    one = zero + 1
    for r in range(r0, r1):
        d = den[r]
        inv = zero if d == 0 else one / d
        vr = v[r]; pr = vp[r]
        for e in range(E):
            pr[e] = vr[e]
        pr[E] = one
        gr = gp[r]; nr = gn[r]
        if has_g:
            a = g[r]; b = o[r]
            s = zero
            for e in range(E):
                x = a[e] * inv
                nr[e] = x
                gr[e] = x
                s += a[e] * b[e]
            gr[E] = -s * inv
        else:
            for e in range(E):
                nr[e] = zero
                gr[e] = zero
            gr[E] = zero


@numba.njit(cache=True, fastmath=_FASTMATH, nogil=True)
def _full_rows(x, y, w, chunk, with_den, normalize, S0, z0, out, den, S_out, z_out, n0,
               n1):  # pragma: no cover - compiled
    N, L, M = x.shape
    S_ = y.shape[1]
    E = w.shape[2]
    zero = np.zeros(1, dtype=x.dtype)[0]           # a typed 0 (a literal 0.0 would be float64)
    for n in range(n0, n1):
        xn = x[n]; yn = y[n]; wn = w[n]; outn = out[n]
        S = empty_aligned(M, E, x)                 # S = S0 + sum_j y_j w_j^T (M x E), on a line
        S[:] = S0[n]
        z = z0[n].copy()
        yT = empty_aligned(M, chunk, x)
        ob = empty_aligned(chunk, E, x)
        # ---- the state over every key, a chunk of keys at a time
        for c0 in range(0, S_, chunk):
            c1 = min(c0 + chunk, S_)
            T = c1 - c0
            transpose(yT, yn[c0:c1], T, M)
            axpy_rows(S, yT, wn[c0:c1], M, T, E)
            if with_den:
                for t in range(c0, c1):            # along z's vector (as _tiles.causal_block)
                    yr = yn[t]
                    for m in range(M):
                        z[m] += yr[m]
        # ---- out = x S, a chunk of queries at a time (into a buffer, copied out: see _causal_rows)
        for c0 in range(0, L, chunk):
            c1 = min(c0 + chunk, L)
            T = c1 - c0
            xc = xn[c0:c1]; oc = ob[:T]
            set_rows(oc, xc, S, T, M, E)
            for t in range(T):
                ot = oc[t]
                if with_den:
                    xa = xc[t]
                    s = zero
                    for m in range(M):
                        s += xa[m] * z[m]
                    den[n, c0 + t] = s
                    if normalize:  # out /= den, 0 where no key is visible
                        divide_row(ot, s, E, zero)
                d_ = outn[c0 + t]
                for e in range(E):
                    d_[e] = ot[e]
        S_out[n] = S
        z_out[n] = z


# ------------------------------------------------------------------ operators
_MODES = ("causal", "reverse", "full")

#: the kernels' block of positions is ``min(chunk, MAX_BLOCK)``: with the axpy-row tiles, blocks of 16 or 32
#: positions ran 5-10% faster than 64 (the torch form's default chunk) at L = 8,192, M = 64 and 256, forward and
#: the backward's products (one thread, CPU time; session 25); the block changes rounding only
MAX_BLOCK = 32


def _product(x: Tensor, y: Tensor, w: Tensor, S0: Tensor, z0: Tensor, mode: str, chunk: int, with_den: bool,
             normalize: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The product primitive on CPU tensors ``x (N, L, DX)``, ``y (N, S, DX)``, ``w (N, S, DW)``,
    ``S0 (N, DX, DW)``, ``z0 (N, DX)``; returns ``(out (N, L, DW), den (N, L) or (N, 0), S, z)``."""
    N, L, DX = x.shape
    S, DW = y.shape[1], w.shape[2]
    if not (y.shape == (N, S, DX) and w.shape[:2] == (N, S) and S0.shape == (N, DX, DW) and z0.shape == (N, DX)):
        raise ValueError(f"numba_linear_product: expected x (N, L, DX), y (N, S, DX), w (N, S, DW), S0 (N, DX, DW), "
                         f"z0 (N, DX); got {tuple(x.shape)}, {tuple(y.shape)}, {tuple(w.shape)}, {tuple(S0.shape)}, "
                         f"{tuple(z0.shape)}")
    if mode not in _MODES or (mode != "full" and L != S) or chunk < 1 or (normalize and not with_den):
        raise ValueError(f"numba_linear_product: mode must be one of {_MODES} (L == S unless 'full'), chunk >= 1, "
                         f"normalize only with with_den; got mode={mode!r}, L={L}, S={S}, chunk={chunk}, "
                         f"with_den={with_den}, normalize={normalize}")
    if any(t.device.type != "cpu" for t in (x, y, w, S0, z0)):
        raise ValueError(f"numba_linear_product: numba kernels take CPU tensors, got {x.device}")
    xa, ya, wa, z0a = arr(x), arr(y), arr(w), arr(z0)
    S0a = arr(S0)
    chunk = min(int(chunk), MAX_BLOCK)
    check_float(xa, ya, wa, S0a, z0a)
    dt = xa.dtype
    out = output((N, L, DW), dt)
    den = np.zeros((N, L if with_den else 0), dtype=dt)
    S_ = np.empty((N, DX, DW), dtype=dt)
    z = np.empty((N, DX), dtype=dt)
    if mode == "full":
        rows(_full_rows, N, xa, ya, wa, int(chunk), bool(with_den), bool(normalize), S0a, z0a, out, den, S_, z)
    else:
        rows(_causal_rows, N, xa, ya, wa, mode == "reverse", int(chunk), bool(with_den), bool(normalize), S0a, z0a,
             out, den, S_, z, _no_features(xa, DW))
    return (torch.from_numpy(out), torch.from_numpy(den), torch.from_numpy(S_),
            torch.from_numpy(z))


def _no_features(x: np.ndarray, DW: int) -> tuple:
    """The ``feat`` argument of :func:`_causal_rows` that leaves the features' backward off (a ``W`` of no
    columns)."""
    N = x.shape[0]
    return (np.empty((N, 0, DW), dtype=x.dtype), np.empty((DW, 0), dtype=x.dtype), np.empty((N, 0, 0), dtype=x.dtype),
            np.empty((N, 0), dtype=np.bool_), x.dtype.type(0))


def _product_fake(x, y, w, S0, z0, mode, chunk, with_den, normalize):
    N, L, _ = x.shape
    return (x.new_empty(N, L, w.shape[-1]), x.new_empty(N, L if with_den else 0), torch.empty_like(S0),
            torch.empty_like(z0))


def _product_features(x: Tensor, y: Tensor, w: Tensor, S0: Tensor, z0: Tensor, reverse: bool, chunk: int,
                      phi: Tensor, W: Tensor, X: Tensor | None, pad: Tensor | None, scale: float
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """The causal (or ``reverse``) product with the performer's features backward on its output:
    ``dx = (product * phi) W - scale · rowsum(product * phi) · X`` (0 at ``pad``; ``X`` None with ``scale`` 0:
    the queries' form), never writing the product itself. ``x (N, L, DX)``, ``y (N, L, DX)``, ``w (N, L, M)``,
    ``phi (N, L, M)``, ``W (M, D)``, ``X (N, L, D)``, ``pad (N, L)`` bool or None; returns
    ``(dx (N, L, D), S, z)``, the final state as :func:`_product` returns it."""
    N, L, DX = x.shape
    M, D = W.shape
    if not (y.shape == x.shape and w.shape == (N, L, M) and phi.shape == (N, L, M) and S0.shape == (N, DX, M)
            and z0.shape == (N, DX) and (X is None or X.shape == (N, L, D))
            and (pad is None or pad.shape == (N, L))):
        raise ValueError(f"numba_linear_product_features: expected x, y (N, L, DX), w and phi (N, L, M), W (M, D), "
                         f"X (N, L, D), pad (N, L), S0 (N, DX, M), z0 (N, DX); got {tuple(x.shape)}, "
                         f"{tuple(y.shape)}, {tuple(w.shape)}, {tuple(phi.shape)}, {tuple(W.shape)}, "
                         f"{None if X is None else tuple(X.shape)}, {None if pad is None else tuple(pad.shape)}, "
                         f"{tuple(S0.shape)}, {tuple(z0.shape)}")
    xa, ya, wa, S0a, z0a, pa, Wa = (arr(t) for t in (x, y, w, S0, z0, phi, W))
    check_float(xa, ya, wa, S0a, z0a, pa, Wa)
    dt = xa.dtype
    Xa = np.empty((N, 0, D), dtype=dt) if X is None else arr(X.to(x.dtype))
    pada = np.empty((N, 0), dtype=np.bool_) if pad is None else arr(pad)
    return _epilogue_product(xa, ya, wa, S0a, z0a, reverse, chunk, (pa, Wa, Xa, pada, dt.type(scale)), D)


def _epilogue_product(xa: np.ndarray, ya: np.ndarray, wa: np.ndarray, S0a: np.ndarray, z0a: np.ndarray,
                      reverse: bool, chunk: int, feat: tuple, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_causal_rows` with a features' backward ``feat`` on its output (``width`` columns, not the
    product's): ``(dx (N, L, width), S, z)``."""
    N, L, DX = xa.shape
    dt = xa.dtype
    dx = output((N, L, width), dt)
    S_ = np.empty((N, DX, wa.shape[2]), dtype=dt)
    z = np.empty((N, DX), dtype=dt)
    rows(_causal_rows, N, xa, ya, wa, bool(reverse), min(int(chunk), MAX_BLOCK), False, False, S0a, z0a, dx,
         np.empty((N, 0), dtype=dt), S_, z, feat)
    return torch.from_numpy(dx), torch.from_numpy(S_), torch.from_numpy(z)


def _product_features_fake(x, y, w, S0, z0, reverse, chunk, phi, W, X, pad, scale):
    return x.new_empty(*x.shape[:2], W.shape[1]), torch.empty_like(S0), torch.empty_like(z0)


def _product_elu(x: Tensor, y: Tensor, w: Tensor, S0: Tensor, z0: Tensor, reverse: bool, chunk: int, phi: Tensor,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The causal (or ``reverse``) product with ``elu(s x) + 1``'s backward on its output:
    ``dx = scale · product · min(phi, 1)``, never writing the product itself. ``x (N, L, DX)``, ``y (N, L, DX)``,
    ``w (N, L, M)``, ``phi (N, L, M)`` the features (0 at padded keys: their ``dx`` is 0); returns
    ``(dx (N, L, M), S, z)``, the final state as :func:`_product` returns it."""
    N, L, DX = x.shape
    M = w.shape[-1]
    if not (y.shape == x.shape and w.shape == (N, L, M) and phi.shape == (N, L, M) and S0.shape == (N, DX, M)
            and z0.shape == (N, DX)):
        raise ValueError(f"numba_linear_product_elu: expected x, y (N, L, DX), w and phi (N, L, M), S0 (N, DX, M), "
                         f"z0 (N, DX); got {tuple(x.shape)}, {tuple(y.shape)}, {tuple(w.shape)}, "
                         f"{tuple(phi.shape)}, {tuple(S0.shape)}, {tuple(z0.shape)}")
    xa, ya, wa, S0a, z0a, pa = (arr(t) for t in (x, y, w, S0, z0, phi))
    check_float(xa, ya, wa, S0a, z0a, pa)
    dt = xa.dtype
    # a W of no columns selects elu's epilogue; X and pad are the performer's (unread here)
    feat = (pa, np.empty((M, 0), dtype=dt), np.empty((N, 0, 0), dtype=dt), np.empty((N, 0), dtype=np.bool_),
            dt.type(scale))
    return _epilogue_product(xa, ya, wa, S0a, z0a, reverse, chunk, feat, M)


def _product_elu_fake(x, y, w, S0, z0, reverse, chunk, phi, scale):
    return torch.empty_like(w), torch.empty_like(S0), torch.empty_like(z0)


def _backward_inputs(g: Tensor | None, out: Tensor, den: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(gp, vp, g_num)`` of :func:`attnkit_kernelized._ops.linear_attention_backward` in one numba pass
    (``g (N, L, E)`` the output's gradient or None, ``out (N, L, E)``, ``den (N, L)``, ``v (N, L, E)``):
    ``g_num = g / den`` (0 where ``den`` is 0), ``gp = [g_num, -(g . out) / den]`` ``(N, L, E+1)`` and
    ``vp = [v, 1]`` ``(N, L, E+1)``, instead of seven torch passes and two concatenations along the last dim."""
    N, L, E = out.shape
    oa, da, va = arr(out), arr(den), arr(v.to(out.dtype))
    ga = oa if g is None else arr(g.to(out.dtype))
    check_float(oa, da, va, ga)
    R = N * L
    gp = output((N, L, E + 1), oa.dtype)
    vp = output((N, L, E + 1), oa.dtype)
    gn = output((N, L, E), oa.dtype)
    rows(_prep_rows, R, ga.reshape(R, E), oa.reshape(R, E), da.reshape(R), va.reshape(R, E), g is not None,
         gp.reshape(R, E + 1), vp.reshape(R, E + 1), gn.reshape(R, E), item=_PREP_ITEM)
    return torch.from_numpy(gp), torch.from_numpy(vp), torch.from_numpy(gn)


def _backward_inputs_fake(g, out, den, v):
    N, L, E = out.shape
    return out.new_empty(N, L, E + 1), out.new_empty(N, L, E + 1), out.new_empty(N, L, E)


#: rows per work item of :func:`_prep_rows`
_PREP_ITEM = 256

#: ``attnkit_kernelized::numba_linear_product`` (see :func:`attnkit_kernelized._ops.define_linear_attention`)
numba_linear_product = define("numba_linear_product", _product, _product_fake)

#: ``attnkit_kernelized::numba_linear_product_features``: the product with the performer's features backward on
#: its rows (:func:`_product_features`; no autograd)
numba_linear_product_features = define("numba_linear_product_features", _product_features, _product_features_fake)

#: ``attnkit_kernelized::numba_linear_product_elu``: the product with ``elu(s x) + 1``'s backward on its rows
#: (:func:`_product_elu`; no autograd)
numba_linear_product_elu = define("numba_linear_product_elu", _product_elu, _product_elu_fake)

#: ``attnkit_kernelized::numba_linear_backward_inputs``: ``(g, out, den, v) -> (gp, vp, g_num)`` (no autograd)
numba_linear_backward_inputs = define("numba_linear_backward_inputs", _backward_inputs, _backward_inputs_fake)

#: ``attnkit_kernelized::numba_linear_attention``: normalised, differentiable, with state in and out
numba_linear_attention = define_linear_attention("numba", numba_linear_product, numba_linear_backward_inputs)


def linear_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, S0: Tensor | None = None, z0: Tensor | None = None,
                     *, causal: bool, chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor, Tensor]:
    """Normalised linear attention with the numba kernels (the ``numba`` backend; differentiable).

    Args:
        phi_q: ``(B, H, L, M)``; phi_k: ``(B, H, S, M)``; v: ``(B, H, S, E)``; float32/float64 CPU tensors.
        S0, z0: the state ``(B, H, M, E)``, ``(B, H, M)`` carried in (None: zeros).
        causal: prefix sums (L == S) or every key (any S).
        chunk: positions per kernel block (at most :data:`MAX_BLOCK`).

    Returns:
        ``(out (B, H, L, E), S (B, H, M, E), z (B, H, M))``: the output (0 where a
        query sees no key) and the state after the last key.
    """
    return call_linear_attention(numba_linear_attention, phi_q, phi_k, v, S0, z0, causal=causal, chunk=chunk)
