"""Causal FAVOR+ with exponents kept in log space and a prefix-safe per-feature maximum (the ``torch`` form).

The random features are ``phi_q_tm = a_tm exp(lq_tm)`` and
``phi_k_jm = b_jm exp(lk_jm)`` (``a = b = 1`` for the positive map, the sine
and cosine values for the trig map, whose exponent ``lk_j = |k_j|^2/2`` is the
same for every feature: ``lk`` then has one column). Causal attention is
``out_t = sum_{j <= t} A_tj v_j / sum_{j <= t} A_tj`` with
``A_tj = sum_m phi_q_tm phi_k_jm``.

For inputs of large norm the exponents span thousands, so neither factor can
be formed on its own in floating point (every feature of a row underflows:
the all-zero rows of the unstabilised map). Every exponent is shifted by
references that cancel between numerator and denominator:

* ``mk_tm = max_{j <= t} lk_jm``: the running (prefix) maximum of each
  feature's key exponent, ``(B, H, L, M)`` (``(B, H, L, 1)`` for trig); it
  uses keys up to ``t`` only, so no future key can change (or underflow) an
  earlier output.
* ``c_t = max_m (lq_tm + mk_tm)``: the query's shift. Then every weight
  ``exp(lq_tm + lk_jm - c_t) <= 1`` for ``j <= t``, and the feature attaining
  ``c_t`` has a key with weight exactly 1 (its own maximum): the denominator
  of the positive map is >= 1 for every query that sees a key, at any scale.

Chunked form (``C`` positions per chunk, the state carried across chunks by
matrix products): the state ``S`` (``M x (E+1)``, the denominator a column
of ones appended to ``v``) is held relative to ``R = mk`` at the end of the
previous chunk: ``S = sum_j exp(lk_j - R) [v_j, 1]``, entries <= 1 per key.

* across chunks: ``out_t += (a_t exp(lq_t + R - c_t)) S`` (exponent <= 0);
  ``S <- exp(R - R') S + (b exp(lk - R'))^T [v, 1]`` with ``R'`` the
  maximum at the chunk's end (every exponent <= 0);
* inside a chunk: ``A = (a exp(lq + r - c)) (b exp(lk - r))^T`` masked to
  ``j <= t``, with ``r = mk`` at the chunk's *first* position (seen by every
  query of the chunk, so prefix-safe). A key of the chunk may exceed ``r``
  by ``g``: its factor is then up to ``e^g``. When ``g`` exceeds
  :data:`GROWTH_LIMIT` for a chunk (sharp growth of the maximum inside it,
  e.g. at the start of a sequence of large-norm keys) that chunk's
  ``(C x C)`` block is computed pairwise instead,
  ``A_tj = sum_m a_tm b_jm exp(lq_tm + lk_jm - c_t)`` (every exponent <= 0),
  so no factor overflows or underflows spuriously.

The shifts are detached: they are constants that cancel (the function and
its gradients are those of the unshifted formula). Padded keys write
nothing and never enter a maximum. ``chunk=1`` is the recurrent step form
(one position at a time, the growth inside a chunk is then always 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common import DEFAULT_CHUNK, normalize, with_ones_column

#: largest growth (in the exponent) of a feature's key maximum inside one chunk for the factored
#: (matrix-product) form; beyond it the chunk's block is computed pairwise (per dtype)
GROWTH_LIMIT = {torch.float32: 20.0, torch.float64: 200.0}

#: the reference of a state that has seen no key (finite, so differences stay finite; exp() of it is 0)
NO_KEY = -1e30


def _chunks(x: Tensor, C: int, N: int, fill: float) -> Tensor:
    """``(B, H, L, F)`` -> ``(B, H, N, C, F)``, the tail padded with ``fill``."""
    extra = N * C - x.shape[2]
    if extra:
        x = F.pad(x, (0, 0, 0, extra), value=fill)
    return x.reshape(*x.shape[:2], N, C, x.shape[-1])


def _pairwise(lq: Tensor, lk: Tensor, c: Tensor, a: Tensor | None, b: Tensor | None, future: Tensor) -> Tensor:
    """``A_tj = sum_m a_tm b_jm exp(lq_tm + lk_jm - c_t)`` for ``j <= t`` (0 above), ``(..., C, C)``;
    every exponent <= 0 (``c_t`` includes the maximum over keys up to ``t``)."""
    expo = lq[..., :, None, :] + lk[..., None, :, :] - c[..., :, None, :]          # (..., C, C, M)
    w = torch.exp(expo.masked_fill(future[..., None], float("-inf")))
    if a is not None:
        w = w * a[..., :, None, :]
    if b is not None:
        w = w * b[..., None, :, :]
    return w.sum(-1)


def log_space_causal(lq: Tensor, lk: Tensor, v: Tensor, a: Tensor | None = None, b: Tensor | None = None,
                     pad: Tensor | None = None, state: tuple[Tensor, Tensor, Tensor] | None = None, *,
                     chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """Causal random-feature attention from log-space features; ``(out (B, H, L, E), (S, z, m))``.

    Args:
        lq: ``(B, H, L, M)`` query exponents (``(B, H, L, 1)`` broadcasts).
        lk: ``(B, H, L, M)`` key exponents, or ``(B, H, L, 1)`` (one per key, the trig map).
        v: ``(B, H, L, E)``.
        a, b: ``(B, H, L, M)`` bounded multipliers of the query and key features (None: 1).
        pad: ``(B, 1, L, 1)`` bool, True at padded keys (they write nothing), or None.
        state: ``(S (B, H, M, E), z (B, H, M), m (B, H, Mk))`` carried in (``m`` the reference of ``S``
            and ``z``, ``Mk`` = ``lk``'s last dim), or None (nothing seen).
        chunk: positions per chunk.

    Returns:
        The normalised output (0 where a query has seen no key) and the new state.
    """
    B, H, L, _ = lq.shape
    M = lq.shape[-1] if a is None else a.shape[-1]
    M = max(M, lk.shape[-1] if b is None else b.shape[-1])
    Mk = lk.shape[-1]
    E = v.shape[-1]
    dt = v.dtype
    limit = GROWTH_LIMIT.get(dt, 20.0)
    vp = with_ones_column(v)
    if pad is not None:
        vp = vp.masked_fill(pad, 0.0)
    with torch.no_grad():
        lk_d = lk.detach() if pad is None else lk.detach().masked_fill(pad, NO_KEY)
    if state is None:
        Sp = vp.new_zeros(B, H, M, E + 1)
        m0 = vp.new_full((B, H, Mk), NO_KEY)
    else:
        S0, z0, m0 = state
        Sp = torch.cat([S0, z0.unsqueeze(-1)], dim=-1)
    if L == 0:
        return v.new_zeros(B, H, 0, E), (Sp[..., :E], Sp[..., E], m0)
    C = max(1, min(chunk, L))
    N = -(-L // C)
    with torch.no_grad():
        mk = torch.maximum(torch.cummax(lk_d, dim=2).values, m0.detach().unsqueeze(2))   # (B, H, L, Mk)
        c = (lq.detach() + mk).amax(-1, keepdim=True)                                     # (B, H, L, 1)
        tail = N * C - L
        mk_c = torch.cat([mk, mk[:, :, -1:].expand(-1, -1, tail, -1)], dim=2) if tail else mk
        mk_c = mk_c.reshape(B, H, N, C, Mk)                                               # the tail keeps the last max
        first = mk_c[:, :, :, :1]                                                         # r per chunk
        end = mk_c[:, :, :, -1:]                                                          # R' per chunk
        prev = torch.cat([m0.detach()[:, :, None, None], end[:, :, :-1]], dim=2)          # R per chunk
        lk_cd = _chunks(lk_d, C, N, NO_KEY)
        growth = (lk_cd - first).amax(dim=(-2, -1))                                       # (B, H, N)
        pairwise = growth > limit
    lq_c, c_c = _chunks(lq, C, N, NO_KEY), _chunks(c, C, N, 0.0)      # tail queries: factors exp(-1e30) = 0
    lk_c = _chunks(lk.masked_fill(pad, NO_KEY) if pad is not None else lk, C, N, NO_KEY)
    a_c = None if a is None else _chunks(a, C, N, 0.0)
    if b is not None and pad is not None:
        b = b.masked_fill(pad, 0.0)                                         # NaN there must not reach A @ v
    b_c = None if b is None else _chunks(b, C, N, 0.0)
    vp_c = _chunks(vp, C, N, 0.0)

    def times(x: Tensor, y: Tensor | None) -> Tensor:
        return x if y is None else x * y

    q_inter = times(torch.exp(lq_c + prev - c_c), a_c)                     # (B, H, N, C, M), <= 1
    q_intra = times(torch.exp(lq_c + first - c_c), a_c)                    # <= 1
    k_intra = times(torch.exp(torch.clamp(lk_c - first, max=limit)), b_c)  # <= e^limit (pairwise beyond)
    k_state = times(torch.exp(lk_c - end), b_c)                            # <= 1
    future = torch.ones(C, C, dtype=torch.bool, device=v.device).triu(1)
    A = (q_intra @ k_intra.transpose(-1, -2)).masked_fill(future, 0.0)     # (B, H, N, C, C)
    if torch.compiler.is_compiling():
        # no data-dependent branch in a traced graph: every chunk's block pairwise where needed, by a select
        A = torch.where(pairwise[..., None, None], _pairwise(lq_c, lk_c, c_c, a_c, b_c, future), A)
    elif bool(pairwise.any()):
        idx = pairwise.nonzero(as_tuple=True)
        A = A.index_put(idx, _pairwise(*(None if t is None else t[idx] for t in (lq_c, lk_c, c_c, a_c, b_c)),
                                       future))
    intra = A @ vp_c                                                        # (B, H, N, C, E+1)
    kv = k_state.transpose(-1, -2) @ vp_c                                   # (B, H, N, M, E+1)
    decay = torch.exp(prev - end).squeeze(-2)                               # (B, H, N, Mk), <= 1
    outs = []
    for n in range(N):  # over chunks, not positions
        outs.append(intra[:, :, n] + q_inter[:, :, n] @ Sp)
        Sp = decay[:, :, n, :, None] * Sp + kv[:, :, n]
    out = torch.cat(outs, dim=2)[:, :, :L]
    m_end = mk[:, :, -1]
    return normalize(out[..., :E], out[..., E]), (Sp[..., :E], Sp[..., E], m_end)
