# ruff: noqa: E702  -- the polynomial's constants read best one group per line
"""numba CPU kernels of the performer's positive features on its bounded causal path.

The torch form of these features (:meth:`.module.PerformerAttention._bounded_causal`) is
a matmul followed by seven elementwise or reduction passes over ``(B, H, L, M)``
tensors (the squared norms subtracted, a row maximum, a shift, ``exp`` for the
queries; the shift, ``exp``, a maximum and a minimum over the keys), each a fresh
tensor, plus their autograd nodes. At M = 256 they took about 2.5x the time of the
linear-attention kernel they feed (measured, session 25 in docs/benchmarks.md).
Here each tensor gets **one** numba pass over blocks of 16 rows: the projection
``X W'^T`` of the block (:func:`attnkit_kernelized._tiles.set_rows`, into a buffer
that stays in cache), the shift, the bounds and ``exp`` there, and one write of the
features; the backward likewise forms ``g * phi`` a block at a time and multiplies it
by ``W'`` in the same pass (no ``(B, H, L, M)`` temporary). Custom operators wrap them
(``torch.library``, the backward a third one), so a program (``torch.export``) holds them
and they take any length: a causal performer program on numba reads its bounds and chooses
its form from them (:meth:`.module.PerformerAttention._program_causal`):

* queries: ``phi_q[r] = exp(p[r] - max_m p[r, m])`` with ``p = q W'^T``
  (``W' = sqrt(scale) · W``). The squared-norm term ``|q'|^2/2`` is a per-row
  constant, so it cancels against the row maximum and is never formed.
  Backward: ``dq = (g * phi_q) W'`` (the maximum is a detached shift).
* keys: ``lk = p - |k'|^2/2``, ``phi_k = exp(lk)`` (0 at padded keys) and, in
  the same pass, the largest exponent per feature over the real keys
  ``hi (B, H, M)`` and the smallest of a sequence ``lo (B, H)``, which decide
  whether the bounded path may run at all, and the largest growth of a feature's
  running maximum inside a chunk ``growth (B, H)`` (whether the log-space form
  marks chunks for pairwise blocks: the tests read it to know which form an input
  takes; programs read it until session 55, when the log-space form began selecting
  its marked chunks itself). Backward:
  ``dk = G W' - (sum_m G) · scale · k`` with ``G = g * phi_k`` (0 at padded keys).

``exp`` is :func:`attnkit_kernelized._vexp.exp_row` (vectorised; the bounded path's arguments,
``|lk| <= 600`` in float64 and ``<= 60`` in float32, cannot overflow it).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from attnkit.numba_panel import empty_aligned
from attnkit.numba_vreduce import row_max, row_min

from .._numba import FASTMATH, arr, output, rows
from .._ops import define
from .._tiles import feature_grad_row, set_rows
from .._vexp import HALF, constants, exp_row

# the plugin's flags (reassoc lets the row maximum and the norms vectorise); the exp (.._vexp) is compiled apart
_FM = FASTMATH

_BLOCK = 16   # rows per projection block (a (16, M) buffer stays in L1/L2 while it is exponentiated)
_ITEM = 64    # rows per work item of the row-wise kernels (rows hands out ranges of them)


@numba.njit(cache=True, fastmath=_FM, inline="always")
def _project(buf, X, WT, nb):  # pragma: no cover - compiled
    """``buf[:nb] = X[:nb] WT`` (``X (>= nb, D)``, ``WT (D, M)``, ``buf (>= nb, M)``) through :func:`set_rows`
    (the register panels start from zero: no pass zeroing ``buf`` first)."""
    D, M = WT.shape
    set_rows(buf, X, WT, nb, D, M)


@numba.njit(cache=True, fastmath=_FM, nogil=True)
def _query_rows(X, WT, P, r0, r1):  # pragma: no cover - compiled
    """``P[r] = exp(p - max p)`` with ``p = X[r] WT`` for the rows ``r0 <= r < r1`` (``X (R, D)``, ``WT (D, M)``,
    ``P (R, M)``). Each block of rows is projected into a buffer of its own (:func:`set_rows`), exponentiated
    there and copied out (writes into argument arrays vectorise less: LLVM must assume they alias the inputs)."""
    M = WT.shape[1]
    buf = empty_aligned(_BLOCK, M, P)
    mb = np.empty(_BLOCK, dtype=P.dtype)
    for b0 in range(r0, r1, _BLOCK):
        nb = min(_BLOCK, r1 - b0)
        _project(buf, X[b0:], WT, nb)
        for i in range(nb):         # the maxima first, then the exponentials (as numba_fused._query_block)
            mb[i] = row_max(buf[i])
        for i in range(nb):
            row = buf[i]
            exp_row(row, mb[i])
            out = P[b0 + i]
            for j in range(M):
                out[j] = row[j]


@numba.njit(cache=True, fastmath=_FM, nogil=True)
def _key_rows(X, WT, pad, s2h, cst, chunk, P, hi, lo, grow, n0, n1):  # pragma: no cover - compiled
    """For the sequences ``n0 <= n < n1`` of ``X (N, L, D)``: ``P[n, t] = exp(X[n, t] WT - s2h |X[n, t]|^2)``
    (0 where ``pad[n, t]``; ``pad`` may be ``(N, 0)``: nothing padded), ``hi[n, m]`` the largest exponent of
    feature m and ``lo[n]`` the smallest exponent over the real keys (-inf and +inf when there is none), and
    ``grow[n]`` the largest growth of a feature's running maximum inside a chunk of ``chunk`` positions: over the
    chunks, ``max_m (h_m at the chunk's end - h_m after its first key)`` with ``h`` the running maximum over the
    real keys (the growth :func:`.chunk.log_space_causal` decides its pairwise chunks by, from no
    earlier key; +inf when a chunk's first key is padded and a feature sees its first key later in it)."""
    N, L, D = X.shape
    M = WT.shape[1]
    has_pad = pad.shape[1] > 0
    zero = cst[HALF] - cst[HALF]
    ninf = -np.inf * cst[HALF] * 2   # typed -inf
    buf = empty_aligned(_BLOCK, M, P)
    first = np.empty(M, dtype=P.dtype)   # the running maximum after each chunk's first key
    for n in range(n0, n1):
        Xn = X[n]; Pn = P[n]
        h = hi[n]
        for j in range(M):
            h[j] = ninf
        low = -ninf
        g = zero
        for b0 in range(0, L, _BLOCK):
            nb = min(_BLOCK, L - b0)
            _project(buf, Xn[b0:], WT, nb)
            for i in range(nb):
                t = b0 + i
                row = buf[i]
                out = Pn[t]
                if has_pad and pad[n, t]:
                    for j in range(M):
                        out[j] = zero
                else:
                    kr = Xn[t]
                    sq = zero
                    for d in range(D):
                        sq += kr[d] * kr[d]
                    c = s2h * sq
                    for j in range(M):
                        h[j] = np.fmax(h[j], row[j] - c)     # fmax: a plain store, not a masked one
                    low = min(low, row_min(row) - c)
                    exp_row(row, c)
                    for j in range(M):
                        out[j] = row[j]
                if t % chunk == 0:
                    for j in range(M):
                        first[j] = h[j]
                if t % chunk == chunk - 1 or t == L - 1:
                    for j in range(M):
                        g = np.fmax(g, h[j] - first[j])     # fmax: a feature with no key yet (-inf - -inf) adds no NaN
        lo[n] = low
        grow[n] = g


@numba.njit(cache=True, fastmath=_FM, nogil=True)
def _back_rows(G, PHI, W, X, pad, scale, DX, r0, r1):  # pragma: no cover - compiled
    """``DX[r] = (G[r] * PHI[r]) W - scale · sum_m (G[r] * PHI[r])_m · X[r]`` for ``r0 <= r < r1``
    (``G, PHI (R, M)``, ``W (M, D)``, ``X, DX (R, D)``; ``scale = 0``: the queries' form, X unused);
    0 where ``pad[r]`` (``pad`` may be empty: nothing padded)."""
    M, D = W.shape
    has_pad = pad.shape[0] > 0
    zero = W[0, 0] - W[0, 0]
    gb = empty_aligned(_BLOCK, M, DX)
    ob = empty_aligned(_BLOCK, D, DX)
    for b0 in range(r0, r1, _BLOCK):
        nb = min(_BLOCK, r1 - b0)
        for i in range(nb):
            g = G[b0 + i]; f = PHI[b0 + i]; row = gb[i]
            for j in range(M):
                row[j] = g[j] * f[j]
        set_rows(ob, gb, W, nb, M, D)
        for i in range(nb):
            feature_grad_row(DX[b0 + i], ob[i], gb[i], X, b0 + i, has_pad and pad[b0 + i], scale, zero)


def _row_pad(pad: Tensor | None, B: int, H: int, L: int) -> np.ndarray:
    """``pad (B, 1, L, 1)`` as one flag per row of ``(B*H*L)`` (empty: nothing padded)."""
    if pad is None:
        return np.zeros(0, dtype=np.bool_)
    return arr(pad[:, 0, :, 0].reshape(B, 1, L).expand(B, H, L).reshape(B * H * L))


def _query_features(q: Tensor, w: Tensor) -> Tensor:
    B, H, L, D = q.shape
    M = w.shape[0]
    X = arr(q).reshape(B * H * L, D)
    P = output((B * H * L, M), X.dtype)
    rows(_query_rows, X.shape[0], X, arr(w.t()), P, item=_ITEM)
    return torch.from_numpy(P).view(B, H, L, M)


def _query_features_fake(q, w):
    return q.new_empty(*q.shape[:3], w.shape[0])


def _key_features(k: Tensor, w: Tensor, scale: float, pad: Tensor | None,
                  chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    B, H, L, D = k.shape
    M = w.shape[0]
    X = arr(k).reshape(B * H, L, D)
    padn = _row_pad(pad, B, H, L).reshape(B * H, L if pad is not None else 0)
    P = output((B * H, L, M), X.dtype)
    hi = np.empty((B * H, M), dtype=X.dtype)
    lo = np.empty(B * H, dtype=X.dtype)
    grow = np.empty(B * H, dtype=X.dtype)
    rows(_key_rows, B * H, X, arr(w.t()), padn, X.dtype.type(0.5 * scale), constants(X.dtype),
         max(1, int(chunk)), P, hi, lo, grow)
    return (torch.from_numpy(P).view(B, H, L, M), torch.from_numpy(hi).view(B, H, M),
            torch.from_numpy(lo).view(B, H), torch.from_numpy(grow).view(B, H))


def _key_features_fake(k, w, scale, pad, chunk):
    B, H, L, _ = k.shape
    M = w.shape[0]
    return k.new_empty(B, H, L, M), k.new_empty(B, H, M), k.new_empty(B, H), k.new_empty(B, H)


def _features_backward(g: Tensor, phi: Tensor, w: Tensor, x: Tensor | None, pad: Tensor | None,
                       scale: float) -> Tensor:
    B, H, L, M = phi.shape
    D = w.shape[1]
    PHI = arr(phi).reshape(-1, M)
    dx = output((PHI.shape[0], D), PHI.dtype)
    X = np.zeros((1, D), dtype=PHI.dtype) if x is None else arr(x).reshape(-1, D)
    # 0 at padded keys, whatever they hold (NaN, Inf): phi is 0 there and the row is skipped
    rows(_back_rows, PHI.shape[0], arr(g.to(phi.dtype)).reshape(-1, M), PHI, arr(w.to(phi.dtype)), X,
         _row_pad(pad, B, H, L), PHI.dtype.type(scale), dx, item=_ITEM)
    return torch.from_numpy(dx).view(B, H, L, D)


def _features_backward_fake(g, phi, w, x, pad, scale):
    return phi.new_empty(*phi.shape[:3], w.shape[1])


#: ``attnkit_kernelized::numba_performer_features_backward``: ``(g * phi) W' - scale · sum_m (g * phi)_m · x``
#: per row (``x`` None: the queries' form), 0 at padded rows
numba_performer_features_backward = define("numba_performer_features_backward", _features_backward,
                                           _features_backward_fake)


def _query_setup(ctx, inputs, output):
    _, w = inputs
    ctx.save_for_backward(output, w)


def _query_backward(ctx, g):
    if not ctx.needs_input_grad[0]:
        return None, None
    phi, w = ctx.saved_tensors
    return numba_performer_features_backward(g, phi, w, None, None, 0.0), None


def _key_setup(ctx, inputs, output):
    k, w, scale, pad, _ = inputs
    phi, hi, lo, grow = output
    ctx.mark_non_differentiable(hi, lo, grow)
    ctx.save_for_backward(phi, w, k, pad)
    ctx.scale = scale


def _key_backward(ctx, g, _g_hi, _g_lo, _g_grow):
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None
    phi, w, k, pad = ctx.saved_tensors
    return numba_performer_features_backward(g, phi, w, k, pad, ctx.scale), None, None, None, None


#: ``attnkit_kernelized::numba_performer_query_features``: ``(q (B, H, L, D), w (M, D)) -> phi_q (B, H, L, M)``
numba_performer_query_features = define("numba_performer_query_features", _query_features, _query_features_fake,
                                        backward=_query_backward, setup_context=_query_setup)
#: ``attnkit_kernelized::numba_performer_key_features``: ``(k, w, scale, pad, chunk) -> (phi_k, hi (B, H, M),
#: lo (B, H), growth (B, H))``
numba_performer_key_features = define("numba_performer_key_features", _key_features, _key_features_fake,
                                      backward=_key_backward, setup_context=_key_setup)


def positive_features(q: Tensor, k: Tensor, w: Tensor, scale: float, pad: Tensor | None, chunk: int = 64
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The bounded causal path's features on CPU, differentiable in ``q`` and ``k``.

    Args:
        q: ``(B, H, L, D)``; k: ``(B, H, L, D)``; float32 or float64 CPU tensors.
        w: ``(M, D)``, the random projection times ``sqrt(scale)`` (no gradient).
        scale: the attention scale (``|k'|^2/2 = scale · |k|^2 / 2``).
        pad: ``(B, 1, L, 1)`` bool, True at padded keys (:func:`..common.padded`), or None.
        chunk: positions per chunk of ``growth``.

    Returns:
        ``(phi_q (B, H, L, M), phi_k (B, H, L, M), hi (B, H, M), lo (B, H), growth (B, H))``: ``phi_q`` each
        query row shifted by its largest exponent, ``phi_k = exp(W' k' - |k'|^2/2)`` (0 at padded keys), ``hi``
        the largest key exponent per feature and ``lo`` the smallest of each sequence over the real keys
        (``-inf`` / ``+inf`` when a sequence has none), ``growth`` the largest growth of a feature's running key
        maximum inside a chunk of ``chunk`` positions (what :func:`.chunk.log_space_causal` decides its pairwise
        chunks by, from no earlier key); ``hi``, ``lo`` and ``growth`` carry no gradient.
    """
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64) or k.dtype != q.dtype:
        raise ValueError(f"positive_features: q and k must be float32 or float64 CPU tensors of one dtype; got "
                         f"{q.dtype} and {k.dtype} on {q.device}")
    w = w.detach().to(q.dtype)
    phi_q = numba_performer_query_features(q, w)
    phi_k, hi, lo, growth = numba_performer_key_features(k, w, float(scale), pad, int(chunk))
    return phi_q, phi_k, hi, lo, growth
